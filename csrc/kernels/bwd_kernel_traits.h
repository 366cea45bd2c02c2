// Tile shapes, shared-memory layout and launch planning of the SM75 backward kernels.
//
// Plain C++ (no device code), like kernel_traits.h, so host code and tests can check every
// configuration against the Turing limits.
//
// Three kernels do the work (see flash_bwd_kernel.h):
//  1. preprocess: D = rowsum(dO * O) - dLSE, one fp32 per query row.
//  2. dK/dV kernel: one CTA per (key block of Bc keys, batch, kv head). It keeps dK and dV of
//     its keys in registers and streams the query tiles (Br rows) of every q-head of its GQA
//     group. Optionally (atomic mode) it also adds dQ = dS K of each tile into an fp32 buffer.
//  3. dQ: either a convert kernel (atomic mode: scale, fp32 -> fp16) or a separate dQ kernel
//     over query tiles (deterministic mode) that recomputes S, P, dP like the forward.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "kernel_traits.h"

namespace flash_sm75 {

// dK/dV kernel. kNWarps warps = (kBlockN / 16 key groups) x (kNWarpsM query splits) x
// (kDSplit column splits): warp (wn, wm, ws) owns keys 16 wn .. 16 wn + 15 of the block, query
// columns wm * kWarpCols .. (wm + 1) * kWarpCols - 1 of each query tile and output columns
// ws * kDOut .. (ws + 1) * kDOut - 1 of dK and dV. It computes the transposed scores
// S^T = K Q^T directly, so the rows of its accumulators are keys: P^T and dS^T are then already
// the A operands (fp16 registers) of dV += P^T dO and dK += dS^T Q. The kNWarpsM partial dK/dV
// of one key group are summed through shared memory once, at the end. With kDSplit > 1 the
// warps of one (key group, query split) each compute the same S^T and dP^T (over the whole d)
// and keep only their share of the dK/dV columns: 1 / kDSplit of the d/2 + d/2 fp32 accumulator
// registers, for S^T / dP^T MMAs done kDSplit times (d = 256: the dK/dV accumulators alone
// would take all 255 registers).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kDSplit_ = 1,
          bool kDropout_ = true>
struct Flash_bwd_kernel_traits {
  // The extended deterministic kernel applies attention dropout (dropout.h); false: not compiled
  // (d = 256's tile, whose dK / dV accumulators leave no register for the generator: the
  // dropout calls run Bwd_tile_config::DropoutTraits).
  static constexpr bool kDropout = kDropout_;
  static constexpr int kHeadDim = kHeadDim_;  // d
  static constexpr int kBlockM = kBlockM_;    // Br: query rows per tile of the inner loop
  static constexpr int kBlockN = kBlockN_;    // Bc: keys per CTA
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kDSplit = kDSplit_;              // column splits of dK / dV
  static constexpr int kDOut = kHeadDim / kDSplit;      // dK / dV columns per warp
  // Its extended kernels take packed sequences and per-sequence diagonals (SeqInfo<true>,
  // seq_info.h): every tile up to kMaxBwdSeqHeadDim, and above it a tile of at most 64 dK / dV
  // columns per warp (d = 256's dropout tile, 168-170 registers with them), not d = 256's
  // plain tile (255 registers without them; every form of them spilled 16-48 bytes).
  static constexpr bool kPackedSeq = kHeadDim <= kMaxBwdSeqHeadDim || kDOut <= 64;

  static constexpr int kNWarpsN = kBlockN / 16;                   // key groups
  static constexpr int kNWarpsM = kNWarps / (kNWarpsN * kDSplit);  // query splits
  static constexpr int kWarpCols = kBlockM / kNWarpsM;            // queries per warp
  static_assert(kBlockN % 16 == 0, "each warp owns 16 keys");
  static_assert(kNWarpsM >= 1 && kNWarps % (kNWarpsN * kDSplit) == 0,
                "warps must tile (key groups x query splits x column splits)");
  static_assert(kBlockM % kNWarpsM == 0 && kWarpCols % 16 == 0,
                "each warp's query columns must be a multiple of 16 (ldmatrix.x4 pairs)");
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16");
  static_assert(kHeadDim % kDSplit == 0 && kDOut % 16 == 0, "column splits of 16k");

