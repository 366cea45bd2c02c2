// check_fwd_inputs (csrc/flash_api.cpp) through LibTorch CPU tensors: every invalid input is a
// c10::ValueError whose message starts with "flash_attention_sm75:" and names the argument.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include "flash_api.h"
#include "kernels/launch_plan.h"
#include "reference.h"

namespace flash_sm75 {
namespace {

using flash_sm75_test::AttnCase;
using flash_sm75_test::AttnInputs;
using flash_sm75_test::make_inputs;

constexpr std::nullopt_t kNone = std::nullopt;

at::Tensor half(at::IntArrayRef shape) { return at::randn(shape).to(at::kHalf); }

// A meta tensor: same dtype and shape, different device, no GPU needed.
at::Tensor on_meta(const at::Tensor& t) { return at::empty_like(t, t.options().device(at::kMeta)); }

class FwdInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    AttnCase c;
    c.b = 2;
    c.sq = 5;
    c.sk = 7;
    c.h = 4;
    c.hk = 2;
    c.d = 64;
    in = make_inputs(c);
  }
  double check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               std::optional<double> scale = std::nullopt,
               const std::optional<at::Tensor>& leftpad = std::nullopt,
               const std::optional<at::Tensor>& seqused = std::nullopt) {
    return check_fwd_inputs(q, k, v, scale, leftpad, seqused);
  }
  AttnInputs in;
};

TEST_F(FwdInputs, ValidInputsReturnTheScale) {
  EXPECT_DOUBLE_EQ(check(in.q, in.k, in.v), 1.0 / 8.0);  // 1/sqrt(64)
  EXPECT_DOUBLE_EQ(check(in.q, in.k, in.v, 0.25), 0.25);
  at::Tensor q128 = half({2, 5, 4, 128}), k128 = half({2, 7, 2, 128});
  EXPECT_DOUBLE_EQ(check(q128, k128, k128), 1.0 / std::sqrt(128.0));
  // BHSD storage passed as a BSHD view, MQA, explicit key bounds.
  at::Tensor qt = half({2, 4, 5, 64}).transpose(1, 2), kt = half({2, 1, 7, 64}).transpose(1, 2);
  at::Tensor bounds = at::tensor({1, 7}, at::kInt);
  EXPECT_DOUBLE_EQ(check(qt, kt, kt, kNone, bounds, bounds), 0.125);
}

TEST_F(FwdInputs, WrongDtype) {
  EXPECT_VALUE_ERROR(check(in.q.to(at::kFloat), in.k, in.v), "q must be float16", "Float");
  EXPECT_VALUE_ERROR(check(in.q, in.k.to(at::kBFloat16), in.v), "k must be float16", "BFloat16");
  EXPECT_VALUE_ERROR(check(in.q, in.k, in.v.to(at::kDouble)), "v must be float16", "Double");
}

TEST_F(FwdInputs, WrongRank) {
  EXPECT_VALUE_ERROR(check(in.q[0], in.k, in.v), "q must be 4-D", "3-D");
  EXPECT_VALUE_ERROR(check(in.q, in.k.unsqueeze(0), in.v), "k must be 4-D", "5-D");
  EXPECT_VALUE_ERROR(check(in.q, in.k, in.v.flatten(2)), "v must be 4-D");
}

TEST_F(FwdInputs, DeviceMismatch) {
  EXPECT_VALUE_ERROR(check(in.q, on_meta(in.k), in.v), "k must be on the same device as q",
                     "meta");
  EXPECT_VALUE_ERROR(check(in.q, in.k, on_meta(in.v)), "v must be on the same device as q");
  at::Tensor lp = at::zeros({2}, at::TensorOptions().dtype(at::kInt).device(at::kMeta));
  EXPECT_VALUE_ERROR(check(in.q, in.k, in.v, kNone, lp), "leftpad_k must be on the same device");
  EXPECT_VALUE_ERROR(check(in.q, in.k, in.v, kNone, kNone, lp),
                     "seqused_k must be on the same device");
}

TEST_F(FwdInputs, UnsupportedHeadDim) {
  // Multiples of 8 up to 256 run (on the smallest bucket >= d); nothing else.
  for (int64_t d : {4, 12, 100, 264}) {
    at::Tensor q = half({1, 3, 2, d}), k = half({1, 3, 2, d});
    EXPECT_VALUE_ERROR(check(q, k, k), "head_dim must be a multiple of 8 from 8 to 256",
                       "got " + std::to_string(d));
  }
  for (int64_t d : {8, 40, 96, 136, 256}) {
    at::Tensor q = half({1, 3, 2, d}), k = half({1, 3, 2, d});
    EXPECT_NO_THROW(check(q, k, k));
  }
  // q and k disagree on head_dim.
  EXPECT_VALUE_ERROR(check(half({1, 3, 2, 64}), half({1, 3, 2, 128}), half({1, 3, 2, 128})),
                     "head_dim");
}

