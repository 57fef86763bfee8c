/* FP4 (e2m1) weight linear for x86-64 with AVX2, FMA and F16C: MXFP4 and NVFP4 weights,
 *   out[M, N] = x[M, K] @ dequant(w)[N, Kp].T (+ bias[N]),
 * read in the layout quantpass quantizes into (no prepared copy): w [N, Kp / 2] bytes, byte j of a row
 * holding code(2j) in its low nibble and code(2j + 1) in its high one (sign in bit 3); ws [N, Kp / B]
 * one scale byte per block of B weights (MXFP4: B = 32, e8m0; NVFP4: B = 16, e4m3), decoded through
 * `lut` (256 floats: the byte's value); NVFP4's per-tensor scale and other constants come in as `g`.
 * Built and loaded at run time by quantpass/kernels/cpu_fp4.py (ctypes).
 *
 * Every e2m1 value times 2 is an integer in [-12, 12], so a block's dot product is an integer one:
 *   activations  quantized here once per call (`act`): INT8_BLOCKS, per block of B to int8 q with
 *                d = max|x| / 127 (weight-only formats, llama.cpp's Q8 idea); NVFP4, to NVFP4 as
 *                quantpass's formats.quantize does for a dynamic key, byte for byte (an fp32 scale
 *                over the whole x, e4m3 block scales, e2m1 codes through `codes`, the table that
 *                function rounds with): the products are then exact integer ones.
 *   products     per 32 weight bytes (64 codes): the nibbles become int8 through one _mm256_shuffle_epi8
 *                table lookup each, _mm256_maddubs_epi16 multiplies |w| by sign(w) * q (llama.cpp's
 *                trick for signed x signed), _mm256_madd_epi16 sums into 8 int32 lanes (each lane: 8
 *                codes of one block; |sums| <= 2 * 12 * 127 * 4 < 2^31), one conversion and one FMA by
 *                the lanes' weight scale x activation scale.
 * The activations are split once per call into their even and odd columns, so the low nibbles of 32
 * weight bytes meet 32 consecutive even activations and the high ones the odd ones. Where the CPU has
 * AVX-512 VNNI (`qp_fp4_tiles`), 512-bit tiles form the same integer lane sums 64 bytes at a time (see
 * tile_vnni): 1.35-1.65x the AVX2 tiles' speed at M <= 16 on Zen 4 (bench/README.md, "VNNI tiles for
 * FP4"). Threads (OpenMP)
 * split N into ranges starting on multiples of 16 rows; each output is one thread's sum in a fixed
 * order, whatever the number of threads (built with -ffp-contract=off).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "moe_layer.h"

#define CHUNK 32                         /* weight bytes (64 codes) per step */

enum { INT8_BLOCKS = 0, NVFP4 = 1 }; /* `act` */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define OFFSET 12 /* the VNNI tiles' codes are E2M1_X2 + 12, unsigned */

typedef struct {
  outputs o; /* g: the weight's per-tensor scale, with x's for NVFP4 activations */
  int64_t N, K, kp, row_bytes, chunks, full_chunks, blocks, act_stride;
  int block, act;
  float eps, scale2; /* NVFP4 activations: formats.AMAX_EPS, x's per-tensor scale */
  const uint8_t *w, *ws, *codes;
  const float *lut;
  const int8_t *acts; /* per activation row: even codes [chunks * 32], odd codes [chunks * 32], lane scales
                       * [chunks * 8] fp32, lane corrections [chunks * 8] int32 (the VNNI tiles') */
} problem;

/* The block each of a chunk's 8 int32 lanes sums (lane i: bytes 4i .. 4i + 3, codes 64c + 8i ..), or -1 past the row. */
INLINE int64_t lane_block(const problem *p, int64_t c, int i) {
  const int64_t b = (64 * c + 8 * i) / p->block;
  return b < p->blocks ? b : -1;
}

