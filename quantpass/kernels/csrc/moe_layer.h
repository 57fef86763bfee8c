/* One MoE layer with routing done, the same for every format quantpass's CPU kernels read: linear_avx2.c's
 * qp_moe (INT8, INT4), linear_fp8.c's qp_moe_fp8 (every FP8 format), linear_fp4.c's qp_moe_fp4 (MXFP4,
 * NVFP4), weight-only. Each includes this header and gives `moe_layer` its expert GEMM (`expert_gemm`: its
 * own qp_linear on one expert's weights); the routing, the gather, the gated activation and the weighted
 * sums are here, once. */
#ifndef QUANTPASS_MOE_LAYER_H
#define QUANTPASS_MOE_LAYER_H
#include <math.h>

#include "cpu_common.h"

/* x [m, K] fp32 (row stride K) times expert e's weights (`weights`: the format's experts) -> out [m, N] fp32
 * (row stride N). x is moe_layer's scratch, read by this GEMM only: it may be overwritten (quantized in
 * place). Returns the kernel's status (0: done). */
typedef int (*expert_gemm)(const void *weights, int64_t e, float *x, int64_t m, int64_t K, float *out,
                           int64_t N, int threads);

/* Called once before each GEMM stage with all its input rows (x [R, K] fp32: every routed row, sorted by
 * expert), where a format's experts need something of all of them (a per-tensor activation scale);
 * NULL: nothing. */
typedef void (*expert_rows)(const void *weights, const float *x, int64_t R, int64_t K);

/* The parameters every MoE entry starts with (`moe_layer`'s), and the same as arguments. */
#define MOE_PARAMS                                                                                               \
  const void *hidden, int htype, int64_t T, int64_t H, const int64_t *ids, int64_t k, const void *map,           \
      int map_bytes, int64_t map_len, const void *router, int rtype, int on_input, int64_t E, int64_t I,         \
      const void *b13, const void *b2, int btype, int act, int layout, float alpha, float limit, void *out,      \
      int threads, int64_t most
#define MOE_ARGS                                                                                                   \
  hidden, htype, T, H, ids, k, map, map_bytes, map_len, router, rtype, on_input, E, I, b13, b2, btype, act, layout, \
      alpha, limit, out, threads, most

enum { SILU = 0, GELU = 1, GELU_TANH = 2, SWIGLUOAI = 3, SILU_CLAMPED = 4 }; /* moe_problem.MoEActivation, in its order */
static __thread uint8_t *kept_moe; /* moe_layer's scratch, held across its kernel calls (which use `kept`) */

/* f as a `type` element holds it (rounded to nearest even), back in fp32 */
INLINE float as_type(float f, int type) {
  if (type == F32) return f;
  uint16_t h;
  store(&h, type, 0, f);
  return to_f32(&h, type, 0);
}

/* exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial, the
 * exponent added in): within 1 ulp of the correctly rounded exp on [-87, 88] (1.09 M points checked
 * against double exp, 91% exact, 2026-12-02), 1.2e-38 below -87.3, inf above 88.7. What the activations
 * below need of exp, at a fraction of expf's time (6144 scalar expf calls were ~5% of a MoE layer at
 * decode). */
INLINE __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

/* e[0 .. n) = exp(e[0 .. n)), 8 at a time (the tail through a zero-padded block) */
static void exp_inplace(float *e, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(e + i, exp8(_mm256_loadu_ps(e + i)));
  if (i < n) {
    float tail[8] = {0};
    memcpy(tail, e + i, (size_t)(n - i) * 4);
    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
    memcpy(e + i, tail, (size_t)(n - i) * 4);
  }
}

/* moe_problem.GatedActivation over one row's I (gate, up) pairs of h into a [I] fp32, rounded to `type`,
 * in torch's order of operations (exp, erf and tanh may differ from torch's vectorized ones in the last
 * bit). SiLU (clamped or not) and SwiGLU-OAI first write their exp arguments into a, then exp them 8 at a time. */
