// Attention dropout with torch's semantics: P -> P * Z / (1 - p), Z_ij = 1 with probability
// 1 - p (independently per (batch, head, query, key)), applied to the normalised probabilities
// (the LSE and the softmax's denominator see every key). The forward and both backward kernels
// regenerate the same Z from a counter-based generator instead of storing it.
//
// Generator: Philox4x32 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011), keyed by the seed of torch's CUDA generator, with kDropoutRounds rounds.
// One call gives four 32-bit words for one *cell*: the four elements
//   (query a, key b), (a + 8, b), (a, b + 8), (a + 8, b + 8)
// of a 16 x 16 (query, key) block, a, b in 0..7. That cell is what one thread holds in the
// mma.m16n8k8 accumulator layouts of both the forward (rows = queries: lane (g, t) holds queries
// g, g + 8 and keys 2t, 2t + 1 of each 8-key tile) and the dK/dV kernel (rows = keys, S^T: keys
// g, g + 8, queries 2t, 2t + 1), so every kernel computes each random word exactly once, with no
// shuffle. Counter = (cell index in the query block's row of 16 x 16 blocks, query block, batch
// * heads + head, the call's offset / 4); key = the seed (high word xor the offset's bits past
// 2^34). An element is kept iff its word < keep_threshold = round((1 - p) 2^32): probability
// 1 - p to within 2^-32.
//
// The seed and offset come from torch's default CUDA generator (philox_cuda_state: 4 counter
// units per call), so torch.manual_seed reproduces a run; under CUDA-graph capture they are read
// on the device at every replay (seed_ptr / offset_ptr), and the forward writes the values it used
// to rng_state (int64 [seed, offset]), which the backward reads the same way.
#pragma once

#include <cstdint>

#include "flash.h"

#if defined(__CUDACC__)
#define FLASH_SM75_HD __host__ __device__ __forceinline__
#else
#define FLASH_SM75_HD inline
#endif

namespace flash_sm75 {

// Philox4x32-7: the fewest rounds of the family that passes TestU01's BigCrush (Salmon et al.,
// table 2); every round is two 32 x 32 -> 64-bit multiplies, the key schedule two adds. The
// round function is tested at 10 rounds against torch's own Philox engine (tests/cpp).
constexpr int kDropoutRounds = 7;

struct Philox4 {
  uint32_t x, y, z, w;
};

FLASH_SM75_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

template <int Rounds>
FLASH_SM75_HD Philox4 philox4x32(Philox4 c, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < Rounds; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t hi0 = mulhi32(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = mulhi32(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
  }
  return c;
}

// The generator of one call: key and the offset's counter word.
struct DropoutRng {
  uint32_t k0, k1, off;
};

FLASH_SM75_HD DropoutRng dropout_rng_from(uint64_t seed, uint64_t offset) {
  return DropoutRng{static_cast<uint32_t>(seed),
                    static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 34),
                    static_cast<uint32_t>(offset >> 2)};
}

// The random words of cell (a, b) of the 16 x 16 block (query block qb, key block kb) of slice
// bh: .x (a, b), .y (a + 8, b), .z (a, b + 8), .w (a + 8, b + 8).
FLASH_SM75_HD Philox4 dropout_cell(const DropoutRng& rng, uint32_t bh, uint32_t qb, uint32_t kb,
                                   uint32_t a, uint32_t b) {
  uint32_t c0 = kb * 64u + a * 8u + b;
#if defined(__CUDA_ARCH__)
  // One cell's rounds at a time: the empty volatile statements keep their order, so a call's
  // chain starts only after the previous call's words exist. ptxas would otherwise interleave
  // the independent chains and hold several Philox states at once (spills in the backward
  // kernels at 255 registers).
  asm volatile("" : "+r"(c0));
#endif
  const Philox4 r =
      philox4x32<kDropoutRounds>(Philox4{c0, qb, bh, rng.off}, rng.k0, rng.k1);
#if defined(__CUDA_ARCH__)
  asm volatile("" ::"r"(r.x), "r"(r.y), "r"(r.z), "r"(r.w));
#endif
  return r;
}

// Element (query i, key j) of slice bh kept? (host reference; the kernels take whole cells.)
FLASH_SM75_HD bool dropout_keep(const DropoutRng& rng, uint32_t bh, uint32_t i, uint32_t j,
                                uint32_t keep_threshold) {
  const Philox4 r = dropout_cell(rng, bh, i >> 4, j >> 4, i & 7, j & 7);
  const uint32_t qh = (i >> 3) & 1, kh = (j >> 3) & 1;
  const uint32_t w = qh ? (kh ? r.w : r.y) : (kh ? r.z : r.x);
  return w < keep_threshold;
}

// keep_threshold of a drop probability p in (0, 1): round((1 - p) 2^32), at most 2^32 - 1.
inline uint32_t dropout_keep_threshold(double p) {
  const double t = (1.0 - p) * 4294967296.0 + 0.5;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

// Device code: nvcc, or the CPU emulator of tests/emu (which defines threadIdx as a macro).
#if defined(__CUDACC__) || defined(threadIdx)
// This call's generator: from the device (a captured graph's replay, or the backward reading
// the forward's rng_state) or from the values the host took.
__device__ __forceinline__ DropoutRng dropout_rng(const Flash_fwd_params& p) {
  uint64_t seed = p.dropout_seed, offset = p.dropout_offset;
  if (p.dropout_seed_ptr != nullptr) {
    seed = static_cast<uint64_t>(*p.dropout_seed_ptr);
    offset = static_cast<uint64_t>(*p.dropout_offset_ptr) + p.dropout_offset_add;
  }
  return dropout_rng_from(seed, offset);
}

// The backward's generator: always the forward's rng_state on the device (no branch).
__device__ __forceinline__ DropoutRng dropout_rng_saved(const Flash_fwd_params& p) {
  return dropout_rng_from(static_cast<uint64_t>(*p.dropout_seed_ptr),
                          static_cast<uint64_t>(*p.dropout_offset_ptr));
}

// The forward writes what it used to rng_state (one thread of the grid).
__device__ __forceinline__ void dropout_save_state(const Flash_fwd_params& p) {
  if (p.dropout_rng_state_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    uint64_t seed = p.dropout_seed, offset = p.dropout_offset;
    if (p.dropout_seed_ptr != nullptr) {
      seed = static_cast<uint64_t>(*p.dropout_seed_ptr);
      offset = static_cast<uint64_t>(*p.dropout_offset_ptr) + p.dropout_offset_add;
    }
    p.dropout_rng_state_out[0] = static_cast<int64_t>(seed);
    p.dropout_rng_state_out[1] = static_cast<int64_t>(offset);
  }
}

// Visits the kept / dropped state of every element a thread holds in an accumulator layout:
// kNT tiles of 8 columns from column col0 (16-aligned) for the warp's 16 rows from row16
// (16-aligned); f(nt, e, keep) with e as in the accumulator (0, 1: row g, columns 2t, 2t + 1;
// 2, 3: row g + 8). kKeyRows = false: rows are queries, columns keys (the forward, the dQ
// kernel); true: rows are keys, columns queries (the dK/dV kernel's S^T). Either way the lane
// holds whole cells (see the file comment): (g, 2t + x) resp. (2t + x, g) of each 16 x 16 block.
template <int kNT, bool kKeyRows, typename F>
__device__ __forceinline__ void dropout_visit(const DropoutRng& rng, uint32_t bh, int row16,
                                              int col0, int g, int t, uint32_t thr, F&& f) {
  static_assert(kNT % 2 == 0, "dropout: whole 16 x 16 blocks");
  const uint32_t rb = static_cast<uint32_t>(row16) >> 4, cb = static_cast<uint32_t>(col0) >> 4;
#pragma unroll
  for (int m = 0; m < kNT / 2; ++m) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      // words (a, b), (a + 8, b), (a, b + 8), (a + 8, b + 8) of query a, key b
      const Philox4 r = kKeyRows ? dropout_cell(rng, bh, cb + m, rb, 2 * t + x, g)
                                 : dropout_cell(rng, bh, rb, cb + m, g, 2 * t + x);
      // query + 8 is the next column tile (key rows) or the lower row half (query rows); key
      // + 8 the other way round
      f(2 * m, x, r.x < thr);
      f(kKeyRows ? 2 * m + 1 : 2 * m, kKeyRows ? x : 2 + x, r.y < thr);
      f(kKeyRows ? 2 * m : 2 * m + 1, kKeyRows ? 2 + x : x, r.z < thr);
      f(2 * m + 1, 2 + x, r.w < thr);
    }
  }
}

