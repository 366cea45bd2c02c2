// Attention dropout with torch's semantics: P -> P * Z / (1 - p), Z_ij = 1 with probability
// 1 - p (independently per (batch, head, query, key)), applied to the normalised probabilities
// (the LSE and the softmax's denominator see every key). The forward and both backward kernels
// regenerate the same Z from a counter-based generator instead of storing it.
//
// Generator: Philox4x32 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011), keyed by the seed of torch's CUDA generator, with kDropoutRounds rounds.
// One call gives eight 16-bit words for one *cell*: the eight elements
//   queries a, a + 8  x  keys 2c, 2c + 1, 2c + 8, 2c + 9
// of a 16 x 16 (query, key) block, a in 0..7, c in 0..3 (dropout_cell below: the words'
// order).
// That cell is what one lane holds of the block in the mma.m16n8k8 accumulator layout of the
// forward and the dQ kernel (rows = queries: lane (g, t) holds queries g, g + 8 and keys 2t,
// 2t + 1 of each 8-key tile), so there each word is computed exactly once, with no shuffle. In
// the dK/dV kernel's S^T (rows = keys: lane (g, t) holds keys g, g + 8 and queries 2t, 2t + 1
// of each 8-query tile) a cell's words are split between lanes g and g ^ 1 by their key's
// parity: each of the pair computes one of its two cells and sends the other lane the half it
// needs (dropout_visit). Counter = (cell index in the query block's row of 16 x 16 blocks,
// query block, batch * heads + head, the call's offset / 4); key = the seed (high word xor the
// offset's bits past 2^34).
//
// An element is kept iff its 32-bit number u < keep_threshold = round((1 - p) 2^32), i.e. with
// probability 1 - p to within 2^-32. Its high 16 bits are the cell's word; the low 16 bits are
// drawn (from the same cell's second call, counter bit 31 set) only where the high word equals
// the threshold's (probability 2^-16 per element), the one case the high word cannot decide.
// So one call serves eight elements where a 32-bit word per element took two calls.
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

// The 16-bit words of cell (a, c) of the 16 x 16 block (query block qb, key block kb) of slice
// bh: .x (a, 2c | 2c + 1 in its low | high half), .y (a + 8, the same keys), .z (a, 2c + 8 |
// 2c + 9), .w (a + 8, 2c + 8 | 2c + 9). tie: the cell's second call (the low 16 bits of each
// element's number, dropout_keep_word).
FLASH_SM75_HD Philox4 dropout_cell(const DropoutRng& rng, uint32_t bh, uint32_t qb, uint32_t kb,
                                   uint32_t a, uint32_t c, bool tie = false) {
  uint32_t c0 = kb * 32u + a * 4u + c + (tie ? 0x80000000u : 0u);
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

// Word `word` (0 .x, 1 .y, 2 .z, 3 .w) half `half` of a cell's call.
FLASH_SM75_HD uint32_t dropout_half(const Philox4& r, int word, uint32_t half) {
  const uint32_t w = word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w;
  return (w >> (16u * half)) & 0xFFFFu;
}

// Kept? An element's 16-bit word w16 against threshold thr; `tie` gives the low 16 bits of its
// number (the cell's second call), asked for only when w16 equals thr's high half.
template <typename Tie>
FLASH_SM75_HD bool dropout_keep_word(uint32_t w16, uint32_t thr, Tie&& tie) {
  const uint32_t hi = thr >> 16;
  if (w16 != hi) return w16 < hi;
  return tie() < (thr & 0xFFFFu);
}

// Element (query i, key j) of slice bh kept? (host reference; the kernels take whole cells.)
FLASH_SM75_HD bool dropout_keep(const DropoutRng& rng, uint32_t bh, uint32_t i, uint32_t j,
                                uint32_t keep_threshold) {
  const uint32_t a = i & 7u, c = (j & 7u) >> 1, half = j & 1u;
  const int word = static_cast<int>(((i >> 3) & 1u) + 2u * ((j >> 3) & 1u));
  const Philox4 r = dropout_cell(rng, bh, i >> 4, j >> 4, a, c);
  return dropout_keep_word(dropout_half(r, word, half), keep_threshold, [&] {
    return dropout_half(dropout_cell(rng, bh, i >> 4, j >> 4, a, c, true), word, half);
  });
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

// Half `half` of x in the low 16 bits, the same half of y in the high 16 bits (one PRMT).
FLASH_SM75_HD uint32_t dropout_pack_halves(uint32_t x, uint32_t y, uint32_t half) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, half ? 0x7632u : 0x5410u);
#else
  return half ? (x >> 16) | (y & 0xFFFF0000u) : (x & 0xFFFFu) | (y << 16);
#endif
}

