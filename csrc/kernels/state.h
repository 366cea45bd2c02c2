// Merging partial softmax results (split-KV decode). A part is the attention of one query row
// over a subset of the keys, kept as (m, l, O): m the max raw score of the subset, l the sum of
// exp2((s - m) * scale_log2) over it, O its output, unnormalised (sum of the p v, relative to m)
// or normalised (divided by l). Parts over disjoint key sets merge into the row's result:
//   M = max m_s,   w_s = exp2((m_s - M) * scale_log2),   l = sum w_s l_s,
//   O = sum w_s O_s / l (unnormalised parts) or sum w_s l_s O_s / l (normalised parts),
//   LSE = M * scale + log(l).
// Keeping m and l apart (rather than one LSE per part) keeps the weights exact at large |m|: in
// fp32, m * scale + log(l) loses log(l) once |m * scale| is large. The decode kernel merges its
// warps' parts (unnormalised) and the merge kernel the splits' (normalised) with this.
#pragma once

#include <cmath>

namespace flash_sm75 {

// Two passes over the parts: max_with() every part's m, then add_*() every part. Each weight is
// taken against the final max once (no rescaling of running sums). kN output elements per
// thread.
template <int kN>
struct SoftmaxMerge {
  float m = -INFINITY;  // merged max M (-inf: no part saw a key)
  // Set by start():
  float ref;            // exponent shift: M, or 0 when M = -inf (exp2(-inf - 0) = 0, not NaN)
  float acc[kN];        // merged O times l, relative to ref
  float sum;            // merged l, relative to ref

  __device__ __forceinline__ void max_with(float m_part) { m = fmaxf(m, m_part); }

  // After the last max_with(): fix the shift and clear the sums.
  __device__ __forceinline__ void start() {
    ref = m == -INFINITY ? 0.f : m;
    sum = 0.f;
#pragma unroll
    for (int e = 0; e < kN; ++e) acc[e] = 0.f;
  }

  // A part's weight f = exp2((m_part - M) * scale_log2): 0 for a part that saw no key
  // (m_part = -inf). scale_log2 by reference: a caller's load of it (e.g. from the kernel
  // parameters) happens here, after the subtraction, which keeps the merge kernel's SASS as it
  // was written by hand before this struct.
  __device__ __forceinline__ float weight(float m_part, const float& scale_log2) const {
    return exp2f((m_part - ref) * scale_log2);
  }

  // A part of weight f (weight()) whose O is unnormalised: l += f l_part, O += f O_part, with
  // element e of O_part read as o(e).
  template <typename PartO>
  __device__ __forceinline__ void add_unnormalised(float f, float l_part, PartO o) {
    sum += f * l_part;
#pragma unroll
    for (int e = 0; e < kN; ++e) acc[e] += f * o(e);
  }

  // A part of weight f whose O is normalised: w = f l_part, l += w, O += w O_part (an empty
  // part has l = 0, O = 0: w = 0).
  template <typename PartO>
  __device__ __forceinline__ void add_normalised(float f, float l_part, PartO o) {
    const float w = f * l_part;
    sum += w;
#pragma unroll
    for (int e = 0; e < kN; ++e) acc[e] = fmaf(w, o(e), acc[e]);
  }

  // The result: O (kN elements) and the natural-log LSE of the scaled scores (scale = the
  // softmax scale). sum = 0: no key was seen (O = 0, LSE = -inf); NaN propagates (NaN != 0).
  // result() gives both at once; out(e) and lse() one at a time, for callers where only some
  // threads need the LSE.
  __device__ __forceinline__ void result(float scale, float (&o)[kN], float& lse_out) const {
    const bool seen = sum != 0.f;
    if (seen) {
#pragma unroll
      for (int e = 0; e < kN; ++e) o[e] = acc[e] / sum;
      lse_out = ref * scale + logf(sum);
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) o[e] = 0.f;
      lse_out = -INFINITY;
    }
  }

  __device__ __forceinline__ bool any() const { return sum != 0.f; }
  __device__ __forceinline__ float out(int e) const { return any() ? acc[e] / sum : 0.f; }
  __device__ __forceinline__ float lse(float scale) const {
    return any() ? ref * scale + logf(sum) : -INFINITY;
  }
};

}  // namespace flash_sm75
