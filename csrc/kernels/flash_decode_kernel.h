// Decode forward (seqlen_q == 1): split-KV attention on CUDA cores, GQA-packed. The extended
// instantiations also take a few query rows (the KV-cache op's short queries against a long
// cache): a CTA's "heads" below are then (query, q-head) rows, each with its own causal limit.
//
// With one query row the prefill kernel wastes 63 of its 64 (or 127 of 128) tile rows and runs
// one CTA per (batch, q-head) over all keys: few CTAs, each K/V row read once per q-head. Here
// one CTA of 4 warps serves (batch, kv head, head part, key split):
//   * up to kR q-heads of the kv head are handled together (K/V read once per CTA); a group of
//     h / h_k > kR q-heads is cut into ceil(h / h_k / kR) parts of kR heads, one CTA each
//     (registers cap kR per head dim: decode_max_heads_per_cta, launch_plan.h);
//   * the keys [key_start, key_end) are cut into splits so the grid fills the GPU; each split
//     writes its normalised O (fp32) and LSE, and flash_fwd_decode_merge_kernel combines them
//     (the split-KV scheme of FlashDecoding / FlashAttention-2's `num_splits`);
//   * per step, warp w takes 32 keys: the K rows go through shared memory (coalesced 16-byte
//     loads; for kD > 128 in two column halves, which keeps the staging buffer at 34 KiB), lane j
//     computes the kR scores of key j, an online softmax per head (the
//     FlashAttention recurrence: running max m, sum l, O rescaled by exp2(m_old - m_new)),
//     then each lane accumulates O for its d/32 output dims, reading V rows directly
//     (coalesced: a warp reads one whole row per key).
// The 4 warps' (m, l, O) are merged through shared memory at the end. Scores are fp32 sums of
// exact fp16 products; exponents are taken as exp2((s - m) * scale_log2), so the row max gets
// exactly 1 for any score magnitude. A NaN score gives NaN O and LSE, an empty key range O = 0,
// LSE = -inf, as in the prefill kernel.
//
// Head dims below kD (head_dims.h): d is a multiple of 8, so the K rows' 16-byte chunks at or
// past d / 8 and whole lanes' V dims (a lane owns kD / 32 = 2, 4 or 8 dims, aligned to them) lie
// past d. Nothing past d is read (it belongs to the next head or lies past the tensor): q and
// those K chunks are zero-filled, so the scores are exact, and such a lane reads V dims below d
// in place of its own and never stores them. Output dims >= d are neither stored nor written to
// the fp32 split workspace, which is indexed with d (num_splits x b x h x d, as mha_fwd
// allocates it).
#pragma once

#include <cmath>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "block_info.h"
#include "flash.h"
#include "kernel_traits.h"
#include "launch_plan.h"  // decode_max_heads_per_cta
#include "score_mod.h"
#include "softmax.h"  // clamp_to_fp16_range
#include "state.h"
#include "utils.h"

