// "mem-efficient as a T4 runs it": torch's own memory-efficient attention kernels (xformers'
// cutlass kernels, shipped in the torch wheel as headers under
// ATen/native/transformers/cuda/mem_eff_attention/) instantiated for cutlass::arch::Sm75 and
// fp16, as torch's cutlassF.h / cutlassB.h instantiate them for a compute capability 7.5 GPU,
// and chosen the way torch's _efficient_attention_forward / _efficient_attention_backward
// choose them on a T4 (64 KiB of shared memory per block). Built for compute_75 PTX (plus
// sm_75 SASS) by scripts/build_memeff_sm75.py, so a newer GPU runs exactly the kernels a T4
// would, through the driver's PTX JIT, as our own kernels are measured.
//
// This file is our wrapper only: the kernels come from torch's headers and cutlass at build
// time (never copied here). The ops are registered with TORCH_LIBRARY (no pybind), so the
// built library loads with torch.ops.load_library under any CPython:
//
//   memeff_sm75::fwd(q, k, v, causal, scale=None, compute_lse=True) -> (out, lse)
//   memeff_sm75::bwd(dout, q, k, v, out, lse, causal, scale=None) -> (dq, dk, dv)
//   memeff_sm75::plan(head_dim) -> [forward kernel, backward kernel]    (no GPU needed)
//   memeff_sm75::kernels() -> every candidate: "name pass built smem_bytes threads"
//
// Tensors are BSHD (batch, seqlen, heads, head_dim) fp16 CUDA tensors with a contiguous last
// dim; lse is float32 (batch, heads, seqlen_q rounded up to a multiple of 32) as the kernel
// writes it. causal is torch's is_causal (the kernel's CausalFromTopLeft mask, as SDPA sets
// it). No dropout, no bias, no variable lengths: what the benchmarks time.
//
// The file builds as one translation unit, or as two (-DMEMEFF_SM75_PART=1: forward kernels and
// the op registration; =2: backward kernels) that the build script compiles in parallel.

#include <tuple>  // before torch's Philox headers, which use std::tuple

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <ATen/native/transformers/cuda/mem_eff_attention/kernel_backward.h>
#include <ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#ifndef MEMEFF_SM75_PART
#define MEMEFF_SM75_PART 0  // 0: everything in one unit
#endif
#define MEMEFF_SM75_HAS_FWD (MEMEFF_SM75_PART == 0 || MEMEFF_SM75_PART == 1)
#define MEMEFF_SM75_HAS_BWD (MEMEFF_SM75_PART == 0 || MEMEFF_SM75_PART == 2)

