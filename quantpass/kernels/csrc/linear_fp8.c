/* FP8 (e4m3) weight linear for x86-64 with AVX2, FMA and F16C: every FP8 weight quantpass stores,
 *   out[M, N] = x[M, K] @ dequant(w)[N, kp].T (+ bias[N]),
 * read in the layout quantpass quantizes into (no prepared copy): w [N, kp] e4m3 bytes, and a scale
 * grid `ws` with one scale per (`srows` weight rows, `group` columns): per-tensor (srows >= N, group 0:
 * the whole row), per-channel (1, 0), 128x128 blocks (128, 128), MXFP8 (1, 32). Scales are fp32, or
 * bytes decoded through `lut` (256 floats: MXFP8's e8m0, 2^(b - 127), which the bf16 tiles
 * fold into the weights' exponents). Built and loaded at run time by
 * quantpass/kernels/cpu_fp8.py (ctypes).
 *
 * Activations are fp32 (x converted once per call into per-thread scratch, zero past K), as given or
 * (`act`) quantized on the way to FP8 and back: per token (or per group of columns), per tensor, with
 * a static per-tensor scale, or MXFP8's per 32 columns, with the fp32 operations of quantpass's
 * reference (scale = max(max|x|, eps) / 448, the static one, or MXFP8's power of two, x / scale clamped
 * to +-448, rounded to e4m3 to nearest even, times scale), so the values are the reference's bit for bit
 * (tested) and the products are its own up to the order of fp32 sums.
 *
 * Decoding: an e4m3 byte sign-extended to 16 bits and shifted left by 7 is an fp16 with the e4m3 sign in
 * bit 15, a stray copy of it in bit 14 (cleared) and exponent and mantissa below: its value is the e4m3
 * value / 256, subnormals included (they become fp16 subnormals, which F16C converts without a
 * microcode assist). 16 bytes -> two vectors of 8 fp32 (_mm256_cvtph_ps), then FMAs with x; each output is
 * multiplied by the 256 once. e4m3's NaN codes (0x7F, 0xFF) read as +-480 here: quantpass never writes them
 * (a weight with NaN gets a NaN scale, which does propagate).
 *
 * bf16 tiles: where the CPU has AVX-512 BF16 (`qp_fp8_tiles`), e4m3 bytes decode to bf16 and one
 * _mm512_dpbf16_ps multiplies 32 weights by 32 bf16 activations, exactly (bf16 x e4m3 fits fp32), adding
 * into fp32. A call runs on them where every activation it multiplies is a bf16 value that dpbf16ps reads
 * as it is (not subnormal): a bf16 model's activations as given; FP8-quantized ones as their codes (e4m3
 * values), each weight group's sum then times its activation scale (with the weight's), unless a code
 * times its scale is not finite (then the fp32 tiles: the reference's inf and NaN). The products are the
 * fp32 tiles' (weight-only) or the unscaled codes' (W8A8: the scales applied to sums, not to each value);
 * the fp32 sums run in another order, and dpbf16ps flushes sums below 2^-126 to zero. MXFP8's power-of-two
 * scales are folded into the bf16 values instead (weights as they decode, activations as they are
 * quantized: `tile_bf16_mx`), so a row is one sum there too. Measured on Zen 4 (bench/README.md, "bf16
 * tiles on AVX-512 BF16", "MXFP8 with its scales folded"): 1.3-1.6x the fp32 tiles' speed at M = 1,
 * 1.5-2.1x at M = 4 and 16; MXFP8 1.8-2.4x its unfolded bf16 tiles' speed.
 * Threads (OpenMP) split N into ranges starting on multiples of 16 rows; each output is one thread's
 * sum in a fixed order, whatever the number of threads (built with -ffp-contract=off).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "moe_layer.h"

#define STEP 16   /* weight bytes decoded at a time */
/* `act` (PER_TOKEN and MX: per `act_group` columns) */
enum { AS_GIVEN = 0, PER_TOKEN = 1, PER_TENSOR = 2, STATIC = 3, MX = 4 };

