// Host side of the backward op: validate, fill Flash_bwd_params, allocate the fp32 workspaces,
// launch (CUDA); and the float32 ATen implementation of the same contract (CPU). No op
// registration here (see torch_bindings.cpp).
#include "flash_api.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include "kernels/block_info.h"
#include "kernels/flash_bwd.h"
#include "kernels/bwd_kernel_traits.h"
#include "kernels/head_dims.h"

namespace flash_sm75 {
namespace {

// The kernels read 16-byte vectors: last dim contiguous, 16-byte aligned data pointer, batch /
// seq / head strides divisible by 8 elements. The backward is mostly called by autograd with
// whatever layout the incoming gradient has (e.g. an expanded or sliced dout), so instead of
// rejecting other layouts it copies them into a contiguous tensor.
bool kernel_layout_ok(const at::Tensor& t) {
  if (t.stride(-1) != 1) return false;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int i = 0; i < 3; ++i) {
    if (t.size(i) != 1 && t.stride(i) % 8 != 0) return false;
  }
  return true;
}

at::Tensor to_kernel_layout(const at::Tensor& t) {
  if (!t.defined() || t.dim() != 4 || t.numel() == 0 || t.scalar_type() != at::kHalf) return t;
  if (kernel_layout_ok(t)) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

void check_like_q(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kHalf, "flash_attention_sm75: ", name,
                    " must be float16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == q.sizes(), "flash_attention_sm75: ", name,
                    " must have the shape of q ", q.sizes(), ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t.device());
}

void check_lse_like(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "flash_attention_sm75: ", name,
                    " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(2) &&
                        t.size(2) == q.size(1),
                    "flash_attention_sm75: ", name, " must have shape (batch, num_heads, seqlen_q) = (",
                    q.size(0), ", ", q.size(2), ", ", q.size(1), "), got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t.device());
}

// dQ mode. Default: the separate dQ kernel (no atomics, deterministic), which measured as fast
// or faster than atomic accumulation on the H200 proxy for every shape of scripts/smoke_bwd.py
// (DESIGN.md). FLASH_SM75_BWD_DQ=atomic selects fp32 atomicAdd accumulation of dQ instead (a
// tuning knob for GPUs with fast fp32 atomics); deterministic=True always uses the separate kernel.
bool env_selects_atomic_dq() {
  return env_choice("FLASH_SM75_BWD_DQ", {"separate", "atomic"}) == 1;
}

// FLASH_SM75_BWD_DQ_STREAM: "side" (default) runs the deterministic mode's dQ kernel on a
// second stream, concurrently with the dK/dV kernel; "same" runs both on the caller's stream.
bool env_selects_dq_side_stream() {
  return env_choice("FLASH_SM75_BWD_DQ_STREAM", {"side", "same"}) == 0;
}

// A timing-free event, destroyed with this object (the runtime releases an event's resources
// once its pending work is done). Two of them fork and join the dQ stream.
struct ScopedEvent {
  cudaEvent_t event = nullptr;
  ScopedEvent() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }
  ~ScopedEvent() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  ScopedEvent(const ScopedEvent&) = delete;
  ScopedEvent& operator=(const ScopedEvent&) = delete;
};
struct ForkJoinEvents {
  ScopedEvent fork, join;  // if creating join throws, fork's destructor still runs
};

// Zero-size problems (see zero_size in flash_api.cpp): zero gradients, no launch.
bool zero_size(const at::Tensor& q, const at::Tensor& k) { return q.numel() == 0 || k.numel() == 0; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> zero_size_bwd(const at::Tensor& q,
                                                             const at::Tensor& k) {
  const auto opts = q.options().dtype(at::kHalf);
  return {at::zeros(q.sizes(), opts), at::zeros(k.sizes(), opts), at::zeros(k.sizes(), opts)};
}

}  // namespace

