// Op registration: schemas under TORCH_LIBRARY, implementations per dispatch key. Fake (meta)
// implementations and autograd are registered from Python (flash_attention_sm75/_ops.py).
#include <torch/library.h>

#include "flash_api.h"

namespace {

using Bwd3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The two backward ops over one implementation Impl(dbias, args...) (mha_bwd_with /
// mha_bwd_cpu_with): `bwd` passes no bias gradient, `bwd_dbias` also returns it.
template <typename Sig>
struct BwdEntries;
template <typename... A>
struct BwdEntries<Bwd3(at::Tensor*, A...)> {
  template <Bwd3 (*Impl)(at::Tensor*, A...)>
  static Bwd3 plain(A... a) {
    return Impl(nullptr, a...);
  }
  template <Bwd3 (*Impl)(at::Tensor*, A...)>
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> with_dbias(A... a) {
    at::Tensor dbias;
    auto [dq, dk, dv] = Impl(&dbias, a...);
    return {dq, dk, dv, dbias};
  }
};
using BwdCuda = BwdEntries<decltype(flash_sm75::mha_bwd_with)>;
using BwdCpu = BwdEntries<decltype(flash_sm75::mha_bwd_cpu_with)>;

// bwd's arguments (bwd_dbias has the same).
#define FLASH_SM75_BWD_ARGS                                                                       \
  "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "                  \
  "float softmax_scale, bool is_causal, bool causal_bottom_right, Tensor? leftpad_k=None, "        \
  "Tensor? seqused_k=None, bool deterministic=False, Tensor? grad_softmax_lse=None, "              \
  "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, "                         \
  "Tensor? alibi_slopes=None, Tensor? attn_bias=None, float dropout_p=0.0, "                       \
  "Tensor? rng_state=None)"

}  // namespace

TORCH_LIBRARY(flash_attention_sm75, m) {
  // q: (b, seqlen_q, h, d) fp16; k, v: (b, seqlen_k, h_k, d) fp16; any strides, last dim contiguous.
  // Returns out (b, seqlen_q, h, d) fp16 contiguous and softmax_lse (b, h, seqlen_q) fp32.
// softcap / alibi_slopes: flash-attn's score modifiers (check_score_mod in flash_api.h);
// attn_bias: torch SDPA's attn_mask, bool or additive, broadcast through strides (check_attn_bias).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool is_causal=False, "
      "bool causal_bottom_right=True, Tensor? leftpad_k=None, Tensor? seqused_k=None, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None, Tensor? attn_bias=None) -> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) { m.impl("fwd", &flash_sm75::mha_fwd); }

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) { m.impl("fwd", &flash_sm75::mha_fwd_cpu); }

// ---- forward with attention dropout -----------------------------------------------------------
// fwd's arguments with dropout_p (flash-attn's, in [0, 1)) after v; a third output rng_state,
// int64 (2,) [seed, offset] on q's device (the forward's generator, written by the kernel), that
// bwd takes with the same dropout_p to regenerate the mask (mha_fwd_dropout in flash_api.h).
// dropout_mask: the keep mask (bool, CPU) those kernels draw, for tests and references.
TORCH_LIBRARY_FRAGMENT(flash_attention_sm75, m) {
  m.def(
      "fwd_dropout(Tensor q, Tensor k, Tensor v, float dropout_p, float? softmax_scale=None, "
      "bool is_causal=False, bool causal_bottom_right=True, Tensor? leftpad_k=None, "
      "Tensor? seqused_k=None, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? attn_bias=None) -> "
      "(Tensor out, Tensor softmax_lse, Tensor rng_state)");
  m.def(
      "dropout_mask(Tensor rng_state, int batch, int heads, int seqlen_q, int seqlen_k, "
      "float dropout_p) -> Tensor");
  // fwd_dropout drawing from a given rng_state (a pure function of its inputs, for
  // torch.compile: the graph draws rng_state with a random op the compiler knows).
  m.def(
      "fwd_dropout_seeded(Tensor q, Tensor k, Tensor v, float dropout_p, Tensor rng_state, "
      "float? softmax_scale=None, bool is_causal=False, bool causal_bottom_right=True, "
      "Tensor? leftpad_k=None, Tensor? seqused_k=None, int window_size_left=-1, "
      "int window_size_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "Tensor? attn_bias=None) -> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) {
  m.impl("fwd_dropout", &flash_sm75::mha_fwd_dropout);
  m.impl("fwd_dropout_seeded", &flash_sm75::mha_fwd_dropout_seeded);
  m.impl("dropout_mask", &flash_sm75::dropout_keep_mask);
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) {
  m.impl("fwd_dropout", &flash_sm75::mha_fwd_dropout_cpu);
  m.impl("fwd_dropout_seeded", &flash_sm75::mha_fwd_dropout_seeded_cpu);
  m.impl("dropout_mask", &flash_sm75::dropout_keep_mask);
}

// ---- backward ----------------------------------------------------------------------------------
// Gradients of fwd (functional, no mutation). dout/out like q, softmax_lse as returned by fwd,
// softmax_scale the value fwd used. Returns dq (like q), dk, dv (like k, v), fp16 contiguous BSHD.
// grad_softmax_lse: optional gradient flowing into fwd's softmax_lse output.
// bwd_dbias: the same, and a fourth output dbias, the gradient of attn_bias (required) before
// the sum over its broadcast dimensions: float32 (b, h, seqlen_q, seqlen_k), dS where a row sees
// a key, 0 elsewhere (the caller sums it to the bias's shape).
TORCH_LIBRARY_FRAGMENT(flash_attention_sm75, m) {
  m.def("bwd" FLASH_SM75_BWD_ARGS " -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("bwd_dbias" FLASH_SM75_BWD_ARGS " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) {
  m.impl("bwd", &BwdCuda::plain<&flash_sm75::mha_bwd_with>);
  m.impl("bwd_dbias", &BwdCuda::with_dbias<&flash_sm75::mha_bwd_with>);
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) {
  m.impl("bwd", &BwdCpu::plain<&flash_sm75::mha_bwd_cpu_with>);
  m.impl("bwd_dbias", &BwdCpu::with_dbias<&flash_sm75::mha_bwd_cpu_with>);
}

// ---- packed sequences (varlen) -----------------------------------------------------------------
// flash-attn's varlen layout and semantics (mha_varlen_fwd / mha_varlen_bwd in flash_api.h):
// q (total_q, h, d), k / v (total_k, h_k, d), int32 cu_seqlens (batch + 1,), per-sequence
// bottom-right causal / window / ALiBi; out (total_q, h, d), softmax_lse (h, total_q).
TORCH_LIBRARY_FRAGMENT(flash_attention_sm75, m) {
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale=None, bool is_causal=False, "
      "Tensor? seqused_k=None, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor out, Tensor softmax_lse)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
      "float softmax_scale, bool is_causal, Tensor? seqused_k=None, bool deterministic=False, "
      "Tensor? grad_softmax_lse=None, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0, "
      "Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // varlen_fwd with attention dropout drawn from rng_state (int64 (2,) [seed, offset], which
  // the caller draws per call and passes to varlen_bwd with the same dropout_p); dropout_p in
  // flash-attn's varlen position, after max_seqlen_k.
  m.def(
      "varlen_fwd_dropout(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
      "Tensor rng_state, float? softmax_scale=None, bool is_causal=False, "
      "Tensor? seqused_k=None, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) {
  m.impl("varlen_fwd", &flash_sm75::mha_varlen_fwd);
  m.impl("varlen_bwd", &flash_sm75::mha_varlen_bwd);
  m.impl("varlen_fwd_dropout", &flash_sm75::mha_varlen_fwd_dropout);
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) {
  m.impl("varlen_fwd", &flash_sm75::mha_varlen_fwd_cpu);
  m.impl("varlen_bwd", &flash_sm75::mha_varlen_bwd_cpu);
  m.impl("varlen_fwd_dropout", &flash_sm75::mha_varlen_fwd_dropout_cpu);
}

// ---- KV cache ----------------------------------------------------------------------------------
// flash_attn_with_kvcache's core (mha_kvcache_fwd in flash_api.h): k / v appended into k_cache /
// v_cache in place (declared mutations, so functionalization and torch.compile see the writes),
// then attention over each sequence's cache rows. No autograd (flash-attn has none either).
TORCH_LIBRARY_FRAGMENT(flash_attention_sm75, m) {
  m.def(
      "kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
      "Tensor? k=None, Tensor? v=None, Tensor? cache_leftpad=None, Tensor? block_table=None, "
      "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, "
      "int window_size_right=-1, float softcap=0.0, Tensor? alibi_slopes=None) -> "
      "(Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CUDA, m) {
  m.impl("kvcache_fwd", &flash_sm75::mha_kvcache_fwd);
}

TORCH_LIBRARY_IMPL(flash_attention_sm75, CPU, m) {
  m.impl("kvcache_fwd", &flash_sm75::mha_kvcache_fwd_cpu);
}
