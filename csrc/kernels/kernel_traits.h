// Tiles of the SM75 forward kernel: the named tile parameters, the kernel traits derived from
// them, and the tiles each head dim launches.
//
// This header is plain C++ (no device code) so that host code and the GoogleTest suite can
// check every instantiation's shared-memory budget against the Turing limits.
#pragma once

#include "head_dims.h"

namespace flash_sm75 {

// Turing (sm_75) limits the kernels must respect.
constexpr int kSm75MaxSmemPerBlock = 64 * 1024;   // dynamic shared memory per block (opt-in)
constexpr int kSm75DefaultSmemPerBlock = 48 * 1024;  // without cudaFuncSetAttribute
constexpr int kSm75MaxThreadsPerBlock = 1024;

// 16-byte chunks each of kNThreads threads moves when copying a kRows x kHeadDim fp16 tile
// between global and shared memory (every kernel's copies must divide evenly).
template <int kRows, int kHeadDim, int kNThreads>
constexpr int chunks_per_thread() {
  static_assert(kRows * (kHeadDim / 8) % kNThreads == 0, "tile copy must divide evenly");
  return kRows * (kHeadDim / 8) / kNThreads;
}

// A forward tile is a struct of named parameters (C++17 has no class-type template arguments, so
// the struct is the one type argument of Flash_fwd_kernel_traits). It sets the four shape fields
// and derives from FwdTileDefaults, overriding only the choices that differ:
//
//   struct MyTile : FwdTileDefaults {
//     static constexpr int kHeadDim = 64, kBlockM = 64, kBlockN = 64, kNWarps = 4;
//     static constexpr int kMinBlocksPerSm = 3;
//   };
//
//   kHeadDim         d
//   kBlockM          Br: query rows per CTA (16 per warp)
//   kBlockN          Bc: keys per K/V tile
//   kNWarps          warps per CTA
//   kQInSmem         Q fragments: false = loaded once into registers (d/4 registers per thread);
//                    true = the Q tile stays in its own shared-memory region and is re-read with
//                    ldmatrix for every K tile (fewer registers, more shared-memory reads).
//   kMinBlocksPerSm  __launch_bounds__ minimum CTAs per SM (caps registers at
//                    64K / (this x threads)).
//   kRescaleThreshold  online-softmax rescale policy. 0: every tile moves the running max to the
//                    new row max and rescales O and l (FlashAttention-2). t > 0: a warp keeps its
//                    stale max (no O / l rescale, 64 FMULs and 2 exp2 per row saved at d = 128)
//                    unless some row's max grew by more than t in log2 units; P = exp2(s -
//                    m_stale) is then at most 2^t, safe in fp16 for t <= 15, and the result is
//                    exact because l, O and the LSE all use the same stale max. Used at d = 128
//                    (t = 8, +2-7% on the H200, benchmarks/NOTES.md); at d = 64 it spills under
//                    the 3-CTA register cap.
//   kLoadStyle       address arithmetic of the tile loads (tile_io.h, load_tile_g2r's kStyle:
//                    0 = a 64-bit multiply per chunk, 1 = one row pointer plus a step per chunk,
//                    2 = as 1 with an unchecked path for whole tiles). Same loads, different
//                    SASS; picked per head dim by measurement (benchmarks/NOTES.md).
//   kSplitTile       each K/V tile is processed as two halves of Bc/2 keys (flash_fwd_kernel): S
//                    of the second half is issued beside the softmax of the first, and O += P V
//                    of the first half beside the softmax of the second, so that one warp has
//                    MMAs and softmax arithmetic in the same straight-line code (no branch
//                    between them) for the scheduler to interleave. Same shared-memory layout
//                    and barriers as the plain loop.
//   kFullHeadDimOnly the tile runs only head_dim == kHeadDim (no tail predicate on the loads and
//                    stores, head_dims.h): for a tile at its register cap, where the predicate
//                    spills. Fwd_tile_config's SmallGridTraits then runs the smaller head dims.
//   kDSplit          warps per 16-row group (1 or 2). With 2, the two warps of a group each own
//                    half of the head dim: half of Q's columns (d/8 registers) and half of O's
//                    (d/4 fp32 registers). Each computes the partial S of its half (split-k of
//                    S = Q K^T), the pair adds the partials through a shared-memory exchange
//                    slot (16 x Bc fp32 per warp), and both run the same softmax on the sum
//                    (a + b == b + a exactly, so their m, l and P are bitwise equal) and
//                    O += P V for their own columns. No MMA is done twice; it costs the
//                    exchange (smem traffic of 1/4 of the K and V reads at Bc = 32) and the
//                    duplicated softmax. For head dims whose Q and O do not fit one warp's
//                    registers (d = 256: 64 + 128 registers).
struct FwdTileDefaults {
  static constexpr bool kQInSmem = false;
  static constexpr int kMinBlocksPerSm = 1;
  // The same for the score-mod instantiations (softcap, ALiBi: score_mod.h), whose extra score
  // arithmetic may not fit the plain kernel's register cap.
  static constexpr int kMinBlocksPerSmMod = -1;  // -1: kMinBlocksPerSm
  // The same for the bias-only instantiations (kFwdBias).
  static constexpr int kMinBlocksPerSmBias = -1;  // -1: kMinBlocksPerSm
  // The attention bias's fast reads (whole-block bounds, paired loads: score_mod.h
  // bias_scores); off where the register cap has no room for the extra code path.
  static constexpr bool kBiasFastPath = true;
  static constexpr int kRescaleThreshold = 0;
  static constexpr int kLoadStyle = 0;
  static constexpr bool kSplitTile = false;
  static constexpr bool kFullHeadDimOnly = false;
  static constexpr int kDSplit = 1;
  // Register-pressure options of the plain loop (dense calls), for tiles at the 255-register
  // cap where ptxas otherwise spilled loop invariants: kFreshKVBase recomputes the K / V tile
  // bases from the parameters per tile (two 32-bit indices live through the loop instead of two
  // 64-bit pointers); kLateOPointerCausal takes the O pointer after the loop in the causal
  // kernels (as the bias-only kernel always does).
  static constexpr bool kFreshKVBase = false;
  static constexpr bool kLateOPointerCausal = false;
  // The plain kernel's L2 prefetch of K / V (load_tile_g2r): each K / V load also asks L2 for
  // the tile this many tiles past it; 0: no prefetch code (Flash_fwd_params::l2_prefetch,
  // FLASH_SM75_FWD_L2_PREFETCH, overrides the distance where it is not 0). Measured (H100, T4
  // plan, B 4): d = 256 (FwdTileD256Wide) 3-8% faster with 2 or 4; the d = 128 split tile 0-2%
  // slower (kept off); the d = 64 tiles spill under their 3- and 4-CTA caps with it.
  static constexpr int kL2PrefetchTiles = 0;
  // S = Q K^T of the plain kernel in two accumulator sets (even and odd chunk pairs of the head
  // dim, added at the end: gemm_rs_bt_2acc), so that a 16 x 16 S has 4 independent MMA chains
  // instead of 2. For a narrow key tile (Bc = 16) at two warps per scheduler, whose S chains
  // (32 dependent MMAs at d = 256) were the kernel's most sampled stall (ncu: fixed-latency
  // waits and ldmatrix results at the S MMAs). Bc / 2 more registers during S. Measured (H100,
  // T4 plan, B 4, H 8, d = 256): 2-7% faster non-causal, causal from N = 2048 3-4%
  // (benchmarks/NOTES.md).
  static constexpr bool kTwoScoreSets = false;
};

// The forward kernel's compile-time parameters: the tile's fields, checked against the kernel's
// constraints and the Turing limits, and the shared-memory layout and copy counts derived from
// them.
template <typename Tile>
struct Flash_fwd_kernel_traits {
  using TileConfig = Tile;
  static constexpr int kHeadDim = Tile::kHeadDim;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kNWarps = Tile::kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr bool kQInSmem = Tile::kQInSmem;
  static constexpr int kMinBlocksPerSm = Tile::kMinBlocksPerSm;
  static constexpr int kMinBlocksPerSmMod =
      Tile::kMinBlocksPerSmMod < 0 ? Tile::kMinBlocksPerSm : Tile::kMinBlocksPerSmMod;
  static constexpr int kMinBlocksPerSmBias =
      Tile::kMinBlocksPerSmBias < 0 ? Tile::kMinBlocksPerSm : Tile::kMinBlocksPerSmBias;
  static constexpr bool kBiasFastPath = Tile::kBiasFastPath;
  static constexpr int kRescaleThreshold = Tile::kRescaleThreshold;
  static_assert(kRescaleThreshold >= 0 && kRescaleThreshold <= 15, "P must fit in fp16");
  static constexpr int kLoadStyle = Tile::kLoadStyle;
  static_assert(kLoadStyle >= 0 && kLoadStyle <= 2, "load style 0, 1 or 2");
  static constexpr bool kSplitTile = Tile::kSplitTile;
  static constexpr bool kFullHeadDimOnly = Tile::kFullHeadDimOnly;
  static_assert(!kSplitTile || (!kQInSmem && kBlockN % 32 == 0 && kRescaleThreshold > 0),
                "split tile: Q in registers, halves of 16k keys, a rescale threshold");
  static constexpr int kDSplit = Tile::kDSplit;
  static constexpr bool kFreshKVBase = Tile::kFreshKVBase;
  static constexpr bool kLateOPointerCausal = Tile::kLateOPointerCausal;
  static constexpr int kL2PrefetchTiles = Tile::kL2PrefetchTiles;
  static constexpr bool kTwoScoreSets = Tile::kTwoScoreSets;
  static_assert(!kTwoScoreSets || (kDSplit == 1 && !kSplitTile && !kQInSmem),
                "two S accumulator sets: the plain loop with Q in registers (gemm_rs_bt_2acc)");
  static_assert(kL2PrefetchTiles >= 0, "tiles ahead");
  static_assert(kDSplit == 1 || (kDSplit == 2 && !kQInSmem && !kSplitTile),
                "head-dim split: pairs of warps, Q in registers, the plain loop");
  static constexpr int kRowWarps = kNWarps / kDSplit;  // 16-row groups
  static constexpr int kDCols = kHeadDim / kDSplit;    // head-dim columns of Q and O per warp