BwdBuffers prepare_bwd(Flash_bwd_params& params, const at::Tensor& dout, const at::Tensor& q,
                       const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                       const at::Tensor& softmax_lse_, double softmax_scale, bool is_causal,
                       bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
                       const std::optional<at::Tensor>& seqused_k, bool dq_atomic,
                       const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left,
                       int64_t window_size_right, double softcap,
                       const std::optional<at::Tensor>& alibi_slopes) {
  BwdBuffers bufs;
  // Kept in bufs: params points into it (a non-contiguous lse is copied).
  bufs.lse = softmax_lse_.contiguous();
  const at::Tensor& softmax_lse = bufs.lse;
  if (grad_softmax_lse.has_value()) bufs.dlse = grad_softmax_lse->contiguous();

  const int64_t b = q.size(0), seqlen_q = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t seqlen_k = k.size(1), h_k = k.size(2);
  bufs.dq = at::empty({b, seqlen_q, h, d}, q.options());
  bufs.dk = at::empty({b, seqlen_k, h_k, d}, q.options());
  bufs.dv = at::empty({b, seqlen_k, h_k, d}, q.options());
  bufs.dsoftmax_sum = at::empty({b, h, seqlen_q}, q.options().dtype(at::kFloat));
  // Rows of the bucket's width (head_dims.h): the dK/dV kernel adds whole kD-wide tile rows at
  // constant offsets; columns at or past d stay 0 and are never converted.
  if (dq_atomic) {
    bufs.dq_accum = at::zeros({b, h, seqlen_q, static_cast<int64_t>(head_dim_bucket(d))},
                              q.options().dtype(at::kFloat));
  }

  set_params_fprop(params, q, k, v, out, softmax_lse, softmax_scale, is_causal,
                   causal_bottom_right, leftpad_k, seqused_k, window_size_left, window_size_right,
                   softcap, alibi_slopes);
  params.do_ptr = dout.data_ptr();
  params.do_batch_stride = dout.stride(0);
  params.do_row_stride = dout.stride(1);
  params.do_head_stride = dout.stride(2);
  params.dq_ptr = bufs.dq.data_ptr();
  params.dk_ptr = bufs.dk.data_ptr();
  params.dv_ptr = bufs.dv.data_ptr();
  params.dq_batch_stride = bufs.dq.stride(0);
  params.dq_row_stride = bufs.dq.stride(1);
  params.dq_head_stride = bufs.dq.stride(2);
  params.dk_batch_stride = bufs.dk.stride(0);
  params.dk_row_stride = bufs.dk.stride(1);
  params.dk_head_stride = bufs.dk.stride(2);
  params.dv_batch_stride = bufs.dv.stride(0);
  params.dv_row_stride = bufs.dv.stride(1);
  params.dv_head_stride = bufs.dv.stride(2);
  params.dsoftmax_sum = bufs.dsoftmax_sum.data_ptr<float>();
  params.dlse_ptr = bufs.dlse.defined() ? bufs.dlse.data_ptr<float>() : nullptr;
  params.dq_accum_ptr = dq_atomic ? bufs.dq_accum.data_ptr<float>() : nullptr;
  params.dq_atomic = dq_atomic;
  return bufs;
}

double check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out,
                        const at::Tensor& softmax_lse, double softmax_scale,
                        const std::optional<at::Tensor>& leftpad_k,
                        const std::optional<at::Tensor>& seqused_k,
                        const std::optional<at::Tensor>& grad_softmax_lse) {
  const double scale = check_fwd_inputs(q, k, v, softmax_scale, leftpad_k, seqused_k);
  check_like_q(dout, "dout", q);
  check_like_q(out, "out", q);
  check_lse_like(softmax_lse, "softmax_lse", q);
  if (grad_softmax_lse.has_value()) check_lse_like(*grad_softmax_lse, "grad_softmax_lse", q);
  return scale;
}