TEST_F(FwdInputs, HeadsNotDivisible) {
  at::Tensor q = half({1, 3, 6, 64}), k = half({1, 3, 4, 64});
  EXPECT_VALUE_ERROR(check(q, k, k), "num_heads (6)", "num_heads_k (4)");
  // More kv heads than q heads.
  EXPECT_VALUE_ERROR(check(half({1, 3, 2, 64}), q, q), "num_heads", "num_heads_k");
}

TEST_F(FwdInputs, ShapeMismatches) {
  EXPECT_VALUE_ERROR(check(in.q, in.k, half({2, 8, 2, 64})), "k and v must have the same shape");
  EXPECT_VALUE_ERROR(check(in.q, half({3, 7, 2, 64}), half({3, 7, 2, 64})), "batch");
}

TEST_F(FwdInputs, ZeroSizeTensors) {
  // Zero sizes are valid (the implementations return the empty / zero result, no launch):
  // seqlen_q, batch, seqlen_k, heads (with kv heads), q heads alone.
  EXPECT_DOUBLE_EQ(check(half({2, 0, 4, 64}), in.k, in.v), 0.125);
  EXPECT_DOUBLE_EQ(check(half({0, 5, 4, 64}), half({0, 7, 2, 64}), half({0, 7, 2, 64})), 0.125);
  EXPECT_DOUBLE_EQ(check(in.q, half({2, 0, 2, 64}), half({2, 0, 2, 64})), 0.125);
  EXPECT_DOUBLE_EQ(check(half({2, 5, 0, 64}), half({2, 7, 0, 64}), half({2, 7, 0, 64})), 0.125);
  EXPECT_DOUBLE_EQ(check(half({2, 5, 0, 64}), in.k, in.v), 0.125);
  at::Tensor none = at::zeros({0}, at::kInt);
  EXPECT_DOUBLE_EQ(check(half({0, 5, 4, 64}), half({0, 7, 2, 64}), half({0, 7, 2, 64}), kNone,
                         none, none),
                   0.125);
  // ...but q heads need kv heads: a ValueError, never a division by zero.
  EXPECT_VALUE_ERROR(check(in.q, half({2, 7, 0, 64}), half({2, 7, 0, 64})),
                     "num_heads_k must be >= 1 when num_heads >= 1", "num_heads_k 0 and num_heads 4");
  EXPECT_VALUE_ERROR(check(half({0, 0, 4, 64}), half({0, 0, 0, 64}), half({0, 0, 0, 64})),
                     "num_heads_k must be >= 1");
  EXPECT_VALUE_ERROR(check(in.q, in.k, half({2, 7, 2, 64}).narrow(1, 0, 0)),
                     "k and v must have the same shape");
}

TEST_F(FwdInputs, LastDimNotContiguous) {
  at::Tensor q = half({2, 5, 4, 128}).slice(3, 0, 128, 2);  // stride(-1) == 2, head_dim 64
  ASSERT_EQ(q.size(3), 64);
  EXPECT_VALUE_ERROR(check(q, in.k, in.v), "q must have a contiguous last dimension",
                     "stride(-1) == 1");
  at::Tensor k = in.k.transpose(1, 3).contiguous().transpose(1, 3);  // last dim strided
  EXPECT_VALUE_ERROR(check(in.q, k, in.v), "k must have a contiguous last dimension");
  EXPECT_VALUE_ERROR(check(in.q, in.k, k), "v must have a contiguous last dimension");
}

TEST_F(FwdInputs, KeyBoundsDtypeShapeLayout) {
  for (const char* name : {"leftpad_k", "seqused_k"}) {
    const bool lp = std::string(name) == "leftpad_k";
    auto run = [&](const at::Tensor& t) {
      return lp ? check(in.q, in.k, in.v, kNone, t, kNone)
                : check(in.q, in.k, in.v, kNone, kNone, t);
    };
    SCOPED_TRACE(name);
    EXPECT_VALUE_ERROR(run(at::zeros({2}, at::kLong)), std::string(name) + " must be int32",
                       "Long");
    EXPECT_VALUE_ERROR(run(at::zeros({2}, at::kFloat)), std::string(name) + " must be int32");
    EXPECT_VALUE_ERROR(run(at::zeros({3}, at::kInt)), std::string(name) + " must have shape",
                       "(batch,) = (2,)");
    EXPECT_VALUE_ERROR(run(at::zeros({2, 1}, at::kInt)), std::string(name) + " must have shape");
    EXPECT_VALUE_ERROR(run(at::zeros({}, at::kInt)), std::string(name) + " must have shape");
    EXPECT_VALUE_ERROR(run(at::zeros({4}, at::kInt).slice(0, 0, 4, 2)),
                       std::string(name) + " must be contiguous");
    EXPECT_NO_THROW(run(at::zeros({2}, at::kInt)));
  }
}

