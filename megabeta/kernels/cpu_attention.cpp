// The attention of a stack of query cells over their whole key set (spec §3, §7) as fused CPU
// kernels: the `cpu` attention backend (model/attention/cpu.py), forward and backward.
//
// A cell is one block's queries at one layer. Its key set is its own construction K/V (causal;
// the diagonal is the self slot, score plus b_σ; with a decoding prefix the own keys are longer
// than the queries and query r is own key nk - n + r) and its finished groups: rows [lo, hi) of
// source layer m of the history buffers `[L, B, H_kv, T, d]`, score minus the group's depth
// shift λ_h·(m - l). One online softmax over all of it, tile by tile (flash attention): per
// (cell, batch row, head, tile of 64 queries), tiles of 512 keys, BLAS for the products, AVX2
// vectors (at::vec, Sleef's exp) for the row operations. Nothing per key is kept for backward
// but the output and the log-sum-exp.
//
// Backward, per (cell, batch row, KV head): for every query head it serves and query tile, each
// key tile's P = exp(S - lse) and dS = P ∘ (dO·Vᵀ - D), D = rowsum(dO ∘ O); then
// dQ += scale·dS·K, and dK += scale·dSᵀ·Q, dV += Pᵀ·dO into the own keys' gradients or, for a
// group, straight into the history's gradient buffers (BLAS with beta = 1: in place). One task
// owns its KV head's rows: no two tasks write the same gradient (the cells of a wave read
// disjoint source layers). Per query row it also sums each group's dS (the gradient of the
// group's shift, hence of λ) and the diagonal's (b_σ's).
//
// Document masks (spec §7): each query row may carry a lower bound, the position of the first
// key its document lets it read. Key tiles wholly below a query tile's smallest bound are
// skipped; within a tile the keys below a row's bound are masked (P = 0). The self slot is
// always read, so every row's lse is finite.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
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
  if (m == 0 || n == 0) return;
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  } else {
    dgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
}

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

// x[i] = exp(x[i] - shift); returns Σ x[i] (-inf entries give 0).
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

constexpr int64_t kQueryTile = 64;
constexpr int64_t kKeyTile = 512;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Scratch a thread's tasks reuse: grown to the largest tile a task needs.
template <typename T>
struct Scratch {
  std::vector<T> s, p, acc, m, l;
  void fit(size_t ns, size_t np, size_t nacc, size_t nrows) {
    if (s.size() < ns) s.resize(ns);
    if (p.size() < np) p.resize(np);
    if (acc.size() < nacc) acc.resize(nacc);
    if (m.size() < nrows) m.resize(nrows);
    if (l.size() < nrows) l.resize(nrows);
  }
};

// A `[..., rows, d]` tensor read through its strides; the row stride is BLAS's leading
// dimension (a dimension of size 1 may carry any stride and becomes d).
template <typename T>
struct Rows {
  T* data = nullptr;
  std::vector<int64_t> st;
  Rows() = default;
  explicit Rows(const at::Tensor& t) {
    if (!t.defined() || t.numel() == 0) return;
    data = t.data_ptr<T>();
    st = t.strides().vec();
    if (t.size(-2) == 1) st[st.size() - 2] = t.size(-1);
  }
  int64_t ld() const { return st[st.size() - 2]; }
};

// One finished group of a cell: rows [lo, hi) of source layer `layer`, its index g among the
// cell's groups (the shift's and row sums' column).
struct Group {
  int64_t layer, lo, hi, g;
};

// Everything one call reads, with its geometry: cells of n queries at `starts[i]`, own keys nk
// (nk >= n: query r is own key nk - n + r), heads H, KV heads H_kv, width d.
template <typename T>
struct Call {
  int64_t cells, batch, heads, kv_heads, per_kv, n, nk, dim;
  T scale;
  Rows<T> q, k, v, hk, hv;
  const T* shift = nullptr;  // [cells, G, H]
  std::vector<int64_t> shift_st;
  const T* self_bias = nullptr;  // [cells]
  int64_t self_st = 0;
  const int64_t* lower = nullptr;  // [cells, B, n]
  std::vector<int64_t> lower_st;
  std::vector<int64_t> starts;
  std::vector<std::vector<Group>> groups;