namespace flash_sm75 {

template <int kD, int kR>
struct DecodeTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeys = 32;              // keys per warp per step
  // K is staged kKCols columns at a time: the whole row up to kD = 128, halves above (a
  // 32 x 256 fp16 tile per warp would take 66 KiB).
  static constexpr int kKParts = kD > 128 ? 2 : 1;
  static constexpr int kKCols = kD / kKParts;
  static constexpr int kRowH = kKCols + 8;      // padded K rows: 16-byte reads of 8 lanes
                                                // (8 rows) hit 8 distinct bank groups
  static constexpr int kDimsPerLane = kD / 32;  // output dims of a lane: 2, 4 or 8 (one load)
  // L2 prefetch of each step's V rows (flash_fwd_decode_kernel). Not at kD = 256: there it made
  // B 4, 32k keys 17% slower (H100; a step's K rows alone are 16 KiB per warp, the call was
  // at the copy bandwidth already). Not at the register cap's kR (its address arithmetic
  // spilled 28-56 bytes there; those groups are bound by their CUDA-core dot products, not by
  // memory latency).
  static constexpr bool kL2Prefetch = kD <= 128 && kR < decode_max_heads_per_cta(kD);
  // The K rows of a warp's next step are loaded into registers while the current step runs
  // (flash_fwd_decode_kernel): a step then waits for its V rows only, not for a K round trip
  // first. For the whole-row staging (kD <= 128) and groups that leave the registers (kD / 2 per
  // lane at kD = 128) room below the cap: kR <= 4 at kD = 128; at kD = 64 kR <= 2 (with kR = 4
  // / 8, 122 / 151 -> 154 / 182 registers, an H100 SM held one CTA fewer and B 64 took 3-39%
  // longer; a T4 SM holds as many either way, but only the H100 was measured). The kernel
  // takes it at kD = 64 only without Is_ext (flash_fwd_decode_kernel's kPipe).
  static constexpr bool kPipelineK = kD <= 128 && kR <= (kD == 128 ? 4 : 2);
  static constexpr int kSmemK = kWarps * kKeys * kRowH * 2;
  static constexpr int kSmemO = kWarps * kR * kD * 4;  // end-of-kernel merge, aliases sK
  static constexpr int kOffQ = kSmemK > kSmemO ? kSmemK : kSmemO;  // [kR][kD] fp32
  static constexpr int kOffP = kOffQ + kR * kD * 4;                // [warps][kR][32] fp32
  static constexpr int kOffM = kOffP + kWarps * kR * kKeys * 4;    // [warps][kR] fp32 m, l
  static constexpr int kOffCta = kOffM + 2 * kWarps * kR * 4;     // 4 ints: the CTA's coordinates
  static constexpr int kOffSlope = kOffCta + 4 * 4;               // [kR] fp32: ALiBi (Is_ext)
  static constexpr int kOffRowEnd = kOffSlope + kR * 4;             // [kR] int: rows' key limits
  static constexpr int kOffRowAlibi = kOffRowEnd + kR * 4;          // [kR] int: rows' ALiBi diagonal
  static constexpr int kOffRowBias = (kOffRowAlibi + kR * 4 + 7) / 8 * 8;  // [kR] int64: bias rows
  static constexpr int kSmemSize = kOffRowBias + kR * 8;
  static_assert(kD == 64 || kD == 128 || kD == 256, "kD = 64, 128 or 256");
  static_assert(kR >= 1 && kR <= decode_max_heads_per_cta(kD), "kR over the register cap");
  static_assert(kSmemSize <= kSm75MaxSmemPerBlock, "exceeds SM75 shared memory per block");
};

// Asks L2 for rows [first, min(first + 32, end)) of a K or V slice (row0: its row 0, column 0)
// up to column d: the warp's 32 lanes each ask for kD / 64 of the rows' 128-byte lines.
template <int kD>
__device__ __forceinline__ void decode_prefetch_rows(const __half* row0, index_t row_stride,
                                                     int64_t first, int end, int d, int lane) {
  constexpr int kLines = kD * 2 / 128;  // lines of a kD row: 1, 2 or 4
#pragma unroll
  for (int i = 0; i < kLines; ++i) {
    const int idx = i * 32 + lane;
    const int64_t row = first + idx / kLines;
    const int col = idx % kLines * 64;
    if (row < end && col < d) prefetch_l2(row0 + row * row_stride + col);
  }
}

