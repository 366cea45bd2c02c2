// Parameters shared by the host API and the SM75 FlashAttention kernels.
//
// Layout convention: every tensor is addressed through explicit strides (in elements), so
// BSHD (batch, seqlen, heads, head_dim) and BHSD (a transpose(1, 2) view of BSHD) inputs use
// the same kernel. Only the last dimension must be contiguous. All strides and offsets are
// 64-bit (index_t) so that tensors with more than 2^31 elements are addressed correctly.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "block_info.h"

namespace flash_sm75 {

using index_t = int64_t;


struct Flash_fwd_params {
  // ---- inputs (fp16) -------------------------------------------------------------------
  const void* q_ptr;   // batch x seqlen_q x h   x d
  const void* k_ptr;   // batch x seqlen_k x h_k x d
  const void* v_ptr;   // batch x seqlen_k x h_k x d
  // ---- outputs -----------------------------------------------------------------------
  void* o_ptr;              // batch x seqlen_q x h x d (fp16)
  float* softmax_lse_ptr;   // batch x h x seqlen_q (fp32, contiguous), natural-log LSE of scaled scores

  // ---- optional per-batch key ranges (int32, batch entries) or nullptr ------------------
  // Keys j with leftpad_k[b] <= j < seqused_k[b] are visible in batch b; the others are
  // masked. Defaults: 0 and seqlen_k. Used for left/right padded batches (HF masks).
  const int* leftpad_k;   // first valid key index per batch
  const int* seqused_k;   // one past the last valid key index per batch

  // ---- optional packed (varlen) sequences, int32 (b + 1,) offsets, or nullptr ------------
  // Batch entry b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of a packed q / o (and the
  // same for k / v with cu_seqlens_k): its row 0 is there and its length is the difference;
  // seqlen_q / seqlen_k are then the maxima (the grid's extent) and the batch strides 0. With
  // cu_seqlens_q the LSE is packed too: (h, total_q), flash-attn's varlen layout. Only the
  // extended instantiations (Is_ext, needs_ext) read these.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q;  // rows of the packed q / o (cu_seqlens_q), for clamping and the LSE's head stride
  int total_k;  // rows of the packed k / v (cu_seqlens_k), for clamping
  // The band's diagonals and ALiBi's offset are per batch entry, relative to its bottom-right
  // corner (flash-attn's varlen and KV-cache semantics): the kernels add key_end[b] -
  // seqlen_q[b] to causal_offset, window_lower (when set) and alibi_offset, which the host then
  // sets relative to that corner (right, -left, 0). Is_ext only.
  bool per_seq_offset;
  // Host only (the launch plan): kDeviceProfiles[plan_profile] (launch_plan.h), 0 = the device
  // itself (occupancy API). Declared here, in the padding after per_seq_offset, so that the
  // kernels' parameter offsets stay those they were built and measured with (moving every later
  // field by 8 bytes changed one decode kernel's register allocation: an 8-byte spill).
  int plan_profile = 0;

  // ---- strides, in elements ------------------------------------------------------------
  index_t q_batch_stride, q_row_stride, q_head_stride;
  index_t k_batch_stride, k_row_stride, k_head_stride;
  index_t v_batch_stride, v_row_stride, v_head_stride;
  index_t o_batch_stride, o_row_stride, o_head_stride;

  // ---- sizes ---------------------------------------------------------------------------
  int b;            // batch size
  int seqlen_q;     // query length (>= 1)
  int seqlen_k;     // key/value length (>= 1)
  int h;            // number of query heads
  int h_k;          // number of key/value heads (h % h_k == 0)
  int h_h_k_ratio;  // h / h_k: query head i reads kv head i / h_h_k_ratio (GQA/MQA)
  int d;            // head dimension: a multiple of 8 up to 256; runs on head_dim_bucket(d)

  // ---- softmax -------------------------------------------------------------------------
  float scale_softmax;        // multiplies q.k (default 1/sqrt(d))
  float scale_softmax_log2;   // scale_softmax * log2(e): the kernel evaluates exp2, not exp

