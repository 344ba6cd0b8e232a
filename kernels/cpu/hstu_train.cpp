// HSTU attention for training on CPU: forward and backward over a jagged batch, one user's
// rows at a time, everything of one (user, head) in cache (kernels/hstu_train.py calls it).
//
//   S = alpha q k^T + table[code]     over the pairs the mask allows (code != masked)
//   out = SiLU(S) v / N
//
// Why a kernel of its own: PyTorch's coded path runs the same math as batched GEMMs over
// [B, rows, keys] blocks padded to the batch's longest user, with a pass over memory for each
// of the gather, the bias add, SiLU, its gradient and the table's scatter; at HSTU's shapes
// (a few hundred rows a user, 64-wide heads) those passes and the small GEMMs' overheads cost
// more than the arithmetic. Here each user's q, k, v are read once into fp32 scratch, its
// scores exist only as a [rows, keys] tile of the causal triangle, and the pointwise work runs
// on the tile while it is in cache. The forward keeps S (fp32) for the backward pass.
//
// Layout: q, k, v, out, dq, dk, dv are rows of the jagged batch [T, H, D] (row strides given,
// heads contiguous), fp32 or bf16 (dtype 0 / 1; fp32: fp32 arithmetic; bf16: the GEMMs in bf16
// where the CPU has AVX512-BF16, see forward_one_bf, else converted to fp32 on load; results
// rounded to nearest even on store). codes: kernels.hstu_coded's int32 bias codes by query
// block, end to end (block (s, e): [B, e - s, e], user b's pair (i, j) at [b][i - s][j]; every
// block but the last rows_per_block rows). Every allowed pair has j <= i, so query tile [s, e)
// needs keys [0, e) only. GCC/Clang vector extensions (16 floats; AVX-512 where
// -march=native has it, two halves elsewhere). Users are split between the caller's OpenMP
// threads by their n^2 (built with -fopenmp: PyTorch's own pool, kernels/native.py).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GENREC_DPBF16 1
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 ld16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void st16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

typedef int32_t v16i __attribute__((vector_size(64)));

// exp(x), lane-wise, to about a float ulp: 2^(x log2 e) as 2^n (exponent bits) times 2^f from its
// degree-6 Taylor polynomial, |f| <= 1/2; arguments clamped to [-126, 127] powers of two (so
// exp of a masked pair's huge negative score is a finite 2^-126 and its SiLU a finite ~ -1,
// zeroed by its mask).
inline v16 vexp(v16 x) {
  v16 t = x * 1.4426950408889634f;
  t = t < -126.f ? v16{} - 126.f : t;
  t = t > 127.f ? v16{} + 127.f : t;
  const v16 n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const v16 f = (t - n) * 0.6931471805599453f;
  v16 p = 1.f / 720.f + f * 0.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline v16 vsigmoid(v16 x) { return 1.f / (1.f + vexp(-x)); }

using genrec_bf16::from_float;
using genrec_bf16::to_float;

// rows x width values at src (row stride ld elements, dtype 0 fp32 / 1 bf16) -> dst [rows, width] fp32
void load_rows(const void* src, int dtype, int64_t ld, int rows, int width, float* dst) {
  for (int r = 0; r < rows; ++r) {
    if (dtype == 0) {
      std::memcpy(dst + int64_t(r) * width, static_cast<const float*>(src) + r * ld, sizeof(float) * width);
    } else {
      const uint16_t* s = static_cast<const uint16_t*>(src) + r * ld;
      for (int c = 0; c < width; ++c) dst[int64_t(r) * width + c] = to_float(s[c]);
    }
  }
}

// src [rows, width] fp32 * scale -> rows of dst (row stride ld, dtype as above)
void store_rows(const float* src, int rows, int width, float scale, void* dst, int dtype, int64_t ld) {
  for (int r = 0; r < rows; ++r) {
    const float* s = src + int64_t(r) * width;
    if (dtype == 0) {
      float* d = static_cast<float*>(dst) + r * ld;
      for (int c = 0; c < width; ++c) d[c] = s[c] * scale;
    } else {
      uint16_t* d = static_cast<uint16_t*>(dst) + r * ld;
      int c = 0;
#if GENREC_DPBF16
      for (; c + 16 <= width; c += 16)  // the same rounding (to nearest even)
        _mm256_storeu_si256((__m256i*)(d + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + c), _mm512_set1_ps(scale))));
#endif
      for (; c < width; ++c) d[c] = from_float(s[c] * scale);
    }
  }
}