__device__ __forceinline__ float warp_allreduce_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_allreduce_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Keys of this (batch) row that query 0 sees: [key_start, key_end) and, with a band (causal,
// window), window_lower <= j <= causal_offset.
__device__ __forceinline__ KeyRange decode_key_range(const Flash_fwd_params& params, int bidb) {
  KeyRange kr = key_range(params.seqlen_k, params.leftpad_k, params.seqused_k, bidb);
  if (params.is_causal) {
    kr.key_start = imin(imax(kr.key_start, params.window_lower), kr.key_end);
    kr.key_end = imax(kr.key_start, imin(kr.key_end, params.causal_offset + 1));
  }
  return kr;
}

// Is_ext: a softcap, ALiBi slopes and / or an attention bias modify the scores (score_mod.h).
template <int kD, int kR, bool Is_ext = false>
__global__ void __launch_bounds__(DecodeTraits<kD, kR>::kThreads, 1)
    flash_fwd_decode_kernel(const Flash_fwd_params params) {
  using T = DecodeTraits<kD, kR>;
  constexpr int kDPL = T::kDimsPerLane;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw + T::kOffQ);
  float* sM = reinterpret_cast<float*>(smem_raw + T::kOffM);
  float* sL = sM + T::kWarps * kR;
  int* sCta = reinterpret_cast<int*>(smem_raw + T::kOffCta);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // blockIdx.x = ((batch * h_k + kv head) * num_splits + split) * parts + part: the parts of a
  // group run next to each other and share the split's K/V in L2.
  // The CTA's rows are (query, q-head) pairs of its kv head, query-major: row f = i * ratio + j
  // is query i of q-head hk * ratio + j. One query row (every plain instantiation): the rows are
  // the group's q-heads. Several (Is_ext, params.seqlen_q > 1: the KV-cache op's short queries
  // against a long cache, e.g. speculative tokens): each row has its own causal key limit.
  const int ratio = params.h_h_k_ratio;
  const int rows_per_kv = Is_ext ? ratio * params.seqlen_q : ratio;
  const int parts = (rows_per_kv + kR - 1) / kR;
  const int part = static_cast<int>(blockIdx.x % parts);
  const int bhks = static_cast<int>(blockIdx.x / parts);
  const int split = bhks % params.num_splits;
  const int bhk = bhks / params.num_splits;
  const int bidb = bhk / params.h_k, hk = bhk % params.h_k;
  const int h0 = hk * ratio + part * kR;  // first q-head (one query row) / row + hk * ratio
  const int nh = imin(kR, rows_per_kv - part * kR);  // rows of the CTA
  const KeyRange kr = decode_key_range(params, bidb);
  // In 64 bits: (split + 1) * keys_per_split passes 2^31 - 1 for seqlen_k near it.
  const int64_t split_lo = static_cast<int64_t>(split) * params.keys_per_split;
  const int begin = static_cast<int>(split_lo > kr.key_start ? split_lo : kr.key_start);
  const int64_t split_hi = split_lo + params.keys_per_split;
  const int end = static_cast<int>(split_hi < kr.key_end ? split_hi : kr.key_end);
  const float scale_log2 = params.scale_softmax_log2;

  // The epilogue reads its coordinates back from shared memory: kept in registers across the
  // key loop they cost the kR = 16, d = 128 kernel a spill.
  if (tid == 0) {
    sCta[0] = bidb;
    sCta[1] = h0;
    sCta[2] = nh;
    sCta[3] = split;
  }
  // Row r's query and q-head (see above).
  auto row_query = [&](int r) { return Is_ext ? (part * kR + r) / ratio : 0; };
  auto row_head = [&](int r) { return Is_ext ? hk * ratio + (part * kR + r) % ratio : h0 + r; };
  // ALiBi: each row's slope in raw-score units (score_mod_for), 0 without slopes, and its
  // diagonal: query i is at distance |diag - j| from key j, diag = alibi_offset + i, or per
  // sequence (decode_rows_from_end: the KV-cache op) key_end - seqlen_q + i, flash-attn's
  // bottom-right distance. The rows' key limits: causal rows (decode_causal_rows) see keys <
  // key_end - (seqlen_q - 1 - i), bottom-right.
  float* sSlope = reinterpret_cast<float*>(smem_raw + T::kOffSlope);
  int* sRowEnd = reinterpret_cast<int*>(smem_raw + T::kOffRowEnd);
  int* sRowAlibi = reinterpret_cast<int*>(smem_raw + T::kOffRowAlibi);
  // The attention bias: each row's offset of bias[b, q-head, query, 0] (elements).
  int64_t* sRowBias = reinterpret_cast<int64_t*>(smem_raw + T::kOffRowBias);
  if constexpr (Is_ext) {
    if (tid < kR) {
      const int br = tid < nh ? tid : 0;  // rows past nh read row 0's bias (never stored)
      sRowBias[tid] = static_cast<int64_t>(bidb) * params.bias_batch_stride +
                      static_cast<int64_t>(row_head(br)) * params.bias_head_stride +
                      static_cast<int64_t>(row_query(br)) * params.bias_row_stride;
      sSlope[tid] = tid < nh ? score_mod_for(params, bidb, row_head(tid), params.alibi_offset).slope
                             : 0.f;
      sRowEnd[tid] = params.decode_causal_rows
                         ? kr.key_end - (params.seqlen_q - 1 - row_query(tid)) : kr.key_end;
      sRowAlibi[tid] = (params.decode_rows_from_end ? kr.key_end - params.seqlen_q
                                                    : params.alibi_offset) + row_query(tid);
    }
  }

  // ---- q of the CTA's rows -> sQ (fp32; rows past nh are 0 and never written out).
  const __half* q = static_cast<const __half*>(params.q_ptr) + bidb * params.q_batch_stride;
  for (int i = tid; i < kR * kD; i += T::kThreads) {
    const int h = i / kD, c = i % kD;
    sQ[i] = h < nh && c < params.d
                ? __half2float(q[row_query(h) * params.q_row_stride +
                                 row_head(h) * params.q_head_stride + c])
                : 0.f;
  }
  __syncthreads();

  float m[kR], l[kR], o[kR][kDPL];
#pragma unroll
  for (int h = 0; h < kR; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < kDPL; ++e) o[h][e] = 0.f;
  }

  // Paged K/V (Is_ext, block_table): the batch term is the page's, taken per step below.
  const bool paged = Is_ext && params.block_table != nullptr;
  const __half* k_base = static_cast<const __half*>(params.k_ptr) +
                         (paged ? 0 : bidb * params.k_batch_stride) + hk * params.k_head_stride;
  // A lane whose V dims lie past d (all of them: d % 8 == 0 and kDPL divides 8) reads dims
  // 0 .. kDPL - 1 of the row instead, memory lane 0 reads anyway: its O dims are never stored,
  // and the loop keeps the single key bound of d = kD.
  const __half* v_base = static_cast<const __half*>(params.v_ptr) +
                         (paged ? 0 : bidb * params.v_batch_stride) + hk * params.v_head_stride +
                         (lane * kDPL < params.d ? lane * kDPL : 0);
  // K chunks past d: zero-filled by one bool per lane and column part (within a part, a lane's
  // chunk column is the same in every row it loads: 32 % kCPR == 0). A bool stays in a predicate
  // register; a per-lane key bound in its place cost kR = 16 at d = 128 a spill.
  constexpr int kCPR = T::kKCols / 8;  // 16-byte chunks per staged K row
  static_assert(32 % kCPR == 0, "a lane's K chunk column is fixed");
  bool k_ok[T::kKParts];