  Call(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& hk_,
       const at::Tensor& hv_, const at::Tensor& shift_, const at::Tensor& self_bias_,
       const at::Tensor& lower_, at::IntArrayRef starts_, at::IntArrayRef groups_, double sc)
      : cells(q_.size(0)), batch(q_.size(1)), heads(q_.size(2)), kv_heads(k_.size(2)),
        per_kv(q_.size(2) / k_.size(2)), n(q_.size(3)), nk(k_.size(3)), dim(q_.size(4)),
        scale(static_cast<T>(sc)), q(q_), k(k_), v(v_), hk(hk_), hv(hv_),
        starts(starts_.begin(), starts_.end()), groups(q_.size(0)) {
    if (shift_.defined() && shift_.numel()) {
      shift = shift_.data_ptr<T>();
      shift_st = shift_.strides().vec();
    }
    if (self_bias_.defined() && self_bias_.numel()) {
      self_bias = self_bias_.data_ptr<T>();
      self_st = self_bias_.stride(0);
    }
    if (lower_.defined() && lower_.numel()) {
      lower = lower_.data_ptr<int64_t>();
      lower_st = lower_.strides().vec();
    }
    for (size_t j = 0; j + 4 < groups_.size(); j += 5) {
      groups[groups_[j]].push_back(Group{groups_[j + 1], groups_[j + 2], groups_[j + 3],
                                         groups_[j + 4]});
    }
  }

  // The document bound of query row r of cell i, batch row b (0: none).
  int64_t bound(int64_t i, int64_t b, int64_t r) const {
    return lower ? lower[i * lower_st[0] + b * lower_st[1] + r * lower_st[2]] : 0;
  }
  int64_t least_bound(int64_t i, int64_t b, int64_t r0, int64_t m) const {
    if (!lower) return 0;
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int64_t r = r0; r < r0 + m; ++r) least = std::min(least, bound(i, b, r));
    return least;
  }
  T shift_of(int64_t i, int64_t g, int64_t h) const {
    return shift ? shift[i * shift_st[0] + g * shift_st[1] + h * shift_st[2]] : T(0);
  }
  const T* qrow(int64_t i, int64_t b, int64_t h, int64_t r) const {
    return q.data + i * q.st[0] + b * q.st[1] + h * q.st[2] + r * q.st[3];
  }
  const T* own(const Rows<T>& t, int64_t i, int64_t b, int64_t hk_, int64_t j) const {
    return t.data + i * t.st[0] + b * t.st[1] + hk_ * t.st[2] + j * t.st[3];
  }
  const T* hist(const Rows<T>& t, int64_t layer, int64_t b, int64_t hk_, int64_t j) const {
    return t.data + layer * t.st[0] + b * t.st[1] + hk_ * t.st[2] + j * t.st[3];
  }

  // The scores of queries [r0, r0 + m) of cell i over one key tile, biased and masked (-inf
  // where hidden), into s [m x nj]: own keys [j0, j0 + nj) when `group` is null, else rows
  // [j0, j0 + nj) of the group.
  void scores(int64_t i, int64_t b, int64_t h, int64_t r0, int m, int64_t j0, int nj,
              const Group* group, T* s) const {
    const int64_t hk_ = h / per_kv;
    const int d = static_cast<int>(dim);
    const T* keys = group ? hist(hk, group->layer, b, hk_, j0) : own(k, i, b, hk_, j0);
    const int ldk = static_cast<int>(group ? hk.ld() : k.ld());
    gemm<T>(false, true, m, nj, d, scale, qrow(i, b, h, r0), static_cast<int>(q.ld()), keys,
            ldk, T(0), s, nj);
    const T inf = std::numeric_limits<T>::infinity();
    if (group) {
      const T bias = shift_of(i, group->g, h);
      for (int r = 0; r < m; ++r) {
        T* row = s + r * nj;
        const int64_t hidden = std::clamp<int64_t>(bound(i, b, r0 + r) - j0, 0, nj);
        for (int c = 0; c < nj; ++c) row[c] = c < hidden ? -inf : row[c] - bias;
      }
      return;
    }
    const int64_t offset = nk - n, start = starts[i];
    const T sb = self_bias ? self_bias[i * self_st] : T(0);
    for (int r = 0; r < m; ++r) {
      T* row = s + r * nj;
      const int64_t me = offset + r0 + r;  // this query's own key
      const int64_t hidden = std::clamp<int64_t>(bound(i, b, r0 + r) - start - j0, 0, nj);
      for (int c = 0; c < nj; ++c) {
        const int64_t j = j0 + c;
        if (c < hidden || j > me) row[c] = -inf;
        else if (j == me) row[c] += sb;
      }
    }
  }

  // The key tiles a query tile reads: own keys first, then each group's rows, from the tile's
  // least bound on. `fn(group or null, j0, nj)`.
  template <typename Fn>
  void tiles(int64_t i, int64_t b, int64_t r0, int m, Fn fn) const {
    const int64_t least = least_bound(i, b, r0, m);
    const int64_t own_end = std::min(nk, nk - n + r0 + m);
    for (int64_t j0 = std::max<int64_t>(0, least - starts[i]); j0 < own_end; j0 += kKeyTile) {
      fn(static_cast<const Group*>(nullptr), j0, static_cast<int>(std::min(kKeyTile, own_end - j0)));
    }
    for (const Group& group : groups[i]) {
      for (int64_t j0 = std::max(group.lo, least); j0 < group.hi; j0 += kKeyTile) {
        fn(&group, j0, static_cast<int>(std::min(kKeyTile, group.hi - j0)));
      }
    }
  }
};