// C[MR, 16 NV] = A[MR, K] B[K, 16 NV], the accumulators in registers.
template <int MR, int NV>
inline void tile(int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
  v16 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = v16{};
  for (int k = 0; k < K; ++k) {
    v16 b[NV];
    for (int c = 0; c < NV; ++c) b[c] = ld16(B + int64_t(k) * ldb + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const float a = A[int64_t(r) * lda + k];
      for (int c = 0; c < NV; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) st16(C + int64_t(r) * ldc + 16 * c, acc[r][c]);
}

// The fp32 tile as a kind the GEMM driver below takes: A fp32 rows, B fp32 rows, K values.
struct FmaTile {
  using TA = float;
  using TB = float;
  template <int MR, int NV>
  static void run(int K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int ldc) {
    tile<MR, NV>(K, A, int(lda), B, int(ldb), C, ldc);
  }
};

// C[M, N] = A B, row-major, N a multiple of 16, in tiles of 4 rows x 64 columns (the edges in
// smaller ones) of the kind T: FmaTile (A [M, K], B [K, N], fp32) or BfTile (K pairs of bf16).
template <typename T, int NV>
inline void rows_tile(int mr, int K, const typename T::TA* A, int64_t lda, const typename T::TB* B, int64_t ldb,
                      float* C, int ldc) {
  switch (mr) {
    case 4: T::template run<4, NV>(K, A, lda, B, ldb, C, ldc); break;
    case 3: T::template run<3, NV>(K, A, lda, B, ldb, C, ldc); break;
    case 2: T::template run<2, NV>(K, A, lda, B, ldb, C, ldc); break;
    default: T::template run<1, NV>(K, A, lda, B, ldb, C, ldc); break;
  }
}

template <typename T>
void gemm_tiles(int M, int N, int K, const typename T::TA* A, int64_t lda, const typename T::TB* B, int64_t ldb,
                float* C, int ldc) {
  for (int i = 0; i < M; i += 4) {
    const int mr = M - i < 4 ? M - i : 4;
    const typename T::TA* a = A + int64_t(i) * lda;
    float* c = C + int64_t(i) * ldc;
    int j = 0;
    for (; j + 64 <= N; j += 64) rows_tile<T, 4>(mr, K, a, lda, B + j, ldb, c + j, ldc);
    switch ((N - j) / 16) {
      case 3: rows_tile<T, 3>(mr, K, a, lda, B + j, ldb, c + j, ldc); break;
      case 2: rows_tile<T, 2>(mr, K, a, lda, B + j, ldb, c + j, ldc); break;
      case 1: rows_tile<T, 1>(mr, K, a, lda, B + j, ldb, c + j, ldc); break;
      default: break;
    }
  }
}

// C[M, N] = A[M, K] B[K, N], fp32, row-major, N a multiple of 16.
void gemm(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
  gemm_tiles<FmaTile>(M, N, K, A, lda, B, ldb, C, ldc);
}

inline int pad16(int x) { return (x + 15) & ~15; }
#if defined(__AVX512F__)
// lanes 0..n-1 of 16 (all for n >= 16, none for n <= 0)
inline __mmask16 first_lanes(int n) { return n >= 16 ? __mmask16(0xffff) : n > 0 ? __mmask16((1u << n) - 1) : 0; }
#endif
constexpr int kTile = 32;  // query rows a tile

struct Dims {
  int H, dqk, dv, L, dtype;
  int64_t ldq, ldk, ldv, ldo;  // row strides of q, k, v and of out / dout (elements)
  const int32_t* codes;  // by query block: block k holds rows s..e-1 of every user, [B, e - s, e]
  const int64_t* blocks;  // per block (s, e, offset into codes)
  int rows_per_block;
  const float* table;
  int32_t masked;
  float alpha, inv_n;
  int eb() const { return dtype == 0 ? 4 : 2; }
  int width() const { return dqk > dv ? dqk : dv; }
  // bf16 inputs on a CPU with bf16 dot products: the GEMMs in bf16 (forward_one_bf, backward_one_bf)
  bool bf() const {
#if GENREC_DPBF16
    return dtype == 1;
#else
    return false;
#endif
  }
};

// One thread's bf16 operands (the bf16 path only), sized for the batch's longest user: pairs of
// columns (k, v) and of rows (k, v, q, dout), P and dS [np, np] in bf16, a lower triangle's
// transpose.
struct ScratchBf {
  std::vector<uint32_t> kc, vc, kr, vr, qr, gr;
  std::vector<uint16_t> p, ds, t;
  explicit ScratchBf(const Dims& d) {
    if (!d.bf()) return;
    const size_t np = size_t(pad16(d.L));
    kc.resize(np * d.dqk / 2);
    vc.resize(np * d.dv / 2);
    kr.resize(np / 2 * d.dqk);
    vr.resize(np / 2 * d.dv);
    qr.resize(np / 2 * d.dqk);
    gr.resize(np / 2 * d.dv);
    p.resize(np * np);
    ds.resize(np * np);
    t.resize(np * np);
  }
};

// One thread's scratch, sized for the batch's longest user (L rows, np = pad16(L)): a user's
// rows in fp32 (keys and values with zero rows up to pad16(n)), its [n, np] P and dS, their
// transpose, a tile of scores and one row's pointwise inputs.
// The bf16 path keeps its operands in `bf` instead, and a tile's dS in `ds`.
struct Scratch {
  std::vector<float> q, k, v, kt, vt, s, p, ds, t, g, r, x, m, table_grad;
  ScratchBf bf;
  explicit Scratch(const Dims& d) : bf(d) {
    const size_t np = size_t(pad16(d.L)), w = size_t(d.width());
    s.resize(kTile * np);
    r.resize(np * w);
    x.resize(np);
    m.resize(np);
    if (d.bf()) {
      ds.resize(kTile * np);
      return;
    }
    q.resize(np * d.dqk);
    k.resize(np * d.dqk);
    v.resize(np * d.dv);
    kt.resize(np * d.dqk);
    vt.resize(np * d.dv);
    p.resize(np * np);
    ds.resize(np * np);
    t.resize(np * np);
    g.resize(np * d.dv);
  }
};

// user b's pair codes, row i (keys 0..i at least)
inline const int32_t* code_row(const Dims& d, int b, int i) {
  const int64_t* blk = d.blocks + 3 * (i / d.rows_per_block);
  const int64_t s = blk[0], e = blk[1];
  return d.codes + blk[2] + (int64_t(b) * (e - s) + (i - s)) * e;
}

// One query row's scores before SiLU over keys 0..k-1 (k = row + 1): x = alpha s + table[code]
// and m = 1, or m = 0 where masked; zeros from k to `end` (the tile's padded width).
inline void row_scores(const Dims& d, const int32_t* cr, int k, int end, const float* sr, float* x, float* m) {
#if defined(__AVX512F__)
  if (end % 16 == 0) {  // 16 keys at a time, the table read by a gather
    const __m512 alpha = _mm512_set1_ps(d.alpha), one = _mm512_set1_ps(1.f);
    const __m512i masked = _mm512_set1_epi32(d.masked);
    for (int j = 0; j < end; j += 16) {
      const __mmask16 in = first_lanes(k - j);
      const __m512i c = _mm512_maskz_loadu_epi32(in, cr + j);
      const __m512 t = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, c, d.table, 4);
      _mm512_storeu_ps(x + j, _mm512_maskz_fmadd_ps(in, alpha, _mm512_loadu_ps(sr + j), t));
      _mm512_storeu_ps(m + j, _mm512_maskz_mov_ps(_mm512_mask_cmpneq_epi32_mask(in, c, masked), one));
    }
    return;
  }
#endif
  for (int j = 0; j < k; ++j) {
    const int32_t c = cr[j];
    x[j] = d.alpha * sr[j] + d.table[c];
    m[j] = c == d.masked ? 0.f : 1.f;
  }
  for (int j = k; j < end; ++j) x[j] = m[j] = 0.f;
}

// q, k, v rows of one (user, head) into w.q, w.k, w.v; zero rows n..np-1 of k and v.
void load_head(const Dims& d, int64_t o, int h, int n, int np, const void* q, const void* k, const void* v,
               Scratch& w) {
  const int eb = d.eb();
  auto at = [&](const void* base, int64_t ld, int off) { return static_cast<const char*>(base) + (o * ld + off) * eb; };
  load_rows(at(q, d.ldq, h * d.dqk), d.dtype, d.ldq, n, d.dqk, w.q.data());
  load_rows(at(k, d.ldk, h * d.dqk), d.dtype, d.ldk, n, d.dqk, w.k.data());
  load_rows(at(v, d.ldv, h * d.dv), d.dtype, d.ldv, n, d.dv, w.v.data());
  std::fill(w.k.begin() + int64_t(n) * d.dqk, w.k.begin() + int64_t(np) * d.dqk, 0.f);
  std::fill(w.v.begin() + int64_t(n) * d.dv, w.v.begin() + int64_t(np) * d.dv, 0.f);
}

// dst [cols, np] <- src [n, cols]^T, columns n..np-1 zero
void transpose_padded(int n, int np, int cols, const float* src, float* dst) {
  for (int c = 0; c < cols; ++c) {
    float* row = dst + int64_t(c) * np;
    for (int r = 0; r < n; ++r) row[r] = src[int64_t(r) * cols + c];
    for (int r = n; r < np; ++r) row[r] = 0.f;
  }
}

// t [n, np] <- the lower triangle of a [n, np] matrix a transposed, as the key-side GEMMs read
// it: row j holds a[i][j] for i >= j, and 0 for the i in j's tile before j.
void transpose_lower(int n, int np, const float* a, float* t) {
  for (int j = 0; j < n; ++j) {
    float* row = t + int64_t(j) * np;
    for (int i = j / kTile * kTile; i < j; ++i) row[i] = 0.f;
    for (int i = j; i < n; ++i) row[i] = a[int64_t(i) * np + j];
  }
}

// (user b, head h) forward: rows o..o+n-1; keeps S (pre-activation, [n, n]) in save.
void forward_one(const Dims& d, int b, int h, int64_t o, int n, const void* q, const void* k, const void* v,
                 void* out, float* save, Scratch& w) {
  const int np = pad16(n);
  load_head(d, o, h, n, np, q, k, v, w);
  transpose_padded(n, np, d.dqk, w.k.data(), w.kt.data());
  for (int s = 0; s < n; s += kTile) {
    const int e = s + kTile < n ? s + kTile : n, cols = pad16(e), rows = e - s;
    gemm(rows, cols, d.dqk, w.q.data() + int64_t(s) * d.dqk, d.dqk, w.kt.data(), np, w.s.data(), np);
    for (int i = s; i < e; ++i) {  // P = SiLU(S) m over the tile's width, m = 0 where masked; S kept
      const float* sr = w.s.data() + int64_t(i - s) * np;
      float* pr = w.p.data() + int64_t(i) * np;
      row_scores(d, code_row(d, b, i), i + 1, cols, sr, w.x.data(), w.m.data());
      std::memcpy(save + int64_t(i) * n, w.x.data(), sizeof(float) * (i + 1));
      for (int j = 0; j < cols; j += 16) {
        const v16 x = ld16(w.x.data() + j);
        st16(pr + j, x * vsigmoid(x) * ld16(w.m.data() + j));
      }
    }
    // out rows s..e-1 = P[s:e, 0:cols] v[0:cols]: P is 0 past each row's diagonal
    gemm(rows, d.dv, cols, w.p.data() + int64_t(s) * np, np, w.v.data(), d.dv, w.r.data(), d.dv);
    store_rows(w.r.data(), rows, d.dv, d.inv_n, static_cast<char*>(out) + ((o + s) * d.ldo + h * d.dv) * d.eb(),
               d.dtype, d.ldo);
  }
}

// Rows j of a [n, np] lower triangle's transpose times src [n, width] -> dst's rows (row stride
// H width): sum over i >= j of a[i][j] src[i], the backward's key side. Key tile [s, e) takes
// query rows from s on (a[i][j] is 0 for i < j).
void key_side(const Dims& d, int n, int np, const float* a, const float* src, int width, void* dst, Scratch& w) {
  transpose_lower(n, np, a, w.t.data());
  for (int s = 0; s < n; s += kTile) {
    const int e = s + kTile < n ? s + kTile : n;
    gemm(e - s, width, n - s, w.t.data() + int64_t(s) * np + s, np, src + int64_t(s) * width, width,
         w.r.data() + int64_t(s) * width, width);
  }
  store_rows(w.r.data(), n, width, 1.f, dst, d.dtype, int64_t(d.H) * width);
}

// (user b, head h) backward from dout's rows: dq, dk, dv rows written (each head's own
// columns, contiguous [T, H, D] outputs), the table's gradient added to dtable.
void backward_one(const Dims& d, int b, int h, int64_t o, int n, const void* q, const void* k, const void* v,
                  const void* dout, const float* save, void* dq, void* dk, void* dv, float* dtable, Scratch& w) {
  const int np = pad16(n), eb = d.eb();
  auto out_at = [&](void* base, int dim) { return static_cast<char*>(base) + (o * d.H * dim + int64_t(h) * dim) * eb; };
  load_head(d, o, h, n, np, q, k, v, w);
  load_rows(static_cast<const char*>(dout) + (o * d.ldo + h * d.dv) * eb, d.dtype, d.ldo, n, d.dv, w.g.data());
  for (int64_t i = 0; i < int64_t(n) * d.dv; ++i) w.g[i] *= d.inv_n;  // d out / N
  transpose_padded(n, np, d.dv, w.v.data(), w.vt.data());
  for (int s = 0; s < n; s += kTile) {
    const int e = s + kTile < n ? s + kTile : n, cols = pad16(e), rows = e - s;
    gemm(rows, cols, d.dv, w.g.data() + int64_t(s) * d.dv, d.dv, w.vt.data(), np, w.s.data(), np);  // dP
    for (int i = s; i < e; ++i) {  // dS = dP SiLU'(S) m and P again, over the tile's width
      const float* dpr = w.s.data() + int64_t(i - s) * np;
      float* pr = w.p.data() + int64_t(i) * np;
      float* dsr = w.ds.data() + int64_t(i) * np;
      const int32_t* cr = code_row(d, b, i);
      std::memcpy(w.x.data(), save + int64_t(i) * n, sizeof(float) * (i + 1));
      for (int j = 0; j <= i; ++j) w.m[j] = cr[j] == d.masked ? 0.f : 1.f;
      for (int j = i + 1; j < cols; ++j) w.x[j] = w.m[j] = 0.f;
      for (int j = 0; j < cols; j += 16) {
        const v16 x = ld16(w.x.data() + j), m = ld16(w.m.data() + j), sg = vsigmoid(x);
        st16(pr + j, x * sg * m);
        st16(dsr + j, ld16(dpr + j) * sg * (1.f + x * (1.f - sg)) * m);  // SiLU'(x) = sg (1 + x (1 - sg))
      }
      for (int j = 0; j <= i; ++j) {  // the table's gradient; masked pairs add 0 to the masked slot
        dtable[cr[j]] += dsr[j];
        dsr[j] *= d.alpha;
      }
      for (int j = i + 1; j < cols; ++j) dsr[j] = 0.f;
    }
    // dq rows s..e-1 = dS[s:e, 0:cols] k[0:cols]
    gemm(rows, d.dqk, cols, w.ds.data() + int64_t(s) * np, np, w.k.data(), d.dqk, w.r.data() + int64_t(s) * d.dqk,
         d.dqk);
  }
  store_rows(w.r.data(), n, d.dqk, 1.f, out_at(dq, d.dqk), d.dtype, int64_t(d.H) * d.dqk);
  // dv = P^T (dout / N), dk = dS^T q
  key_side(d, n, np, w.p.data(), w.g.data(), d.dv, out_at(dv, d.dv), w);
  key_side(d, n, np, w.ds.data(), w.q.data(), d.dqk, out_at(dk, d.dqk), w);
}

#if GENREC_DPBF16
// ----- bf16 inputs: the GEMMs as bf16 dot products (AVX512-BF16), fp32 accumulators -----------
//
// Under bf16 autocast q, k, v and dout arrive in bf16. The fp32 path above widens them and runs
// its GEMMs in fp32; here the GEMMs take them as they are, two bf16 values a 32-bit lane
// (VDPBF16PS: a0 b0 + a1 b1 added to an fp32 accumulator), at twice the fp32 FMA rate. P and dS
// (computed in fp32 by the same pointwise passes) are rounded to bf16 for the GEMMs that read
// them, as a bf16 attention in PyTorch or FlashAttention rounds them; the saved S, the table's
// gradient and every accumulator stay fp32.
//
// Layouts, all of 32-bit pairs: an A operand is rows of pairs along the reduced dimension (a bf16
// row as it lies); a B operand [K/2][N] holds in lane j of pair-row p the two values of column j
// at reduced indices 2p and 2p + 1: `pairs_of_columns` (B = X^T: columns of X^T are rows of X,
// their pairs lie together) or `pairs_of_rows` (B = X: rows 2p and 2p + 1 interleaved).

inline uint32_t ld32(const uint16_t* p) { uint32_t u; std::memcpy(&u, p, sizeof u); return u; }

// C[MR, 16 NV] = A[MR, K2 pairs] B[K2, 16 NV], the accumulators in registers.
template <int MR, int NV>
inline void tile_bf(int K2, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int ldc) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int p = 0; p < K2; ++p) {
    __m512bh b[NV];
    for (int c = 0; c < NV; ++c) b[c] = (__m512bh)_mm512_loadu_si512(B + int64_t(p) * ldb + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(ld32(A + int64_t(r) * lda + 2 * p)));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(C + int64_t(r) * ldc + 16 * c, acc[r][c]);
}

