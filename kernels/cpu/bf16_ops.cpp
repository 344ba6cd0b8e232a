// Pointwise passes over bf16 blocks for the candidates' scoring (kernels/hstu_candidates.py),
// which leaves the GEMMs to oneDNN and runs SiLU between them here.
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

#include <cmath>
#include <cstdint>
#include <cstring>

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
  t = t > 127.f ? 127.f : t;  // exp(-x) past float range: the sigmoid is 0 either way
  float n = std::floor(t), f = t - n;
  float p = ((kC3 * f + kC2) * f + kC1) * f + kC0;
  return x / (1.f + std::ldexp(p, int(n)));
}

#if GENREC_BF16_VEC
// sigmoid(x) = 1 / (1 + 2^(-x log2 e)), 2^t from the cubic on t's fraction
inline __m512 sigmoid16(__m512 x) {
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(-kLog2e));
  __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t), one op
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kC3), f, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC0));
  __m512 e = _mm512_scalef_ps(p, t);  // p * 2^floor(t): +inf past float range, and rcp14(inf) = 0
  return _mm512_rcp14_ps(_mm512_add_ps(e, _mm512_set1_ps(1.f)));
}

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


// 1 where this build's pass is the 16-lane AVX512-BF16 one, 0 where it is lane by lane.
int genrec_bf16_vectorised() {
#if GENREC_BF16_VEC
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
