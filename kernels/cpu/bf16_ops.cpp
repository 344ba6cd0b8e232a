// bf16 passes for the candidates' scoring (kernels/hstu_candidates.py): SiLU over bf16 blocks,
// and the whole candidates-against-a-history attention in one kernel (genrec_candidates_bf16).
//
// Why not oneDNN's SiLU epilogue: its exp is accurate to float rounding, and over a
// [candidates, keys] score block it costs more than half of the GEMM it follows. The block is
// bf16, so SiLU needs to be good to bf16's rounding (2^-9 relative), not to float's: 2^x from a
// cubic on [0, 1) (7.7e-5 relative, fitted on Chebyshev nodes) scaled by its integer part, and
// the hardware's 14-bit reciprocal for the sigmoid, both far inside a bf16 ulp. Rounding back to
// bf16 is to nearest even, as PyTorch's.
//
// Where the target has AVX512-BF16 the pass runs 16 lanes at a time; elsewhere the same
// arithmetic runs lane by lane (correct, not fast: callers choose bf16 for CPUs that have it).
// The fused attention exists only where AVX512-BF16 does (elsewhere it answers "unsupported").

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define GENREC_BF16_VEC 1
#endif

namespace {

constexpr float kC0 = 0.9999278266445146f, kC1 = 0.6957770964274215f, kC2 = 0.2262331941998577f,
                kC3 = 0.07790716377386592f;
constexpr float kLog2e = 1.4426950408889634f;

using genrec_bf16::from_float;
using genrec_bf16::to_float;

inline float silu_scalar(float x) {
  float t = -x * kLog2e;
  // 2^t is +inf past t = 128 (sigmoid 0, SiLU a signed 0) and 0 below -150 (SiLU x): the bounds
  // only keep floor(t) finite and int(n) defined. (A bound of 127 made x in [-88.7, -88.0] read
  // up to 1.6x too large; none below let x past 2.4e38, and +inf, read NaN.)
  t = t > 192.f ? 192.f : (t < -192.f ? -192.f : t);
  float n = std::floor(t), f = t - n;
  float p = ((kC3 * f + kC2) * f + kC1) * f + kC0;
  return x / (1.f + std::ldexp(p, int(n)));
}

#if GENREC_BF16_VEC
// 1 / (1 + 2^t) = sigmoid(x) for t = -x log2 e, 2^t from the cubic on t's fraction
inline __m512 sigmoid16_of_t(__m512 t) {
  __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t), one op
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kC3), f, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC0));
  __m512 e = _mm512_scalef_ps(p, t);  // p * 2^floor(t): +inf past float range, and rcp14(inf) = 0
  return _mm512_rcp14_ps(_mm512_add_ps(e, _mm512_set1_ps(1.f)));
}

// sigmoid(x) = 1 / (1 + 2^(-x log2 e))
inline __m512 sigmoid16(__m512 x) { return sigmoid16_of_t(_mm512_mul_ps(x, _mm512_set1_ps(-kLog2e))); }

inline __m512 silu16(__m512 x) { return _mm512_mul_ps(x, sigmoid16(x)); }

inline __m512 load16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// 64 values from src to dst (the same or apart): four independent chains for the core to
// overlap, two conversions back to bf16
inline void silu64(const uint16_t* src, uint16_t* dst) {
  __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 32);
  __m512 a0 = silu16(widen(_mm512_castsi512_si256(a))), a1 = silu16(widen(_mm512_extracti64x4_epi64(a, 1)));
  __m512 b0 = silu16(widen(_mm512_castsi512_si256(b))), b1 = silu16(widen(_mm512_extracti64x4_epi64(b, 1)));
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(a1, a0));
  _mm512_storeu_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(b1, b0));
}

// g SiLU'(x) = g sg (1 + x (1 - sg)), sg = sigmoid16(x): the forward pass's approximation
inline __m512 silu_grad16(__m512 x, __m512 g) {
  __m512 sg = sigmoid16(x), one = _mm512_set1_ps(1.f);
  __m512 d = _mm512_mul_ps(sg, _mm512_fmadd_ps(x, _mm512_sub_ps(one, sg), one));
  return _mm512_mul_ps(g, d);
}
#endif