struct BfTile {
  using TA = uint16_t;
  using TB = uint32_t;
  template <int MR, int NV>
  static void run(int K2, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int ldc) {
    tile_bf<MR, NV>(K2, A, lda, B, ldb, C, ldc);
  }
};

// C[M, N] = A[M, 2 K2] B, A bf16 rows (stride lda elements, even), B [K2, N] pairs, N a
// multiple of 16.
void gemm_bf(int M, int N, int K2, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int ldc) {
  gemm_tiles<BfTile>(M, N, K2, A, lda, B, ldb, C, ldc);
}

// dst [width / 2][np] <- pairs of columns of src rows 0..n-1 (stride ld elements): dst[p][j] holds
// src[j][2p], src[j][2p + 1]; lanes j >= n zero. The B operand of X^T for X = src. Sixteen rows
// at a time, one gather a pair-column (a column-by-column copy wrote each 4 bytes to another line).
void pairs_of_columns(const uint16_t* src, int64_t ld, int n, int np, int width, uint32_t* dst) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(int(ld)));
  for (int j = 0; j < np; j += 16) {
    const __mmask16 in = first_lanes(n - j);
    const uint16_t* base = src + int64_t(j < n ? j : 0) * ld;
    for (int p = 0; p < width / 2; ++p)
      _mm512_storeu_si512(dst + int64_t(p) * np + j,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, rows, base + 2 * p, 2));
  }
}