  // dQ tile (atomic mode) = dS (Br x Bc) K (Bc x d), split over the warps as
  // (Br / 16 row groups) x (kDqWarpsN column groups of kDqCols).
  static constexpr int kDqWarpsM = kBlockM / 16;
  static constexpr int kDqWarpsN = kNWarps / kDqWarpsM;
  static constexpr int kDqCols = kHeadDim / kDqWarpsN;
  static_assert(kBlockM % 16 == 0 && kNWarps % kDqWarpsM == 0, "dQ row groups must tile the warps");
  static_assert(kHeadDim % kDqWarpsN == 0 && kDqCols % 16 == 0, "dQ column groups of 16k");

  // ---- shared memory (bytes). fp16 tiles are row-major with rows padded to d + 8 halves: 8
  // consecutive rows are an odd number of 16-byte units apart, so ldmatrix (8 rows, same
  // column chunk) is conflict-free, and every fragment address is a constant offset from one
  // per-lane base (no XOR-swizzle address registers, which made ptxas spill at d = 128).
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kRowHalves = kHeadDim + 8;
  static constexpr int kKVTileBytes = kBlockN * kRowHalves * 2;
  static constexpr int kQTileBytes = kBlockM * kRowHalves * 2;
  // dS^T (Bc x Br fp16), rows padded by 16 bytes likewise: conflict-free half2 stores and
  // ldmatrix.trans reads.
  static constexpr int kDsRowHalves = kBlockM + 8;
  static constexpr int kDsBytes = kBlockN * kDsRowHalves * 2;
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVTileBytes;
  static constexpr int kOffQ = kOffV + kKVTileBytes;
  static constexpr int kOffDo = kOffQ + kQTileBytes;
  static constexpr int kOffLse = kOffDo + kQTileBytes;  // Br fp32: lse * log2(e) (+inf: no key)
  static constexpr int kOffDsum = kOffLse + kBlockM * 4;  // Br fp32: D
  static constexpr int kOffDs = kOffDsum + kBlockM * 4;
  static constexpr int kSmemSizeNoDq = kOffDs;
  static constexpr int kSmemSizeAtomicDq = kOffDs + kDsBytes;
  static_assert(kOffDs % 16 == 0 && kQTileBytes % 16 == 0, "ldmatrix rows must be 16-byte aligned");
  // Aliases: the fp32 dQ tile (Br x d) reuses sQ + sdO; the fp32 dK/dV reduction buffer
  // (Bc x d) reuses sK + sV.
  // (fp32 tiles have rows padded to d + 8 floats, see fp32_tile_offset.)
  static_assert(kBlockM * (kHeadDim + 8) * 4 == 2 * kQTileBytes, "dQ tile aliases sQ + sdO");
  static_assert(kBlockN * (kHeadDim + 8) * 4 == 2 * kKVTileBytes, "reduction aliases sK + sV");
  static_assert(kSmemSizeAtomicDq <= kSm75MaxSmemPerBlock, "exceeds SM75 shared memory per block");