typedef struct {
  outputs o; /* g: 256 on the fp32 tiles (decode's values are / 256), else 1; the scales applied per group */
  int64_t N, K, kp, xcols, srows, group_steps, groups, sld;
  const uint8_t *w;
  const void *ws;
  const float *lut;
  const float *xs; /* [M, xcols] fp32 activations, zero past K */
  const uint16_t *xb;   /* the bf16 tiles': [M, bcols] bf16 activations (FP8 codes where `act`), zero past K */
  const float *xscales; /* NULL, or [M, groups]: the codes' scale for each weight group of each row */
  int64_t bcols, bgroup_steps;
  int mx; /* the bf16 tiles fold e8m0 weight scales into the weights (`tile_bf16_mx`); xscales NULL or per row */
} problem;

/* fp32 -> e4m3 -> fp32 rounded to nearest even as torch's cast, for |v| <= 448 or NaN: below 2^-6 on the
 * subnormal grid (multiples of 2^-9), above by rounding the mantissa to 3 bits. */
INLINE float e4m3_value(float v) {
  if (fabsf(v) < 0.015625f) return nearbyintf(v * 512.0f) * 0.001953125f;
  uint32_t u;
  memcpy(&u, &v, 4);
  u = (u + 0x7FFFF + ((u >> 20) & 1)) & ~(uint32_t)0xFFFFF;
  memcpy(&v, &u, 4);
  return v;
}

/* max |v| over n elements of a row, NaN if any is NaN (as torch's amax). */
static float amax_of(const float *v, int64_t n) {
  float amax = 0.0f;
  for (int64_t k = 0; k < n; k++) {
    if (isnan(v[k])) return NAN;
    amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
  }
  return amax;
}

/* v / scale clamped to +-448 and rounded to e4m3: the FP8 code's value (NaN stays NaN). */
INLINE float fp8_code(float v, float scale) {
  const float q = v / scale;
  return e4m3_value(q > 448.0f ? 448.0f : q < -448.0f ? -448.0f : q);
}

/* Row v (n elements) through FP8 with `scale` and back, in place. */
static void fake_fp8(float *v, int64_t n, float scale) {
  for (int64_t k = 0; k < n; k++) v[k] = fp8_code(v[k], scale) * scale;
}

/* Row v's FP8 codes with `scale` as bf16 (exact: e4m3 values are bf16 values) into dst, or (`scaled`, for a
 * power-of-two scale) the codes times the scale; 0 if a code times the scale is not finite (where a sum of
 * those products can be NaN and one of the codes' is not), or (`scaled`) not a bf16 value dpbf16ps reads
 * as it is. */
static int fp8_codes_bf16(const float *v, int64_t n, float scale, int scaled, uint16_t *dst) {
  int ok = 1;
  for (int64_t k = 0; k < n; k++) {
    const float q = fp8_code(v[k], scale), value = scaled ? q * scale : q;
    uint32_t u;
    memcpy(&u, &value, 4);
    dst[k] = (uint16_t)(u >> 16);
    ok &= isfinite(q * scale) && (!scaled || (u & 0x7F800000) != 0 || (u & 0x7FFFFFFF) == 0);
  }
  return ok;
}

/* x's row [K] through FP8, per `act_group` columns with their scales (`scales`, one for the row if not
 * `per_group`): its codes into xb (bf16; `scaled`: times their power-of-two scales), returning 0 where
 * `fp8_codes_bf16` does, or (xb NULL) its values in place. */
static int row_through_fp8(float *row, int64_t K, int64_t act_group, const float *scales, int per_group,
                           int scaled, uint16_t *xb) {
  int ok = 1;
  for (int64_t c = 0; c < K; c += act_group) {
    const int64_t n = K - c < act_group ? K - c : act_group;
    const float scale = scales[per_group ? c / act_group : 0];
    if (xb)
      ok &= fp8_codes_bf16(row + c, n, scale, scaled, xb + c);
    else
      fake_fp8(row + c, n, scale);
  }
  return ok;
}

/* The scale of a dynamic FP8 activation key for |x| max `amax`: max(amax, eps) / 448, NaN for NaN. */
INLINE float dynamic_scale(float amax, float eps) { return isnan(amax) ? NAN : (amax > eps ? amax : eps) / 448.0f; }

/* MXFP8's block scale for |x| max `amax`, as formats.py takes it: 2^ceil(log2(amax / 448)), the exponent
 * clamped to [-127, 127] (-127 for a zero block); NaN for NaN. torch's fp32 log2 equals the double log2
 * rounded once to fp32 at every fp32 value within 2^13 ulps of a power of two and at 2^16 subnormals
 * (checked 2026-12-02): where ceil can go either way, this gives torch's exponent. */