// word indices of two 32-word vectors x, y (y's from 32): x0 y0 x1 y1 ... x15 y15, and from x16
const __m512i kInterleaveLo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                               6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
const __m512i kInterleaveHi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                               54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);

// dst [np / 2][width] <- src rows 0..n-1 (stride ld elements) two by two: dst[p][c] holds
// src[2p][c] (low half) and src[2p + 1][c]; rows n..np-1 read as zero. The B operand of X = src.
void pairs_of_rows(const uint16_t* src, int64_t ld, int n, int np, int width, uint32_t* dst) {
  for (int p = 0; p < np / 2; ++p) {
    const int r0 = 2 * p, r1 = 2 * p + 1;
    uint32_t* out = dst + int64_t(p) * width;
    const uint16_t* a = r0 < n ? src + int64_t(r0) * ld : nullptr;
    const uint16_t* b = r1 < n ? src + int64_t(r1) * ld : nullptr;
    if (a && b) {
      int c = 0;
      for (; c + 32 <= width; c += 32) {  // 32 columns of the two rows, interleaved
        const __m512i x = _mm512_loadu_si512(a + c), y = _mm512_loadu_si512(b + c);
        _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(x, kInterleaveLo, y));
        _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(x, kInterleaveHi, y));
      }
      for (; c < width; ++c) out[c] = uint32_t(a[c]) | uint32_t(b[c]) << 16;
    } else {
      for (int c = 0; c < width; ++c) out[c] = (a ? uint32_t(a[c]) : 0u) | (b ? uint32_t(b[c]) << 16 : 0u);
    }
  }
}