namespace memeff_sm75 {

using Half = cutlass::half_t;
using Arch = cutlass::arch::Sm75;

// sharedMemPerBlockOptin of a Turing GPU (T4, RTX 20xx): the limit torch's dispatch compares
// each candidate's shared storage with. The plan uses the smaller of it and the device's own.
constexpr int64_t kTuringSmemPerBlockOptin = 64 * 1024;
// Above this a kernel needs cudaFuncAttributeMaxDynamicSharedMemorySize (as torch sets it).
constexpr int64_t kDefaultDynamicSmemLimit = 48 * 1024;

// The forward kernels torch instantiates for fp16 on sm75 (cutlassF.h, dispatch_cutlassF_f16_sm75):
// AttentionKernel<half, Sm75, aligned, queries/block, keys/block, kMaxK, dropout, bias>.
template <bool kAligned, int kQueries, int kKeys, int kMaxK>
using FwdKernel = PyTorchMemEffAttention::AttentionKernel<Half, Arch, kAligned, kQueries, kKeys,
                                                          kMaxK, true, true>;
// The backward kernels (cutlassB.h, dispatch_cutlassB_f16_sm75), without dropout:
// AttentionBackwardKernel<Sm75, half, aligned, dropout, preload, block I, block J, kMaxK>.
template <bool kAligned, int kBlockI, int kBlockJ, int kMaxK>
using BwdKernel = PyTorchMemEffAttention::AttentionBackwardKernel<Arch, Half, kAligned, false,
                                                                  false, kBlockI, kBlockJ, kMaxK>;

using FwdA64 = FwdKernel<true, 64, 64, 64>;
using FwdA128 = FwdKernel<true, 32, 128, 128>;
using FwdAGmem = FwdKernel<true, 32, 128, 65536>;
using FwdN64 = FwdKernel<false, 64, 64, 64>;
using FwdN128 = FwdKernel<false, 32, 128, 128>;
using FwdNGmem = FwdKernel<false, 32, 128, 65536>;

using BwdA32 = BwdKernel<true, 64, 64, 32>;
using BwdA64 = BwdKernel<true, 64, 64, 64>;
using BwdA128x64K128 = BwdKernel<true, 128, 64, 128>;
using BwdA64x64K128 = BwdKernel<true, 64, 64, 128>;
using BwdA128x64KMax = BwdKernel<true, 128, 64, 65536>;
using BwdA64x64KMax = BwdKernel<true, 64, 64, 65536>;
using BwdN32 = BwdKernel<false, 64, 64, 32>;
using BwdN64 = BwdKernel<false, 64, 64, 64>;
using BwdN128x64K128 = BwdKernel<false, 128, 64, 128>;
using BwdN64x64K128 = BwdKernel<false, 64, 64, 128>;
using BwdN128x64KMax = BwdKernel<false, 128, 64, 65536>;
using BwdN64x64KMax = BwdKernel<false, 64, 64, 65536>;

// ---------------------------------------------------------------------------------------------
// Device entry points (our own names). The body is compiled for __CUDA_ARCH__ >= 750 only; the
// build targets compute_75, so the PTX a newer GPU JIT-compiles holds the whole kernel.

template <typename K>
__device__ __forceinline__ void fwd_body(typename K::Params& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  if (!p.advance_to_block()) {
    return;
  }
  K::attention_kernel(p);
#endif
}

template <typename K>
__device__ __forceinline__ void bwd_body(typename K::Params& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  if (!p.advance_to_block()) {
    return;
  }
  K::attention_kernel(p);
#endif
}

#define MEMEFF_SM75_FWD_ENTRY(NAME, K)                                                 \
  __global__ void __launch_bounds__(K::kNumThreads, K::kMinBlocksPerSm) NAME(          \
      typename K::Params p) {                                                          \
    fwd_body<K>(p);                                                                    \
  }
#define MEMEFF_SM75_BWD_ENTRY(NAME, K)                                                 \
  __global__ void __launch_bounds__(K::kNumThreads, K::kMinBlocksPerSm) NAME(          \
      typename K::Params p) {                                                          \
    bwd_body<K>(p);                                                                    \
  }

// Only the kernels torch's sm75 dispatch picks for fp16 head dims 33-256 (a multiple of 8) on a
// 64 KiB SM are built; the others are candidates (their shared storage decides the choice) whose
// selection raises "not built".
#if MEMEFF_SM75_HAS_FWD
MEMEFF_SM75_FWD_ENTRY(memeff_sm75_fwd_f16_aligned_64x64_rf, FwdA64)
MEMEFF_SM75_FWD_ENTRY(memeff_sm75_fwd_f16_aligned_32x128_rf, FwdA128)
MEMEFF_SM75_FWD_ENTRY(memeff_sm75_fwd_f16_aligned_32x128_gmem, FwdAGmem)
#endif
#if MEMEFF_SM75_HAS_BWD
MEMEFF_SM75_BWD_ENTRY(memeff_sm75_bwd_f16_aligned_64x64_k64, BwdA64)
MEMEFF_SM75_BWD_ENTRY(memeff_sm75_bwd_f16_aligned_128x64_k128, BwdA128x64K128)
MEMEFF_SM75_BWD_ENTRY(memeff_sm75_bwd_f16_aligned_128x64_k65536, BwdA128x64KMax)
#endif

// ---------------------------------------------------------------------------------------------
// Host side: the candidates in torch's order, and the checks torch's launchKernel applies to each.

template <typename K>
struct Candidate {
  using Kernel = K;
  const char* name;  // torch's instantiation name (cutlassF.h / cutlassB.h), without "fmha_cutlass"
  void (*fn)(typename K::Params);  // nullptr: not built
};

template <typename K>
Candidate<K> candidate(const char* name, void (*fn)(typename K::Params)) {
  return Candidate<K>{name, fn};
}
template <typename K>
Candidate<K> candidate(const char* name) {
  return Candidate<K>{name, nullptr};
}

#if MEMEFF_SM75_HAS_FWD
// dispatch_cutlassF_f16_sm75's order.
template <typename Cb>
void for_each_fwd_candidate(Cb&& cb) {
  cb(candidate<FwdA64>("F_f16_aligned_64x64_rf_sm75", memeff_sm75_fwd_f16_aligned_64x64_rf));
  cb(candidate<FwdA128>("F_f16_aligned_32x128_rf_sm75", memeff_sm75_fwd_f16_aligned_32x128_rf));
  cb(candidate<FwdAGmem>("F_f16_aligned_32x128_gmem_sm75",
                         memeff_sm75_fwd_f16_aligned_32x128_gmem));
  cb(candidate<FwdN64>("F_f16_notaligned_64x64_rf_sm75"));
  cb(candidate<FwdN128>("F_f16_notaligned_32x128_rf_sm75"));
  cb(candidate<FwdNGmem>("F_f16_notaligned_32x128_gmem_sm75"));
}
#endif

#if MEMEFF_SM75_HAS_BWD
// dispatch_cutlassB_f16_sm75's order. Its dropout instantiations (after the aligned ones, and
// after the not-aligned ones) are left out: without dropout the same-shaped kernel before each
// of them is always taken first (the k65536 kernels accept every head dim).
template <typename Cb>
void for_each_bwd_candidate(Cb&& cb) {
  cb(candidate<BwdA32>("B_f16_aligned_64x64_k32_sm75"));
  cb(candidate<BwdA64>("B_f16_aligned_64x64_k64_sm75", memeff_sm75_bwd_f16_aligned_64x64_k64));
  cb(candidate<BwdA128x64K128>("B_f16_aligned_128x64_k128_sm75",
                               memeff_sm75_bwd_f16_aligned_128x64_k128));
  cb(candidate<BwdA64x64K128>("B_f16_aligned_64x64_k128_sm75"));
  cb(candidate<BwdA128x64KMax>("B_f16_aligned_128x64_k65536_sm75",
                               memeff_sm75_bwd_f16_aligned_128x64_k65536));
  cb(candidate<BwdA64x64KMax>("B_f16_aligned_64x64_k65536_sm75"));
  cb(candidate<BwdN32>("B_f16_notaligned_64x64_k32_sm75"));
  cb(candidate<BwdN64>("B_f16_notaligned_64x64_k64_sm75"));
  cb(candidate<BwdN128x64K128>("B_f16_notaligned_128x64_k128_sm75"));
  cb(candidate<BwdN64x64K128>("B_f16_notaligned_64x64_k128_sm75"));
  cb(candidate<BwdN128x64KMax>("B_f16_notaligned_128x64_k65536_sm75"));
  cb(candidate<BwdN64x64KMax>("B_f16_notaligned_64x64_k65536_sm75"));
}
#endif

// What the choice depends on: head dims, the head strides (stride(2), in elements) and the
// shared-memory limit.
struct Shape {
  int64_t head_dim = 0;
  int64_t head_dim_value = 0;
  int64_t q_stride_h = 0;
  int64_t k_stride_h = 0;
  int64_t v_stride_h = 0;
  int64_t smem_limit = kTuringSmemPerBlockOptin;
};

#if MEMEFF_SM75_HAS_FWD
// _efficient_attention_forward's per-candidate checks (no dropout, no bias).
template <typename K>
bool fwd_accepts(const Shape& s) {
  if (s.head_dim_value > K::kMaxK || s.head_dim > K::kMaxK) {
    return false;
  }
  if (s.q_stride_h % K::kAlignmentQ || s.k_stride_h % K::kAlignmentK ||
      s.v_stride_h % K::kAlignmentV) {
    return false;
  }
  return int64_t(sizeof(typename K::SharedStorage)) <= s.smem_limit;
}
#endif

#if MEMEFF_SM75_HAS_BWD
// _efficient_attention_backward's per-candidate checks (no dropout, no variable lengths; the
// kernels here all have kKeysQueriesAlignedToBlockSize = false).
template <typename K>
bool bwd_accepts(const Shape& s) {
  if (K::kMaxK < std::max(s.head_dim, s.head_dim_value)) {
    return false;
  }
  if (s.q_stride_h % K::kMinimumAlignment || s.k_stride_h % K::kMinimumAlignment ||
      s.v_stride_h % K::kMinimumAlignment) {
    return false;
  }
  return int64_t(sizeof(typename K::SharedStorage)) <= s.smem_limit;
}
#endif

template <typename Field, typename Value>
void assign_checked(Field& field, Value value, const char* what) {
  TORCH_CHECK(int64_t(value) < int64_t(std::numeric_limits<Field>::max()),
              "memeff_sm75: ", what, " = ", value, " overflows the kernel's parameter");
  field = static_cast<Field>(value);
}

inline double softmax_scale(const at::Tensor& q, const c10::optional<double>& scale) {
  // sdp::calculate_scale: the given scale, else 1 / sqrt(head_dim)
  return scale.has_value() ? *scale : 1.0 / std::sqrt(double(q.size(-1)));
}

inline int64_t smem_limit_for(const at::Tensor& t) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.device().index());
  return std::min<int64_t>(kTuringSmemPerBlockOptin, int64_t(prop->sharedMemPerBlockOptin));
}