static void gated_row(const float *h, int64_t I, int layout, int act, float alpha, float limit, int type, float *a) {
#define GATE(n) (layout ? h[2 * (n)] : h[(n)])
#define UP(n) (layout ? h[2 * (n) + 1] : h[I + (n)])
  if (act == SILU || act == SWIGLUOAI || act == SILU_CLAMPED) {
    for (int64_t n = 0; n < I; n++) {
      const float g = act == SILU ? GATE(n) : GATE(n) > limit ? limit : GATE(n); /* NaN stays NaN, as torch's clamp */
      a[n] = act == SWIGLUOAI ? -(g * alpha) : -g;
    }
    exp_inplace(a, I);
  }
  for (int64_t n = 0; n < I; n++) {
    float g = GATE(n), u = UP(n), v;
    if (act == SILU) {
      v = g / (1.0f + a[n]) * u;
    } else if (act == SILU_CLAMPED) {
      g = g > limit ? limit : g;
      u = u < -limit ? -limit : u > limit ? limit : u;
      v = g / (1.0f + a[n]) * u;
    } else if (act == SWIGLUOAI) {
      g = g > limit ? limit : g;
      u = u < -limit ? -limit : u > limit ? limit : u;
      v = (u + 1.0f) * (g * (1.0f / (1.0f + a[n])));
    } else if (act == GELU) {
      v = g * 0.5f * (1.0f + erff(g * (float)M_SQRT1_2)) * u;
    } else { /* GELU_TANH */
      const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
      v = 0.5f * g * (1.0f + tanhf(beta * (g + kappa * (g * g * g)))) * u;
    }
    a[n] = as_type(v, type);
  }
#undef GATE
#undef UP
}

/* Row r of x [R, K] (fp32) times expert experts[r]'s weights -> out row r (fp32, [R, N]). Rows sorted by
 * expert: each run of rows with one expert is one GEMM of up to `most` rows, so each expert's weights are
 * read once. */
static int experts_linear(float *x, int64_t R, int64_t K, const int64_t *experts, expert_gemm gemm,
                          const void *weights, int64_t N, float *out, int threads, int64_t most) {
  for (int64_t r = 0, m; r < R; r += m) {
    const int64_t e = experts[r];
    for (m = 1; r + m < R && m < most && experts[r + m] == e;) m++;
    const int status = gemm(weights, e, x + r * K, m, K, out + r * N, N, threads);
    if (status) return status;
  }
  return 0;
}

/* One MoE layer with routing done, as quantpass's reference computes it (kernels/reference.fused_moe, no
 * activation key): out [T, H] (`htype`) = sum over each token's k (expert, weight) pairs of
 * weight * expert(x), where expert(x) = w2 @ gated(w13 @ x + b13) + b2, all in fp32 with the GEMM inputs
 * rounded to `htype` (the router weight multiplies x instead where `on_input`). ids [T, k] int64: global
 * expert ids, through `map` ([map_len] int32 or int64: `map_bytes`) where given; a negative local id is
 * another rank's expert, skipped (as the reference's `local_ids >= 0`). E local experts, each w13 [2I, H]
 * and w2 [H, I] (`gemm` on `w13` and `w2`: the format's experts, `rows` before each stage, or NULL);
 * b13 [E, 2I], b2 [E, H] (`btype`) or NULL;
 * router [T, k] (`rtype`). `act`: moe_problem.MoEActivation's index; `layout` 0: gate rows then up rows of
 * w13, 1: interleaved. Each expert's rows go through its weights once (rows sorted by expert, stable), in
 * GEMMs of at most `most` rows; the sums per token in slot order. Returns 0; -1 if memory ran out; -3 for
 * an expert id outside the map or [0, E); else the GEMM's status. */