// 16 fp32 lanes -> 16 bf16 at dst (round to nearest even)
inline void st_bf16(uint16_t* dst, v16 x) { _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh((__m512)x)); }

// t [n, np] (bf16) <- the lower triangle of a [n, np] bf16 matrix transposed (see transpose_lower),
// and each row's entries from n up to the next even column zero (the pair the GEMM reads last).
void transpose_lower_bf(int n, int np, const uint16_t* a, uint16_t* t) {
  for (int j = 0; j < n; ++j) {
    uint16_t* row = t + int64_t(j) * np;
    for (int i = j / kTile * kTile; i < j; ++i) row[i] = 0;
    for (int i = j; i < n; ++i) row[i] = a[int64_t(i) * np + j];
    if (n & 1) row[n] = 0;
  }
}

// (user b, head h) forward from bf16 rows; as forward_one.
void forward_one_bf(const Dims& d, int b, int h, int64_t o, int n, const void* q, const void* k, const void* v,
                    void* out, float* save, Scratch& w) {
  ScratchBf& x = w.bf;
  const int np = pad16(n);
  const uint16_t* qs = static_cast<const uint16_t*>(q) + o * d.ldq + h * d.dqk;
  pairs_of_columns(static_cast<const uint16_t*>(k) + o * d.ldk + h * d.dqk, d.ldk, n, np, d.dqk, x.kc.data());
  pairs_of_rows(static_cast<const uint16_t*>(v) + o * d.ldv + h * d.dv, d.ldv, n, np, d.dv, x.vr.data());
  uint16_t* pt = x.p.data();  // this tile's P rows, [kTile, np]
  for (int s = 0; s < n; s += kTile) {
    const int e = s + kTile < n ? s + kTile : n, cols = pad16(e), rows = e - s;
    gemm_bf(rows, cols, d.dqk / 2, qs + int64_t(s) * d.ldq, d.ldq, x.kc.data(), np, w.s.data(), np);
    for (int i = s; i < e; ++i) {  // P = SiLU(S) m over the tile's width, m = 0 where masked; S kept
      const float* sr = w.s.data() + int64_t(i - s) * np;
      uint16_t* pr = pt + int64_t(i - s) * np;
      row_scores(d, code_row(d, b, i), i + 1, cols, sr, w.x.data(), w.m.data());
      std::memcpy(save + int64_t(i) * n, w.x.data(), sizeof(float) * (i + 1));
      for (int j = 0; j < cols; j += 16) {
        const v16 xv = ld16(w.x.data() + j);
        st_bf16(pr + j, xv * vsigmoid(xv) * ld16(w.m.data() + j));
      }
    }
    gemm_bf(rows, d.dv, cols / 2, pt, np, x.vr.data(), d.dv, w.r.data(), d.dv);
    store_rows(w.r.data(), rows, d.dv, d.inv_n, static_cast<char*>(out) + ((o + s) * d.ldo + h * d.dv) * 2, 1,
               d.ldo);
  }
}

