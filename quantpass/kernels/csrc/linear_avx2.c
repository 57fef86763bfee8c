/* Weight-only linear for x86-64 with AVX2, FMA and F16C:
 *   out[M, N] = x[M, K] @ dequant(w)[N, Kp].T (+ bias[N]),
 * for INT4 with one fp32 scale per 128 weights of a row and INT8 with one fp32 scale per row. x, bias and
 * out are fp32, bf16 or fp16 (out rounded to nearest even once, after the bias). Built and loaded at run
 * time by quantpass/kernels/cpu_avx2.py (ctypes; no Python or torch headers).
 *
 * Weights are read in the layout quantpass quantizes into, so "preparing" them copies nothing:
 *   INT4: w [N, Kp / 2] bytes, Kp a multiple of 128: byte j of a row holds code(2j) in its low nibble and
 *         code(2j + 1) in its high one, code = q + 8. s [N, Kp / 128] fp32.
 *   INT8: w [N, Kp] int8 in [-127, 127], any Kp; s [N] fp32.
 * x has K <= Kp columns (the rest count as zeros). The activations are rearranged once per call instead
 * of the weights: for INT4 each run of 64 columns becomes its 32 even columns, then its 32 odd ones, so
 * the low nibbles of 32 weight bytes meet 32 consecutive activations and the high nibbles the next 32.
 *
 * How the products are formed (`mode`, at any M):
 *   EXACT  fp32 activations. Each weight becomes a float (INT4 without a conversion instruction: OR-ing a
 *          code c < 2^23 into the mantissa of 2^23 gives the float 2^23 + c exactly), one FMA per weight
 *          and activation row: the reference's products, summed in another order.
 *   INT8   INT4 x int8 activations, as llama.cpp's Q8 ones: each block of 128 activations (= one weight group)
 *          becomes int8 q with one fp32 scale d = max|x| / 127, once per call. Per 32 weight bytes: an
 *          AND and a shift unpack 64 codes, two _mm256_maddubs_epi16 (unsigned codes x signed q) give
 *          int16 pair sums, added in int16 over the group (4 * 2 * 15 * 127 < 2^15); per group one
 *          _mm256_madd_epi16 to int32, one subtraction of 8 * sum(q) (precomputed), one conversion and one
 *          FMA by the weight's scale times d. Where the CPU has AVX-512 VNNI (`qp_int4_vnni`), one
 *          _mm512_dpbusd_epi32 per 64 codes forms the same integer sums (tile_int4_int8_vnni).
 *   INT16  INT8 x int16 activations: each block of 128 activations becomes int16 (d = max|x| / 32767: 15 bits, more
 *          than bf16's 8), so the products are exact integer ones: 16 weights sign-extend to int16 in one
 *          instruction and meet 16 activations in one _mm256_madd_epi16 (an int32 lane gathers at most
 *          16 * 127 * 32767 < 2^31 per block); one conversion and one FMA by d per block, the row's
 *          scale once at the end. Where the CPU has AVX-512 VNNI (`qp_int8_vnni`), 32 weights meet 32
 *          activations in one _mm512_dpwssd_epi32 for 2 activation rows and more (tile_int8_int16_vnni):
 *          the same outputs, bit for bit.
 *
 * Tiles: R weight rows x MB activation rows (MB <= 4; more rows repeat the tile over the same weights,
 * now in cache). Threads (OpenMP, the libgomp torch loaded) split N into contiguous ranges that start on
 * multiples of 16 rows, so no two threads write one 64-byte line of fp32 output and each streams its own
 * part of the weights. Every output is one thread's sum in a fixed order, whatever the number of threads
 * (built with -ffp-contract=off: only the FMAs written here).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "moe_layer.h"

enum { EXACT = 0, INT8 = 1, INT16 = 2 };  /* `mode` (INT8 for INT4 weights, INT16 for INT8 weights) */
#define GROUP 128                         /* INT4 weights per scale, and activations per block */

/* ---- activations: into fp32 (INT4: in the even/odd order), then into integers ---- */

/* x row [K] of `type` -> dst [kpad] fp32, zero past K; INT4 (`split`) reorders each run of 64. */
static void row_to_f32(const void *x, int type, int64_t K, float *dst, int64_t kpad, int split) {
  int64_t k = 0;
  if (!split) {
    row_f32(x, type, K, dst, kpad);
    return;
  }
  for (; k + 64 <= K; k += 64) /* 16 columns at a time: evens to dst[k + i], odds to dst[k + 32 + i] */
    for (int i = 0; i < 32; i += 8) {
      const __m256 a = load8_f32(x, type, k + 2 * i), b = load8_f32(x, type, k + 2 * i + 8);
      const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)); /* a0 a2 b0 b2 | a4 a6 b4 b6 */
      const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      _mm256_storeu_ps(dst + k + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
      _mm256_storeu_ps(dst + k + 32 + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
    }
  for (; k < kpad; k++) { /* the last, partial run (and the padding) one at a time */
    const int64_t run = k & ~(int64_t)63, j = k - run;
    dst[run + (j & 1) * 32 + j / 2] = k < K ? to_f32(x, type, k) : 0.0f;
  }
}

