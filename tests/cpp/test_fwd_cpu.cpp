// mha_fwd_cpu (the float64 ATen reference / CPU implementation) against the naive
// double-precision loop of reference.h, and the registered op flash_attention_sm75::fwd on CPU.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <limits>
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
using flash_sm75_test::naive_attention;

struct Named {
  std::string name;
  AttnCase c;
};
std::ostream& operator<<(std::ostream& os, const Named& n) { return os << n.name; }

AttnCase mk(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d, bool causal,
            bool bottom_right = true) {
  AttnCase c;
  c.b = b;
  c.sq = sq;
  c.sk = sk;
  c.h = h;
  c.hk = hk;
  c.d = d;
  c.is_causal = causal;
  c.bottom_right = bottom_right;
  c.seed = static_cast<uint64_t>(b * 1000003 + sq * 1009 + sk * 31 + h * 7 + d + causal);
  return c;
}

std::vector<Named> cases() {
  std::vector<Named> v;
  for (int64_t d : {64, 128}) {
    const std::string ds = "d" + std::to_string(d);
    v.push_back({ds + "_plain", mk(2, 17, 23, 2, 2, d, false)});
    v.push_back({ds + "_causal_br_sq_lt_sk", mk(1, 9, 40, 2, 1, d, true, true)});
    v.push_back({ds + "_causal_tl_sq_lt_sk", mk(1, 9, 40, 2, 1, d, true, false)});
    // seqlen_q > seqlen_k: bottom-right leaves the first sq - sk rows without keys.
    v.push_back({ds + "_causal_br_sq_gt_sk", mk(2, 33, 12, 2, 2, d, true, true)});
    v.push_back({ds + "_causal_tl_sq_gt_sk", mk(2, 33, 12, 2, 2, d, true, false)});
    v.push_back({ds + "_causal_square", mk(1, 65, 65, 1, 1, d, true, true)});
    v.push_back({ds + "_gqa_4_2", mk(2, 11, 19, 4, 2, d, false)});
    v.push_back({ds + "_gqa_6_3_causal", mk(1, 14, 14, 6, 3, d, true)});
    v.push_back({ds + "_mqa_6_1", mk(1, 7, 30, 6, 1, d, false)});
    AttnCase c = mk(1, 5, 9, 2, 1, d, false);
    c.scale = 0.37;
    v.push_back({ds + "_custom_scale", c});
    c = mk(2, 13, 29, 4, 2, d, false);
    c.bhsd = true;
    v.push_back({ds + "_bhsd_strided", c});
    // Left/right padded keys (HF padded batches), with GQA, causal both alignments.
    for (bool causal : {false, true}) {
      for (bool br : {false, true}) {
        if (!causal && !br) continue;
        c = mk(3, 21, 26, 4, 2, d, causal, br);
        c.leftpad = {0, 5, 11};
        c.seqused = {26, 20, 26};
        v.push_back({ds + "_padded" + (causal ? (br ? "_causal_br" : "_causal_tl") : ""), c});
      }
    }
    // Out-of-range bounds are clamped; an empty window gives zero rows.
    c = mk(4, 6, 10, 2, 2, d, false);
    c.leftpad = {-3, 4, 12, 7};
    c.seqused = {15, 3, 20, 10};  // batch 1: seqused < leftpad; batch 2: leftpad past the end
    v.push_back({ds + "_clamped_and_empty_windows", c});
    c = mk(2, 8, 16, 2, 1, d, true, true);
    c.seqused = {16, 6};
    v.push_back({ds + "_seqused_only_causal", c});
  }
  return v;
}

class FwdCpu : public ::testing::TestWithParam<Named> {};