INLINE float mx_scale(float amax) {
  if (isnan(amax)) return NAN;
  const float q = amax / 448.0f;
  float e = q > 0.0f ? ceilf((float)log2((double)q)) : -127.0f;
  e = e < -127.0f ? -127.0f : e > 127.0f ? 127.0f : e;
  return ldexpf(1.0f, (int)e);
}

/* Scale i of the grid. */
INLINE float scale_at(const problem *p, int64_t i) {
  return p->lut ? p->lut[((const uint8_t *)p->ws)[i]] : ((const float *)p->ws)[i];
}

/* 16 e4m3 bytes -> 16 fp32 values / 256 in two vectors. */
INLINE void decode(const uint8_t *w, __m256 *lo, __m256 *hi) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)), 7),
                                     _mm256_set1_epi16((short)0xBFFF));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* Weight rows r0 .. r0 + R - 1 times activation rows m0 .. m0 + MB - 1 -> res[m * R + r] (scaled, no bias). */
INLINE void tile(const problem *p, int64_t r0, int64_t m0, int R, int MB, float *res) {
  const int64_t steps = p->kp / STEP, full = steps * STEP;
  __m256 acc[4][MB_MAX];
  int64_t srow[4]; /* each row's first scale: one division per tile, not per group */
  const uint8_t *next = p->w + (r0 + R) * p->kp;
  for (int r = 0; r < R; r++) {
    srow[r] = (r0 + r) / p->srows * p->sld;
    for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < p->groups; g++) {
    const int64_t s0 = g * p->group_steps, s1 = s0 + p->group_steps < steps ? s0 + p->group_steps : steps;
    __m256 part[4][MB_MAX][2];
    for (int r = 0; r < R; r++)
      for (int m = 0; m < MB; m++) part[r][m][0] = part[r][m][1] = _mm256_setzero_ps();
    for (int64_t s = s0; s < s1; s++) {
      for (int r = 0; r < R; r++) {
        const uint8_t *w = p->w + (r0 + r) * p->kp + s * STEP;
        if (s % (64 / STEP) == 0) next = prefetch(next);
        __m256 lo, hi;
        decode(w, &lo, &hi);
        for (int m = 0; m < MB; m++) {
          const float *x = p->xs + (m0 + m) * p->xcols + s * STEP;
          part[r][m][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), part[r][m][0]);
          part[r][m][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), part[r][m][1]);
        }
      }
    }
    if (g == p->groups - 1 && full < p->kp) { /* the row's last kp % 16 bytes: a zero-filled copy */
      for (int r = 0; r < R; r++) {
        uint8_t tmp[STEP] = {0};
        memcpy(tmp, p->w + (r0 + r) * p->kp + full, (size_t)(p->kp - full));
        __m256 lo, hi;
        decode(tmp, &lo, &hi);
        for (int m = 0; m < MB; m++) { /* x's scratch rows run to a multiple of 16, zero past K */
          const float *x = p->xs + (m0 + m) * p->xcols + full;
          part[r][m][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), part[r][m][0]);
          part[r][m][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), part[r][m][1]);
        }
      }
    }
    for (int r = 0; r < R; r++) {
      const __m256 scale = _mm256_set1_ps(scale_at(p, srow[r] + g));
      for (int m = 0; m < MB; m++)
        acc[r][m] = _mm256_fmadd_ps(_mm256_add_ps(part[r][m][0], part[r][m][1]), scale, acc[r][m]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) res[m * R + r] = hsum(acc[r][m]);
}

/* One function per (R, MB): the tile's loops unrolled with its registers. */
#define TILE(R, MB) \
  static void tile_##R##_##MB(const void *p, int64_t r0, int64_t m0, float *res) { tile(p, r0, m0, R, MB, res); }
TILE(4, 1) TILE(2, 2) TILE(1, 3) TILE(1, 4) TILE(1, 1) TILE(1, 2)
static const mb_tile_fn WIDE[MB_MAX] = {tile_4_1, tile_2_2, tile_1_3, tile_1_4}, ONE[MB_MAX] = {tile_1_1, tile_1_2, tile_1_3, tile_1_4};
static const int WIDE_ROWS[MB_MAX] = {4, 2, 1, 1};

