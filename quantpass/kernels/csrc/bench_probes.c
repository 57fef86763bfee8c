/* bench/cpu_decode.py's probes: the memory read bandwidth (qp_read) and the INT8/INT4 kernel over several
 * layers in one call (qp_linear_layers).
 *
 * qp_read: sums `bytes` bytes as 64-bit integers with AVX2, split across `threads` OpenMP threads in
 * contiguous ranges (as the kernels split N), each range read as `streams` (1..16) interleaved sequential
 * streams (more streams, more misses in flight: the kernels read 4 to 16 weight rows at once). Returns
 * the sum so the compiler keeps the loads. */
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

uint64_t qp_read(const uint8_t *p, int64_t bytes, int threads, int streams) {
  uint64_t total = 0;
  if (streams < 1 || streams > 16) return 0;
#pragma omp parallel num_threads(threads) reduction(+ : total) if (threads > 1)
  {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int64_t lines = bytes / 64, first = lines * t / nt, part = (lines * (t + 1) / nt - first) / streams;
    __m256i acc[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm256_setzero_si256();
    for (int64_t l = 0; l < part; l++)
      for (int s = 0; s < streams; s++) {
        const __m256i *q = (const __m256i *)(p + (first + s * part + l) * 64);
        acc[s] = _mm256_add_epi64(acc[s], _mm256_add_epi64(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)));
      }
    for (int s = 1; s < 16; s++) acc[0] = _mm256_add_epi64(acc[0], acc[s]);
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc[0]);
    total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
  return total;
}

/* linear_avx2.c's qp_linear (its signature; the caller passes the function). */
typedef int (*linear_fn)(const void *x, int64_t ldx, int xtype, int64_t M, int64_t K, const uint8_t *w,
                         const float *s, int64_t N, int64_t kp, int bits, const void *bias, int btype, void *out,
                         int64_t ldo, int otype, int mode, int threads);

/* `linear` over `layers` weights w[i], s[i] into out[i], one after another with the same x and no bias:
 * the kernel's own time over a rotation of layers, without the Python call each layer would cost.
 * Returns the first nonzero status (and stops there), else 0. */
int qp_linear_layers(linear_fn linear, int layers, const void *x, int64_t ldx, int xtype, int64_t M, int64_t K,
                     const uint8_t *const *w, const float *const *s, int64_t N, int64_t kp, int bits,
                     void *const *out, int64_t ldo, int otype, int mode, int threads) {
  for (int i = 0; i < layers; i++) {
    const int status = linear(x, ldx, xtype, M, K, w[i], s[i], N, kp, bits, NULL, 0, out[i], ldo, otype, mode, threads);
    if (status) return status;
  }
  return 0;
}