void make_dbias(at::Tensor* dbias, const std::optional<at::Tensor>& attn_bias,
                const at::Tensor& q, const at::Tensor& k) {
  if (dbias == nullptr) return;
  TORCH_CHECK_VALUE(attn_bias.has_value(), "flash_attention_sm75: bwd_dbias needs attn_bias "
                    "(its output is the bias's gradient)");
  TORCH_CHECK_VALUE(q.size(1) * k.size(1) <= kMaxDbiasSlice, "flash_attention_sm75: no "
                    "attn_bias gradient for seqlen_q * seqlen_k = ", q.size(1) * k.size(1),
                    " (at most ", kMaxDbiasSlice, ")");
  *dbias = at::zeros({q.size(0), q.size(2), q.size(1), k.size(1)}, q.options().dtype(at::kFloat));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_with(
    at::Tensor* dbias, const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& out_, const at::Tensor& softmax_lse_, double softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, bool deterministic,
    const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left, int64_t window_size_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  check_window_size(window_size_left, window_size_right);
  const at::Tensor q = to_kernel_layout(q_), k = to_kernel_layout(k_), v = to_kernel_layout(v_);
  const at::Tensor dout = to_kernel_layout(dout_), out = to_kernel_layout(out_);
  const double scale = check_bwd_inputs(dout, q, k, v, out, softmax_lse_, softmax_scale,
                                        leftpad_k, seqused_k, grad_softmax_lse);
  check_score_mod(softcap, scale, alibi_slopes, q, leftpad_k, seqused_k);
  const at::Tensor bias =
      attn_bias.has_value() ? check_attn_bias(*attn_bias, q, k.size(1), scale)
                            : at::Tensor();
  check_bias_backward(attn_bias, softcap, q.size(3));
  check_dropout_backward(dropout_p, rng_state, q);
  make_dbias(dbias, attn_bias, q, k);
  TORCH_CHECK_VALUE(q.is_cuda(), "flash_attention_sm75: q must be a CUDA tensor, got ", q.device());
  c10::cuda::CUDAGuard device_guard{q.device()};
  const auto* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK_VALUE(props->major * 10 + props->minor >= 75,
                    "flash_attention_sm75: needs a GPU of compute capability >= 7.5 (Turing or "
                    "newer), got ",
                    props->major, ".", props->minor);
  if (zero_size(q, k)) return zero_size_bwd(q, k);

  Flash_bwd_params params{};
  // A dropout's backward runs the dQ kernel (the atomic dK/dV kernels have no dropout), and so
  // does a bias gradient (the dQ kernel writes it).
  const bool dq_atomic = dropout_p == 0.0 && dbias == nullptr &&
                         bwd_uses_atomic_dq(deterministic, q.size(3));
  BwdBuffers bufs = prepare_bwd(params, dout, q, k, v, out, softmax_lse_, scale, is_causal,
                                causal_bottom_right, leftpad_k, seqused_k, dq_atomic,
                                grad_softmax_lse, window_size_left, window_size_right, softcap,
                                alibi_slopes);
  if (bias.defined()) set_params_bias(params, bias, scale);
  if (dbias != nullptr) params.dbias_ptr = dbias->data_ptr<float>();
  at::Tensor rng;  // the forward's [seed, offset] on q's device, read by the kernels
  if (dropout_p > 0.0) rng = set_params_dropout_from(params, dropout_p, *rng_state, q);
  launch_bwd(params, dq_atomic, q.get_device());
  return {bufs.dq, bufs.dk, bufs.dv};
}

bool bwd_uses_atomic_dq(bool deterministic, int64_t head_dim) {
  // Head dims without the atomic dQ mode (d > 128) run the deterministic kernels.
  return !deterministic && env_selects_atomic_dq() &&
         bwd_atomic_dq_supported(static_cast<int>(head_dim));
}

void launch_bwd(Flash_bwd_params& params, bool dq_atomic, int device) {
  const bool dq_side_stream = env_selects_dq_side_stream();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  std::optional<ForkJoinEvents> events;
  if (!dq_atomic && dq_side_stream) {
    // The pool hands out its streams round-robin and can return the caller's own one: then
    // there is nothing to fork.
    const cudaStream_t side =
        at::cuda::getStreamFromPool(/*isHighPriority=*/false, device).stream();
    if (side != stream) {
      events.emplace();
      params.dq_stream = side;
      params.dq_fork = events->fork.event;
      params.dq_join = events->join.event;
    }
  }
  // If the launch sequence throws after the fork, the caller's stream never waits for the dQ
  // stream: finish its work before the tensors it reads are freed (best effort; the error is
  // reported either way).
  auto drain_dq_stream = [&] {
    if (params.dq_stream != nullptr) (void)cudaStreamSynchronize(params.dq_stream);
  };
  try {
    run_mha_bwd(params, stream);
  } catch (const std::invalid_argument& e) {
    drain_dq_stream();
    TORCH_CHECK_VALUE(false, e.what());
  } catch (...) {
    drain_dq_stream();
    throw;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_cpu_with(
    at::Tensor* dbias, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, bool deterministic,
    const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left, int64_t window_size_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  return mha_bwd_cpu_at(dbias, dout, q, k, v, out, softmax_lse, softmax_scale, is_causal,
                        causal_bottom_right, leftpad_k, seqused_k, deterministic,
                        grad_softmax_lse, window_size_left, window_size_right, softcap,
                        alibi_slopes, attn_bias, dropout_p, rng_state, 0);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_cpu_at(
    at::Tensor* dbias, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, bool /*deterministic: always*/,
    const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p,
    const std::optional<at::Tensor>& rng_state, int64_t dropout_bh0) {
  check_window_size(window_size_left, window_size_right);
  // float32 ATen math even under torch.autocast (see mha_fwd_cpu).
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const double scale = check_bwd_inputs(to_kernel_layout(dout), to_kernel_layout(q),
                                        to_kernel_layout(k), to_kernel_layout(v),
                                        to_kernel_layout(out), softmax_lse, softmax_scale,
                                        leftpad_k, seqused_k, grad_softmax_lse);
  check_score_mod(softcap, scale, alibi_slopes, q, leftpad_k, seqused_k);
  const at::Tensor bias =
      attn_bias.has_value() ? check_attn_bias(*attn_bias, q, k.size(1), scale)
                            : at::Tensor();
  check_bias_backward(attn_bias, softcap, q.size(3));
  check_dropout_backward(dropout_p, rng_state, q);
  make_dbias(dbias, attn_bias, to_kernel_layout(q), to_kernel_layout(k));
  if (zero_size(q, k)) return zero_size_bwd(q, k);
  const int64_t b = q.size(0), h = q.size(2), d = q.size(3);
  const int64_t seqlen_k = k.size(1), h_k = k.size(2);
  const int64_t ratio = h / h_k;
  // (b, h, s, d) float32; K/V repeated over the q-heads of each kv-head. K and V rows outside
  // [leftpad_k, seqused_k) are zeros (as the kernels load them): a NaN or inf there must not
  // reach dq, dk or dv through 0 * NaN.
  std::optional<at::Tensor> outside;
  if (leftpad_k.has_value() || seqused_k.has_value()) {
    outside = cpu_key_in_range(k, leftpad_k, seqused_k).logical_not();  // b, 1, sk, 1
  }
  auto kv_rows = [&](const at::Tensor& t) {
    at::Tensor f = t.to(at::kFloat).transpose(1, 2);
    if (outside.has_value()) f = f.masked_fill(*outside, 0.0);
    return f.repeat_interleave(ratio, 1);
  };
  const at::Tensor qf = q.to(at::kFloat).transpose(1, 2);
  const at::Tensor kf = kv_rows(k);
  const at::Tensor vf = kv_rows(v);
  const at::Tensor dof = dout.to(at::kFloat).transpose(1, 2);
  const at::Tensor of = out.to(at::kFloat).transpose(1, 2);

  const at::Tensor visible = cpu_visibility_mask(q, k, is_causal, causal_bottom_right, leftpad_k,
                                                 seqused_k, window_size_left, window_size_right);

  // P from the saved LSE (as the kernel does); rows with lse = -inf saw no key: P = 0.
  const at::Tensor lse = softmax_lse.to(at::kFloat).unsqueeze(-1);  // b, h, sq, 1
  // Modified scores (softcap, ALiBi) and the softcap's derivative, which dS carries.
  at::Tensor dcap;
  at::Tensor s = cpu_mod_scores(at::matmul(qf, kf.transpose(-1, -2)) * scale, softcap,
                                alibi_slopes, causal_bottom_right, &dcap);
  if (bias.defined()) s = s + cpu_bias(bias).to(at::kFloat);
  const at::Tensor keep = visible.logical_and(at::isfinite(lse));
  const at::Tensor p = at::where(keep, at::exp(s - lse), at::zeros({}, s.options()));
  at::Tensor dsum = (dof * of).sum(-1, /*keepdim=*/true);
  if (grad_softmax_lse.has_value()) dsum = dsum - grad_softmax_lse->to(at::kFloat).unsqueeze(-1);
  at::Tensor dp = at::matmul(dof, vf.transpose(-1, -2));
  at::Tensor p_drop = p;  // what O was made of: P Z / (1 - dropout_p)
  if (dropout_p > 0.0) {
    p_drop = cpu_dropout(p, *rng_state, dropout_p, dropout_bh0);
    dp = cpu_dropout(dp, *rng_state, dropout_p, dropout_bh0);
  }
  const at::Tensor ds = p * (dp - dsum) * dcap;
  if (dbias != nullptr) dbias->copy_(ds);  // b, h, sq, sk: dS where P is nonzero, else 0
  const at::Tensor dq = at::matmul(ds, kf) * scale;                     // b, h, sq, d
  at::Tensor dk = at::matmul(ds.transpose(-1, -2), qf) * scale;         // b, h, sk, d
  at::Tensor dv = at::matmul(p_drop.transpose(-1, -2), dof);            // b, h, sk, d
  dk = dk.view({b, h_k, ratio, seqlen_k, d}).sum(2);
  dv = dv.view({b, h_k, ratio, seqlen_k, d}).sum(2);
  if (outside.has_value()) {
    // Exactly 0 for keys outside the range, also when a visible input is NaN (P = 0 there, but
    // dS = P * (dP - D) would be 0 * NaN).
    dk = dk.masked_fill(*outside, 0.0);
    dv = dv.masked_fill(*outside, 0.0);
  }
  return {dq.transpose(1, 2).to(at::kHalf).contiguous(), dk.transpose(1, 2).to(at::kHalf).contiguous(),
          dv.transpose(1, 2).to(at::kHalf).contiguous()};
}

}  // namespace flash_sm75
