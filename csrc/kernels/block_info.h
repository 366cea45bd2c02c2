// Which keys a query tile can see: per-batch key ranges, causal offset, tile-level pruning.
//
// Plain arithmetic usable on host and device, so the GoogleTest suite checks exactly the code
// the kernel runs.
#pragma once

#ifdef __CUDACC__
#define FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASH_HOST_DEVICE inline
#endif

namespace flash_sm75 {

FLASH_HOST_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }
FLASH_HOST_DEVICE int imin(int a, int b) { return a < b ? a : b; }
FLASH_HOST_DEVICE int imax(int a, int b) { return a > b ? a : b; }

// The diagonal band. Key j is visible to query i iff i + window_lower <= j <= i + c, where c is
// the causal offset (the band's upper diagonal) and window_lower its lower diagonal. Plain
// causal attention has no lower diagonal (kNoWindowLower); a sliding window (flash-attn's
// window_size = (left, right), aligned like the causal mask) sets c = offset + right and
// window_lower = offset - left (band_diagonals). The kernels take the masked (Is_causal)
// instantiation for any band.
constexpr int kNoWindowLower = -(1 << 30);

// The causal offset c: key j is visible to query i iff j <= i + c.
//   bottom_right (FlashAttention `causal`): c = seqlen_k - seqlen_q, the last query sees every key;
//   top-left (torch SDPA `is_causal`):      c = 0, query i sees keys 0..i.
FLASH_HOST_DEVICE int causal_offset(int seqlen_q, int seqlen_k, bool bottom_right) {
  return bottom_right ? seqlen_k - seqlen_q : 0;
}

// Visible keys of one batch entry, before the causal mask: [key_start, key_end).
// Values are clamped into [0, seqlen_k] so a bad leftpad_k/seqused_k can never make the
// kernel read out of bounds (at worst every key is masked and the output is 0).
struct KeyRange {
  int key_start;
  int key_end;
};
FLASH_HOST_DEVICE KeyRange key_range(int seqlen_k, const int* leftpad_k, const int* seqused_k,
                                     int batch) {
  int start = leftpad_k ? imin(imax(leftpad_k[batch], 0), seqlen_k) : 0;
  int end = seqused_k ? imin(imax(seqused_k[batch], start), seqlen_k) : seqlen_k;
  return {start, end};
}

// The band's diagonals for flash-attn's window_size = (left, right) (-1 = unbounded on that
// side; causal forces right = 0) around offset = causal_offset(...): {upper, lower}. Computed in
// 64 bits and clamped so that the kernels' int arithmetic cannot overflow: upper into
// [kNoWindowLower, seqlen_k] (>= seqlen_k - 1 hides nothing), lower into [kNoWindowLower,
// seqlen_k] (kNoWindowLower: no lower diagonal, exact for seqlen_q < 2^30; also for a lower
// diagonal that hides nothing).
struct BandDiagonals {
  int upper;
  int lower;
};
inline BandDiagonals band_diagonals(int seqlen_q, int seqlen_k, bool bottom_right, bool causal,
                                    long long window_left, long long window_right) {
  const long long off = causal_offset(seqlen_q, seqlen_k, bottom_right);
  const long long lo_clamp = kNoWindowLower;
  // A window side beyond 2^32 keys hides nothing that 2^32 would not (|off| < 2^31); clamping
  // first keeps off -/+ window inside 64 bits (window_size = (sys.maxsize, ...) overflowed,
  // undefined behaviour that hid every key).
  const long long kMaxWindow = 1LL << 32;
  if (window_left > kMaxWindow) window_left = kMaxWindow;
  if (window_right > kMaxWindow) window_right = kMaxWindow;
  long long upper = causal ? off : (window_right >= 0 ? off + window_right : seqlen_k);
  long long lower = window_left >= 0 ? off - window_left : lo_clamp;
  upper = upper < lo_clamp ? lo_clamp : (upper > seqlen_k ? seqlen_k : upper);
  lower = lower < lo_clamp ? lo_clamp : (lower > seqlen_k ? seqlen_k : lower);
  // A lower diagonal at or below -(seqlen_q - 1) hides no key from any row (the last row sees
  // j >= seqlen_q - 1 + lower <= 0): it is no lower diagonal at all. Transformers' sliding
  // layers pass their window on every call, also on inputs shorter than it; dropping it keeps
  // those calls on the causal-only instantiations (Has_lower costs the causal backward 6-11%)
  // and, with dropout, on the dropout-only kernels.
  if (lower <= -(static_cast<long long>(seqlen_q) - 1)) lower = lo_clamp;
  return {static_cast<int>(upper), static_cast<int>(lower)};
}

