// Dropout's mask from a counter-based hash, applied in the same pass (kernels/dropout.py).
//
// Why: PyTorch's CPU generator (mt19937) draws one value at a time on one thread, several times
// the cost of the pass that applies the mask, and the HSTU training step has seven masks over
// [tokens, 64]. Here the keep decision for element i is a pure function of (seed, i): the
// SplitMix64 finalizer (a full-avalanche 64-bit mix) of seed + i' * the golden ratio (a Weyl
// sequence), one hash for two elements (its low and high halves). The same call with the same
// seed writes the same mask, so the backward pass recomputes it instead of keeping it.
// Element i is kept when its 32-bit draw >= threshold (threshold = round(p 2^32)), then scaled.
// GCC/Clang vector extensions, 8 hashes a round (64-bit multiplies with AVX-512 DQ where
// -march=native has it; lane by lane elsewhere, the same values).

#include <cstdint>

namespace {

typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

inline u64x8 mix(u64x8 z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// y[0..8) from x[0..8) where draw >= threshold (kept, scaled), else 0.
inline void apply8(const float* x, float* y, u32x8 draw, uint32_t threshold, float scale) {
  f32x8 v;
  __builtin_memcpy(&v, x, sizeof v);
  const i32x8 keep = draw >= threshold;  // all ones where kept
  const f32x8 out = keep ? v * scale : f32x8{};
  __builtin_memcpy(y, &out, sizeof out);
}

// The same for bf16 (raw uint16 bits): widened to float, scaled, rounded to nearest even (NaN
// kept a NaN).
inline void apply8_bf16(const uint16_t* x, uint16_t* y, u32x8 draw, uint32_t threshold, float scale) {
  u16x8 h;
  __builtin_memcpy(&h, x, sizeof h);
  u32x8 bits = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  __builtin_memcpy(&v, &bits, sizeof v);
  const i32x8 keep = draw >= threshold;
  v = keep ? v * scale : f32x8{};
  __builtin_memcpy(&bits, &v, sizeof bits);
  const u32x8 nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const u32x8 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u16x8 out = __builtin_convertvector(nan ? (bits >> 16) | 0x40u : rounded, u16x8);
  __builtin_memcpy(y, &out, sizeof out);
}

template <typename T, void (*Apply)(const T*, T*, u32x8, uint32_t, float)>
int dropout(int64_t n, const T* x, T* y, uint64_t seed, uint32_t threshold, float scale) {
  const u64x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t s = 0; s < n; s += 16) {
    const u64x8 h = mix(seed + (uint64_t(s / 2) + lane) * kGolden);
    const u32x8 lo = __builtin_convertvector(h, u32x8), hi = __builtin_convertvector(h >> 32, u32x8);
    if (s + 16 <= n) {
      Apply(x + s, y + s, lo, threshold, scale);
      Apply(x + s + 8, y + s + 8, hi, threshold, scale);
    } else {  // the last partial round: through a padded copy
      T in[16] = {}, out[16];
      for (int64_t i = s; i < n; ++i) in[i - s] = x[i];
      Apply(in, out, lo, threshold, scale);
      Apply(in + 8, out + 8, hi, threshold, scale);
      for (int64_t i = s; i < n; ++i) y[i] = out[i - s];
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// y[i] = x[i] * scale where element i is kept, else 0, for i in [0, n); x and y may be the same
// buffer. Elements come in rounds of 16 from 8 hashes: element r 16 + j takes the low half of
// hash r 8 + j, element r 16 + 8 + j its high half (j < 8). Returns 0.
int genrec_dropout_f32(int64_t n, const float* x, float* y, uint64_t seed, uint32_t threshold, float scale) {
  return dropout<float, apply8>(n, x, y, seed, threshold, scale);
}

// The same over bf16 values (their raw bits), the same mask for the same (seed, n).
int genrec_dropout_bf16(int64_t n, const uint16_t* x, uint16_t* y, uint64_t seed, uint32_t threshold, float scale) {
  return dropout<uint16_t, apply8_bf16>(n, x, y, seed, threshold, scale);
}

}  // extern "C"
