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

}  // namespace

extern "C" {

// y[i] = x[i] * scale where element i is kept, else 0, for i in [0, n); x and y may be the same
// buffer. Elements come in rounds of 16 from 8 hashes: element r 16 + j takes the low half of
// hash r 8 + j, element r 16 + 8 + j its high half (j < 8). Returns 0.
int genrec_dropout_f32(int64_t n, const float* x, float* y, uint64_t seed, uint32_t threshold, float scale) {
  const u64x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t whole = n / 16 * 16;
  for (int64_t s = 0; s < n; s += 16) {
    const u64x8 h = mix(seed + (uint64_t(s / 2) + lane) * kGolden);
    const u32x8 lo = __builtin_convertvector(h, u32x8), hi = __builtin_convertvector(h >> 32, u32x8);
    if (s < whole) {
      apply8(x + s, y + s, lo, threshold, scale);
      apply8(x + s + 8, y + s + 8, hi, threshold, scale);
    } else {  // the last partial round, element by element
      for (int64_t i = s; i < n; ++i) {
        const int j = int(i - s);
        const uint32_t d = j < 8 ? lo[j] : hi[j - 8];
        y[i] = d >= threshold ? x[i] * scale : 0.0f;
      }
    }
  }
  return 0;
}

}  // extern "C"
