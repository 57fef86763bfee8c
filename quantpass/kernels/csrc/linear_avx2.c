/* Weight-only linear for x86-64 AVX2 + FMA: out[M, N] = x[M, Kp] @ dequant(w)[N, Kp].T, for INT4 with
 * one scale per 128 weights of a row and INT8 with one scale per row.
 *
 * Built and loaded at run time by quantpass/kernels/cpu_avx2.py (ctypes; no Python or torch headers).
 * Activations stay fp32: this is exact weight-only arithmetic, the same products the reference forms
 * (q * scale) * x, summed in fp32 in a different order.
 *
 * INT4 layout ("split16", written by cpu_avx2.pack): w is [N, Kp / 2] bytes, Kp a multiple of 128. In
 * each run of 16 weights k = 16c .. 16c + 15 of a row, byte 8c + i holds code(16c + i) in its low nibble
 * and code(16c + 8 + i) in its high nibble, code = q + 8 with q in [-7, 7]. One zero-extending load of 8
 * bytes then gives both halves of 16 weights in 32-bit lanes: (v & 15) and (v >> 4). A nibble becomes a
 * float without a conversion instruction: OR-ing a code c < 2^23 into the mantissa of 2^23 gives the
 * float 2^23 + c exactly, and subtracting 2^23 + 8 leaves q. s is [N, Kp / 128] fp32.
 *
 * INT8 layout: w is [N, Kp] int8 (Kp a multiple of 8), s is [N] fp32: a sign-extending load of 8 bytes
 * and one conversion give 8 weights.
 *
 * Each scale group (128 weights, or the whole row) accumulates sum(q * x) in registers, then adds it
 * times the group's scale. A tile is R weight rows x MB activation rows: each 8-byte run of a row is
 * decoded once and used for MB rows of x (R * MB accumulators, with the decoded weights and the x
 * vectors, fit the 16 ymm registers). Threads (OpenMP, the same libgomp torch uses) split N in blocks
 * of 4 rows.
 */
#include <immintrin.h>
#include <stdint.h>

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const uint8_t *w, const float *s,
                                                       float *out, int64_t ldo, int64_t kp, int64_t group, int BITS,
                                                       int R, int MB) {
  const int64_t groups = kp / group, row_bytes = kp * BITS / 8, step = 64 / BITS; /* weights per 8 bytes */
  const __m256i low4 = _mm256_set1_epi32(0xF), magic = _mm256_set1_epi32(0x4B000000); /* 2^23 */
  const __m256 bias = _mm256_set1_ps(8388616.0f);                                      /* 2^23 + 8 */
  __m256 total[4][4];
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) total[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 acc[4][4];
    for (int m = 0; m < MB; m++)
      for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += step) {
      __m256 lo[4], hi[4];
      for (int r = 0; r < R; r++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(w + r * row_bytes + k * BITS / 8));
        if (BITS == 4) {
          const __m256i v = _mm256_cvtepu8_epi32(bytes);
          lo[r] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, low4), magic)), bias);
          hi[r] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(v, 4), magic)), bias);
        } else {
          lo[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        }
      }
      for (int m = 0; m < MB; m++) {
        const __m256 xl = _mm256_loadu_ps(x + m * ldx + k);
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(lo[r], xl, acc[m][r]);
        if (BITS == 4) {
          const __m256 xh = _mm256_loadu_ps(x + m * ldx + k + 8);
          for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(hi[r], xh, acc[m][r]);
        }
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

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t);
#define TILE(BITS, R, MB)                                                                                      \
  static void tile_##BITS##_##R##_##MB(const float *x, int64_t ldx, const uint8_t *w, const float *s, float *out, \
                                       int64_t ldo, int64_t kp, int64_t group) {                               \
    tile(x, ldx, w, s, out, ldo, kp, group, BITS, R, MB);                                                      \
  }
#define TILES(BITS)                                                                                    \
  TILE(BITS, 4, 1) TILE(BITS, 2, 2) TILE(BITS, 2, 3) TILE(BITS, 2, 4) TILE(BITS, 1, 1) TILE(BITS, 1, 2) \
  TILE(BITS, 1, 3) TILE(BITS, 1, 4)                                                                    \
  /* Indexed by MB - 1: the widest tile for MB rows of x, and the one-row tile for N's tail. */         \
  static const tile_fn WIDE_##BITS[4] = {tile_##BITS##_4_1, tile_##BITS##_2_2, tile_##BITS##_2_3, tile_##BITS##_2_4}; \
  static const tile_fn ONE_##BITS[4] = {tile_##BITS##_1_1, tile_##BITS##_1_2, tile_##BITS##_1_3, tile_##BITS##_1_4};
TILES(4)
TILES(8)
static const int WIDE_ROWS[4] = {4, 2, 2, 2};

static void linear(const float *x, const uint8_t *w, const float *s, float *out, int64_t M, int64_t N, int64_t kp,
                   int64_t group, int bits, int threads) {
  const int64_t groups = kp / group, row_bytes = kp * bits / 8, blocks = (N + 3) / 4;
  const tile_fn *wide = bits == 4 ? WIDE_4 : WIDE_8, *one = bits == 4 ? ONE_4 : ONE_8;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * 4, n1 = N - n0 < 4 ? N : n0 + 4;
    for (int64_t m = 0; m < M; m += 4) {
      const int mb = M - m < 4 ? (int)(M - m) : 4, step = WIDE_ROWS[mb - 1];
      int64_t n = n0;
      for (; n + step <= n1; n += step)
        wide[mb - 1](x + m * kp, kp, w + n * row_bytes, s + n * groups, out + m * N + n, N, kp, group);
      for (; n < n1; n++) one[mb - 1](x + m * kp, kp, w + n * row_bytes, s + n * groups, out + m * N + n, N, kp, group);
    }
  }
}

/* INT4: w [N, kp / 2] split16 bytes, s [N, kp / 128]; kp a multiple of 128. */
void qp_int4_linear(const float *x, const uint8_t *w, const float *s, float *out, int64_t M, int64_t N, int64_t kp,
                    int threads) {
  linear(x, w, s, out, M, N, kp, 128, 4, threads);
}

/* INT8: w [N, kp] int8, s [N]; kp a multiple of 8. */
void qp_int8_linear(const float *x, const int8_t *w, const float *s, float *out, int64_t M, int64_t N, int64_t kp,
                    int threads) {
  linear(x, (const uint8_t *)w, s, out, M, N, kp, kp, 8, threads);
}