  // ---- global <-> shared copies, 16 bytes per thread per step
  static constexpr int kKVChunksPerThread = chunks_per_thread<kBlockN, kHeadDim, kNThreads>();
  static constexpr int kQChunksPerThread = chunks_per_thread<kBlockM, kHeadDim, kNThreads>();
  static_assert(kBlockM <= kNThreads, "one thread per row loads lse and D");
};

// dK/dV kernel with each warp's K rows in registers (the plain deterministic calls at d = 64 and
// 128: Bwd_tile_config::KregTraits, flash_bwd_dkdv_kreg_kernel). One warp per 16 keys (Bc = 16 x
// kNWarps), no query splits: warp w holds the A fragments of its keys' K (d / 4 registers)
// and the dK / dV accumulators of those keys (d / 2 fp32 registers each), and runs over all
// kBlockM queries of a tile, so S^T takes only its B operand (Q) from shared memory. V's A
// fragments are re-read from shared memory every tile (V in registers too spills at d = 128),
// or with kVInRegs held in registers beside K's (d / 4 more; d = 64). Against
// Flash_bwd_kernel_traits' 16 x 16 warp tiles, whose two query splits both reload their keys'
// K and V for every tile, that is one ldmatrix.x4 per 3.2 MMAs instead of one per 2.7 (d = 128).
// Shared memory: two Q buffers (the next tile's Q is stored while the current one is read),
// one dO tile, one lse / D pair, V; the K tile is staged through V's space before the loop.
// kMinBlocksPerSm CTAs must fit a 64 KiB Turing SM (29.9 KiB at d = 128 with 16-query tiles,
// 22.8 KiB at d = 64 with 32-query tiles: two each), and __launch_bounds__ holds ptxas to the
// registers that many CTAs leave (255 for two of 128 threads): the 8 warps per SM of the 8-warp
// kernel, in CTAs whose barriers do not stall each other.
template <int kHeadDim_, int kBlockM_, int kNWarps_, int kMinBlocksPerSm_, bool kVInRegs_>
struct Flash_bwd_dkdv_kreg_traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per tile
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockN = 16 * kNWarps;  // keys per CTA
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr bool kVInRegs = kVInRegs_;  // V's A fragments in registers, read once
  static_assert(kBlockM % 16 == 0 && kHeadDim % 16 == 0, "multiples of 16");

  // Padded rows (d + 8 halves), as Flash_bwd_kernel_traits.
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kRowHalves = kHeadDim + 8;
  static constexpr int kQTileBytes = kBlockM * kRowHalves * 2;
  static constexpr int kKVTileBytes = kBlockN * kRowHalves * 2;
  static constexpr int kOffQ = 0;                             // [2] Q tiles
  static constexpr int kOffDo = kOffQ + 2 * kQTileBytes;      // dO tile
  static constexpr int kOffLse = kOffDo + kQTileBytes;        // Br fp32: lse * log2(e)
  static constexpr int kOffDsum = kOffLse + kBlockM * 4;      // Br fp32: D
  static constexpr int kOffV = kOffDsum + kBlockM * 4;        // V tile (K's staging first)
  static constexpr int kSmemSize = kOffV + kKVTileBytes;
  static_assert(kOffV % 16 == 0 && kQTileBytes % 16 == 0, "ldmatrix rows must be 16-byte aligned");
  static_assert(kMinBlocksPerSm * kSmemSize <= kSm75MaxSmemPerBlock,
                "kMinBlocksPerSm CTAs must fit the 64 KiB of a Turing SM");
  // Registers: __launch_bounds__(kNThreads, kMinBlocksPerSm) caps them at 64K / (kMinBlocksPerSm
  // x kNThreads); ptxas spills rather than exceed that, which check_sm75.py refuses.
  static_assert(kMinBlocksPerSm * kNThreads <= 1024, "a Turing SM holds 1024 threads");

  static constexpr int kKVChunksPerThread = chunks_per_thread<kBlockN, kHeadDim, kNThreads>();
  static constexpr int kQChunksPerThread = chunks_per_thread<kBlockM, kHeadDim, kNThreads>();
  static_assert(kBlockM <= kNThreads, "one thread per row loads lse and D");
};