  // ---- masking -------------------------------------------------------------------------
  bool is_causal;       // apply the diagonal band below (causal and / or a sliding window)
  int causal_offset;    // key j is visible to query i iff j <= i + causal_offset.
                        // seqlen_k - seqlen_q: bottom-right (FlashAttention `causal`);
                        // 0: top-left (torch SDPA `is_causal`); + right for a window.
  int window_lower = kNoWindowLower;  // ... and j >= i + window_lower (a window's left edge: offset - left);
                        // kNoWindowLower (block_info.h) without one. band_diagonals().

  // ---- score modifiers (score_mod.h; run by the Is_ext instantiations) -------------------
  float softcap_in = 0.f;    // scale / softcap; 0: no softcap
  float softcap_out = 0.f;   // softcap / scale
  const float* alibi_slopes_ptr = nullptr;  // fp32 (b, h) or (h,) ALiBi slopes, or nullptr
  index_t alibi_slopes_batch_stride = 0;    // elements between batch rows; 0 for (h,)
  int alibi_offset = 0;      // query i is at ALiBi distance |i + alibi_offset - j| from key j:
                             // causal_offset(seqlen_q, seqlen_k, bottom_right), no window

  // ---- launch choice (host only) -------------------------------------------------------
  int num_sms;          // SMs to plan for (0 = unknown: the default tile): the device's, or the
                        // profile's (FLASH_SM75_DEVICE_PROFILE; plan_profile below)
  int small_grid_tile;  // Fwd_tile_config::SmallGridTraits: 0 = when it pays
                        // (prefer_small_grid_tile), 1 = always, -1 = never

  // ---- decode (seqlen_q == 1, run_mha_fwd_decode; plan_decode) -------------------------
  // The key splits are also the forward kernel's (its extended instantiations, plan_fwd_splits:
  // the KV-cache op's queries against a long cache), which cut each CTA's own key blocks into
  // num_splits runs (keys_per_split unused there). num_splits <= 1: no split.
  int decode_ratio_bucket;   // q-heads per CTA, compile time: 1, 2, 4, 8, 16
  int num_splits;            // key splits per (batch, kv head)
  int keys_per_split;
  float* oaccum_ptr;         // num_splits x batch x h x seqlen_q x d fp32 (num_splits > 1), O
                             // of each split
  float* softmax_lseaccum_ptr;  // 2 x num_splits x batch x h x seqlen_q fp32: each split's raw
                                // max score m, then its sum l = sum exp2((s - m) *
                                // scale_softmax_log2)

  // ---- paged K/V (KV cache; the extended instantiations, forward and decode) -------------
  // With block_table, k / v are pages (num_pages, page_block_size, h_k, d) and batch entry b's
  // key row j lives in page block_table[b * block_table_batch_stride + j / page_block_size],
  // row j % page_block_size; k_batch_stride / v_batch_stride are the page strides. A kernel's
  // tile or a decode warp's 32 keys never straddle a page: page_block_size is a multiple of 64,
  // or one page holds every row (cache_batch_idx as a one-column table). Entries are clamped
  // into [0, num_pages). Declared last: the fields above keep the offsets the kernels were
  // built and measured with.
  const int* block_table = nullptr;
  index_t block_table_batch_stride = 0;
  int page_block_size = 0;
  int num_pages = 0;
  // Decode with several query rows (the extended decode kernel, seqlen_q > 1: the KV-cache op):
  // query i sees keys < key_end[b] - (seqlen_q - 1 - i) (causal, bottom-right) when set.
  int decode_causal_rows = 0;
  // ... and their ALiBi diagonals relative to the sequence's end (key_end[b] - seqlen_q + i,
  // flash-attn's per-sequence distance) instead of alibi_offset + i.
  int decode_rows_from_end = 0;

  // ---- attention bias / boolean mask (attn_bias; the extended instantiations) -------------
  // softmax(scale * q.k + bias) with bias[b, h, i, j] read through these element strides (0
  // for a broadcast dimension: never expanded in memory). bias_kind (BiasKind, score_mod.h):
  // bool (true = attend, false = -inf), fp16, bf16 or fp32, added in fp32. bias_scale =
  // 1 / scale_softmax: the kernels add it in raw-score units. Dense (non-packed, non-paged)
  // calls only; rows / keys index the call's seqlen_q / seqlen_k.
  const void* bias_ptr = nullptr;
  int bias_kind = 0;
  float bias_scale = 0.f;
  index_t bias_batch_stride = 0, bias_head_stride = 0, bias_row_stride = 0, bias_col_stride = 0;
  // Columns contiguous (bias_col_stride 1) and every even element 2-element aligned: the
  // forward reads pairs of columns with one load.
  int bias_pairs = 0;
  // The largest magnitude of a finite bias in raw units: FLT_MAX / (2 max(1, scale_softmax_log2)),
  // so that raw * scale_softmax_log2 (the exponents' units) and sums of two such values stay
  // finite (bias_to_raw clamps to it).
  float bias_raw_max = 1.7014117e38f;

