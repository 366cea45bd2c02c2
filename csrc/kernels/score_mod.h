// Score modifiers applied to S = Q K^T before masking and the softmax: flash-attn's logit
// soft-capping (Gemma 2) and ALiBi (BLOOM, MPT). With s = softmax_scale * q.k:
//   softcap > 0:   s -> softcap * tanh(s / softcap)
//   alibi_slopes:  s -> s - slope[b, h] * |i + alibi_offset - j|   (after the softcap)
// and the softmax, LSE and backward then see the modified s. Only the extended instantiations
// (Is_ext) contain this code; the others compile exactly as without it.
//
// The kernels keep S in raw units (q.k, the scale folded into exp2 later), so the modifiers are
// applied in raw units too: x -> (softcap / scale) * tanh(x * scale / softcap) and
// x -> x - (slope / scale) * |distance|; multiplied by the scale they are the formulas above.
//
// tanh(y), y = x * scale / softcap: 1 - r with r = 2 / (exp(2 y) + 1) (one ex2, one fast
// reciprocal; exact to ~1 ulp of 1 and free of cancellation in 1 - tanh^2 = r (2 - r)), and
// y (1 - y^2 / 3) below |y| = 2^-6, where 1 - r would lose t's relative precision (a large
// softcap). The relative error of the capped score stays ~1e-6 (tanh.approx.f32's 2^-11 would
// be ~0.02 in a capped logit of 50).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>

#include "flash.h"
#include "utils.h"

namespace flash_sm75 {

// Per (batch, head) constants of the modifiers. cap_in = 0: no softcap; slope = 0: no ALiBi.
// The bias's strides, kind and scale stay in the kernel parameters (constant memory, free as
// operands); only the (batch, head) offset is kept.
struct ScoreMod {
  float cap_in;   // scale / softcap: y = cap_in * x
  float cap_out;  // softcap / scale
  float slope;    // -alibi_slope / scale: raw-score change per key of distance
  int offset;     // ALiBi's diagonal: query i is at distance |i + offset - j| from key j
  int64_t bias_off;  // elements from bias_ptr to bias[b, h, 0, 0]
};


// A value b of the bias in raw-score units (b / scale). A finite bias whose raw value is too
// large for the exponents' arithmetic (a dtype-minimum padding mask: fp32's -3.4e38 / scale
// overflows, and raw * scale * log2(e) must stay finite too) is clamped to +-bias_raw_max:
// torch's softmax of finite scores is finite, and a row of only such keys averages them as
// torch does, where -inf would give an empty row (or inf - inf = NaN). -inf, +inf and NaN pass
// through as in torch.
// An fp16 bias never reaches the clamp (65504 * bias_scale <= bias_raw_max at every scale a
// bias is accepted with: check_attn_bias, kBiasScaleMin), so its values are only scaled: two
// instructions per score fewer on the bias paths' hottest kind.
template <int Kind>
__device__ __forceinline__ float bias_to_raw(const Flash_fwd_params& p, float b) {
  const float v = b * p.bias_scale;
  if constexpr (Kind == kBiasHalf) return v;
  return (fabsf(v) > p.bias_raw_max && fabsf(b) != INFINITY) ? copysignf(p.bias_raw_max, v) : v;
}

// Element `off` of the bias in raw-score units: a bool mask gives 0 (attend) or -inf.
template <int Kind>
__device__ __forceinline__ float bias_raw(const Flash_fwd_params& p, int64_t off) {
  if constexpr (Kind == kBiasBool) {
    return static_cast<const unsigned char*>(p.bias_ptr)[off] ? 0.f : -INFINITY;
  } else {
    float b;
    if constexpr (Kind == kBiasHalf) {
      b = __half2float(static_cast<const __half*>(p.bias_ptr)[off]);
    } else if constexpr (Kind == kBiasBf16) {
      b = __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p.bias_ptr)[off]) << 16);
    } else {
      b = static_cast<const float*>(p.bias_ptr)[off];
    }
    return bias_to_raw<Kind>(p, b);
  }
}

