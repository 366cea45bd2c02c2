// The head dims the kernels take, written once for the C++ side (the Python rulebook,
// flash_attention_sm75/_rules.py, mirrors it; tests/test_rules.py checks the two agree, and
// generate_kernels.py reads kHeadDimBuckets from here).
//
// A head dim d is run by the instantiation of the smallest bucket kD >= d. Every kernel handles
// the tail inside: d is a multiple of 8, so a row of d fp16 ends on a 16-byte boundary and the
// 16-byte chunks at or past d / 8 are zero-filled on load (they add 0 to q.k and contribute zero
// columns to P V) and skipped on store. Nothing is read or written past column d.
#pragma once

#include <stdexcept>
#include <string>

namespace flash_sm75 {

constexpr int kHeadDimMultiple = 8;  // one 16-byte vector of fp16
constexpr int kHeadDimBuckets[] = {64, 96, 128, 256};
constexpr int kNumHeadDimBuckets = sizeof(kHeadDimBuckets) / sizeof(kHeadDimBuckets[0]);
constexpr int kMaxHeadDim = kHeadDimBuckets[kNumHeadDimBuckets - 1];
// The head dims of the decode kernel (seqlen_q == 1, flash_decode_kernel.h), a subset of the
// buckets: a bucket without its own decode kernel (96: 3 dims per lane, which its V loads do not
// take) runs the next larger one, with the tail inside as for any d below a bucket. Decode reads
// only d columns of K and V either way; the larger kernel spends CUDA-core work on zeros.
constexpr int kDecodeHeadDims[] = {64, 128, 256};
constexpr int kNumDecodeHeadDims = sizeof(kDecodeHeadDims) / sizeof(kDecodeHeadDims[0]);

// The instantiated head dim that runs d, or 0 when no kernel takes d.
constexpr int head_dim_bucket(long long d) {
  if (d < kHeadDimMultiple || d > kMaxHeadDim || d % kHeadDimMultiple != 0) return 0;
  for (int i = 0; i < kNumHeadDimBuckets; ++i) {
    if (d <= kHeadDimBuckets[i]) return kHeadDimBuckets[i];
  }
  return 0;
}

// The decode kernel's head dim that runs bucket kd (0 when none).
constexpr int decode_head_dim(int kd) {
  for (int i = 0; i < kNumDecodeHeadDims; ++i) {
    if (kd <= kDecodeHeadDims[i]) return kDecodeHeadDims[i];
  }
  return 0;
}

inline std::string head_dim_rule() {
  return "a multiple of " + std::to_string(kHeadDimMultiple) + " from " +
         std::to_string(kHeadDimMultiple) + " to " + std::to_string(kMaxHeadDim);
}

[[noreturn]] inline void throw_bad_head_dim(long long d) {
  throw std::invalid_argument("flash_attention_sm75: head_dim must be " + head_dim_rule() +
                              ", got " + std::to_string(d));
}

}  // namespace flash_sm75