TEST_F(FwdInputs, SoftmaxScale) {
  for (double s : {0.0, -0.125, -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN(),
                   // denormal in float32 (flushed to 0), or large enough that a score
                   // scale * log2(e) * q.k can overflow float32 for float16 inputs
                   1e-39, 1e-46, 2.2e26, 4.3e26, 1e30, 2.3e38, 2.4e38, 1e300}) {
    EXPECT_VALUE_ERROR(check(in.q, in.k, in.v, s), "softmax_scale must be a finite number > 0");
  }
  EXPECT_DOUBLE_EQ(check(in.q, in.k, in.v, 1e-6), 1e-6);
  EXPECT_DOUBLE_EQ(check(in.q, in.k, in.v, 1.2e-38), 1.2e-38);
  EXPECT_DOUBLE_EQ(check(in.q, in.k, in.v, 1.0e26), 1.0e26);
}

TEST_F(FwdInputs, BothImplementationsValidate) {
  // The CPU reference and the CUDA entry point run the same checks first.
  EXPECT_VALUE_ERROR(mha_fwd_cpu(in.q, in.k, in.v, -1.0, false, true, kNone, kNone),
                     "softmax_scale");
  EXPECT_VALUE_ERROR(mha_fwd(in.q.to(at::kFloat), in.k, in.v, kNone, false, true, kNone, kNone),
                     "q must be float16");
  // mha_fwd is the CUDA implementation: valid CPU tensors are rejected before any launch.
  EXPECT_VALUE_ERROR(mha_fwd(in.q, in.k, in.v, kNone, false, true, kNone, kNone),
                     "q must be a CUDA tensor", "cpu");
}

// env_choice (csrc/flash_api.cpp), the parser of the FLASH_SM75_* switches: unset or empty is
// the first (default) value, a listed value its index, anything else a ValueError naming the
// variable, every accepted value and the value given.
TEST(EnvChoice, DefaultIndexAndError) {
  constexpr const char* kName = "FLASH_SM75_TEST_ENV_CHOICE";
  ::unsetenv(kName);
  EXPECT_EQ(env_choice(kName, {"auto", "always", "never"}), 0);
  ::setenv(kName, "", 1);
  EXPECT_EQ(env_choice(kName, {"auto", "always", "never"}), 0);
  ::setenv(kName, "never", 1);
  EXPECT_EQ(env_choice(kName, {"auto", "always", "never"}), 2);
  ::setenv(kName, "always", 1);
  EXPECT_EQ(env_choice(kName, {"auto", "always", "never"}), 1);
  ::setenv(kName, "ALWAYS", 1);  // case-sensitive, no trimming
  EXPECT_VALUE_ERROR(env_choice(kName, {"auto", "always", "never"}),
                     "environment variable FLASH_SM75_TEST_ENV_CHOICE must be 'auto', 'always' or "
                     "'never' (or unset), got 'ALWAYS'");
  ::setenv(kName, "atomic ", 1);
  EXPECT_VALUE_ERROR(env_choice(kName, {"separate", "atomic"}),
                     "must be 'separate' or 'atomic' (or unset), got 'atomic '");
  ::unsetenv(kName);
}

// FLASH_SM75_DEVICE_PROFILE picks the GPU the launches are planned for: the device itself by
// default, a Turing profile by name (launch_plan.h), a clear error for anything else.
TEST(EnvChoice, DeviceProfile) {
  constexpr const char* kName = "FLASH_SM75_DEVICE_PROFILE";
  ::unsetenv(kName);
  EXPECT_EQ(planning_profile(), nullptr);
  ::setenv(kName, "native", 1);
  EXPECT_EQ(planning_profile(), nullptr);
  // Compared by name: the library and this test may each hold a copy of the profiles.
  auto name = [] { return std::string(planning_profile()->name); };
  ::setenv(kName, "t4", 1);
  ASSERT_NE(planning_profile(), nullptr);
  EXPECT_EQ(name(), "t4");
  EXPECT_EQ(planning_profile()->num_sms, 40);
  ::setenv(kName, "turing", 1);
  EXPECT_EQ(name(), "t4");
  ::setenv(kName, "rtx2080ti", 1);
  EXPECT_EQ(name(), "rtx2080ti");
  EXPECT_EQ(planning_profile()->num_sms, 68);
  ::setenv(kName, "T4", 1);
  EXPECT_VALUE_ERROR(planning_profile(),
                     "FLASH_SM75_DEVICE_PROFILE must be 'native', 't4', 'turing' or 'rtx2080ti' "
                     "(or unset), got 'T4'");
  ::unsetenv(kName);
}

}  // namespace
}  // namespace flash_sm75