#pragma unroll
  for (int kp = 0; kp < T::kKParts; ++kp) k_ok[kp] = kp * T::kKCols + (lane % kCPR) * 8 < params.d;
  __half* sK = reinterpret_cast<__half*>(smem_raw) + warp * T::kKeys * T::kRowH;
  float* sP = reinterpret_cast<float*>(smem_raw + T::kOffP) + warp * kR * T::kKeys;

  // kPipelineK: kq holds the K chunks of the warp's next step (loaded during the current one;
  // rows at or past `end` and chunks past d zero-filled, never read). Not with an attention
  // bias, whose steps may be skipped unread (below): those calls load each step's K at its start.
  // Paged, the next step's page comes from blk_next, read a step earlier still, so that no
  // table lookup precedes a load; only entries of keys below `end` are read (the table covers
  // them).
  // The extended kernels at kD = 64 keep loading K at each step's start: with the staging
  // registers their paged calls ran 20-29% slower (H100, B 1-16, 32k keys; 90 -> 142 registers
  // at kR = 1), while those at kD = 128 ran up to 11% faster (B 16, and GQA 4 at B 1-4) and up
  // to 6% slower (B 4; GQA 4 at B 16).
  constexpr bool kPipe = T::kPipelineK && (!Is_ext || kD == 128);
  static_assert(!kPipe || T::kKParts == 1, "load_k stages whole rows (one column part)");
  constexpr int64_t kStep = T::kWarps * T::kKeys;
  const bool pipe = kPipe && !(Is_ext && params.bias_ptr != nullptr);
  auto page_of = [&](int64_t key) {
    return key < end ? params.block_table[bidb * params.block_table_batch_stride +
                                          static_cast<int>(key / params.page_block_size)]
                     : 0;
  };
  // The K (or V) rows of the step at `first` start at base_ptr + first * row_stride; paged,
  // from its page's block (clamped: the check kernel has asserted the entries).
  auto step_rows = [&](const __half* base_ptr, index_t batch_stride, index_t row_stride,
                       int blk_raw, int64_t first) {
    if (!paged) return base_ptr;
    const int blk = imin(imax(blk_raw, 0), params.num_pages - 1);
    const int64_t page_first = first / params.page_block_size * params.page_block_size;
    return base_ptr + blk * batch_stride - page_first * row_stride;
  };
  uint4 kq[kPipe ? kCPR : 1];
  auto load_k = [&](const __half* k_rows, int64_t first) {
#pragma unroll
    for (int i = 0; i < kCPR; ++i) {
      const int c = i * 32 + lane, r = c / kCPR, cc = c % kCPR;
      kq[i] = make_uint4(0u, 0u, 0u, 0u);
      if (k_ok[0] && first + r < end) {
        kq[i] = __ldg(reinterpret_cast<const uint4*>(k_rows + (first + r) * params.k_row_stride +
                                                     cc * 8));
      }
    }
  };
  int blk_cur = 0, blk_next = 0;
  if constexpr (kPipe) {
    if (pipe) {
      const int64_t first = begin + static_cast<int64_t>(warp) * T::kKeys;
      if (paged) {
        blk_cur = page_of(first);
        blk_next = page_of(first + kStep);
      }
      load_k(step_rows(k_base, params.k_batch_stride, params.k_row_stride, blk_cur, first),
             first);
    }
  }
  // Steps of 128 keys; key indices in 64 bits (base + 128 can pass 2^31 - 1).
  for (int64_t base = begin + static_cast<int64_t>(warp) * T::kKeys; base < end;
       base += kStep) {
    // The warp's 32 keys lie in one page (flash.h, kPageBlockMultiple; the host sends paged
    // calls whose key ranges and splits start at multiples of 32, or one page for all rows):
    // k_step / v_step + key * row_stride address them there.
    // A step whose 32 keys the bias hides from every row (-inf / false: a static cache's
    // unfilled slots, left padding) is skipped before any K/V load: its P would be 0 for every
    // row, so m, l and O stay as they are. Warp-uniform (a vote), before the warp's barriers.
    if constexpr (Is_ext) {
      if (params.bias_ptr != nullptr) {
        const int key = static_cast<int>(base) + lane;
        bool live = false;
        if (key < end) {
          const int64_t kc = static_cast<int64_t>(key) * params.bias_col_stride;
          with_bias_kind(params, [&](auto kind) {
#pragma unroll
            for (int h = 0; h < kR; ++h) {
              live = live || bias_raw<decltype(kind)::value>(params, sRowBias[h] + kc) != -INFINITY;
            }
          });
        }
        if (!warp_any(live)) continue;
      }
    }
    const __half* k_step = k_base;
    const __half* v_step = v_base;
    if (paged) {
      if constexpr (kPipe) {
        const int blk = pipe ? blk_cur : page_of(base);
        k_step = step_rows(k_base, params.k_batch_stride, params.k_row_stride, blk, base);
        v_step = step_rows(v_base, params.v_batch_stride, params.v_row_stride, blk, base);
      } else {  // one division per step (page_of and step_rows would take two)
        const int page = static_cast<int>(base / params.page_block_size);
        const int blk = imin(imax(params.block_table[bidb * params.block_table_batch_stride + page],
                                  0), params.num_pages - 1);
        const int64_t first = static_cast<int64_t>(page) * params.page_block_size;
        k_step = k_base + blk * params.k_batch_stride - first * params.k_row_stride;
        v_step = v_base + blk * params.v_batch_stride - first * params.v_row_stride;
      }
    }
    if constexpr (T::kL2Prefetch) {
      // L2 prefetch of this step's V rows, which the P V loop reads a few rows at a time after
      // the K rows and the softmax: they arrive while those run. Asking for the next step's K
      // and V rows as well made the larger grids 30-40% slower (H100, B 16, 4k-32k keys) and
      // helped only B 1.
      if (params.l2_prefetch != 0) {
        const __half* v_row0 = v_step - (lane * kDPL < params.d ? lane * kDPL : 0);
        decode_prefetch_rows<kD>(v_row0, params.v_row_stride, base, end, params.d, lane);
      }
    }
    float s[kR];
#pragma unroll
    for (int kp = 0; kp < T::kKParts; ++kp) {
      if (kp > 0) __syncwarp();  // every lane is done with the previous part's sK
      // ---- K rows base .. base + 31, columns of part kp -> sK (rows past `end` and chunks
      // past d zero-filled, never read from memory).
      bool staged = false;  // this step's K rows already in kq (kPipe)
      if constexpr (kPipe) {
        if (pipe) {
          // This step's K from kq, then the next step's loads into it.
#pragma unroll
          for (int i = 0; i < kCPR; ++i) {
            const int c = i * 32 + lane, r = c / kCPR, cc = c % kCPR;
            *reinterpret_cast<uint4*>(sK + r * T::kRowH + cc * 8) = kq[i];
          }
          load_k(step_rows(k_base, params.k_batch_stride, params.k_row_stride, blk_next,
                           base + kStep), base + kStep);
          if (paged) {
            blk_cur = blk_next;
            blk_next = page_of(base + 2 * kStep);
          }
          staged = true;
        }
      }
      if (!staged) {
#pragma unroll
        for (int i = 0; i < kCPR; ++i) {
          const int c = i * 32 + lane, r = c / kCPR, cc = c % kCPR;
          uint4 val = make_uint4(0u, 0u, 0u, 0u);
          if (k_ok[kp] && base + r < end) {
            val = __ldg(reinterpret_cast<const uint4*>(k_step + (base + r) * params.k_row_stride +
                                                       kp * T::kKCols + cc * 8));
          }
          *reinterpret_cast<uint4*>(sK + r * T::kRowH + cc * 8) = val;
        }
      }
      __syncwarp();

      // ---- scores of key base + lane for the kR heads over the part's columns (s is zeroed
      // after the K loads: live across them, it costs the kR = 16 kernels registers).
      if (kp == 0) {
#pragma unroll
        for (int h = 0; h < kR; ++h) s[h] = 0.f;
      }
      const __half* k_row = sK + lane * T::kRowH;
      const float* q_part = sQ + kp * T::kKCols;
#pragma unroll 4
      for (int c = 0; c < T::kKCols; c += 8) {
        const uint4 kv = *reinterpret_cast<const uint4*>(k_row + c);
        const uint32_t kw[4] = {kv.x, kv.y, kv.z, kv.w};
        float kf[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = unpack_half2(kw[i]);
          kf[2 * i] = f.x;
          kf[2 * i + 1] = f.y;
        }
#pragma unroll
        for (int h = 0; h < kR; ++h) {
          const float4 qa = *reinterpret_cast<const float4*>(q_part + h * kD + c);
          const float4 qb = *reinterpret_cast<const float4*>(q_part + h * kD + c + 4);
          s[h] = fmaf(qa.x, kf[0], s[h]);
          s[h] = fmaf(qa.y, kf[1], s[h]);
          s[h] = fmaf(qa.z, kf[2], s[h]);
          s[h] = fmaf(qa.w, kf[3], s[h]);
          s[h] = fmaf(qb.x, kf[4], s[h]);
          s[h] = fmaf(qb.y, kf[5], s[h]);
          s[h] = fmaf(qb.z, kf[6], s[h]);
          s[h] = fmaf(qb.w, kf[7], s[h]);
        }
      }
    }

    // Each modification only when the call has it (uniform branches once per step): the paged
    // calls run this kernel without any, and at large GQA groups the per-row work is not free.
    if constexpr (Is_ext) {
      const int key = static_cast<int>(base) + lane;
      if (params.softcap_in != 0.f) {
#pragma unroll
        for (int h = 0; h < kR; ++h) {
          s[h] = softcap_score<false>(s[h], params.softcap_in, params.softcap_out, nullptr);
        }
      }
      if (params.alibi_slopes_ptr != nullptr) {  // ALiBi distance |diag - key| of each row
#pragma unroll
        for (int h = 0; h < kR; ++h) {
          s[h] = fmaf(sSlope[h], fabsf(static_cast<float>(sRowAlibi[h] - key)), s[h]);
        }
      }
      if (params.bias_ptr != nullptr && key < end) {
        const int64_t kc = static_cast<int64_t>(key) * params.bias_col_stride;
        with_bias_kind(params, [&](auto kind) {
#pragma unroll
          for (int h = 0; h < kR; ++h) {
            s[h] += bias_raw<decltype(kind)::value>(params, sRowBias[h] + kc);
          }
        });
      }
      if (params.decode_causal_rows) {  // each query row's own causal limit
#pragma unroll
        for (int h = 0; h < kR; ++h) {
          if (key >= sRowEnd[h]) s[h] = -INFINITY;
        }
      }
    }

    // ---- online softmax per head over the warp's 32 keys; P -> sP for the P V product.
    const bool valid = base + lane < end;
#pragma unroll
    for (int h = 0; h < kR; ++h) {
      const float x = valid ? s[h] : -INFINITY;
      const float m_new = fmaxf(m[h], warp_allreduce_max(x));
      const float ref = m_new == -INFINITY ? 0.f : m_new;  // no key yet: exp2(-inf) = 0
      const float alpha = exp2f((m[h] - ref) * scale_log2);
      const float p = exp2f((x - ref) * scale_log2);
      l[h] = l[h] * alpha + p;  // per lane; summed over the warp at the end
#pragma unroll
      for (int e = 0; e < kDPL; ++e) o[h][e] *= alpha;
      m[h] = m_new;
      sP[h * T::kKeys + lane] = p;
    }
    __syncwarp();

    // ---- O += P V: lane owns dims lane * kDPL .. + kDPL - 1; masked keys are not loaded
    // (their P is 0, and 0 * a NaN left in unused cache memory would be NaN).
#pragma unroll(kD > 128 && kR * kDPL > 32 ? 1 : 2)
    for (int j = 0; j < T::kKeys; j += 4) {
      float vf[4][kDPL];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int64_t key = base + j + jj;
        if constexpr (kDPL == 8) {
          uint4 raw = make_uint4(0u, 0u, 0u, 0u);
          if (key < end) raw = __ldg(reinterpret_cast<const uint4*>(v_step + key * params.v_row_stride));
          const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = unpack_half2(w[i]);
            vf[jj][2 * i] = f.x;
            vf[jj][2 * i + 1] = f.y;
          }
        } else if constexpr (kDPL == 4) {
          uint2 raw = make_uint2(0u, 0u);
          if (key < end) raw = __ldg(reinterpret_cast<const uint2*>(v_step + key * params.v_row_stride));
          const float2 a = unpack_half2(raw.x), b = unpack_half2(raw.y);
          vf[jj][0] = a.x;
          vf[jj][1] = a.y;
          vf[jj][2] = b.x;
          vf[jj][3] = b.y;
        } else {
          uint32_t raw = 0u;
          if (key < end) raw = __ldg(reinterpret_cast<const unsigned int*>(v_step + key * params.v_row_stride));
          const float2 a = unpack_half2(raw);
          vf[jj][0] = a.x;
          vf[jj][1] = a.y;
        }
      }