// The key side from bf16 (see key_side): a's lower triangle transposed times src's row pairs.
void key_side_bf(const Dims& d, int n, int np, const uint16_t* a, const uint32_t* src_pairs, int width, float scale,
                 void* dst, Scratch& w) {
  ScratchBf& x = w.bf;
  transpose_lower_bf(n, np, a, x.t.data());
  for (int s = 0; s < n; s += kTile) {
    const int e = s + kTile < n ? s + kTile : n;
    gemm_bf(e - s, width, (n - s + 1) / 2, x.t.data() + int64_t(s) * np + s, np, src_pairs + int64_t(s / 2) * width,
            width, w.r.data() + int64_t(s) * width, width);
  }
  store_rows(w.r.data(), n, width, scale, dst, 1, int64_t(d.H) * width);
}

// (user b, head h) backward from bf16 rows; as backward_one.
void backward_one_bf(const Dims& d, int b, int h, int64_t o, int n, const void* q, const void* k, const void* v,
                     const void* dout, const float* save, void* dq, void* dk, void* dv, float* dtable, Scratch& w) {
  ScratchBf& x = w.bf;
  const int np = pad16(n);
  auto out_at = [&](void* base, int dim) { return static_cast<char*>(base) + (o * d.H * dim + int64_t(h) * dim) * 2; };
  const uint16_t* gs = static_cast<const uint16_t*>(dout) + o * d.ldo + h * d.dv;
  pairs_of_columns(static_cast<const uint16_t*>(v) + o * d.ldv + h * d.dv, d.ldv, n, np, d.dv, x.vc.data());
  pairs_of_rows(static_cast<const uint16_t*>(k) + o * d.ldk + h * d.dqk, d.ldk, n, np, d.dqk, x.kr.data());
  pairs_of_rows(static_cast<const uint16_t*>(q) + o * d.ldq + h * d.dqk, d.ldq, n, np, d.dqk, x.qr.data());
  pairs_of_rows(gs, d.ldo, n, np, d.dv, x.gr.data());
  const __m512i masked = _mm512_set1_epi32(d.masked);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int s = 0; s < n; s += kTile) {
    const int e = s + kTile < n ? s + kTile : n, cols = pad16(e), rows = e - s;
    gemm_bf(rows, cols, d.dv / 2, gs + int64_t(s) * d.ldo, d.ldo, x.vc.data(), np, w.s.data(), np);  // dP N
    for (int i = s; i < e; ++i) {  // dS = dP SiLU'(S) m and P again, over the tile's width
      const float* dpr = w.s.data() + int64_t(i - s) * np;
      uint16_t* pr = x.p.data() + int64_t(i) * np;
      float* dsr = w.ds.data() + int64_t(i - s) * np;
      const int32_t* cr = code_row(d, b, i);
      for (int j = 0; j < cols; j += 16) {  // x (the saved S) and m over keys 0..i, zero past them
        const __mmask16 in = first_lanes(i + 1 - j);
        const __mmask16 keep = _mm512_mask_cmpneq_epi32_mask(in, _mm512_maskz_loadu_epi32(in, cr + j), masked);
        const v16 xv = (v16)_mm512_maskz_loadu_ps(in, save + int64_t(i) * n + j);
        const v16 m = (v16)_mm512_maskz_mov_ps(keep, one), sg = vsigmoid(xv);
        st_bf16(pr + j, xv * sg * m);
        st16(dsr + j, ld16(dpr + j) * d.inv_n * sg * (1.f + xv * (1.f - sg)) * m);
      }
      for (int j = 0; j <= i; ++j) dtable[cr[j]] += dsr[j];  // masked pairs add 0 to the masked slot
      uint16_t* dsb = x.ds.data() + int64_t(i) * np;
      for (int j = 0; j < cols; j += 16) st_bf16(dsb + j, ld16(dsr + j) * d.alpha);  // 0 past the diagonal
    }
    // dq rows s..e-1 = dS[s:e, 0:cols] k[0:cols]
    gemm_bf(rows, d.dqk, cols / 2, x.ds.data() + int64_t(s) * np, np, x.kr.data(), d.dqk,
            w.r.data() + int64_t(s) * d.dqk, d.dqk);
  }
  store_rows(w.r.data(), n, d.dqk, 1.f, out_at(dq, d.dqk), 1, int64_t(d.H) * d.dqk);
  // dv = P^T (dout / N), dk = dS^T q
  key_side_bf(d, n, np, x.p.data(), x.gr.data(), d.dv, d.inv_n, out_at(dv, d.dv), w);
  key_side_bf(d, n, np, x.ds.data(), x.qr.data(), d.dqk, 1.f, out_at(dk, d.dqk), w);
}
#endif

