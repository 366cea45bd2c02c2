// Test helpers: a naive double-precision attention loop written straight from docs/CONTRACT.md
// (deliberately not reusing csrc/kernels/block_info.h), random fp16 inputs, and an assertion
// for the op's ValueError messages.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace flash_sm75_test {

struct AttnCase {
  int64_t b = 1, sq = 1, sk = 1, h = 1, hk = 1, d = 64;
  bool is_causal = false;
  bool bottom_right = true;
  std::optional<double> scale;           // nullopt: 1/sqrt(d)
  std::vector<int> leftpad;              // empty: no leftpad_k
  std::vector<int> seqused;              // empty: no seqused_k
  bool bhsd = false;                     // pass q/k/v as transpose(1, 2) views of BHSD storage
  uint64_t seed = 0;
};

struct AttnInputs {
  at::Tensor q, k, v;
  std::optional<at::Tensor> leftpad_k, seqused_k;
};

// fp16 inputs on `device`, values ~N(0, 1) so softmax rows are neither flat nor one-hot.
inline AttnInputs make_inputs(const AttnCase& c, at::Device device = at::kCPU) {
  at::manual_seed(c.seed);
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto make = [&](int64_t s, int64_t heads) {
    at::Tensor t;
    if (c.bhsd) {
      t = at::randn({c.b, heads, s, c.d}, opts).to(at::kHalf).to(device).transpose(1, 2);
    } else {
      t = at::randn({c.b, s, heads, c.d}, opts).to(at::kHalf).to(device);
    }
    return t;
  };
  AttnInputs in;
  in.q = make(c.sq, c.h);
  in.k = make(c.sk, c.hk);
  in.v = make(c.sk, c.hk);
  auto int_opts = at::TensorOptions().dtype(at::kInt);
  if (!c.leftpad.empty()) {
    in.leftpad_k = at::tensor(c.leftpad, int_opts).to(device);
  }
  if (!c.seqused.empty()) {
    in.seqused_k = at::tensor(c.seqused, int_opts).to(device);
  }
  return in;
}

