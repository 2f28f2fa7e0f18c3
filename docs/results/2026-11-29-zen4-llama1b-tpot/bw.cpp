#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
int main() {
  const size_t n = size_t(1) << 30;  // 1 GB
  char* buf = (char*)aligned_alloc(4096, n);
  memset(buf, 1, n);
  for (int rep = 0; rep < 6; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    __m512i total = _mm512_setzero_si512();
#pragma omp parallel num_threads(2)
    {
      int t = omp_get_thread_num();
      const char* p = buf + t * (n / 2);
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t o = 0; o < n / 2; o += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + o));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + o + 64));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + o + 128));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + o + 192));
      }
#pragma omp critical
      total = _mm512_xor_si512(total, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%.1f GB/s (%d)\n", n / s / 1e9, _mm512_reduce_add_epi32(total) & 1);
  }
}