/* fp32 -> e4m3 -> fp32, rounded to nearest even, for v in [2^-6, 448] (e4m3's normal range) or NaN. */
INLINE float e4m3(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFF) <= 0x7F800000) u = (u + 0x7FFFF + ((u >> 20) & 1)) & ~(uint32_t)0xFFFFF;
  memcpy(&v, &u, 4);
  return v;
}

/* e2m1 code of an fp32 value: formats.py's table, keyed by its top 12 bits and whether any low 20 is set. */
INLINE int8_t e2m1_x2(const uint8_t *codes, float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return E2M1_X2[codes[((u >> 20) & 0xFFF) << 1 | ((u & 0xFFFFF) != 0)] & 15];
}

/* One activation row into p's layout: int8 codes split even/odd, and per lane its block's scale. */
static void prepare_row(const problem *p, const void *x, int xtype, int8_t *dst) {
  const int64_t half = p->chunks * CHUNK, B = p->block;
  int8_t *even = dst, *odd = dst + half;
  float *lanes = (float *)(dst + 2 * half);
  float d[p->blocks > 0 ? p->blocks : 1];
  memset(even, 0, (size_t)(2 * half));
  if (p->act == NVFP4) { /* formats._quantize_grouped's NVFP4 branch, in its order of fp32 operations */
    for (int64_t b = 0; b < p->blocks; b++) {
      float v[16], amax = 0.0f;
      for (int64_t k = 0; k < 16; k++) {
        const int64_t col = b * 16 + k;
        v[k] = col < p->K ? to_f32(x, xtype, col) : 0.0f;
        amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
      }
      float s = (amax > p->eps ? amax : p->eps) / 6.0f / p->scale2;
      s = e4m3(s < 0.015625f ? 0.015625f : s > 448.0f ? 448.0f : s);
      const float scale = s * p->scale2;
      d[b] = s; /* x's scale2 is applied once, through g */
      for (int64_t k = 0; k < 16; k += 2) {
        even[(b * 16 + k) / 2] = e2m1_x2(p->codes, v[k] / scale);
        odd[(b * 16 + k) / 2] = e2m1_x2(p->codes, v[k + 1] / scale);
      }
    }
  } else { /* int8 per block of B: d = max|x| / 127, NaN if any is NaN or infinite */
    for (int64_t b = 0; b < p->blocks; b++) {
      float v[64], amax = 0.0f;
      int finite = 1;
      for (int64_t k = 0; k < B; k++) {
        const int64_t col = b * B + k;
        v[k] = col < p->K ? to_f32(x, xtype, col) : 0.0f;
        finite &= isfinite(v[k]) != 0;
        amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
      }
      d[b] = finite ? amax / 127.0f : NAN;
      const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t k = 0; k < B; k++) {
        const int64_t col = b * B + k;
        const int8_t q = finite ? (int8_t)lrintf(v[k] * inv) : 0; /* to nearest even, |q| <= 127 */
        if (col & 1)
          odd[col / 2] = q;
        else
          even[col / 2] = q;
      }
    }
  }
  int32_t *corr = (int32_t *)(lanes + p->chunks * 8);
  for (int64_t c = 0; c < p->chunks; c++)
    for (int i = 0; i < 8; i++) {
      const int64_t b = lane_block(p, c, i);
      lanes[c * 8 + i] = b < 0 ? 0.0f : d[b];
      int32_t sum = 0; /* the lane's codes, times the VNNI tiles' offset */
      for (int j = 0; j < 4; j++) sum += even[c * CHUNK + 4 * i + j] + odd[c * CHUNK + 4 * i + j];
      corr[c * 8 + i] = -OFFSET * sum;
    }
}

/* Weight rows r0 .. r0 + R - 1 times activation rows m0 .. m0 + MB - 1 -> res[m * R + r] (without g), over
 * the rows' chunks from c0 (0: a tile). */