/* One activation row in integers, per block of 128 with one scale d = max|x| / qmax, qmax = 127 (INT8
 * mode) or 32767 (INT16 mode): q[128] int8 or int16, then dx[blocks] = d, then (INT8 mode) per block the
 * int32 vector (-8 * sum(q), 0, ..., 0): what the +8 of the INT4 codes added, taken off once per group. */
typedef struct {
  int64_t blocks, block_bytes, stride; /* per row: blocks * block_bytes of q, dx, then corr */
} qlayout;

INLINE qlayout layout(int64_t kpad, int mode) {
  qlayout l;
  l.blocks = kpad / GROUP;
  l.block_bytes = mode == INT16 ? 2 * GROUP : GROUP;
  const int64_t bytes = l.blocks * (l.block_bytes + 4 + (mode == INT8 ? 32 : 0));
  l.stride = (bytes + 63) & ~(int64_t)63;
  return l;
}

INLINE int64_t padded_k(int64_t kp, int bits, int mode) {
  const int64_t multiple = bits == 4 || mode == INT16 ? GROUP : 8;
  return (kp + multiple - 1) / multiple * multiple;
}

/* max |v[i]| over 128 floats, or NaN if any is NaN or infinite */
static float amax128(const float *v) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps(), poison = _mm256_setzero_ps(); /* v * 0 is NaN for NaN or inf */
  for (int i = 0; i < GROUP; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    m = _mm256_max_ps(m, _mm256_and_ps(x, absmask));
    poison = _mm256_add_ps(poison, _mm256_mul_ps(x, _mm256_setzero_ps()));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return hsum(poison) == 0.0f ? _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))) : NAN;
}

INLINE __m256i rounded(const float *v, __m256 inv) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), inv)); /* MXCSR's default: to nearest even */
}

/* packs works per 128-bit lane; these restore the order of a, b (c, d) */
INLINE __m256i pack_i16(__m256i a, __m256i b) { return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); }
INLINE __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* A block whose activations are not all finite gets dx = NaN: its outputs are NaN, as the reference's. */
static void quantize_row(const float *xf, int mode, uint8_t *dst, qlayout l) {
  float *dx = (float *)(dst + l.blocks * l.block_bytes);
  int32_t *corr = (int32_t *)(dx + l.blocks);
  const float qmax = mode == INT16 ? 32767.0f : 127.0f;
  for (int64_t b = 0; b < l.blocks; b++) {
    const float *v = xf + b * GROUP, m = amax128(v);
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? qmax / m : 0.0f); /* |x * inv| <= qmax (+ rounding) */
    uint8_t *q = dst + b * l.block_bytes;
    dx[b] = m / qmax;
    if (mode == INT16) {
      for (int i = 0; i < GROUP; i += 16)
        _mm256_storeu_si256((__m256i *)(q + 2 * i), pack_i16(rounded(v + i, inv), rounded(v + i + 8, inv)));
      continue;
    }
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < GROUP; i += 32) {
      __m256i r[4];
      for (int j = 0; j < 4; j++) sum = _mm256_add_epi32(sum, r[j] = rounded(v + i + 8 * j, inv));
      _mm256_storeu_si256((__m256i *)(q + i), pack_i8(r[0], r[1], r[2], r[3]));
    }
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    corr[8 * b] = -8 * _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(2, 3, 0, 1))));
    for (int i = 1; i < 8; i++) corr[8 * b + i] = 0;
  }
}

/* ---- tiles: res[m * R + r] = row r of w . activation row m, fp32 ---- */

/* A tile of R rows reads R streams; the hardware prefetchers start late on each (a 2 KB INT4 row is half
 * a page), so each tile asks for the next tile as it goes (cpu_common.h's `prefetch`). The INT4 x int8
 * tiles of 4 rows and more read rows 0, 2, 4, ... first and 1, 3, 5, ... after them: each pair of
 * adjacent rows (a 4 KB page at K = 4096) is read front to back as one stream instead of two interleaved
 * ones, which the hardware prefetchers follow better (bench/README.md, "INT4 tiles that read each pair of
 * rows as one stream"); each row's sum keeps its order, so the outputs do not depend on it. */

/* 16 (8) weight bytes from p where `avail` of them belong to the row; the rest read as zero */
INLINE __m128i load16(const uint8_t *p, int64_t avail) {
  if (avail >= 16) return _mm_loadu_si128((const __m128i *)p);
  uint8_t tmp[16] = {0};
  if (avail > 0) memcpy(tmp, p, (size_t)avail);
  return _mm_loadu_si128((const __m128i *)tmp);
}