#pragma unroll
      for (int h = 0; h < kR; ++h) {
        const float4 p4 = *reinterpret_cast<const float4*>(sP + h * T::kKeys + j);
#pragma unroll
        for (int e = 0; e < kDPL; ++e) {
          o[h][e] = fmaf(p4.x, vf[0][e], o[h][e]);
          o[h][e] = fmaf(p4.y, vf[1][e], o[h][e]);
          o[h][e] = fmaf(p4.z, vf[2][e], o[h][e]);
          o[h][e] = fmaf(p4.w, vf[3][e], o[h][e]);
        }
      }
    }
    __syncwarp();  // sK and sP are rewritten by the next step
  }

  // ---- merge the 4 warps (sO aliases sK: wait until every warp has left the loop).
#pragma unroll
  for (int h = 0; h < kR; ++h) l[h] = warp_allreduce_sum(l[h]);
  __syncthreads();
  float* sO = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int h = 0; h < kR; ++h) {
    if (lane == 0) {
      sM[warp * kR + h] = m[h];
      sL[warp * kR + h] = l[h];
    }
#pragma unroll
    for (int e = 0; e < kDPL; ++e) sO[(warp * kR + h) * kD + lane * kDPL + e] = o[h][e];
  }
  __syncthreads();
  const int e_bidb = sCta[0], e_h0 = sCta[1], e_nh = sCta[2], e_split = sCta[3];
  for (int i = tid; i < e_nh * kD; i += T::kThreads) {
    const int h = i / kD, c = i % kD;
    if (c >= params.d) continue;
    SoftmaxMerge<1> st;  // the warps' (m, l, unnormalised O) of head h, output dim c
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) st.max_with(sM[w * kR + h]);
    st.start();
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) {
      st.add_unnormalised(st.weight(sM[w * kR + h], scale_log2), sL[w * kR + h],
                          [&](int) { return sO[(w * kR + h) * kD + c]; });
    }
    float out[1], lse;
    st.result(params.scale_softmax, out, lse);
    // Row h's q-head and query: the plain kernels' rows are q-heads of query 0; the extended
    // ones recompute (query, q-head) from the CTA's index (no register kept across the loop).
    int hq = e_h0 + h, qi = 0;
    if constexpr (Is_ext) {
      const int f = static_cast<int>(blockIdx.x % parts) * kR + h;
      hq = (e_h0 - static_cast<int>(blockIdx.x % parts) * kR) + f % ratio;
      qi = f / ratio;
    }
    if (params.num_splits == 1) {
      __half* o_ptr = static_cast<__half*>(params.o_ptr) + e_bidb * params.o_batch_stride +
                      hq * params.o_head_stride;
      if constexpr (Is_ext) o_ptr += qi * params.o_row_stride;
      o_ptr[c] = __float2half_rn(clamp_to_fp16_range(out[0]));
      if (c == 0) {
        int64_t lrow = static_cast<int64_t>(e_bidb) * params.h + hq;
        if constexpr (Is_ext) lrow = lrow * params.seqlen_q + qi;  // LSE (b, h, seqlen_q)
        params.softmax_lse_ptr[lrow] = lse;
      }
    } else {
      // The split's raw max m and its sum l (relative to m), not one LSE: in fp32, m * scale +
      // log(l) loses log(l) once |m * scale| is large, and the merge would weight the splits
      // wrongly (O = 2 instead of 1 at scores ~1e8; tests/emu check_decode_split_merges).
      // Workspace rows ((split, b, h, seqlen_q)): seqlen_q is 1 in the plain kernels.
      int64_t rows = static_cast<int64_t>(params.num_splits) * params.b * params.h;
      int64_t row = (static_cast<int64_t>(e_split) * params.b + e_bidb) * params.h + hq;
      if constexpr (Is_ext) {
        rows *= params.seqlen_q;
        row = row * params.seqlen_q + qi;
      }
      params.oaccum_ptr[row * params.d + c] = out[0];
      if (c == 0) {
        params.softmax_lseaccum_ptr[row] = st.m;
        params.softmax_lseaccum_ptr[rows + row] = st.sum;
      }
    }
  }
}