INLINE void tile_from(const problem *p, int64_t r0, int64_t m0, int R, int MB, float *res, int64_t c0) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2));
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[4][MB_MAX];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_ps();
  const int64_t half = p->chunks * CHUNK;
  const uint8_t *next = p->w + (r0 + R) * p->row_bytes;
  for (int64_t c = c0; c < p->chunks; c++) {
    const int64_t start = c * CHUNK;
    for (int r = 0; r < R; r++) {
      const uint8_t *w = p->w + (r0 + r) * p->row_bytes + start;
      const uint8_t *s = p->ws + (r0 + r) * p->blocks;
      __m256i v;
      __m256 scale;
      if (c < p->full_chunks) { /* all 64 codes in the row: no division here, this runs per 32 bytes */
        v = _mm256_loadu_si256((const __m256i *)w);
        if (c % 2 == 0) next = prefetch(next); /* 64 bytes per two chunks */
        if (p->block == 16)
          scale = _mm256_setr_ps(p->lut[s[4 * c]], p->lut[s[4 * c]], p->lut[s[4 * c + 1]], p->lut[s[4 * c + 1]],
                                 p->lut[s[4 * c + 2]], p->lut[s[4 * c + 2]], p->lut[s[4 * c + 3]], p->lut[s[4 * c + 3]]);
        else
          scale = _mm256_setr_ps(p->lut[s[2 * c]], p->lut[s[2 * c]], p->lut[s[2 * c]], p->lut[s[2 * c]],
                                 p->lut[s[2 * c + 1]], p->lut[s[2 * c + 1]], p->lut[s[2 * c + 1]], p->lut[s[2 * c + 1]]);
      } else { /* the row's last, partial chunk: missing bytes read as zero codes, missing blocks as scale 0 */
        uint8_t tmp[CHUNK] = {0};
        float f[8];
        memcpy(tmp, w, (size_t)(p->row_bytes - start));
        v = _mm256_loadu_si256((const __m256i *)tmp);
        for (int i = 0; i < 8; i++) {
          const int64_t b = lane_block(p, c, i);
          f[i] = b < 0 ? 0.0f : p->lut[s[b]];
        }
        scale = _mm256_loadu_ps(f);
      }
      const __m256i wl = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
      const __m256i wh = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
      for (int m = 0; m < MB; m++) {
        const int8_t *a = p->acts + (m0 + m) * p->act_stride;
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(a + start));
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(a + half + start));
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(xl, wl)),
                                               _mm256_maddubs_epi16(ah, _mm256_sign_epi8(xh, wh)));
        const __m256 lanes = _mm256_loadu_ps((const float *)(a + 2 * half) + c * 8);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), _mm256_mul_ps(scale, lanes),
                                    acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) res[m * R + r] = hsum(acc[r][m]);
}

/* One function per (R, MB): the tile's loops unrolled with its registers. */
#define TILE(R, MB)                                                                \
  static void tile_##R##_##MB(const void *p, int64_t r0, int64_t m0, float *res) { \
    tile_from(p, r0, m0, R, MB, res, 0);                                           \
  }
TILE(4, 1) TILE(2, 2) TILE(2, 3) TILE(2, 4) TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)
static const mb_tile_fn WIDE[MB_MAX] = {tile_4_1, tile_2_2, tile_2_3, tile_2_4}, ONE[MB_MAX] = {tile_1_1, tile_1_2, tile_1_3, tile_1_4};
static const int WIDE_ROWS[MB_MAX] = {4, 2, 2, 2};

static void rows(const void *p, int64_t n0, int64_t n1) { tile_rows(p, WIDE, ONE, WIDE_ROWS, n0, n1); }