INLINE __m128i load8(const uint8_t *p, int64_t avail) {
  if (avail >= 8) return _mm_loadl_epi64((const __m128i *)p);
  uint8_t tmp[8] = {0};
  if (avail > 0) memcpy(tmp, p, (size_t)avail);
  return _mm_loadl_epi64((const __m128i *)tmp);
}

/* INT4 x int8 activations. acts: the MB rows' quantized activations, `l.stride` apart. */
INLINE void tile_int4_int8(const uint8_t *acts, qlayout l, const uint8_t *w, int64_t row_bytes, const float *s,
                           float *res, int R, int MB) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int passes = R >= 4 ? 2 : 1; /* rows half, half + 2, ...: each pair of rows read as one stream */
  __m256 acc[4][8];
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
  const uint8_t *next = w + R * row_bytes;
  for (int half = 0; half < passes; half++)
    for (int64_t g = 0; g < l.blocks; g++) {
      __m256i sum[4][8];
      for (int m = 0; m < MB; m++)
        for (int r = half; r < R; r += passes) sum[m][r] = _mm256_setzero_si256();
      for (int c = 0; c < 2; c++) /* 32 bytes: low nibbles meet activations 64c .. +31 of the group, high +32 */
        for (int r = half; r < R; r += passes) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(w + r * row_bytes + g * 64 + c * 32));
          if (c == 0) next = prefetch(next);
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          for (int m = 0; m < MB; m++) {
            const uint8_t *q = acts + m * l.stride + g * GROUP + c * 64;
            const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q));
            const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 32)));
            sum[m][r] = _mm256_add_epi16(sum[m][r], _mm256_add_epi16(plo, phi));
          }
        }
      for (int m = 0; m < MB; m++) {
        const uint8_t *a = acts + m * l.stride;
        const float dx = ((const float *)(a + l.blocks * l.block_bytes))[g];
        const __m256i corr = _mm256_loadu_si256((const __m256i *)(a + l.blocks * (l.block_bytes + 4)) + g);
        for (int r = half; r < R; r += passes) {
          const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(sum[m][r], ones), corr);
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[r * l.blocks + g] * dx), acc[m][r]);
        }
      }
    }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) res[m * R + r] = hsum(acc[m][r]);
}

/* The same product with AVX-512 VNNI (Ice Lake and later): a group's 64 weight bytes in one register,
 * _mm512_dpbusd_epi32 multiplies unsigned codes by signed activations and adds 4 products per int32 lane
 * straight into the group's sum (no int16 stage), the correction rides in lane 0 (zero-extended). The
 * activations of a group go in as [0..31, 64..95] against the low nibbles and [32..63, 96..127] against
 * the high ones (two 32-byte halves each). Integer sums are exact either way; the fp32 sums run over 16
 * lanes instead of 8, so this path's outputs differ from the AVX2 one's in the last bits. 8 rows at
 * M = 1 (a 16 KB tile): with the next tile prefetched in address order, 1.06x and 1.23x the 16-row tile
 * at 1 thread on Zen 4, equal at 2 (bench/README.md, "Prefetching the next tile in address order"). */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
INLINE VNNI void tile_int4_int8_vnni(const uint8_t *acts, qlayout l, const uint8_t *w, int64_t row_bytes,
                                     const float *s, float *res, int R, int MB) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int passes = R >= 4 ? 2 : 1; /* rows half, half + 2, ...: each pair of rows read as one stream */
  __m512 acc[4][16];
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
  const uint8_t *next = w + R * row_bytes;
  for (int half = 0; half < passes; half++)
    for (int64_t g = 0; g < l.blocks; g++) {
      __m512i alo[4], ahi[4];
      for (int m = 0; m < MB; m++) {
        const uint8_t *q = acts + m * l.stride + g * GROUP;
        alo[m] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q)),
                                    _mm256_loadu_si256((const __m256i *)(q + 64)), 1);
        ahi[m] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 32))),
                                    _mm256_loadu_si256((const __m256i *)(q + 96)), 1);
      }
      __m512i corr[4];
      float dx[4];
      for (int m = 0; m < MB; m++) {
        const uint8_t *a = acts + m * l.stride;
        dx[m] = ((const float *)(a + l.blocks * l.block_bytes))[g];
        corr[m] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(a + l.blocks * (l.block_bytes + 4)) + g));
      }
      for (int r = half; r < R; r += passes) {
        const __m512i v = _mm512_loadu_si512((const void *)(w + r * row_bytes + g * 64));
        next = prefetch(next);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int m = 0; m < MB; m++) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr[m], lo, alo[m]), hi, ahi[m]);
          acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(s[r * l.blocks + g] * dx[m]), acc[m][r]);
        }
      }
    }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) {
      const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc[m][r]),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][r]), 1)));
      res[m * R + r] = hsum(h);
    }
}

