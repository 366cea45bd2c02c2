// The online softmax of the forward kernel (FlashAttention-2, Dao, arXiv:2307.08691), on the
// fp32 accumulator fragments of S = Q K^T of one warp's 16 query rows: each thread holds rows
// g = lane / 4 and g + 8, and per row the running max m_i (raw scores), the running sum l_i
// (this thread's part; summed over the quad at the end) and its part of the unnormalised O.
// Exponents are exp2 with scale * log2(e) folded in (scale_log2). Also the fp16 range clamp of
// the normalised output, shared with the decode kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "utils.h"

namespace flash_sm75 {

// Max of the running max m and row r (0: g, 1: g + 8) of the S fragments: this lane's
// elements, then over the quad (the lanes that hold the row).
template <int kBN>
__device__ __forceinline__ float row_max(const float (&acc_s)[kBN / 8][4], int r, float m) {
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
    m = fmaxf(m, fmaxf(acc_s[nt][2 * r], acc_s[nt][2 * r + 1]));
  }
  return quad_allreduce_max(m);
}

// Move one row's running max to mx (>= m_i): l_i is rescaled, the factor alpha for O returned,
// and scaled_max set to the shift of exp2 for P.
__device__ __forceinline__ float move_max(float mx, float& m_i, float& l_i, float scale_log2,
                                          float& scaled_max) {
  // A row that has seen no key yet keeps m = -inf; use 0 as the shift so that
  // exp2(-inf - shift) = 0 instead of exp2(-inf + inf) = NaN.
  scaled_max = (mx == -INFINITY) ? 0.f : __fmul_rn(mx, scale_log2);
  // Not an FFMA: with the product rounded as scaled_max is, alpha <= 1 for any magnitude.
  const float alpha = exp2f(__fmul_rn(m_i, scale_log2) - scaled_max);
  m_i = mx;
  l_i *= alpha;
  return alpha;
}

// O (rows g and g + 8) *= alpha. Unconditional per tile: skipping it when no max grew was
// measured slower on the H200 as a per-tile branch on alpha != 1 (benchmarks/NOTES.md).
template <int kD>
__device__ __forceinline__ void rescale_o(float (&acc_o)[kD / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) {
    acc_o[dt][0] *= alpha[0];
    acc_o[dt][1] *= alpha[0];
    acc_o[dt][2] *= alpha[1];
    acc_o[dt][3] *= alpha[1];
  }
}

// |S * scale_log2| from which P = exp2(S * scale_log2 - m) is computed from the rounded product
// (FMUL, FADD) instead of one FFMA: the FFMA subtracts the rounded m from the exact product, so
// the row max itself gets exp2(+-0.5 ulp), which is exp2(+-4096) at 2^36 (|q|, |k| ~ 10^4 at
// the default scale): inf or 0, then NaN. With both sides rounded alike P <= 1 exactly.
constexpr float kExactExpFrom = 16777216.f;  // 2^24: below it the FFMA's error is <= 0.5

// Whether a row max shifted by scaled_max (0 for a row without keys) needs the exact path,
// for any of the warp's rows (warp-uniform).
__device__ __forceinline__ bool warp_needs_exact_exp(const float (&scaled_max)[2]) {
  return warp_any(fabsf(scaled_max[0]) >= kExactExpFrom || fabsf(scaled_max[1]) >= kExactExpFrom);
}

// How exp_scores forms the exponent of a score x (c = scale_log2, sm = scaled_max = rn(m c)):
// kFfma: FFMA(x, c, -sm), exact enough while |sm| < kExactExpFrom; kExact: rn(x c) - sm (both
// sides rounded alike, P <= 1 at any magnitude); kResidual: FFMA(x, c, -sm) - res with
// res = FFMA(m, c, -sm) the exact rounding residual of the shift (softmax_step).
enum class ExpForm { kFfma, kExact, kResidual };

// P = exp2(exponent of S) for rows g, g + 8, summed into l_i and packed as the fp16 A fragments
// of O += P V. res is read only by ExpForm::kResidual.
template <int kBN, ExpForm kForm>
__device__ __forceinline__ void exp_scores(const float (&acc_s)[kBN / 8][4], float (&l_i)[2],
                                           const float (&scaled_max)[2], float scale_log2,
                                           uint32_t (&p_frag)[kBN / 8][2],
                                           const float (&res)[2]) {
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float sm = scaled_max[e >> 1];
      const float x = acc_s[nt][e];
      if constexpr (kForm == ExpForm::kExact) {
        p[e] = exp2f(__fmul_rn(x, scale_log2) - sm);
      } else if constexpr (kForm == ExpForm::kResidual) {
        p[e] = exp2f(fmaf(x, scale_log2, -sm) - res[e >> 1]);
      } else {
        p[e] = exp2f(fmaf(x, scale_log2, -sm));
      }
    }
    l_i[0] += p[0] + p[1];
    l_i[1] += p[2] + p[3];
    p_frag[nt][0] = pack_half2(p[0], p[1]);
    p_frag[nt][1] = pack_half2(p[2], p[3]);
  }
}

