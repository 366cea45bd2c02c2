// FlashAttention forward for SM75 (Turing) tensor cores.
//
// Algorithm: FlashAttention-2 forward (Dao, arXiv:2307.08691, Algorithm 1) with the online
// softmax of FlashAttention (Dao et al., arXiv:2205.14135): for a tile of Br query rows, stream
// the K/V tiles of Bc keys, keep the running row max m_i, the running row sum l_i and the
// unnormalised output acc_o in registers, rescale them when the max grows, and normalise once
// at the end. Names follow the Triton tutorial (m_i, l_i, acc).
//
// SM75 specifics (see DESIGN.md):
//  * mma.sync.m16n8k8 (fp16 in, fp32 accumulate) for both S = Q K^T and O += P V. The fp32
//    accumulator fragment of S has the same layout as the fp16 A fragment of the next MMA, so
//    P = exp2(S * scale_log2 - m) is packed to fp16 in registers and never touches shared memory.
//  * ldmatrix (x4) loads Q and K fragments, ldmatrix.trans loads V fragments from an XOR-swizzled
//    (d = 96: row-padded, smem_layout.h) shared-memory layout without bank conflicts.
//  * No cp.async on SM75: the next tile's global loads are issued into registers before the
//    current tile's MMAs and written to shared memory after them (register double buffering):
//    V_j is fetched while S_j = Q K_j^T and its softmax run, K_{j+1} while O += P_j V_j runs.
//  * Split tile (d = 128, Flash_fwd_kernel_traits::kSplitTile): each K/V tile as two halves of
//    Bc/2 keys, the softmax of one half in the same branch-free code as the MMAs of the other
//    (softmax_step), so one warp can overlap its own softmax with tensor-core work.
//  * Head-dim split (d = 256, Flash_fwd_kernel_traits::kDSplit = 2): two warps share 16 query
//    rows, each holding half of Q's and O's columns; their partial S tiles are summed through
//    shared memory between the loop's two barriers (no extra barrier).
#pragma once

#include <cmath>
#include <cuda_fp16.h>

#include "block_info.h"
#include "dropout.h"
#include "flash.h"
#include "fragment.h"
#include "kernel_traits.h"
#include "mask.h"
#include "score_mod.h"
#include "seq_info.h"
#include "softmax.h"
#include "tile_io.h"
#include "utils.h"