/* INT8 x int16 activations, one block of 128: `whole` (a constant where inlined) unless it is the row's
 * last, which may end inside the block. */
INLINE void block_int8_int16(const uint8_t *acts, qlayout l, const uint8_t *w, int64_t row_bytes, int64_t b,
                             int whole, __m256 acc[4][8], int R, int MB, const uint8_t **next) {
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) {
    __m256i dot[4];
    for (int m = 0; m < MB; m++) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < GROUP / 16; c++) {
      const int64_t k = b * GROUP + 16 * c;
      const uint8_t *p = w + r * row_bytes + k;
      const __m256i v = _mm256_cvtepi8_epi16(whole ? _mm_loadu_si128((const __m128i *)p) : load16(p, row_bytes - k));
      if (c % 4 == 0) *next = prefetch(*next);
      for (int m = 0; m < MB; m++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(acts + m * l.stride + 2 * k));
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(v, q));
      }
    }
    for (int m = 0; m < MB; m++) {
      const float *dx = (const float *)(acts + m * l.stride + l.blocks * l.block_bytes);
      acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_broadcast_ss(dx + b), acc[m][r]);
    }
  }
}

/* The same block with AVX-512 VNNI: 32 weights sign-extend to int16 in one instruction and meet 32
 * activations in one _mm512_dpwssd_epi32 (pair products added into the 16 int32 lanes). Lanes j and j + 8 are
 * then added (exact integers: at most 16 * 127 * 32767 < 2^31 each), so lane j holds the products of the
 * columns the AVX2 block's lane j does, and the fp32 arithmetic after it is the AVX2 block's: the outputs are
 * the same, bit for bit. */
INLINE VNNI void block_int8_int16_vnni(const uint8_t *acts, qlayout l, const uint8_t *w, int64_t row_bytes,
                                       int64_t b, int whole, __m256 acc[4][8], int R, int MB, const uint8_t **next) {
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) {
    __m512i dot[4];
    for (int m = 0; m < MB; m++) dot[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < GROUP / 32; c++) {
      const int64_t k = b * GROUP + 32 * c;
      const uint8_t *p = w + r * row_bytes + k;
      const __m256i bytes = whole ? _mm256_loadu_si256((const __m256i *)p)
                                  : _mm256_set_m128i(load16(p + 16, row_bytes - k - 16), load16(p, row_bytes - k));
      const __m512i v = _mm512_cvtepi8_epi16(bytes);
      if (c % 2 == 0) *next = prefetch(*next);
      for (int m = 0; m < MB; m++)
        dot[m] = _mm512_dpwssd_epi32(dot[m], v, _mm512_loadu_si512((const void *)(acts + m * l.stride + 2 * k)));
    }
    for (int m = 0; m < MB; m++) {
      const float *dx = (const float *)(acts + m * l.stride + l.blocks * l.block_bytes);
      const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(dot[m]), _mm512_extracti64x4_epi64(dot[m], 1));
      acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(dx + b), acc[m][r]);
    }
  }
}

/* INT8 x int16 activations over a tile's blocks (BLOCK: the AVX2 or the VNNI one), the row's scale at the end */
#define TILE_INT8_INT16(NAME, BLOCK, ...)                                                                       \
  INLINE __VA_ARGS__ void NAME(const uint8_t *acts, qlayout l, const uint8_t *w, int64_t row_bytes,            \
                               const float *s, float *res, int R, int MB) {                                    \
    __m256 acc[4][8];                                                                                           \
    for (int m = 0; m < MB; m++)                                                                                \
      for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();                                             \
    const int64_t whole = row_bytes / GROUP < l.blocks ? row_bytes / GROUP : l.blocks;                         \
    const uint8_t *next = w + R * row_bytes;                                                                    \
    for (int64_t b = 0; b < whole; b++) BLOCK(acts, l, w, row_bytes, b, 1, acc, R, MB, &next);                 \
    for (int64_t b = whole; b < l.blocks; b++) BLOCK(acts, l, w, row_bytes, b, 0, acc, R, MB, &next);          \
    for (int m = 0; m < MB; m++)                                                                                \
      for (int r = 0; r < R; r++) res[m * R + r] = hsum(acc[m][r]) * s[r];                                     \
  }
TILE_INT8_INT16(tile_int8_int16, block_int8_int16)
TILE_INT8_INT16(tile_int8_int16_vnni, block_int8_int16_vnni, VNNI)