// The checks every op makes before touching the GPU (so a CPU tensor or a wrong dtype gets a
// clear error, not a dispatcher or CUDA one).
inline void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "memeff_sm75: ", name,
              " must be 4-D BSHD (batch, seqlen, heads, head_dim), got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == at::kHalf, "memeff_sm75: ", name,
              " must be float16 (only the fp16 sm75 kernels are built), got ", t.scalar_type());
  TORCH_CHECK(!t.is_sparse(), "memeff_sm75: ", name, " must be a dense tensor");
  TORCH_CHECK(t.stride(-1) == 1, "memeff_sm75: ", name, ": last dimension must be contiguous");
}

inline void check_head_dim(int64_t d) {
  TORCH_CHECK(d > 32 && d <= 256 && d % 8 == 0, "memeff_sm75: head_dim ", d,
              " not supported: this build has torch's sm75 kernels for head dims 40-256, a "
              "multiple of 8 (head_dim <= 32 would take the k32 backward kernel, not built)");
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "memeff_sm75: ", name, " must be a CUDA tensor, got ", t.device());
}

inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_bshd(q, "q");
  check_bshd(k, "k");
  check_bshd(v, "v");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0),
              "memeff_sm75: q, k, v batch sizes differ");
  TORCH_CHECK(k.size(1) == v.size(1), "memeff_sm75: k and v sequence lengths differ");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) == v.size(2),
              "memeff_sm75: q, k, v must have the same number of heads (no GQA in torch's "
              "mem-efficient kernels)");
  TORCH_CHECK(q.size(3) == k.size(3) && q.size(3) == v.size(3),
              "memeff_sm75: q, k, v must have the same head_dim");
  check_head_dim(q.size(3));
  check_cuda(q, "q");
  check_cuda(k, "k");
  check_cuda(v, "v");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "memeff_sm75: q, k, v must be on one device");
}