// Two adjacent elements off, off + 1 (off even, params.bias_pairs: 2-element aligned), raw
// units: one 2-, 4- or 8-byte load.
template <int Kind>
__device__ __forceinline__ float2 bias_raw2(const Flash_fwd_params& p, int64_t off) {
  if constexpr (Kind == kBiasBool) {
    const uint16_t w = *reinterpret_cast<const uint16_t*>(
        static_cast<const unsigned char*>(p.bias_ptr) + off);
    return make_float2((w & 0xffu) ? 0.f : -INFINITY, (w >> 8) ? 0.f : -INFINITY);
  } else if constexpr (Kind == kBiasHalf) {
    const __half2 h = *reinterpret_cast<const __half2*>(static_cast<const __half*>(p.bias_ptr) + off);
    const float2 f = __half22float2(h);
    return make_float2(bias_to_raw<Kind>(p, f.x), bias_to_raw<Kind>(p, f.y));
  } else if constexpr (Kind == kBiasBf16) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(
        static_cast<const uint16_t*>(p.bias_ptr) + off);
    return make_float2(bias_to_raw<Kind>(p, __uint_as_float(w << 16)),
                       bias_to_raw<Kind>(p, __uint_as_float(w & 0xffff0000u)));
  } else {
    const float2 f = *reinterpret_cast<const float2*>(static_cast<const float*>(p.bias_ptr) + off);
    return make_float2(bias_to_raw<Kind>(p, f.x), bias_to_raw<Kind>(p, f.y));
  }
}

// Calls f(std::integral_constant<int, kind>) for the call's bias kind (a uniform branch once per
// tile; the loop inside is then free of it). Nothing without a bias, or for a kind outside
// Kinds (flash.h bias_kind_bit; the host never launches such a call on that kernel).
template <int Kinds = kAllBiasKinds, typename F>
__device__ __forceinline__ void with_bias_kind(const Flash_fwd_params& p, F&& f) {
  switch (p.bias_kind) {
    case kBiasBool:
      if constexpr ((Kinds & bias_kind_bit(kBiasBool)) != 0) f(std::integral_constant<int, kBiasBool>{});
      break;
    case kBiasHalf:
      if constexpr ((Kinds & bias_kind_bit(kBiasHalf)) != 0) f(std::integral_constant<int, kBiasHalf>{});
      break;
    case kBiasBf16:
      if constexpr ((Kinds & bias_kind_bit(kBiasBf16)) != 0) f(std::integral_constant<int, kBiasBf16>{});
      break;
    case kBiasFloat:
      if constexpr ((Kinds & bias_kind_bit(kBiasFloat)) != 0) f(std::integral_constant<int, kBiasFloat>{});
      break;
    default: break;
  }
}

// Elements from bias_ptr to bias[b, h, 0, 0].
__device__ __forceinline__ int64_t bias_offset(const Flash_fwd_params& p, int bidb, int bidh) {
  return static_cast<int64_t>(bidb) * p.bias_batch_stride +
         static_cast<int64_t>(bidh) * p.bias_head_stride;
}

// alibi_offset: the entry's ALiBi diagonal (SeqInfo::alibi_off: params.alibi_offset, or per
// sequence relative to its bottom-right corner).
__device__ __forceinline__ ScoreMod score_mod_for(const Flash_fwd_params& p, int bidb, int bidh,
                                                  int alibi_offset) {
  ScoreMod m;
  m.cap_in = p.softcap_in;
  m.cap_out = p.softcap_out;
  m.slope = p.alibi_slopes_ptr == nullptr
                ? 0.f
                : -__ldg(p.alibi_slopes_ptr + bidb * p.alibi_slopes_batch_stride + bidh) /
                      p.scale_softmax;
  m.offset = alibi_offset;
  m.bias_off = bias_offset(p, bidb, bidh);
  return m;
}

constexpr float kTwoLog2e = 2.8853900817779268f;  // 2 log2(e): exp(2 y) = exp2(kTwoLog2e y)

// cap_out * tanh(cap_in * x); with Grad, *g = 1 - tanh^2 (the derivative over cap_in * cap_out
// = 1). exp2 -> inf gives tanh = 1, -> 0 gives -1; a NaN score stays NaN.
template <bool Grad>
__device__ __forceinline__ float softcap_score(float x, float cap_in, float cap_out, float* g) {
  const float y = x * cap_in;
  const float r = __fdividef(2.f, exp2f(y * kTwoLog2e) + 1.f);
  const bool small = fabsf(y) < 0.015625f;
  const float t = small ? y * fmaf(y * y, -0.333333343f, 1.f) : 1.f - r;
  if constexpr (Grad) *g = small ? fmaf(-t, t, 1.f) : r * (2.f - r);
  return cap_out * t;
}