/* Exact: fp32 activations x [MB][ldx] (INT4: in the even/odd order), weights decoded 8 bytes at a time. */
INLINE void tile_exact(const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, const float *s,
                       int64_t kpad, int bits, float *res, int R, int MB) {
  const int64_t group = bits == 4 ? GROUP : kpad, groups = kpad / group;
  const __m256i low4 = _mm256_set1_epi32(0xF), magic = _mm256_set1_epi32(0x4B000000); /* 2^23 */
  const __m256 bias = _mm256_set1_ps(8388616.0f);                                      /* 2^23 + 8 */
  __m256 total[4][4];
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) total[m][r] = _mm256_setzero_ps();
  const uint8_t *next = w + R * row_bytes;
  for (int64_t g = 0; g < groups; g++) {
    __m256 acc[4][4];
    for (int m = 0; m < MB; m++)
      for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    /* INT4: 8 bytes at byte offset o hold activations (in the order above) o' and o' + 32 of its run of
     * 64, o' = o mod 32 + 64 * (o / 32); INT8: 8 weights at column o */
    for (int64_t o = g * group * bits / 8; o < (g + 1) * group * bits / 8; o += 8) {
      __m256 lo[4], hi[4];
      for (int r = 0; r < R; r++) {
        if (o % 64 == 0) next = prefetch(next);
        if (bits == 4) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + r * row_bytes + o)));
          lo[r] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, low4), magic)), bias);
          hi[r] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(v, 4), magic)), bias);
        } else {
          lo[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(w + r * row_bytes + o, row_bytes - o)));
        }
      }
      const int64_t col = bits == 4 ? (o & 31) + 64 * (o / 32) : o;
      for (int m = 0; m < MB; m++) {
        const __m256 xl = _mm256_loadu_ps(x + m * ldx + col);
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(lo[r], xl, acc[m][r]);
        if (bits == 4) {
          const __m256 xh = _mm256_loadu_ps(x + m * ldx + col + 32);
          for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(hi[r], xh, acc[m][r]);
        }
      }
    }
    for (int r = 0; r < R; r++) {
      const __m256 scale = _mm256_broadcast_ss(s + r * groups + g);
      for (int m = 0; m < MB; m++) total[m][r] = _mm256_fmadd_ps(acc[m][r], scale, total[m][r]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) res[m * R + r] = hsum(total[m][r]);
}

/* ---- one call ---- */

typedef struct {
  int64_t M, N, K, kpad, row_bytes, ldo;
  int bits, mode, otype, btype, vnni;
  const uint8_t *w, *acts; /* acts: integer rows [M][l.stride] or fp32 rows [M][kpad] (EXACT) */
  const float *s;
  const void *bias;
  void *out;
  qlayout l;
} problem;

/* A tile of R rows from row n for MB activation rows; one function per (kind, R, MB). */
typedef void (*tile_fn)(const problem *, const uint8_t *acts, int64_t n, float *res);
#define TILE(NAME, R, MB, CALL) \
  static void NAME##_##R##_##MB(const problem *p, const uint8_t *acts, int64_t n, float *res) { CALL; }
#define W(p, n) ((p)->w + (n) * (p)->row_bytes)
#define Q4(R, MB) TILE(int4_int8, R, MB, tile_int4_int8(acts, p->l, W(p, n), p->row_bytes, p->s + n * p->l.blocks, res, R, MB))
#define V4(R, MB)                                                                                     \
  static VNNI void int4_vnni_##R##_##MB(const problem *p, const uint8_t *acts, int64_t n, float *res) { \
    tile_int4_int8_vnni(acts, p->l, W(p, n), p->row_bytes, p->s + n * p->l.blocks, res, R, MB);          \
  }
#define Q8(R, MB) TILE(int8_int16, R, MB, tile_int8_int16(acts, p->l, W(p, n), p->row_bytes, p->s + n, res, R, MB))
#define V8(R, MB)                                                                                     \
  static VNNI void int8_vnni_##R##_##MB(const problem *p, const uint8_t *acts, int64_t n, float *res) { \
    tile_int8_int16_vnni(acts, p->l, W(p, n), p->row_bytes, p->s + n, res, R, MB);                      \
  }
#define EX(B, R, MB)                                                                                               \
  TILE(exact##B, R, MB,                                                                                            \
       tile_exact((const float *)acts, p->kpad, W(p, n), p->row_bytes, p->s + n * (B == 4 ? p->kpad / GROUP : 1), \
                  p->kpad, B, res, R, MB))
/* Rows per tile for MB = 1..4 (accumulators, decoded weights and temporaries in 16 registers, 32 for the
 * VNNI ones; INT4's 8-row AVX2 tile keeps some of its integer sums on the stack, measured faster than 4
 * rows all in registers), the one-row tiles for N's tail, and 4-row tiles for MB = 1 (`qp_decode_rows`:
 * half as many weight streams at once, measured faster on a Zen 5). */
