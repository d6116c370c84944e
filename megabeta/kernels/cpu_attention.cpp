// The attention of a stack of query cells over their whole key set (spec §3, §7) as fused CPU
// kernels: the `cpu` attention backend (model/attention/cpu.py), forward and backward.
//
// A cell is one block's queries at one layer. Its key set is its own construction K/V (causal;
// the diagonal is the self slot, score plus b_σ; with a decoding prefix the own keys are longer
// than the queries and query r is own key nk - n + r) and its finished groups: rows [lo, hi) of
// source layer m of the history buffers `[L, B, H_kv, T, d]`, score minus the group's depth
// shift λ_h·(m - l). One online softmax over all of it, tile by tile (flash attention): per
// (cell, batch row, head, tile of queries), tiles of 128 keys. Nothing per key is kept for
// backward but the output and the log-sum-exp.
//
// The products are register-blocked vector loops (at::vec), not BLAS: a beta_1.2 cell has only
// c = 32 queries a head, and BLAS copied each cold K/V tile into its panels for 32 rows. The
// source builds for AVX2 or AVX-512 (cpu_attention.py picks by the CPU); the vector width sets
// the tiles' shapes (`Lanes`). A query tile lies across the lanes of the vectors that hold 32
// float32 queries (four AVX2 or two AVX-512 vectors; one vector where the cells are that short,
// as in decoding), and scores, probabilities and their gradients are held key by
// key, `[keys][queries]`: S = K·Qᵀ and dP = V·dOᵀ take a key row's scalars against the
// queries' vectors, O += P·V and dQ += dS·K take a feature column's, and the softmax's row
// operations (max, exp with Sleef, rescale) are vector operations across queries.
//
// Backward, per (cell, batch row, KV head): for every query head it serves and query tile, each
// key tile's P = exp(S - lse) and dS = P ∘ (dO·Vᵀ - D), D = rowsum(dO ∘ O); then
// dQ += scale·dS·K, and dK += scale·dSᵀ·Q, dV += Pᵀ·dO into the own keys' gradients or, for a
// group, straight into the history's gradient buffers (in place). One task owns its KV head's
// rows: no two tasks write the same gradient (the cells of a wave read disjoint source layers).
// Per query row it also sums each group's dS (the gradient of the group's shift, hence of λ)
// and the diagonal's (b_σ's).
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