// softcap_score over one warp's accumulator fragments (any layout), in place.
template <int kBN>
__device__ __forceinline__ void softcap_scores(float (&acc_s)[kBN / 8][4], const ScoreMod& m) {
  if (m.cap_in == 0.f) return;  // uniform: once per fragment, not per element
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc_s[nt][e] = softcap_score<false>(acc_s[nt][e], m.cap_in, m.cap_out, nullptr);
    }
  }
}

// Scalar bias reads, gathered: the raw bits of kN elements (element i at row / column
// coord(i), a pair of ints) loaded first, all of them, then converted and added (bias_add_raw).
// Read and added element by element, ptxas chained the loads, one memory latency per element:
// the dK/dV kernel's reads (16 per lane and tile at d = 64) took it to 3.5x its time without a
// bias. Bits zero-extended; an element outside the bias (`inside` false and coord past seqlen_q
// / seqlen_k) gets the bits that add 0 (a bool's true): what lies past the ends is masked or
// never stored, and must not turn into -inf + inf there.
template <int Kind, int kN, typename Coord>
__device__ __forceinline__ void bias_gather(uint32_t (&w)[kN], const Flash_fwd_params& p,
                                            int64_t bias_off, bool inside, Coord coord) {
  using Elem = std::conditional_t<Kind == kBiasBool, unsigned char,
                                  std::conditional_t<Kind == kBiasFloat, uint32_t, uint16_t>>;
  const Elem* base = static_cast<const Elem*>(p.bias_ptr) + bias_off;
  // Offsets within the (batch, head) slice in 32 bits (the host checks its extent).
  const int rs = static_cast<int>(p.bias_row_stride);
  const int cs = static_cast<int>(p.bias_col_stride);
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int2 rc = coord(i);
    const bool ok = inside || (rc.x < p.seqlen_q && rc.y < p.seqlen_k);
    w[i] = ok ? static_cast<uint32_t>(base[rc.x * rs + rc.y * cs]) : (Kind == kBiasBool ? 1u : 0u);
  }
}

template <int Kind, int kN>
__device__ __forceinline__ void bias_add_raw(float* acc, const uint32_t (&w)[kN],
                                             const Flash_fwd_params& p) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float r;
    if constexpr (Kind == kBiasBool) {
      r = w[i] ? 0.f : -INFINITY;  // added, as bias_raw: a NaN score stays NaN
    } else if constexpr (Kind == kBiasHalf) {
      r = bias_to_raw<Kind>(p, __half2float(__ushort_as_half(static_cast<unsigned short>(w[i]))));
    } else if constexpr (Kind == kBiasBf16) {
      r = bias_to_raw<Kind>(p, __uint_as_float(w[i] << 16));
    } else {
      r = bias_to_raw<Kind>(p, __uint_as_float(w[i]));
    }
    acc[i] += r;
  }
}