inline float silu_grad_scalar(float x, float g) {
  const float sg = x == 0.f ? 0.5f : silu_scalar(x) / x;
  return g * sg * (1.f + x * (1.f - sg));
}

// y[i] = SiLU(x[i]) for i < n, bf16 (raw 16-bit words); y may be x (in place).
void silu_range(int64_t n, const uint16_t* x, uint16_t* y) {
  int64_t i = 0;
#if GENREC_BF16_VEC
  for (; i + 64 <= n; i += 64) silu64(x + i, y + i);
  for (; i + 16 <= n; i += 16) store16(y + i, silu16(load16(x + i, 0xffff)), 0xffff);
  if (i < n) {
    __mmask16 m = __mmask16((1u << (n - i)) - 1);
    store16(y + i, silu16(load16(x + i, m)), m);
    i = n;
  }
#endif
  for (; i < n; ++i) y[i] = from_float(silu_scalar(to_float(x[i])));
}

// out[i] = g[i] SiLU'(x[i]) for i < n, all bf16 (raw 16-bit words): SiLU's backward pass.
void silu_grad_range(int64_t n, const uint16_t* x, const uint16_t* g, uint16_t* out) {
  int64_t i = 0;
#if GENREC_BF16_VEC
  for (; i + 16 <= n; i += 16) store16(out + i, silu_grad16(load16(x + i, 0xffff), load16(g + i, 0xffff)), 0xffff);
  if (i < n) {
    __mmask16 m = __mmask16((1u << (n - i)) - 1);
    store16(out + i, silu_grad16(load16(x + i, m), load16(g + i, m)), m);
    i = n;
  }
#endif
  for (; i < n; ++i) out[i] = from_float(silu_grad_scalar(to_float(x[i]), to_float(g[i])));
}

// Large passes split between the caller's OpenMP threads (PyTorch's pool, kernels/native.py) in
// blocks of kBlock values (a multiple of 64: the same values whatever the split).
constexpr int64_t kBlock = 1 << 16;

#if GENREC_BF16_VEC
// ---- Candidates against one user's history, one head: out = SiLU(q K^T + bias) V ----------
//
// What kernels/hstu_candidates.py ran as two oneDNN GEMMs per block of candidates with a SiLU
// pass between them, in one pass that keeps the scores in registers and the core's L1: for a
// block of kRows candidates, 64 keys at a time, S = q K^T (VDPBF16PS, fp32 sums) plus the bias
// row, SiLU on the fp32 sums, rounded to bf16 into a small buffer (what the GEMM path's bf16
// score block held), then O += P V over kRound keys (VDPBF16PS again). No score block goes
// to memory, none is allocated, and the per-block calls of the Python loop are gone.
//
// Layouts, built once per call (the VDPBF16PS operand that is not broadcast holds pairs of
// values along the sum): keys as [n/16 tiles][d/2 pairs][16 keys] dwords (a dword: the
// pair of a key's consecutive dims), values as [n/2 key pairs][dv] dwords (a dword: one dim of
// two consecutive keys). Keys past n are zero with a zero bias, so their SiLU(0) = 0 adds
// nothing.
constexpr int64_t kKeys = 64;     // keys per score tile: four vectors of 16
constexpr int64_t kRound = 256;   // keys per P V round (the P buffer: rows x 256 bf16)
constexpr int64_t kSpan = 1024;   // keys per span, kept in L2 while every row block reads it

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// The scores arrive as t = -log2(e) x (q and the bias scaled so, once a call), which spares the
// sigmoid its first multiply: t sigmoid(x) = SiLU(x) / -ln 2, and the -ln 2 joins the final scale.
constexpr float kLn2 = 0.6931471805599453f;
inline __m512 silu_t(__m512 t) { return _mm512_mul_ps(t, sigmoid16_of_t(t)); }