inline Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      int64_t limit) {
  Shape s;
  s.head_dim = q.size(3);
  s.head_dim_value = v.size(3);
  s.q_stride_h = q.stride(2);
  s.k_stride_h = k.stride(2);
  s.v_stride_h = v.stride(2);
  s.smem_limit = limit;
  return s;
}

// The plan of a contiguous BSHD problem: what the ops pick for q, k, v of this head dim.
inline Shape contiguous_shape(int64_t d) {
  Shape s;
  s.head_dim = s.head_dim_value = d;
  s.q_stride_h = s.k_stride_h = s.v_stride_h = d;
  return s;
}

template <typename KernelFn>
void allow_dynamic_smem(KernelFn fn, int64_t smem_bytes) {
  if (smem_bytes > kDefaultDynamicSmemLimit) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(smem_bytes));
    TORCH_CHECK(err != cudaErrorInvalidValue, "memeff_sm75: this GPU does not have enough "
                "shared memory (kernel requires ", smem_bytes / 1024, " KiB)");
    C10_CUDA_CHECK(err);
  }
}

// Calls run(c) with the first candidate, in for_each's (torch's) order, that accepts(c) takes;
// false when none does.
template <typename ForEach, typename Accepts, typename Run>
bool first_accepted(ForEach&& for_each, Accepts&& accepts, Run&& run) {
  bool found = false;
  for_each([&](auto c) {
    if (!found && accepts(c)) {
      found = true;
      run(c);
    }
  });
  return found;
}