// Merge of the splits of each (batch, q-head) row from their (m_s, l_s, normalised O_s)
// (SoftmaxMerge, state.h). One warp per row.
template <int kD>
__global__ void __launch_bounds__(128) flash_fwd_decode_merge_kernel(const Flash_fwd_params params) {
  constexpr int kDPL = kD / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // (bidb * h + hq) * seqlen_q + query: seqlen_q > 1 only from the extended kernels' rows.
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + warp;
  const int64_t rows = static_cast<int64_t>(params.b) * params.h * params.seqlen_q;
  if (row >= rows || lane * kDPL >= params.d) return;  // lanes past d: no dims (d % 8 == 0)
  const int64_t bh = row / params.seqlen_q;
  const int qi = static_cast<int>(row % params.seqlen_q);
  const int bidb = static_cast<int>(bh / params.h), hq = static_cast<int>(bh % params.h);
  const float* m_s = params.softmax_lseaccum_ptr;
  const float* l_s = m_s + rows * params.num_splits;
  SoftmaxMerge<kDPL> st;
  for (int s = 0; s < params.num_splits; ++s) st.max_with(m_s[s * rows + row]);
  st.start();
  for (int s = 0; s < params.num_splits; ++s) {
    st.add_normalised(st.weight(m_s[s * rows + row], params.scale_softmax_log2), l_s[s * rows + row],
                      [src = params.oaccum_ptr + (s * rows + row) * params.d + lane * kDPL](int e) {
                        return src[e];
                      });
  }
  __half* o_ptr = static_cast<__half*>(params.o_ptr) + bidb * params.o_batch_stride +
                  qi * params.o_row_stride + hq * params.o_head_stride + lane * kDPL;
#pragma unroll
  for (int e = 0; e < kDPL; ++e) o_ptr[e] = __float2half_rn(clamp_to_fp16_range(st.out(e)));
  if (lane == 0) params.softmax_lse_ptr[row] = st.lse(params.scale_softmax);
}

}  // namespace flash_sm75