TEST_P(FwdCpu, MatchesNaiveDoubleReference) {
  const AttnCase& c = GetParam().c;
  auto in = make_inputs(c);
  auto [out, lse] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, c.is_causal, c.bottom_right,
                                in.leftpad_k, in.seqused_k);
  // Contract: out (b, sq, h, d) fp16 contiguous; lse (b, h, sq) fp32 contiguous.
  EXPECT_EQ(out.sizes(), (at::IntArrayRef{c.b, c.sq, c.h, c.d}));
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_EQ(lse.sizes(), (at::IntArrayRef{c.b, c.h, c.sq}));
  EXPECT_EQ(lse.scalar_type(), at::kFloat);
  EXPECT_TRUE(lse.is_contiguous());
  auto [ref_out, ref_lse] = naive_attention(in.q, in.k, in.v, c);
  // fp32 math rounded to fp16 at the end: half an fp16 ulp plus float32 noise.
  expect_matches_reference(out, lse, ref_out, ref_lse, /*out_atol=*/1e-3, /*out_rtol=*/1e-3,
                           /*lse_atol=*/1e-4);
}

INSTANTIATE_TEST_SUITE_P(Cases, FwdCpu, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Named>& i) { return i.param.name; });

TEST(FwdCpuSemantics, RowsWithoutKeysAreZeroAndNegInf) {
  AttnCase c = mk(1, 6, 3, 1, 1, 64, /*causal=*/true, /*bottom_right=*/true);
  auto in = make_inputs(c);
  auto [out, lse] = mha_fwd_cpu(in.q, in.k, in.v, std::nullopt, true, true, std::nullopt,
                                std::nullopt);
  // off = 3 - 6 = -3: rows 0..2 see nothing, rows 3..5 see keys 0..i-3.
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isinf(lse[0][0][i].item<float>()) && lse[0][0][i].item<float>() < 0) << i;
    EXPECT_EQ(out[0][i].abs().sum().item<float>(), 0.f) << i;
  }
  // Row 3 sees exactly key 0: softmax of one element is 1, so out = v[0] and lse = scale*q.k.
  EXPECT_TRUE(at::allclose(out[0][3].to(at::kFloat), in.v[0][0].to(at::kFloat), 0, 1e-3));
  const float s = (in.q[0][3][0].to(at::kFloat) * in.k[0][0][0].to(at::kFloat)).sum().item<float>() / 8.f;
  EXPECT_NEAR(lse[0][0][3].item<float>(), s, 1e-4);
}

TEST(FwdCpuSemantics, DecodeBottomRightSeesAllTopLeftSeesFirst) {
  // seqlen_q = 1: bottom-right causal equals non-causal; top-left sees key 0 only.
  AttnCase c = mk(1, 1, 50, 2, 2, 128, true);
  auto in = make_inputs(c);
  auto full = mha_fwd_cpu(in.q, in.k, in.v, std::nullopt, false, true, std::nullopt, std::nullopt);
  auto br = mha_fwd_cpu(in.q, in.k, in.v, std::nullopt, true, true, std::nullopt, std::nullopt);
  auto tl = mha_fwd_cpu(in.q, in.k, in.v, std::nullopt, true, false, std::nullopt, std::nullopt);
  EXPECT_TRUE(at::equal(std::get<0>(full), std::get<0>(br)));
  EXPECT_TRUE(at::equal(std::get<1>(full), std::get<1>(br)));
  EXPECT_TRUE(at::allclose(std::get<0>(tl)[0][0].to(at::kFloat),
                           in.v[0][0].to(at::kFloat), 0, 1e-3));
}