// Fast path of one 32-bit word (two elements' 16-bit words, low and high half): kept[0] /
// kept[1] whether the low / high half is <= hi, the threshold's high half; a half equal to hi
// (a tie, probability 2^-16) counts as kept here and is settled afterwards from the low 16 bits
// of its number (dropout_settle_ties). `tie` accumulates, at bit 15 / 31, halves equal to hi
// (x = w ^ hi2 has a zero half; the borrow test is exact as "any": its one false positive, the
// high half of a word whose low half is a tie, comes with a true one). Branch-free: the fast
// path stays one basic block that ptxas can schedule with the MMAs around it.
__device__ __forceinline__ void dropout_word_keep(uint32_t w, uint32_t hi, uint32_t hi2,
                                                  uint32_t& tie, bool (&kept)[2]) {
  const uint32_t x = w ^ hi2;
  tie |= (x - 0x00010001u) & ~x;
  kept[0] = (w & 0xFFFFu) <= hi;
  kept[1] = w <= ((hi << 16) | 0xFFFFu);
}

// Where a cell's words land in the accumulator layout, (tile nt, element e), for block m of
// dropout_visit's columns. Query rows (the forward, the dQ kernel): half `half` of word `word`
// (.x, .y: keys 2t | 2t + 1 of tile 2m, .z, .w of tile 2m + 1; .y, .w the lower row half).
// Key rows (the dK/dV kernel): word `word` of the cell of query 2t + x, this lane's key parity
// (.x: tile 2m, .y: + 8 queries, the next tile; .z: key g + 8, the lower row half; .w both).
struct DropoutElem {
  int nt, e;
};
__device__ __forceinline__ DropoutElem dropout_elem_q(int m, int word, int half) {
  return DropoutElem{2 * m + (word >> 1), 2 * (word & 1) + half};
}
__device__ __forceinline__ DropoutElem dropout_elem_k(int m, int x, int word) {
  return DropoutElem{2 * m + (word & 1), 2 * (word >> 1) + x};
}

