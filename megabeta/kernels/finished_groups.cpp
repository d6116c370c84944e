// A block's attention over its finished groups (merged_attention.py), forward and backward, as
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

template <typename T>
void run_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& keys,
                  const at::Tensor& values, const at::Tensor& lse, const at::Tensor& delta,
                  double scale, at::Tensor& dq, at::Tensor& grad_keys, at::Tensor& grad_values,
                  at::Tensor& row_sums) {
  const int64_t groups = keys.size(0), batch = keys.size(1), kv_heads = keys.size(2);
  const int64_t rows = keys.size(3), dim = keys.size(4);
  const int64_t heads = q.size(1), n = q.size(2), per_kv = heads / kv_heads;
  const T sc = static_cast<T>(scale);
  const T* q_ = q.data_ptr<T>();
  const T* g_ = grad.data_ptr<T>();
  const T* k_ = keys.data_ptr<T>();
  const T* v_ = values.data_ptr<T>();
  const T* lse_ = lse.data_ptr<T>();
  const T* delta_ = delta.data_ptr<T>();
  T* dq_ = dq.data_ptr<T>();
  // Empty key/value gradient buffers: nobody wants those gradients, only dq.
  T* gk_ = grad_keys.numel() ? grad_keys.data_ptr<T>() : nullptr;
  T* gv_ = grad_values.numel() ? grad_values.data_ptr<T>() : nullptr;
  T* rs_ = row_sums.numel() ? row_sums.data_ptr<T>() : nullptr;
  auto rss = row_sums.strides();
  // Strides: queries-like tensors [B, H, n, d], keys-like [G, B, H_kv, R, d]; the last
  // dimension is contiguous (checked by the caller).
  auto qs = row_strides(q), gs = row_strides(grad), dqs = row_strides(dq);
  auto ks = row_strides(keys), vs = row_strides(values);
  auto gks = gk_ ? row_strides(grad_keys) : ks, gvs = gv_ ? row_strides(grad_values) : vs;
  auto ls = lse.strides(), ds = delta.strides();
  const int64_t qt = std::min(n, kQueryTile), kt = std::min(rows, kKeyTile);
  // One (batch, KV head) per task: its query heads and every group add to its own gradients.
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(qt * kt), ds_buf(qt * kt);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, hk = task % kv_heads;
      for (int64_t h = hk * per_kv; h < (hk + 1) * per_kv; ++h) {
        const T* qh = q_ + b * qs[0] + h * qs[1];
        const T* gh = g_ + b * gs[0] + h * gs[1];
        T* dqh = dq_ + b * dqs[0] + h * dqs[1];
        const T* dh = delta_ + b * ds[0] + h * ds[1];
        for (int64_t g = 0; g < groups; ++g) {
          const T* kg = k_ + g * ks[0] + b * ks[1] + hk * ks[2];
          const T* vg = v_ + g * vs[0] + b * vs[1] + hk * vs[2];
          T* gkg = gk_ ? gk_ + g * gks[0] + b * gks[1] + hk * gks[2] : nullptr;
          T* gvg = gv_ ? gv_ + g * gvs[0] + b * gvs[1] + hk * gvs[2] : nullptr;
          const T* lh = lse_ + g * ls[0] + b * ls[1] + h * ls[2];
          T* rh = rs_ ? rs_ + g * rss[0] + b * rss[1] + h * rss[2] : nullptr;
          for (int64_t i0 = 0; i0 < n; i0 += qt) {
            const int mi = static_cast<int>(std::min(qt, n - i0));
            const T* qi = qh + i0 * qs[2];
            const T* gi = gh + i0 * gs[2];
            T* dqi = dqh + i0 * dqs[2];
            for (int64_t j0 = 0; j0 < rows; j0 += kt) {
              const int nj = static_cast<int>(std::min(kt, rows - j0));
              const T* kj = kg + j0 * ks[3];
              const T* vj = vg + j0 * vs[3];
              const int ld = nj, d = static_cast<int>(dim);
              gemm<T>(false, true, mi, nj, d, sc, qi, qs[2], kj, ks[3], T(0), p.data(), ld);
              for (int i = 0; i < mi; ++i) {
                exp_row<T>(p.data() + i * ld, nj, lh[(i0 + i) * ls[3]]);
              }
              gemm<T>(false, true, mi, nj, d, T(1), gi, gs[2], vj, vs[3], T(0), ds_buf.data(),
                      ld);
              for (int i = 0; i < mi; ++i) {
                const T di = dh[(i0 + i) * ds[2]];
                T* dsr = ds_buf.data() + i * ld;
                const T* pr = p.data() + i * ld;
                const T sum = score_grad_row<T>(dsr, pr, nj, di);
                if (rh) rh[(i0 + i) * rss[3]] += sum;
              }
              if (gkg) {
                gemm<T>(true, false, nj, d, mi, T(1), p.data(), ld, gi, gs[2], T(1),
                        gvg + j0 * gvs[3], gvs[3]);
                gemm<T>(true, false, nj, d, mi, sc, ds_buf.data(), ld, qi, qs[2], T(1),
                        gkg + j0 * gks[3], gks[3]);
              }
              gemm<T>(false, false, mi, d, nj, sc, ds_buf.data(), ld, kj, ks[3], T(1), dqi,
                      dqs[2]);
            }
          }
        }
      }
    }
  });
}

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