namespace flash_sm75 {

// Which (batch, head, query tile) a CTA owns and where its tensors start. A 1-D grid, so
// batch x heads is not limited by gridDim.y/z. Causal: the heaviest query tiles (last rows) are
// scheduled first. Packed sequences (Is_ext): the grid covers the longest one; a CTA whose
// tile lies past its own entry's length has nothing to do (fwd_cta_idle).
// Key splits (Is_ext, params.num_splits > 1: the KV-cache op's queries against a long cache,
// plan_fwd_splits): the grid is num_splits copies of the tiles, split s (the slowest index)
// taking the s-th of num_splits equal runs of its tile's own key blocks (the sequence's keys
// that the tile's rows see, not the cache's capacity: a long static cache with short sequences
// still spreads their keys; a run past them is an empty split, which still writes its rows);
// store_output writes each split's (m, l, O) to the workspace that
// flash_fwd_decode_merge_kernel combines.
template <bool Is_ext>
struct FwdCta {
  int m_block, bidb, bidh;
  int split;  // key split (0 unless Is_ext with num_splits > 1)
  int64_t bh;
  const __half *q_base, *k_base, *v_base;
  __half* o_base;
  SeqInfo<Is_ext> si;
  KeyRange kr;
  BlockRange nb;
};

template <typename Kt, bool Is_causal, bool Is_local, bool Is_ext>
__device__ __forceinline__ FwdCta<Is_ext> fwd_cta(const Flash_fwd_params& params) {
  const int num_m_blocks = ceil_div(params.seqlen_q, Kt::kBlockM);
  const int64_t num_bh = static_cast<int64_t>(params.b) * params.h;
  int64_t linear = blockIdx.x;
  int split = 0;
  if constexpr (Is_ext) {
    if (params.num_splits > 1) {
      const int64_t tiles = static_cast<int64_t>(num_m_blocks) * num_bh;
      split = static_cast<int>(linear / tiles);
      linear -= split * tiles;
    }
  }
  int m_block;
  int64_t bh;
  if (Is_causal) {
    const TileOrder o = causal_tile_order(linear, num_m_blocks, num_bh);
    bh = o.bh;
    m_block = num_m_blocks - 1 - o.rank;
  } else {
    m_block = static_cast<int>(linear % num_m_blocks);
    bh = linear / num_m_blocks;
  }
  const int bidb = static_cast<int>(bh / params.h);
  FwdCta<Is_ext> c{m_block, bidb, static_cast<int>(bh % params.h), split, bh, nullptr, nullptr,
                   nullptr, nullptr, SeqInfo<Is_ext>(params, bidb), KeyRange{}, BlockRange{}};
  const int bidh_k = c.bidh / params.h_h_k_ratio;  // GQA: no K/V copy, just index the shared head
  c.q_base = static_cast<const __half*>(params.q_ptr) +
             c.si.q_offset(c.bidb, params.q_batch_stride, params.q_row_stride) +
             c.bidh * params.q_head_stride;
  c.k_base = static_cast<const __half*>(params.k_ptr) +
             c.si.k_offset(c.bidb, params.k_batch_stride, params.k_row_stride) +
             bidh_k * params.k_head_stride;
  c.v_base = static_cast<const __half*>(params.v_ptr) +
             c.si.k_offset(c.bidb, params.v_batch_stride, params.v_row_stride) +
             bidh_k * params.v_head_stride;
  c.o_base = static_cast<__half*>(params.o_ptr) +
             c.si.q_offset(c.bidb, params.o_batch_stride, params.o_row_stride) +
             c.bidh * params.o_head_stride;
  c.kr = c.si.keys(bidb);
  c.nb = n_block_range<Is_local>(c.m_block, Kt::kBlockM, Kt::kBlockN, c.si.seqlen_q(), c.kr,
                                 Is_causal, c.si.causal_off(), c.si.window_lower());
  if constexpr (Is_ext) {
    if (params.num_splits > 1) {
      const int per = ceil_div(imax(c.nb.n_block_max - c.nb.n_block_min, 0), params.num_splits);
      c.nb.n_block_min += split * per;
      c.nb.n_block_max = imin(c.nb.n_block_max, c.nb.n_block_min + per);
    }
  }
  return c;
}

// A packed entry shorter than the grid's longest: tiles past its rows write nothing (their rows
// belong to no query of this entry).
template <typename Kt, bool Is_ext>
__device__ __forceinline__ bool fwd_cta_idle(const FwdCta<Is_ext>& c) {
  if constexpr (!Is_ext) return false;
  return c.m_block * Kt::kBlockM >= c.si.seqlen_q();
}

// Epilogue: O = acc_o / l, LSE = m * scale + log(l); rows that saw no key get O = 0 and
// LSE = -inf (never NaN). The fp16 O tile is staged through shared memory sO (Br x d, free for
// this warp's rows when called) so the global stores are 16-byte, row-contiguous, coalesced.
// exact_exp: the warp's last exponents took the exact path (softmax_rescale; key splits only).
// Dropout: O times the kept probabilities' 1 / (1 - p) (the extended and dropout-only kernels).
template <typename Kt, bool Is_ext, bool Dropout = Is_ext>
__device__ __forceinline__ void store_output(float (&acc_o)[Kt::kDCols / 8][4],
                                             const float (&m_i)[2], const float (&l_i)[2],
                                             const Flash_fwd_params& params, const FwdCta<Is_ext>& c,
                                             __half* sO, bool exact_exp) {
  constexpr int kDCols = Kt::kDCols;
  constexpr int kCPR = Kt::kChunksPerRow;
  using L = SmemRows<kCPR, Kt::kPaddedRows>;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // This warp's 16 rows and its first head-dim chunk (kDSplit: its part of the columns).
  const int rw = Kt::kDSplit > 1 ? warp % Kt::kRowWarps : warp;
  const int ch0 = Kt::kDSplit > 1 ? warp / Kt::kRowWarps * (kDCols / 8) : 0;
  const int row0 = c.m_block * Kt::kBlockM;
  if constexpr (Is_ext) {
    if (params.num_splits > 1) {
      // A key split: its raw max m, its sum l (relative to m) and its normalised O (fp32) per
      // row, in flash_fwd_decode_merge_kernel's workspace (rows (split, b, h, seqlen_q), O
      // indexed with d): m and l rather than one LSE, which in fp32 loses log(l) once |m scale|
      // is large (flash_decode_kernel.h). No dropout here (the host splits no dropout call).
      float l_sum[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) l_sum[r] = quad_allreduce_sum(l_i[r]);
      if (!Kt::kSplitTile && !exact_exp) {
        // These tiles' exponents are measured from rn(m c) (c = scale_softmax_log2: FFMA(s, c,
        // -rn(m c)), softmax.h); the merge weighs a split by exp2((m_s - M) c), from the exact
        // m c. Within one kernel the shift cancels; across splits it does not (up to half an
        // ulp of |m c| in the exponent: 1e-2 errors in O at scores ~2^21). So l is moved to
        // the exact shift by the residual m c - rn(m c). The split tile's exponents already
        // take the residual (ExpForm::kResidual). On the exact path (|m c| >= 2^24, rn(s c) -
        // rn(m c)) the residual is an ulp of 2 or more, far from the grid those exponents use:
        // l stays as it is there (exact for tied maxima across splits, as the unsplit kernel's
        // own exponents are there; tests/emu check_huge_scores).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (m_i[r] != -INFINITY) {
            const float sm = __fmul_rn(m_i[r], params.scale_softmax_log2);
            l_sum[r] *= exp2f(-fmaf(m_i[r], params.scale_softmax_log2, -sm));
          }
        }
      }
      float lse_unused[2];
      softmax_normalize<kDCols>(acc_o, m_i, l_i, params.scale_softmax, lse_unused);
      const int64_t rows = static_cast<int64_t>(params.num_splits) * params.b * params.h *
                           params.seqlen_q;
      const int64_t row_base =
          ((static_cast<int64_t>(c.split) * params.b + c.bidb) * params.h + c.bidh) *
          params.seqlen_q;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 16 * rw + g + 8 * r;
        if (row >= c.si.seqlen_q()) continue;
        float* o_ws = params.oaccum_ptr + (row_base + row) * params.d;
#pragma unroll
        for (int dt = 0; dt < kDCols / 8; ++dt) {
          const int col = (ch0 + dt) * 8 + 2 * t;  // d is a multiple of 8: col + 1 < d too
          if (Kt::kFullHeadDimOnly || col < params.d) {
            *reinterpret_cast<float2*>(o_ws + col) =
                make_float2(acc_o[dt][2 * r], acc_o[dt][2 * r + 1]);
          }
        }
        if (t == 0 && ch0 == 0) {  // kDSplit: the pair holds the same m and l
          params.softmax_lseaccum_ptr[row_base + row] = m_i[r];
          params.softmax_lseaccum_ptr[rows + row_base + row] = l_sum[r];
        }
      }
      return;
    }
  }
  // One m16 row tile per warp. [1][2] rather than [2]: the flat array changes ptxas's register
  // assignment of this kernel (d = 64), this shape keeps the SASS it had with warps of more tiles.
  float lse[1][2];
  if constexpr (Dropout) {
    if (params.dropout) {  // the kept probabilities' 1 / (1 - p), once on O (dropout.h)
#pragma unroll
      for (int dt = 0; dt < kDCols / 8; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[dt][e] *= params.dropout_rp;
      }
    }
  }
  softmax_normalize<kDCols>(acc_o, m_i, l_i, params.scale_softmax, lse[0]);
