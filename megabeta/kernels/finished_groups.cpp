// A block's attention over its finished groups (model/attention/merged.py, `merged_attention`), forward and backward, as
// fused CPU kernels.
//
// Forward: per (batch, head), attention over every group's keys, each group's scores shifted
// by its depth bias (spec §3), merged by log-sum-exp into the block's own-key output and lse
// that the caller passes in: one pass, no per-group outputs, no repeated queries.
//
// Backward: ATen's flash backward returns freshly zero-filled dK/dV for all history rows of
// every group, which the caller then adds into the history's gradient buffer: four memory
// passes over O(T²/c) numbers per layer that this kernel replaces with BLAS calls whose
// beta = 1 adds in place. Per (batch, KV head) and tile of queries x keys, for each group g
// (its depth bias folded into the shifted lse):
//   P  = exp(Q·Kᵀ·scale - lse_g)         (the group's exact share of the merged softmax)
//   dS = P ∘ (dO·Vᵀ - D),   D = rowsum(dO ∘ O)
//   dV_g += Pᵀ·dO,   dK_g += scale·dSᵀ·Q,   dQ += scale·dS·K_g,   rows_g += rowsum(dS)
// (rows_g: the gradient of group g's score shift, which the depth bias's gradient reads).
// Given empty key/value gradient buffers (nobody wants them), only dQ and rows_g.
// The tiles keep P and dS in cache, as the flash kernels do.
//
// Document masks (spec §7): each query row r of a block may carry a lower bound, the position of
// the first key its document lets it read. Keys of a query tile below its smallest bound are
// never read (the key loop starts there: whole tiles skipped, forward and backward), and the
// keys of a tile below a row's own bound are masked (-inf scores, so P = 0). A row that reads
// no key of a tile leaves the merged output and lse as they were: a part all masked is the
// empty part (lse -inf), never NaN; the merged lse stays finite (the self slot is always read).
//
// One call serves several query blocks (a wave's cells, or one block), each with a list of
// stacks of groups: the tasks of all blocks run in one parallel loop.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

extern "C" {
// BLAS (column-major, 32-bit integers), exported by libtorch_cpu's MKL.
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc);
}

namespace {

// Row-major C[m x n] = alpha·op(A)·op(B) + beta·C, op(A) being m x k: BLAS computes the
// column-major transpose, Cᵀ = op(B)ᵀ·op(A)ᵀ.
template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
          const T* b, int ldb, T beta, T* c, int ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  } else {
    dgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
}