// Deterministic dQ kernel: the forward's structure. Each warp owns 16 query rows, the CTA
// streams K/V tiles of Bc keys and accumulates dQ += dS K in registers.
//  kQInSmem = false: Q and dO fragments stay in registers (d/4 + d/4 per thread), staged
//    through the K/V space before the loop. smem [K | V] (the Q / dO / dQ staging aliases it).
//  kQInSmem = true: Q and dO tiles stay in their own shared memory and are re-read with
//    ldmatrix for every K/V tile. smem [Q | dO | K | V], dQ staged through Q.
//  kDSplit: the warps of one 16-row group (kDSplit of them) each own kDOut = d / kDSplit columns
//    of dQ and compute the same S and dP over the whole d (needs kQInSmem).
//  kKVDoubleBuf: two [K | V] buffers, so that the plain kernels (no score modifier, bias,
//    dropout or packed sequences) store tile j + 1 into the idle one while tile j is read and
//    end each tile with one barrier instead of three. Only where the shared memory is there
//    anyway (the Q / dO staging of kQInSmem = false already takes >= 4 K/V tiles): no CTA per
//    SM is lost to it.
template <int kHeadDim_, int kBlockN_, int kNWarps_, int kDSplit_ = 1, bool kQInSmem_ = false,
          bool kDbias_ = true, bool kKVDoubleBuf_ = false>
struct Flash_bwd_dq_kernel_traits {
  // The extended kernels store the bias gradient when asked (params.dbias_ptr); false: not
  // compiled (a head dim whose bias-gradient calls run other traits, DqBiasTraits).
  static constexpr bool kDbias = kDbias_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kDSplit = kDSplit_;
  static constexpr bool kQInSmem = kQInSmem_;
  static constexpr int kDOut = kHeadDim / kDSplit;  // dQ columns per warp
  // Its extended kernels take packed sequences and per-sequence diagonals (SeqInfo<true>): every
  // dQ tile (d = 256's: 174-180 registers without them), so that packed calls whose dK/dV tile
  // takes them (Flash_bwd_kernel_traits::kPackedSeq) run natively.
  static constexpr bool kPackedSeq = true;
  static constexpr int kRowGroups = kNWarps / kDSplit;
  static constexpr int kBlockM = 16 * kRowGroups;
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "multiples of 16");
  static_assert(kNWarps % kDSplit == 0 && kHeadDim % kDSplit == 0, "column splits tile the warps");
  static_assert(kDSplit == 1 || kQInSmem, "column-split warps read Q and dO from shared memory");
  // Shared tiles in the forward's layouts (smem_layout.h): XOR-swizzled rows at d in {64, 128,
  // 256}, rows padded to d + 8 halves at d = 96 (12 chunks per row).
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr bool kPaddedRows = !(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
  static constexpr int kRowHalves = kPaddedRows ? kHeadDim + 8 : kHeadDim;
  static_assert(!kPaddedRows || kChunksPerRow % 2 == 0, "padded rows need an even d / 8");
  // The dQ += dS K column loop of a warp moves through chunk pairs col0 / 16 + np with one XOR
  // (swizzle_xor): kDOut / 16 must be a power of two (padded rows: one add, any count).
  static_assert(kPaddedRows || (kDOut / 16 & (kDOut / 16 - 1)) == 0,
                "dQ columns per warp: 16 x a power of two");

  static constexpr int kSmemTileBytes = kBlockN * kRowHalves * 2;
  static constexpr int kQTileBytes = kBlockM * kRowHalves * 2;
  static constexpr int kOffQ = 0;                                    // kQInSmem only
  static constexpr int kOffDo = kQTileBytes;                         // kQInSmem only
  static constexpr int kOffK = kQInSmem ? 2 * kQTileBytes : 0;
  static constexpr int kSmemSize =
      kQInSmem ? 2 * kQTileBytes + 2 * kSmemTileBytes
               : (2 * kSmemTileBytes > kQTileBytes ? 2 * kSmemTileBytes : kQTileBytes);
  static_assert(kSmemSize <= kSm75MaxSmemPerBlock, "exceeds SM75 shared memory per block");
  static constexpr bool kKVDoubleBuf = kKVDoubleBuf_;
  static constexpr int kKVBufHalves = 2 * kBlockN * kRowHalves;  // one [K | V] buffer
  static_assert(!kKVDoubleBuf || (!kQInSmem && 4 * kSmemTileBytes <= kSmemSize),
                "the second K/V buffer must fit the shared memory the Q staging takes");

  static constexpr int kChunksPerThread = chunks_per_thread<kBlockN, kHeadDim, kNThreads>();
  static constexpr int kQChunksPerThread = chunks_per_thread<kBlockM, kHeadDim, kNThreads>();
};