#pragma unroll
  for (int dt = 0; dt < kDCols / 8; ++dt) {
    const int row = 16 * rw + g;
    *reinterpret_cast<uint32_t*>(sO + L::offset(row, ch0 + dt) + 2 * t) =
        pack_half2(clamp_to_fp16_range(acc_o[dt][0]), clamp_to_fp16_range(acc_o[dt][1]));
    *reinterpret_cast<uint32_t*>(sO + L::offset(row + 8, ch0 + dt) + 2 * t) =
        pack_half2(clamp_to_fp16_range(acc_o[dt][2]), clamp_to_fp16_range(acc_o[dt][3]));
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < Kt::kQChunksPerThread; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / kCPR;
    const int ch = idx % kCPR;
    const int grow = row0 + r;
    // No column past head_dim d (head_dims.h).
    if (grow < c.si.seqlen_q() && (Kt::kFullHeadDimOnly || ch < params.d / 8)) {
      *reinterpret_cast<uint4*>(c.o_base + grow * params.o_row_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sO + L::offset(r, ch));
    }
  }
  if (t == 0 && ch0 == 0) {  // kDSplit: the pair holds the same LSE; one warp writes it
    float* lse_base = params.softmax_lse_ptr;
    if constexpr (Is_ext) {
      lse_base += c.si.lse_index(c.bidb, c.bidh, 0);
    } else {
      lse_base += c.bh * params.seqlen_q;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 16 * rw + g + 8 * r;
      if (row < c.si.seqlen_q()) lse_base[row] = lse[0][r];
    }
  }
}