  // ---- attention dropout (dropout.h; the extended instantiations) ---------------------------
  // dropout: P's elements kept iff their 32-bit Philox number (dropout.h) <
  // dropout_keep_threshold, the kept ones scaled by dropout_rp = 1 / (1 - p) (the forward on
  // O, the backward on dP and dV). Seed and offset: the values, or (CUDA-graph capture, the
  // backward) read on the device from dropout_seed_ptr / dropout_offset_ptr (+
  // dropout_offset_add). The forward writes the pair it used to dropout_rng_state_out (int64
  // [seed, offset]).
  int dropout = 0;
  uint32_t dropout_keep_threshold = 0;
  float dropout_rp = 1.f;
  // L2 prefetch of K / V (FLASH_SM75_FWD_L2_PREFETCH, set_plan_device): by the plain forward
  // kernels of tiles with kL2PrefetchTiles > 0 (kernel_traits.h, load_tile_g2r: with a tile's
  // loads, ask L2 for the tile l2_prefetch tiles past it), and by the decode kernel (each
  // step's V rows, DecodeTraits::kL2Prefetch; any value but 0). -1: each kernel's own (the
  // forward's distance set at launch, run_flash_fwd); 0: none. Here, in the padding before the
  // 8-byte seed: no later field moves (Flash_bwd_params extends this struct; moving its fields
  // changed a backward kernel's register allocation, a 4-byte spill).
  int l2_prefetch = -1;
  uint64_t dropout_seed = 0, dropout_offset = 0, dropout_offset_add = 0;
  const int64_t* dropout_seed_ptr = nullptr;
  const int64_t* dropout_offset_ptr = nullptr;
  int64_t* dropout_rng_state_out = nullptr;
};

// The largest head dim (bucket) whose backward kernels read an attention bias (the d = 256
// dK/dV kernel has no registers left for it); the host refuses larger ones.
constexpr int kBwdBiasMaxHeadDim = 128;

// The largest head-dim bucket whose backward kernels all take packed sequences and per-sequence
// diagonals (kernels/seq_info.h). Above it (d = 256) only a dropout's backward does (its dK/dV
// tile, Bwd_tile_config<256>::DropoutTraits, has the registers: kPackedSeq in
// bwd_kernel_traits.h); the host runs other packed calls there on a right-aligned padded copy,
// which a dropout's backward cannot use (it would move each sequence's rows and so its mask).
constexpr int kMaxBwdSeqHeadDim = 128;

// Whether the backward's kernels take these packed sequences / per-sequence diagonals natively
// at head dim d (else the host pads them): every call up to kMaxBwdSeqHeadDim, a dropout's
// above it.
inline bool bwd_takes_packed(int head_dim_bucket, bool dropout) {
  return head_dim_bucket <= kMaxBwdSeqHeadDim || dropout;
}

// Paged K/V needs a tile of kBlockN keys (and a decode warp's 32) inside one page.
constexpr int kPageBlockMultiple = 64;

// Host entry: dispatches on head dim, causal flag and lower diagonal. Defined in
// flash_fwd_dispatch.cpp.
void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream);

// The band has a lower diagonal (a sliding window's left edge): the local instantiations
// (Is_local) run it; causal-only and right-only bands run the causal ones.
inline bool has_window_lower(const Flash_fwd_params& params) {
  return params.is_causal && params.window_lower != kNoWindowLower;
}

// params.bias_kind: how the kernels read attn_bias (score_mod.h).
enum BiasKind : int { kBiasNone = 0, kBiasBool = 1, kBiasHalf = 2, kBiasBf16 = 3, kBiasFloat = 4 };
// Sets of kinds (a bit per kind) that an instantiation's bias code is compiled for.
constexpr int bias_kind_bit(int kind) { return 1 << kind; }
constexpr int kAllBiasKinds = bias_kind_bit(kBiasBool) | bias_kind_bit(kBiasHalf) |
                              bias_kind_bit(kBiasBf16) | bias_kind_bit(kBiasFloat);