// The configuration used for each head dim. Why these shapes:
//  * dK/dV kernel, 8 warps = 4 key groups x 2 query splits, Bc = 64 keys per CTA. Per thread
//    dK and dV take d/2 fp32 registers each; S^T, dP^T take kWarpCols/2 each.
//    d = 64:  Br = 64 (32 query columns per warp), 45.5 KiB smem in atomic mode.
//    d = 128: Br = 32 (16 query columns per warp); K, V, Q, dO and dS^T take 56.25 KiB, so
//             Br = 64 would not fit the 64 KiB of an SM75 block.
//  * dQ kernel: d = 64 like the forward (Br = 64, 4 warps, Bc = 64); d = 128 keeps Q, dO and dQ
//    (d/4 + d/4 + d/2 registers) resident, so Bc = 32 keeps S, dP small enough not to spill.
//  * d = 256 (the Turing limits: 64 KiB of shared memory, 255 registers, no spills):
//    dK/dV: Br = 16, Bc = 32, 4 warps = 2 key groups x 1 query split x 2 column splits. K, V
//    (padded rows) take 33 KiB and Q, dO 16.5 KiB: 49.6 KiB (51.1 KiB atomic); Br = 32 would
//    need 66 KiB. Each warp keeps dK, dV of 128 columns (64 + 64 fp32 registers).
//    dQ: Br = 32, Bc = 16, 4 warps = 2 row groups x 2 column splits, Q and dO in shared memory
//    (in registers they alone would take 128 registers): 48 KiB. Deterministic dQ only.
template <int kHeadDim>
struct Bwd_tile_config;
template <>
struct Bwd_tile_config<64> {
  using Traits = Flash_bwd_kernel_traits<64, 64, 64, 8>;
  // The plain deterministic calls' dK/dV kernel (as at d = 128): K and V in registers (16 + 16
  // beside dK / dV's 64: 197 / 202 registers), 32 queries per tile, two 4-warp CTAs of 22.8 KiB
  // per Turing SM. 16-query tiles with three CTAs per SM (152 / 156 registers, 15.9 KiB) were
  // 3-11% slower; four CTAs spill (the 128-register cap).
  using KregTraits = Flash_bwd_dkdv_kreg_traits<64, 32, 4, 2, /*kVInRegs=*/true>;
  using DropoutTraits = Traits;  // dropout.h's generator fits the dK/dV kernel
  using DqTraits = Flash_bwd_dq_kernel_traits<64, 64, 4, 1, false, false>;
  // The dQ kernel of a call with a bias gradient (params.dbias_ptr; the extended, non-band
  // instantiations): Bc = 32, as at d = 96 / 128. Its fp32 dS stores spilled the Bc = 64 one,
  // whose Q and dO fragments stay in registers (255 before them; 200-209 here).
  using DqBiasTraits = Flash_bwd_dq_kernel_traits<64, 32, 4>;
  static constexpr bool kAtomicDq = true;  // the atomic dQ mode exists (else: deterministic)
};
// d = 96 (runs d = 72 .. 96). dK/dV: the d = 64 shape, Br = 64 (32 query columns per warp):
// K, V, Q, dO with rows padded to 104 halves take 52.5 KiB (61.5 KiB atomic; opt-in above 48).
// dQ: Q, dO and dQ resident (24 + 24 + 48 registers), Bc = 32 keeps S and dP small; its shared
// tiles use padded rows like the forward (smem_layout.h): 13 KiB.
template <>
struct Bwd_tile_config<96> {
  using Traits = Flash_bwd_kernel_traits<96, 64, 64, 8>;
  using KregTraits = void;  // no K-in-registers dK/dV tile
  using DropoutTraits = Traits;  // dropout.h's generator fits the dK/dV kernel
  using DqTraits = Flash_bwd_dq_kernel_traits<96, 32, 4>;
  using DqBiasTraits = DqTraits;
  static constexpr bool kAtomicDq = true;
};
template <>
struct Bwd_tile_config<128> {
  using Traits = Flash_bwd_kernel_traits<128, 32, 64, 8>;
  // The dK/dV kernel of the plain deterministic calls (no score modifier, bias, dropout, packed
  // sequences or lower window diagonal; DkdvLaunchTraits::kKregTile): K in registers, two 4-warp
  // CTAs per SM, the same 64 keys per CTA as Traits (the same grid).
  using KregTraits = Flash_bwd_dkdv_kreg_traits<128, 16, 4, 2, /*kVInRegs=*/false>;
  using DropoutTraits = Traits;  // dropout.h's generator fits the dK/dV kernel
  using DqTraits = Flash_bwd_dq_kernel_traits<128, 32, 8, 1, false, true, /*kKVDoubleBuf=*/true>;
  using DqBiasTraits = DqTraits;
  static constexpr bool kAtomicDq = true;
};
template <>
struct Bwd_tile_config<256> {
  using Traits = Flash_bwd_kernel_traits<256, 16, 32, 4, 2, /*kDropout=*/false>;
  using KregTraits = void;  // no K-in-registers dK/dV tile
  // The dK/dV kernel of a dropout's backward: Traits' 255 registers (its dK / dV accumulators, d
  // / 2 columns per warp) left none for dropout.h's generator (32-36 bytes of spill). Four
  // column splits instead of two halve the accumulators (d / 4 = 64 columns per warp: 168-170
  // registers, 0 spills) for S^T / dP^T computed four times per key group instead of twice; 8
  // warps of one CTA per SM as Traits' 4 warps of one (49.6 KiB of shared memory each: the same
  // tiles, Bc = 32, Br = 16).
  using DropoutTraits = Flash_bwd_kernel_traits<256, 16, 32, 8, 4>;
  using DqTraits = Flash_bwd_dq_kernel_traits<256, 16, 4, 2, true>;
  using DqBiasTraits = DqTraits;  // no bias backward here (kBwdBiasMaxHeadDim)
  // No atomic dQ mode: the dK/dV kernel with the dQ = dS K tile and its atomics spills 12-84
  // bytes at 255 registers (deterministic 252 / 253). Requests for it run the deterministic
  // kernels (bwd_atomic_dq_supported).
  static constexpr bool kAtomicDq = false;
};