static void rows(const void *p, int64_t n0, int64_t n1) { tile_rows(p, WIDE, ONE, WIDE_ROWS, n0, n1); }

/* ---- AVX-512 BF16 tiles (where the compiler has AVX-512 BF16's intrinsics: GCC 10, clang 9 on) ---- */
#define BSTEP 32 /* weight bytes decoded at a time */
#if (defined(_AVX512BF16INTRIN_H_INCLUDED) || defined(__AVX512BF16INTRIN_H)) && !defined(QP_NO_BF16_TILES)
#define BF16_TILES __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The bf16 values of e4m3's subnormal codes by mantissa (0 .. 7, then unused), as `decode_bf16` looks them up. */
static const uint16_t SUBNORMAL_BF16[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

/* 32 e4m3 bytes -> 32 bf16 values. Sign-extended to 16 bits and shifted left by 4, a byte's exponent and
 * mantissa sit where bf16's low exponent bits and top mantissa bits are: the exponent rebiased (+120,
 * 7 -> 127), codes with exponent 0 (subnormals, zero) looked up by mantissa, the sign put back. */
INLINE BF16_TILES __m512i decode_bf16(const uint8_t *w, __m512i subnormals) {
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
  const __mmask32 sub = _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78));
  __m512i v = _mm512_and_si512(_mm512_slli_epi16(b, 4), _mm512_set1_epi16(0x07F0));
  v = _mm512_mask_permutexvar_epi16(_mm512_add_epi16(v, _mm512_set1_epi16(120 << 7)), sub, b, subnormals);
  return _mm512_ternarylogic_epi32(v, b, _mm512_set1_epi16((short)0x8000), 0xF8); /* v | (b & sign) */
}

/* One step of a bf16 tile: 32 decoded weights (columns col ..) times MB activation rows from m0. */
INLINE BF16_TILES void step_bf16(const problem *p, __m512i w, int64_t col, int64_t m0, int MB, __m512 *part) {
  for (int m = 0; m < MB; m++) {
    const __m512i x = _mm512_loadu_si512((const void *)(p->xb + (m0 + m) * p->bcols + col));
    part[m] = _mm512_dpbf16_ps(part[m], (__m512bh)w, (__m512bh)x);
  }
}