template <typename T>
void forward_task(const Call<T>& call, int64_t i, int64_t b, int64_t h, int64_t r0, Rows<T>& out,
                  T* lse, const std::vector<int64_t>& lse_st, Scratch<T>& sc) {
  const int m = static_cast<int>(std::min(kQueryTile, call.n - r0));
  const int d = static_cast<int>(call.dim);
  sc.fit(m * kKeyTile, 0, m * d, m);
  T *s = sc.s.data(), *acc = sc.acc.data(), *mx = sc.m.data(), *l = sc.l.data();
  const T inf = std::numeric_limits<T>::infinity();
  std::fill(acc, acc + m * d, T(0));
  std::fill(mx, mx + m, -inf);
  std::fill(l, l + m, T(0));
  const int64_t hk_ = h / call.per_kv;
  call.tiles(i, b, r0, m, [&](const Group* group, int64_t j0, int nj) {
    call.scores(i, b, h, r0, m, j0, nj, group, s);
    for (int r = 0; r < m; ++r) {
      T* row = s + r * nj;
      const T tile_max = row_max<T>(row, nj);
      if (tile_max == -inf) {
        std::fill(row, row + nj, T(0));
        continue;
      }
      const T now = std::max(mx[r], tile_max);
      const T alpha = mx[r] == -inf ? T(0) : std::exp(mx[r] - now);
      l[r] = l[r] * alpha + exp_row<T>(row, nj, now);
      mx[r] = now;
      if (alpha != T(1)) {
        T* a = acc + r * d;
        for (int c = 0; c < d; ++c) a[c] *= alpha;
      }
    }
    const T* values = group ? call.hist(call.hv, group->layer, b, hk_, j0)
                            : call.own(call.v, i, b, hk_, j0);
    const int ldv = static_cast<int>(group ? call.hv.ld() : call.v.ld());
    gemm<T>(false, false, m, d, nj, T(1), s, nj, values, ldv, T(1), acc, d);
  });
  for (int r = 0; r < m; ++r) {
    T* o = out.data + i * out.st[0] + b * out.st[1] + h * out.st[2] + (r0 + r) * out.st[3];
    const T inv = T(1) / l[r];
    for (int c = 0; c < d; ++c) o[c] = acc[r * d + c] * inv;
    lse[i * lse_st[0] + b * lse_st[1] + h * lse_st[2] + (r0 + r) * lse_st[3]] =
        mx[r] + std::log(l[r]);
  }
}

