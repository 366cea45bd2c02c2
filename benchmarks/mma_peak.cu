// mma_peak.cu: throughput ceiling of the Turing tensor-core instruction our kernels use.
//
// Runs back-to-back `mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32` (fp16 inputs, fp32
// accumulate, the only HMMA shape sm_75 has besides m16n8k16 via two k8 steps) on every SM, with
// several independent accumulator chains per warp to hide the instruction latency, registers only
// (no memory traffic inside the timed loop). Sweeps a few (warps per block, blocks per SM,
// chains) configurations and reports the best TFLOP/s: the "SM75-instruction ceiling" of the GPU
// it runs on. On a Turing card that is the tensor-core peak; on newer GPUs running our sm_75 build
// through PTX JIT it is the most an mma.sync-m16n8k8 kernel can reach there (e.g. ~460 TFLOP/s
// expected on an H200, well below its wgmma peak).
//
// Build (sm_75 SASS + compute_75 PTX so the driver can JIT it on newer GPUs):
//   nvcc -O3 -gencode arch=compute_75,code=[sm_75,compute_75] -o mma_peak benchmarks/mma_peak.cu
// Run:
//   ./mma_peak [--device N] [--target-ms MS] [--quick]
// The last line of output is machine readable:
//   MMA_PEAK_JSON {"peak_tflops": ..., ...}
//
// FLOP count: one m16n8k8 mma by one warp = 2*16*8*8 = 2048 FLOP.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "mma_peak: %s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__,    \
                   #expr, cudaGetErrorString(err_), cudaGetErrorName(err_));               \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

static constexpr double kFlopPerMma = 2.0 * 16 * 8 * 8;

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  unsigned u;
  std::memcpy(&u, &h, sizeof(u));
  return u;
}

// Each thread holds kChains accumulators of 4 fp32 (the m16n8 C/D fragment), one shared A
// fragment (2 x f16x2) and B fragment (1 x f16x2). Chains are independent so the warp can keep
// kChains mma in flight; within a chain each mma depends on the previous one.
template <int kChains>
__global__ void mma_m16n8k8_loop(float* __restrict__ out, int iters, float scale) {
  const float t = static_cast<float>(threadIdx.x & 31);
  // Operands depend on a runtime argument so nothing can be constant-folded; small magnitudes
  // keep the accumulators finite for any iteration count used here.
  const unsigned a0 = pack_half2(scale * t, scale * (t + 1.0f));
  const unsigned a1 = pack_half2(scale * (t + 2.0f), -scale * t);
  const unsigned b0 = pack_half2(scale, -scale * 0.5f);

  float acc[kChains][4];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[c][r] = 0.0f;
  }

  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      asm volatile(
          "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
          "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
          : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
          : "r"(a0), "r"(a1), "r"(b0));
    }
  }

  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x] = s;
}

struct Config {
  int warps_per_block;
  int blocks_per_sm;
  int chains;
};

struct Result {
  Config cfg;
  int occupancy_blocks_per_sm;  // what the hardware allows for this kernel/block size
  int iters;
  double best_ms;
  double tflops;
};

typedef void (*KernelFn)(float*, int, float);

static KernelFn kernel_for(int chains) {
  switch (chains) {
    case 2: return mma_m16n8k8_loop<2>;
    case 4: return mma_m16n8k8_loop<4>;
    case 8: return mma_m16n8k8_loop<8>;
    default: return nullptr;
  }
}

static float time_launch(KernelFn k, int grid, int block, float* out, int iters,
                         cudaEvent_t start, cudaEvent_t stop) {
  CUDA_CHECK(cudaEventRecord(start));
  k<<<grid, block>>>(out, iters, 1.0e-3f);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaEventRecord(stop));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  return ms;
}

static void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--device N] [--target-ms MS] [--reps R] [--quick]\n", argv0);
}