/* ---- AVX-512 VNNI tiles: 64 weight bytes (128 codes) per step ----
 * The codes + 12 (unsigned: E2M1_X2 + OFFSET) through one _mm512_shuffle_epi8 each, _mm512_dpbusd_epi32
 * multiplies them by the int8 activations and adds 4 products per int32 lane, starting from the lane's
 * correction (-12 x the sum of its activation codes): the AVX2 tiles' integer lane sums exactly; then
 * the same conversion and FMA by weight scale x activation scale, on 16 lanes. A row's last odd or
 * partial chunk goes through the AVX2 tile. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* The weight scales of 64-byte step t's 16 lanes (row scales s): 4 blocks of 32 or 8 of 16 codes. */
INLINE VNNI __m512 lane_scales(const problem *p, const uint8_t *s, int64_t t) {
  const float *lut = p->lut;
  if (p->block == 16) {
    s += 8 * t;
    const __m256 v = _mm256_setr_ps(lut[s[0]], lut[s[1]], lut[s[2]], lut[s[3]], lut[s[4]], lut[s[5]], lut[s[6]], lut[s[7]]);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(v));
  }
  s += 4 * t;
  const __m128 v = _mm_setr_ps(lut[s[0]], lut[s[1]], lut[s[2]], lut[s[3]]);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(v));
}

INLINE VNNI void tile_vnni(const problem *p, int64_t r0, int64_t m0, int R, int MB, float *res) {
  const __m512i table = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_X2)),
                                        _mm512_set1_epi8(OFFSET));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t half = p->chunks * CHUNK, steps = p->full_chunks / 2;
  __m512 acc[4][MB_MAX];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
  const uint8_t *next = p->w + (r0 + R) * p->row_bytes;
  for (int64_t t = 0; t < steps; t++)
#pragma GCC unroll 4 /* acc in registers (measured: 1.2-1.3x slower as a loop) */
    for (int r = 0; r < R; r++) {
      const __m512i v = _mm512_loadu_si512((const void *)(p->w + (r0 + r) * p->row_bytes + 64 * t));
      next = prefetch(next);
      const __m512 scale = lane_scales(p, p->ws + (r0 + r) * p->blocks, t);
      const __m512i wl = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
      const __m512i wh = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) {
        const int8_t *a = p->acts + (m0 + m) * p->act_stride;
        const float *lanes = (const float *)(a + 2 * half);
        const int32_t *corr = (const int32_t *)(lanes + p->chunks * 8);
        __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(corr + 16 * t)), wl,
                                        _mm512_loadu_si512((const void *)(a + 64 * t)));
        d = _mm512_dpbusd_epi32(d, wh, _mm512_loadu_si512((const void *)(a + half + 64 * t)));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(scale, _mm512_loadu_ps(lanes + 16 * t)),
                                    acc[r][m]);
      }
    }
  float rest[4 * MB_MAX] = {0}; /* an odd last chunk, a partial one: the AVX2 tile's */
  if (2 * steps < p->chunks) tile_from(p, r0, m0, R, MB, rest, 2 * steps);
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) res[m * R + r] = _mm512_reduce_add_ps(acc[r][m]) + rest[m * R + r];
}

#define TILE_VNNI(R, MB)                                                                       \
  static VNNI void tile_vnni_##R##_##MB(const void *p, int64_t r0, int64_t m0, float *res) { \
    tile_vnni(p, r0, m0, R, MB, res);                                                        \
  }
TILE_VNNI(4, 1) TILE_VNNI(2, 2) TILE_VNNI(2, 3) TILE_VNNI(2, 4) TILE_VNNI(1, 1) TILE_VNNI(1, 2) TILE_VNNI(1, 3) TILE_VNNI(1, 4)
static const mb_tile_fn WIDE_VNNI[MB_MAX] = {tile_vnni_4_1, tile_vnni_2_2, tile_vnni_2_3, tile_vnni_2_4},
                        ONE_VNNI[MB_MAX] = {tile_vnni_1_1, tile_vnni_1_2, tile_vnni_1_3, tile_vnni_1_4};

static void rows_vnni(const void *p, int64_t n0, int64_t n1) { tile_rows(p, WIDE_VNNI, ONE_VNNI, WIDE_ROWS, n0, n1); }