template <typename T>
struct Grads {
  Rows<T> grad, out, dq, dk, dv, ghk, ghv;
  const T* lse;
  std::vector<int64_t> lse_st;
  T* rows = nullptr;  // [cells, G, B, H, n]
  std::vector<int64_t> rows_st;
  T* diag = nullptr;  // [cells, B, H, n]
  std::vector<int64_t> diag_st;
};

template <typename T>
void backward_task(const Call<T>& call, const Grads<T>& g, int64_t i, int64_t b, int64_t hk_,
                   Scratch<T>& sc) {
  const int d = static_cast<int>(call.dim);
  const T inf = std::numeric_limits<T>::infinity();
  std::vector<T> delta(kQueryTile);
  for (int64_t h = hk_ * call.per_kv; h < (hk_ + 1) * call.per_kv; ++h) {
    for (int64_t r0 = 0; r0 < call.n; r0 += kQueryTile) {
      const int m = static_cast<int>(std::min(kQueryTile, call.n - r0));
      sc.fit(m * kKeyTile, m * kKeyTile, 0, 0);
      T *s = sc.s.data(), *ds = sc.p.data();
      const T* q = call.qrow(i, b, h, r0);
      const T* go = g.grad.data + i * g.grad.st[0] + b * g.grad.st[1] + h * g.grad.st[2] +
                    r0 * g.grad.st[3];
      T* dq = g.dq.data + i * g.dq.st[0] + b * g.dq.st[1] + h * g.dq.st[2] + r0 * g.dq.st[3];
      const int ldq = static_cast<int>(call.q.ld()), ldg = static_cast<int>(g.grad.ld());
      const int lddq = static_cast<int>(g.dq.ld());
      for (int r = 0; r < m; ++r) {
        const T* o = g.out.data + i * g.out.st[0] + b * g.out.st[1] + h * g.out.st[2] +
                     (r0 + r) * g.out.st[3];
        const T* gr = go + r * g.grad.ld();
        T sum = 0;
        for (int c = 0; c < d; ++c) sum += gr[c] * o[c];
        delta[r] = sum;
      }
      const T* lse = g.lse + i * g.lse_st[0] + b * g.lse_st[1] + h * g.lse_st[2];
      call.tiles(i, b, r0, m, [&](const Group* group, int64_t j0, int nj) {
        call.scores(i, b, h, r0, m, j0, nj, group, s);
        for (int r = 0; r < m; ++r) exp_row<T>(s + r * nj, nj, lse[(r0 + r) * g.lse_st[3]]);
        const T* keys = group ? call.hist(call.hk, group->layer, b, hk_, j0)
                              : call.own(call.k, i, b, hk_, j0);
        const T* values = group ? call.hist(call.hv, group->layer, b, hk_, j0)
                                : call.own(call.v, i, b, hk_, j0);
        const int ldk = static_cast<int>(group ? call.hk.ld() : call.k.ld());
        const int ldv = static_cast<int>(group ? call.hv.ld() : call.v.ld());
        // dP = dO·Vᵀ, then dS = P ∘ (dP - D) in place, with its row sums.
        gemm<T>(false, true, m, nj, d, T(1), go, ldg, values, ldv, T(0), ds, nj);
        for (int r = 0; r < m; ++r) {
          const T sum = score_grad_row<T>(ds + r * nj, s + r * nj, nj, delta[r]);
          if (group && g.rows) {
            g.rows[i * g.rows_st[0] + group->g * g.rows_st[1] + b * g.rows_st[2] +
                   h * g.rows_st[3] + (r0 + r) * g.rows_st[4]] += sum;
          }
          if (!group && g.diag) {
            const int64_t me = call.nk - call.n + r0 + r - j0;
            if (me >= 0 && me < nj) {
              g.diag[i * g.diag_st[0] + b * g.diag_st[1] + h * g.diag_st[2] +
                     (r0 + r) * g.diag_st[3]] += ds[r * nj + me];
            }
          }
        }
        gemm<T>(false, false, m, d, nj, call.scale, ds, nj, keys, ldk, T(1), dq, lddq);
        T* dk = nullptr;
        T* dv = nullptr;
        int lddk = 0, lddv = 0;
        if (group) {
          if (g.ghk.data) {
            const auto& a = g.ghk.st;
            const auto& bb = g.ghv.st;
            dk = g.ghk.data + group->layer * a[0] + b * a[1] + hk_ * a[2] + j0 * a[3];
            dv = g.ghv.data + group->layer * bb[0] + b * bb[1] + hk_ * bb[2] + j0 * bb[3];
            lddk = static_cast<int>(g.ghk.ld());
            lddv = static_cast<int>(g.ghv.ld());
          }
        } else if (g.dk.data) {
          const auto& a = g.dk.st;
          const auto& bb = g.dv.st;
          dk = g.dk.data + i * a[0] + b * a[1] + hk_ * a[2] + j0 * a[3];
          dv = g.dv.data + i * bb[0] + b * bb[1] + hk_ * bb[2] + j0 * bb[3];
          lddk = static_cast<int>(g.dk.ld());
          lddv = static_cast<int>(g.dv.ld());
        }
        if (dk) {
          gemm<T>(true, false, nj, d, m, T(1), s, nj, go, ldg, T(1), dv, lddv);
          gemm<T>(true, false, nj, d, m, call.scale, ds, nj, q, ldq, T(1), dk, lddk);
        }
        (void)inf;
      });
    }
  }
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, "history attention (cpu): ",
              name, " must be a CPU tensor of the queries' dtype, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, "history attention (cpu): ", name,
              " needs a contiguous last dimension");
}