// Naive reference in double precision. Returns out (b, sq, h, d) and lse (b, h, sq), both float64.
// Key j is visible to query i in batch bi iff leftpad[bi] <= j < seqused[bi] (clamped to
// [0, sk]) and, if causal, j <= i + off with off = sk - sq (bottom-right) or 0 (top-left). Rows
// that see no key: out = 0, lse = -inf.
inline std::tuple<at::Tensor, at::Tensor> naive_attention(const at::Tensor& q_in,
                                                          const at::Tensor& k_in,
                                                          const at::Tensor& v_in,
                                                          const AttnCase& c) {
  at::Tensor q = q_in.to(at::kCPU).to(at::kDouble).contiguous();
  at::Tensor k = k_in.to(at::kCPU).to(at::kDouble).contiguous();
  at::Tensor v = v_in.to(at::kCPU).to(at::kDouble).contiguous();
  const int64_t b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t sk = k.size(1), hk = k.size(2);
  const double scale = c.scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t off = c.bottom_right ? sk - sq : 0;
  at::Tensor out = at::zeros({b, sq, h, d}, at::kDouble);
  at::Tensor lse = at::empty({b, h, sq}, at::kDouble);
  auto qa = q.accessor<double, 4>();
  auto ka = k.accessor<double, 4>();
  auto va = v.accessor<double, 4>();
  auto oa = out.accessor<double, 4>();
  auto la = lse.accessor<double, 3>();
  std::vector<double> s(static_cast<size_t>(sk));
  for (int64_t bi = 0; bi < b; ++bi) {
    const int64_t lo = c.leftpad.empty() ? 0 : c.leftpad[bi];
    const int64_t hi = c.seqused.empty() ? sk : c.seqused[bi];
    for (int64_t hi_q = 0; hi_q < h; ++hi_q) {
      const int64_t kvh = hi_q / (h / hk);
      for (int64_t i = 0; i < sq; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < sk; ++j) {
          const bool vis = j >= lo && j < hi && (!c.is_causal || j <= i + off);
          if (!vis) {
            s[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double dot = 0.0;
          for (int64_t x = 0; x < d; ++x) dot += qa[bi][i][hi_q][x] * ka[bi][j][kvh][x];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) {
          la[bi][hi_q][i] = mx;  // no visible key; out row stays 0
          continue;
        }
        double sum = 0.0;
        for (int64_t j = 0; j < sk; ++j) {
          if (s[j] == -std::numeric_limits<double>::infinity()) continue;
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        la[bi][hi_q][i] = mx + std::log(sum);
        for (int64_t j = 0; j < sk; ++j) {
          if (s[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = s[j] / sum;
          for (int64_t x = 0; x < d; ++x) oa[bi][i][hi_q][x] += p * va[bi][j][kvh][x];
        }
      }
    }
  }
  return {out, lse};
}

// Every element within atol + rtol * |ref|, no NaN, and rows with lse == -inf exactly 0 / -inf.
inline void expect_matches_reference(const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& ref_out, const at::Tensor& ref_lse,
                                     double out_atol, double out_rtol, double lse_atol) {
  ASSERT_EQ(out.sizes(), ref_out.sizes());
  ASSERT_EQ(lse.sizes(), ref_lse.sizes());
  at::Tensor o = out.to(at::kCPU).to(at::kDouble);
  at::Tensor l = lse.to(at::kCPU).to(at::kDouble);
  ASSERT_FALSE(o.isnan().any().item<bool>()) << "NaN in out";
  ASSERT_FALSE(l.isnan().any().item<bool>()) << "NaN in softmax_lse";
  ASSERT_FALSE(o.isinf().any().item<bool>()) << "inf in out";

  // Rows that see no key: lse must be exactly -inf and the output row exactly 0.
  at::Tensor empty_rows = ref_lse.isneginf();                       // (b, h, sq)
  EXPECT_TRUE(at::equal(l.isneginf(), empty_rows)) << "softmax_lse -inf pattern differs";
  at::Tensor empty_bshd = empty_rows.transpose(1, 2).unsqueeze(-1).expand_as(o);
  EXPECT_EQ(o.masked_select(empty_bshd).abs().sum().item<double>(), 0.0)
      << "rows that see no key must be exactly 0";

  const double max_out_err = (o - ref_out).abs().max().item<double>();
  const double mean_out_err = (o - ref_out).abs().mean().item<double>();
  at::Tensor finite = empty_rows.logical_not();
  const double max_lse_err =
      finite.any().item<bool>()
          ? (l.masked_select(finite) - ref_lse.masked_select(finite)).abs().max().item<double>()
          : 0.0;
  std::cout << "    max|out-ref| = " << max_out_err << ", mean|out-ref| = " << mean_out_err
            << ", max|lse-ref| = " << max_lse_err << "\n";
  at::Tensor bad = (o - ref_out).abs() > (out_atol + out_rtol * ref_out.abs());
  const int64_t n_bad = bad.sum().item<int64_t>();
  EXPECT_EQ(n_bad, 0) << n_bad << " of " << o.numel() << " output elements outside atol "
                      << out_atol << " + rtol " << out_rtol << " (max err " << max_out_err << ")";
  EXPECT_LE(max_lse_err, lse_atol);
}

// Runs `stmt`, expects c10::ValueError whose message starts with "flash_attention_sm75:" and
// contains every string in `needles` (the argument's name and what was wrong).
#define EXPECT_VALUE_ERROR(stmt, ...)                                                        \
  do {                                                                                       \
    bool thrown_ = false;                                                                    \
    try {                                                                                    \
      (void)(stmt);                                                                          \
    } catch (const c10::ValueError& e_) {                                                    \
      thrown_ = true;                                                                        \
      const std::string msg_ = e_.what_without_backtrace();                                  \
      EXPECT_EQ(msg_.rfind("flash_attention_sm75:", 0), 0u) << "message: " << msg_;         \
      for (const std::string& needle_ : std::vector<std::string>{__VA_ARGS__}) {             \
        EXPECT_NE(msg_.find(needle_), std::string::npos)                                     \
            << "message lacks '" << needle_ << "': " << msg_;                                \
      }                                                                                      \
    } catch (const std::exception& e_) {                                                     \
      ADD_FAILURE() << "expected c10::ValueError, got another exception: " << e_.what();     \
      thrown_ = true;                                                                        \
    }                                                                                        \
    EXPECT_TRUE(thrown_) << "expected c10::ValueError from " #stmt;                          \
  } while (0)

}  // namespace flash_sm75_test