Q4(8, 1) Q4(4, 1) Q4(2, 2) Q4(1, 1) Q4(1, 2) Q4(1, 3) Q4(1, 4)
V4(8, 1) V4(4, 1) V4(4, 2) V4(2, 3) V4(2, 4) V4(1, 1) V4(1, 2) V4(1, 3) V4(1, 4)
Q8(8, 1) Q8(4, 1) Q8(4, 2) Q8(2, 3) Q8(2, 4) Q8(1, 1) Q8(1, 2) Q8(1, 3) Q8(1, 4)
V8(4, 2) V8(2, 3) V8(2, 4) V8(1, 2) V8(1, 3) V8(1, 4)
EX(4, 4, 1) EX(4, 2, 2) EX(4, 2, 3) EX(4, 2, 4) EX(4, 1, 1) EX(4, 1, 2) EX(4, 1, 3) EX(4, 1, 4)
EX(8, 4, 1) EX(8, 2, 2) EX(8, 2, 3) EX(8, 2, 4) EX(8, 1, 1) EX(8, 1, 2) EX(8, 1, 3) EX(8, 1, 4)

typedef struct {
  tile_fn wide[4], one[4]; /* by MB - 1 */
  int rows[4];
  tile_fn four; /* MB = 1 on 4 rows (`qp_decode_rows`) */
} tiles;
static const tiles INT4_INT8 = {{int4_int8_8_1, int4_int8_2_2, int4_int8_1_3, int4_int8_1_4},
                                {int4_int8_1_1, int4_int8_1_2, int4_int8_1_3, int4_int8_1_4}, {8, 2, 1, 1}, int4_int8_4_1};
static const tiles INT4_VNNI = {{int4_vnni_8_1, int4_vnni_4_2, int4_vnni_2_3, int4_vnni_2_4},
                                {int4_vnni_1_1, int4_vnni_1_2, int4_vnni_1_3, int4_vnni_1_4}, {8, 4, 2, 2}, int4_vnni_4_1};
static const tiles INT8_INT16 = {{int8_int16_8_1, int8_int16_4_2, int8_int16_2_3, int8_int16_2_4},
                                 {int8_int16_1_1, int8_int16_1_2, int8_int16_1_3, int8_int16_1_4}, {8, 4, 2, 2},
                                 int8_int16_4_1};
/* One activation row stays on the AVX2 tiles: streaming weights from DRAM, VNNI ones were 5-9% slower there
 * on a Zen 5 (the AVX2 ones read at 90% of the probe's bandwidth); 2 rows: 1.1x at 1 thread, both at the
 * bandwidth at 2; 4 rows: 1.65-2.1x, 2.3-2.5x in cache (bench/README.md, "INT8 tiles on AVX-512 VNNI"). The
 * same outputs either way. */
static const tiles INT8_VNNI = {{int8_int16_8_1, int8_vnni_4_2, int8_vnni_2_3, int8_vnni_2_4},
                                {int8_int16_1_1, int8_vnni_1_2, int8_vnni_1_3, int8_vnni_1_4}, {8, 4, 2, 2}, int8_int16_4_1};
static const tiles EXACT4 = {{exact4_4_1, exact4_2_2, exact4_2_3, exact4_2_4},
                             {exact4_1_1, exact4_1_2, exact4_1_3, exact4_1_4}, {4, 2, 2, 2}, exact4_4_1};
static const tiles EXACT8 = {{exact8_4_1, exact8_2_2, exact8_2_3, exact8_2_4},
                             {exact8_1_1, exact8_1_2, exact8_1_3, exact8_1_4}, {4, 2, 2, 2}, exact8_4_1};

/* Which tiles multiply one activation row: 0 the 8-row ones, 1 the 4-row ones (`choose_tiles`). Every
 * output is the same sum in the same order either way. */
static int decode_four = 0;
int qp_decode_rows(int want) { return choose_tiles(&decode_four, want, 1); }

static void rows(const void *arg, int64_t n0, int64_t n1) {
  const problem *p = arg;
  const tiles *t = p->mode == INT8    ? (p->vnni ? &INT4_VNNI : &INT4_INT8)
                   : p->mode == INT16 ? (p->vnni ? &INT8_VNNI : &INT8_INT16)
                   : p->bits == 4     ? &EXACT4
                                      : &EXACT8;
  const int64_t act_stride = p->mode == EXACT ? p->kpad * 4 : p->l.stride;
  float res[32];
  for (int64_t nb = n0; nb < n1; nb += 16) { /* 16 weight rows at a time: in cache while M repeats them */
    const int64_t ne = nb + 16 < n1 ? nb + 16 : n1;
    for (int64_t m = 0; m < p->M; m += 4) {
      const int mb = p->M - m < 4 ? (int)(p->M - m) : 4, four = mb == 1 && decode_four == 1;
      const int step = four ? 4 : t->rows[mb - 1];
      const tile_fn wide = four ? t->four : t->wide[mb - 1];
      const uint8_t *acts = p->acts + m * act_stride;
      for (int64_t n = nb; n < ne;) {
        const int r = n + step <= ne ? step : 1;
        (r == step ? wide : t->one[mb - 1])(p, acts, n, res);
        for (int i = 0; i < mb; i++)
          for (int j = 0; j < r; j++) {
            const float b = p->bias ? to_f32(p->bias, p->btype, n + j) : 0.0f;
            store(p->out, p->otype, (m + i) * p->ldo + n + j, res[i * r + j] + b);
          }
        n += r;
      }
    }
  }
}