// The main forward kernel: all warps in lock-step, two barriers per K/V tile.
// Is_local: the causal band has a lower diagonal too (a sliding window, params.window_lower).
// Variant (flash.h, fwd_variant): kFwdExt runs every extended feature its flags switch on
// (score modifiers, bias, dropout, packed / paged sequences, key splits); kFwdDropout only adds
// dropout to the plain kernel; kFwdBias only adds an
// attention bias to the plain kernel.
template <typename Kt, bool Is_causal, bool Is_local = false, int Variant = kFwdPlain>
__global__ void __launch_bounds__(Kt::kNThreads,
                                  Variant == kFwdExt || Variant == kFwdDropout
                                      ? Kt::kMinBlocksPerSmMod
                                      : Variant == kFwdBias ? Kt::kMinBlocksPerSmBias
                                                            : Kt::kMinBlocksPerSm)
    flash_fwd_kernel(const Flash_fwd_params params) {
  constexpr bool Is_ext = Variant == kFwdExt;
  // The bias's code (always on in kFwdBias, where bias_ptr is set; by flag in kFwdExt).
  constexpr bool Has_bias = Variant == kFwdExt || Variant == kFwdBias;
  // Dropout's code (always on in kFwdDropout, by flag in kFwdExt).
  constexpr bool kDropout = Variant == kFwdExt || Variant == kFwdDropout;
  constexpr int kKinds = Variant == kFwdBias ? kFwdBiasKinds : kAllBiasKinds;  // bias kinds
  constexpr int kD = Kt::kHeadDim;
  constexpr int kDCols = Kt::kDCols;  // head-dim columns of this warp's Q and O
  constexpr int kBN = Kt::kBlockN;
  constexpr int kCPR = Kt::kChunksPerRow;
  constexpr bool kPad = Kt::kPaddedRows;  // shared layout (smem_layout.h): padded or swizzled
  constexpr int kRowBytes = Kt::kRowHalves * 2;
  constexpr int kLs = Kt::kLoadStyle;  // load_tile_g2r address arithmetic
  // 16-byte chunks of a row that exist (head_dims.h: the tail past head_dim d).
  const int dc = Kt::kFullHeadDimOnly ? kCPR : params.d / 8;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // kQInSmem: [sQ: Br x d][sK][sV], O staged through sQ. Otherwise [sK][sV], with the Q tile
  // (before the loop) and the O tile (after it) staged through the contiguous K+V space.
  // kDSplit > 1: then [sX], one 16 x Bc fp32 partial-S slot per warp.
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sK = reinterpret_cast<__half*>(smem_raw + Kt::kSmemKVOffset);  // Bc x d
  __half* sV = sK + kBN * Kt::kRowHalves;                                // Bc x d
  float4* sX = reinterpret_cast<float4*>(smem_raw + Kt::kSmemExchangeOffset);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  // The warp's 16-row group, and its part of the head dim (0 unless kDSplit > 1).
  const int rw = Kt::kDSplit > 1 ? warp % Kt::kRowWarps : warp;
  const int dpart = Kt::kDSplit > 1 ? warp / Kt::kRowWarps : 0;
  // Chunk pairs (16 columns) before this warp's columns: chunk_pair_addr moves any lane address
  // there, as it moves between the chunk pairs of a GEMM.
  const int kk0 = dpart * (kDCols / 16);
  if constexpr (kDropout) dropout_save_state(params);
  const FwdCta<Is_ext> c = fwd_cta<Kt, Is_causal, Is_local, Is_ext>(params);
  if (fwd_cta_idle<Kt>(c)) return;  // uniform over the CTA, before any barrier
  const int row0 = c.m_block * Kt::kBlockM;
  const float scale_log2 = params.scale_softmax_log2;
  // L2 prefetch distance in key rows (params.l2_prefetch tiles: run_flash_fwd puts the tile's
  // kL2PrefetchTiles there for 'auto', -1, so a launch that skips it prefetches nothing;
  // load_tile_g2r): the plain kernels' loops (in the bias-only kernels at d = 128 its address
  // arithmetic spilled 12 bytes).
  constexpr bool kPf = Variant == kFwdPlain && Kt::kL2PrefetchTiles > 0;
  const int pf_rows = kPf ? params.l2_prefetch * kBN : 0;
  ScoreMod smod{};
  if constexpr (Is_ext) smod = score_mod_for(params, c.bidb, c.bidh, c.si.alibi_off());
  if constexpr (Variant == kFwdBias) smod.bias_off = bias_offset(params, c.bidb, c.bidh);
  // Whether the scores get a bias (uniform; always in kFwdBias, where it is still tested at run
  // time: as a constant, ptxas spilled 4 bytes of the d = 128 kernel at 255 registers).
  const bool biased = Has_bias && params.bias_ptr != nullptr;

  float m_i[2] = {-INFINITY, -INFINITY};  // running max of raw scores, rows g and g + 8
  bool exact_exp = false;  // softmax_rescale: the warp's scaled max needs exact exponents
  float l_i[2] = {0.f, 0.f};              // running sum of exp2(s * scale_log2 - m), per thread
  float acc_o[kDCols / 8][4];             // unnormalised O, 16 x d (d / kDSplit) per warp
  zero_acc(acc_o);

  // K / V tile bases: the page holding the tile's first key when K/V are paged (seq_info.h).
  auto k_tile = [&](int row) {
    return c.si.paged_base(c.k_base, row, params.k_batch_stride, params.k_row_stride);
  };
  auto v_tile = [&](int row) {
    return c.si.paged_base(c.v_base, row, params.v_batch_stride, params.v_row_stride);
  };

  if (c.nb.n_block_max > c.nb.n_block_min) {
    uint4 stage[Kt::kChunksPerThread];
    // ---- prologue: the Q tile and the first K tile are fetched together (one global-memory
    // round trip, not two); Q -> shared -> (unless kQInSmem) registers, then K_0 -> sK.
    const uint32_t q_lane_addr =
        chunk_pair_addr<kPad>(lane_addr_a<kCPR, kPad>(sQ, 16 * rw, lane), kk0);
    {
      uint4 qstage[Kt::kQChunksPerThread];
      load_tile_g2r<Kt, kLs>(qstage, c.q_base, params.q_row_stride, row0, 0, c.si.seqlen_q(), tid,
                             dc);
      load_tile_g2r<Kt, kLs>(stage, k_tile(c.nb.n_block_min * kBN), params.k_row_stride,
                             c.nb.n_block_min * kBN, c.kr.key_start, c.kr.key_end, tid, dc);
      store_tile_r2s<Kt>(qstage, sQ, tid);
    }
    // Without kQInSmem, Q stays in registers for the whole loop: q_frag[kk] holds the A
    // fragments of k-steps 2kk (regs 0, 1) and 2kk + 1 (regs 2, 3) for this warp's 16 rows
    // (and its kDCols columns).
    uint32_t q_frag[Kt::kQInSmem ? 1 : kDCols / 16][4];
    if (!Kt::kQInSmem) {
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < (Kt::kQInSmem ? 1 : kDCols / 16); ++kk) {
        ldmatrix_x4(q_frag[kk], chunk_pair_addr<kPad>(q_lane_addr, kk));
      }
      __syncthreads();  // every warp holds its Q fragments before the space is reused
    }
    store_tile_r2s<Kt>(stage, sK, tid);
    __syncthreads();

    // Per-lane ldmatrix base addresses (chunk pair 0 of this warp's columns; fragment.h): K
    // non-transposed as B of S = Q K^T, V transposed as B of O += P V.
    const uint32_t k_lane_addr = chunk_pair_addr<kPad>(lane_addr_b<kCPR, kPad>(sK, lane), kk0);
    const uint32_t v_lane_addr = chunk_pair_addr<kPad>(lane_addr_bt<kCPR, kPad>(sV, lane), kk0);

    if constexpr (Kt::kDSplit > 1) {
      // This warp's exchange slot and its partner's (the other half of the head dim, same rows).
      // Lane-major float4s: a warp's 16-byte accesses are contiguous, conflict-free.
      float4* x_own = sX + warp * (kBN / 8) * 32 + lane;
      const float4* x_other = sX + (warp + Kt::kRowWarps) % Kt::kNWarps * (kBN / 8) * 32 + lane;
      for (int n_block = c.nb.n_block_min; n_block < c.nb.n_block_max; ++n_block) {
        load_tile_g2r<Kt, kLs>(stage, v_tile(n_block * kBN), params.v_row_stride,
                               n_block * kBN, c.kr.key_start, c.kr.key_end, tid, dc);
        // Partial S over this warp's columns; the slot was read by the partner before the
        // previous tile's last barrier.
        float acc_s[kBN / 8][4];
        gemm_rs_bt<kDCols, kBN, kRowBytes, kPad>(acc_s, q_frag, k_lane_addr);
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
          x_own[32 * j] = make_float4(acc_s[j][0], acc_s[j][1], acc_s[j][2], acc_s[j][3]);
        }
        store_tile_r2s<Kt>(stage, sV, tid);
        __syncthreads();  // V_j and the partial S tiles visible; every warp is done with K_j

        const bool has_next = n_block + 1 < c.nb.n_block_max;
        if (has_next) {  // K_{j+1}: global loads in flight during the softmax and O += P V_j
          load_tile_g2r<Kt, kLs>(stage, k_tile((n_block + 1) * kBN), params.k_row_stride,
                                 (n_block + 1) * kBN, c.kr.key_start, c.kr.key_end, tid, dc);
        }
        // S = own + partner's partial: the pair computes the same sums (fp32 addition
        // commutes), so both run the same softmax on bitwise equal scores.
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
          const float4 x = x_other[32 * j];
          acc_s[j][0] += x.x;
          acc_s[j][1] += x.y;
          acc_s[j][2] += x.z;
          acc_s[j][3] += x.w;
        }
        if constexpr (Has_bias) mod_scores<kBN, Kt::kBiasFastPath, Is_ext, kKinds>(acc_s, smod, row0 + 16 * rw, n_block * kBN, params);
        mask_scores<Is_causal, Is_local, Kt::kBlockM, kBN>(acc_s, c.m_block, n_block, c.kr, row0 + 16 * rw,
                                                 c.si.causal_off(), c.si.window_lower());
        uint32_t p_frag[kBN / 8][2];
        softmax_rescale<kBN, kDCols, Kt::kRescaleThreshold>(acc_s, m_i, l_i, acc_o, scale_log2,
                                                            p_frag, exact_exp);
        if (kDropout && params.dropout) {  // both warps of the pair drop the same elements
          dropout_p_frag<kBN / 8>(p_frag, dropout_rng(params), static_cast<uint32_t>(c.bh),
                                  row0 + 16 * rw, n_block * kBN, params.dropout_keep_threshold);
        }
        gemm_rs_t<kBN, kDCols, kRowBytes, !kPad>(acc_o, p_frag, v_lane_addr);  // O += P V
        if (has_next) store_tile_r2s<Kt>(stage, sK, tid);
        __syncthreads();  // K_{j+1} visible; every warp is done with V_j and the slots
      }
    } else if constexpr (Kt::kSplitTile) {
      // The bias-only kernel loads a bias's half blocks (BiasPrefetch, 9 registers) one half
      // ahead: half b's before S_b, and the next tile's half a as soon as half b's is added
      // (pf_next), so that those loads are in flight during this tile's O += P V and the next
      // one's S_a. Loaded just before S_a, their latency outlasted its 64 MMAs (ncu: the first
      // conversion of half a's bias was the kernel's most sampled stall). The extended kernel
      // keeps loading each half just before its MMAs (as measured; the change not tried there).
      constexpr bool kBiasAhead = Variant == kFwdBias;
      BiasPrefetch<kBN / 2> pf_next;
      pf_next.ok = false;
      if (kBiasAhead && Kt::kBiasFastPath && biased) {
        bias_prefetch<kBN / 2, kKinds>(pf_next, params, smod, row0 + 16 * warp,
                                       c.nb.n_block_min * kBN);
      }
      for (int n_block = c.nb.n_block_min; n_block < c.nb.n_block_max; ++n_block) {
        // The split tile: halves a (keys 0 .. Bc/2 - 1) and b of K_j / V_j.
        constexpr int kHalf = kBN / 2;
        constexpr uint32_t kHalfBytes = kHalf * kRowBytes;
        load_tile_g2r<Kt, kLs, kPf>(stage, v_tile(n_block * kBN), params.v_row_stride,
                               n_block * kBN, c.kr.key_start, c.kr.key_end, tid, dc, pf_rows,
                               c.kr.key_end);
        float acc_sa[kHalf / 8][4], acc_sb[kHalf / 8][4], alpha[2];
        uint32_t p_a[kHalf / 8][2], p_b[kHalf / 8][2];
        // A bias's half block loaded before the MMAs of its half (half a's before S_a, half
        // b's before S_b); with kBiasAhead, half a's is already in pf_next.
        BiasPrefetch<kHalf> pf_here;
        BiasPrefetch<kHalf>& pf = kBiasAhead ? pf_next : pf_here;
        if constexpr (!kBiasAhead) {
          pf.ok = false;
          if (Kt::kBiasFastPath && biased) {
            bias_prefetch<kHalf, kKinds>(pf, params, smod, row0 + 16 * warp, n_block * kBN);
          }
        }
        gemm_rs_bt<kD, kHalf, kRowBytes, kPad>(acc_sa, q_frag, k_lane_addr);
        if constexpr (Has_bias) {
          mod_scores<kHalf, Kt::kBiasFastPath, Is_ext, kKinds>(acc_sa, smod, row0 + 16 * warp, n_block * kBN,
                                               params, Kt::kBiasFastPath ? &pf : nullptr);
        }
        mask_scores<Is_causal, Is_local, Kt::kBlockM, kHalf>(acc_sa, c.m_block, 2 * n_block, c.kr,
                                                   row0 + 16 * warp, c.si.causal_off(),
                                                   c.si.window_lower());
        if (Kt::kBiasFastPath && biased) {
          bias_prefetch<kHalf, kKinds>(pf, params, smod, row0 + 16 * warp, n_block * kBN + kHalf);
        }
        // S_b = Q K_b^T beside the softmax of half a.
        gemm_rs_bt<kD, kHalf, kRowBytes, kPad>(acc_sb, q_frag, k_lane_addr + kHalfBytes);
        if (softmax_step<kHalf, Kt::kRescaleThreshold>(acc_sa, m_i, l_i, scale_log2, p_a, alpha,
                                                       exact_exp)) {
          rescale_o<kD>(acc_o, alpha);
        }
        if (kDropout && params.dropout) {
          dropout_p_frag<kHalf / 8>(p_a, dropout_rng(params), static_cast<uint32_t>(c.bh),
                                    row0 + 16 * warp, n_block * kBN,
                                    params.dropout_keep_threshold);
        }
        if constexpr (Has_bias) {
          mod_scores<kHalf, Kt::kBiasFastPath, Is_ext, kKinds>(acc_sb, smod, row0 + 16 * warp,
                                               n_block * kBN + kHalf, params,
                                               Kt::kBiasFastPath ? &pf : nullptr);
        }
        if (kBiasAhead && Kt::kBiasFastPath && biased && n_block + 1 < c.nb.n_block_max) {
          bias_prefetch<kHalf, kKinds>(pf, params, smod, row0 + 16 * warp, (n_block + 1) * kBN);
        }
        mask_scores<Is_causal, Is_local, Kt::kBlockM, kHalf>(acc_sb, c.m_block, 2 * n_block + 1, c.kr,
                                                   row0 + 16 * warp, c.si.causal_off(),
                                                   c.si.window_lower());
        store_tile_r2s<Kt>(stage, sV, tid);
        __syncthreads();  // V_j visible; every warp is done with K_j
        const bool has_next = n_block + 1 < c.nb.n_block_max;
        if (has_next) {
          load_tile_g2r<Kt, kLs, kPf>(stage, k_tile((n_block + 1) * kBN), params.k_row_stride,
                                 (n_block + 1) * kBN, c.kr.key_start, c.kr.key_end, tid, dc,
                                 pf_rows, c.kr.key_end);
        }
        // O += P_a V_a beside the softmax of half b; O is rescaled for b's max only after it.
        gemm_rs_t<kHalf, kD, kRowBytes, !kPad>(acc_o, p_a, v_lane_addr);
        if (softmax_step<kHalf, Kt::kRescaleThreshold>(acc_sb, m_i, l_i, scale_log2, p_b, alpha,
                                                       exact_exp)) {
          rescale_o<kD>(acc_o, alpha);
        }
        if (kDropout && params.dropout) {
          dropout_p_frag<kHalf / 8>(p_b, dropout_rng(params), static_cast<uint32_t>(c.bh),
                                    row0 + 16 * warp, n_block * kBN + kHalf,
                                    params.dropout_keep_threshold);
        }
        gemm_rs_t<kHalf, kD, kRowBytes, !kPad>(acc_o, p_b, v_lane_addr + kHalfBytes);
        if (has_next) store_tile_r2s<Kt>(stage, sK, tid);
        __syncthreads();  // K_{j+1} visible; every warp is done with V_j
      }
    } else {
      // kFreshKVBase (dense calls): the K / V tile bases recomputed from the parameters per tile,
      // as fwd_cta forms them (two 32-bit indices live through the loop instead of two 64-bit
      // pointers).
      auto k_next = [&](int row) {
        if constexpr (Kt::kFreshKVBase && !Is_ext) {
          return static_cast<const __half*>(params.k_ptr) + c.bidb * params.k_batch_stride +
                 (c.bidh / params.h_h_k_ratio) * params.k_head_stride;
        } else {
          return k_tile(row);
        }
      };
      auto v_next = [&](int row) {
        if constexpr (Kt::kFreshKVBase && !Is_ext) {
          return static_cast<const __half*>(params.v_ptr) + c.bidb * params.v_batch_stride +
                 (c.bidh / params.h_h_k_ratio) * params.v_head_stride;
        } else {
          return v_tile(row);
        }
      };
      for (int n_block = c.nb.n_block_min; n_block < c.nb.n_block_max; ++n_block) {
        // V_j: global loads in flight while S_j and its softmax are computed.
        load_tile_g2r<Kt, kLs, kPf>(stage, v_next(n_block * kBN), params.v_row_stride,
                               n_block * kBN, c.kr.key_start, c.kr.key_end, tid, dc, pf_rows,
                               c.kr.key_end);

        // ---- S = Q K_j^T (16 x Bc per warp, fp32), masked, then the online softmax. A bias's
        // block is loaded before the MMAs.
        BiasPrefetch<kBN> pf;
        pf.ok = false;
        if (Kt::kBiasFastPath && biased) {
          bias_prefetch<kBN, kKinds>(pf, params, smod, row0 + 16 * warp, n_block * kBN);
        }
        float acc_s[kBN / 8][4];
        if constexpr (Kt::kQInSmem) {
          gemm_ss_bt<kD, kBN, kRowBytes, kPad>(acc_s, q_lane_addr, k_lane_addr);
        } else if constexpr (Kt::kTwoScoreSets && Variant == kFwdPlain) {
          gemm_rs_bt_2acc<kD, kBN, kRowBytes, kPad>(acc_s, q_frag, k_lane_addr);
        } else {
          gemm_rs_bt<kD, kBN, kRowBytes, kPad>(acc_s, q_frag, k_lane_addr);
        }
        if constexpr (Has_bias) {
          mod_scores<kBN, Kt::kBiasFastPath, Is_ext, kKinds>(acc_s, smod, row0 + 16 * warp, n_block * kBN,
                                             params, Kt::kBiasFastPath ? &pf : nullptr);
        }
        mask_scores<Is_causal, Is_local, Kt::kBlockM, kBN>(acc_s, c.m_block, n_block, c.kr, row0 + 16 * warp,
                                                 c.si.causal_off(), c.si.window_lower());
        uint32_t p_frag[kBN / 8][2];
        softmax_rescale<kBN, kD, Kt::kRescaleThreshold>(acc_s, m_i, l_i, acc_o, scale_log2,
                                                        p_frag, exact_exp);
        if (kDropout && params.dropout) {
          dropout_p_frag<kBN / 8>(p_frag, dropout_rng(params), static_cast<uint32_t>(c.bh),
                                  row0 + 16 * warp, n_block * kBN, params.dropout_keep_threshold);
        }

        // Every warp finished reading sV in the previous iteration (last barrier below), so V_j
        // can be written now.
        store_tile_r2s<Kt>(stage, sV, tid);
        __syncthreads();  // V_j visible; every warp is done with K_j

        const bool has_next = n_block + 1 < c.nb.n_block_max;
        if (has_next) {  // K_{j+1}: global loads in flight during O += P V_j
          load_tile_g2r<Kt, kLs, kPf>(stage, k_next((n_block + 1) * kBN), params.k_row_stride,
                                 (n_block + 1) * kBN, c.kr.key_start, c.kr.key_end, tid, dc,
                                 pf_rows, c.kr.key_end);
        }
        gemm_rs_t<kBN, kD, kRowBytes, !kPad>(acc_o, p_frag, v_lane_addr);  // O += P V
        if (has_next) store_tile_r2s<Kt>(stage, sK, tid);
        __syncthreads();  // K_{j+1} visible; every warp is done with V_j
      }
    }
  }

  // O staged through sQ (each warp only ever read its own 16 rows there) or the K+V space (free
  // after the loop's last barrier).
  if (Kt::kQInSmem) __syncwarp();
  if constexpr (Variant == kFwdBias ||
                (Variant == kFwdPlain && Is_causal && Kt::kLateOPointerCausal)) {
    // The bias-only kernel (and kLateOPointerCausal's) takes its O pointer only now: held
    // through the loop, its registers were spilled at sm_75 (stored before the loop, reloaded
    // after it).
    // bidh >= 0 taken zero-extended: its sign word, not otherwise needed after the loop, was
    // the value spilled.
    // fwd_cta's formula for a dense call (kFwdBias never runs packed sequences: fwd_variant).
    static_assert(!Is_ext, "kFwdBias / kFwdPlain: dense calls only, SeqInfo<false>");
    FwdCta<Is_ext> late = c;
    late.o_base = static_cast<__half*>(params.o_ptr) +
                  c.si.q_offset(c.bidb, params.o_batch_stride, params.o_row_stride) +
                  static_cast<index_t>(static_cast<uint32_t>(c.bidh)) * params.o_head_stride;
    // The plain kernel's LSE row base too (bh = bidb * h + bidh, fwd_cta): with the L2
    // prefetch's address arithmetic in the loop, the 64-bit bh held through it was spilled (4
    // bytes, sm_75).
    if constexpr (Variant == kFwdPlain) late.bh = static_cast<int64_t>(c.bidb) * params.h + c.bidh;
    store_output<Kt, Is_ext>(acc_o, m_i, l_i, params, late, Kt::kQInSmem ? sQ : sK, exact_exp);
  } else {
    store_output<Kt, Is_ext, kDropout>(acc_o, m_i, l_i, params, c, Kt::kQInSmem ? sQ : sK,
                                       exact_exp);
  }
}

}  // namespace flash_sm75
