// set_params_fprop (csrc/flash_api.cpp): Flash_fwd_params filled from strided BSHD/BHSD inputs.
// Host-only: the tensors live on the CPU, nothing is launched.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include "flash_api.h"

namespace flash_sm75 {
namespace {

TEST(FwdParams, BshdContiguous) {
  const int64_t b = 2, sq = 5, sk = 9, h = 6, hk = 2, d = 64;
  at::Tensor q = at::zeros({b, sq, h, d}, at::kHalf);
  at::Tensor k = at::zeros({b, sk, hk, d}, at::kHalf);
  at::Tensor v = at::zeros({b, sk, hk, d}, at::kHalf);
  at::Tensor out = at::empty({b, sq, h, d}, at::kHalf);
  at::Tensor lse = at::empty({b, h, sq}, at::kFloat);
  at::Tensor lp = at::zeros({b}, at::kInt), su = at::full({b}, sk, at::kInt);
  Flash_fwd_params p;
  set_params_fprop(p, q, k, v, out, lse, 0.125, /*is_causal=*/true, /*bottom_right=*/true, lp,
                   su);
  EXPECT_EQ(p.q_ptr, q.data_ptr());
  EXPECT_EQ(p.k_ptr, k.data_ptr());
  EXPECT_EQ(p.v_ptr, v.data_ptr());
  EXPECT_EQ(p.o_ptr, out.data_ptr());
  EXPECT_EQ(p.softmax_lse_ptr, lse.data_ptr<float>());
  EXPECT_EQ(p.leftpad_k, lp.data_ptr<int>());
  EXPECT_EQ(p.seqused_k, su.data_ptr<int>());
  EXPECT_EQ(p.q_batch_stride, sq * h * d);
  EXPECT_EQ(p.q_row_stride, h * d);
  EXPECT_EQ(p.q_head_stride, d);
  EXPECT_EQ(p.k_batch_stride, sk * hk * d);
  EXPECT_EQ(p.k_row_stride, hk * d);
  EXPECT_EQ(p.k_head_stride, d);
  EXPECT_EQ(p.v_row_stride, hk * d);
  EXPECT_EQ(p.o_batch_stride, sq * h * d);
  EXPECT_EQ(p.o_row_stride, h * d);
  EXPECT_EQ(p.o_head_stride, d);
  EXPECT_EQ(p.b, b);
  EXPECT_EQ(p.seqlen_q, sq);
  EXPECT_EQ(p.seqlen_k, sk);
  EXPECT_EQ(p.h, h);
  EXPECT_EQ(p.h_k, hk);
  EXPECT_EQ(p.h_h_k_ratio, 3);
  EXPECT_EQ(p.d, d);
  EXPECT_FLOAT_EQ(p.scale_softmax, 0.125f);
  EXPECT_FLOAT_EQ(p.scale_softmax_log2, static_cast<float>(0.125 / std::log(2.0)));
  EXPECT_TRUE(p.is_causal);
  EXPECT_EQ(p.causal_offset, sk - sq);
}

TEST(FwdParams, BhsdViewsAndSlices) {
  // BHSD storage passed as transpose(1, 2): the strides say where everything is.
  const int64_t b = 3, sq = 7, sk = 11, h = 4, hk = 4, d = 128;
  at::Tensor q = at::zeros({b, h, sq, d}, at::kHalf).transpose(1, 2);
  // k and v: slices of a packed (b, sk, 2, hk, d) KV buffer.
  at::Tensor kv = at::zeros({b, sk, 2, hk, d}, at::kHalf);
  at::Tensor k = kv.select(2, 0), v = kv.select(2, 1);
  at::Tensor out = at::empty({b, sq, h, d}, at::kHalf);
  at::Tensor lse = at::empty({b, h, sq}, at::kFloat);
  Flash_fwd_params p;
  set_params_fprop(p, q, k, v, out, lse, 0.5, /*is_causal=*/true, /*bottom_right=*/false,
                   std::nullopt, std::nullopt);
  EXPECT_EQ(p.q_batch_stride, h * sq * d);
  EXPECT_EQ(p.q_row_stride, d);
  EXPECT_EQ(p.q_head_stride, sq * d);
  EXPECT_EQ(p.k_batch_stride, sk * 2 * hk * d);
  EXPECT_EQ(p.k_row_stride, 2 * hk * d);
  EXPECT_EQ(p.k_head_stride, d);
  EXPECT_EQ(p.v_row_stride, 2 * hk * d);
  EXPECT_EQ(static_cast<const char*>(p.v_ptr) - static_cast<const char*>(p.k_ptr),
            hk * d * 2);  // v starts one (hk, d) block of fp16 after k
  EXPECT_EQ(p.leftpad_k, nullptr);
  EXPECT_EQ(p.seqused_k, nullptr);
  EXPECT_EQ(p.h_h_k_ratio, 1);
  EXPECT_EQ(p.causal_offset, 0);  // top-left
  // Decode shape (seqlen_q = 1), non-causal: the offset is still filled in.
  at::Tensor q1 = at::zeros({1, 1, h, d}, at::kHalf);
  set_params_fprop(p, q1, k.narrow(0, 0, 1), v.narrow(0, 0, 1), out.narrow(0, 0, 1).narrow(1, 0, 1),
                   lse.narrow(0, 0, 1).narrow(2, 0, 1), 0.5, false, true, std::nullopt,
                   std::nullopt);
  EXPECT_EQ(p.seqlen_q, 1);
  EXPECT_FALSE(p.is_causal);
  EXPECT_EQ(p.causal_offset, sk - 1);
}

// fwd_variant (kernels/flash.h): which forward family runs a call. The bias-only kernel takes a
// bool or fp16 bias and nothing else of the extended features, the dropout-only kernel dropout
// and nothing else; any other of them, or another bias kind, runs the extended kernel.
TEST(FwdParams, FwdVariant) {
  at::Tensor q = at::zeros({1, 70, 2, 64}, at::kHalf), k = at::zeros({1, 90, 2, 64}, at::kHalf);
  at::Tensor out = at::empty_like(q), lse = at::empty({1, 2, 70}, at::kFloat);
  at::Tensor lp = at::zeros({1}, at::kInt), su = at::full({1}, 90, at::kInt);
  auto base = [&](bool causal) {
    Flash_fwd_params p;
    set_params_fprop(p, q, k, k, out, lse, 0.125, causal, /*bottom_right=*/true, lp, su);
    return p;
  };
  unsigned char dummy = 0;
  for (bool causal : {false, true}) {
    Flash_fwd_params p = base(causal);
    EXPECT_EQ(fwd_variant(p), kFwdPlain);
    p.bias_ptr = &dummy;
    for (int kind : {kBiasBool, kBiasHalf, kBiasBf16, kBiasFloat}) {
      p.bias_kind = kind;
      EXPECT_EQ(fwd_variant(p), kind == kBiasBool || kind == kBiasHalf ? kFwdBias : kFwdExt)
          << kind;
    }
    p.bias_kind = kBiasHalf;
    const int cu[2] = {0, 70};
    const float slopes[2] = {0.5f, 0.25f};
    const int table[2] = {0, 1};
    // Each other extended feature beside a narrow family's one (the bias; dropout): the
    // extended kernel. A lower window diagonal (the local kernels) is only banded when causal.
    auto expect_ext_beside = [&](const Flash_fwd_params& narrow, FwdVariant family,
                                 const char* what) {
      auto with = [&](auto set) {
        Flash_fwd_params r = narrow;
        set(r);
        return fwd_variant(r);
      };
      EXPECT_EQ(fwd_variant(narrow), family) << what;
      EXPECT_EQ(with([](Flash_fwd_params& r) { r.softcap_in = 0.1f; }), kFwdExt) << what;
      EXPECT_EQ(with([&](Flash_fwd_params& r) { r.alibi_slopes_ptr = slopes; }), kFwdExt) << what;
      EXPECT_EQ(with([&](Flash_fwd_params& r) { r.cu_seqlens_q = cu; }), kFwdExt) << what;
      EXPECT_EQ(with([&](Flash_fwd_params& r) { r.cu_seqlens_k = cu; }), kFwdExt) << what;
      EXPECT_EQ(with([](Flash_fwd_params& r) { r.per_seq_offset = true; }), kFwdExt) << what;
      EXPECT_EQ(with([&](Flash_fwd_params& r) { r.block_table = table; }), kFwdExt) << what;
      EXPECT_EQ(with([](Flash_fwd_params& r) { r.num_splits = 2; }), kFwdExt) << what;
      EXPECT_EQ(with([](Flash_fwd_params& r) { r.window_lower = -5; }),
                causal ? kFwdExt : family)
          << what;
    };
    expect_ext_beside(p, kFwdBias, "bias");
    // Dropout alone: the dropout-only kernel; with a bias of any kind the extended one.
    Flash_fwd_params dr = base(causal);
    dr.dropout = 1;
    expect_ext_beside(dr, kFwdDropout, "dropout");
    for (int kind : {kBiasBool, kBiasHalf, kBiasBf16, kBiasFloat}) {
      Flash_fwd_params r = dr;
      r.bias_ptr = &dummy;
      r.bias_kind = kind;
      EXPECT_EQ(fwd_variant(r), kFwdExt) << kind;
    }
    // Without either, the features alone are extended as before.
    Flash_fwd_params n = base(causal);
    n.softcap_in = 0.1f;
    EXPECT_EQ(fwd_variant(n), kFwdExt);
  }
}

}  // namespace
}  // namespace flash_sm75