/* Which integer tiles run, INT4 x int8 (qp_int4_vnni) and INT8 x int16 (qp_int8_vnni): 0 the AVX2 ones, 1 the
 * VNNI ones (`choose_tiles`; only on a CPU with AVX-512 F, BW, VL and VNNI). */
#define HAS_VNNI                                                                                          \
  (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && \
   __builtin_cpu_supports("avx512vnni"))
static int use_vnni = -1, use_vnni8 = -1;
int qp_int4_vnni(int want) { return choose_tiles(&use_vnni, want, HAS_VNNI); }
int qp_int8_vnni(int want) { return choose_tiles(&use_vnni8, want, HAS_VNNI); }

/* Bytes of scratch a call needs: fp32 rows [M][kpad] (EXACT), or integer rows [M][l.stride] then the one
 * fp32 row they are made from. */
int64_t qp_scratch_bytes(int64_t M, int64_t kp, int bits, int mode) {
  const int64_t kpad = padded_k(kp, bits, mode);
  return mode == EXACT ? M * kpad * 4 : M * layout(kpad, mode).stride + kpad * 4;
}

/* x [M, K] (row stride ldx elements, `xtype`) @ w.T -> out [M, N] (row stride ldo, `otype`), + bias [N]
 * (`btype`), or no bias if NULL. kp: the weights' columns (INT4: the data's columns x 2, a multiple of
 * 128), K <= kp. Returns 0; -1 if the scratch could not be allocated; -2 for a mode the format lacks. */
int qp_linear(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, const uint8_t *w, const float *s,
              int64_t N, int64_t kp, int bits, const void *bias, int btype, void *out, int64_t ldo, int otype,
              int mode, int threads) {
  if (mode != EXACT && mode != (bits == 4 ? INT8 : INT16)) return -2;
  problem p = {.M = M, .N = N, .K = K, .row_bytes = bits == 4 ? kp / 2 : kp, .ldo = ldo, .bits = bits,
               .mode = mode, .otype = otype, .btype = btype, .w = w, .s = s, .bias = bias,
               .out = out, .vnni = bits == 4 ? qp_int4_vnni(-1) : qp_int8_vnni(-1)};
  p.kpad = padded_k(kp, bits, p.mode);
  p.l = layout(p.kpad, p.mode);
  int fresh;
  uint8_t *buf = scratch((size_t)qp_scratch_bytes(M, kp, bits, mode), &fresh);
  if (buf == NULL) return -1;
  const size_t fp32_row = (size_t)p.kpad * 4, integers = p.mode == EXACT ? 0 : (size_t)M * p.l.stride;
  for (int64_t m = 0; m < M; m++) {
    float *xf = (float *)(buf + (p.mode == EXACT ? m * fp32_row : integers));
    row_to_f32((const uint8_t *)x + m * ldx * (xtype == F32 ? 4 : 2), xtype, K, xf, p.kpad, bits == 4);
    if (p.mode != EXACT) quantize_row(xf, p.mode, buf + m * p.l.stride, p.l);
  }
  p.acts = buf;
  parallel_rows(rows, &p, N, p.kpad, threads);
  if (fresh) free(buf);
  return 0;
}

/* ---- dequantized rows, for the matmul above the kernels' largest M ---- */

/* 8 floats to out[i .. i + 7] of `type`, each rounded as `store` rounds it */
INLINE void store8(void *out, int type, int64_t i, __m256 v) {
  if (type == F32) {
    _mm256_storeu_ps((float *)out + i, v);
    return;
  }
  __m128i h;
  if (type == F16) {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  } else { /* bf16: + 0x7FFF + the kept lowest bit, then the top half; a NaN made quiet instead */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                            _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i bits = _mm256_srli_epi32(_mm256_blendv_epi8(up, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan), 16);
    h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8));
  }
  _mm_storeu_si128((__m128i *)((uint16_t *)out + i), h);
}

typedef struct {
  const uint8_t *w;
  const float *s;
  int64_t first, kp, row_bytes, groups;
  int bits, otype;
  void *out;
} dequant_job;