// A fragment's worth of scalar bias reads (bias_gather, bias_add_raw) in chunks of kChunk
// elements (acc viewed flat: element i is acc[i / 4][i % 4]): one exposed latency per chunk;
// the chunk bounds the registers the raw bits hold at once.
template <int Kind, int kN, int kChunk, typename Coord>
__device__ __forceinline__ void bias_add_gathered(float (&acc)[kN / 4][4],
                                                  const Flash_fwd_params& p, int64_t bias_off,
                                                  bool inside, Coord coord) {
  static_assert(kN % kChunk == 0 && kChunk % 4 == 0, "whole fragments per chunk");
  // Two copies of the loop, so that the common case (`inside`) has no per-element bounds.
  auto run = [&](auto in) {
#pragma unroll
    for (int c = 0; c < kN; c += kChunk) {
      uint32_t w[kChunk];
      bias_gather<Kind, kChunk>(w, p, bias_off, decltype(in)::value,
                                [&](int i) { return coord(c + i); });
      bias_add_raw<Kind, kChunk>(&acc[c / 4][0], w, p);
    }
  };
  if (inside) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

// The attention bias over one warp's m16 x kBN fragments in the forward's layout (rows row_w +
// lane / 4 (+ 8), keys col0 + 8 nt + 2 (lane % 4) (+ 1)); elements past seqlen_q / seqlen_k
// are not read (they are masked or never stored).
template <int kBN, bool Fast = true, int kGather = 8, int Kinds = kAllBiasKinds>
__device__ __forceinline__ void bias_scores(float (&acc_s)[kBN / 8][4], const Flash_fwd_params& p,
                                            const ScoreMod& m, int row_w, int col0) {
  const int lane = threadIdx.x % 32;
  const int r0 = row_w + lane / 4, c0 = col0 + 2 * (lane % 4);
  // Offsets within the (batch, head) slice in 32 bits (the host checks its extent).
  const int rs = static_cast<int>(p.bias_row_stride);
  // The warp's 16 x kBN block inside the bias (warp-uniform): no per-element bounds; with
  // column pairs contiguous and aligned (bias_pairs), one load per pair.
  const bool inside = Fast && row_w + 16 <= p.seqlen_q && col0 + kBN <= p.seqlen_k;
  with_bias_kind<Kinds>(p, [&](auto kind) {
    constexpr int K = decltype(kind)::value;
    if (Fast && inside && p.bias_pairs) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row_off = m.bias_off + (r0 + 8 * half) * rs + c0;
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
          const float2 b = bias_raw2<K>(p, row_off + 8 * nt);
          acc_s[nt][2 * half] += b.x;
          acc_s[nt][2 * half + 1] += b.y;
        }
      }
    } else if constexpr (kGather > 0) {
      // kGather elements in flight at once: the forward's split tile and the dQ kernel have
      // few registers to spare.
      bias_add_gathered<K, kBN / 2, kGather>(acc_s, p, m.bias_off, inside, [&](int i) {
        return make_int2(r0 + ((i & 3) >= 2 ? 8 : 0), c0 + 8 * (i / 4) + (i & 1));
      });
    } else {
      // One element at a time (one latency each): where even 4 in flight spilled.
      const int cs = static_cast<int>(p.bias_col_stride);
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = r0 + (e >= 2 ? 8 : 0), c = c0 + 8 * nt + (e & 1);
          if (inside || (r < p.seqlen_q && c < p.seqlen_k)) {
            acc_s[nt][e] += bias_raw<K>(p, m.bias_off + (r * rs + c * cs));
          }
        }
      }
    }
  });
}

// The bias of a warp's 16 x kCols block, loaded ahead (before the S = Q K^T that it is added
// to, so the loads' latency hides behind the MMAs): the raw 16-bit pairs of rows g and g + 8,
// for 1- and 2-byte kinds whose column pairs are contiguous (bias_pairs) and a block inside the
// bias; `ok` false: bias_apply reads the bias itself (bias_scores).
template <int kCols>
struct BiasPrefetch {
  uint32_t w[kCols / 8][2];
  bool ok;
};

template <int kCols, int Kinds = kAllBiasKinds>
__device__ __forceinline__ void bias_prefetch(BiasPrefetch<kCols>& pf, const Flash_fwd_params& p,
                                              const ScoreMod& m, int row_w, int col0) {
  // The 1- and 2-byte kinds of Kinds (the same three compares as before the kind sets where
  // all are compiled: the extended kernels' schedules stay as measured).
  const bool kind_ok =
      ((Kinds & bias_kind_bit(kBiasBool)) != 0 && p.bias_kind == kBiasBool) ||
      ((Kinds & bias_kind_bit(kBiasHalf)) != 0 && p.bias_kind == kBiasHalf) ||
      ((Kinds & bias_kind_bit(kBiasBf16)) != 0 && p.bias_kind == kBiasBf16);
  pf.ok = p.bias_pairs && kind_ok &&
          row_w + 16 <= p.seqlen_q && col0 + kCols <= p.seqlen_k;
  if (!pf.ok) return;  // warp-uniform
  const int lane = threadIdx.x % 32;
  const int rs = static_cast<int>(p.bias_row_stride);
  const int64_t off0 = m.bias_off + (row_w + lane / 4) * rs + col0 + 2 * (lane % 4);
  if ((Kinds & bias_kind_bit(kBiasBool)) != 0 && p.bias_kind == kBiasBool) {
    const unsigned char* b = static_cast<const unsigned char*>(p.bias_ptr) + off0;
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        pf.w[nt][half] = *reinterpret_cast<const uint16_t*>(b + 8 * half * rs + 8 * nt);
      }
    }
  } else {
    const uint16_t* b = static_cast<const uint16_t*>(p.bias_ptr) + off0;
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        pf.w[nt][half] = *reinterpret_cast<const uint32_t*>(b + 8 * half * rs + 8 * nt);
      }
    }
  }
}

