// The HSTU tower's serving steps (history encoding and candidate scoring) on CPU, one call
// per step for the whole batch: every layer's LayerNorm, fused uvqk GEMM, SiLU, relative-bias
// attention over the causal pairs only, U gate and output GEMM in tight loops over packed rows,
// with no framework operator between them (kernels/native.py builds and loads it; serve/native.py
// calls it), and around them the tower's final norm and the exact top-k retrieval over the
// catalogue, so a batch's model work crosses into Python only between steps. fp32 throughout;
// GCC/Clang vector extensions (8 floats; the GEMM tiles and SiLU 16 where the target has
// AVX-512), so it builds on any target and vectorises with -march=native.
//
// Layout (row-major, packed: user b's history rows are offsets[b]..offsets[b+1]-1):
//   x     [T, D]        token inputs (item row (+ action row)) * scale + position embedding
//   z     [T, G]        SiLU(LN(x) W_uvqk + b), G = H*(2 Dv + 2 Dqk), columns u | v | q | k, head-major
//   cache k [T, H*Dqk], v [T, H*Dv] per layer, for the candidates
// A layer's parameters come as 9 pointers (see Param); the bias table is kernels.hstu_attention's
// bias_table: table[distance * nb + time bucket]. Pairs the mask forbids are skipped, not biased.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64)));  // the GEMM's tiles and SiLU (see gemm, silu_inplace)
#endif

typedef int32_t v16i __attribute__((vector_size(64)));