// After first_accepted: the errors of a call that launched nothing (`unbuilt`: the candidate
// torch would run, not in this build).
inline void check_launched(bool found, const std::string& unbuilt, const char* pass,
                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(unbuilt.empty(), "memeff_sm75: torch would run ", unbuilt,
              " here (head_dim ", q.size(3), ", head strides ", q.stride(2), "/", k.stride(2),
              "/", v.stride(2), "), which this build does not include");
  TORCH_CHECK(found, "memeff_sm75: no sm75 ", pass, " kernel accepts these inputs");
}

// The q, k, v strides both passes' Params hold (batch, row, head; in elements).
template <typename P>
void set_qkv_strides(P& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  assign_checked(p.q_strideB, q.stride(0), "q.stride(0)");
  assign_checked(p.k_strideB, k.stride(0), "k.stride(0)");
  assign_checked(p.v_strideB, v.stride(0), "v.stride(0)");
  assign_checked(p.q_strideM, q.stride(1), "q.stride(1)");
  assign_checked(p.k_strideM, k.stride(1), "k.stride(1)");
  assign_checked(p.v_strideM, v.stride(1), "v.stride(1)");
  assign_checked(p.q_strideH, q.stride(2), "q.stride(2)");
  assign_checked(p.k_strideH, k.stride(2), "k.stride(2)");
  assign_checked(p.v_strideH, v.stride(2), "v.stride(2)");
}

// One row of kernels(): name, pass, built or not, shared bytes, threads.
template <typename C>
std::string kernel_row(const C& c, const char* pass) {
  using K = typename C::Kernel;
  return std::string(c.name) + " " + pass + " " + (c.fn ? "built" : "not-built") + " " +
         std::to_string(sizeof(typename K::SharedStorage)) + " " +
         std::to_string(int64_t(K::kNumThreads));
}

#if MEMEFF_SM75_HAS_FWD
inline constexpr auto fwd_candidates = [](auto&& cb) { for_each_fwd_candidate(cb); };
auto fwd_accepted(const Shape& s) {
  return [&s](auto c) { return fwd_accepts<typename decltype(c)::Kernel>(s); };
}