// The rare path of dropout_visit: the thread's tied elements that the low 16 bits of their
// number drop (>= the threshold's low half), as drop(nt, e) (the fast path kept them).
// The cells are recomputed (both calls) in a loop that is not unrolled (it runs for a tied
// lane only, about once per 4000 visits of 16 elements), collecting bits that are applied
// unrolled (register arrays are indexed only at compile time).
template <int kNT, bool kKeyRows, typename D>
__device__ __forceinline__ void dropout_settle_ties(const DropoutRng& rng, uint32_t bh,
                                                    uint32_t rb, uint32_t cb, int g, int t,
                                                    uint32_t thr, D&& drop_elem) {
  static_assert(kNT <= 8, "dropout: the tie bits of one 32-bit word");
  const uint32_t hi = thr >> 16, lo = thr & 0xFFFFu;
  const uint32_t h = static_cast<uint32_t>(g) & 1u, c = static_cast<uint32_t>(g) >> 1;
  uint32_t drop = 0u;  // bit 8 m + 2 word + half (query rows) / 8 m + 4 x + word (key rows)
#pragma unroll 1
  for (int m = 0; m < kNT / 2; ++m) {
#pragma unroll
    for (int x = 0; x < (kKeyRows ? 2 : 1); ++x) {
      const Philox4 r1 = kKeyRows ? dropout_cell(rng, bh, cb + m, rb, 2 * t + x, c)
                                  : dropout_cell(rng, bh, rb, cb + m, g, t);
      const Philox4 r2 = kKeyRows ? dropout_cell(rng, bh, cb + m, rb, 2 * t + x, c, true)
                                  : dropout_cell(rng, bh, rb, cb + m, g, t, true);
#pragma unroll
      for (int word = 0; word < 4; ++word) {
#pragma unroll
        for (int half = 0; half < (kKeyRows ? 1 : 2); ++half) {
          const uint32_t hf = kKeyRows ? h : static_cast<uint32_t>(half);
          const bool d = dropout_half(r1, word, hf) == hi && dropout_half(r2, word, hf) >= lo;
          const int bit = 8 * m + (kKeyRows ? 4 * x + word : 2 * word + half);
          drop |= static_cast<uint32_t>(d) << bit;
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kNT / 2; ++m) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (!((drop >> (8 * m + i)) & 1u)) continue;
      // i = 4 x + word (key rows) or 2 word + half (query rows)
      const DropoutElem el = kKeyRows ? dropout_elem_k(m, i >> 2, i & 3)
                                      : dropout_elem_q(m, i >> 1, i & 1);
      drop_elem(el.nt, el.e);
    }
  }
}

// Visits the kept / dropped state of every element a thread holds in an accumulator layout:
// kNT tiles of 8 columns from column col0 (16-aligned) for the warp's 16 rows from row16
// (16-aligned), e as in the accumulator (0, 1: row g, columns 2t, 2t + 1; 2, 3: row g + 8).
// f(nt, e, keep) is called once per element by the fast path, where a tie counts as kept; then
// drop(nt, e) for each tied element that the low half of its number drops (by default
// f(nt, e, false) once more: right for callbacks that act only on a drop).
// kKeyRows = false: rows are queries, columns keys (the forward, the dQ kernel): lane (g, t)
// holds cell (g, t) of each 16 x 16 block. true: rows are keys, columns queries (the dK/dV
// kernel's S^T): lane (g, t) holds, of cells (2t, g / 2) and (2t + 1, g / 2), the halves of key
// parity g & 1; it computes cell (2t + (g & 1), g / 2) and swaps halves with lane (g ^ 1, t).
// Every lane of the warp must call it (the swap is a shuffle).
template <int kNT, bool kKeyRows, typename F, typename D>
__device__ __forceinline__ void dropout_visit(const DropoutRng& rng, uint32_t bh, int row16,
                                              int col0, int g, int t, uint32_t thr, F&& f,
                                              D&& drop) {
  static_assert(kNT % 2 == 0, "dropout: whole 16 x 16 blocks");
  const uint32_t rb = static_cast<uint32_t>(row16) >> 4, cb = static_cast<uint32_t>(col0) >> 4;
  const uint32_t hi = thr >> 16, hi2 = hi * 0x00010001u;
  uint32_t tie = 0u;
#pragma unroll
  for (int m = 0; m < kNT / 2; ++m) {
    if constexpr (!kKeyRows) {
      const Philox4 r = dropout_cell(rng, bh, rb, cb + m, g, t);
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int word = 0; word < 4; ++word) {
        bool kept[2];
        dropout_word_keep(w[word], hi, hi2, tie, kept);
        const DropoutElem lo = dropout_elem_q(m, word, 0), hi_el = dropout_elem_q(m, word, 1);
        f(lo.nt, lo.e, kept[0]);
        f(hi_el.nt, hi_el.e, kept[1]);
      }
    } else {
      const uint32_t h = static_cast<uint32_t>(g) & 1u, c = static_cast<uint32_t>(g) >> 1;
      // Cell (query 2t + h, key pair c) of this block: query block cb + m, key block rb.
      const Philox4 own = dropout_cell(rng, bh, cb + m, rb, 2 * t + h, c);
      // Packed words: half h (this lane's key parity) of .x | .y and of .z | .w, and the
      // partner's (key parity 1 - h) halves the same way, sent to it (lane = 4 g + t).
      const uint32_t mine0 = dropout_pack_halves(own.x, own.y, h);
      const uint32_t mine1 = dropout_pack_halves(own.z, own.w, h);
      const uint32_t recv0 =
          __shfl_xor_sync(0xffffffffu, dropout_pack_halves(own.x, own.y, 1u - h), 4);
      const uint32_t recv1 =
          __shfl_xor_sync(0xffffffffu, dropout_pack_halves(own.z, own.w, 1u - h), 4);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        // cell (query 2t + x): this lane's own where x == h, else the partner's
        const bool is_own = static_cast<uint32_t>(x) == h;
        bool k01[2], k23[2];
        dropout_word_keep(is_own ? mine0 : recv0, hi, hi2, tie, k01);
        dropout_word_keep(is_own ? mine1 : recv1, hi, hi2, tie, k23);
        // the packed words hold .x | .y and .z | .w (low | high half)
        const DropoutElem ex = dropout_elem_k(m, x, 0), ey = dropout_elem_k(m, x, 1);
        const DropoutElem ez = dropout_elem_k(m, x, 2), ew = dropout_elem_k(m, x, 3);
        f(ex.nt, ex.e, k01[0]);
        f(ey.nt, ey.e, k01[1]);
        f(ez.nt, ez.e, k23[0]);
        f(ew.nt, ew.e, k23[1]);
      }
    }
  }
  if (tie & 0x80008000u) {  // rare (2^-16 per element): this lane only
    dropout_settle_ties<kNT, kKeyRows>(rng, bh, rb, cb, g, t, thr, drop);
  }
}
template <int kNT, bool kKeyRows, typename F>
__device__ __forceinline__ void dropout_visit(const DropoutRng& rng, uint32_t bh, int row16,
                                              int col0, int g, int t, uint32_t thr, F&& f) {
  dropout_visit<kNT, kKeyRows>(rng, bh, row16, col0, g, t, thr, f,
                               [&](int nt, int e) { f(nt, e, false); });
}

// The kept / dropped state of the thread's elements as bits 4 nt + e (kNT <= 8 tiles): taken at
// the top of a backward iteration, where few registers are live, and carried in one register.
template <int kNT, bool kKeyRows>
__device__ __forceinline__ uint32_t dropout_bits(const DropoutRng& rng, uint32_t bh, int row16,
                                                 int col0, int g, int t, uint32_t thr) {
  static_assert(kNT <= 8, "dropout: one 32-bit mask");
  uint32_t bits = 0u;
  dropout_visit<kNT, kKeyRows>(
      rng, bh, row16, col0, g, t, thr,
      [&](int nt, int e, bool k) { if (k) bits |= 1u << (4 * nt + e); },
      [&](int nt, int e) { bits &= ~(1u << (4 * nt + e)); });
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