namespace {

using at::vec::Vectorized;

// Whether at::vec was built for AVX-512 (32 vector registers of 16 floats) rather than AVX2
// (16 of 8).
constexpr bool kWide = Vectorized<float>::size() == 16;

// Vectors in a full query tile: 32 float32 queries (16 float64), a beta_1.2 cell's c.
constexpr int kTileVectors = kWide ? 2 : 4;

// A tile of queries lies across the lanes of QV vectors (W = Vectorized<T>::size() queries
// each): scores, probabilities and their gradients are held key by key, `[keys][Q]`, so that
// every row operation of the softmax is a vector operation across queries.
template <typename T, int QV>
struct Lanes {
  using V = Vectorized<T>;
  static constexpr int W = V::size();
  static constexpr int Q = QV * W;
  // Rows of the products' register block: KB x QV accumulators, QV loads and KB broadcasts
  // per step (12 of AVX2's 16 registers, 16 of AVX-512's 32).
  static constexpr int KB = QV == 1 || kWide ? 8 : 3;
  // Rows of `add_rows`' register block, of four vectors each (12 or 24 accumulators).
  static constexpr int AB = kWide ? 6 : 3;
};

// The next history tile's rows, fetched into L2 a few lines at a time while the current tile
// is computed: its keys and values, and in backward the rows of the history's gradient that
// its adds read and write. Each product's register block fetches `kDripRows` (`Call::tiles`
// sets the streams, one Drip per thread). Issued all at once before a tile (1024 lines for
// 128 keys and values of 64 float32), and the gradient's rows not at all, a wavefront step
// ran 4-5 % slower: spread over the products, the fetches overlap their arithmetic
// (docs/benchmarks/2026-12-07-cpu-avx512.md).
struct Drip {
  const char* base[4] = {};
  int64_t ld[4] = {};
  int streams = 0, row_bytes = 0, rows = 0;
  int stream = 0, row = 0;  // the next row (stream == streams: none)
  void set(int count, const char* const* bases, const int64_t* lds, int bytes, int nj) {
    streams = count;
    for (int k = 0; k < count; ++k) {
      base[k] = bases[k];
      ld[k] = lds[k];
    }
    row_bytes = bytes;
    rows = nj;
    stream = row = 0;
  }
  // Fetches the next `count` rows, every line of each.
  void step(int count) {
    for (; count > 0 && stream < streams; --count) {
      const char* at = base[stream] + row * ld[stream];
      for (int byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(at + byte, 0, 2);
      if (++row == rows) {
        row = 0;
        ++stream;
      }
    }
  }
  void finish() { step(1 << 30); }
};
thread_local Drip drip;
constexpr int kDripRows = 6;

// out[j][:] = Σ_c a[j][c] · bt[c][:] for the rows j of one register block (a's rows `lda`
// apart; bt `[d][Q]`): a tile's scores from its keys and the queries' transpose.
template <typename T, int QV, int KB>
inline void rows_by_lanes_block(const T* a, int64_t lda, const T* bt, int d, T* out) {
  using L = Lanes<T, QV>;
  using V = typename L::V;
  V acc[KB][QV];
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < QV; ++v) acc[k][v] = V(T(0));
  for (int c = 0; c < d; ++c) {
    V b[QV];
#pragma GCC unroll 4
    for (int v = 0; v < QV; ++v) b[v] = V::loadu(bt + c * L::Q + v * L::W);
#pragma GCC unroll 8
    for (int k = 0; k < KB; ++k) {
      const V x(a[k * lda + c]);
#pragma GCC unroll 4
      for (int v = 0; v < QV; ++v) acc[k][v] = at::vec::fmadd(x, b[v], acc[k][v]);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < QV; ++v) acc[k][v].store(out + k * L::Q + v * L::W);
}

// out[j][:] = Σ_c a[j][c] · bt[c][:] for j < nj: S = K·Qᵀ, dP = V·dOᵀ (key-major).
template <typename T, int QV>
void rows_by_lanes(const T* a, int64_t lda, int nj, const T* bt, int d, T* out) {
  using L = Lanes<T, QV>;
  int j = 0;
  for (; j + L::KB <= nj; j += L::KB) {
    rows_by_lanes_block<T, QV, L::KB>(a + j * lda, lda, bt, d, out + j * L::Q);
    drip.step(kDripRows);
  }
  for (; j < nj; ++j) rows_by_lanes_block<T, QV, 1>(a + j * lda, lda, bt, d, out + j * L::Q);
}

// ct[c][:] += Σ_j a[j][c] · pt[j][:] for the columns c of one register block.
template <typename T, int QV, int KB>
inline void lanes_by_rows_block(const T* pt, int nj, const T* a, int64_t lda, T* ct) {
  using L = Lanes<T, QV>;
  using V = typename L::V;
  V acc[KB][QV];
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < QV; ++v) acc[k][v] = V::loadu(ct + k * L::Q + v * L::W);
  for (int j = 0; j < nj; ++j) {
    V p[QV];
#pragma GCC unroll 4
    for (int v = 0; v < QV; ++v) p[v] = V::loadu(pt + j * L::Q + v * L::W);
#pragma GCC unroll 8
    for (int k = 0; k < KB; ++k) {
      const V x(a[j * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < QV; ++v) acc[k][v] = at::vec::fmadd(x, p[v], acc[k][v]);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < QV; ++v) acc[k][v].store(ct + k * L::Q + v * L::W);
}

// ct[c][:] += Σ_j a[j][c] · pt[j][:] for c < d (ct `[d][Q]`): O += P·V, dQ += dS·K,
// transposed.
template <typename T, int QV>
void lanes_by_rows(const T* pt, int nj, const T* a, int64_t lda, int d, T* ct) {
  using L = Lanes<T, QV>;
  int c = 0;
  for (; c + L::KB <= d; c += L::KB) {
    lanes_by_rows_block<T, QV, L::KB>(pt, nj, a + c, lda, ct + c * L::Q);
    drip.step(kDripRows);
  }
  for (; c < d; ++c) lanes_by_rows_block<T, QV, 1>(pt, nj, a + c, lda, ct + c * L::Q);
}

// Fetches rows [0, nj) (`ld` apart, d wide) into L1. `lanes_by_rows` walks a tile's rows a
// few columns at a time, and its first touch of each line would wait on L2 (the hardware's
// prefetchers do not follow that stride); issued before the softmax's row operations, the
// lines arrive while those run.
template <typename T>
void prefetch_l1(const T* rows, int nj, int64_t ld, int d) {
  for (int j = 0; j < nj; ++j) {
    const char* row = reinterpret_cast<const char*>(rows + j * ld);
    for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64) {
      __builtin_prefetch(row + byte, 0, 3);
    }
  }
}

// dst[j][c] += Σ_r pt[j][r] · e[r][c] for a block of KB rows and FV vectors of columns (e
// `[Q][d]`, dst's rows `ldd` apart); the last vector `last` columns wide (a width that is not
// a multiple of the vector's: t19_flash's 200 columns are 12.5 AVX-512 vectors).
template <typename T, int QV, int KB, int FV>
inline void add_rows_block(const T* pt, const T* e, int d, T* dst, int64_t ldd,
                           int last = Vectorized<T>::size()) {
  using L = Lanes<T, QV>;
  using V = typename L::V;
  auto load = [last](const T* p, int f) {
    return f == FV - 1 && last < L::W ? V::loadu(p, last) : V::loadu(p);
  };
  V acc[KB][FV];
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int f = 0; f < FV; ++f) acc[k][f] = load(dst + k * ldd + f * L::W, f);
  for (int r = 0; r < L::Q; ++r) {
    V x[FV];
#pragma GCC unroll 4
    for (int f = 0; f < FV; ++f) x[f] = load(e + r * d + f * L::W, f);
#pragma GCC unroll 8
    for (int k = 0; k < KB; ++k) {
      const V p(pt[k * L::Q + r]);
#pragma GCC unroll 4
      for (int f = 0; f < FV; ++f) acc[k][f] = at::vec::fmadd(p, x[f], acc[k][f]);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
    for (int f = 0; f < FV; ++f) {
      if (f == FV - 1 && last < L::W) {
        acc[k][f].store(dst + k * ldd + f * L::W, last);
      } else {
        acc[k][f].store(dst + k * ldd + f * L::W);
      }
    }
}

// dst[j][c] += Σ_r pt[j][r] · e[r][c] for j < nj, c < d: dV += Pᵀ·dO and dK += dSᵀ·Q, in
// place in the own keys' or the history's gradient rows.
template <typename T, int QV, int KB>
void add_rows_of(const T* pt, const T* e, int d, T* dst, int64_t ldd) {
  using L = Lanes<T, QV>;
  int c = 0;
  for (; c + 4 * L::W <= d; c += 4 * L::W) add_rows_block<T, QV, KB, 4>(pt, e + c, d, dst + c, ldd);
  for (; c + L::W <= d; c += L::W) add_rows_block<T, QV, KB, 1>(pt, e + c, d, dst + c, ldd);
  if (c < d) add_rows_block<T, QV, KB, 1>(pt, e + c, d, dst + c, ldd, d - c);
}

template <typename T, int QV>
void add_rows(const T* pt, int nj, const T* e, int d, T* dst, int64_t ldd) {
  using L = Lanes<T, QV>;
  int j = 0;
  for (; j + L::AB <= nj; j += L::AB) {
    add_rows_of<T, QV, L::AB>(pt + j * L::Q, e, d, dst + j * ldd, ldd);
    drip.step(kDripRows);
  }
  for (; j < nj; ++j) add_rows_of<T, QV, 1>(pt + j * L::Q, e, d, dst + j * ldd, ldd);
}

constexpr int64_t kKeyTile = 128;  // keys a tile: its scores and their gradients stay in L1

// Scratch a thread's tasks reuse, carved into `[d][Q]` and `[keys][Q]` pieces.
template <typename T>
struct Scratch {
  std::vector<T> data;
  T* fit(size_t n) {
    if (data.size() < n) data.resize(n);
    return data.data();
  }
};

// A `[..., rows, d]` tensor read through its strides; the row stride is the leading
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
  T* at4(int64_t a, int64_t b, int64_t c, int64_t r) const {
    return data + a * st[0] + b * st[1] + c * st[2] + r * st[3];
  }
};

// One finished group of a cell: rows [lo, hi) of source layer `layer`, its index g among the
// cell's groups (the shift's and row sums' column).
struct Group {
  int64_t layer, lo, hi, g;
};

// The per-query thresholds of a query tile, one vector each per lane group: the first own key
// and the first history row its document lets it read, and its own key (the diagonal). The
// lanes past the block's last query see no key.
template <typename T, int QV>
struct Bounds {
  typename Lanes<T, QV>::V own_lo[QV], hist_lo[QV], me[QV];
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
  // The keys (or values) of a tile: own rows of cell i, or rows of the group's source layer.
  const T* rows_of(const Rows<T>& own, const Rows<T>& hist, const Group* group, int64_t i,
                   int64_t b, int64_t hk_, int64_t j0) const {
    return group ? hist.at4(group->layer, b, hk_, j0) : own.at4(i, b, hk_, j0);
  }