// Whether the row max mx of row g or g + 8 grew past the running max m_i by more than kThr
// log2 units for any row of the warp (warp-uniform). NaN (both -inf: no key seen yet) and +inf
// (first key) count as growth.
template <int kThr>
__device__ __forceinline__ bool warp_max_grew(const float (&mx)[2], const float (&m_i)[2],
                                              float scale_log2) {
  return warp_any(!((mx[0] - m_i[0]) * scale_log2 <= static_cast<float>(kThr)) ||
                  !((mx[1] - m_i[1]) * scale_log2 <= static_cast<float>(kThr)));
}

// The threshold online-softmax step once the warp has decided (warp-uniform `move`) whether its
// rows move their running max to mx (row maxima; and rescale l and O) or keep the stale max;
// then P.
template <int kBN, int kD>
__device__ __forceinline__ void softmax_move_or_keep(bool move, const float (&acc_s)[kBN / 8][4],
                                                     const float (&mx)[2], float (&m_i)[2],
                                                     float (&l_i)[2], float (&acc_o)[kD / 8][4],
                                                     float scale_log2,
                                                     uint32_t (&p_frag)[kBN / 8][2],
                                                     bool& exact_exp) {
  float scaled_max[2], alpha[2];
  if (move) {  // warp-uniform branch
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      alpha[r] = move_max(mx[r], m_i[r], l_i[r], scale_log2, scaled_max[r]);
    }
    rescale_o<kD>(acc_o, alpha);
    exact_exp = warp_needs_exact_exp(scaled_max);
  } else {
    scaled_max[0] = m_i[0] * scale_log2;  // finite; P <= 2^(kThr + 0.5) (FFMA rounding)
    scaled_max[1] = m_i[1] * scale_log2;
  }
  if (exact_exp) {  // warp-uniform
    exp_scores<kBN, ExpForm::kExact>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
  } else {
    exp_scores<kBN, ExpForm::kFfma>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
  }
}

// One online-softmax step on the accumulator fragments of S (rows g and g + 8 of the warp):
// update the running max m_i and sum l_i, rescale O by exp2(m_old - m_new), and pack
// P = exp2(S * scale_log2 - m) as the fp16 A fragments of O += P V.
// kThr > 0 (Flash_fwd_kernel_traits::kRescaleThreshold; the d = 128 default uses 8): keep the
// stale max and skip the rescale while no row of the warp grew by more than kThr in log2 units.
// exact_exp (the caller's, false before the first tile) says the warp's scaled max reached
// kExactExpFrom (never at ordinary magnitudes): the exponents then take the exact path, and at
// kThr > 0 every tile moves the max (the stale-max bound P <= 2^kThr does not survive the
// rounding at that magnitude). The max only moves in the branches that recompute the flag.
template <int kBN, int kD, int kThr = 0>
__device__ __forceinline__ void softmax_rescale(const float (&acc_s)[kBN / 8][4], float (&m_i)[2],
                                                float (&l_i)[2], float (&acc_o)[kD / 8][4],
                                                float scale_log2, uint32_t (&p_frag)[kBN / 8][2],
                                                bool& exact_exp) {
  if constexpr (kThr > 0) {
    const float mx[2] = {row_max<kBN>(acc_s, 0, m_i[0]), row_max<kBN>(acc_s, 1, m_i[1])};
    softmax_move_or_keep<kBN, kD>(warp_max_grew<kThr>(mx, m_i, scale_log2) || exact_exp, acc_s,
                                  mx, m_i, l_i, acc_o, scale_log2, p_frag, exact_exp);
  } else {
    float scaled_max[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      alpha[r] = move_max(row_max<kBN>(acc_s, r, m_i[r]), m_i[r], l_i[r], scale_log2,
                          scaled_max[r]);
    }
    rescale_o<kD>(acc_o, alpha);
    exact_exp = warp_needs_exact_exp(scaled_max);
    if (exact_exp) {  // warp-uniform
      exp_scores<kBN, ExpForm::kExact>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
    } else {
      exp_scores<kBN, ExpForm::kFfma>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
    }
  }
}