// The kept / dropped state of the thread's elements as bits 4 nt + e (kNT <= 8 tiles): taken at
// the top of a backward iteration, where few registers are live, and carried in one register.
template <int kNT, bool kKeyRows>
__device__ __forceinline__ uint32_t dropout_bits(const DropoutRng& rng, uint32_t bh, int row16,
                                                 int col0, int g, int t, uint32_t thr) {
  static_assert(kNT <= 8, "dropout: one 32-bit mask");
  uint32_t bits = 0u;
  dropout_visit<kNT, kKeyRows>(rng, bh, row16, col0, g, t, thr, [&](int nt, int e, bool k) {
    if (k) bits |= 1u << (4 * nt + e);
  });
  return bits;
}

// Zero the halves of fp16 fragments (p[nt][0]: row g, p[nt][1]: g + 8 of the accumulator
// layout; low half column 2t, high half 2t + 1) whose bit 4 nt + e is clear.
template <int kNT>
__device__ __forceinline__ void dropout_apply_bits(uint32_t (&p)[kNT][2], uint32_t bits) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!((bits >> (4 * nt + e)) & 1u)) p[nt][e >> 1] &= (e & 1) ? 0x0000FFFFu : 0xFFFF0000u;
    }
  }
}

// Backward: P (>= 0, fp32 accumulator layout) carries its keep bit in its sign until dS: -P
// where dropped, so no mask register stays live across the dP GEMM.
template <int kNT>
__device__ __forceinline__ void dropout_sign_p(float (&s)[kNT][4], uint32_t bits) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!((bits >> (4 * nt + e)) & 1u)) s[nt][e] = -s[nt][e];
    }
  }
}
// dS = P (Z dP / (1 - p) - D) from a sign-carrying P (a dropped P = 0 reads as kept: dS = 0).
__device__ __forceinline__ float dropout_ds(float p_signed, float dp, float d, float rp) {
  const float p = fabsf(p_signed);
  return p * ((p_signed >= 0.f ? dp * rp : 0.f) - d);
}

// Forward: zero the dropped halves of the fp16 P fragments (p[nt][0]: query g, p[nt][1]: g + 8;
// low half key 2t, high half 2t + 1). The 1 / (1 - p) is applied to O at the end.
template <int kNT>
__device__ __forceinline__ void dropout_p_frag(uint32_t (&p)[kNT][2], const DropoutRng& rng,
                                               uint32_t bh, int row16, int col0, uint32_t thr) {
  const int lane = threadIdx.x % 32;
  dropout_visit<kNT, false>(rng, bh, row16, col0, lane / 4, lane % 4, thr,
                            [&](int nt, int e, bool keep) {
                              if (!keep) p[nt][e >> 1] &= (e & 1) ? 0x0000FFFFu : 0xFFFF0000u;
                            });
}
#endif

}  // namespace flash_sm75