/* `tile` on the bf16 tiles (activations p->xb). */
INLINE BF16_TILES void tile_bf16(const problem *p, int64_t r0, int64_t m0, int R, int MB, float *res) {
  const int64_t steps = p->kp / BSTEP, full = steps * BSTEP;
  const __m512i subnormals = _mm512_loadu_si512((const void *)SUBNORMAL_BF16);
  __m512 acc[4][MB_MAX];
  int64_t srow[4];
  const uint8_t *next = p->w + (r0 + R) * p->kp;
  for (int r = 0; r < R; r++) {
    srow[r] = (r0 + r) / p->srows * p->sld;
    for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < p->groups; g++) {
    const int64_t s0 = g * p->bgroup_steps, s1 = s0 + p->bgroup_steps < steps ? s0 + p->bgroup_steps : steps;
    __m512 part[4][MB_MAX];
    for (int r = 0; r < R; r++)
      for (int m = 0; m < MB; m++) part[r][m] = _mm512_setzero_ps();
    for (int64_t s = s0; s < s1; s++)
      for (int r = 0; r < R; r++) {
        if (s % (64 / BSTEP) == 0) next = prefetch(next);
        step_bf16(p, decode_bf16(p->w + (r0 + r) * p->kp + s * BSTEP, subnormals), s * BSTEP, m0, MB, part[r]);
      }
    if (g == p->groups - 1 && full < p->kp) /* the row's last kp % 32 bytes: a zero-filled copy */
      for (int r = 0; r < R; r++) {
        uint8_t tmp[BSTEP] = {0};
        memcpy(tmp, p->w + (r0 + r) * p->kp + full, (size_t)(p->kp - full));
        step_bf16(p, decode_bf16(tmp, subnormals), full, m0, MB, part[r]);
      }
    for (int r = 0; r < R; r++) {
      const float scale = scale_at(p, srow[r] + g);
      for (int m = 0; m < MB; m++) {
        const float xscale = p->xscales ? p->xscales[(m0 + m) * p->groups + g] : 1.0f;
        acc[r][m] = _mm512_fmadd_ps(part[r][m], _mm512_set1_ps(scale * xscale), acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) res[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* MXFP8 on the bf16 tiles: each weight's e8m0 scale 2^(e - 127) folded into its bf16 exponent as it decodes
 * (exact: an e4m3 value times 2^(e - 127) is a normal bf16 value for e in 10 .. 246), so each row is one
 * sum, with no scaling per 32 weights; the activations come folded too (`fp8_codes_bf16`'s `scaled`), or
 * with one scale per row. A tile with a scale byte outside 10 .. 246, or more than MX_GROUPS groups per
 * row, runs `tile_bf16`. Measured on Zen 4 (bench/README.md, "MXFP8 with its scales folded"). */
#define MX_GROUPS 1024
/* SUBNORMAL_BF16 less the exponent bias decode_bf16 adds (120 << 7): `decode_bf16_mx` adds it with the scale */
static const uint16_t SUBNORMAL_MX[32] = {0, 0x3B00 - 0x3C00, 0x3B80 - 0x3C00, 0x3BC0 - 0x3C00,
                                          0x3C00 - 0x3C00, 0x3C20 - 0x3C00, 0x3C40 - 0x3C00, 0x3C60 - 0x3C00};

/* The tile's rows' e8m0 bytes -> off[r][g] = (e - 7) << 7: 120 << 7 (e4m3's exponent rebiased to bf16's)
 * plus (e - 127) << 7 (the scale). 0 if a byte is outside 10 .. 246. */
INLINE BF16_TILES int mx_offsets(const problem *p, int64_t r0, int R, int16_t (*off)[MX_GROUPS]) {
  __mmask32 bad = 0;
  for (int r = 0; r < R; r++) {
    const uint8_t *e = (const uint8_t *)p->ws + (r0 + r) / p->srows * p->sld;
    for (int64_t g = 0; g < p->groups; g += 32) {
      const __mmask32 in = p->groups - g >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (p->groups - g)) - 1;
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(in, e + g));
      bad |= _mm512_mask_cmpgt_epu16_mask(in, _mm512_sub_epi16(v, _mm512_set1_epi16(10)), _mm512_set1_epi16(236));
      _mm512_mask_storeu_epi16(off[r] + g, in, _mm512_slli_epi16(_mm512_sub_epi16(v, _mm512_set1_epi16(7)), 7));
    }
  }
  return bad == 0;
}

/* decode_bf16 with the exponent offset `off` (mx_offsets') in place of 120 << 7; zero codes stay zero. */
INLINE BF16_TILES __m512i decode_bf16_mx(const uint8_t *w, __m512i subnormals, __m512i off) {
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
  const __mmask32 sub = _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78));
  const __mmask32 nonzero = _mm512_test_epi16_mask(b, _mm512_set1_epi16(0x7F));
  __m512i v = _mm512_and_si512(_mm512_slli_epi16(b, 4), _mm512_set1_epi16(0x07F0));
  v = _mm512_maskz_add_epi16(nonzero, _mm512_mask_permutexvar_epi16(v, sub, b, subnormals), off);
  return _mm512_ternarylogic_epi32(v, b, _mm512_set1_epi16((short)0x8000), 0xF8); /* v | (b & sign) */
}

INLINE BF16_TILES void tile_bf16_mx(const problem *p, int64_t r0, int64_t m0, int R, int MB, float *res) {
  int16_t off[4][MX_GROUPS] __attribute__((aligned(64)));
  if (p->groups > MX_GROUPS || !mx_offsets(p, r0, R, off)) {
    tile_bf16(p, r0, m0, R, MB, res);
    return;
  }
  const int64_t steps = p->kp / BSTEP, full = steps * BSTEP;
  const __m512i subnormals = _mm512_loadu_si512((const void *)SUBNORMAL_MX);
  __m512 acc[4][MB_MAX];
  const uint8_t *next = p->w + (r0 + R) * p->kp;
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; s++)
    for (int r = 0; r < R; r++) {
      if (s % (64 / BSTEP) == 0) next = prefetch(next);
      const __m512i o = _mm512_set1_epi16(off[r][s / p->bgroup_steps]);
      step_bf16(p, decode_bf16_mx(p->w + (r0 + r) * p->kp + s * BSTEP, subnormals, o), s * BSTEP, m0, MB, acc[r]);
    }
  if (full < p->kp) /* the row's last kp % 32 bytes: a zero-filled copy */
    for (int r = 0; r < R; r++) {
      uint8_t tmp[BSTEP] = {0};
      memcpy(tmp, p->w + (r0 + r) * p->kp + full, (size_t)(p->kp - full));
      const __m512i o = _mm512_set1_epi16(off[r][p->groups - 1]);
      step_bf16(p, decode_bf16_mx(tmp, subnormals, o), full, m0, MB, acc[r]);
    }
  for (int m = 0; m < MB; m++) {
    const float xscale = p->xscales ? p->xscales[(m0 + m) * p->groups] : 1.0f;
    for (int r = 0; r < R; r++) res[m * R + r] = _mm512_reduce_add_ps(acc[r][m]) * xscale;
  }
}

#define TILE_BF16(R, MB)                                                                  \
  static BF16_TILES void tile_bf16_##R##_##MB(const void *p, int64_t r0, int64_t m0, float *res) { \
    if (((const problem *)p)->mx)                                                         \
      tile_bf16_mx(p, r0, m0, R, MB, res);                                                \
    else                                                                                  \
      tile_bf16(p, r0, m0, R, MB, res);                                                   \
  }