  // Each row group owns 16 query rows (one m16 MMA tile); S and P never leave its registers.
  static_assert(kNWarps % kDSplit == 0 && kBlockM == 16 * kRowWarps,
                "each warp (kDSplit = 1) or pair of warps (2) owns exactly 16 query rows");
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16 (ldmatrix.x4 k-pairs)");
  static_assert(kDCols % 16 == 0, "a warp's head-dim columns are whole ldmatrix.x4 k-pairs");
  static_assert(kBlockN % 16 == 0, "Bc must be a multiple of 16 (ldmatrix.x4 n-pairs)");

  // Shared memory holds one K tile and one V tile, Bc x d fp16 each, row-major in one of the two
  // layouts of smem_layout.h: d in {64, 128, 256}: rows of d halves, the 16-byte chunks of row r
  // XOR-swizzled by (r % 8); d = 96 (12 chunks, no power of two): rows padded to d + 8 halves.
  // Either way ldmatrix (8 rows, same logical chunk) touches 8 distinct bank groups. The Q tile
  // (before the loop) and the output tile (after it) are staged through the same, contiguous
  // K+V space, so neither needs its own. kDSplit = 2 adds the exchange slots of the partial S
  // tiles after it (16 x Bc fp32 per warp).
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr bool kPaddedRows = !(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
  static constexpr int kRowHalves = kPaddedRows ? kHeadDim + 8 : kHeadDim;  // row stride
  static_assert(!kPaddedRows || kChunksPerRow % 2 == 0, "padded rows need an even d / 8");
  static constexpr int kSmemTileBytes = kBlockN * kRowHalves * 2;
  static constexpr int kSmemQBytes = kBlockM * kRowHalves * 2;
  static constexpr int kSmemKVOffset = kQInSmem ? kSmemQBytes : 0;  // bytes before sK
  static constexpr int kSmemKVBytes =
      kQInSmem ? 2 * kSmemTileBytes
               : (2 * kSmemTileBytes > kSmemQBytes ? 2 * kSmemTileBytes : kSmemQBytes);
  static constexpr int kSmemExchangeOffset = kSmemKVOffset + kSmemKVBytes;  // bytes before sX
  static constexpr int kSmemExchangeBytes = kDSplit > 1 ? kNWarps * 16 * kBlockN * 4 : 0;
  static constexpr int kSmemSize = kSmemExchangeOffset + kSmemExchangeBytes;
  static_assert(kSmemSize <= kSm75MaxSmemPerBlock, "exceeds SM75 shared memory per block");
  // swizzle_xor (utils.h) moves between chunk pairs by XOR-ing address bits 5 .. 4 + log2(d/16):
  // rows must be a power of two of >= 128 bytes, and every tile start a multiple of the row size.
  // Padded rows only need 16-byte aligned tiles (ldmatrix rows).
  static_assert(kPaddedRows || kSmemKVOffset % (2 * kHeadDim) == 0,
                "swizzled tiles start on a row boundary");
  static_assert(kSmemKVOffset % 16 == 0 && kSmemTileBytes % 16 == 0, "16-byte aligned tiles");
  // Load styles 1 and 2 give each thread a fixed chunk column: whole rows per pass.
  static_assert(kLoadStyle == 0 || kNThreads % kChunksPerRow == 0,
                "load styles 1 / 2 need d / 8 to divide the threads (d = 96: style 0)");

  // Global <-> shared copies move 16 bytes per thread per step.
  static constexpr int kChunksPerThread = chunks_per_thread<kBlockN, kHeadDim, kNThreads>();
  static constexpr int kQChunksPerThread = chunks_per_thread<kBlockM, kHeadDim, kNThreads>();
};

// The tiles that ship. Why these shapes (see DESIGN.md):
//  * Each warp keeps 16 rows of Q (d/4 registers), O (d/2 fp32 registers) and S (Bc/2 fp32
//    registers) in registers; Bc = 64 gives a 16 x 64 S tile per warp.
//  * d = 64: Br = 64 with 4 warps (~165 registers/thread, 16 KiB smem): three CTAs fit a T4 SM.
//  * d = 128: Br = 128 with 8 warps. With 4 warps the per-thread register staging of the next
//    K/V tile (Bc*d/128 halves) pushes the kernel past 255 registers and ptxas spills; 8 warps
//    halve that staging and fit (250 / 252 registers with the head-dim tail predicate, no
//    spills). 32 KiB of smem.
struct FwdTileD64 : FwdTileDefaults {
  static constexpr int kHeadDim = 64, kBlockM = 64, kBlockN = 64, kNWarps = 4;
  // Min 3 CTAs per SM: without it ptxas takes 170-177 registers and only 2 CTAs fit.
  static constexpr int kMinBlocksPerSm = 3;
  // With ALiBi's distances the 168-register cap of 3 CTAs spilled 20 bytes: 2 CTAs per SM.
  static constexpr int kMinBlocksPerSmMod = 2;
  // The bias-only kernel spilled 4-24 bytes under the same cap (with or without the bias
  // prefetch): 2 CTAs per SM, as the extended kernel.
  static constexpr int kMinBlocksPerSmBias = 2;
  static constexpr int kLoadStyle = 2;  // +3-8% at N = 4096 on the H200
  // The tail predicate (head_dim < 64) spills 12 B in the causal kernel under the 3-CTA cap;
  // FwdTileD64SmallGrid (124 registers) runs those head dims.
  static constexpr bool kFullHeadDimOnly = true;
};
// d = 64 for grids that FwdTileD64 runs in a little more than one wave: Q in shared memory,
// Bc = 32, 4 CTAs per SM (<= 128 registers, 16 KiB smem each), 16 warps per SM instead of 12.
// Measured 1.35x vs 1.12x of mem-efficient (bench_forward.py) at B=4 H=16 N=512 (512 CTAs: one
// wave of 528 slots on the H200 instead of 1.3 waves of 396), slower from N = 1024 on.
struct FwdTileD64SmallGrid : FwdTileDefaults {
  static constexpr int kHeadDim = 64, kBlockM = 64, kBlockN = 32, kNWarps = 4;
  static constexpr bool kQInSmem = true;
  static constexpr int kMinBlocksPerSm = 4;
  // The extended kernel (score modifiers, bias, dropout's generator) spilled 8-24 bytes under
  // the 128-register cap of 4 CTAs: 3 CTAs per SM (168 registers) for it.
  static constexpr int kMinBlocksPerSmMod = 3;
  static constexpr bool kBiasFastPath = false;  // 8 bytes of spill under the 128-register cap
};
// Threshold rescale t = 8 (P <= 2^8): measured +2-7% over rescaling every tile. Split tile:
// +4-8% at N >= 1024 (250-252 registers, no spills).
struct FwdTileD128 : FwdTileDefaults {
  static constexpr int kHeadDim = 128, kBlockM = 128, kBlockN = 64, kNWarps = 8;
  static constexpr int kRescaleThreshold = 8;
  static constexpr bool kSplitTile = true;
};
// d = 96 (runs d = 72 .. 96): the d = 128 tile at three quarters of its head dim: 128 x 64,
// 8 warps, split tile, threshold rescale t = 8. Rows padded to 104 halves (smem_layout.h; 12
// chunks per row do not XOR-swizzle): K + V 26 KiB. Load style 0 (12 chunks do not divide 256
// threads, which styles 1 / 2 need). One CTA (8 warps) per Turing SM by registers, like d = 128;
// it loads each K/V tile once per 128 query rows (half the K/V traffic of a 64-row tile).
struct FwdTileD96 : FwdTileDefaults {
  static constexpr int kHeadDim = 96, kBlockM = 128, kBlockN = 64, kNWarps = 8;
  static constexpr int kRescaleThreshold = 8;
  static constexpr bool kSplitTile = true;
};
// Not instantiated: the first A/B against FwdTileD96 on a GPU (DESIGN.md section 5, head dims).
// 64 x 64 with 4 warps, two CTAs per SM (registers capped at 256 by the launch bounds): the same
// 8 warps per SM, in two independent CTAs whose barriers do not stall each other, for twice the
// K/V loads per query row; plain loop, rescale every tile (as d = 64).
struct FwdTileD96Narrow : FwdTileDefaults {
  static constexpr int kHeadDim = 96, kBlockM = 64, kBlockN = 64, kNWarps = 4;
  static constexpr int kMinBlocksPerSm = 2;
};
// d = 256: Q (d/4 = 64 registers) and O (d/2 = 128 fp32 registers) of 16 rows do not fit one
// warp beside S and the load staging, so pairs of warps split the head dim (kDSplit = 2: 32 + 64
// registers per warp, S split-k and summed through shared memory). 8 warps, 64 x 32:
// K + V = 32 KiB (the Q and O tiles are staged through it), exchange slots 16 KiB, 48 KiB in
// all (no opt-in); 238 / 240 registers. At that register count a Turing SM holds 8 warps
// (64K registers), and at > 32 KiB one CTA: this tile has all 8 warps in it, two per scheduler.
// The tile that keeps one warp per 16 rows, 64 x 16 with 4 warps and Q re-read from shared
// memory (48 KiB, 254-255 registers), leaves 4 warps per SM (one per scheduler, 2 independent
// S accumulators to cover the MMA latency), re-reads Q for every 16 keys (a third of its
// ldmatrix traffic), and has twice the barriers and O rescales per key. Bc = 64 does not fit
// (K + V alone 64 KiB). Threshold rescale t = 8 as at d = 128.
struct FwdTileD256 : FwdTileDefaults {
  static constexpr int kHeadDim = 256, kBlockM = 64, kBlockN = 32, kNWarps = 8;
  static constexpr int kDSplit = 2;
  static constexpr int kRescaleThreshold = 8;
};

// The tiles each head dim launches (flash_fwd_launch_template.h):
//  * Traits: the default tile.
//  * SmallGridTraits (void where there is none): a tile with more CTAs per SM for grids that the
//    default tile runs in a little more than one wave but this one runs in one
//    (prefer_small_grid_tile in launch_plan.h), and every head dim below kHeadDim when the
//    default tile is kFullHeadDimOnly.
//  * PlainFullTraits (void where there is none): a tile for the plain kernels without a window
//    (kFwdPlain, not Is_local) at exactly kHeadDim; every other call takes Traits.
template <int kHeadDim>
struct Fwd_tile_config;
template <>
struct Fwd_tile_config<64> {
  using Traits = Flash_fwd_kernel_traits<FwdTileD64>;
  using SmallGridTraits = Flash_fwd_kernel_traits<FwdTileD64SmallGrid>;
  using PlainFullTraits = void;
};
template <>
struct Fwd_tile_config<96> {
  using Traits = Flash_fwd_kernel_traits<FwdTileD96>;
  using SmallGridTraits = void;
  using PlainFullTraits = void;
};
template <>
struct Fwd_tile_config<128> {
  using Traits = Flash_fwd_kernel_traits<FwdTileD128>;
  using SmallGridTraits = void;
  using PlainFullTraits = void;
};
// d = 256 exactly, the plain kernels without a window (Fwd_tile_config<256>::PlainFullTraits):
// one warp per 16 rows and no head-dim split, 128 x 16, 8 warps, Q (64 registers) and O (128)
// in registers. Against FwdTileD256 it loads each K/V tile once per 128 query rows instead of 64
// and has no partial-S exchange and no softmax done twice; Bc = 16 keeps S (8 registers) and
// the load staging (2 chunks) small enough for 255 registers. Shared memory: K + V 16 KiB, but
// the Q and O tiles (128 x 256 fp16 = 64 KiB) are staged through it: 64 KiB, the opt-in
// maximum (one CTA per SM, as the registers allow anyway). Measured (H200, T4 plan, B 4, H 8,
// a build that still spilled; benchmarks/NOTES.md): 8-26% faster than FwdTileD256 at N =
// 1024-8192. At 255 registers ptxas spilled loop invariants (4-28 bytes) until the K / V bases
// were recomputed per tile and, in the causal kernel, the O pointer taken after the loop; the
// head-dim tail predicate (d < 256) spilled again, so those head dims and the extended / bias /
// dropout / local kernels keep FwdTileD256. "Without a window": without a left window edge (a
// window with only a right edge runs the plain causal kernel, and this tile). Not 64 x 16 with
// 4 warps (32 KiB, two CTAs per SM, each one's Q load and O store beside the other's loop):
// measured 18-23% slower non-causal, 2-7% causal from N = 2048 (H100, T4 plan): each CTA loads
// every K / V tile for 64 query rows instead of 128.
struct FwdTileD256Wide : FwdTileDefaults {
  static constexpr int kHeadDim = 256, kBlockM = 128, kBlockN = 16, kNWarps = 8;
  static constexpr int kRescaleThreshold = 8;
  static constexpr bool kFullHeadDimOnly = true;
  static constexpr bool kFreshKVBase = true;
  static constexpr bool kLateOPointerCausal = true;
  static constexpr int kL2PrefetchTiles = 2;
  static constexpr bool kTwoScoreSets = true;  // 255 registers, 0 spills at sm_75
};
template <>
struct Fwd_tile_config<256> {
  using Traits = Flash_fwd_kernel_traits<FwdTileD256>;
  using SmallGridTraits = void;
  using PlainFullTraits = Flash_fwd_kernel_traits<FwdTileD256Wide>;
};

}  // namespace flash_sm75
