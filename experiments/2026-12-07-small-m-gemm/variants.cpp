// Small-row fp32 GEMM variants for AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T, W packed in panels of C output
// columns ([N/C, K, C]); R rows of x per pass over a panel (R * C/8 accumulators), optional software prefetch PF
// bytes ahead in the panel.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

template <int C, int R, int PF>
static inline void panel(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int rows) {
  constexpr int V = C / 8;
  __m256 acc[R][V];
  for (int m = 0; m < R; ++m) for (int v = 0; v < V; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (PF) _mm_prefetch((const char*)(w + k * C) + PF, _MM_HINT_T0);
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(w + k * C + v * 8);
    for (int m = 0; m < R; ++m) {
      if (m < rows) {
        __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        for (int v = 0; v < V; ++v) acc[m][v] = _mm256_fmadd_ps(xb, wv[v], acc[m][v]);
      }
    }
  }
  for (int m = 0; m < rows; ++m) for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + m * ldy + v * 8, acc[m][v]);
}

template <int C, int R, int PF>
static void gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t P, float* y) {
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        int rows = (int)std::min<int64_t>(R, M - m0);
        switch (rows) {  // the row count as a constant, so that the row loop unrolls
#define ROWS_CASE(r) case r: if (r <= R) panel<C, (r <= R ? r : R), PF>(x + m0 * K, K, w + p * K * C, K, y + m0 * P * C + p * C, P * C, r); break;
          ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        }
      }
  });
}

torch::Tensor pack(torch::Tensor w, int64_t C) {
  auto N = w.size(0), K = w.size(1);
  return w.view({N / C, C, K}).transpose(1, 2).contiguous();
}

torch::Tensor linear(torch::Tensor x, torch::Tensor wp, int64_t variant) {
  auto M = x.size(0), K = x.size(1), P = wp.size(0), C = wp.size(2);
  x = x.contiguous();
  auto y = torch::empty({M, P * C}, x.options());
  const float* xp = x.data_ptr<float>(); const float* w = wp.data_ptr<float>(); float* yp = y.data_ptr<float>();
  switch (variant) {
    case 0: gemm<16, 6, 2048>(xp, M, K, w, P, yp); break;
    case 1: gemm<16, 6, 4096>(xp, M, K, w, P, yp); break;
    case 2: gemm<8, 8, 2048>(xp, M, K, w, P, yp); break;
    case 3: gemm<8, 8, 512>(xp, M, K, w, P, yp); break;
    case 4: gemm<16, 6, 0>(xp, M, K, w, P, yp); break;
    case 5: gemm<8, 8, 4096>(xp, M, K, w, P, yp); break;
  }
  return y;
}