/* Which tiles run: 0 the AVX2 ones, 1 the VNNI ones (`choose_tiles`; only on a CPU with AVX-512 F, BW, VL
 * and VNNI). */
static int use_vnni = -1;
int qp_fp4_tiles(int want) {
  return choose_tiles(&use_vnni, want, __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"));
}

/* Bytes of scratch a call needs: per activation row, even and odd codes, then 8 fp32 lane scales and 8 int32
 * lane corrections per chunk. */
int64_t qp_fp4_scratch_bytes(int64_t M, int64_t kp) {
  const int64_t chunks = (kp / 2 + CHUNK - 1) / CHUNK;
  return M * chunks * (2 * CHUNK + 64);
}

typedef struct { /* NVFP4 activations' per-tensor scale, and whether every value it was taken over is finite */
  float scale2;
  int finite;
} tensor_scale;

/* x [M, K]'s NVFP4 per-tensor scale: max|x| (at least eps) / (448 * 6), as torchao's. */
static tensor_scale nvfp4_tensor_scale(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, float eps) {
  float amax = 0.0f;
  int finite = 1;
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k++) {
      const float v = fabsf(to_f32((const uint8_t *)x + m * ldx * (xtype == F32 ? 4 : 2), xtype, k));
      finite &= v <= 3.4028235e38f; /* false for NaN and inf */
      amax = v > amax ? v : amax;
    }
  return (tensor_scale){(amax > eps ? amax : eps) / 2688.0f, finite};
}

/* qp_linear_fp4 with NVFP4 activations' per-tensor scale given (`ts`; unused for INT8_BLOCKS). */
static int linear_fp4(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, int act, const uint8_t *codes,
                      float eps, tensor_scale ts, const uint8_t *w, const uint8_t *ws, const float *lut, int block,
                      int64_t N, int64_t kp, float g, const void *bias, int btype, void *out, int64_t ldo, int otype,
                      int threads) {
  if ((block != 16 && block != 32) || kp % block || (act == NVFP4 && (block != 16 || codes == NULL))) return -2;
  problem p = {.o = {.M = M, .ldo = ldo, .otype = otype, .btype = btype, .g = g, .bias = bias, .out = out},
               .N = N, .K = K, .kp = kp, .row_bytes = kp / 2, .chunks = (kp / 2 + CHUNK - 1) / CHUNK,
               .full_chunks = kp / 64, .blocks = kp / block, .block = block, .act = act, .eps = eps, .w = w,
               .ws = ws, .codes = codes, .lut = lut};
  if (act == NVFP4) {
    p.scale2 = ts.scale2;
    p.o.g = ts.finite ? g * ts.scale2 * 0.5f : NAN; /* x's codes are its e2m1 values x 2 too */
  }
  p.act_stride = p.chunks * (2 * CHUNK + 64);
  const size_t bytes = (size_t)qp_fp4_scratch_bytes(M, kp);
  int fresh;
  int8_t *buf = (int8_t *)scratch(bytes, &fresh);
  if (buf == NULL) return -1;
  for (int64_t m = 0; m < M; m++)
    prepare_row(&p, (const uint8_t *)x + m * ldx * (xtype == F32 ? 4 : 2), xtype, buf + m * p.act_stride);
  p.acts = buf;
  parallel_rows(qp_fp4_tiles(-1) ? rows_vnni : rows, &p, N, kp, threads);
  if (fresh) free(buf);
  return 0;
}

/* x [M, K] (row stride ldx elements, `xtype`) @ w.T -> out [M, N] (row stride ldo, `otype`) * g, + bias [N]
 * (`btype`; NULL: none). kp: the weights' columns (the data's columns x 2), a multiple of `block` (16 or
 * 32), K <= kp. `act`: INT8_BLOCKS, or NVFP4 (block 16) with `codes` (formats.py's 8192-entry e2m1 table)
 * and `eps` (its AMAX_EPS); an x with a NaN or infinity then gives NaN everywhere (its per-tensor scale).
 * Returns 0; -1 if the scratch could not be allocated; -2 for a block size other than 16 or 32, a kp that
 * is not a multiple of it, or NVFP4 activations on blocks of 32 or without `codes`. */
