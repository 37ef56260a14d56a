// How close topk_logprobs' row kernel (csrc/topk_logprobs/topk_rows_kernel.cuh) comes to reading its
// chunk of float32 logits at the memory's speed: the kernel against a read-only kernel over the same
// buffer (each row summed by a block: the floor), alternated over rounds, for several K. Rows of N(0, 3^2)
// logits, the spread of a trained teacher's. Checks a few rows against a host walk in double first
// (top-K values, ids, log-normalizer, entropy; no bias, scale or soft-cap: the CUDA tests cover those). Standalone (no torch):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icsrc tools/experiments/topk_rows_bench.cu -o topk_rows_bench
//   ./topk_rows_bench [rows >= 2] [vocab >= 8]   (default 882 x 152064: a 512 MiB chunk of a Qwen teacher)
// Prints CSV: K, rows, vocab, median ms of the kernel, of the read-only floor, their ratio, GB/s.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "../../csrc/topk_logprobs/topk_rows_kernel.cuh"

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t err_ = (x);                                                       \
    if (err_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

using nitrobrew::cuda::kTopKRowThreads;
using nitrobrew::cuda::TopKRowArgs;
using nitrobrew::cuda::launch_topk_rows;

// A hash-based N(0, 3^2) sample per entry (Box-Muller on two hashed uniforms): the same on every run.
__device__ __host__ inline float logit_at(uint64_t i) {
  auto hash = [](uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
  };
  const double u1 = ((hash(2 * i) >> 11) + 1.0) / 9007199254740993.0, u2 = (hash(2 * i + 1) >> 11) / 9007199254740992.0;
  return static_cast<float>(3.0 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

__global__ void fill(float* z, int64_t rows, int64_t ld, int64_t vocab) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * ld; i += int64_t(gridDim.x) * blockDim.x)
    // Row 1: ties (a grid of 1/4); the last row: offset by 1e4 (the sums must not carry the maximum's rounding).
    z[i] = i % ld >= vocab ? 0.f : i / ld == 1 ? rintf(4 * logit_at(i)) / 4 : logit_at(i) + (i / ld == rows - 1 ? 1e4f : 0.f);
}

// The floor: every entry of the row read once, as the row kernel reads it, and summed.
__global__ void __launch_bounds__(kTopKRowThreads) read_rows(const float* z, int64_t ld, int64_t vocab, float* out) {
  const float* row = z + blockIdx.x * ld;
  float acc = 0.f;
  for (int64_t v = threadIdx.x * 4; v < vocab; v += kTopKRowThreads * 4) {
    const float4 q = __ldcs(reinterpret_cast<const float4*>(row + v));
    acc += q.x + q.y + q.z + q.w;
  }
  if (acc == 12345.f) out[blockIdx.x] = acc;  // keeps the loads
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 882, vocab = argc > 2 ? std::atoll(argv[2]) : 152064;
  // "check": the host check alone, without the timing (under compute-sanitizer, whose racecheck takes
  // minutes over the timed launches).
  const bool check_only = argc > 3 && std::strcmp(argv[3], "check") == 0;
  if (rows < 2 || vocab < 8) {
    std::fprintf(stderr, "usage: topk_rows_bench [rows >= 2] [vocab >= 8] [check]\n");
    return 2;
  }
  const int64_t ld = (vocab + 7) / 8 * 8;
  float *z, *lp, *stats, *sink;
  int64_t* ids;
  CHECK(cudaMalloc(&z, rows * ld * sizeof(float)));
  CHECK(cudaMalloc(&lp, rows * 1024 * sizeof(float)));
  CHECK(cudaMalloc(&ids, rows * 1024 * sizeof(int64_t)));
  CHECK(cudaMalloc(&stats, rows * 2 * sizeof(float)));
  CHECK(cudaMalloc(&sink, rows * sizeof(float)));
  fill<<<1024, 256>>>(z, rows, ld, vocab);
  CHECK(cudaGetLastError());
  auto args_for = [&](int k) {
    TopKRowArgs a{};
    a.z = z;
    a.ld = ld;
    a.vocab = vocab;
    a.bias = nullptr;
    a.scale = 1.f;
    a.cap = 0.f;
    a.inv_t = 1.f;
    a.k = k;
    a.logprobs = lp;
    a.ids = ids;
    a.stats = stats;
    return a;
  };

  // The check: rows 0, 1 (on a grid of 1/4: ties across rounds) and the last, copied back, against a host walk
  // in double.
  int failures = 0;
  std::vector<int> ks;  // the K checked and timed: those the vocabulary allows
  for (int k : {8, 32, 256, 1024})
    if (k <= vocab) ks.push_back(k);
  for (int k : ks) {
    launch_topk_rows(args_for(k), rows, 0);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got_lp(rows * k), got_stats(rows * 2);
    std::vector<int64_t> got_ids(rows * k);
    CHECK(cudaMemcpy(got_lp.data(), lp, got_lp.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(got_ids.data(), ids, got_ids.size() * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(got_stats.data(), stats, got_stats.size() * 4, cudaMemcpyDeviceToHost));
    for (int64_t r : {int64_t(0), int64_t(1), rows - 1}) {
      std::vector<float> s(vocab);
      CHECK(cudaMemcpy(s.data(), z + r * ld, vocab * sizeof(float), cudaMemcpyDeviceToHost));
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0, centered = 0;
      for (float x : s) {
        sum += std::exp(x - m);
        centered += std::exp(x - m) * (x - m);
      }
      const double lse = m + std::log(sum), entropy = std::log(sum) - centered / sum;
      std::vector<int64_t> order(vocab);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t i, int64_t j) { return s[i] > s[j] || (s[i] == s[j] && i < j); });
      // Absolute tolerances, but for the float32 rounding of lse itself.
      bool ok = std::fabs(got_stats[r * 2] - lse) < 1e-7 * std::fabs(lse) + 2e-5 &&
                std::fabs(got_stats[r * 2 + 1] - entropy) < 2e-4;
      for (int j = 0; j < k; ++j)
        ok = ok && got_ids[r * k + j] == order[j] && std::fabs(got_lp[r * k + j] - (s[order[j]] - lse)) < 2e-5;
      if (!ok) {
        ++failures;
        std::printf("MISMATCH K=%d row %lld: lse %f vs %f, entropy %f vs %f, id0 %lld vs %lld\n", k, (long long)r,
                    got_stats[r * 2], lse, got_stats[r * 2 + 1], entropy, (long long)got_ids[r * k], (long long)order[0]);
      }
    }
  }
  std::printf("check: %s\n", failures ? "FAILED" : "ok");
  if (check_only) return failures ? 1 : 0;

  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  auto time_ms = [&](auto launch) {
    std::vector<float> ms;
    for (int i = 0; i < 11; ++i) {
      CHECK(cudaEventRecord(t0));
      launch();
      CHECK(cudaEventRecord(t1));
      CHECK(cudaEventSynchronize(t1));
      float t;
      CHECK(cudaEventElapsedTime(&t, t0, t1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const int num_k = static_cast<int>(ks.size());
  std::vector<std::vector<float>> kernel_ms(num_k), floor_ms(num_k);
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < num_k; ++i) {
      const TopKRowArgs a = args_for(ks[i]);
      floor_ms[i].push_back(time_ms([&] { read_rows<<<static_cast<unsigned>(rows), kTopKRowThreads>>>(z, ld, vocab, sink); }));
      kernel_ms[i].push_back(time_ms([&] { launch_topk_rows(a, rows, 0); }));
    }
  }
  CHECK(cudaGetLastError());
  std::printf("K,rows,vocab,kernel_ms,floor_ms,ratio_to_floor,kernel_GBps\n");
  for (int i = 0; i < num_k; ++i) {
    std::sort(kernel_ms[i].begin(), kernel_ms[i].end());
    std::sort(floor_ms[i].begin(), floor_ms[i].end());
    const double k_ms = kernel_ms[i][1], f_ms = floor_ms[i][1];
    std::printf("%d,%lld,%lld,%.4f,%.4f,%.3f,%.0f\n", ks[i], (long long)rows, (long long)vocab, k_ms, f_ms, k_ms / f_ms,
                rows * vocab * 4.0 / (k_ms * 1e6));
  }
  return failures ? 1 : 0;
}
