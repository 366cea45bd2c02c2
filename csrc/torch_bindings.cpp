// Op registration: schemas under TORCH_LIBRARY, implementations per dispatch key. Fake (meta)
// implementations and autograd are registered from Python (flash_attention_sm75/_ops.py).
#include <torch/library.h>

#include "flash_api.h"

TORCH_LIBRARY(flash_attention_sm75, m) {
  // q: (b, seqlen_q, h, d) fp16; k, v: (b, seqlen_k, h_k, d) fp16; any strides, last dim contiguous.
  // Returns out (b, seqlen_q, h, d) fp16 contiguous and softmax_lse (b, h, seqlen_q) fp32.
// softcap / alibi_slopes: flash-attn's score modifiers (check_score_mod in flash_api.h).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool is_causal=False, "
      "bool causal_bottom_right=True, Tensor? leftpad_k=None, Tensor? seqused_k=None, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None) -> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) { m.impl("fwd", &flash_sm75::mha_fwd); }

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) { m.impl("fwd", &flash_sm75::mha_fwd_cpu); }

// ---- backward ----------------------------------------------------------------------------------
// Gradients of fwd (functional, no mutation). dout/out like q, softmax_lse as returned by fwd,
// softmax_scale the value fwd used. Returns dq (like q), dk, dv (like k, v), fp16 contiguous BSHD.
// grad_softmax_lse: optional gradient flowing into fwd's softmax_lse output.
TORCH_LIBRARY_FRAGMENT(flash_attention_sm75, m) {
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "float softmax_scale, bool is_causal, bool causal_bottom_right, Tensor? leftpad_k=None, "
      "Tensor? seqused_k=None, bool deterministic=False, Tensor? grad_softmax_lse=None, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) { m.impl("bwd", &flash_sm75::mha_bwd); }

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) { m.impl("bwd", &flash_sm75::mha_bwd_cpu); }