// Adds a prefetched block (bias_prefetch) to the scores, or reads it (bias_scores).
template <int kCols, bool Fast, int kGather = 8, int Kinds = kAllBiasKinds>
__device__ __forceinline__ void bias_apply(float (&acc_s)[kCols / 8][4],
                                           const BiasPrefetch<kCols>& pf,
                                           const Flash_fwd_params& p, const ScoreMod& m,
                                           int row_w, int col0) {
  if (!pf.ok) {
    bias_scores<kCols, Fast, kGather, Kinds>(acc_s, p, m, row_w, col0);
    return;
  }
  constexpr bool kBf16 = (Kinds & bias_kind_bit(kBiasBf16)) != 0;
  if ((Kinds & bias_kind_bit(kBiasBool)) != 0 && p.bias_kind == kBiasBool) {
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t w = pf.w[nt][half];  // added, as bias_raw: a NaN score stays NaN
        acc_s[nt][2 * half] += (w & 0xffu) ? 0.f : -INFINITY;
        acc_s[nt][2 * half + 1] += (w & 0xff00u) ? 0.f : -INFINITY;
      }
    }
  } else if (!kBf16 || p.bias_kind == kBiasHalf) {  // pf.ok: one of the prefetched kinds
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 f = unpack_half2(pf.w[nt][half]);
        acc_s[nt][2 * half] += bias_to_raw<kBiasHalf>(p, f.x);
        acc_s[nt][2 * half + 1] += bias_to_raw<kBiasHalf>(p, f.y);
      }
    }
  } else if constexpr (kBf16) {
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t w = pf.w[nt][half];
        acc_s[nt][2 * half] += bias_to_raw<kBiasBf16>(p, __uint_as_float(w << 16));
        acc_s[nt][2 * half + 1] += bias_to_raw<kBiasBf16>(p, __uint_as_float(w & 0xffff0000u));
      }
    }
  }
}

// The modifiers over one warp's m16 x kBN fragments in the forward's layout: rows row_w +
// lane / 4 (+ 8), keys col0 + 8 nt + 2 (lane % 4) (+ 1). Softcap, then ALiBi, then the bias
// (Gemma 2's order: the mask is added to the capped logits). ScoreMods false: a kernel with a
// bias and nothing else (the forward's kFwdBias), whose bias_ptr is always set.
template <int kBN, bool BiasFast = true, bool ScoreMods = true, int Kinds = kAllBiasKinds>
__device__ __forceinline__ void mod_scores(float (&acc_s)[kBN / 8][4], const ScoreMod& m,
                                           int row_w, int col0, const Flash_fwd_params& p,
                                           const BiasPrefetch<kBN>* pf = nullptr) {
  if constexpr (ScoreMods) softcap_scores<kBN>(acc_s, m);
  if (ScoreMods && m.slope != 0.f) {
    const int lane = threadIdx.x % 32;
    // Distances in float: exact below 2^24, and constant offsets from dist0 per element.
    const float dist0 = static_cast<float>(row_w + lane / 4 + m.offset - col0 - 2 * (lane % 4));
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float dist = dist0 + static_cast<float>((e >= 2 ? 8 : 0) - 8 * nt - (e & 1));
        acc_s[nt][e] = fmaf(m.slope, fabsf(dist), acc_s[nt][e]);
      }
    }
  }
  if (!ScoreMods || p.bias_ptr != nullptr) {
    if (pf != nullptr) {
      bias_apply<kBN, BiasFast, 8, Kinds>(acc_s, *pf, p, m, row_w, col0);
    } else {
      bias_scores<kBN, BiasFast, 8, Kinds>(acc_s, p, m, row_w, col0);
    }
  }
}

// Neither a softcap nor ALiBi (a dropout or bias call): the per-score step below is the identity
// (dcap 1, no distance term), so the backward runs the plain kernel's loop instead.
__device__ __forceinline__ bool no_score_mod(const ScoreMod& m) {
  return m.cap_in == 0.f && m.slope == 0.f;
}

// The backward's per-score step on a score x that softcap_scores already capped: ALiBi is
// added to x (dist: query + offset - key, as a float), and the softcap's derivative 1 - tanh^2
// returned (1 without a softcap: cap_in = 0). tanh is read back from the capped score (x *
// cap_in = tanh), so the backward keeps no second array of derivatives; near |tanh| = 1 that
// costs a few ulp of 1 in the derivative, below the fp16 rounding of dS.
__device__ __forceinline__ float alibi_and_dcap(const ScoreMod& m, float& x, float dist) {
  const float t = x * m.cap_in;
  x = fmaf(m.slope, fabsf(dist), x);
  return fmaf(-t, t, 1.f);
}

}  // namespace flash_sm75