TEST(FwdCpuSemantics, ZeroSizeGivesEmptyOrZeroResults) {
  const double inf = std::numeric_limits<double>::infinity();
  // {b, sq, sk, h, hk}
  for (auto s : std::vector<std::vector<int64_t>>{{0, 5, 7, 4, 2}, {2, 5, 7, 0, 0}, {2, 0, 7, 4, 2},
                                                  {2, 5, 0, 4, 2}, {0, 0, 0, 0, 0}, {2, 5, 7, 0, 2}}) {
    const int64_t b = s[0], sq = s[1], sk = s[2], h = s[3], hk = s[4];
    SCOPED_TRACE(::testing::PrintToString(s));
    at::Tensor q = at::randn({b, sq, h, 64}).to(at::kHalf);
    at::Tensor k = at::randn({b, sk, hk, 64}).to(at::kHalf);
    auto [out, lse] = mha_fwd_cpu(q, k, k, std::nullopt, true, true, std::nullopt, std::nullopt);
    EXPECT_EQ(out.sizes(), q.sizes());
    EXPECT_EQ(lse.sizes(), (at::IntArrayRef{b, h, sq}));
    EXPECT_EQ(out.scalar_type(), at::kHalf);
    EXPECT_EQ(lse.scalar_type(), at::kFloat);
    EXPECT_TRUE(out.is_contiguous() && lse.is_contiguous());
    EXPECT_TRUE(at::equal(out, at::zeros_like(out)));
    EXPECT_TRUE(at::equal(lse, at::full_like(lse, -inf)));
    auto [dq, dk, dv] = mha_bwd_cpu(out, q, k, k, out, lse, 0.125, true, true, std::nullopt,
                                    std::nullopt, true, std::nullopt);
    EXPECT_EQ(dq.sizes(), q.sizes());
    EXPECT_EQ(dk.sizes(), k.sizes());
    EXPECT_EQ(dv.sizes(), k.sizes());
    EXPECT_TRUE(at::equal(dq, at::zeros_like(dq)) && at::equal(dk, at::zeros_like(dk)) &&
                at::equal(dv, at::zeros_like(dv)));
  }
}

TEST(FwdCpuSemantics, KeysOutsideTheRangeAreNeverRead) {
  // NaN / inf in K and V rows outside [leftpad_k, seqused_k) change nothing (they reached out
  // through 0 * NaN in P V, and dq/dk/dv), and those keys get exactly zero dk / dv.
  AttnCase c = mk(3, 6, 12, 4, 2, 64, true, false);
  c.leftpad = {2, 0, 5};
  c.seqused = {9, 4, 3};  // the last row sees no key
  auto in = make_inputs(c);
  at::Tensor k2 = in.k.clone(), v2 = in.v.clone();
  const std::vector<std::pair<int64_t, int64_t>> hidden = {{0, 0}, {0, 1}, {0, 9}, {0, 11},
                                                           {1, 4}, {1, 11}, {2, 0}, {2, 7}};
  for (auto [bi, j] : hidden) {
    k2[bi][j].fill_(std::numeric_limits<double>::quiet_NaN());
    v2[bi][j].fill_((j % 2) ? std::numeric_limits<double>::infinity()
                            : std::numeric_limits<double>::quiet_NaN());
  }
  auto [out, lse] = mha_fwd_cpu(in.q, in.k, in.v, std::nullopt, true, false, in.leftpad_k,
                                in.seqused_k);
  auto [out2, lse2] = mha_fwd_cpu(in.q, k2, v2, std::nullopt, true, false, in.leftpad_k,
                                  in.seqused_k);
  EXPECT_TRUE(at::equal(out, out2));
  EXPECT_TRUE(at::equal(lse, lse2));
  EXPECT_FALSE(out2.isnan().any().item<bool>());
  at::Tensor dout = at::randn(out.sizes()).to(at::kHalf);
  auto g = mha_bwd_cpu(dout, in.q, in.k, in.v, out, lse, 0.125, true, false, in.leftpad_k,
                       in.seqused_k, true, std::nullopt);
  auto g2 = mha_bwd_cpu(dout, in.q, k2, v2, out2, lse2, 0.125, true, false, in.leftpad_k,
                        in.seqused_k, true, std::nullopt);
  EXPECT_TRUE(at::equal(std::get<0>(g), std::get<0>(g2)));
  EXPECT_TRUE(at::equal(std::get<1>(g), std::get<1>(g2)));
  EXPECT_TRUE(at::equal(std::get<2>(g), std::get<2>(g2)));
  for (auto [bi, j] : hidden) {
    EXPECT_EQ(std::get<1>(g2)[bi][j].abs().sum().item<float>(), 0.f);
    EXPECT_EQ(std::get<2>(g2)[bi][j].abs().sum().item<float>(), 0.f);
  }
}