template <typename T>
void run_forward(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& shift, double scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t groups = keys.size(0), batch = keys.size(1), kv_heads = keys.size(2);
  const int64_t rows = keys.size(3), dim = keys.size(4);
  const int64_t heads = q.size(1), n = q.size(2), per_kv = heads / kv_heads;
  const T* q_ = q.data_ptr<T>();
  const T* k_ = keys.data_ptr<T>();
  const T* v_ = values.data_ptr<T>();
  const T* shift_ = shift.data_ptr<T>();
  T* out_ = out.data_ptr<T>();
  T* lse_ = lse.data_ptr<T>();
  auto qs = row_strides(q), ks = row_strides(keys), vs = row_strides(values),
       os = row_strides(out);
  auto ls = lse.strides(), ss = shift.strides();
  const int64_t kt = std::min(rows, kKeyTile);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(n * kt), o(n * dim), maxima(n), sums(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads, hk = h / per_kv;
      const T* qh = q_ + b * qs[0] + h * qs[1];
      T* oh = out_ + b * os[0] + h * os[1];
      T* lh = lse_ + b * ls[0] + h * ls[1];
      const int d = static_cast<int>(dim), mi = static_cast<int>(n);
      for (int64_t g = 0; g < groups; ++g) {
        const T bias = shift_[g * ss[0] + h * ss[1]];
        const T* kg = k_ + g * ks[0] + b * ks[1] + hk * ks[2];
        const T* vg = v_ + g * vs[0] + b * vs[1] + hk * vs[2];
        for (int64_t j0 = 0; j0 < rows; j0 += kt) {
          const int nj = static_cast<int>(std::min(kt, rows - j0)), ld = nj;
          gemm<T>(false, true, mi, nj, d, T(scale), qh, qs[2], kg + j0 * ks[3], ks[3], T(0),
                  p.data(), ld);
          for (int i = 0; i < mi; ++i) {
            T* pr = p.data() + i * ld;
            maxima[i] = row_max<T>(pr, nj);
            sums[i] = exp_row<T>(pr, nj, maxima[i]);
          }
          gemm<T>(false, false, mi, d, nj, T(1), p.data(), ld, vg + j0 * vs[3], vs[3], T(0),
                  o.data(), d);
          // Merge the tile (unnormalized output o, log-sum m + log Σp - bias) into the
          // running normalized output and lse.
          for (int i = 0; i < mi; ++i) {
            T* li = lh + i * ls[2];
            const T tile = maxima[i] + std::log(sums[i]) - bias;
            const T merged = std::max(*li, tile) +
                             std::log1p(std::exp(-std::abs(*li - tile)));
            const T keep = std::exp(*li - merged), add = std::exp(maxima[i] - bias - merged);
            T* oi = oh + i * os[2];
            const T* ti = o.data() + i * d;
            for (int c = 0; c < d; ++c) oi[c] = oi[c] * keep + ti[c] * add;
            *li = merged;
          }
        }
      }
    }
  });
}

void finished_groups_forward(const at::Tensor& q, const at::Tensor& keys,
                             const at::Tensor& values, const at::Tensor& shift, double scale,
                             at::Tensor out, at::Tensor lse) {
  check(q, keys, values, {&q, &keys, &values, &out}, {&shift, &lse});
  check_shape(out, q.sizes(), "out");
  check_shape(lse, q.sizes().slice(0, 3), "lse");
  check_shape(shift, {keys.size(0), q.size(1)}, "shift");
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "finished_groups_forward", [&] {
    run_forward<scalar_t>(q, keys, values, shift, scale, out, lse);
  });
}

void finished_groups_backward(const at::Tensor& grad, const at::Tensor& q,
                              const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& lse, const at::Tensor& delta, double scale,
                              at::Tensor dq, at::Tensor grad_keys, at::Tensor grad_values,
                              at::Tensor row_sums) {
  TORCH_CHECK(grad_keys.numel() == grad_values.numel(),
              "finished groups: grad_keys and grad_values both given or both empty");
  check(q, keys, values, {&q, &grad, &keys, &values, &dq}, {&lse, &delta, &row_sums});
  check_shape(grad, q.sizes(), "grad");
  check_shape(dq, q.sizes(), "dq");
  if (grad_keys.numel()) {
    check(q, keys, values, {&grad_keys, &grad_values}, {});
    check_shape(grad_keys, keys.sizes(), "grad_keys");
    check_shape(grad_values, keys.sizes(), "grad_values");
  }
  check_shape(delta, q.sizes().slice(0, 3), "delta");
  const std::vector<int64_t> per_group{keys.size(0), q.size(0), q.size(1), q.size(2)};
  check_shape(lse, per_group, "lse");
  if (row_sums.numel()) check_shape(row_sums, per_group, "row_sums");
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "finished_groups_backward", [&] {
    run_backward<scalar_t>(grad, q, keys, values, lse, delta, scale, dq, grad_keys, grad_values,
                           row_sums);
  });
}

}  // namespace

TORCH_LIBRARY(megabeta, m) {
  m.def("finished_groups_forward(Tensor q, Tensor keys, Tensor values, Tensor shift, "
        "float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.impl("finished_groups_forward", c10::DispatchKey::CPU, &finished_groups_forward);
  m.def("finished_groups_backward(Tensor grad, Tensor q, Tensor keys, Tensor values, "
        "Tensor lse, Tensor delta, float scale, Tensor(a!) dq, Tensor(b!) grad_keys, "
        "Tensor(c!) grad_values, Tensor(d!) row_sums) -> ()");
  m.impl("finished_groups_backward", c10::DispatchKey::CPU, &finished_groups_backward);
}