void check_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& hk, const at::Tensor& hv, const at::Tensor& lower,
                at::IntArrayRef starts) {
  TORCH_CHECK(q.dim() == 5 && k.dim() == 5 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  k.size(1) == q.size(1) && k.size(4) == q.size(4) && q.size(2) % k.size(2) == 0 &&
                  k.size(3) >= q.size(3),
              "history attention (cpu): q [cells, B, H, n, d] and k, v [cells, B, H_kv, nk, d] "
              "with nk >= n and H a multiple of H_kv, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "history attention (cpu): float32 or float64 only, got ", q.scalar_type());
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&hk, "hist_k"},
                         {&hv, "hist_v"}}) {
    check_rows(*t, name, q.scalar_type());
  }
  TORCH_CHECK(hk.numel() == 0 || (hk.dim() == 5 && hv.sizes() == hk.sizes() &&
                                  hk.size(1) == q.size(1) && hk.size(2) == k.size(2) &&
                                  hk.size(4) == q.size(4)),
              "history attention (cpu): history buffers [L, B, H_kv, T, d], got ", hk.sizes());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == q.size(0),
              "history attention (cpu): one start per cell");
  TORCH_CHECK(!lower.defined() || lower.numel() == 0 ||
                  (lower.scalar_type() == at::kLong &&
                   lower.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(3)})),
              "history attention (cpu): lower must be int64 [cells, B, n]");
}

