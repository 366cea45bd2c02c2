// Parameters of the SM75 FlashAttention backward pass (FlashAttention-2 style).
//
// Flash_bwd_params extends the forward parameters: q/k/v, the forward output o (read only here),
// the forward softmax_lse (read only), strides, sizes, scale and masking are inherited with the
// same meaning; the backward adds dO, the gradients and the fp32 workspaces.
#pragma once

#include "flash.h"

namespace flash_sm75 {

struct Flash_bwd_params : public Flash_fwd_params {
  // ---- input: gradient of the output, batch x seqlen_q x h x d (fp16, any strides, last dim 1)
  const void* do_ptr;
  index_t do_batch_stride, do_row_stride, do_head_stride;

  // ---- outputs (fp16): dq like q (h heads), dk/dv like k/v (h_k heads, GQA-summed)
  void* dq_ptr;
  void* dk_ptr;
  void* dv_ptr;
  index_t dq_batch_stride, dq_row_stride, dq_head_stride;
  index_t dk_batch_stride, dk_row_stride, dk_head_stride;
  index_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // ---- fp32 workspaces
  // D = rowsum(dO * O) - dLSE: batch x h x seqlen_q, contiguous (written by the preprocess).
  float* dsoftmax_sum;
  // Optional gradient of softmax_lse (batch x h x seqlen_q, contiguous) or nullptr. A gradient
  // g flowing into lse_i adds g_i * P_ij to dS_ij, i.e. it is folded into D.
  const float* dlse_ptr;
  // Atomic dQ mode only: batch x h x seqlen_q x kD fp32 (kD = head_dim_bucket(d), the
  // instantiation's head dim), zero-initialised, contiguous; the main kernel adds every key
  // block's dS K into it, a final kernel scales and converts columns < d to fp16.
  float* dq_accum_ptr;
  // Gradient of attn_bias, or nullptr: batch x h x seqlen_q x seqlen_k fp32, contiguous,
  // zero-initialised; the dQ kernel writes dS (the gradient of the scores the bias is added to)
  // of every element its tiles visit, once (the host runs the dQ kernel, never atomic dQ). The
  // host sums it over the bias's broadcast dimensions.
  float* dbias_ptr = nullptr;

  // true: dQ accumulated with fp32 atomics inside the dK/dV kernel (fast, not bitwise
  // reproducible). false: dQ from a separate kernel over query tiles that recomputes S/P/dP
  // (deterministic, no atomics, ~1.4x the matmul work of the atomic mode).
  bool dq_atomic;

  // Deterministic mode: when dq_stream is not null, the dQ kernel runs on dq_stream,
  // concurrently with the dK/dV kernel (the two are independent; the CTAs of one fill the SMs
  // the other's last wave leaves idle). dq_fork is recorded on the caller's stream after the
  // preprocess and waited for by dq_stream; dq_join is recorded on dq_stream after the dQ
  // kernel and waited for by the caller's stream, so everything after the backward is ordered
  // after both kernels. Null: every kernel on the caller's stream.
  cudaStream_t dq_stream;
  cudaEvent_t dq_fork;
  cudaEvent_t dq_join;
};


// Host entry: dispatches on head dim and causal flag (flash_bwd_dispatch.cpp).
void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream);

// The backward's instantiation families, as the forward's (flash.h FwdVariant):
//  * kBwdPlain: none of needs_ext's features;
//  * kBwdExt: any of them (the runtime flags select what runs);
//  * kBwdDropout: attention dropout and nothing else, on a dense batch without a lower window
//    diagonal: the plain kernels and the mask's regeneration only (the extended ones with
//    nothing but dropout on cost it about as much again as the mask itself; DESIGN.md section 6).
enum BwdVariant : int { kBwdPlain = 0, kBwdExt = 1, kBwdDropout = 2 };

inline BwdVariant bwd_variant(const Flash_fwd_params& params) {
  if (!needs_ext(params)) return kBwdPlain;
  const bool dropout_only =
      params.dropout != 0 && params.bias_ptr == nullptr && params.softcap_in == 0.f &&
      params.alibi_slopes_ptr == nullptr && params.cu_seqlens_q == nullptr &&
      params.cu_seqlens_k == nullptr && !params.per_seq_offset && params.block_table == nullptr &&
      !has_window_lower(params);
  return dropout_only ? kBwdDropout : kBwdExt;
}

// One explicit specialization per generated instantiation file (instantiations/flash_bwd_*.cu),
// (Is_causal, Is_local) as run_mha_fwd_'s, Variant a BwdVariant (kBwdDropout never banded).
template <int kHeadDim, bool Is_causal, bool Is_local, int Variant>
void run_mha_bwd_(Flash_bwd_params& params, cudaStream_t stream);

}  // namespace flash_sm75