static int moe_layer(MOE_PARAMS, expert_gemm gemm, expert_rows rows, const void *w13, const void *w2) {
  const int64_t P = T * k, I2 = 2 * I;
  /* the pairs' experts, order, rank, sorted experts and bucket starts, then the rows' fp32 buffers */
  const size_t ints = (size_t)(4 * P + E + 1), floats = (size_t)(P * (2 * H + I2 + I) + T * H);
  int fresh;
  int64_t *expert = (int64_t *)scratch_in(&kept_moe, ints * sizeof(int64_t) + floats * sizeof(float), &fresh);
  float *x = NULL, *h = NULL, *a = NULL, *y = NULL, *acc = NULL;
  int status = -3;
  if (expert == NULL) return -1;
  int64_t *order = expert + P, *rank = order + P, *sorted = rank + P, *start = sorted + P, R = 0;
  for (int64_t e = 0; e <= E; e++) start[e] = 0;
  for (int64_t p = 0; p < P; p++) { /* each pair's local expert; negative: another rank's */
    int64_t e = ids[p];
    if (map != NULL) {
      if (e < 0 || e >= map_len) goto done;
      e = map_bytes == 4 ? ((const int32_t *)map)[e] : ((const int64_t *)map)[e];
    }
    if (e >= E) goto done;
    expert[p] = e < 0 ? -1 : e;
    if (e >= 0) start[e + 1]++, R++;
  }
  status = -1;
  for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
  for (int64_t p = 0; p < P; p++) /* stable counting sort by expert */
    if (expert[p] >= 0) rank[p] = start[expert[p]]++, order[rank[p]] = p;
  for (int64_t j = 0; j < R; j++) sorted[j] = expert[order[j]];
  x = (float *)(expert + ints), h = x + R * H, a = h + R * I2, y = a + R * I, acc = y + R * H;
  const int big = R * (H + I2) > (1 << 16) && threads > 1;
#pragma omp parallel for num_threads(threads) if (big)
  for (int64_t j = 0; j < R; j++) { /* the rows, each its token's activations (times the router weight) */
    const int64_t p = order[j], t = p / k;
    const float r = on_input ? to_f32(router, rtype, p) : 1.0f;
    for (int64_t c = 0; c < H; c++)
      x[j * H + c] = on_input ? as_type(to_f32(hidden, htype, t * H + c) * r, htype) : to_f32(hidden, htype, t * H + c);
  }
  if (rows != NULL) rows(w13, x, R, H);
  status = experts_linear(x, R, H, sorted, gemm, w13, I2, h, threads, most);
  if (status) goto done;
#pragma omp parallel for num_threads(threads) if (big)
  for (int64_t j = 0; j < R; j++) {
    float *hj = h + j * I2;
    if (b13 != NULL)
      for (int64_t n = 0; n < I2; n++) hj[n] += to_f32(b13, btype, sorted[j] * I2 + n);
    gated_row(hj, I, layout, act, alpha, limit, htype, a + j * I);
  }
  if (rows != NULL) rows(w2, a, R, I);
  status = experts_linear(a, R, I, sorted, gemm, w2, H, y, threads, most);
  if (status) goto done;
#pragma omp parallel for num_threads(threads) if (big)
  for (int64_t t = 0; t < T; t++) { /* per token, its slots in order, as index_add_ sums them */
    float *at = acc + t * H;
    for (int64_t c = 0; c < H; c++) at[c] = 0.0f;
    for (int64_t p = t * k; p < (t + 1) * k; p++) {
      if (expert[p] < 0) continue;
      const int64_t j = rank[p], e = expert[p];
      const float r = on_input ? 1.0f : to_f32(router, rtype, p), *yj = y + j * H;
      for (int64_t c = 0; c < H; c++) {
        const float v = b2 != NULL ? yj[c] + to_f32(b2, btype, e * H + c) : yj[c];
        at[c] += on_input ? v : v * r;
      }
    }
    for (int64_t c = 0; c < H; c++) store(out, htype, t * H + c, at[c]);
  }
done:
  if (fresh) free(expert);
  return status;
}

#endif