template <class V = v8f>
inline V ld(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <class V>
inline void st(float* p, V v) { std::memcpy(p, &v, sizeof v); }
template <class V = v8f>
inline V splat(float a) { V v; for (unsigned i = 0; i < sizeof v / sizeof a; ++i) v[i] = a; return v; }
template <class V> struct IntOf;
template <> struct IntOf<v8f> { typedef v8i type; };
#if defined(__AVX512F__)
template <> struct IntOf<v16f> { typedef v16i type; };
#endif

// exp(x) for x in float range: Cephes' expf reduction and polynomial (~1 ulp), lane-wise (the
// same operations at either vector width, so 8- and 16-float results are bit-identical).
template <class V>
inline V vexp(V x) {
  typedef typename IntOf<V>::type I;
  x = x > splat<V>(88.3762626647949f) ? splat<V>(88.3762626647949f) : x;
  x = x < splat<V>(-87.3365478515625f) ? splat<V>(-87.3365478515625f) : x;
  V fx = x * splat<V>(1.44269504088896341f) + splat<V>(0.5f);
  V t = __builtin_convertvector(__builtin_convertvector(fx, I), V);  // trunc
  fx = t > fx ? t - splat<V>(1.0f) : t;                                // floor
  x = x - fx * splat<V>(0.693359375f) - fx * splat<V>(-2.12194440e-4f);
  V y = splat<V>(1.9875691500e-4f);
  y = y * x + splat<V>(1.3981999507e-3f);
  y = y * x + splat<V>(8.3334519073e-3f);
  y = y * x + splat<V>(4.1665795894e-2f);
  y = y * x + splat<V>(1.6666665459e-1f);
  y = y * x + splat<V>(5.0000001201e-1f);
  y = y * x * x + x + splat<V>(1.0f);
  I e = (__builtin_convertvector(fx, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

template <class V>
inline V vsilu(V x) { return x / (splat<V>(1.0f) + vexp(-x)); }

// SiLU in place: 16 floats at a time where the target has AVX-512, then 8, then the tail.
void silu_inplace(float* p, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) st(p + i, vsilu(ld<v16f>(p + i)));
#endif
  for (; i + 8 <= n; i += 8) st(p + i, vsilu(ld(p + i)));
  if (i < n) {
    float tmp[8] = {0};
    std::memcpy(tmp, p + i, sizeof(float) * (n - i));
    st(tmp, vsilu(ld(tmp)));
    std::memcpy(p + i, tmp, sizeof(float) * (n - i));
  }
}

// C[MR, W NV] (+)= A[MR, K] B[K, W NV], W floats a vector V, the accumulators in registers.
template <class V, int MR, int NV>
inline void tile(int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc) {
  constexpr int W = sizeof(V) / sizeof(float);
  V c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? ld<V>(C + r * ldc + W * v) : V{};
  for (int k = 0; k < K; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = ld<V>(B + (size_t)k * ldb + W * v);
    for (int r = 0; r < MR; ++r) {
      V a = V{} + A[(size_t)r * lda + k];  // broadcast
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) st(C + (size_t)r * ldc + W * v, c[r][v]);
}

template <class V, int NV>
inline void rows_tile(int mr, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc) {
  switch (mr) {
    case 1: tile<V, 1, NV>(K, A, lda, B, ldb, C, ldc, acc); break;
    case 2: tile<V, 2, NV>(K, A, lda, B, ldb, C, ldc, acc); break;
    case 3: tile<V, 3, NV>(K, A, lda, B, ldb, C, ldc, acc); break;
    case 4: tile<V, 4, NV>(K, A, lda, B, ldb, C, ldc, acc); break;
    case 5: tile<V, 5, NV>(K, A, lda, B, ldb, C, ldc, acc); break;
    default: tile<V, 6, NV>(K, A, lda, B, ldb, C, ldc, acc); break;
  }
}

// C[M, N] (+)= A[M, K] B[K, N]; N a multiple of 8. Each output is one FMA chain over k in
// order, whatever the tile width. With AVX-512 (full-width FMA units on e.g. Zen 5), 16-float
// vectors do twice the work per instruction: 32- and 16-column tiles, 8 for the rest.
void gemm(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool acc) {
  for (int i = 0; i < M; i += 6) {
    int mr = M - i < 6 ? M - i : 6;
    const float* a = A + (size_t)i * lda;
    float* c = C + (size_t)i * ldc;
    int j = 0;
#if defined(__AVX512F__)
    for (; j + 32 <= N; j += 32) rows_tile<v16f, 2>(mr, K, a, lda, B + j, ldb, c + j, ldc, acc);
    if (j + 16 <= N) {
      rows_tile<v16f, 1>(mr, K, a, lda, B + j, ldb, c + j, ldc, acc);
      j += 16;
    }
#else
    for (; j + 16 <= N; j += 16) rows_tile<v8f, 2>(mr, K, a, lda, B + j, ldb, c + j, ldc, acc);
#endif
    if (j < N) rows_tile<v8f, 1>(mr, K, a, lda, B + j, ldb, c + j, ldc, acc);
  }
}

// y[r] = LayerNorm(x[r]) (eps 1e-5, biased variance, affine), rows of n values.
void layer_norm(int rows, int n, const float* x, int ldx, const float* w, const float* b, float* y, int ldy) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + (size_t)r * ldx;
    float* yr = y + (size_t)r * ldy;
    float mean = 0.f, var = 0.f;
    for (int i = 0; i < n; ++i) mean += xr[i];
    mean /= n;
    for (int i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    float inv = 1.0f / std::sqrt(var / n + 1e-5f);
    for (int i = 0; i < n; ++i) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
  }
}

// The 9 parameter pointers of one layer, in this order.
enum Param { LN_W, LN_B, UVQK_WT, UVQK_B, ON_W, ON_B, OUT_WT, OUT_B, TABLE, P_COUNT };

struct Dims {
  int D, H, dqk, dv, n, nb;  // model dim, heads, head dims, max_seq_len, time buckets
  float alpha;
  int G() const { return H * (2 * dv + 2 * dqk); }
  int U() const { return H * dv; }
};

// Time bucket of a gap: thresholds[b] is the smallest gap in bucket >= b (kernels/native.py
// derives them from kernels.hstu_attention.time_bucket itself, so the two agree exactly).
inline int bucket(int64_t dt, const int64_t* thr, int nb) {
  if (dt <= 0 || nb <= 1) return 0;
  int lo = 0, hi = nb - 1;  // largest b with thr[b] <= dt
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (thr[mid] <= dt) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// SiLU(LN(x) W + b) for `rows` rows -> z [rows, G].
void uvqk(const Dims& d, const float* const* p, int rows, const float* x, int ldx, float* y, float* z) {
  layer_norm(rows, d.D, x, ldx, p[LN_W], p[LN_B], y, d.D);
  int G = d.G();
  for (int r = 0; r < rows; ++r) std::memcpy(z + (size_t)r * G, p[UVQK_B], sizeof(float) * G);
  gemm(rows, G, d.D, y, d.D, p[UVQK_WT], G, z, G, true);
  silu_inplace(z, rows * G);
}

// x[r] += out(u[r] * LN_out(attn[r] / n)) + out_b for `rows` rows (attn [rows, H Dv] is overwritten).
void gate(const Dims& d, const float* const* p, int rows, float* attn, const float* z, float* x, int ldx) {
  int U = d.U(), G = d.G();
  float inv_n = 1.0f / d.n;
  for (int r = 0; r < rows; ++r) {
    float* a = attn + (size_t)r * U;
    for (int i = 0; i < U; ++i) a[i] *= inv_n;
    layer_norm(1, U, a, U, p[ON_W], p[ON_B], a, U);
    const float* u = z + (size_t)r * G;
    for (int i = 0; i < U; ++i) a[i] *= u[i];
    float* xr = x + (size_t)r * ldx;
    for (int i = 0; i < d.D; ++i) xr[i] += p[OUT_B][i];
  }
  gemm(rows, d.D, U, attn, U, p[OUT_WT], d.D, x, ldx, true);
}

// The last layer, read at each of B sequences' last rows only (row ends[b] - 1 of x [., D] and
// z [., G]; al [B, U]: their attention): out [B, D] = those rows of x after the gate.
void gate_last(const Dims& d, const float* const* p, int B, const int64_t* ends, const float* x, const float* z,
               float* al, float* out) {
  const int D = d.D, G = d.G();
  std::vector<float> zl((size_t)B * G);
  for (int b = 0; b < B; ++b) {
    const int64_t row = ends[b] - 1;
    std::memcpy(out + (size_t)b * D, x + (size_t)row * D, sizeof(float) * D);
    std::memcpy(zl.data() + (size_t)b * G, z + (size_t)row * G, sizeof(float) * G);
  }
  gate(d, p, B, al, zl.data(), out, D);
}

// kT [dqk, hp] (zero past h) <- the k columns of head `hd` of rows k[h, ldk].
void transpose_keys(int h, int hp, int dqk, const float* k, int ldk, float* kT) {
  for (int c = 0; c < dqk; ++c) {
    float* row = kT + (size_t)c * hp;
    for (int j = 0; j < h; ++j) row[j] = k[(size_t)j * ldk + c];
    for (int j = h; j < hp; ++j) row[j] = 0.f;
  }
}

inline int pad8(int x) { return (x + 7) & ~7; }

// Whether event times tk[0..h-1] never decrease (then a row's time buckets can be walked).
inline bool in_order(const int64_t* tk, int h, int nb) {
  bool ordered = nb > 1;
  for (int j = 1; j < h && ordered; ++j) ordered = tk[j] >= tk[j - 1];
  return ordered;
}

// Bias codes of a query at position pos and time q against keys 0..pos (event times tk):
// row[j] = distance * nb + time bucket. With times in order the gaps grow as j falls, so one
// walk up the thresholds replaces a binary search per pair.
inline void query_codes(int pos, int64_t q, const int64_t* tk, bool ordered, const int64_t* thr, int n, int nb,
                        int32_t* row) {
  if (ordered) {
    int bk = 0;
    for (int j = pos; j >= 0; --j) {
      const int64_t dt = q - tk[j];
      while (dt > 0 && bk + 1 < nb && thr[bk + 1] <= dt) ++bk;
      row[j] = std::min(pos - j, n - 1) * nb + bk;
    }
  } else {
    for (int j = 0; j <= pos; ++j) row[j] = std::min(pos - j, n - 1) * nb + (nb > 1 ? bucket(q - tk[j], thr, nb) : 0);
  }
}


// IEEE half -> float (the fp16 scale and bias of fbgemm's row-wise quantized rows, fp16 tables).
inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: normalise
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400u));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

extern "C" {

// Encode B histories: x [T, D] (modified), offsets [B + 1], tq / tk [T] query / event times
// (int64, any origin; ignored when nb == 1), time thresholds [nb]. Writes every layer's k / v
// rows to kc [L, T, H Dqk] / vc [L, T, H Dv] and each history's last row after the last
// layer to out [B, D] (before the tower's final norm). params: L * P_COUNT pointers.
int genrec_hstu_encode(int L, const float* const* params, int D, int H, int dqk, int dv, int n, int nb, float alpha,
                       const int64_t* thr, int B, const int64_t* offsets, const int64_t* tq, const int64_t* tk,
                       float* x, float* kc, float* vc, float* out) {
  Dims d{D, H, dqk, dv, n, nb, alpha};
  const int T = (int)offsets[B], G = d.G(), U = d.U();
  const int BLOCK = 64;
  std::vector<float> y((size_t)T * D), z((size_t)T * G), attn((size_t)T * U);
  int hmax = 0;
  for (int b = 0; b < B; ++b) hmax = std::max(hmax, (int)(offsets[b + 1] - offsets[b]));
  const int hp_max = pad8(hmax);
  std::vector<float> kT((size_t)dqk * hp_max), S((size_t)BLOCK * hp_max);
  // bias codes of the causal pairs, per user [h, h] (row i: keys 0..i), shared by the layers
  std::vector<size_t> code_at(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    size_t h = offsets[b + 1] - offsets[b];
    code_at[b + 1] = code_at[b] + h * h;
  }
  std::vector<int32_t> codes(code_at[B]);
  for (int b = 0; b < B; ++b) {
    const int h = (int)(offsets[b + 1] - offsets[b]);
    const int64_t o = offsets[b];
    int32_t* cb = codes.data() + code_at[b];
    const bool ordered = in_order(tk + o, h, nb);  // (the usual case: query_codes walks the buckets)
    for (int i = 0; i < h; ++i) query_codes(i, tq[o + i], tk + o, ordered, thr, n, nb, cb + (size_t)i * h);
  }
  std::vector<float> al((size_t)B * U);
  for (int l = 0; l < L; ++l) {
    const float* const* p = params + (size_t)l * P_COUNT;
    const float* table = p[TABLE];
    const bool last = l == L - 1;
    uvqk(d, p, T, x, D, y.data(), z.data());
    float* kcl = kc + (size_t)l * T * H * dqk;
    float* vcl = vc + (size_t)l * T * U;
    for (int t = 0; t < T; ++t) {
      const float* zr = z.data() + (size_t)t * G;
      std::memcpy(vcl + (size_t)t * U, zr + U, sizeof(float) * U);
      std::memcpy(kcl + (size_t)t * H * dqk, zr + 2 * U + H * dqk, sizeof(float) * H * dqk);
    }
    for (int b = 0; b < B; ++b) {
      const int h = (int)(offsets[b + 1] - offsets[b]), hp = pad8(h);
      const int64_t o = offsets[b];
      const int32_t* cb = codes.data() + code_at[b];
      const float* zb = z.data() + (size_t)o * G;
      for (int hd = 0; hd < H; ++hd) {
        const int vcol = U + hd * dv, qcol = 2 * U + hd * dqk, kcol = 2 * U + H * dqk + hd * dqk;
        transpose_keys(h, hp, dqk, zb + kcol, G, kT.data());
        const int s0 = last ? h - 1 : 0;  // the last layer: only each history's last row is read
        for (int s = s0; s < h; s += BLOCK) {
          const int e = std::min(s + BLOCK, h), r = e - s, ep = pad8(e);
          // scores of rows s..e-1 against keys 0..e-1, in a [r, ep] block with row stride hp
          gemm(r, ep, dqk, zb + (size_t)s * G + qcol, G, kT.data(), hp, S.data(), hp, false);
          for (int i = 0; i < r; ++i) {
            float* si = S.data() + (size_t)i * hp;
            const int32_t* ci = cb + (size_t)(s + i) * h;
            const int nk = s + i + 1;  // keys 0..s+i
            for (int j = 0; j < nk; ++j) si[j] = alpha * si[j] + table[ci[j]];
            silu_inplace(si, nk);
            for (int j = nk; j < ep; ++j) si[j] = 0.f;
          }
          float* dst = last ? al.data() + (size_t)b * U + hd * dv : attn.data() + (size_t)(o + s) * U + hd * dv;
          gemm(r, dv, e, S.data(), hp, zb + vcol, G, dst, U, false);
        }
      }
    }
    if (!last)
      gate(d, p, T, attn.data(), z.data(), x, D);
    else
      gate_last(d, p, B, offsets + 1, x, z.data(), al.data(), out);
  }
  return 0;
}

// Extend W cached histories by their new rows (an engine cache's warm call): x [Tn, D] the new
// rows' inputs (modified), packed by history in order, qoff [W + 1] their offsets; history w
// has prefix[w] cached rows and lens[w] rows in all (so lens[w] - prefix[w] new ones). Layer l's
// keys and values are rows of kl[l] [., H Dqk] / vl[l] [., H Dv]: row t of history w is row
// slots[w ld + t] (an SGLang pool's slot map), or w ld + t where slots is null (an engine
// cache's storage, ld its capacity). Rows 0..prefix-1 are read, the new rows' are written,
// layer by layer, before they are attended to. tq [Tn]: the new rows' query times, tk [W, ld]:
// every row's event time (ignored when nb == 1). Each history's last row after the last layer
// goes to out [W, D] (before the final norm): what encode gives for the whole history, its
// cached rows' keys and values reused.
int genrec_hstu_extend(int L, const float* const* params, int D, int H, int dqk, int dv, int n, int nb, float alpha,
                       const int64_t* thr, int W, const int64_t* prefix, const int64_t* lens, const int64_t* qoff,
                       const int64_t* tq, const int64_t* tk, int ld, const int64_t* slots, float* x,
                       float* const* kl, float* const* vl, float* out) {
  Dims d{D, H, dqk, dv, n, nb, alpha};
  const int Tn = (int)qoff[W], G = d.G(), U = d.U(), KW = H * dqk;
  const int BLOCK = 64;
  if (dqk > 256) return -1;  // (the few-rows path keeps [dqk, 8] queries on the stack)
  for (int w = 0; w < W; ++w)
    if (lens[w] > ld || prefix[w] < 0 || lens[w] - prefix[w] != qoff[w + 1] - qoff[w] || qoff[w + 1] == qoff[w])
      return -1;
  std::vector<float> y((size_t)Tn * D), z((size_t)Tn * G), attn((size_t)Tn * U);
  int hmax = 0;
  for (int w = 0; w < W; ++w) hmax = std::max(hmax, (int)lens[w]);
  const int hp_max = pad8(hmax);
  std::vector<float> kT((size_t)dqk * hp_max), S((size_t)BLOCK * hp_max), ST((size_t)8 * hp_max);
  std::vector<float> kg(slots ? (size_t)hp_max * KW : 0), vg(slots ? (size_t)hp_max * U : 0);
  // bias codes of each new row against the keys it sees (its history's rows up to itself),
  // shared by the layers: [r, h] per history, row i's keys 0..prefix+i
  std::vector<size_t> code_at(W + 1, 0);
  for (int w = 0; w < W; ++w) code_at[w + 1] = code_at[w] + (size_t)(qoff[w + 1] - qoff[w]) * lens[w];
  std::vector<int32_t> codes(code_at[W]);
  for (int w = 0; w < W; ++w) {
    const int h = (int)lens[w], p0 = (int)prefix[w], r = h - p0;
    const int64_t* tkw = tk + (size_t)w * ld;
    const bool ordered = in_order(tkw, h, nb);
    for (int i = 0; i < r; ++i)
      query_codes(p0 + i, tq[qoff[w] + i], tkw, ordered, thr, n, nb, codes.data() + code_at[w] + (size_t)i * h);
  }
  std::vector<float> al((size_t)W * U);
  for (int l = 0; l < L; ++l) {
    const float* const* p = params + (size_t)l * P_COUNT;
    const float* table = p[TABLE];
    const bool last = l == L - 1;
    uvqk(d, p, Tn, x, D, y.data(), z.data());
    for (int w = 0; w < W; ++w) {
      const int p0 = (int)prefix[w], h = (int)lens[w];
      const int64_t q0 = qoff[w];
      const int64_t* sw = slots ? slots + (size_t)w * ld : nullptr;
      for (int t = p0; t < h; ++t) {  // the new rows' keys and values, after the cached ones
        const float* zr = z.data() + (size_t)(q0 + t - p0) * G;
        const int64_t row = sw ? sw[t] : (int64_t)w * ld + t;
        std::memcpy(vl[l] + row * U, zr + U, sizeof(float) * U);
        std::memcpy(kl[l] + row * KW, zr + 2 * U + KW, sizeof(float) * KW);
      }
      const float* kw = kl[l] + (size_t)w * ld * KW;  // the history's rows, in order
      const float* vw = vl[l] + (size_t)w * ld * U;
      if (sw) {  // rows scattered over a pool: gathered in order (reads in place, one pass)
        for (int t = 0; t < h; ++t) {
          std::memcpy(kg.data() + (size_t)t * KW, kl[l] + sw[t] * KW, sizeof(float) * KW);
          std::memcpy(vg.data() + (size_t)t * U, vl[l] + sw[t] * U, sizeof(float) * U);
        }
        kw = kg.data();
        vw = vg.data();
      }
      const int r = h - p0, hp = pad8(h);
      const int32_t* cw = codes.data() + code_at[w];
      const float* zw = z.data() + (size_t)q0 * G;
      for (int hd = 0; hd < H; ++hd) {
        const int qcol = 2 * U + hd * dqk;
        const int s0 = last ? r - 1 : 0;  // the last layer: only the history's last row is read
        // few query rows (a warm call's usual few new events, the last layer's one): their scores
        // as K q^T straight from the stored keys' rows ([keys, 8], then turned); more: against
        // the keys transposed once (as encode), which costs a pass over every key column
        const bool few = r - s0 <= 8;
        if (!few) transpose_keys(h, hp, dqk, kw + hd * dqk, KW, kT.data());
        for (int s = s0; s < r; s += BLOCK) {
          const int e = std::min(s + BLOCK, r), rr = e - s, keys = p0 + e, kp = pad8(keys);
          if (few) {
            float qT[256 * 8] = {0};  // [dqk, 8], the rows' queries as columns (dqk <= 256)
            for (int i = 0; i < rr; ++i)
              for (int t = 0; t < dqk; ++t) qT[t * 8 + i] = zw[(size_t)(s + i) * G + qcol + t];
            gemm(keys, 8, dqk, kw + hd * dqk, KW, qT, 8, ST.data(), 8, false);
            for (int i = 0; i < rr; ++i)
              for (int j = 0; j < keys; ++j) S[(size_t)i * hp + j] = ST[(size_t)j * 8 + i];
          } else {
            gemm(rr, kp, dqk, zw + (size_t)s * G + qcol, G, kT.data(), hp, S.data(), hp, false);
          }
          for (int i = 0; i < rr; ++i) {
            float* si = S.data() + (size_t)i * hp;
            const int32_t* ci = cw + (size_t)(s + i) * h;
            const int nk = p0 + s + i + 1;  // keys 0..its own position
            for (int j = 0; j < nk; ++j) si[j] = alpha * si[j] + table[ci[j]];
            silu_inplace(si, nk);
            for (int j = nk; j < kp; ++j) si[j] = 0.f;
          }
          float* dst = last ? al.data() + (size_t)w * U + hd * dv : attn.data() + (size_t)(q0 + s) * U + hd * dv;
          gemm(rr, dv, keys, S.data(), hp, vw + hd * dv, U, dst, U, false);
        }
      }
    }
    if (!last)
      gate(d, p, Tn, attn.data(), z.data(), x, D);
    else
      gate_last(d, p, W, qoff + 1, x, z.data(), al.data(), out);
  }
  return 0;
}

// Score candidates against encoded histories: x [N, D] candidate inputs (modified: the tower's
// output before its final norm), grouped by user: cand_offsets [U + 1], user [U] (the batch
// history each group reads). A candidate sits at position h (its history's length) at the
// request time (the query time of the history's last row), sees every history row and itself.
// Layer l's history keys / values are rows of kl[l] [., H Dqk] / vl[l] [., H Dv]: packed row r
// (offsets' numbering) at row slots[r], or r where slots is null; read where they lie.
int genrec_hstu_score(int L, const float* const* params, int D, int H, int dqk, int dv, int n, int nb, float alpha,
                      const int64_t* thr, const int64_t* offsets, const int64_t* tq, const int64_t* tk,
                      const float* const* kl, const float* const* vl, const int64_t* slots, int Uc,
                      const int64_t* cand_offsets, const int64_t* user, float* x) {
  Dims d{D, H, dqk, dv, n, nb, alpha};
  const int N = (int)cand_offsets[Uc], G = d.G(), U = d.U();
  std::vector<float> y((size_t)N * D), z((size_t)N * G), attn((size_t)N * U);
  int hmax = 0, cmax = 0;
  std::vector<size_t> code_at(Uc + 1, 0);
  for (int g = 0; g < Uc; ++g) {
    int b = (int)user[g];
    int h = (int)(offsets[b + 1] - offsets[b]);
    hmax = std::max(hmax, h);
    cmax = std::max(cmax, (int)(cand_offsets[g + 1] - cand_offsets[g]));
    code_at[g + 1] = code_at[g] + h;
  }
  const int hp_max = pad8(hmax);
  std::vector<float> kT((size_t)dqk * hp_max), S((size_t)cmax * hp_max), vg(slots ? (size_t)hp_max * dv : 0);
  std::vector<int32_t> codes(code_at[Uc]);  // a candidate's code against each history row
  for (int g = 0; g < Uc; ++g) {
    int b = (int)user[g];
    const int64_t o = offsets[b];
    const int h = (int)(offsets[b + 1] - o);
    const int64_t req = tq[o + h - 1];
    for (int j = 0; j < h; ++j)
      codes[code_at[g] + j] = std::min(h - j, n - 1) * nb + (nb > 1 ? bucket(req - tk[o + j], thr, nb) : 0);
  }
  for (int l = 0; l < L; ++l) {
    const float* const* p = params + (size_t)l * P_COUNT;
    const float* table = p[TABLE];
    const float* kcl = kl[l];
    const float* vcl = vl[l];
    uvqk(d, p, N, x, D, y.data(), z.data());
    for (int g = 0; g < Uc; ++g) {
      const int b = (int)user[g];
      const int64_t o = offsets[b];
      const int h = (int)(offsets[b + 1] - o), hp = pad8(h);
      const int c0 = (int)cand_offsets[g], c = (int)(cand_offsets[g + 1] - c0);
      if (c == 0) continue;
      const int32_t* cg = codes.data() + code_at[g];
      const float* zg = z.data() + (size_t)c0 * G;
      for (int hd = 0; hd < H; ++hd) {
        const int vcol = U + hd * dv, qcol = 2 * U + hd * dqk, kcol = 2 * U + H * dqk + hd * dqk;
        if (slots) {  // rows scattered over a pool: keys transposed and values gathered from their slots
          const int64_t* so = slots + o;
          for (int j = 0; j < h; ++j) {
            const float* kr = kcl + so[j] * H * dqk + hd * dqk;
            for (int t = 0; t < dqk; ++t) kT[(size_t)t * hp + j] = kr[t];
            std::memcpy(vg.data() + (size_t)j * dv, vcl + so[j] * U + hd * dv, sizeof(float) * dv);
          }
          for (int t = 0; t < dqk; ++t)
            for (int j = h; j < hp; ++j) kT[(size_t)t * hp + j] = 0.f;
        } else {
          transpose_keys(h, hp, dqk, kcl + (size_t)o * H * dqk + hd * dqk, H * dqk, kT.data());
        }
        gemm(c, hp, dqk, zg + qcol, G, kT.data(), hp, S.data(), hp, false);
        for (int i = 0; i < c; ++i) {
          float* si = S.data() + (size_t)i * hp;
          for (int j = 0; j < h; ++j) si[j] = alpha * si[j] + table[cg[j]];
          silu_inplace(si, h);
          for (int j = h; j < hp; ++j) si[j] = 0.f;
        }
        float* dst = attn.data() + (size_t)c0 * U + hd * dv;
        if (slots)
          gemm(c, dv, h, S.data(), hp, vg.data(), dv, dst, U, false);
        else
          gemm(c, dv, h, S.data(), hp, vcl + (size_t)o * U + hd * dv, U, dst, U, false);
        for (int i = 0; i < c; ++i) {  // ... and itself: distance 0 at the request time (table[0])
          const float* zi = zg + (size_t)i * G;
          float s = 0.f;
          for (int t = 0; t < dqk; ++t) s += zi[qcol + t] * zi[kcol + t];
          s = alpha * s + table[0];
          float w = s / (1.0f + std::exp(-s));
          float* di = dst + (size_t)i * U;
          for (int t = 0; t < dv; ++t) di[t] += w * zi[vcol + t];
        }
      }
    }
    gate(d, p, N, attn.data(), z.data(), x, D);
  }
  return 0;
}

// The ranking head's MLP: logits [N, out] (out: the last layer's width, padded to 8 with zero
// columns) for candidate rows whose input is [h | item | h * item | context of their user].
// The first layer's context rows are applied once per user, not per candidate. widths [nl + 1]:
// the input width (3 D + E), the hidden widths (multiples of 8), the padded output width;
// w: per layer W^T [in, out] and bias [out]. SiLU between layers.
int genrec_rank_mlp(int N, int D, const float* h, const float* item, int Uc, const int64_t* cand_offsets,
                    const int64_t* user, const float* ctx, int E, int nl, const int32_t* widths, const float* const* w,
                    float* out) {
  const int K0 = 3 * D;
  std::vector<float> x((size_t)N * K0);
  for (int i = 0; i < N; ++i) {
    float* xi = x.data() + (size_t)i * K0;
    const float* hi = h + (size_t)i * D;
    const float* ii = item + (size_t)i * D;
    for (int t = 0; t < D; ++t) {
      xi[t] = hi[t];
      xi[D + t] = ii[t];
      xi[2 * D + t] = hi[t] * ii[t];
    }
  }
  std::vector<float> a, b;
  for (int l = 0; l < nl; ++l) {
    const int in = widths[l], o = widths[l + 1];
    const float* W = w[2 * l];
    const float* bias = w[2 * l + 1];
    b.assign((size_t)N * o, 0.f);
    if (l == 0) {
      std::vector<float> cu(o);
      for (int g = 0; g < Uc; ++g) {  // this user's bias + context term, then its candidates' rows
        std::memcpy(cu.data(), bias, sizeof(float) * o);
        if (E > 0) gemm(1, o, E, ctx + (size_t)user[g] * E, E, W + (size_t)K0 * o, o, cu.data(), o, true);
        for (int64_t i = cand_offsets[g]; i < cand_offsets[g + 1]; ++i)
          std::memcpy(b.data() + (size_t)i * o, cu.data(), sizeof(float) * o);
      }
      gemm(N, o, K0, x.data(), K0, W, o, b.data(), o, true);
    } else {
      for (int i = 0; i < N; ++i) std::memcpy(b.data() + (size_t)i * o, bias, sizeof(float) * o);
      gemm(N, o, in, a.data(), in, W, o, b.data(), o, true);
    }
    if (l < nl - 1) silu_inplace(b.data(), N * o);
    a.swap(b);
  }
  std::memcpy(out, a.data(), sizeof(float) * (size_t)N * widths[nl]);
  return 0;
}

// Embedding rows for the token inputs and the pooled context, without a framework call per
// table: out[dst[i] * ld + c] (+)= mul * row(rows[i])[c] for c < dim, i < n (dst null: i).
// A row is `bits` 8 / 4: fbgemm's row-wise quantized layout (dim codes of that many bits, low
// nibble first, then an fp16 scale and an fp16 bias: value = scale * code + bias), 16: fp16,
// 32: fp32; row_bytes apart in `table`. Any row outside [0, nrows): returns -1, nothing written.
int genrec_gather_rows(const uint8_t* table, int64_t nrows, int64_t row_bytes, int bits, int dim,
                       const int64_t* rows, const int64_t* dst, int64_t n, float mul, int accumulate, float* out,
                       int64_t ld) {
  for (int64_t i = 0; i < n; ++i)
    if (rows[i] < 0 || rows[i] >= nrows) return -1;
  const int64_t code_bytes = (int64_t(dim) * (bits == 4 ? 4 : 8) + 7) / 8;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* r = table + rows[i] * row_bytes;
    float* o = out + (dst ? dst[i] : i) * ld;
    if (!accumulate) std::fill(o, o + dim, 0.0f);
    if (bits == 8 || bits == 4) {
      uint16_t sb[2];
      std::memcpy(sb, r + code_bytes, sizeof sb);
      const float scale = half_to_float(sb[0]) * mul, bias = half_to_float(sb[1]) * mul;
      if (bits == 8) {
        for (int c = 0; c < dim; ++c) o[c] += scale * float(r[c]) + bias;
      } else {
        for (int c = 0; c < dim; ++c) o[c] += scale * float((r[c >> 1] >> ((c & 1) * 4)) & 0xf) + bias;
      }
    } else if (bits == 16) {
      for (int c = 0; c < dim; ++c) {
        uint16_t h;
        std::memcpy(&h, r + 2 * c, sizeof h);
        o[c] += mul * half_to_float(h);
      }
    } else {
      for (int c = 0; c < dim; ++c) {
        float f;
        std::memcpy(&f, r + 4 * c, sizeof f);
        o[c] += mul * f;
      }
    }
  }
  return 0;
}

// Token inputs in one call, as three genrec_gather_rows passes would make them: out[i] =
// scale * item(items[i]) (+ scale * action(actions[i])) + pos(positions[i]); item_out (when
// given) gets the raw item rows. A table is (rows, nrows, row_bytes, bits); act null: none.
int genrec_tokens(const uint8_t* item, int64_t item_n, int64_t item_rb, int item_bits, const uint8_t* act, int64_t act_n,
                  int64_t act_rb, int act_bits, const uint8_t* pos, int64_t pos_n, int64_t pos_rb, int pos_bits, int dim,
                  int64_t n, const int64_t* items, const int64_t* actions, const int64_t* positions, float scale,
                  float* out, float* item_out) {
  if (genrec_gather_rows(item, item_n, item_rb, item_bits, dim, items, nullptr, n, scale, 0, out, dim)) return -1;
  if (act && genrec_gather_rows(act, act_n, act_rb, act_bits, dim, actions, nullptr, n, scale, 1, out, dim)) return -2;
  if (genrec_gather_rows(pos, pos_n, pos_rb, pos_bits, dim, positions, nullptr, n, 1.0f, 1, out, dim)) return -3;
  if (item_out && genrec_gather_rows(item, item_n, item_rb, item_bits, dim, items, nullptr, n, 1.0f, 0, item_out, dim))
    return -1;
  return 0;
}

// Pooled context of B users over nf features into out [B, E] (zeroed by the caller): feature f
// (table tabs[f] as in genrec_tokens, dims[f] wide, at column cols[f]) of user b sums the rows of
// ids[offsets[f B + b] .. offsets[f B + b + 1]), then divides by their count when mean[f]
// (by 1 when the user has none). Returns -1 - f for an id outside feature f's table.
int genrec_pooled(int B, int nf, const uint8_t* const* tabs, const int64_t* nrows, const int64_t* row_bytes,
                  const int32_t* bits, const int32_t* dims, const int32_t* mean, const int32_t* cols, const int64_t* ids,
                  const int64_t* offsets, float* out, int E) {
  int64_t most = 0;
  for (int k = 0; k < nf * B; ++k) most = std::max(most, offsets[k + 1] - offsets[k]);
  const std::vector<int64_t> row0(most, 0);  // every id of a (feature, user) into that user's row
  for (int f = 0; f < nf; ++f)
    for (int b = 0; b < B; ++b) {
      const int64_t s = offsets[f * B + b], e = offsets[f * B + b + 1];
      if (e == s) continue;
      if (genrec_gather_rows(tabs[f], nrows[f], row_bytes[f], bits[f], dims[f], ids + s, row0.data(), e - s, 1.0f, 1,
                             out + (size_t)b * E + cols[f], E))
        return -1 - f;
      if (mean[f]) {
        const float c = float(e - s);
        float* o = out + (size_t)b * E + cols[f];
        for (int t = 0; t < dims[f]; ++t) o[t] /= c;
      }
    }
  return 0;
}

// The tower's final LayerNorm (eps 1e-5, affine) on rows of n values in place, then, when l2,
// each row divided by max(its L2 norm, 1e-6) (F.normalize, the retrieval head's).
int genrec_final_norm(int rows, int n, float* x, const float* w, const float* b, int l2) {
  layer_norm(rows, n, x, n, w, b, x, n);  // (each row's statistics are read before it is written)
  if (!l2) return 0;
  for (int r = 0; r < rows; ++r) {
    float* xr = x + (size_t)r * n;
    float ss = 0.f;
    for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float norm = std::max(std::sqrt(ss), 1e-6f);
    for (int i = 0; i < n; ++i) xr[i] /= norm;
  }
  return 0;
}

// Exact top-k retrieval over a catalogue of N items for B users, one GEMM for the batch:
// score(b, j) = (users[b] . item j) / temperature, items_t [D, Np] the catalogue's vectors as
// columns (Np >= N, a multiple of 8; columns past N unread). The ids ex_ids[ex_offsets[b] ..
// ex_offsets[b + 1]) (user b's history; ex_offsets null: none) found in the sorted catalogue ids
// `corpus` [N] score -inf for b. Writes the k <= N best per user, best first (equal scores: the
// lower catalogue position first): positions pos [B, k] and scores val [B, k].
int genrec_retrieve(int B, int D, const float* users, int N, int Np, const float* items_t, float temperature,
                    const int64_t* corpus, const int64_t* ex_offsets, const int64_t* ex_ids, int k, int64_t* pos,
                    float* val) {
  if (k < 0 || k > N || Np < N || Np % 8) return -1;
  std::vector<float> s((size_t)B * Np);
  gemm(B, Np, D, users, D, items_t, Np, s.data(), Np, false);
  std::vector<int32_t> idx(N);
  for (int b = 0; b < B; ++b) {
    float* sb = s.data() + (size_t)b * Np;
    for (int j = 0; j < N; ++j) sb[j] /= temperature;
    if (ex_offsets)
      for (int64_t e = ex_offsets[b]; e < ex_offsets[b + 1]; ++e) {
        const int64_t* at = std::lower_bound(corpus, corpus + N, ex_ids[e]);
        if (at != corpus + N && *at == ex_ids[e]) sb[at - corpus] = -std::numeric_limits<float>::infinity();
      }
    for (int j = 0; j < N; ++j) idx[j] = j;
    auto better = [sb](int32_t a, int32_t c) { return sb[a] > sb[c] || (sb[a] == sb[c] && a < c); };
    if (k < N) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
    std::sort(idx.begin(), idx.begin() + k, better);
    for (int j = 0; j < k; ++j) {
      pos[(size_t)b * k + j] = idx[j];
      val[(size_t)b * k + j] = sb[idx[j]];
    }
  }
  return 0;
}

// SipHash-2-4 (Aumasson & Bernstein) under the key (k0, k1) of n messages of nw little-endian
// 64-bit words each (message i: words[0][i], words[1][i], ...), shifted right by `shift`:
// out[i] = siphash(message i) >> shift. serve.sglang_engine.siphash24_words is the same
// function in NumPy (and the reference the tests hold this to).
int genrec_siphash_words(uint64_t k0, uint64_t k1, int nw, const int64_t* const* words, int64_t n, int shift,
                         uint64_t* out) {
  if (nw < 0 || nw > 31 || shift < 0 || shift > 63) return -1;
  auto rotl = [](uint64_t x, int b) { return (x << b) | (x >> (64 - b)); };
  for (int64_t i = 0; i < n; ++i) {
    uint64_t v0 = k0 ^ 0x736F6D6570736575ULL, v1 = k1 ^ 0x646F72616E646F6DULL;
    uint64_t v2 = k0 ^ 0x6C7967656E657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    auto round = [&]() {
      v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);
      v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;
      v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;
      v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);
    };
    for (int w = 0; w < nw; ++w) {
      const uint64_t m = uint64_t(words[w][i]);
      v3 ^= m; round(); round(); v0 ^= m;
    }
    const uint64_t b = uint64_t((8 * nw) & 0xFF) << 56;
    v3 ^= b; round(); round(); v0 ^= b;
    v2 ^= 0xFF;
    round(); round(); round(); round();
    out[i] = (v0 ^ v1 ^ v2 ^ v3) >> shift;
  }
  return 0;
}

}  // extern "C"