// The bias-only forward's kinds: what torch's SDPA (a bool or a query-dtype mask) and HF's
// masks and position biases (bool, or the fp16 model's dtype) pass. bf16 / fp32 biases (the
// direct APIs only) run on the extended kernel. Two kinds rather than four halve the bias-only
// kernel's code (d = 128: 7184 sm_75 instructions with four, 4664 with these two, the plain
// kernel 2528).
constexpr int kFwdBiasKinds = bias_kind_bit(kBiasBool) | bias_kind_bit(kBiasHalf);

// The extended instantiations (Is_ext) run the call: a softcap, ALiBi slopes, packed (varlen)
// sequences, per-sequence diagonals, paged K/V, an attention bias / mask or dropout. The plain ones compile exactly as without these.
inline bool needs_ext(const Flash_fwd_params& params) {
  return params.softcap_in != 0.f || params.alibi_slopes_ptr != nullptr ||
         params.cu_seqlens_q != nullptr || params.cu_seqlens_k != nullptr ||
         params.per_seq_offset || params.block_table != nullptr || params.bias_ptr != nullptr ||
         params.dropout != 0;
}

// The forward's instantiation families (the Variant template argument of flash_fwd_kernel):
//  * kFwdPlain: none of needs_ext's features;
//  * kFwdExt: any of them (the runtime flags select what runs);
//  * kFwdBias: an attention bias / mask (bool or fp16: kFwdBiasKinds) and nothing else of
//    needs_ext's list, on a batch that
//    is not packed or paged, no band with a lower diagonal and no key splits: the kernel that
//    masked and biased prefill (HF padding masks, T5 bias, diffusers masks) runs. It carries
//    only the bias's code, so its registers and schedule stay close to the plain kernel's (the
//    extended kernel with nothing switched on measured 13-17% slower than the plain one at
//    d = 128).
//  * kFwdDropout: attention dropout and nothing else of needs_ext's list, on the same kind of
//    batch (training without a mask: BERT, GPT-2 and T5 fine-tunes): the plain kernel and the
//    mask's generator only.
enum FwdVariant : int { kFwdPlain = 0, kFwdExt = 1, kFwdBias = 2, kFwdDropout = 3 };

inline FwdVariant fwd_variant(const Flash_fwd_params& params) {
  if (!needs_ext(params)) return kFwdPlain;
  // Dense, unbanded below, one key split, no score modifier: what the two narrow variants share.
  const bool narrow = params.softcap_in == 0.f && params.alibi_slopes_ptr == nullptr &&
                      params.cu_seqlens_q == nullptr && params.cu_seqlens_k == nullptr &&
                      !params.per_seq_offset && params.block_table == nullptr &&
                      params.num_splits <= 1 && !has_window_lower(params);
  if (!narrow) return kFwdExt;
  if (params.dropout == 0 && params.bias_ptr != nullptr &&
      (kFwdBiasKinds & bias_kind_bit(params.bias_kind)) != 0) {
    return kFwdBias;
  }
  if (params.dropout != 0 && params.bias_ptr == nullptr) return kFwdDropout;
  return kFwdExt;
}

// One explicit specialization per generated instantiation file (instantiations/*.cu):
// (Is_causal, Is_local) in {(false, false), (true, false), (true, true)}, each plain and
// extended (kFwdExt: score modifiers, packed sequences, per-sequence diagonals; seq_info.h),
// and the unbanded ones (causal or not) also bias-only (kFwdBias) and dropout-only
// (kFwdDropout).
template <int kHeadDim, bool Is_causal, bool Is_local, int Variant>
void run_mha_fwd_(Flash_fwd_params& params, cudaStream_t stream);

// Decode path (seqlen_q == 1; the host fills the decode fields from plan_decode).
void run_mha_fwd_decode(Flash_fwd_params& params, cudaStream_t stream);
template <int kHeadDim, bool Is_ext>
void run_mha_fwd_decode_(Flash_fwd_params& params, cudaStream_t stream);

}  // namespace flash_sm75