// Row operations on a score tile: AVX2 vectors (at::vec; its exp is Sleef's) and a scalar tail.
template <typename T>
T row_max(const T* x, int n) {
  using V = at::vec::Vectorized<T>;
  int i = 0;
  T m = -std::numeric_limits<T>::infinity();
  if (n >= V::size()) {
    V acc = V::loadu(x);
    for (i = V::size(); i + V::size() <= n; i += V::size()) {
      acc = at::vec::maximum(acc, V::loadu(x + i));
    }
    m = at::vec::vec_reduce_all<T>([](V& a, V& b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = exp(x[i] - shift); returns Σ x[i].
template <typename T>
T exp_row(T* x, int n, T shift) {
  using V = at::vec::Vectorized<T>;
  const V h(shift);
  V acc(T(0));
  int i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    V e = (V::loadu(x + i) - h).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  T sum = at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += x[i] = std::exp(x[i] - shift);
  return sum;
}

// ds[i] = p[i]·(ds[i] - d) (the score gradient); returns Σ ds[i].
template <typename T>
T score_grad_row(T* ds, const T* p, int n, T d) {
  using V = at::vec::Vectorized<T>;
  const V dv(d);
  V acc(T(0));
  int i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    V g = V::loadu(p + i) * (V::loadu(ds + i) - dv);
    g.store(ds + i);
    acc = acc + g;
  }
  T sum = at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += ds[i] = p[i] * (ds[i] - d);
  return sum;
}

// Strides of a tensor read as rows of d numbers; the rows' stride (the second-to-last) is
// BLAS's leading dimension: where that dimension has size 1 it may carry any stride and is
// never stepped over, so it becomes d.
std::vector<int64_t> row_strides(const at::Tensor& t) {
  std::vector<int64_t> s(t.strides().begin(), t.strides().end());
  if (t.size(-2) == 1) s[s.size() - 2] = t.size(-1);
  return s;
}

constexpr int64_t kQueryTile = 64;
constexpr int64_t kKeyTile = 512;

// Scratch a thread's tasks reuse: grown to the largest tile a task needs.
template <typename T>
struct Scratch {
  std::vector<T> a, b, c, d;
  void fit(size_t na, size_t nb, size_t nc, size_t nd) {
    if (a.size() < na) a.resize(na);
    if (b.size() < nb) b.resize(nb);
    if (c.size() < nc) c.resize(nc);
    if (d.size() < nd) d.resize(nd);
  }
};

// One stack of groups `keys/values [g, B, H_kv, R, d]` read by one query block `q [B, H, n, d]`
// (the caller's `cells` says which): pointers and strides, read as rows of d numbers.
// With `lower` (`[B, n]` int64, or undefined: no document mask) and `first`, the position of
// the stack's first row: which keys each query row reads (spec §7).
template <typename T>
struct Groups {
  int64_t groups, batch, kv_heads, rows, dim, heads, n, per_kv;
  const T* q_;
  const T* k_;
  const T* v_;
  std::vector<int64_t> qs, ks, vs;
  const int64_t* lower_;
  int64_t first;
  std::vector<int64_t> lows;

  Groups(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
         const at::Tensor& lower, int64_t first_row)
      : groups(keys.size(0)), batch(keys.size(1)), kv_heads(keys.size(2)), rows(keys.size(3)),
        dim(keys.size(4)), heads(q.size(1)), n(q.size(2)), per_kv(q.size(1) / keys.size(2)),
        q_(q.data_ptr<T>()), k_(keys.data_ptr<T>()), v_(values.data_ptr<T>()),
        qs(row_strides(q)), ks(row_strides(keys)), vs(row_strides(values)),
        lower_(lower.defined() ? lower.data_ptr<int64_t>() : nullptr), first(first_row),
        lows(lower.defined() ? lower.strides().vec() : std::vector<int64_t>{0, 0}) {}

  // The stack's rows that query row i of batch row b may not read: [0, masked(b, i)).
  int64_t masked(int64_t b, int64_t i) const {
    if (!lower_) return 0;
    return std::clamp(lower_[b * lows[0] + i * lows[1]] - first, int64_t(0), rows);
  }

  // The first row any of queries [i0, i0 + m) reads: the key loop starts there.
  int64_t first_read(int64_t b, int64_t i0, int64_t m) const {
    if (!lower_) return 0;
    int64_t least = rows;
    for (int64_t i = i0; i < i0 + m; ++i) least = std::min(least, masked(b, i));
    return least;
  }

  // How many leading keys of the tile from row j0, `nj` wide, query row i (batch row b) may
  // not read (nj: none it may). Their weights are zeroed, not exp'd from -inf scores.
  int masked_in_tile(int64_t b, int64_t i, int64_t j0, int nj) const {
    return static_cast<int>(std::clamp<int64_t>(masked(b, i) - j0, 0, nj));
  }
};

template <typename T>
struct ForwardItem : Groups<T> {
  const T* shift_;
  T* out_;
  T* lse_;
  std::vector<int64_t> os, ls, ss;

  ForwardItem(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
              const at::Tensor& shift, const at::Tensor& out, const at::Tensor& lse,
              const at::Tensor& lower, int64_t first)
      : Groups<T>(q, keys, values, lower, first), shift_(shift.data_ptr<T>()), out_(out.data_ptr<T>()),
        lse_(lse.data_ptr<T>()), os(row_strides(out)), ls(lse.strides().vec()),
        ss(shift.strides().vec()) {}

  // Query head h of batch row b: every group merged into its output and lse.
  void run(int64_t b, int64_t h, double scale, Scratch<T>& s) const {
    const int64_t kt = std::min(this->rows, kKeyTile), n = this->n, dim = this->dim;
    s.fit(n * kt, n * dim, n, n);
    T *p = s.a.data(), *o = s.b.data(), *maxima = s.c.data(), *sums = s.d.data();
    const int64_t hk = h / this->per_kv;
    const T* qh = this->q_ + b * this->qs[0] + h * this->qs[1];
    T* oh = out_ + b * os[0] + h * os[1];
    T* lh = lse_ + b * ls[0] + h * ls[1];
    const int d = static_cast<int>(dim), mi = static_cast<int>(n);
    const int64_t from = this->first_read(b, 0, n);
    for (int64_t g = 0; g < this->groups; ++g) {
      const T bias = shift_[g * ss[0] + h * ss[1]];
      const T* kg = this->k_ + g * this->ks[0] + b * this->ks[1] + hk * this->ks[2];
      const T* vg = this->v_ + g * this->vs[0] + b * this->vs[1] + hk * this->vs[2];
      for (int64_t j0 = from; j0 < this->rows; j0 += kt) {
        const int nj = static_cast<int>(std::min(kt, this->rows - j0)), ld = nj;
        gemm<T>(false, true, mi, nj, d, T(scale), qh, this->qs[2], kg + j0 * this->ks[3],
                this->ks[3], T(0), p, ld);
        for (int i = 0; i < mi; ++i) {
          T* pr = p + i * ld;
          const int below = this->masked_in_tile(b, i, j0, nj);
          std::fill(pr, pr + below, T(0));
          if (below == nj) {
            // Nothing of this tile for the row (lse -inf): the merge below skips it.
            maxima[i] = -std::numeric_limits<T>::infinity();
            continue;
          }
          maxima[i] = row_max<T>(pr + below, nj - below);
          sums[i] = exp_row<T>(pr + below, nj - below, maxima[i]);
        }
        gemm<T>(false, false, mi, d, nj, T(1), p, ld, vg + j0 * this->vs[3], this->vs[3], T(0),
                o, d);
        // Merge the tile (unnormalized output o, log-sum m + log Σp - bias) into the
        // running normalized output and lse.
        for (int i = 0; i < mi; ++i) {
          if (maxima[i] == -std::numeric_limits<T>::infinity()) continue;
          T* li = lh + i * ls[2];
          const T tile = maxima[i] + std::log(sums[i]) - bias;
          const T merged = std::max(*li, tile) + std::log1p(std::exp(-std::abs(*li - tile)));
          const T keep = std::exp(*li - merged), add = std::exp(maxima[i] - bias - merged);
          T* oi = oh + i * os[2];
          const T* ti = o + i * d;
          for (int c = 0; c < d; ++c) oi[c] = oi[c] * keep + ti[c] * add;
          *li = merged;
        }
      }
    }
  }
};

template <typename T>
struct BackwardItem : Groups<T> {
  const T* g_;
  const T* lse_;
  const T* delta_;
  T* dq_;
  T* gk_;
  T* gv_;
  T* rs_;
  std::vector<int64_t> gs, dqs, gks, gvs, ls, ds, rss;

  BackwardItem(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys,
               const at::Tensor& values, const at::Tensor& lse, const at::Tensor& delta,
               const at::Tensor& dq, const at::Tensor& grad_keys, const at::Tensor& grad_values,
               const at::Tensor& row_sums, const at::Tensor& lower, int64_t first)
      : Groups<T>(q, keys, values, lower, first), g_(grad.data_ptr<T>()), lse_(lse.data_ptr<T>()),
        delta_(delta.data_ptr<T>()), dq_(dq.data_ptr<T>()),
        // Empty key/value gradient buffers: nobody wants those gradients, only dq.
        gk_(grad_keys.numel() ? grad_keys.data_ptr<T>() : nullptr),
        gv_(grad_values.numel() ? grad_values.data_ptr<T>() : nullptr),
        rs_(row_sums.numel() ? row_sums.data_ptr<T>() : nullptr), gs(row_strides(grad)),
        dqs(row_strides(dq)), gks(gk_ ? row_strides(grad_keys) : this->ks),
        gvs(gv_ ? row_strides(grad_values) : this->vs), ls(lse.strides().vec()),
        ds(delta.strides().vec()), rss(row_sums.strides().vec()) {}

  // KV head hk of batch row b: its query heads and every group add to its own gradients.
  void run(int64_t b, int64_t hk, double scale, Scratch<T>& s) const {
    const int64_t n = this->n, rows = this->rows;
    const int64_t qt = std::min(n, kQueryTile), kt = std::min(rows, kKeyTile);
    s.fit(qt * kt, qt * kt, 0, 0);
    T *p = s.a.data(), *ds_buf = s.b.data();
    const T sc = static_cast<T>(scale);
    const auto &qs = this->qs, &ks = this->ks, &vs = this->vs;
    for (int64_t h = hk * this->per_kv; h < (hk + 1) * this->per_kv; ++h) {
      const T* qh = this->q_ + b * qs[0] + h * qs[1];
      const T* gh = g_ + b * gs[0] + h * gs[1];
      T* dqh = dq_ + b * dqs[0] + h * dqs[1];
      const T* dh = delta_ + b * ds[0] + h * ds[1];
      for (int64_t g = 0; g < this->groups; ++g) {
        const T* kg = this->k_ + g * ks[0] + b * ks[1] + hk * ks[2];
        const T* vg = this->v_ + g * vs[0] + b * vs[1] + hk * vs[2];
        T* gkg = gk_ ? gk_ + g * gks[0] + b * gks[1] + hk * gks[2] : nullptr;
        T* gvg = gv_ ? gv_ + g * gvs[0] + b * gvs[1] + hk * gvs[2] : nullptr;
        const T* lh = lse_ + g * ls[0] + b * ls[1] + h * ls[2];
        T* rh = rs_ ? rs_ + g * rss[0] + b * rss[1] + h * rss[2] : nullptr;
        for (int64_t i0 = 0; i0 < n; i0 += qt) {
          const int mi = static_cast<int>(std::min(qt, n - i0));
          const T* qi = qh + i0 * qs[2];
          const T* gi = gh + i0 * gs[2];
          T* dqi = dqh + i0 * dqs[2];
          for (int64_t j0 = this->first_read(b, i0, mi); j0 < rows; j0 += kt) {
            const int nj = static_cast<int>(std::min(kt, rows - j0));
            const T* kj = kg + j0 * ks[3];
            const T* vj = vg + j0 * vs[3];
            const int ld = nj, d = static_cast<int>(this->dim);
            gemm<T>(false, true, mi, nj, d, sc, qi, qs[2], kj, ks[3], T(0), p, ld);
            for (int i = 0; i < mi; ++i) {
              // P = 0 on masked keys: dS, and every gradient they feed, gets nothing there.
              T* pr = p + i * ld;
              const int below = this->masked_in_tile(b, i0 + i, j0, nj);
              std::fill(pr, pr + below, T(0));
              exp_row<T>(pr + below, nj - below, lh[(i0 + i) * ls[3]]);
            }
            gemm<T>(false, true, mi, nj, d, T(1), gi, gs[2], vj, vs[3], T(0), ds_buf, ld);
            for (int i = 0; i < mi; ++i) {
              const T sum = score_grad_row<T>(ds_buf + i * ld, p + i * ld, nj,
                                              dh[(i0 + i) * ds[2]]);
              if (rh) rh[(i0 + i) * rss[3]] += sum;
            }
            if (gkg) {
              gemm<T>(true, false, nj, d, mi, T(1), p, ld, gi, gs[2], T(1), gvg + j0 * gvs[3],
                      gvs[3]);
              gemm<T>(true, false, nj, d, mi, sc, ds_buf, ld, qi, qs[2], T(1),
                      gkg + j0 * gks[3], gks[3]);
            }
            gemm<T>(false, false, mi, d, nj, sc, ds_buf, ld, kj, ks[3], T(1), dqi, dqs[2]);
          }
        }
      }
    }
  }
};

// Shapes (q [B, H, n, d], keys [g, B, H_kv, R, d]), dtypes and layouts. `rows`: tensors read
// as rows of d numbers (a contiguous last dimension); `other`: tensors indexed element by
// element through their strides.
void check(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
           std::initializer_list<const at::Tensor*> rows,
           std::initializer_list<const at::Tensor*> other) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 5 && values.sizes() == keys.sizes() &&
                  keys.size(1) == q.size(0) && keys.size(4) == q.size(3) &&
                  q.size(1) % keys.size(2) == 0,
              "finished groups: queries [B, H, n, d] and keys/values [g, B, H_kv, R, d] with H "
              "a multiple of H_kv, got ", q.sizes(), " and ", keys.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "finished groups: float32 or float64 only");
  for (auto list : {rows, other}) {
    for (const at::Tensor* t : list) {
      TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device().is_cpu(),
                  "finished groups: every tensor on the CPU in the queries' dtype");
    }
  }
  for (const at::Tensor* t : rows) {
    TORCH_CHECK(t->stride(-1) == 1 && (t->size(-2) == 1 || t->stride(-2) >= t->size(-1)),
                "finished groups: q, grad, out, dq, keys, values and their gradients need a "
                "contiguous last dimension and non-overlapping rows");
  }
}