// The dQ kernel a launch runs (run_mha_bwd_hdim and the CPU emulator's mirror of it). Plain:
// DqTraits, and in a sliding window's band kernels (Is_local) DqTraits without the bias
// gradient's stores (kDbias = false: the band kernels of calls without a bias gradient keep the
// code they had before the band stored it). Bias: DqBiasTraits, for a call with a bias gradient,
// or with a bias read by scalar loads (no aligned column pairs) where DqBiasTraits is another
// tile (d = 64: its Bc = 64 tile reads those one at a time); kBiasTile: whether Bias is a second
// kernel at all.
template <int kHeadDim, bool Is_local, bool Is_ext>
struct DqLaunchTraits {
  using C = Bwd_tile_config<kHeadDim>;
  using K = typename C::DqTraits;
  using Plain = std::conditional_t<
      Is_local && Is_ext,
      Flash_bwd_dq_kernel_traits<K::kHeadDim, K::kBlockN, K::kNWarps, K::kDSplit, K::kQInSmem,
                                 false, K::kKVDoubleBuf>,
      K>;
  using Bias = typename C::DqBiasTraits;
  static constexpr bool kBiasTile =
      Is_ext && kHeadDim <= kBwdBiasMaxHeadDim && !std::is_same_v<Plain, Bias>;
  template <typename Params>
  static bool use_bias_tile(const Params& p) {
    if constexpr (!kBiasTile) {
      return false;
    } else {
      static_assert(Bias::kBlockM == Plain::kBlockM && Bias::kNThreads == Plain::kNThreads,
                    "the bias tile runs the plain tile's grid and threads");
      return p.dbias_ptr != nullptr ||
             (p.bias_ptr != nullptr && !p.bias_pairs && !std::is_same_v<K, Bias>);
    }
  }
};