// The op registered by torch_bindings.cpp, called through the dispatcher with CPU tensors: the
// CPU kernel is mha_fwd_cpu and errors stay c10::ValueError.
using FwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, std::optional<double>, bool,
                                                  bool, const std::optional<at::Tensor>&,
                                                  const std::optional<at::Tensor>&, int64_t,
                                                  int64_t, double, const std::optional<at::Tensor>&,
                                                  const std::optional<at::Tensor>&);

TEST(FwdOp, RegisteredAndDispatchesToCpu) {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("flash_attention_sm75::fwd", "")
                .typed<FwdSig>();
  const std::string schema = c10::toString(op.schema());
  EXPECT_NE(schema.find("float? softmax_scale=None"), std::string::npos) << schema;
  EXPECT_NE(schema.find("bool causal_bottom_right=True"), std::string::npos) << schema;
  EXPECT_NE(schema.find("int window_size_left=-1, int window_size_right=-1"), std::string::npos)
      << schema;
  EXPECT_NE(schema.find("float softcap=0., Tensor? alibi_slopes=None, Tensor? attn_bias=None"),
            std::string::npos)
      << schema;
  EXPECT_NE(schema.find("-> (Tensor out, Tensor softmax_lse)"), std::string::npos) << schema;

  AttnCase c = mk(2, 10, 21, 4, 2, 64, true, false);
  c.leftpad = {2, 0};
  c.seqused = {21, 15};
  auto in = make_inputs(c);
  auto [out, lse] = op.call(in.q, in.k, in.v, c.scale, c.is_causal, c.bottom_right, in.leftpad_k,
                            in.seqused_k, 5, -1, 0.0, std::nullopt, std::nullopt);
  auto [want_out, want_lse] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, c.is_causal, c.bottom_right,
                                          in.leftpad_k, in.seqused_k, 5, -1);
  EXPECT_TRUE(at::equal(out, want_out));
  EXPECT_TRUE(at::equal(lse, want_lse));
  // The window changes the result (so the comparison above covers it).
  auto [plain, plain_lse] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, c.is_causal, c.bottom_right,
                                        in.leftpad_k, in.seqused_k);
  EXPECT_FALSE(at::equal(lse, plain_lse));

  EXPECT_VALUE_ERROR(op.call(in.q, in.k, in.v, 0.0, false, true, std::nullopt, std::nullopt, -1,
                             -1, 0.0, std::nullopt, std::nullopt),
                     "softmax_scale");
  EXPECT_VALUE_ERROR(op.call(in.q, in.k, in.v, std::nullopt, false, true, std::nullopt,
                             std::nullopt, -2, -1, 0.0, std::nullopt, std::nullopt),
                     "window_size_left");
  EXPECT_VALUE_ERROR(op.call(in.q, in.k, in.v, std::nullopt, false, true, std::nullopt,
                             std::nullopt, -1, -1, -1.0, std::nullopt, std::nullopt),
                     "softcap");
}

