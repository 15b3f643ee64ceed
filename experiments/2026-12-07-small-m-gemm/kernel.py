"""A small-row fp32 GEMM for AVX2 + FMA, y = x @ W^T with W packed in panels of 16 output columns ([N/16, K, 16]):
per panel and k one load of 16 weights, one broadcast per row, two FMAs per row; up to ROWS (<= 6) rows in
registers (12 accumulators, spilling none of AVX2's 16 registers), more rows in blocks of ROWS over the same panel
(then in L2). Every weight is read from memory once a
call whatever the rows, and the FMAs run at the core's rate: is that what a pass of 8 nodes needs?"""
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#ifndef ROWS
#define ROWS 6
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
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(y + m * ldy, acc[m][0]);
    _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
  }
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

torch::Tensor pack(torch::Tensor w) {  // [N, K] -> [N/16, K, 16]
  auto N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "out features must be a multiple of 16");
  return w.view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

torch::Tensor linear(torch::Tensor x, torch::Tensor wp) {
  auto M = x.size(0), K = x.size(1), P = wp.size(0);
  x = x.contiguous();
  auto y = torch::empty({M, P * 16}, x.options());
  const float* xp = x.data_ptr<float>(); const float* w = wp.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += ROWS)
        rows(std::min<int64_t>(ROWS, M - m0), xp + m0 * K, K, w + p * K * 16, K, yp + m0 * P * 16 + p * 16, P * 16);
  });
  return y;
}
"""
ROWS = int(os.environ.get("ROWS", 6))
ext = load_inline(f"small_m_gemm{ROWS}", cpp_sources=SRC, functions=["pack", "linear"],
                  extra_cflags=[f"-DROWS={ROWS}", "-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                  verbose=False)

torch.manual_seed(0)
H, FF, KV, L, V = 576, 1536, 192, 30, 49152
shapes = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF)]
weights = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(L)]
lm_head = torch.randn(V, H) * 0.02
packs = [[ext.pack(w) for w in ws] for ws in weights]
head = ext.pack(lm_head)

x = torch.randn(5, 576)
print("max |diff| vs F.linear:", (ext.linear(x, head) - F.linear(x, lm_head)).abs().max().item())


def chain(x):
    lin = ext.linear
    for q, k, v, o, g, u, d in packs:
        a = lin(x, q) + lin(x, k).repeat(1, 3) + lin(x, v).repeat(1, 3)
        x = x + lin(a, o)
        x = x + lin(F.silu(lin(x, g)) * lin(x, u), d)
    return lin(x, head)


def best(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


for m in [1, 2, 4, 8, 12, 16]:
    x = torch.randn(m, H)
    with torch.no_grad():
        print(m, f"{best(lambda: chain(x)):.2f} ms", flush=True)