  template <int QV>
  Bounds<T, QV> bounds(int64_t i, int64_t b, int64_t r0, int m) const {
    using L = Lanes<T, QV>;
    T own_lo[L::Q], hist_lo[L::Q], me[L::Q];
    for (int r = 0; r < L::Q; ++r) {
      const bool live = r < m;
      const int64_t first = live ? bound(i, b, r0 + r) : 0;
      hist_lo[r] = live ? T(first) : std::numeric_limits<T>::max();
      own_lo[r] = live ? T(first - starts[i]) : std::numeric_limits<T>::max();
      me[r] = T(nk - n + r0 + r);
    }
    Bounds<T, QV> out;
    for (int v = 0; v < QV; ++v) {
      out.own_lo[v] = L::V::loadu(own_lo + v * L::W);
      out.hist_lo[v] = L::V::loadu(hist_lo + v * L::W);
      out.me[v] = L::V::loadu(me + v * L::W);
    }
    return out;
  }

  // Biases and masks the scores st `[nj][Q]` of keys [j0, j0 + nj) in place (-inf where
  // hidden): a group's minus its shift, the own keys causal with b_σ on the diagonal.
  template <int QV>
  void mask(T* st, int nj, int64_t j0, const Group* group, int64_t i, int64_t h,
            const Bounds<T, QV>& bd) const {
    using L = Lanes<T, QV>;
    using V = typename L::V;
    const V hidden_score(-std::numeric_limits<T>::infinity());
    if (group) {
      const V bias(shift_of(i, group->g, h));
      for (int j = 0; j < nj; ++j) {
        const V key(T(j0 + j));
        for (int v = 0; v < QV; ++v) {
          T* s = st + j * L::Q + v * L::W;
          V::blendv(V::loadu(s) - bias, hidden_score, key < bd.hist_lo[v]).store(s);
        }
      }
      return;
    }
    const V sb(self_bias ? self_bias[i * self_st] : T(0)), zero(T(0));
    for (int j = 0; j < nj; ++j) {
      const V key(T(j0 + j));
      for (int v = 0; v < QV; ++v) {
        T* s = st + j * L::Q + v * L::W;
        const V x = V::loadu(s) + V::blendv(zero, sb, key == bd.me[v]);
        V::blendv(x, hidden_score, (key < bd.own_lo[v]) | (key > bd.me[v])).store(s);
      }
    }
  }