// keys k [n, d] fp32 (rows ks apart) -> [n_pad/16 tiles][d/2 pairs][16 keys] dwords of bf16 pairs:
// each key's row rounded to bf16 pairs 16 at a time, its dwords stored 16 apart (plain stores:
// the AVX-512 gathers of a first version took most of the packing's time on Zen 4)
void pack_keys(const float* k, int64_t ks, int64_t n, int64_t d, int64_t n_pad, uint32_t* out) {
  const int64_t pairs = d / 2;
  alignas(64) uint32_t row[16];
  std::memset(out + (n / 16) * pairs * 16, 0, sizeof(uint32_t) * size_t((n_pad / 16 - n / 16) * pairs * 16));
  for (int64_t j = 0; j < n; ++j) {
    uint32_t* o = out + (j / 16) * pairs * 16 + j % 16;
    for (int64_t e = 0; e < d; e += 32) {  // 32 dims: 16 pairs
      const int64_t left = d - e;
      const __mmask16 m0 = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? __mmask16(0xffff) : left > 16 ? __mmask16((1u << (left - 16)) - 1) : 0;
      const __m512 a = _mm512_maskz_loadu_ps(m0, k + j * ks + e), b = _mm512_maskz_loadu_ps(m1, k + j * ks + e + 16);
      _mm512_store_si512(row, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      const int64_t np = left >= 32 ? 16 : left / 2;
      for (int64_t p = 0; p < np; ++p) o[(e / 2 + p) * 16] = row[p];
    }
  }
}

// values v [n, dv] fp32 (rows vs apart) -> [n_pad/2 key pairs][dv] dwords: (v[2j, c], v[2j+1, c]) in bf16
void pack_values(const float* v, int64_t vs, int64_t n, int64_t dv, int64_t n_pad, uint32_t* out) {
  alignas(64) uint16_t order[32];
  for (int w = 0; w < 32; ++w) order[w] = uint16_t(w % 2 ? 16 + w / 2 : w / 2);
  const __m512i idx = _mm512_load_si512(order);
  for (int64_t j = 0; j < n_pad / 2; ++j) {
    uint32_t* o = out + j * dv;
    for (int64_t c = 0; c < dv; c += 16) {
      const __m512 a = 2 * j < n ? _mm512_loadu_ps(v + 2 * j * vs + c) : _mm512_setzero_ps();
      const __m512 b = 2 * j + 1 < n ? _mm512_loadu_ps(v + (2 * j + 1) * vs + c) : _mm512_setzero_ps();
      _mm512_storeu_si512(o + c, _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

// kRows candidate rows (q: kRows rows of 2 x pairs bf16, one after another) against keys [k0, k1)
// (multiples of kKeys): o [kRows][NV * 16] fp32 accumulates; p: the rows' bf16 P buffer
// [kRows][kRound].
template <int kRows, int NV>
void rows_block(const uint16_t* q, int64_t pairs, const uint32_t* kp, const uint32_t* vp, const float* bias,
                int64_t k0, int64_t k1, float* o, uint16_t* p) {
  constexpr int64_t dv = NV * 16;
  for (int64_t r0 = k0; r0 < k1; r0 += kRound) {
    const int64_t r1 = r0 + kRound < k1 ? r0 + kRound : k1;
    for (int64_t c0 = r0; c0 < r1; c0 += kKeys) {
      __m512 acc[kRows][4];
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
      const uint32_t* kt = kp + (c0 / 16) * pairs * 16;  // four tiles of 16 keys
      for (int64_t e = 0; e < pairs; ++e) {
        __m512i b[4];
        for (int i = 0; i < 4; ++i) b[i] = _mm512_loadu_si512(kt + (i * pairs + e) * 16);
        for (int r = 0; r < kRows; ++r) {
          int32_t w;
          std::memcpy(&w, q + (r * pairs + e) * 2, sizeof w);
          const __m512bh a = as_bh(_mm512_set1_epi32(w));
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], a, as_bh(b[i]));
        }
      }
      __m512 bb[4];
      for (int i = 0; i < 4; ++i) bb[i] = _mm512_loadu_ps(bias + c0 + 16 * i);
      for (int r = 0; r < kRows; ++r) {
        uint16_t* pr = p + r * kRound + (c0 - r0);
        const __m512 s0 = silu_t(_mm512_add_ps(acc[r][0], bb[0])), s1 = silu_t(_mm512_add_ps(acc[r][1], bb[1]));
        const __m512 s2 = silu_t(_mm512_add_ps(acc[r][2], bb[2])), s3 = silu_t(_mm512_add_ps(acc[r][3], bb[3]));
        _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(s1, s0));
        _mm512_storeu_si512(pr + 32, (__m512i)_mm512_cvtne2ps_pbh(s3, s2));
      }
    }
    __m512 out[kRows][NV];
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < NV; ++i) out[r][i] = _mm512_loadu_ps(o + r * dv + 16 * i);
    const uint32_t* vt = vp + (r0 / 2) * dv;
    for (int64_t j = 0; j < (r1 - r0) / 2; ++j) {
      __m512i b[NV];
      for (int i = 0; i < NV; ++i) b[i] = _mm512_loadu_si512(vt + j * dv + 16 * i);
      for (int r = 0; r < kRows; ++r) {
        int32_t w;
        std::memcpy(&w, p + r * kRound + 2 * j, sizeof w);
        const __m512bh a = as_bh(_mm512_set1_epi32(w));
        for (int i = 0; i < NV; ++i) out[r][i] = _mm512_dpbf16_ps(out[r][i], a, as_bh(b[i]));
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + r * dv + 16 * i, out[r][i]);
  }
}

template <int kRows, int NV>
void candidates(int64_t c_pad, int64_t n_pad, int64_t d, const uint16_t* qp, const uint32_t* kp, const uint32_t* vp,
                const float* bias, float* obuf) {
  constexpr int64_t dv = NV * 16;
  const int64_t blocks = c_pad / kRows;
  for (int64_t s0 = 0; s0 < n_pad; s0 += kSpan) {
    const int64_t s1 = s0 + kSpan < n_pad ? s0 + kSpan : n_pad;
#pragma omp parallel for schedule(static) if (blocks >= 16)
    for (int64_t b = 0; b < blocks; ++b) {
      alignas(64) uint16_t pbuf[kRows * kRound];
      rows_block<kRows, NV>(qp + b * kRows * d, d / 2, kp, vp, bias, s0, s1, obuf + b * kRows * dv, pbuf);
    }
  }
}
#endif

}  // namespace

extern "C" {

// x[i] = SiLU(x[i]) for i < n, x bf16 (raw 16-bit words), in place.
int genrec_silu_bf16(int64_t n, uint16_t* x) {
#pragma omp parallel for schedule(static) if (n > 4 * kBlock)
  for (int64_t s = 0; s < n; s += kBlock) silu_range(n - s < kBlock ? n - s : kBlock, x + s, x + s);
  return 0;
}

// y[i] = SiLU(x[i]) for i < n, bf16 (raw 16-bit words): one read and one write where a copy
// followed by the in-place pass costs two of each (training keeps x for the backward).
int genrec_silu_bf16_out(int64_t n, const uint16_t* x, uint16_t* y) {
#pragma omp parallel for schedule(static) if (n > 4 * kBlock)
  for (int64_t s = 0; s < n; s += kBlock) silu_range(n - s < kBlock ? n - s : kBlock, x + s, y + s);
  return 0;
}

// out[i] = g[i] SiLU'(x[i]) for i < n, all bf16 (raw 16-bit words): SiLU's backward pass.
int genrec_silu_backward_bf16(int64_t n, const uint16_t* x, const uint16_t* g, uint16_t* out) {
#pragma omp parallel for schedule(static) if (n > 4 * kBlock)
  for (int64_t s = 0; s < n; s += kBlock) silu_grad_range(n - s < kBlock ? n - s : kBlock, x + s, g + s, out + s);
  return 0;
}


// Candidates against one user's history, one head, as kernels/hstu_candidates.py defines it:
//   out[i] = scale (SiLU(alpha q_i K^T + bias) V + SiLU(alpha q_i . ck_i + self_bias) cv_i)
// for candidate rows i < c (q, ck: their queries and own keys [c, d]; cv: own values [c, dv])
// against the user's n keys k [n, d] and values v [n, dv]; bias [n]. All fp32, rows q_s / k_s /
// ... elements apart (unit last stride), out overwritten. The history's part runs in bf16 with
// fp32 sums (above); the candidates' own term in fp32. d even; dv 16, 32, 64 or 128. Returns 0,
// or 1 where the shape or this build (no AVX512-BF16) is not supported.
int genrec_candidates_bf16(int64_t c, int64_t n, int64_t d, int64_t dv, const float* q, int64_t q_s, const float* k,
                           int64_t k_s, const float* v, int64_t v_s, const float* bias, const float* ck, int64_t ck_s,
                           const float* cv, int64_t cv_s, float alpha, float self_bias, float scale, float* out,
                           int64_t out_s) {
#if GENREC_BF16_VEC
  if (c < 0 || n < 0 || d <= 0 || d % 2 || !(dv == 16 || dv == 32 || dv == 64 || dv == 128)) return 1;
  if (c == 0) return 0;
  const int64_t n_pad = (n + kKeys - 1) / kKeys * kKeys;
  const int rows = dv == 128 ? 2 : 5;  // a block's score tile (rows x 4) and P V sums (rows x dv/16) in registers
  const int64_t c_pad = (c + rows - 1) / rows * rows;
  // the packed operands and sums, kept per thread between calls (no fresh megabytes a call)
  thread_local std::vector<float> obuf, bp;
  thread_local std::vector<uint16_t> qp;  // -log2(e) alpha q in bf16
  thread_local std::vector<uint32_t> kp, vp;
  obuf.assign(size_t(c_pad * dv), 0.f);
  if (n_pad > 0) {
    qp.assign(size_t(c_pad * d), 0);  // zero rows past c
    const __m512 al = _mm512_set1_ps(-kLog2e * alpha);
    for (int64_t i = 0; i < c; ++i)
      for (int64_t e = 0; e < d; e += 16) {
        const __mmask16 m = d - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - e)) - 1);
        const __m512 x = _mm512_mul_ps(al, _mm512_maskz_loadu_ps(m, q + i * q_s + e));
        _mm256_mask_storeu_epi16(qp.data() + i * d + e, m, (__m256i)_mm512_cvtneps_pbh(x));
      }
    kp.resize(size_t(n_pad * d / 2));
    vp.resize(size_t(n_pad / 2 * dv));
    bp.assign(size_t(n_pad), 0.f);
    pack_keys(k, k_s, n, d, n_pad, kp.data());
    pack_values(v, v_s, n, dv, n_pad, vp.data());
    for (int64_t j = 0; j < n; ++j) bp[size_t(j)] = -kLog2e * bias[j];
    if (dv == 16) candidates<5, 1>(c_pad, n_pad, d, qp.data(), kp.data(), vp.data(), bp.data(), obuf.data());
    else if (dv == 32) candidates<5, 2>(c_pad, n_pad, d, qp.data(), kp.data(), vp.data(), bp.data(), obuf.data());
    else if (dv == 64) candidates<5, 4>(c_pad, n_pad, d, qp.data(), kp.data(), vp.data(), bp.data(), obuf.data());
    else candidates<2, 8>(c_pad, n_pad, d, qp.data(), kp.data(), vp.data(), bp.data(), obuf.data());
  }
  for (int64_t i = 0; i < c; ++i) {
    __m512 dot = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 16) {
      const __mmask16 m = d - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - e)) - 1);
      dot = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i * q_s + e), _mm512_maskz_loadu_ps(m, ck + i * ck_s + e), dot);
    }
    const float s = alpha * _mm512_reduce_add_ps(dot) + self_bias;
    const float g = s / (1.f + std::exp(-s));
    for (int64_t e = 0; e < dv; ++e) out[i * out_s + e] = scale * (-kLn2 * obuf[size_t(i * dv + e)] + g * cv[i * cv_s + e]);
  }
  return 0;
#else
  (void)c, (void)n, (void)d, (void)dv, (void)q, (void)q_s, (void)k, (void)k_s, (void)v, (void)v_s, (void)bias,
      (void)ck, (void)ck_s, (void)cv, (void)cv_s, (void)alpha, (void)self_bias, (void)scale, (void)out, (void)out_s;
  return 1;
#endif
}

// 1 where this build's pass is the 16-lane AVX512-BF16 one, 0 where it is lane by lane.
int genrec_bf16_vectorised() {
#if GENREC_BF16_VEC
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