// The dK/dV kernel a launch runs (run_mha_bwd_hdim and the CPU emulator's mirror of it): Plain
// (Bwd_tile_config::Traits), or DropoutTraits for a dropout's backward where that is another
// tile (d = 256; kDropoutTile: whether it is), on the same grid (its keys per CTA are Plain's).
// Kreg (Bwd_tile_config::KregTraits, void where there is none): the K-in-registers tile that
// the plain family's non-banded deterministic launches run instead of Plain (kKregTile; the
// banded and atomic ones run Plain), on the same grid.
template <int kHeadDim, bool Is_ext>
struct DkdvLaunchTraits {
  using C = Bwd_tile_config<kHeadDim>;
  using Plain = typename C::Traits;
  using Dropout = typename C::DropoutTraits;
  using Kreg = typename C::KregTraits;
  static constexpr bool kDropoutTile = Is_ext && !std::is_same_v<Plain, Dropout>;
  template <bool Is_local>
  static constexpr bool kKregTile = !Is_ext && !Is_local && !std::is_void_v<Kreg>;
  static_assert(Dropout::kBlockN == Plain::kBlockN && Dropout::kBlockM == Plain::kBlockM &&
                    Dropout::kDropout,
                "the dropout tile runs the plain tile's grid and applies dropout");
  template <typename Params>
  static bool use_dropout_tile(const Params& p) {
    return kDropoutTile && p.dropout;
  }
  template <typename K = Kreg>
  static constexpr bool kreg_same_grid() {
    if constexpr (std::is_void_v<K>) {
      return true;
    } else {
      return K::kBlockN == Plain::kBlockN;
    }
  }
  static_assert(kreg_same_grid(), "the K-in-registers tile runs the plain tile's grid");
};

// Preprocess / convert kernels: 256 threads, 8 elements (16 bytes of fp16) per thread.
constexpr int kBwdAuxThreads = 256;
// Threads per query row of the preprocess kernel: one per 16-byte chunk of the bucket, rounded
// up to a power of two so that a row's threads form a shuffle-reducible group of a warp (d = 96:
// 16 threads, 12 loading).
constexpr int bwd_preprocess_threads_per_row(int d) {
  int n = 1;
  while (n < d / 8) n *= 2;
  return n;
}

struct BwdLaunchPlan {
  bool dq_atomic;            // the dQ mode that runs (an atomic request may run deterministic)
  int num_n_blocks;          // key blocks of the dK/dV kernel
  int64_t dkdv_blocks;       // num_n_blocks * b * h_k
  // Threads and shared memory of the default tile (Traits); run_mha_bwd_hdim launches another
  // tile of the same grid where DkdvLaunchTraits picks one (a dropout's, the K-in-registers one)
  // with that tile's own.
  int dkdv_threads;
  int dkdv_smem;             // bytes (depends on the dQ mode)
  int num_m_blocks_dq;       // query tiles of the dQ kernel
  int64_t dq_blocks;         // num_m_blocks_dq * b * h (deterministic mode)
  int dq_threads;
  int dq_smem;
  int64_t preprocess_blocks;  // b * h * seqlen_q rows, 256 / bwd_preprocess_threads_per_row rows per block
  int64_t convert_blocks;     // b * seqlen_q * h * d / 8 threads of work (atomic mode)
};