int main(int argc, char** argv) {
  int device = 0;
  double target_ms = 25.0;
  int reps = 5;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      device = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--target-ms") && i + 1 < argc) {
      target_ms = std::atof(argv[++i]);
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else {
      usage(argv[0]);
      return 1;
    }
  }

  int ndev = 0;
  CUDA_CHECK(cudaGetDeviceCount(&ndev));
  if (device < 0 || device >= ndev) {
    std::fprintf(stderr, "mma_peak: device %d out of range (%d devices)\n", device, ndev);
    return 1;
  }
  CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int sms = 0, clock_khz = 0, max_threads_sm = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&max_threads_sm, cudaDevAttrMaxThreadsPerMultiProcessor,
                                    device));
  // cudaDevAttrClockRate may be unsupported on some drivers; treat failure as "unknown".
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device) != cudaSuccess) {
    clock_khz = 0;
    (void)cudaGetLastError();
  }
  const int max_warps_sm = max_threads_sm / 32;
  std::printf("mma_peak: %s (sm_%d%d), %d SMs, max %d warps/SM, clock %.0f MHz\n", prop.name,
              prop.major, prop.minor, sms, max_warps_sm, clock_khz / 1000.0);
  std::printf("instruction: mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 (2048 FLOP/warp)\n");

  std::vector<Config> configs;
  const int warps_opts[] = {4, 8, 16, 32};
  const int blocks_opts[] = {1, 2, 4};
  const int chain_opts[] = {2, 4, 8};
  for (int w : warps_opts)
    for (int b : blocks_opts)
      for (int c : chain_opts) {
        if (w * 32 > prop.maxThreadsPerBlock) continue;
        if (w * b > max_warps_sm) continue;
        if (quick && !((w == 8 && b == 2 && c == 4) || (w == 16 && b == 1 && c == 8) ||
                       (w == 8 && b == 4 && c == 4) || (w == 4 && b == 2 && c == 8)))
          continue;
        configs.push_back({w, b, c});
      }

  size_t max_threads = 0;
  for (const Config& c : configs)
    max_threads = std::max(max_threads, static_cast<size_t>(c.warps_per_block) * 32 *
                                            c.blocks_per_sm * sms);
  float* out = nullptr;
  CUDA_CHECK(cudaMalloc(&out, std::max<size_t>(max_threads, 1) * sizeof(float)));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));

  std::printf("%8s %8s %7s %6s %10s %10s %10s\n", "warps/b", "blocks/SM", "chains", "occ",
              "iters", "best_ms", "TFLOP/s");
  std::vector<Result> results;
  for (const Config& cfg : configs) {
    KernelFn k = kernel_for(cfg.chains);
    const int block = cfg.warps_per_block * 32;
    int occ = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, block, 0));
    if (occ < cfg.blocks_per_sm) {
      std::printf("%8d %8d %7d %6d %10s %10s %10s (skipped: occupancy)\n", cfg.warps_per_block,
                  cfg.blocks_per_sm, cfg.chains, occ, "-", "-", "-");
      continue;
    }
    const int grid = sms * cfg.blocks_per_sm;
    // Calibrate the trip count so one launch takes about target_ms (first launch also JITs).
    int iters = 256;
    (void)time_launch(k, grid, block, out, iters, start, stop);
    for (int step = 0; step < 8; ++step) {
      const float ms = time_launch(k, grid, block, out, iters, start, stop);
      if (ms >= 0.5 * target_ms) break;
      const double scale = ms > 0.0f ? target_ms / ms : 64.0;
      const double next = std::min<double>(iters * std::min(scale, 64.0), 1 << 26);
      iters = std::max(iters + 1, static_cast<int>(next));
    }
    double best = 1e30;
    for (int r = 0; r < reps; ++r) best = std::min<double>(best, time_launch(k, grid, block, out,
                                                                             iters, start, stop));
    const double flop = kFlopPerMma * cfg.chains * static_cast<double>(iters) * grid *
                        cfg.warps_per_block;
    const double tflops = flop / (best * 1e-3) / 1e12;
    results.push_back({cfg, occ, iters, best, tflops});
    std::printf("%8d %8d %7d %6d %10d %10.3f %10.1f\n", cfg.warps_per_block, cfg.blocks_per_sm,
                cfg.chains, occ, iters, best, tflops);
  }

  // Read back one value so the result is observably used.
  float probe = 0.0f;
  CUDA_CHECK(cudaMemcpy(&probe, out, sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  CUDA_CHECK(cudaFree(out));

  if (results.empty()) {
    std::fprintf(stderr, "mma_peak: no configuration could run\n");
    return 1;
  }
  const Result* best = &results[0];
  for (const Result& r : results)
    if (r.tflops > best->tflops) best = &r;
  const double per_sm_clk =
      clock_khz > 0 ? best->tflops * 1e12 / (static_cast<double>(sms) * clock_khz * 1e3) : 0.0;
  std::printf("best: %.1f TFLOP/s with %d warps/block x %d blocks/SM, %d chains "
              "(%.0f FLOP/SM/clk at the %.0f MHz nominal clock; probe %g)\n",
              best->tflops, best->cfg.warps_per_block, best->cfg.blocks_per_sm, best->cfg.chains,
              per_sm_clk, clock_khz / 1000.0, static_cast<double>(probe));
  std::printf("MMA_PEAK_JSON {\"peak_tflops\": %.3f, \"warps_per_block\": %d, "
              "\"blocks_per_sm\": %d, \"chains\": %d, \"iters\": %d, \"best_ms\": %.4f, "
              "\"device\": \"%s\", \"cc\": \"%d.%d\", \"sms\": %d, \"clock_mhz\": %.0f, "
              "\"configs_run\": %zu}\n",
              best->tflops, best->cfg.warps_per_block, best->cfg.blocks_per_sm, best->cfg.chains,
              best->iters, best->best_ms, prop.name, prop.major, prop.minor, sms,
              clock_khz / 1000.0, results.size());
  return 0;
}