int qp_linear_fp4(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, int act, const uint8_t *codes,
                  float eps, const uint8_t *w, const uint8_t *ws, const float *lut, int block, int64_t N, int64_t kp,
                  float g, const void *bias, int btype, void *out, int64_t ldo, int otype, int threads) {
  const tensor_scale ts = act == NVFP4 ? nvfp4_tensor_scale(x, ldx, xtype, M, K, eps) : (tensor_scale){0.0f, 1};
  return linear_fp4(x, ldx, xtype, M, K, act, codes, eps, ts, w, ws, lut, block, N, kp, g, bias, btype, out, ldo,
                    otype, threads);
}

/* ---- a MoE layer (moe_layer.h) on this kernel ---- */

typedef struct { /* E experts' weights [E, N, kp / 2] and block scales [E, N, kp / block], as qp_linear_fp4 reads each */
  const uint8_t *w, *ws;
  const float *lut, *g; /* g: each expert's `g` (NULL: 0.5 for all) */
  int64_t kp;
  int block, act;       /* act: INT8_BLOCKS, or NVFP4 with `codes`, `eps` and the stage's per-tensor scale */
  const uint8_t *codes;
  float eps;
  tensor_scale *stage;  /* NVFP4: taken over every routed row of the stage (`fp4_rows`) */
} fp4_experts;

/* NVFP4 activations: one per-tensor scale over all of a stage's rows, as the reference's loop quantizes
 * them; each expert GEMM then quantizes its rows' blocks with it. */
static void fp4_rows(const void *weights, const float *x, int64_t R, int64_t K) {
  const fp4_experts *q = weights;
  if (q->act == NVFP4) *q->stage = nvfp4_tensor_scale(x, K, F32, R, K, q->eps);
}

static int fp4_expert(const void *weights, int64_t e, float *x, int64_t m, int64_t K, float *out, int64_t N,
                      int threads) {
  const fp4_experts *q = weights;
  return linear_fp4(x, K, F32, m, K, q->act, q->codes, q->eps, *q->stage, q->w + e * N * (q->kp / 2),
                    q->ws + e * N * (q->kp / q->block), q->lut, q->block, N, q->kp, q->g ? q->g[e] : 0.5f, NULL, 0,
                    out, N, F32, threads);
}

/* moe_layer on MXFP4 / NVFP4 experts: w13 [E, 2I, kp13 / 2] and w2 [E, H, kp2 / 2] codes, ws13 and ws2 their
 * scale bytes (blocks of `block`, decoded through `lut`), g13 and g2 each expert's `g` as qp_linear_fp4
 * takes it (NVFP4's per-tensor scale / 2) or NULL (0.5), contiguous. The rows as `xq` (qp_linear_fp4's
 * `act`): int8 per block, or NVFP4 (with `codes` and `eps`) over each stage's routed rows (`fp4_rows`). */
int qp_moe_fp4(MOE_PARAMS, const uint8_t *w13, const uint8_t *ws13, int64_t kp13, const float *g13,
               const uint8_t *w2, const uint8_t *ws2, int64_t kp2, const float *g2, int block, const float *lut,
               int xq, const uint8_t *codes, float eps) {
  tensor_scale s13 = {0.0f, 1}, s2 = {0.0f, 1};
  const fp4_experts a = {w13, ws13, lut, g13, kp13, block, xq, codes, eps, &s13};
  const fp4_experts b = {w2, ws2, lut, g2, kp2, block, xq, codes, eps, &s2};
  return moe_layer(MOE_ARGS, fp4_expert, fp4_rows, &a, &b);
}