// The online-softmax step of the split tile (Flash_fwd_kernel_traits::kSplitTile) for the kBN
// scores of one half: as softmax_rescale with threshold kThr > 0, but without a branch, so that
// the caller's MMAs of the other half can be interleaved with it. The rescale of O is left to
// the caller: when this returns true (warp-uniform), O must be multiplied by alpha after the
// MMAs that still use the old max have accumulated (alpha = 1 otherwise; l_i is already
// rescaled).
// Exponents: x -> exp2(FFMA(x, scale_log2, -scaled_max) - res), res = m * scale_log2 -
// scaled_max (the rounding residual of the shift, exact by FFMA). The exponent of the max m is 0
// exactly, of any x <= m at most 0, and equals (x - m) * scale_log2 up to one rounding at any
// magnitude: unlike FFMA(x, c, -rn(m c)) it does not carry the shift's rounding error (~1 ulp
// of |m c|, a visible error from |m c| ~ 2^15), and unlike rn(x c) - rn(m c) no error of the
// product either. alpha = exp2 of the same form at x = m_old. exact_exp then only forces the
// max to move (as in softmax_rescale).
template <int kBN, int kThr>
__device__ __forceinline__ bool softmax_step(const float (&acc_s)[kBN / 8][4], float (&m_i)[2],
                                             float (&l_i)[2], float scale_log2,
                                             uint32_t (&p_frag)[kBN / 8][2], float (&alpha)[2],
                                             bool& exact_exp) {
  static_assert(kThr > 0, "the split tile keeps a stale max");
  const float mx[2] = {row_max<kBN>(acc_s, 0, m_i[0]), row_max<kBN>(acc_s, 1, m_i[1])};
  const bool move = warp_max_grew<kThr>(mx, m_i, scale_log2) || exact_exp;
  float scaled_max[2], res[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = move ? mx[r] : m_i[r];
    // A row without keys keeps m = -inf: shift 0, so that exp2(-inf) = 0 (not -inf + inf).
    scaled_max[r] = (m_new == -INFINITY) ? 0.f : __fmul_rn(m_new, scale_log2);
    res[r] = (m_new == -INFINITY) ? 0.f : fmaf(m_new, scale_log2, -scaled_max[r]);
    // 1 exactly when the max stays; 0 for a row that had no key.
    alpha[r] = exp2f(fmaf(m_i[r], scale_log2, -scaled_max[r]) - res[r]);
    m_i[r] = m_new;
    l_i[r] *= alpha[r];
  }
  exact_exp = warp_needs_exact_exp(scaled_max);  // unchanged when the max stays
  exp_scores<kBN, ExpForm::kResidual>(acc_s, l_i, scaled_max, scale_log2, p_frag, res);
  return move;
}

// The end of the online softmax for rows g, g + 8: l summed over the quad, O = acc_o / l in
// place and lse = m * scale + log(l) (natural log; scale = the softmax scale). A row that saw no
// key (l = 0) gets O = 0 and lse = -inf, never NaN. A NaN score makes l NaN: O and lse NaN, as
// in PyTorch (testing l > 0 instead would report such a row as empty, lse = -inf, and the
// backward would then skip it, hiding the NaN from the gradients).
template <int kD>
__device__ __forceinline__ void softmax_normalize(float (&acc_o)[kD / 8][4], const float (&m_i)[2],
                                                  const float (&l_i)[2], float scale,
                                                  float (&lse)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_allreduce_sum(l_i[r]);
    const bool any = l != 0.f;
    const float inv_l = any ? 1.f / l : 0.f;
    lse[r] = any ? m_i[r] * scale + logf(l) : -INFINITY;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      acc_o[dt][2 * r] *= inv_l;
      acc_o[dt][2 * r + 1] *= inv_l;
    }
  }
}

// x limited to the finite fp16 range (NaN kept). O is a convex combination of V rows, but P is
// rounded to fp16 for P V while l sums the fp32 P, so O can exceed max |v| by ~2^-11 relative:
// from |v| ~ 65504 that rounded to inf before the clamp.
__device__ __forceinline__ float clamp_to_fp16_range(float x) {
  return x > 65504.f ? 65504.f : (x < -65504.f ? -65504.f : x);
}

}  // namespace flash_sm75