void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* name) {
  TORCH_CHECK(t.sizes() == expected, "finished groups: ", name, " must be ", expected, ", got ",
              t.sizes());
}

// Document bounds (spec §7): none (both lists empty), or `lower [B, n]` int64 per query block
// and the first row's position per stack. Returns query block i's bounds (undefined: none).
std::vector<at::Tensor> document_bounds(at::TensorList lower, at::IntArrayRef first,
                                        at::TensorList q, size_t stacks) {
  std::vector<at::Tensor> bounds(q.size());
  if (lower.empty() && first.empty()) return bounds;
  TORCH_CHECK(lower.size() == q.size() && first.size() == stacks,
              "finished groups: document bounds need lower [B, n] per query block and first "
              "per stack of groups (or neither), got ", lower.size(), " and ", first.size(),
              " for ", q.size(), " query blocks and ", stacks, " stacks");
  for (size_t i = 0; i < q.size(); ++i) {
    TORCH_CHECK(lower[i].scalar_type() == at::kLong && lower[i].device().is_cpu(),
                "finished groups: lower must be int64 on the CPU, got ", lower[i].scalar_type());
    if (q[i].dim() == 4) check_shape(lower[i], {q[i].size(0), q[i].size(2)}, "lower");
    bounds[i] = lower[i];
  }
  return bounds;
}