// This thread's users: B users split into `parts` ranges of about equal work (n^2 each).
void my_users(const int64_t* offsets, int B, int part, int parts, int* b0, int* b1) {
  double total = 0;
  for (int b = 0; b < B; ++b) total += double(offsets[b + 1] - offsets[b]) * double(offsets[b + 1] - offsets[b]);
  double acc = 0;
  int cut = 0;
  *b0 = part == 0 ? 0 : -1;
  *b1 = B;
  for (int b = 0; b < B && cut < parts - 1; ++b) {
    const double n = double(offsets[b + 1] - offsets[b]);
    acc += n * n;
    while (cut < parts - 1 && acc >= total * (cut + 1) / parts) {
      ++cut;
      if (cut == part) *b0 = b + 1;
      if (cut == part + 1) *b1 = b + 1;
    }
  }
  if (*b0 < 0) *b0 = B;
}

// Denormal floats flushed to zero (FTZ, DAZ) while a thread runs the kernel, its own setting
// restored after: a strongly negative score's sigmoid and the gradients through it fall below
// float's normal range, and each operation on a denormal costs ~100 cycles on x86.
struct FlushDenormals {
#if defined(__x86_64__) || defined(__i386__)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int thread_count() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// 0 where the arguments fit the kernel, else the code the entry points return.
int check(const Dims& d, int B, const int64_t* offsets, int nblocks) {
  if ((d.dqk % 16) || (d.dv % 16) || d.dtype < 0 || d.dtype > 1) return 1;
  for (int b = 0; b < B; ++b)
    if (offsets[b + 1] - offsets[b] > d.L) return 2;
  if (nblocks < 1 || d.rows_per_block < 1 || d.blocks[3 * (nblocks - 1) + 1] < d.L) return 3;
  return 0;
}

// each(w, b, h, o, n) for every (user, head) of the batch, the users split between the OpenMP
// threads (denormals flushed, a scratch each); then done(w) once in every thread.
template <typename Each, typename Done>
void each_head(const Dims& d, int B, const int64_t* offsets, Each each, Done done) {
#pragma omp parallel
  {
    FlushDenormals ftz;
    Scratch w(d);
    int b0, b1;
    my_users(offsets, B, thread_id(), thread_count(), &b0, &b1);
    for (int b = b0; b < b1; ++b) {
      const int64_t o = offsets[b];
      const int n = int(offsets[b + 1] - o);
      for (int h = 0; h < d.H && n; ++h) each(w, b, h, o, n);
    }
    done(w);
  }
}

}  // namespace