TILE_BF16(4, 1) TILE_BF16(2, 2) TILE_BF16(1, 3) TILE_BF16(1, 4) TILE_BF16(1, 1) TILE_BF16(1, 2)
static const mb_tile_fn WIDE_BF16[MB_MAX] = {tile_bf16_4_1, tile_bf16_2_2, tile_bf16_1_3, tile_bf16_1_4},
                        ONE_BF16[MB_MAX] = {tile_bf16_1_1, tile_bf16_1_2, tile_bf16_1_3, tile_bf16_1_4};

static void rows_bf16(const void *p, int64_t n0, int64_t n1) { tile_rows(p, WIDE_BF16, ONE_BF16, WIDE_ROWS, n0, n1); }
#define CAN_BF16                                                                                      \
  (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && \
   __builtin_cpu_supports("avx512bf16"))
#else /* the fp32 tiles only */
#define rows_bf16 rows
#define CAN_BF16 0
#endif

/* Which tiles run where a call allows: 0 the fp32 (AVX2) ones, 1 the bf16 ones (`choose_tiles`; only on a
 * CPU with AVX-512 F, BW, VL and BF16, built by a compiler that has them). */
static int use_bf16 = -1;
int qp_fp8_tiles(int want) { return choose_tiles(&use_bf16, want, CAN_BF16); }

/* x's fp32 rows [M, xcols] -> bf16 rows [M, bcols] (zero past xcols); 1 if every value was a bf16 value
 * that dpbf16ps reads as it is (zero, normal, infinite or NaN: not subnormal), else 0. */
static int bf16_rows(const float *xs, int64_t M, int64_t xcols, uint16_t *xb, int64_t bcols) {
  uint32_t inexact = 0;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t k = 0; k < xcols; k++) {
      uint32_t u;
      memcpy(&u, xs + m * xcols + k, 4);
      inexact |= (u & 0xFFFF) | ((u & 0x7F800000) == 0 && (u & 0x7FFFFFFF) != 0);
      xb[m * bcols + k] = (uint16_t)(u >> 16);
    }
    for (int64_t k = xcols; k < bcols; k++) xb[m * bcols + k] = 0;
  }
  return inexact == 0;
}

/* x [M, K] (row stride ldx elements, `xtype`) @ dequant(w).T -> out [M, N] (row stride ldo, `otype`), + bias
 * [N] (`btype`; NULL: none). w [N, kp] e4m3, K <= kp; scales as the header says: ws[(n / srows) * sld + g]
 * for column group g of `group` columns (0: one group per row), fp32 or bytes through `lut`. `act`: x as
 * given or through FP8 (PER_TOKEN per `act_group` columns, 0: the row; PER_TENSOR; both with `eps`,
 * quantpass's AMAX_EPS; STATIC with `act_scale`; MX: MXFP8's power-of-two scale per `act_group`).
 * Returns 0; -1 if the scratch could not be allocated; -2 for a group that is not a multiple of 16. */