// Range [n_block_min, n_block_max) of key tiles (size block_n) that query tile m_block
// (rows m_block*block_m .. min(seqlen_q, (m_block+1)*block_m) - 1) must visit. Tiles entirely
// outside the key range, entirely above the causal diagonal or entirely before the window's
// lower diagonal are skipped, so a window's cost follows the window, not seqlen_k. An empty
// range (max <= min) means no row of the tile sees any key: output 0, LSE -inf.
struct BlockRange {
  int n_block_min;
  int n_block_max;
};
//
// Has_lower (compile time): the band has a lower diagonal (a window's left edge, window_lower).
// Without it the code is exactly the causal-only form: the kernels instantiate the lower
// diagonal only where a window uses it (Is_local), because even a never-taken lower bound
// changed the causal backward's code enough to cost 6-11% on the H200 (d = 64 / 128, N = 4096).
template <bool Has_lower = false>
FLASH_HOST_DEVICE BlockRange n_block_range(int m_block, int block_m, int block_n, int seqlen_q,
                                           KeyRange kr, bool is_causal, int causal_off,
                                           int window_lower = kNoWindowLower) {
  int first_key = kr.key_start;
  int last_key = kr.key_end;  // exclusive
  if (is_causal) {
    int last_row = imin(seqlen_q, (m_block + 1) * block_m) - 1;
    // The last row of the tile sees keys <= last_row + causal_off, the first row keys >=
    // first_row + window_lower.
    last_key = imin(last_key, imax(last_row + causal_off + 1, 0));
    if constexpr (Has_lower) first_key = imax(first_key, m_block * block_m + window_lower);
  }
  int n_min = first_key / block_n;
  int n_max = ceil_div(last_key, block_n);
  if (last_key <= first_key) n_max = n_min;  // nothing visible
  return {n_min, n_max};
}

// True when key tile n_block needs no per-element mask for query tile m_block: it lies inside
// the key range and, if causal, entirely on or below the diagonal for the tile's first row and
// on or after the window's lower diagonal for its last row.
template <bool Has_lower = false>
FLASH_HOST_DEVICE bool tile_is_unmasked(int m_block, int n_block, int block_m, int block_n,
                                        KeyRange kr, bool is_causal, int causal_off,
                                        int window_lower = kNoWindowLower) {
  int n_start = n_block * block_n;
  int n_end = n_start + block_n;
  if (n_start < kr.key_start || n_end > kr.key_end) return false;
  if (is_causal && n_end - 1 > m_block * block_m + causal_off) return false;
  if constexpr (Has_lower) {
    if (is_causal && n_start < (m_block + 1) * block_m - 1 + window_lower) return false;
  }
  return true;
}

// Launch order of causal tiles. A causal grid runs its tiles heaviest first (the query tiles
// that see the most keys; for the backward's dK/dV, the key blocks seen by the most queries),
// so that the last wave holds the light ones. The heads are taken a group at a time, heaviest
// first within the group: the CTAs running at once then share the K/V (or Q/dO) of a few heads
// in L2 instead of each reading its own head's from memory (heads interleaved over the whole
// grid: +3.5-4.5% forward and backward at d = 128, N = 4096-16384, on the H200). A group holds
// about kCausalGroupCtas CTAs (>= 1 head): with fewer, the heavy tiles of the last groups start
// late and lengthen the tail (groups of 4 heads x 8 tiles: -15% at N = 1024, d = 128). Groups
// scaled by the kernel's CTAs per SM (768 CTAs for the d = 64 forward) measured 4-11% slower
// at d = 64, N = 1024-4096, so every kernel uses the same count.
// CTA `linear` gets the tile of weight rank `rank` (0 = heaviest) of the (batch, head) index
// bh; every (rank, bh) in [0, num_blocks) x [0, num_bh) is hit exactly once.
constexpr int kCausalGroupCtas = 256;
struct TileOrder {
  int rank;
  long long bh;
};
FLASH_HOST_DEVICE TileOrder causal_tile_order(long long linear, int num_blocks, long long num_bh) {
  const int group_heads = ceil_div(kCausalGroupCtas, num_blocks);
  const long long group_ctas = static_cast<long long>(group_heads) * num_blocks;
  const long long group = linear / group_ctas;
  const long long within = linear - group * group_ctas;
  const long long first_bh = group * group_heads;
  const long long heads = num_bh - first_bh < group_heads ? num_bh - first_bh : group_heads;
  return {static_cast<int>(within / heads), first_bh + within % heads};
}

// Element-level visibility, the definition the tile logic above must agree with.
template <bool Has_lower = false>
FLASH_HOST_DEVICE bool key_visible(int row, int col, KeyRange kr, bool is_causal,
                                   int causal_off, int window_lower = kNoWindowLower) {
  if (col < kr.key_start || col >= kr.key_end) return false;
  if constexpr (Has_lower) {
    return !is_causal || (col <= row + causal_off && col >= row + window_lower);
  } else {
    return !is_causal || col <= row + causal_off;
  }
}

}  // namespace flash_sm75