std::string fwd_choice(const Shape& s) {
  std::string chosen;
  first_accepted(fwd_candidates, fwd_accepted(s), [&](auto c) { chosen = c.name; });
  return chosen;
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, bool causal,
                                       c10::optional<double> scale, bool compute_lse) {
  check_qkv(q, k, v);
  at::cuda::CUDAGuard device_guard(q.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const int64_t B = q.size(0), M = q.size(1), N = k.size(1), H = q.size(2);
  const int64_t Kv = v.size(3);
  const Shape s = shape_of(q, k, v, smem_limit_for(q));

  at::Tensor out, lse;
  std::string unbuilt;
  const bool found = first_accepted(fwd_candidates, fwd_accepted(s), [&](auto c) {
    using K = typename decltype(c)::Kernel;
    if (c.fn == nullptr) {
      unbuilt = c.name;
      return;
    }
    const int64_t smem_bytes = sizeof(typename K::SharedStorage);
    out = at::empty({B, M, H, Kv}, q.options());
    // LSE padded to the backward's block size (K::kAlignLSE), as torch allocates it; none
    // (and the kernel writes none) without compute_lse, as SDPA's forward without a gradient.
    const int64_t lse_len =
        compute_lse ? (M + K::kAlignLSE - 1) / K::kAlignLSE * K::kAlignLSE : 0;
    lse = at::empty({B, H, lse_len}, q.options().dtype(at::kFloat));

    typename K::Params p;
    p.query_ptr = reinterpret_cast<const Half*>(q.const_data_ptr());
    p.key_ptr = reinterpret_cast<const Half*>(k.const_data_ptr());
    p.value_ptr = reinterpret_cast<const Half*>(v.const_data_ptr());
    p.logsumexp_ptr = compute_lse ? lse.data_ptr<float>() : nullptr;
    at::Tensor out_accum;
    if (K::kNeedsOutputAccumulatorBuffer) {
      out_accum = at::empty({B, M, H, Kv}, q.options().dtype(at::kFloat));
      p.output_accum_ptr = out_accum.data_ptr<float>();
    } else {
      p.output_accum_ptr = nullptr;
    }
    p.output_ptr = reinterpret_cast<Half*>(out.data_ptr());
    p.num_heads = H;
    p.head_dim = q.size(3);
    p.head_dim_value = Kv;
    p.num_queries = M;
    p.num_keys = N;
    p.num_batches = B;
    p.custom_mask_type = causal ? K::CausalFromTopLeft : K::NoCustomMask;
    p.seqlen_k_ptr = nullptr;
    p.window_size = 0;
    p.scale = float(softmax_scale(q, scale));
    set_qkv_strides(p, q, k, v);
    assign_checked(p.o_strideM, out.stride(1), "out.stride(1)");
    p.use_dropout = false;

    allow_dynamic_smem(c.fn, smem_bytes);
    const dim3 blocks = p.getBlocksGrid();
    if (blocks.x * blocks.y * blocks.z == 0 || N == 0) {
      out.zero_();  // as torch: nothing to attend to
      return;
    }
    K::check_supported(p);
    c.fn<<<blocks, p.getThreadsGrid(), smem_bytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  check_launched(found, unbuilt, "forward", q, k, v);
  return std::make_tuple(out, lse);
}
#endif  // MEMEFF_SM75_HAS_FWD

#if MEMEFF_SM75_HAS_BWD
inline constexpr auto bwd_candidates = [](auto&& cb) { for_each_bwd_candidate(cb); };
auto bwd_accepted(const Shape& s) {
  return [&s](auto c) { return bwd_accepts<typename decltype(c)::Kernel>(s); };
}

std::string bwd_choice(const Shape& s) {
  std::string chosen;
  first_accepted(bwd_candidates, bwd_accepted(s), [&](auto c) { chosen = c.name; });
  return chosen;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout_, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool causal, c10::optional<double> scale) {
  check_bshd(dout_, "dout");
  check_bshd(out, "out");
  TORCH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat,
              "memeff_sm75: lse must be float32 (batch, heads, seqlen_q padded), as fwd returns "
              "it");
  check_qkv(q, k, v);
  check_cuda(dout_, "dout");
  check_cuda(out, "out");
  check_cuda(lse, "lse");
  const int64_t B = q.size(0), M = q.size(1), N = k.size(1), H = q.size(2);
  const int64_t Kv = v.size(3);
  TORCH_CHECK(dout_.sizes() == out.sizes() && out.size(0) == B && out.size(1) == M &&
                  out.size(2) == H && out.size(3) == Kv,
              "memeff_sm75: dout and out must be (batch, seqlen_q, heads, head_dim)");
  // The kernel reads out with row stride heads * head_dim (Params::o_strideM()).
  TORCH_CHECK(out.stride(1) == H * Kv, "memeff_sm75: out must have fwd's layout (row stride ",
              H * Kv, "), got stride ", out.stride(1));
  TORCH_CHECK(lse.size(0) == B && lse.size(1) == H && lse.size(2) >= M && lse.stride(2) == 1,
              "memeff_sm75: lse must be (batch, heads, >= seqlen_q) with a contiguous last dim");

  at::cuda::CUDAGuard device_guard(q.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor dout = dout_.contiguous();  // as torch: grad_out through a contiguous copy

  const Shape s = shape_of(q, k, v, smem_limit_for(q));
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());

  std::string unbuilt;
  const bool found = first_accepted(bwd_candidates, bwd_accepted(s), [&](auto c) {
    using K = typename decltype(c)::Kernel;
    if (c.fn == nullptr) {
      unbuilt = c.name;
      return;
    }
    const int64_t smem_bytes = sizeof(typename K::SharedStorage);
    // The fp16 kernels compute delta = rowsum(dO * O) themselves (kKernelComputesDelta).
    static_assert(K::kKernelComputesDelta, "the fp16 sm75 kernels compute delta");
    at::Tensor delta = at::empty({B, H, M}, q.options().dtype(at::kFloat));

    typename K::Params p;
    p.query_ptr = reinterpret_cast<const Half*>(q.const_data_ptr());
    p.key_ptr = reinterpret_cast<const Half*>(k.const_data_ptr());
    p.value_ptr = reinterpret_cast<const Half*>(v.const_data_ptr());
    p.logsumexp_ptr = lse.const_data_ptr<float>();
    p.output_ptr = reinterpret_cast<const Half*>(out.const_data_ptr());
    p.grad_output_ptr = reinterpret_cast<const Half*>(dout.const_data_ptr());
    p.grad_query_ptr = reinterpret_cast<Half*>(dq.data_ptr());
    p.grad_key_ptr = reinterpret_cast<Half*>(dk.data_ptr());
    p.grad_value_ptr = reinterpret_cast<Half*>(dv.data_ptr());
    p.delta_ptr = delta.data_ptr<float>();
    p.head_dim = q.size(3);
    p.head_dim_value = Kv;
    p.num_queries = M;
    p.num_keys = N;
    p.num_batches = B;
    p.num_heads = H;
    p.custom_mask_type = causal ? K::CausalFromTopLeft : K::NoCustomMask;
    p.scale = float(softmax_scale(q, scale));
    p.window_size = 0;

    assign_checked(p.lse_strideB, lse.stride(0), "lse.stride(0)");
    assign_checked(p.lse_strideH, lse.stride(1), "lse.stride(1)");
    assign_checked(p.gO_strideB, dout.stride(0), "dout.stride(0)");
    assign_checked(p.gO_strideM, dout.stride(1), "dout.stride(1)");
    assign_checked(p.gO_strideH, dout.stride(2), "dout.stride(2)");
    assign_checked(p.o_strideB, out.stride(0), "out.stride(0)");
    assign_checked(p.o_strideH, out.stride(2), "out.stride(2)");
    assign_checked(p.gQ_strideB, dq.stride(0), "dq.stride(0)");
    assign_checked(p.gK_strideB, dk.stride(0), "dk.stride(0)");
    assign_checked(p.gV_strideB, dv.stride(0), "dv.stride(0)");
    assign_checked(p.gQ_strideH, dq.stride(2), "dq.stride(2)");
    assign_checked(p.gK_strideH, dk.stride(2), "dk.stride(2)");
    assign_checked(p.gV_strideH, dv.stride(2), "dv.stride(2)");
    p.gQKV_strideM_multiplier = 1;  // separate dq, dk, dv (torch's shared_storage_dqdkdv=False)
    TORCH_INTERNAL_ASSERT(p.gQ_strideM() == dq.stride(1) && p.gK_strideM() == dk.stride(1) &&
                          p.gV_strideM() == dv.stride(1));
    set_qkv_strides(p, q, k, v);
    assign_checked(p.delta_strideB, delta.stride(0), "delta.stride(0)");
    assign_checked(p.delta_strideH, delta.stride(1), "delta.stride(1)");

    // Key splits as torch's heuristic sets them when SDPA passes num_splits_key = None: one
    // split per key block, none when the grid is already large and the keys short, and at most
    // 200 / (batch * heads) when dK/dV go through the gmem workspace.
    const dim3 grid_one_split = p.getBlocksGrid();  // num_splits_key is still 1 here
    const int64_t parallelism_without_split_key =
        int64_t(grid_one_split.x) * grid_one_split.y * grid_one_split.z;
    int64_t splits = (int64_t(p.num_keys) + K::kBlockSizeJ - 1) / K::kBlockSizeJ;
    if (parallelism_without_split_key >= 256 && p.num_keys <= 2 * K::kBlockSizeJ) {
      splits = 1;
    }
    if (K::kNeedsAccumGradK || K::kNeedsAccumGradV) {
      splits = std::min<int64_t>(splits, 200 / (int64_t(p.num_batches) * p.num_heads));
    }
    if (!K::kEnableSplitKeys || splits < 1) {
      splits = 1;
    }
    assign_checked(p.num_splits_key, splits, "num_splits_key");
    // torch's deterministic mode: one split (or a warning only, as torch).
    auto& ctx = at::globalContext();
    if (ctx.deterministicAlgorithms()) {
      if (ctx.deterministicAlgorithmsWarnOnly()) {
        TORCH_WARN_ONCE("memeff_sm75: mem-efficient attention's backward is not deterministic");
      } else {
        p.num_splits_key = 1;
      }
    }

    at::Tensor workspace;
    const int64_t workspace_bytes = p.workspace_size();
    if (workspace_bytes) {
      workspace = at::empty({workspace_bytes}, q.options().dtype(at::kByte));
      p.workspace = reinterpret_cast<float*>(workspace.data_ptr());
      if (p.should_zero_workspace()) {
        workspace.zero_();
      }
    }

    if (p.num_queries == 0 || p.num_keys == 0 || p.num_batches == 0 || p.num_heads == 0) {
      dq.zero_();
      dk.zero_();
      dv.zero_();
      return;
    }
    K::check_supported(p);
    allow_dynamic_smem(c.fn, smem_bytes);
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, c.fn));
    TORCH_INTERNAL_ASSERT(attr.binaryVersion >= K::ArchTag::kMinComputeCapability,
                          "memeff_sm75: the kernel's binary is older than sm75");
    c.fn<<<p.getBlocksGrid(), p.getThreadsGrid(), smem_bytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  check_launched(found, unbuilt, "backward", q, k, v);
  return std::make_tuple(dq, dk, dv);
}
#endif  // MEMEFF_SM75_HAS_BWD

// ---------------------------------------------------------------------------------------------
// Registration (with the forward part when split in two units).

#if MEMEFF_SM75_PART == 1
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool causal, c10::optional<double> scale);
std::string bwd_choice(const Shape& s);
std::vector<std::string> bwd_kernel_table();
#endif

#if MEMEFF_SM75_HAS_BWD
std::vector<std::string> bwd_kernel_table() {
  std::vector<std::string> rows;
  for_each_bwd_candidate([&](auto c) { rows.push_back(kernel_row(c, "bwd")); });
  return rows;
}
#endif

#if MEMEFF_SM75_HAS_FWD
std::vector<std::string> plan(int64_t head_dim) {
  check_head_dim(head_dim);
  const Shape s = contiguous_shape(head_dim);
  return {fwd_choice(s), bwd_choice(s)};
}

std::vector<std::string> kernels() {
  std::vector<std::string> rows;
  for_each_fwd_candidate([&](auto c) { rows.push_back(kernel_row(c, "fwd")); });
  for (auto& row : bwd_kernel_table()) {
    rows.push_back(row);
  }
  return rows;
}

// Catch-all registrations: every backend reaches our checks, so a CPU tensor gets our message.
TORCH_LIBRARY(memeff_sm75, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, bool causal, float? scale=None, bool compute_lse=True) "
        "-> (Tensor, Tensor)",
        &fwd);
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float? scale=None) -> (Tensor, Tensor, Tensor)",
        &bwd);
  m.def("plan(int head_dim) -> str[]", &plan);
  m.def("kernels() -> str[]", &kernels);
}
#endif

}  // namespace memeff_sm75