// Grids, threads and shared memory of the backward's kernels: the dK/dV kernel of Kt (both dQ
// modes; in the atomic mode with the dS^T tile for the dQ atomics) and the dQ kernel of Kq.
// dq_atomic is the mode that runs (see Bwd_tile_config::kAtomicDq).
template <typename Kt, typename Kq>
inline BwdLaunchPlan make_bwd_plan(int b, int h, int h_k, int seqlen_q, int seqlen_k,
                                   bool dq_atomic) {
  BwdLaunchPlan p;
  p.dq_atomic = dq_atomic;
  p.num_n_blocks = (seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN;
  p.dkdv_threads = Kt::kNThreads;
  p.dkdv_smem = dq_atomic ? Kt::kSmemSizeAtomicDq : Kt::kSmemSizeNoDq;
  p.dkdv_blocks = static_cast<int64_t>(p.num_n_blocks) * b * h_k;
  p.num_m_blocks_dq = (seqlen_q + Kq::kBlockM - 1) / Kq::kBlockM;
  p.dq_blocks = static_cast<int64_t>(p.num_m_blocks_dq) * b * h;
  p.dq_threads = Kq::kNThreads;
  p.dq_smem = Kq::kSmemSize;
  const int64_t rows = static_cast<int64_t>(b) * h * seqlen_q;
  const int rows_per_block = kBwdAuxThreads / bwd_preprocess_threads_per_row(Kt::kHeadDim);
  p.preprocess_blocks = (rows + rows_per_block - 1) / rows_per_block;
  p.convert_blocks = (rows * (Kt::kHeadDim / 8) + kBwdAuxThreads - 1) / kBwdAuxThreads;
  const int64_t worst = p.dkdv_blocks > p.dq_blocks ? p.dkdv_blocks : p.dq_blocks;
  const int64_t worst2 = p.preprocess_blocks > p.convert_blocks ? p.preprocess_blocks
                                                                 : p.convert_blocks;
  if (worst > INT32_MAX || worst2 > INT32_MAX) {
    throw std::invalid_argument(
        "flash_attention_sm75: backward grid exceeds the 2^31-1 CTA limit (batch * heads * "
        "seqlen too large)");
  }
  return p;
}

// Whether head dim d has the atomic dQ mode; without it an atomic request runs the
// deterministic kernels (d > 128: the d = 256 bucket).
inline bool bwd_atomic_dq_supported(int d) {
  switch (head_dim_bucket(d)) {
    case 64: return Bwd_tile_config<64>::kAtomicDq;
    case 96: return Bwd_tile_config<96>::kAtomicDq;
    case 128: return Bwd_tile_config<128>::kAtomicDq;
    case 256: return Bwd_tile_config<256>::kAtomicDq;
    default: throw_bad_head_dim(d);
  }
}

inline BwdLaunchPlan plan_bwd_launch(int d, int b, int h, int h_k, int seqlen_q, int seqlen_k,
                                     bool dq_atomic) {
  switch (head_dim_bucket(d)) {
    case 64: {
      using C = Bwd_tile_config<64>;
      return make_bwd_plan<C::Traits, C::DqTraits>(b, h, h_k, seqlen_q, seqlen_k,
                                                   dq_atomic && C::kAtomicDq);
    }
    case 96: {
      using C = Bwd_tile_config<96>;
      return make_bwd_plan<C::Traits, C::DqTraits>(b, h, h_k, seqlen_q, seqlen_k,
                                                   dq_atomic && C::kAtomicDq);
    }
    case 128: {
      using C = Bwd_tile_config<128>;
      return make_bwd_plan<C::Traits, C::DqTraits>(b, h, h_k, seqlen_q, seqlen_k,
                                                   dq_atomic && C::kAtomicDq);
    }
    case 256: {
      using C = Bwd_tile_config<256>;
      return make_bwd_plan<C::Traits, C::DqTraits>(b, h, h_k, seqlen_q, seqlen_k,
                                                   dq_atomic && C::kAtomicDq);
    }
    default: throw_bad_head_dim(d);
  }
}

}  // namespace flash_sm75