// Score mods (softcap, ALiBi) in the CPU reference: each changes the result as its formula says,
// computed here from the unmodified op's scores; bad values raise ValueError naming the argument.
TEST(FwdOp, ScoreModsOnTheCpuReference) {
  AttnCase c = mk(2, 9, 13, 4, 2, 64, true, true);
  auto in = make_inputs(c);
  const double cap = 0.5;
  const at::Tensor slopes = at::tensor({0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f}).view({2, 4});
  auto [out, lse] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true, std::nullopt, std::nullopt,
                                -1, -1, cap, slopes);
  // Reference from first principles, float64.
  const at::Tensor q = in.q.to(at::kDouble).transpose(1, 2);
  const at::Tensor k = in.k.to(at::kDouble).transpose(1, 2).repeat_interleave(2, 1);
  const at::Tensor v = in.v.to(at::kDouble).transpose(1, 2).repeat_interleave(2, 1);
  at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * c.scale.value_or(0.125);
  s = cap * at::tanh(s / cap);
  const at::Tensor i = at::arange(9, at::kLong).view({9, 1});
  const at::Tensor j = at::arange(13, at::kLong).view({1, 13});
  const at::Tensor dist = (i + (13 - 9) - j).abs().to(at::kDouble);
  s = s - slopes.to(at::kDouble).view({2, 4, 1, 1}) * dist;
  s = s.masked_fill(j > i + (13 - 9), -INFINITY);
  const at::Tensor want_lse = at::logsumexp(s, -1);
  const at::Tensor want_out = at::matmul(at::softmax(s, -1), v).transpose(1, 2);
  EXPECT_TRUE(at::allclose(lse.to(at::kDouble), want_lse, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), want_out, 2e-3, 2e-3));
  // (h,) slopes broadcast over the batch.
  auto [out_h, lse_h] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true, std::nullopt,
                                    std::nullopt, -1, -1, cap, slopes[1]);
  auto [out_b, lse_b] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true, std::nullopt,
                                    std::nullopt, -1, -1, cap, slopes[1].expand({2, 4}).contiguous());
  EXPECT_TRUE(at::equal(lse_h, lse_b));

  EXPECT_VALUE_ERROR(mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true, std::nullopt,
                                 std::nullopt, -1, -1, std::nan(""), std::nullopt),
                     "softcap");
  EXPECT_VALUE_ERROR(mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true, std::nullopt,
                                 std::nullopt, -1, -1, 0.0, slopes.to(at::kDouble)),
                     "alibi_slopes must be float32");
  EXPECT_VALUE_ERROR(mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true, std::nullopt,
                                 std::nullopt, -1, -1, 0.0, slopes.view({8})),
                     "alibi_slopes must have shape");
  EXPECT_VALUE_ERROR(mha_fwd_cpu(in.q, in.k, in.v, c.scale, true, true,
                                 at::zeros({2}, at::TensorOptions().dtype(at::kInt)),
                                 std::nullopt, -1, -1, 0.0, slopes),
                     "seqused_k");
}

// attn_bias: a boolean mask that is a key range per batch row gives the key range's result, and
// an additive bias of 0 / -inf the boolean mask's (the CPU reference; the kernels are compared
// with it in tests/test_attn_bias.py).
TEST(FwdCpuBias, KeyRangeMaskEqualsKeyRangeAndAdditiveEqualsBool) {
  AttnCase c = mk(2, 10, 21, 4, 2, 64, false);
  c.leftpad = {2, 0};
  c.seqused = {21, 15};
  auto in = make_inputs(c);
  auto [want, want_lse] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, false, true, in.leftpad_k,
                                      in.seqused_k);
  const at::Tensor j = at::arange(21, at::TensorOptions().dtype(at::kInt)).view({1, 1, 1, 21});
  const at::Tensor mask =
      j.ge(in.leftpad_k->view({2, 1, 1, 1})).logical_and(j.lt(in.seqused_k->view({2, 1, 1, 1})));
  auto [out, lse] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, false, true, std::nullopt,
                                std::nullopt, -1, -1, 0.0, std::nullopt, mask);
  EXPECT_TRUE(at::allclose(out.to(at::kFloat), want.to(at::kFloat), 0, 1e-3));
  EXPECT_TRUE(at::allclose(lse, want_lse, 0, 1e-5));
  const at::Tensor add = at::zeros({2, 1, 1, 21}).masked_fill(mask.logical_not(), -INFINITY);
  auto [out2, lse2] = mha_fwd_cpu(in.q, in.k, in.v, c.scale, false, true, std::nullopt,
                                  std::nullopt, -1, -1, 0.0, std::nullopt, add);
  EXPECT_TRUE(at::equal(out2, out));
  EXPECT_TRUE(at::allclose(lse2, lse, 0, 1e-6));
  // A shape that does not broadcast: ValueError naming attn_bias, before anything runs.
  EXPECT_THROW(mha_fwd_cpu(in.q, in.k, in.v, c.scale, false, true, std::nullopt, std::nullopt,
                           -1, -1, 0.0, std::nullopt, at::zeros({3, 21})),
               c10::ValueError);
}

}  // namespace
}  // namespace flash_sm75

