/* What quantpass's CPU kernels (linear_avx2.c, linear_fp4.c, linear_fp8.c) share: element types and their
 * conversions, the next tile's prefetch, the per-thread activation scratch, and how N is split across threads. */
#ifndef QUANTPASS_CPU_COMMON_H
#define QUANTPASS_CPU_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 }; /* element types of x, bias and out */
#define INLINE static inline __attribute__((always_inline))

/* A tile of R weight rows (contiguous) prefetches the next tile as it reads its own: one 64-byte line per
 * line it reads, `next = prefetch(next)` from the next tile's first byte, in address order (one stream
 * for the memory to serve, not R), into L2. Measured on Zen 4 against the next tile's rows in the order
 * the tile reads its own, into L1 (bench/README.md, "Prefetching the next tile in address order"; not
 * measured on an Intel CPU): INT8 14.9 -> 23.1 GB/s, INT4 15.2 -> 19.1 GB/s at 1 thread, FP8 1.04-1.16x,
 * FP4 0.98-1.14x. A prefetch past the end of the weights is harmless (it never faults). */
INLINE const uint8_t *prefetch(const uint8_t *p) {
  _mm_prefetch((const char *)p, _MM_HINT_T1);
  return p + 64;
}

INLINE float to_f32(const void *p, int type, int64_t i) {
  if (type == F32) return ((const float *)p)[i];
  if (type == F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
  const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

INLINE __m256 load8_f32(const void *p, int type, int64_t i) {
  if (type == F32) return _mm256_loadu_ps((const float *)p + i);
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
  if (type == F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* x row [K] of `type` -> dst [kpad] fp32, zero past K. */
static inline void row_f32(const void *x, int type, int64_t K, float *dst, int64_t kpad) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8_f32(x, type, k));
  for (; k < K; k++) dst[k] = to_f32(x, type, k);
  for (; k < kpad; k++) dst[k] = 0.0f;
}

INLINE float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

INLINE void store(void *out, int type, int64_t i, float f) {
  if (type == F32) {
    ((float *)out)[i] = f;
  } else if (type == F16) {
    ((uint16_t *)out)[i] = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
  } else { /* bf16, rounded to nearest even; a NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u & 0x7FFFFFFF) > 0x7F800000 ? (u | 0x00400000) : u + 0x7FFF + ((u >> 16) & 1);
    ((uint16_t *)out)[i] = (uint16_t)(u >> 16);
  }
}

/* Scratch: a per-thread buffer in `*slot` kept between calls (decode sizes), or a fresh allocation for
 * larger ones (then *fresh is set: the caller frees it). NULL if allocation failed. `scratch` is the
 * kernels' (their rearranged activations); a caller that holds its own scratch across kernel calls
 * keeps it in another slot. */
#define KEEP_BYTES (1 << 20)
static __thread uint8_t *kept;

static uint8_t *scratch_in(uint8_t **slot, size_t bytes, int *fresh) {
  *fresh = bytes > KEEP_BYTES;
  if (*fresh) return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
  if (*slot == NULL) *slot = aligned_alloc(64, KEEP_BYTES);
  return *slot;
}

static uint8_t *scratch(size_t bytes, int *fresh) { return scratch_in(&kept, bytes, fresh); }

/* A kernel's switch between its AVX2 tiles (0) and its AVX-512 ones (1, only where the CPU `can` run them):
 * `*chosen` starts at -1 (then: the AVX-512 ones where it can); want 0 or 1 chooses, -1 just asks.
 * Returns the tiles in use after the call. */
static inline int choose_tiles(int *chosen, int want, int can) {
  if (*chosen < 0) *chosen = can;
  if (want == 0 || want == 1) *chosen = want && can;
  return *chosen;
}

/* Tiled kernels (linear_fp4.c, linear_fp8.c): a tile multiplies weight rows r0 .. r0 + R - 1 by activation rows
 * m0 .. m0 + MB - 1 (MB <= MB_MAX) into res[m * R + r]; `tile_rows` runs them over a range of weight rows and
 * writes each result r as out[m * ldo + n] = r * g + bias[n] (`outputs`, the first member of the kernel's
 * problem: `p` is both). */
#define MB_MAX 4
typedef void (*mb_tile_fn)(const void *p, int64_t r0, int64_t m0, float *res);
typedef struct {
  int64_t M, ldo;
  int otype, btype;
  float g;
  const void *bias;
  void *out;
} outputs;

/* Weight rows n0 .. n1 - 1, 8 at a time (in cache while M repeats them), activation rows MB_MAX at a time: per
 * mb activation rows, `wide[mb - 1]` tiles of `wide_rows[mb - 1]` weight rows, `one[mb - 1]` (1 row) for the rest. */
static inline void tile_rows(const void *p, const mb_tile_fn *wide, const mb_tile_fn *one, const int *wide_rows,
                             int64_t n0, int64_t n1) {
  const outputs *o = p;
  float res[4 * MB_MAX];
  for (int64_t nb = n0; nb < n1; nb += 8) {
    const int64_t ne = nb + 8 < n1 ? nb + 8 : n1;
    for (int64_t m = 0; m < o->M; m += MB_MAX) {
      const int mb = o->M - m < MB_MAX ? (int)(o->M - m) : MB_MAX, step = wide_rows[mb - 1];
      for (int64_t n = nb; n < ne;) {
        const int r = n + step <= ne ? step : 1;
        (r == step ? wide : one)[mb - 1](p, n, m, res);
        for (int i = 0; i < mb; i++)
          for (int j = 0; j < r; j++) {
            const float b = o->bias ? to_f32(o->bias, o->btype, n + j) : 0.0f;
            store(o->out, o->otype, (m + i) * o->ldo + n + j, res[i * r + j] * o->g + b);
          }
        n += r;
      }
    }
  }
}

/* `rows(p, n0, n1)` over N weight rows of kp weights each, on up to `threads` OpenMP threads (the libgomp
 * torch loaded): contiguous ranges that start on multiples of 16 rows, so no two threads write one 64-byte
 * line of fp32 output and each streams its own part of the weights; one thread below 2^18 weights each
 * (waking another costs more). */
#define ROW_ALIGN 16
#define MIN_WEIGHTS_PER_THREAD (1 << 18)

static void parallel_rows(void (*rows)(const void *, int64_t, int64_t), const void *p, int64_t N, int64_t kp,
                          int threads) {
  const int64_t units = (N + ROW_ALIGN - 1) / ROW_ALIGN, rows_per_thread = MIN_WEIGHTS_PER_THREAD / kp + 1;
  const int64_t most = N / rows_per_thread < units ? N / rows_per_thread : units;
  if (threads > most) threads = most > 1 ? (int)most : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int64_t n0 = units * t / nt * ROW_ALIGN, n1 = units * (t + 1) / nt * ROW_ALIGN;
    rows(p, n0, n1 < N ? n1 : N);
  }
}

#endif
