/* Memory read bandwidth probe for bench/cpu_decode.py: sums `bytes` bytes (a multiple of 256) as 64-bit
 * integers with AVX2, 8 independent accumulators, split across `threads` OpenMP threads in contiguous
 * ranges (as the kernels split N). Returns the sum so the compiler keeps the loads. */
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

uint64_t qp_read(const uint8_t *p, int64_t bytes, int threads) {
  const int64_t lines = bytes / 256;
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total) if (threads > 1)
  {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    __m256i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
    for (int64_t l = lines * t / nt; l < lines * (t + 1) / nt; l++)
      for (int i = 0; i < 8; i++)
        acc[i] = _mm256_add_epi64(acc[i], _mm256_loadu_si256((const __m256i *)(p + l * 256 + 32 * i)));
    for (int i = 1; i < 8; i++) acc[0] = _mm256_add_epi64(acc[0], acc[i]);
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc[0]);
    total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
  return total;
}