static void dequant_rows(const void *arg, int64_t n0, int64_t n1) {
  const dequant_job *j = arg;
  const __m256i low4 = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *w = j->w + (j->first + n) * j->row_bytes;
    const float *s = j->s + (j->first + n) * j->groups;
    const int64_t o = n * j->kp;
    if (j->bits == 4) { /* 8 bytes: codes of columns k, k + 1, ..., k + 15 in low, high, low, ... nibbles */
      for (int64_t k = 0; k < j->kp; k += 16) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + k / 2)));
        const __m256 scale = _mm256_set1_ps(s[k / GROUP]);
        const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, low4), eight)), scale);
        const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight)), scale);
        const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi); /* per 128-bit lane */
        store8(j->out, j->otype, o + k, _mm256_permute2f128_ps(a, b, 0x20));
        store8(j->out, j->otype, o + k + 8, _mm256_permute2f128_ps(a, b, 0x31));
      }
      continue;
    }
    const __m256 scale = _mm256_set1_ps(s[0]);
    int64_t k = 0;
    for (; k + 8 <= j->kp; k += 8)
      store8(j->out, j->otype, o + k,
             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k)))), scale));
    for (; k < j->kp; k++) store(j->out, j->otype, o + k, (float)(int8_t)w[k] * s[0]);
  }
}

/* Rows first .. first + rows - 1 of a weight as qp_linear reads it (w, s, kp, bits as there), dequantized into
 * out [rows, kp] of `otype`: each weight's value times its scale, in fp32, rounded once. Returns 0. */
int qp_dequantize(const uint8_t *w, const float *s, int64_t first, int64_t rows, int64_t kp, int bits, void *out,
                  int otype, int threads) {
  const dequant_job j = {w, s, first, kp, bits == 4 ? kp / 2 : kp, bits == 4 ? kp / GROUP : 1, bits, otype, out};
  parallel_rows(dequant_rows, &j, rows, kp, threads);
  return 0;
}

/* ---- a MoE layer (moe_layer.h) on the kernels above ---- */

typedef struct { /* E experts' weights [E, N, kp] as qp_linear reads each (N: the GEMM's) */
  const uint8_t *w;
  const float *s;
  int64_t kp, row_bytes, groups;
  int bits, mode;
  int per_token; /* INT8 W8A8: each input row through int8 first, one scale per row */
  float eps;
} int_experts;

/* Row v (n elements) through int8 and back in place, as quantpass's reference quantizes a per-token
 * INT8 activation: scale = max(max|v|, eps) / 127, round(v / scale) to nearest even within +-127, times
 * scale (NaN rows stay NaN). */
static void fake_int8_row(float *v, int64_t n, float eps) {
  float amax = 0.0f;
  for (int64_t k = 0; k < n; k++) amax = isnan(v[k]) || isnan(amax) ? NAN : fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
  const float scale = (isnan(amax) ? amax : amax > eps ? amax : eps) / 127.0f;
  for (int64_t k = 0; k < n; k++) {
    float q = v[k] / scale;
    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q; /* NaN stays NaN */
    v[k] = nearbyintf(q) * scale;
  }
}

static int int_expert(const void *weights, int64_t e, float *x, int64_t m, int64_t K, float *out, int64_t N,
                      int threads) {
  const int_experts *q = weights;
  for (int64_t r = 0; q->per_token && r < m; r++) fake_int8_row(x + r * K, K, q->eps);
  return qp_linear(x, K, F32, m, K, q->w + e * N * q->row_bytes, q->s + e * N * q->groups, N, q->kp, q->bits, NULL,
                   0, out, N, F32, q->mode, threads);
}

/* moe_layer on INT8/INT4 experts: w13 [E, 2I, kp13 (/ 2 for INT4)], s13 [E, 2I, groups], w2 [E, H, kp2 ...],
 * s2 [E, H, ...] contiguous, as qp_linear reads them, multiplied in `mode`; `per_token` (INT8 W8A8): each
 * GEMM's input rows through int8 per row first (`eps`: quantpass's AMAX_EPS), as the reference's loop
 * quantizes them over all routed rows, row by row. */
int qp_moe(MOE_PARAMS, const uint8_t *w13, const float *s13, int64_t kp13, const uint8_t *w2, const float *s2,
           int64_t kp2, int bits, int mode, int per_token, float eps) {
  const int_experts a = {w13, s13, kp13, bits == 4 ? kp13 / 2 : kp13, bits == 4 ? kp13 / GROUP : 1, bits, mode,
                         per_token, eps};
  const int_experts b = {w2, s2, kp2, bits == 4 ? kp2 / 2 : kp2, bits == 4 ? kp2 / GROUP : 1, bits, mode,
                         per_token, eps};
  return moe_layer(MOE_ARGS, int_expert, NULL, &a, &b);
}