  // The key tiles a query tile of head h reads: own keys first, then each group's rows, from
  // the tile's least bound on. `fn(group or null, j0, nj)`. The next history tile's keys and
  // values (and the rows of `grad_k`, `grad_v` there: backward's history gradient) are
  // prefetched into L2 while one is computed (`Drip`): they are read once per query tile,
  // cold (the history is larger than the caches), and the hardware's prefetchers follow one
  // group's rows too late. What the products left unfetched goes before the tile.
  template <typename Fn>
  void tiles(int64_t i, int64_t b, int64_t h, int64_t r0, int m, Fn fn,
             const Rows<T>* grad_k = nullptr, const Rows<T>* grad_v = nullptr) const {
    struct Tile {
      const Group* group;
      int64_t j0;
      int nj;
    };
    std::vector<Tile> list;
    const int64_t least = least_bound(i, b, r0, m);
    const int64_t own_end = std::min(nk, nk - n + r0 + m);
    for (int64_t j0 = std::max<int64_t>(0, least - starts[i]); j0 < own_end; j0 += kKeyTile) {
      list.push_back({nullptr, j0, static_cast<int>(std::min(kKeyTile, own_end - j0))});
    }
    for (const Group& group : groups[i]) {
      for (int64_t j0 = std::max(group.lo, least); j0 < group.hi; j0 += kKeyTile) {
        list.push_back({&group, j0, static_cast<int>(std::min(kKeyTile, group.hi - j0))});
      }
    }
    const int64_t hk_ = h / per_kv;
    const int bytes = static_cast<int>(dim * sizeof(T));
    for (size_t t = 0; t < list.size(); ++t) {
      drip.finish();
      if (t + 1 < list.size() && list[t + 1].group) {
        const Tile& up = list[t + 1];
        const char* bases[4];
        int64_t lds[4];
        int count = 0;
        for (const Rows<T>* rows : {&hk, &hv, grad_k, grad_v}) {
          if (!rows || !rows->data) continue;
          bases[count] = reinterpret_cast<const char*>(rows->at4(up.group->layer, b, hk_, up.j0));
          lds[count++] = rows->ld() * static_cast<int64_t>(sizeof(T));
        }
        drip.set(count, bases, lds, bytes, up.nj);
      }
      fn(list[t].group, list[t].j0, list[t].nj);
    }
  }