// `cells[j]`: the query block that stack j of groups belongs to, non-decreasing, < blocks.
void check_cells(at::IntArrayRef cells, size_t stacks, size_t blocks) {
  TORCH_CHECK(cells.size() == stacks, "finished groups: one cell index per stack of groups, got ",
              cells.size(), " for ", stacks);
  for (size_t j = 0; j < cells.size(); ++j) {
    TORCH_CHECK(cells[j] >= 0 && static_cast<size_t>(cells[j]) < blocks &&
                    (j == 0 || cells[j] >= cells[j - 1]),
                "finished groups: cell indices must be non-decreasing query block indices");
  }
}

// Runs `task(stack, b, head)` for every query block's (batch row, head) pair, `heads_of(block)`
// heads each, in parallel; a task runs the block's stacks in order, so each output is formed
// as by one call per stack. Different query blocks must write disjoint gradients (a wave's
// cells read different source layers). The tasks are split among the threads by their work
// (queries x groups x rows): a wave's cells read different numbers of groups.
template <typename Heads, typename Task>
void for_each_head(at::IntArrayRef cells, at::TensorList q, at::TensorList keys, Heads heads_of,
                   Task task) {
  const size_t blocks = q.size();
  std::vector<int64_t> first(blocks + 1, static_cast<int64_t>(cells.size()));
  std::vector<double> work(blocks, 0.0);
  for (int64_t j = static_cast<int64_t>(cells.size()) - 1; j >= 0; --j) {
    first[cells[j]] = j;
    work[cells[j]] += static_cast<double>(keys[j].size(0) * keys[j].size(3));
  }
  for (int64_t i = static_cast<int64_t>(blocks) - 1; i >= 0; --i) {
    first[i] = std::min(first[i], first[i + 1]);
  }
  // Tasks in order (block, batch row, head); `before[t]`: the work of the tasks before t.
  std::vector<int64_t> offset(blocks + 1, 0);
  for (size_t i = 0; i < blocks; ++i) {
    offset[i + 1] = offset[i] + (q[i].dim() == 4 ? q[i].size(0) * heads_of(i) : 0);
  }
  const int64_t tasks = offset[blocks];
  std::vector<double> before(tasks + 1, 0.0);
  for (size_t i = 0, t = 0; i < blocks; ++i) {
    const double each = work[i] * (q[i].dim() == 4 ? q[i].size(2) : 0);
    for (; static_cast<int64_t>(t) < offset[i + 1]; ++t) before[t + 1] = before[t] + each;
  }
  if (tasks == 0 || before[tasks] == 0) return;
  const int64_t parts = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      // This part's tasks: those whose preceding work falls in its share.
      const double lo = before[tasks] * part / parts, hi = before[tasks] * (part + 1) / parts;
      const int64_t t0 = std::lower_bound(before.begin(), before.end() - 1, lo) - before.begin();
      const int64_t t1 = part + 1 == parts ? tasks
          : std::lower_bound(before.begin(), before.end() - 1, hi) - before.begin();
      for (int64_t t = t0; t < t1; ++t) {
        const size_t i = std::upper_bound(offset.begin(), offset.end(), t) - offset.begin() - 1;
        const int64_t local = t - offset[i], heads = heads_of(i);
        for (int64_t j = first[i]; j < first[i + 1]; ++j) task(j, local / heads, local % heads);
      }
    }
  });
}