int qp_linear_fp8(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                  int64_t kp, const void *ws, const float *lut, int64_t srows, int64_t sld, int64_t group,
                  int act, int64_t act_group, float act_scale, float eps, const void *bias, int btype, void *out,
                  int64_t ldo, int otype, int threads) {
  if (group % STEP || group < 0 || srows < 1 || act_group < 0) return -2;
  if (act_group == 0) act_group = K > 0 ? K : 1;
  const int64_t steps = kp / STEP, xcols = (kp + STEP - 1) / STEP * STEP;
  problem p = {.o = {.M = M, .ldo = ldo, .otype = otype, .btype = btype, .g = 1.0f, .bias = bias, .out = out},
               .N = N, .K = K, .kp = kp, .xcols = xcols, .srows = srows,
               .group_steps = group ? group / STEP : steps + 1, .sld = sld, .w = w, .ws = ws, .lut = lut};
  p.groups = group ? (kp + group - 1) / group : 1;
  /* the bf16 tiles scale each weight group's sum by its activation scale: each group inside one */
  const int64_t xgroups = act == PER_TOKEN || act == MX ? (K + act_group - 1) / act_group : 1;
  const int bf16 = qp_fp8_tiles(-1) && group % BSTEP == 0 && (xgroups == 1 || (group && act_group % group == 0));
  p.bcols = (kp + BSTEP - 1) / BSTEP * BSTEP;
  p.bgroup_steps = group ? group / BSTEP : kp / BSTEP + 1;
  const size_t rows_bytes = (size_t)(M * xcols) * 4, codes_bytes = bf16 ? (size_t)(M * p.bcols) * 2 : 0;
  int fresh;
  float *buf = (float *)scratch(rows_bytes + codes_bytes + (size_t)(M * (xgroups + p.groups)) * 4, &fresh);
  if (buf == NULL) return -1;
  uint16_t *xb = (uint16_t *)((uint8_t *)buf + rows_bytes);
  float *scales = (float *)((uint8_t *)xb + codes_bytes), *xscales = scales + M * xgroups; /* [M, xgroups] */
  float amax = 0.0f; /* PER_TENSOR: over every row, NaN if any is */
  for (int64_t m = 0; m < M; m++) {
    const uint8_t *row = (const uint8_t *)x + m * ldx * (xtype == F32 ? 4 : 2);
    float *dst = buf + m * xcols;
    row_f32(row, xtype, K, dst, xcols);
    for (int64_t c = 0; (act == PER_TOKEN || act == MX) && c < K; c += act_group) {
      const float a = amax_of(dst + c, K - c < act_group ? K - c : act_group);
      scales[m * xgroups + c / act_group] = act == MX ? mx_scale(a) : dynamic_scale(a, eps);
    }
    if (act == STATIC) scales[m] = act_scale;
    if (act == PER_TENSOR) {
      const float a = amax_of(dst, K);
      amax = isnan(a) || isnan(amax) ? NAN : a > amax ? a : amax;
    }
  }
  for (int64_t m = 0; act == PER_TENSOR && m < M; m++) scales[m] = dynamic_scale(amax, eps);
  /* the rows through FP8: codes and their scales for the bf16 tiles, or values for the fp32 ones */
  int on_bf16 = bf16;
  for (int64_t m = 0; act != AS_GIVEN && bf16 && m < M; m++) {
    on_bf16 &= row_through_fp8(buf + m * xcols, K, act_group, scales + m * xgroups, xgroups > 1, act == MX,
                               xb + m * p.bcols);
    for (int64_t k = K; k < p.bcols; k++) xb[m * p.bcols + k] = 0;
    for (int64_t g = 0; g < p.groups; g++) {
      const int64_t gx = group ? g * group / act_group : 0;
      xscales[m * p.groups + g] = scales[m * xgroups + (gx < xgroups ? gx : xgroups - 1)];
    }
  }
  for (int64_t m = 0; act != AS_GIVEN && !on_bf16 && m < M; m++)
    row_through_fp8(buf + m * xcols, K, act_group, scales + m * xgroups, xgroups > 1, 0, NULL);
  p.xs = buf;
  p.xb = xb;
  /* MXFP8's activation scales are in xb (powers of two, folded) on the bf16 tiles */
  p.xscales = act != AS_GIVEN && !(on_bf16 && act == MX) ? xscales : NULL;
  p.mx = lut != NULL && (p.xscales == NULL || xgroups == 1);
  if (act == AS_GIVEN && bf16) on_bf16 = bf16_rows(buf, M, xcols, xb, p.bcols);
  /* the fp32 tiles' decoded values are / 256: times 256 with the outputs (with each group's scale, a scale
   * of 2^120 or more overflowed, and turned zero sums into NaN) */
  p.o.g = on_bf16 ? 1.0f : 256.0f;
  parallel_rows(on_bf16 ? rows_bf16 : rows, &p, N, kp, threads);
  if (fresh) free(buf);
  return 0;
}