  // Rows [r0, r0 + m) of a `[cells, B, H, n, d]` tensor at (i, b, h) into the lanes of
  // `[d][Q]` (transposed) or `[Q][d]`, times `factor`; the lanes past m are zeros.
  template <int QV>
  void gather(const Rows<T>& t, int64_t i, int64_t b, int64_t h, int64_t r0, int m, T factor,
              T* lanes, T* rows) const {
    using L = Lanes<T, QV>;
    const int d = static_cast<int>(dim);
    if (lanes) std::fill(lanes, lanes + d * L::Q, T(0));
    if (rows) std::fill(rows, rows + d * L::Q, T(0));
    for (int r = 0; r < m; ++r) {
      const T* x = t.at4(i, b, h, r0 + r);
      for (int c = 0; c < d; ++c) {
        if (lanes) lanes[c * L::Q + r] = factor * x[c];
        if (rows) rows[r * d + c] = factor * x[c];
      }
    }
  }
};

template <typename T, int QV>
using VecOf = typename Lanes<T, QV>::V;

// Per lane group, the maximum of st `[nj][Q]` down its keys.
template <typename T, int QV>
void lane_max(const T* st, int nj, VecOf<T, QV>* mx) {
  using L = Lanes<T, QV>;
  for (int j = 0; j < nj; ++j) {
    for (int v = 0; v < QV; ++v) {
      mx[v] = at::vec::maximum(mx[v], L::V::loadu(st + j * L::Q + v * L::W));
    }
  }
}

// st = exp(st - shift) per lane (-inf gives 0); adds each lane's sum into `sum`.
template <typename T, int QV>
void lane_exp(T* st, int nj, const VecOf<T, QV>* shift, VecOf<T, QV>* sum) {
  using L = Lanes<T, QV>;
  for (int j = 0; j < nj; ++j) {
    for (int v = 0; v < QV; ++v) {
      T* s = st + j * L::Q + v * L::W;
      const auto e = (L::V::loadu(s) - shift[v]).exp_u20();
      e.store(s);
      if (sum) sum[v] = sum[v] + e;
    }
  }
}

template <typename T, int QV>
void forward_task(const Call<T>& call, int64_t i, int64_t b, int64_t h, int64_t r0, Rows<T>& out,
                  T* lse, const std::vector<int64_t>& lse_st, Scratch<T>& sc) {
  using L = Lanes<T, QV>;
  using V = typename L::V;
  const int m = static_cast<int>(std::min<int64_t>(L::Q, call.n - r0));
  const int d = static_cast<int>(call.dim);
  T* qt = sc.fit(2 * d * L::Q + kKeyTile * L::Q);
  T *ot = qt + d * L::Q, *st = ot + d * L::Q;
  call.template gather<QV>(call.q, i, b, h, r0, m, call.scale, qt, nullptr);
  std::fill(ot, ot + d * L::Q, T(0));
  const Bounds<T, QV> bd = call.template bounds<QV>(i, b, r0, m);
  const T inf = std::numeric_limits<T>::infinity();
  V mx[QV], l[QV];
  for (int v = 0; v < QV; ++v) {
    mx[v] = V(-inf);
    l[v] = V(T(0));
  }
  const int64_t hk_ = h / call.per_kv;
  call.tiles(i, b, h, r0, m, [&](const Group* group, int64_t j0, int nj) {
    const T* keys = call.rows_of(call.k, call.hk, group, i, b, hk_, j0);
    const T* values = call.rows_of(call.v, call.hv, group, i, b, hk_, j0);
    const int64_t ldv = group ? call.hv.ld() : call.v.ld();
    rows_by_lanes<T, QV>(keys, group ? call.hk.ld() : call.k.ld(), nj, qt, d, st);
    prefetch_l1(values, nj, ldv, d);
    call.template mask<QV>(st, nj, j0, group, i, h, bd);
    V now[QV], alpha[QV];
    for (int v = 0; v < QV; ++v) now[v] = mx[v];
    lane_max<T, QV>(st, nj, now);
    for (int v = 0; v < QV; ++v) {
      // A lane that has seen no key yet keeps a zero shift: exp(-inf - 0) = 0.
      now[v] = V::blendv(now[v], V(T(0)), now[v] == V(-inf));
      alpha[v] = (mx[v] - now[v]).exp();
      l[v] = l[v] * alpha[v];
      mx[v] = now[v];
    }
    lane_exp<T, QV>(st, nj, now, l);
    for (int c = 0; c < d; ++c) {
      for (int v = 0; v < QV; ++v) {
        T* o = ot + c * L::Q + v * L::W;
        (V::loadu(o) * alpha[v]).store(o);
      }
    }
    lanes_by_rows<T, QV>(st, nj, values, ldv, d, ot);
  });
  T mxs[L::Q], ls[L::Q];
  for (int v = 0; v < QV; ++v) {
    mx[v].store(mxs + v * L::W);
    l[v].store(ls + v * L::W);
  }
  for (int r = 0; r < m; ++r) {
    T* o = out.at4(i, b, h, r0 + r);
    const T inv = T(1) / ls[r];
    for (int c = 0; c < d; ++c) o[c] = ot[c * L::Q + r] * inv;
    lse[i * lse_st[0] + b * lse_st[1] + h * lse_st[2] + (r0 + r) * lse_st[3]] =
        mxs[r] + std::log(ls[r]);
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

template <typename T, int QV>
void backward_task(const Call<T>& call, const Grads<T>& g, int64_t i, int64_t b, int64_t hk_,
                   Scratch<T>& sc) {
  using L = Lanes<T, QV>;
  using V = typename L::V;
  const int d = static_cast<int>(call.dim);
  const int64_t tile = d * L::Q;
  T* qt = sc.fit(5 * tile + 2 * kKeyTile * L::Q);
  T *gt = qt + tile, *qr = gt + tile, *gr = qr + tile, *dqt = gr + tile;
  T *st = dqt + tile, *dst = st + kKeyTile * L::Q;
  for (int64_t h = hk_ * call.per_kv; h < (hk_ + 1) * call.per_kv; ++h) {
    for (int64_t r0 = 0; r0 < call.n; r0 += L::Q) {
      const int m = static_cast<int>(std::min<int64_t>(L::Q, call.n - r0));
      call.template gather<QV>(call.q, i, b, h, r0, m, call.scale, qt, qr);
      call.template gather<QV>(g.grad, i, b, h, r0, m, T(1), gt, gr);
      std::fill(dqt, dqt + tile, T(0));
      const Bounds<T, QV> bd = call.template bounds<QV>(i, b, r0, m);
      // Per lane D = rowsum(dO ∘ O) and the lse (the lanes past m: zeros, and they see no key).
      T delta_s[L::Q] = {}, lse_s[L::Q] = {};
      for (int r = 0; r < m; ++r) {
        const T* o = g.out.at4(i, b, h, r0 + r);
        T sum = 0;
        for (int c = 0; c < d; ++c) sum += gr[r * d + c] * o[c];
        delta_s[r] = sum;
        lse_s[r] = g.lse[i * g.lse_st[0] + b * g.lse_st[1] + h * g.lse_st[2] +
                         (r0 + r) * g.lse_st[3]];
      }
      V delta[QV], lse[QV];
      for (int v = 0; v < QV; ++v) {
        delta[v] = V::loadu(delta_s + v * L::W);
        lse[v] = V::loadu(lse_s + v * L::W);
      }
      call.tiles(i, b, h, r0, m, [&](const Group* group, int64_t j0, int nj) {
        const T* keys = call.rows_of(call.k, call.hk, group, i, b, hk_, j0);
        const T* values = call.rows_of(call.v, call.hv, group, i, b, hk_, j0);
        const int64_t ldk = group ? call.hk.ld() : call.k.ld();
        // P = exp(S - lse), dP = dO·Vᵀ, then dS = P ∘ (dP - D) in place, with its sums.
        rows_by_lanes<T, QV>(keys, ldk, nj, qt, d, st);
        call.template mask<QV>(st, nj, j0, group, i, h, bd);
        lane_exp<T, QV>(st, nj, lse, nullptr);
        rows_by_lanes<T, QV>(values, group ? call.hv.ld() : call.v.ld(), nj, gt, d, dst);
        prefetch_l1(keys, nj, ldk, d);
        V sum[QV];
        for (int v = 0; v < QV; ++v) sum[v] = V(T(0));
        for (int j = 0; j < nj; ++j) {
          for (int v = 0; v < QV; ++v) {
            T* ds = dst + j * L::Q + v * L::W;
            const V x = V::loadu(st + j * L::Q + v * L::W) * (V::loadu(ds) - delta[v]);
            x.store(ds);
            sum[v] = sum[v] + x;
          }
        }
        if (group && g.rows) {
          T sums[L::Q];
          for (int v = 0; v < QV; ++v) sum[v].store(sums + v * L::W);
          for (int r = 0; r < m; ++r) {
            g.rows[i * g.rows_st[0] + group->g * g.rows_st[1] + b * g.rows_st[2] +
                   h * g.rows_st[3] + (r0 + r) * g.rows_st[4]] += sums[r];
          }
        }
        if (!group && g.diag) {
          for (int r = 0; r < m; ++r) {
            const int64_t me = call.nk - call.n + r0 + r - j0;
            if (me >= 0 && me < nj) {
              g.diag[i * g.diag_st[0] + b * g.diag_st[1] + h * g.diag_st[2] +
                     (r0 + r) * g.diag_st[3]] += dst[me * L::Q + r];
            }
          }
        }
        lanes_by_rows<T, QV>(dst, nj, keys, ldk, d, dqt);
        const Rows<T>& dk = group ? g.ghk : g.dk;
        const Rows<T>& dv = group ? g.ghv : g.dv;
        if (dk.data) {
          const int64_t a = group ? group->layer : i;
          add_rows<T, QV>(st, nj, gr, d, dv.at4(a, b, hk_, j0), dv.ld());
          add_rows<T, QV>(dst, nj, qr, d, dk.at4(a, b, hk_, j0), dk.ld());
        }
      }, &g.ghk, &g.ghv);
      for (int r = 0; r < m; ++r) {
        T* dq = g.dq.at4(i, b, h, r0 + r);
        for (int c = 0; c < d; ++c) dq[c] = call.scale * dqt[c * L::Q + r];
      }
    }
  }
}

// Query tiles of one vector where the cells are that short (decoding, small blocks), else
// of a full tile's vectors.
template <typename T, typename Fn>
void with_lanes(int64_t n, Fn fn) {
  if (n <= Vectorized<T>::size()) {
    fn(std::integral_constant<int, 1>{});
  } else {
    fn(std::integral_constant<int, kTileVectors>{});
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
    with_lanes<scalar_t>(call.n, [&](auto lanes) {
      constexpr int QV = decltype(lanes)::value;
      constexpr int64_t Q = Lanes<scalar_t, QV>::Q;
      const int64_t tiles = (call.n + Q - 1) / Q;
      parallel(call.cells, call.batch, call.heads * tiles, [&](int64_t i, int64_t b, int64_t ht) {
        thread_local Scratch<scalar_t> scratch;
        forward_task<scalar_t, QV>(call, i, b, ht / tiles, ht % tiles * Q, o, l, lst, scratch);
      });
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
  // Laid out like q (the operator's fake says so); every row is written once.
  at::Tensor dq = at::empty_like(q);
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
    with_lanes<scalar_t>(call.n, [&](auto lanes) {
      constexpr int QV = decltype(lanes)::value;
      parallel(call.cells, call.batch, call.kv_heads, [&](int64_t i, int64_t b, int64_t hk) {
        thread_local Scratch<scalar_t> scratch;
        backward_task<scalar_t, QV>(call, g, i, b, hk, scratch);
      });
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
