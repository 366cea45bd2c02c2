// The SM75 CUDA kernels against the CPU implementation (mha_fwd_cpu): one launch per
// instantiation (head dim buckets 64/128/256, full and with a tail, x causal; both alignments),
// plus the CUDA-only input checks. Skipped when no GPU is visible (CI has none).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <optional>
#include <ostream>
#include <string>
#include <tuple>

#include "flash_api.h"
#include "reference.h"

namespace flash_sm75 {
namespace {

using flash_sm75_test::AttnCase;
using flash_sm75_test::expect_matches_reference;
using flash_sm75_test::make_inputs;

#define SKIP_WITHOUT_CUDA()                                                  \
  do {                                                                       \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";      \
  } while (0)

struct GpuCase {
  std::string name;
  AttnCase c;
};
std::ostream& operator<<(std::ostream& os, const GpuCase& g) { return os << g.name; }

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> v;
  for (int64_t d : {40, 64, 96, 128, 200, 256}) {  // each bucket, full and with a tail
    const std::string ds = "hdim" + std::to_string(d);
    // flash_fwd_hdim{d}_fp16_sm75: ragged lengths, GQA 4:2, padded keys, BHSD strided input.
    AttnCase c;
    c.b = 2, c.sq = 97, c.sk = 203, c.h = 4, c.hk = 2, c.d = d;
    c.leftpad = {0, 5};
    c.seqused = {203, 150};
    c.bhsd = true;
    c.seed = 100 + d;
    v.push_back({ds + "_noncausal", c});
    // flash_fwd_hdim{d}_fp16_causal_sm75, bottom-right with seqlen_q > seqlen_k: leading rows
    // see no key (out 0, lse -inf); MQA.
    c = AttnCase{};
    c.b = 2, c.sq = 200, c.sk = 129, c.h = 3, c.hk = 1, c.d = d;
    c.is_causal = true, c.bottom_right = true;
    c.seed = 200 + d;
    v.push_back({ds + "_causal_bottom_right", c});
    // The same kernel, top-left (SDPA is_causal) with padded keys and a custom scale.
    c = AttnCase{};
    c.b = 1, c.sq = 257, c.sk = 200, c.h = 6, c.hk = 3, c.d = d;
    c.is_causal = true, c.bottom_right = false;
    c.leftpad = {3};
    c.seqused = {190};
    c.scale = 0.1;
    c.seed = 300 + d;
    v.push_back({ds + "_causal_top_left", c});
  }
  return v;
}

class FwdCuda : public ::testing::TestWithParam<GpuCase> {};

TEST_P(FwdCuda, MatchesCpuImplementation) {
  SKIP_WITHOUT_CUDA();
  const AttnCase& c = GetParam().c;
  auto in = make_inputs(c, at::Device(at::kCUDA, 0));
  auto [out, lse] = mha_fwd(in.q, in.k, in.v, c.scale, c.is_causal, c.bottom_right, in.leftpad_k,
                            in.seqused_k);
  ASSERT_TRUE(out.is_cuda());
  EXPECT_EQ(out.sizes(), (at::IntArrayRef{c.b, c.sq, c.h, c.d}));
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_EQ(lse.sizes(), (at::IntArrayRef{c.b, c.h, c.sq}));
  EXPECT_EQ(lse.scalar_type(), at::kFloat);
  EXPECT_TRUE(lse.is_contiguous());

  auto cpu = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value()) return std::nullopt;
    return t->cpu();
  };
  auto [ref_out, ref_lse] =
      mha_fwd_cpu(in.q.cpu(), in.k.cpu(), in.v.cpu(), c.scale, c.is_causal, c.bottom_right,
                  cpu(in.leftpad_k), cpu(in.seqused_k));
  // fp16 P.V with fp32 accumulation vs the fp32 reference rounded to fp16.
  expect_matches_reference(out, lse, ref_out.to(at::kDouble), ref_lse.to(at::kDouble),
                           /*out_atol=*/4e-3, /*out_rtol=*/4e-3, /*lse_atol=*/2e-3);
}

INSTANTIATE_TEST_SUITE_P(Instantiations, FwdCuda, ::testing::ValuesIn(gpu_cases()),
                         [](const ::testing::TestParamInfo<GpuCase>& i) { return i.param.name; });

TEST(FwdCudaOp, DispatcherRoutesCudaTensorsToTheKernel) {
  SKIP_WITHOUT_CUDA();
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, std::optional<double>, bool,
                                                 bool, const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&, int64_t,
                                                 int64_t, double, const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&);
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("flash_attention_sm75::fwd", "")
                .typed<Sig>();
  AttnCase c;
  c.b = 1, c.sq = 64, c.sk = 64, c.h = 2, c.hk = 2, c.d = 64;
  auto in = make_inputs(c, at::Device(at::kCUDA, 0));
  auto [out, lse] = op.call(in.q, in.k, in.v, std::nullopt, false, true, std::nullopt,
                            std::nullopt, -1, -1, 0.0, std::nullopt, std::nullopt);
  auto [want_out, want_lse] = mha_fwd(in.q, in.k, in.v, std::nullopt, false, true, std::nullopt,
                                      std::nullopt);
  EXPECT_TRUE(out.is_cuda());
  EXPECT_TRUE(at::equal(out, want_out));
  EXPECT_TRUE(at::equal(lse, want_lse));
}

TEST(FwdCudaInputs, AlignmentAndDeviceChecks) {
  SKIP_WITHOUT_CUDA();
  const auto opts = at::TensorOptions().dtype(at::kHalf).device(at::kCUDA, 0);
  const int64_t b = 1, s = 16, h = 2, d = 64;
  at::Tensor k = at::randn({b, s, h, d}, opts);
  // Data pointer 2 bytes past a 16-byte boundary.
  at::Tensor q = at::randn({b * s * h * d + 1}, opts).narrow(0, 1, b * s * h * d).view({b, s, h, d});
  EXPECT_VALUE_ERROR(mha_fwd(q, k, k, std::nullopt, false, true, std::nullopt, std::nullopt),
                     "q must be 16-byte aligned");
  // Row stride h*d + 4: not a multiple of 8 elements.
  at::Tensor kp = at::randn({b * s * (h * d + 4)}, opts)
                      .as_strided({b, s, h, d}, {s * (h * d + 4), h * d + 4, d, 1});
  EXPECT_VALUE_ERROR(mha_fwd(k, kp, k, std::nullopt, false, true, std::nullopt, std::nullopt),
                     "k must be 16-byte aligned", "strides");
  // k on the CPU while q is on the GPU.
  EXPECT_VALUE_ERROR(mha_fwd(k, k.cpu(), k, std::nullopt, false, true, std::nullopt, std::nullopt),
                     "k must be on the same device as q");
  // leftpad_k on the CPU.
  at::Tensor lp = at::zeros({b}, at::kInt);
  EXPECT_VALUE_ERROR(mha_fwd(k, k, k, std::nullopt, false, true, lp, std::nullopt),
                     "leftpad_k must be on the same device as q");
}

}  // namespace
}  // namespace flash_sm75
