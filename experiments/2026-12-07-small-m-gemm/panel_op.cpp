
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#ifndef ROWS
#define ROWS 4
#endif

template <int M>
static inline void panel(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) { acc[m][0] = _mm256_setzero_ps(); acc[m][1] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
    for (int m = 0; m < M; ++m) {
      __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) { _mm256_storeu_ps(y + m * ldy, acc[m][0]); _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]); }
}

static void rows(int64_t m, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  switch (m) {
    case 1: panel<1>(x, ldx, w, K, y, ldy); break;
    case 2: panel<2>(x, ldx, w, K, y, ldy); break;
    case 3: panel<3>(x, ldx, w, K, y, ldy); break;
    case 4: panel<4>(x, ldx, w, K, y, ldy); break;
    case 5: panel<5>(x, ldx, w, K, y, ldy); break;
    default: panel<6>(x, ldx, w, K, y, ldy); break;
  }
}

static torch::Tensor pack(const torch::Tensor& w) {  // [N, K] -> [N/16, K, 16]
  auto N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "out features must be a multiple of 16");
  return w.view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

static torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& wp) {
  auto K = input.size(-1), P = wp.size(0);
  auto x = input.reshape({-1, K}).contiguous();
  auto M = x.size(0);
  auto sizes = input.sizes().vec();
  sizes.back() = P * 16;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>(); const float* w = wp.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += ROWS)
        rows(std::min<int64_t>(ROWS, M - m0), xp + m0 * K, K, w + p * K * 16, K, yp + m0 * P * 16 + p * 16, P * 16);
  });
  return y;
}

TORCH_LIBRARY(medusa_kernels, m) {
  m.def("panel_pack(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(medusa_kernels, CPU, m) {
  m.impl("panel_pack", &pack);
  m.impl("panel_linear", &linear);
}