void finished_groups_forward(at::TensorList q, at::TensorList keys, at::TensorList values,
                             at::TensorList shift, at::IntArrayRef cells, double scale,
                             at::TensorList out, at::TensorList lse, at::TensorList lower,
                             at::IntArrayRef first) {
  TORCH_CHECK(out.size() == q.size() && lse.size() == q.size() && keys.size() == values.size() &&
                  shift.size() == keys.size(),
              "finished groups: q, out, lse one per query block; keys, values, shift one per "
              "stack of groups");
  check_cells(cells, keys.size(), q.size());
  for (size_t j = 0; j < keys.size(); ++j) {
    const at::Tensor& qi = q[cells[j]];
    check(qi, keys[j], values[j], {&qi, &keys[j], &values[j], &out[cells[j]]},
          {&shift[j], &lse[cells[j]]});
    check_shape(out[cells[j]], qi.sizes(), "out");
    check_shape(lse[cells[j]], qi.sizes().slice(0, 3), "lse");
    check_shape(shift[j], {keys[j].size(0), qi.size(1)}, "shift");
  }
  const std::vector<at::Tensor> bounds = document_bounds(lower, first, q, keys.size());
  if (keys.empty()) return;
  AT_DISPATCH_FLOATING_TYPES(q[0].scalar_type(), "finished_groups_forward", [&] {
    std::vector<ForwardItem<scalar_t>> items;
    for (size_t j = 0; j < keys.size(); ++j) {
      items.emplace_back(q[cells[j]], keys[j], values[j], shift[j], out[cells[j]],
                         lse[cells[j]], bounds[cells[j]], first.empty() ? 0 : first[j]);
    }
    auto heads = [&](size_t i) { return q[i].size(1); };
    for_each_head(cells, q, keys, heads, [&](int64_t j, int64_t b, int64_t h) {
      thread_local Scratch<scalar_t> scratch;
      items[j].run(b, h, scale, scratch);
    });
  });
}