// Runs `task(cell, batch row, head)` over every (cell, batch row, head or KV head) in parallel,
// each thread taking the next task when it finishes one: the cells of a wave are of different
// blocks, so their key sets differ in length, and equal shares of the tasks would leave the
// threads with the shorter cells waiting at the end.
template <typename Task>
void parallel(int64_t cells, int64_t batch, int64_t heads, Task task) {
  const int64_t total = cells * batch * heads;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < total; t = next++) {
      task(t / (batch * heads), t / heads % batch, t % heads);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& hist_k,
                                           const at::Tensor& hist_v, const at::Tensor& shift,
                                           const at::Tensor& self_bias, const at::Tensor& lower,
                                           at::IntArrayRef starts, at::IntArrayRef groups,
                                           double scale) {
  check_call(q, k, v, hist_k, hist_v, lower, starts);
  // The output as a transposed view of [cells, B, n, H, d] (the output projection reads the
  // heads side by side).
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(3), q.size(2), q.size(4)},
                             q.options()).transpose(2, 3);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "history_attention_forward", [&] {
    Call<scalar_t> call(q, k, v, hist_k, hist_v, shift, self_bias, lower, starts, groups, scale);
    Rows<scalar_t> o(out);
    scalar_t* l = lse.data_ptr<scalar_t>();
    const std::vector<int64_t> lst = lse.strides().vec();
    const int64_t tiles = (call.n + kQueryTile - 1) / kQueryTile;
    parallel(call.cells, call.batch, call.heads * tiles, [&](int64_t i, int64_t b, int64_t ht) {
      thread_local Scratch<scalar_t> scratch;
      forward_task<scalar_t>(call, i, b, ht / tiles, ht % tiles * kQueryTile, o, l, lst,
                             scratch);
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& hist_k, const at::Tensor& hist_v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& shift, const at::Tensor& self_bias,
    const at::Tensor& lower, const at::Tensor& grad_hist_k, const at::Tensor& grad_hist_v,
    at::IntArrayRef starts, at::IntArrayRef groups, int64_t group_count, double scale) {
  check_call(q, k, v, hist_k, hist_v, lower, starts);
  TORCH_CHECK(k.size(3) == q.size(3), "history attention (cpu): backward for own keys as long "
              "as the queries only (training)");
  for (auto [t, name] : {std::pair{&grad, "grad"}, {&out, "out"}, {&grad_hist_k, "grad_hist_k"},
                         {&grad_hist_v, "grad_hist_v"}}) {
    check_rows(*t, name, q.scalar_type());
  }
  TORCH_CHECK(grad.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "history attention (cpu): grad and out shaped like q");
  TORCH_CHECK(grad_hist_k.numel() == 0 || grad_hist_k.sizes() == hist_k.sizes(),
              "history attention (cpu): gradient buffers shaped like the history");
  at::Tensor dq = at::zeros_like(q);  // laid out like q (the operator's fake says so)
  at::Tensor dk = at::zeros_like(k);
  at::Tensor dv = at::zeros_like(v);
  at::Tensor rows = at::zeros({q.size(0), group_count, q.size(1), q.size(2), q.size(3)},
                              q.options());
  at::Tensor diag = at::zeros({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "history_attention_backward", [&] {
    Call<scalar_t> call(q, k, v, hist_k, hist_v, shift, self_bias, lower, starts, groups, scale);
    Grads<scalar_t> g;
    g.grad = Rows<scalar_t>(grad);
    g.out = Rows<scalar_t>(out);
    g.dq = Rows<scalar_t>(dq);
    g.dk = Rows<scalar_t>(dk);
    g.dv = Rows<scalar_t>(dv);
    g.ghk = Rows<scalar_t>(grad_hist_k);
    g.ghv = Rows<scalar_t>(grad_hist_v);
    g.lse = lse.data_ptr<scalar_t>();
    g.lse_st = lse.strides().vec();
    if (group_count) {
      g.rows = rows.data_ptr<scalar_t>();
      g.rows_st = rows.strides().vec();
    }
    g.diag = diag.data_ptr<scalar_t>();
    g.diag_st = diag.strides().vec();
    parallel(call.cells, call.batch, call.kv_heads, [&](int64_t i, int64_t b, int64_t hk) {
      thread_local Scratch<scalar_t> scratch;
      backward_task<scalar_t>(call, g, i, b, hk, scratch);
    });
  });
  return {dq, dk, dv, rows, diag};
}

}  // namespace

TORCH_LIBRARY(megabeta_cpu, m) {
  m.def("history_attention_forward(Tensor q, Tensor k, Tensor v, Tensor hist_k, Tensor hist_v, "
        "Tensor shift, Tensor self_bias, Tensor lower, int[] starts, int[] groups, "
        "float scale) -> (Tensor, Tensor)");
  m.impl("history_attention_forward", c10::DispatchKey::CPU, &forward);
  m.def("history_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor hist_k, "
        "Tensor hist_v, Tensor out, Tensor lse, Tensor shift, Tensor self_bias, Tensor lower, "
        "Tensor(a!) grad_hist_k, Tensor(b!) grad_hist_v, int[] starts, int[] groups, "
        "int group_count, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("history_attention_backward", c10::DispatchKey::CPU, &backward);
}
