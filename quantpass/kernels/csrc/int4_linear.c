/* INT4 group-128 weight-only linear for x86-64 AVX2 + FMA: out[M, N] = x[M, Kp] @ dequant(w)[N, Kp].T
 *
 * Built and loaded at run time by quantpass/kernels/cpu_avx2.py (ctypes; no Python or torch headers).
 * Activations stay fp32: this is exact weight-only arithmetic, the same products the reference forms
 * (q * scale) * x, summed in fp32 in a different order.
 *
 * Layout ("split16", written by cpu_avx2.pack): w is [N, Kp / 2] bytes, Kp a multiple of 128. In each
 * run of 16 weights k = 16c .. 16c + 15 of a row, byte 8c + i holds code(16c + i) in its low nibble and
 * code(16c + 8 + i) in its high nibble, code = q + 8 with q in [-7, 7]. One zero-extending load of 8
 * bytes then gives both halves of 16 weights in 32-bit lanes: (v & 15) and (v >> 4). s is [N, Kp / 128]
 * fp32 scales.
 *
 * A nibble becomes a float without a conversion instruction: OR-ing a code c < 2^23 into the mantissa of
 * 2^23 gives the float 2^23 + c exactly, and subtracting 2^23 + 8 leaves q. Each 128-weight group
 * accumulates sum(q * x) in registers, then adds it times the group's scale.
 *
 * A tile is R weight rows x MB activation rows: each run of 16 weights is decoded once and used for MB
 * rows of x (R * MB accumulators, with the decoded weights and two x vectors, fit the 16 ymm registers).
 * Threads (OpenMP, the same libgomp torch uses) split N in blocks of 4 rows.
 */
#include <immintrin.h>
#include <stdint.h>

#define GROUP 128

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const uint8_t *w, const float *s,
                                                       float *out, int64_t ldo, int64_t kp, int R, int MB) {
  const int64_t groups = kp / GROUP, row_bytes = kp / 2;
  const __m256i low4 = _mm256_set1_epi32(0xF), magic = _mm256_set1_epi32(0x4B000000); /* 2^23 */
  const __m256 bias = _mm256_set1_ps(8388616.0f);                                      /* 2^23 + 8 */
  __m256 total[4][4];
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) total[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 acc[4][4];
    for (int m = 0; m < MB; m++)
      for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    for (int c = 0; c < GROUP / 16; c++) {
      const int64_t k = g * GROUP + c * 16;
      __m256 lo[4], hi[4];
      for (int r = 0; r < R; r++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + r * row_bytes + k / 2)));
        lo[r] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, low4), magic)), bias);
        hi[r] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(v, 4), magic)), bias);
      }
      for (int m = 0; m < MB; m++) {
        const __m256 xl = _mm256_loadu_ps(x + m * ldx + k), xh = _mm256_loadu_ps(x + m * ldx + k + 8);
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(hi[r], xh, _mm256_fmadd_ps(lo[r], xl, acc[m][r]));
      }
    }
    for (int r = 0; r < R; r++) {
      const __m256 scale = _mm256_set1_ps(s[r * groups + g]);
      for (int m = 0; m < MB; m++) total[m][r] = _mm256_fmadd_ps(acc[m][r], scale, total[m][r]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(total[m][r]), _mm256_extractf128_ps(total[m][r], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[m * ldo + r] = _mm_cvtss_f32(h);
    }
}

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t);
#define TILE(R, MB)                                                                                       \
  static void tile_##R##_##MB(const float *x, int64_t ldx, const uint8_t *w, const float *s, float *out, \
                              int64_t ldo, int64_t kp) {                                                 \
    tile(x, ldx, w, s, out, ldo, kp, R, MB);                                                              \
  }
TILE(4, 1) TILE(2, 2) TILE(2, 3) TILE(2, 4) TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)
/* Indexed by MB - 1: the widest tile for MB rows of x (and its R), and the one-row tile for N's tail. */
static const tile_fn WIDE[4] = {tile_4_1, tile_2_2, tile_2_3, tile_2_4};
static const int WIDE_ROWS[4] = {4, 2, 2, 2};
static const tile_fn ONE[4] = {tile_1_1, tile_1_2, tile_1_3, tile_1_4};

void qp_int4_linear(const float *x, const uint8_t *w, const float *s, float *out, int64_t M, int64_t N, int64_t kp,
                    int threads) {
  const int64_t groups = kp / GROUP, row_bytes = kp / 2, blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * 4, n1 = N - n0 < 4 ? N : n0 + 4;
    for (int64_t m = 0; m < M; m += 4) {
      const int mb = M - m < 4 ? (int)(M - m) : 4, step = WIDE_ROWS[mb - 1];
      int64_t n = n0;
      for (; n + step <= n1; n += step)
        WIDE[mb - 1](x + m * kp, kp, w + n * row_bytes, s + n * groups, out + m * N + n, N, kp);
      for (; n < n1; n++) ONE[mb - 1](x + m * kp, kp, w + n * row_bytes, s + n * groups, out + m * N + n, N, kp);
    }
  }
}