void finished_groups_backward(at::TensorList grad, at::TensorList q, at::TensorList keys,
                              at::TensorList values, at::TensorList lse, at::TensorList delta,
                              at::IntArrayRef cells, double scale, at::TensorList dq,
                              at::TensorList grad_keys, at::TensorList grad_values,
                              at::TensorList row_sums, at::TensorList lower,
                              at::IntArrayRef first) {
  TORCH_CHECK(grad.size() == q.size() && delta.size() == q.size() && dq.size() == q.size() &&
                  values.size() == keys.size() && lse.size() == keys.size() &&
                  grad_keys.size() == keys.size() && grad_values.size() == keys.size() &&
                  row_sums.size() == keys.size(),
              "finished groups: grad, q, delta, dq one per query block; keys, values, lse, "
              "grad_keys, grad_values, row_sums one per stack of groups");
  check_cells(cells, keys.size(), q.size());
  std::vector<int64_t> kv_heads(q.size(), 1);
  for (size_t j = 0; j < keys.size(); ++j) {
    const at::Tensor& qi = q[cells[j]];
    TORCH_CHECK(grad_keys[j].numel() == grad_values[j].numel(),
                "finished groups: grad_keys and grad_values both given or both empty");
    check(qi, keys[j], values[j], {&qi, &grad[cells[j]], &keys[j], &values[j], &dq[cells[j]]},
          {&lse[j], &delta[cells[j]], &row_sums[j]});
    check_shape(grad[cells[j]], qi.sizes(), "grad");
    check_shape(dq[cells[j]], qi.sizes(), "dq");
    if (grad_keys[j].numel()) {
      check(qi, keys[j], values[j], {&grad_keys[j], &grad_values[j]}, {});
      check_shape(grad_keys[j], keys[j].sizes(), "grad_keys");
      check_shape(grad_values[j], keys[j].sizes(), "grad_values");
    }
    check_shape(delta[cells[j]], qi.sizes().slice(0, 3), "delta");
    const std::vector<int64_t> per_group{keys[j].size(0), qi.size(0), qi.size(1), qi.size(2)};
    check_shape(lse[j], per_group, "lse");
    if (row_sums[j].numel()) check_shape(row_sums[j], per_group, "row_sums");
    TORCH_CHECK(j == 0 || cells[j] != cells[j - 1] || keys[j].size(2) == keys[j - 1].size(2),
                "finished groups: one query block's stacks have the same KV heads");
    kv_heads[cells[j]] = keys[j].size(2);
  }
  const std::vector<at::Tensor> bounds = document_bounds(lower, first, q, keys.size());
  if (keys.empty()) return;
  AT_DISPATCH_FLOATING_TYPES(q[0].scalar_type(), "finished_groups_backward", [&] {
    std::vector<BackwardItem<scalar_t>> items;
    for (size_t j = 0; j < keys.size(); ++j) {
      items.emplace_back(grad[cells[j]], q[cells[j]], keys[j], values[j], lse[j],
                         delta[cells[j]], dq[cells[j]], grad_keys[j], grad_values[j],
                         row_sums[j], bounds[cells[j]], first.empty() ? 0 : first[j]);
    }
    auto heads = [&](size_t i) { return kv_heads[i]; };
    for_each_head(cells, q, keys, heads, [&](int64_t j, int64_t b, int64_t hk) {
      thread_local Scratch<scalar_t> scratch;
      items[j].run(b, hk, scale, scratch);
    });
  });
}

}  // namespace

TORCH_LIBRARY(megabeta, m) {
  m.def("finished_groups_forward(Tensor[] q, Tensor[] keys, Tensor[] values, Tensor[] shift, "
        "int[] cells, float scale, Tensor(a!)[] out, Tensor(b!)[] lse, Tensor[] lower, "
        "int[] first) -> ()");
  m.impl("finished_groups_forward", c10::DispatchKey::CPU, &finished_groups_forward);
  m.def("finished_groups_backward(Tensor[] grad, Tensor[] q, Tensor[] keys, Tensor[] values, "
        "Tensor[] lse, Tensor[] delta, int[] cells, float scale, Tensor(a!)[] dq, "
        "Tensor(b!)[] grad_keys, Tensor(c!)[] grad_values, Tensor(d!)[] row_sums, "
        "Tensor[] lower, int[] first) -> ()");
  m.impl("finished_groups_backward", c10::DispatchKey::CPU, &finished_groups_backward);
}