/* ---- a MoE layer (moe_layer.h) on this kernel ---- */

typedef struct { /* E experts' weights [E, N, kp] e4m3 and their scales, as qp_linear_fp8 reads each */
  const uint8_t *w, *ws;
  const float *lut;
  int64_t kp, srows, sld, group;
  int xq;                   /* qp_linear_fp8's `act` for the expert's input rows */
  int64_t xq_group;         /* its `act_group` */
  const float *xq_scales;   /* STATIC: each expert's calibrated input scale */
  float eps;
  float *tensor_scale;      /* PER_TENSOR: the scale over every routed row of the stage (`fp8_rows`) */
} fp8_experts;

/* PER_TENSOR: one dynamic scale over all of a stage's rows, as the reference's loop takes it; each expert
 * GEMM then quantizes its rows with it (STATIC). */
static void fp8_rows(const void *weights, const float *x, int64_t R, int64_t K) {
  const fp8_experts *q = weights;
  if (q->xq == PER_TENSOR) *q->tensor_scale = dynamic_scale(amax_of(x, R * K), q->eps);
}

static int fp8_expert(const void *weights, int64_t e, float *x, int64_t m, int64_t K, float *out, int64_t N,
                      int threads) {
  const fp8_experts *q = weights;
  const int64_t scale_bytes = (N + q->srows - 1) / q->srows * q->sld * (q->lut ? 1 : 4);
  const int act = q->xq == PER_TENSOR ? STATIC : q->xq;
  const float scale = q->xq == PER_TENSOR ? *q->tensor_scale : q->xq_scales ? q->xq_scales[e] : 0.0f;
  return qp_linear_fp8(x, K, F32, m, K, q->w + e * N * q->kp, N, q->kp, q->ws + e * scale_bytes, q->lut, q->srows,
                       q->sld, q->group, act, q->xq_group, scale, q->eps, NULL, 0, out, N, F32, threads);
}

/* moe_layer on FP8 experts: w13 [E, 2I, kp13] and w2 [E, H, kp2] e4m3, each expert's scales as
 * qp_linear_fp8 takes them (srows, sld; `group` and `lut` for both), contiguous. Each GEMM's input rows as
 * given (xq AS_GIVEN) or through FP8 as the reference's loop quantizes them over all routed rows: per
 * token or per `xq_group` columns (PER_TOKEN, MX: row by row, so the same whichever rows share a GEMM),
 * PER_TENSOR (one scale over all the stage's rows, `fp8_rows`), or STATIC with each expert's scale (xq13
 * for w13's GEMMs, xq2 for w2's, [E]); `eps` quantpass's AMAX_EPS. */
int qp_moe_fp8(MOE_PARAMS, const uint8_t *w13, const void *s13, int64_t kp13, int64_t srows13, int64_t sld13,
               const uint8_t *w2, const void *s2, int64_t kp2, int64_t srows2, int64_t sld2, int64_t group,
               const float *lut, int xq, int64_t xq_group, const float *xq13, const float *xq2, float eps) {
  if (xq == STATIC && (xq13 == NULL || xq2 == NULL)) return -2;
  float scale13 = 0.0f, scale2 = 0.0f;
  const fp8_experts a = {w13, s13, lut, kp13, srows13, sld13, group, xq, xq_group, xq13, eps, &scale13};
  const fp8_experts b = {w2, s2, lut, kp2, srows2, sld2, group, xq, xq_group, xq2, eps, &scale2};
  return moe_layer(MOE_ARGS, fp8_expert, fp8_rows, &a, &b);
}