extern "C" {

// Forward of a jagged batch of B users (offsets [B + 1]; see the layout above): out [T, H, dv]
// (row stride ldo); save: each user's S, H n^2 floats from save_off[b] (n = its rows). Users
// are split between the OpenMP threads of the caller (PyTorch's pool, where built with it).
int genrec_hstu_train_forward(int B, const int64_t* offsets, int H, int dqk, int dv, int L, int dtype,
                              const void* q, int64_t ldq, const void* k, int64_t ldk, const void* v, int64_t ldv,
                              const int32_t* codes, const int64_t* blocks, int nblocks, const float* table,
                              int32_t masked, float alpha, float inv_n, void* out, int64_t ldo, float* save,
                              const int64_t* save_off) {
  const Dims d{H, dqk, dv, L, dtype, ldq, ldk, ldv, ldo, codes, blocks, int(blocks[1] - blocks[0]), table, masked, alpha,
               inv_n};
  if (int rc = check(d, B, offsets, nblocks)) return rc;
  each_head(
      d, B, offsets,
      [&](Scratch& w, int b, int h, int64_t o, int n) {
        float* sv = save + save_off[b] + int64_t(h) * n * n;
#if GENREC_DPBF16
        if (d.bf()) return forward_one_bf(d, b, h, o, n, q, k, v, out, sv, w);
#endif
        forward_one(d, b, h, o, n, q, k, v, out, sv, w);
      },
      [](Scratch&) {});
  return 0;
}

// Backward: dout [T, H, dv] (row stride ldo); dq [T, H, dqk], dk [T, H, dqk], dv [T, H, dv]
// (contiguous) written; the table's gradient (ntable entries) added to dtable.
int genrec_hstu_train_backward(int B, const int64_t* offsets, int H, int dqk, int dv, int L, int dtype,
                               const void* q, int64_t ldq, const void* k, int64_t ldk, const void* v, int64_t ldv,
                               const int32_t* codes, const int64_t* blocks, int nblocks, const float* table,
                               int32_t masked, float alpha, float inv_n, const void* dout, int64_t ldo,
                               const float* save, const int64_t* save_off, void* dq, void* dk, void* dvo,
                               float* dtable, int ntable) {
  const Dims d{H, dqk, dv, L, dtype, ldq, ldk, ldv, ldo, codes, blocks, int(blocks[1] - blocks[0]), table, masked, alpha,
               inv_n};
  if (int rc = check(d, B, offsets, nblocks)) return rc;
  each_head(
      d, B, offsets,
      [&](Scratch& w, int b, int h, int64_t o, int n) {
        if (w.table_grad.empty()) w.table_grad.assign(ntable, 0.f);  // this thread's, added at the end
        const float* sv = save + save_off[b] + int64_t(h) * n * n;
#if GENREC_DPBF16
        if (d.bf()) return backward_one_bf(d, b, h, o, n, q, k, v, dout, sv, dq, dk, dvo, w.table_grad.data(), w);
#endif
        backward_one(d, b, h, o, n, q, k, v, dout, sv, dq, dk, dvo, w.table_grad.data(), w);
      },
      [&](Scratch& w) {
        if (w.table_grad.empty()) return;
#pragma omp critical
        for (int i = 0; i < ntable; ++i) dtable[i] += w.table_grad[i];
      });
  return 0;
}

// 1 where bf16 inputs run the bf16 GEMMs (built with AVX512-BF16), 0 where they are widened to fp32.
int genrec_hstu_train_bf16_gemms() {
#if GENREC_DPBF16
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
