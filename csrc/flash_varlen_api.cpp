// Host side of the packed-sequence (varlen) ops: flash-attn's varlen layout on the extended
// kernels (kernels/seq_info.h), and a float64 CPU reference that runs the dense op per sequence.
// No op registration here (see torch_bindings.cpp).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "flash_api.h"
#include "kernels/block_info.h"
#include "kernels/flash.h"
#include "kernels/flash_bwd.h"
#include "kernels/head_dims.h"

namespace flash_sm75 {
namespace {

constexpr int64_t kMaxVarlenSeqlen = int64_t{1} << 30;  // keeps every diagonal inside int

void check_packed(const at::Tensor& t, const char* name, const char* heads) {
  TORCH_CHECK_VALUE(t.dim() == 3, "flash_attention_sm75: ", name, " must be 3-D (total_tokens, ",
                    heads, ", head_dim), flash-attn's packed varlen layout, got ", t.dim(),
                    "-D of shape ", t.sizes());
}

void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt, "flash_attention_sm75: ", name,
                    " must be int32, got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, "flash_attention_sm75: ", name,
                    " must be 1-D of shape (batch + 1,), got ", cu.sizes());
  TORCH_CHECK_VALUE(cu.device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", cu.device());
  TORCH_CHECK_VALUE(cu.is_contiguous(), "flash_attention_sm75: ", name, " must be contiguous");
}

struct VarlenShape {
  double scale;
  int64_t batch;
};

// Everything that can be checked without reading device values, before any launch.
VarlenShape check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                         int64_t max_seqlen_q, int64_t max_seqlen_k,
                         std::optional<double> softmax_scale,
                         const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
                         int64_t window_size_right, double softcap,
                         const std::optional<at::Tensor>& alibi_slopes) {
  check_packed(q, "q", "num_heads");
  check_packed(k, "k", "num_heads_k");
  check_packed(v, "v", "num_heads_k");
  // dtype, head dims, GQA ratio, strides, scale: the dense op's rules on one-entry views.
  const double scale =
      check_fwd_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale,
                       std::nullopt, std::nullopt);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
                    "flash_attention_sm75: cu_seqlens_q and cu_seqlens_k must have the same length "
                    "(batch + 1), got ", cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_q <= kMaxVarlenSeqlen,
                    "flash_attention_sm75: max_seqlen_q must be in [0, 2^30], got ", max_seqlen_q);
  TORCH_CHECK_VALUE(max_seqlen_k >= 0 && max_seqlen_k <= kMaxVarlenSeqlen,
                    "flash_attention_sm75: max_seqlen_k must be in [0, 2^30], got ", max_seqlen_k);
  if (seqused_k.has_value()) {
    const at::Tensor& s = *seqused_k;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kInt, "flash_attention_sm75: seqused_k must be "
                      "int32, got ", s.scalar_type());
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == batch, "flash_attention_sm75: seqused_k must "
                      "have shape (batch,) = (", batch, ",), got ", s.sizes());
    TORCH_CHECK_VALUE(s.device() == q.device(), "flash_attention_sm75: seqused_k must be on the "
                      "same device as q (", q.device(), "), got ", s.device());
    TORCH_CHECK_VALUE(s.is_contiguous(), "flash_attention_sm75: seqused_k must be contiguous");
  }
  check_window_size(window_size_left, window_size_right);
  check_score_mod(softcap, scale, alibi_slopes, q.device(), batch, q.size(1));
  return {scale, batch};
}

// Fills the kernel parameters of a packed call on top of set_params_fprop's (which saw the
// packed tensors as one entry): per-entry lengths from the offsets, batch strides 0, the band's
// diagonals and ALiBi's offset relative to each entry's bottom-right corner.
void set_varlen_params(Flash_fwd_params& params, int64_t batch, int64_t max_seqlen_q,
                       int64_t max_seqlen_k, const at::Tensor& cu_seqlens_q,
                       const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
                       bool is_causal, int64_t window_size_left, int64_t window_size_right) {
  params.total_q = params.seqlen_q;
  params.total_k = params.seqlen_k;
  params.b = static_cast<int>(batch);
  params.seqlen_q = static_cast<int>(max_seqlen_q);
  params.seqlen_k = static_cast<int>(max_seqlen_k);
  params.q_batch_stride = params.k_batch_stride = params.v_batch_stride = 0;
  params.o_batch_stride = 0;
  params.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  params.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  params.leftpad_k = nullptr;
  params.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
  set_per_seq_diagonals(params, max_seqlen_q, max_seqlen_k, is_causal, window_size_left,
                        window_size_right);
}

bool nothing_to_do(int64_t batch, const at::Tensor& q, const at::Tensor& k, int64_t max_seqlen_q,
                   int64_t max_seqlen_k) {
  return batch == 0 || q.numel() == 0 || k.numel() == 0 || max_seqlen_q == 0 ||
         max_seqlen_k == 0;
}

void check_gpu(const at::Tensor& q) {
  TORCH_CHECK_VALUE(q.is_cuda(), "flash_attention_sm75: q must be a CUDA tensor, got ", q.device());
  const auto* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK_VALUE(props->major * 10 + props->minor >= 75,
                    "flash_attention_sm75: needs a GPU of compute capability >= 7.5 (Turing or "
                    "newer), got ", props->major, ".", props->minor);
}

// The packed-LSE-shaped arguments of the backward: (num_heads, total_q) float32.
void check_packed_lse(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "flash_attention_sm75: ", name,
                    " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == q.size(1) && t.size(1) == q.size(0),
                    "flash_attention_sm75: ", name, " must have shape (num_heads, total_q) = (",
                    q.size(1), ", ", q.size(0), "), got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t.device());
}

void check_like_packed_q(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kHalf, "flash_attention_sm75: ", name,
                    " must be float16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == q.sizes(), "flash_attention_sm75: ", name,
                    " must have the shape of q ", q.sizes(), ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t.device());
}

// The backward's arguments: check_varlen's, dout / out like q, the packed-LSE-shaped ones.
VarlenShape check_varlen_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& out,
                             const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, double softmax_scale,
                             const std::optional<at::Tensor>& seqused_k,
                             const std::optional<at::Tensor>& grad_softmax_lse,
                             int64_t window_size_left, int64_t window_size_right, double softcap,
                             const std::optional<at::Tensor>& alibi_slopes) {
  check_packed(dout, "dout", "num_heads");
  check_packed(out, "out", "num_heads");
  const VarlenShape vs = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, seqused_k, window_size_left,
                                      window_size_right, softcap, alibi_slopes);
  check_like_packed_q(dout, "dout", q);
  check_like_packed_q(out, "out", q);
  check_packed_lse(softmax_lse, "softmax_lse", q);
  if (grad_softmax_lse.has_value()) check_packed_lse(*grad_softmax_lse, "grad_softmax_lse", q);
  return vs;
}

// A 3-D packed tensor as the kernels want it (last dim contiguous, 16-byte aligned, strides
// multiples of 8 elements); the backward copies other layouts, as the dense op's does.
at::Tensor packed_kernel_layout(const at::Tensor& t) {
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 2; ++i) ok = ok && (t.size(i) == 1 || t.stride(i) % 8 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Host copies of the offsets for the CPU reference, with the value checks the GPU path leaves
// to its callers (a device-side check there).
std::vector<int64_t> cpu_offsets(const at::Tensor& cu, const char* name, int64_t total,
                                 int64_t max_len) {
  const at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> v(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  TORCH_CHECK_VALUE(v.front() >= 0 && v.back() <= total, "flash_attention_sm75: ", name,
                    " must hold offsets in [0, ", total, "] (the packed tokens), got ", v.front(),
                    " .. ", v.back());
  for (size_t i = 1; i < v.size(); ++i) {
    TORCH_CHECK_VALUE(v[i] >= v[i - 1] && v[i] - v[i - 1] <= max_len, "flash_attention_sm75: ",
                      name, " must be non-decreasing with no sequence longer than the max_seqlen "
                      "passed (", max_len, "), got ", name, "[", i - 1, "] = ", v[i - 1], " and ",
                      name, "[", i, "] = ", v[i]);
  }
  return v;
}

// Where each packed row goes in a right-aligned padded batch (B, max_len): the row of token t
// in the flattened (B * max_len) batch, or B * max_len (a dummy row) for a token of no sequence
// or past its sequence's `used` length. Sequence b's first `used[b]` rows end at row (b + 1) *
// max_len, so the dense kernels' single bottom-right offset is every sequence's own. All on the
// device, no host synchronisation.
at::Tensor padded_rows(const at::Tensor& cu_seqlens, int64_t total, int64_t max_len,
                       const std::optional<at::Tensor>& used) {
  const int64_t b = cu_seqlens.size(0) - 1;
  const at::Tensor cu = cu_seqlens.to(at::kLong);
  const at::Tensor t = at::arange(total, cu.options());
  const at::Tensor seq = at::searchsorted(cu.slice(0, 1).contiguous(), t, /*out_int32=*/false,
                                          /*right=*/true);
  const at::Tensor seq_c = seq.clamp_max(std::max<int64_t>(b - 1, 0));
  const at::Tensor pos = t - cu.index({seq_c});
  at::Tensor len = cu.slice(0, 1) - cu.slice(0, 0, b);
  if (used.has_value()) len = at::minimum(used->to(at::kLong).clamp_min(0), len);
  const at::Tensor len_t = len.index({seq_c});
  const at::Tensor valid = seq.lt(b).logical_and(t.ge(cu[0])).logical_and(pos.lt(len_t));
  const at::Tensor dst = (seq_c + 1) * max_len - len_t + pos;
  return at::where(valid, dst, at::full({}, b * max_len, cu.options()));
}

// (B, max_len, ...) right-aligned copy of packed x (rows per padded_rows), zeros elsewhere.
at::Tensor to_padded(const at::Tensor& x, const at::Tensor& rows, int64_t b, int64_t max_len) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = b * max_len + 1;
  at::Tensor buf = at::zeros(shape, x.options()).index_put_({rows}, x);
  shape[0] = max_len;
  shape.insert(shape.begin(), b);
  return buf.slice(0, 0, b * max_len).view(shape);
}

// Packed rows back from a (B, max_len, ...) padded tensor; 0 for rows of no sequence.
at::Tensor from_padded(const at::Tensor& x, const at::Tensor& rows) {
  std::vector<int64_t> shape = x.sizes().vec();
  const int64_t n = shape[0] * shape[1];
  shape.erase(shape.begin());
  shape[0] = n;
  at::Tensor flat = at::cat({x.reshape(shape), at::zeros({1, shape[1], shape[2]}, x.options())});
  return flat.index_select(0, rows);
}

// The packed-LSE-shaped (h, total_q) `lse` as (B, h, max_len), `fill` in the padding.
at::Tensor lse_to_padded(const at::Tensor& lse, const at::Tensor& rows, int64_t b,
                         int64_t max_len, double fill) {
  at::Tensor buf = at::full({b * max_len + 1, lse.size(0)}, fill, lse.options())
                       .index_put_({rows}, lse.t());
  return buf.slice(0, 0, b * max_len).view({b, max_len, lse.size(0)}).permute({0, 2, 1})
      .contiguous();
}

}  // namespace

namespace {
// mha_varlen_fwd; dropout_p > 0: from rng_in (mha_varlen_fwd_dropout).
std::tuple<at::Tensor, at::Tensor> varlen_fwd_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, const at::Tensor* rng_in) {
  const VarlenShape vs = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, seqused_k, window_size_left,
                                      window_size_right, softcap, alibi_slopes);
  check_dropout_p(dropout_p);
  if (rng_in != nullptr) check_rng_state(*rng_in, q);
  check_gpu(q);
  const at::Tensor q4 = q.unsqueeze(0), k4 = k.unsqueeze(0), v4 = v.unsqueeze(0);
  check_alignment(q4, "q");
  check_alignment(k4, "k");
  check_alignment(v4, "v");
  c10::cuda::CUDAGuard device_guard{q.device()};
  const int64_t total_q = q.size(0), h = q.size(1), d = q.size(2);
  // Zeros / -inf: tokens of no sequence (and rows that see no key) keep them.
  at::Tensor out = at::zeros({total_q, h, d}, q.options());
  at::Tensor lse = at::full({h, total_q}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(at::kFloat));
  if (nothing_to_do(vs.batch, q, k, max_seqlen_q, max_seqlen_k)) return {out, lse};

  Flash_fwd_params params;
  set_params_fprop(params, q4, k4, v4, out.unsqueeze(0), lse.unsqueeze(0), vs.scale, is_causal,
                   /*causal_bottom_right=*/true, std::nullopt, std::nullopt, window_size_left,
                   window_size_right, softcap, alibi_slopes);
  set_varlen_params(params, vs.batch, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                    seqused_k, is_causal, window_size_left, window_size_right);
  // The generator's [seed, offset] read on the device by the kernels (kernels/dropout.h);
  // named: params points into it until the launch is queued.
  at::Tensor rng_dev;
  if (dropout_p > 0.0) rng_dev = set_params_dropout_from(params, dropout_p, *rng_in, q);
  set_plan_device(params, q.get_device());
  params.small_grid_tile = 0;
  try {
    run_mha_fwd(params, at::cuda::getCurrentCUDAStream().stream());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  return varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, is_causal, seqused_k, window_size_left,
                         window_size_right, softcap, alibi_slopes, 0.0, nullptr);
}

std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_dropout(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  return varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, is_causal, seqused_k, window_size_left,
                         window_size_right, softcap, alibi_slopes, dropout_p, &rng_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_varlen_bwd(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& out_, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    bool deterministic, const std::optional<at::Tensor>& grad_softmax_lse,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  // 3-D first (packed_kernel_layout reads two strides); everything else after the copies.
  check_packed(q_, "q", "num_heads");
  check_packed(dout_, "dout", "num_heads");
  check_packed(out_, "out", "num_heads");
  check_packed(k_, "k", "num_heads_k");
  check_packed(v_, "v", "num_heads_k");
  const at::Tensor q = packed_kernel_layout(q_), k = packed_kernel_layout(k_),
                   v = packed_kernel_layout(v_);
  const at::Tensor dout = packed_kernel_layout(dout_), out = packed_kernel_layout(out_);
  const VarlenShape vs = check_varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                          seqused_k, grad_softmax_lse, window_size_left,
                                          window_size_right, softcap, alibi_slopes);
  check_dropout_backward(dropout_p, rng_state, q);
  check_gpu(q);
  c10::cuda::CUDAGuard device_guard{q.device()};
  const auto f16 = q.options();
  if (nothing_to_do(vs.batch, q, k, max_seqlen_q, max_seqlen_k)) {
    return {at::zeros(q.sizes(), f16), at::zeros(k.sizes(), f16), at::zeros(k.sizes(), f16)};
  }

  Flash_bwd_params params{};
  // A dropout's backward runs the dQ kernel (the atomic dK/dV kernels have no dropout).
  const bool dq_atomic = dropout_p == 0.0 && bwd_uses_atomic_dq(deterministic, q.size(2));
  if (!bwd_takes_packed(head_dim_bucket(q.size(2)), dropout_p > 0.0)) {
    // The d = 256 backward kernels without dropout take no packed sequences
    // (kernels/seq_info.h): the dense kernels on a right-aligned padded copy, where the single
    // bottom-right offset of the padded batch is every sequence's own (causal, window, ALiBi
    // distance), the key range [max_seqlen_k - used, max_seqlen_k) its keys, and padded query
    // rows (lse -inf) see none. (A dropout's backward never comes here: the copy would move each
    // sequence's rows, and so its mask; its d = 256 tile takes packed sequences.)
    const int64_t b = vs.batch;
    const at::Tensor rows_q = padded_rows(cu_seqlens_q, q.size(0), max_seqlen_q, std::nullopt);
    const at::Tensor rows_k = padded_rows(cu_seqlens_k, k.size(0), max_seqlen_k, seqused_k);
    const at::Tensor cu_k = cu_seqlens_k.to(at::kLong);
    at::Tensor used = cu_k.slice(0, 1) - cu_k.slice(0, 0, b);
    if (seqused_k.has_value()) used = at::minimum(seqused_k->to(at::kLong).clamp_min(0), used);
    const at::Tensor leftpad = (max_seqlen_k - used).to(at::kInt);
    std::optional<at::Tensor> dlse_pad;
    if (grad_softmax_lse.has_value()) {
      dlse_pad = lse_to_padded(grad_softmax_lse->contiguous(), rows_q, b, max_seqlen_q, 0.0);
    }
    // Named: params points into them until the launches are queued.
    const at::Tensor dout_p = to_padded(dout, rows_q, b, max_seqlen_q);
    const at::Tensor q_p = to_padded(q, rows_q, b, max_seqlen_q);
    const at::Tensor k_p = to_padded(k, rows_k, b, max_seqlen_k);
    const at::Tensor v_p = to_padded(v, rows_k, b, max_seqlen_k);
    const at::Tensor out_p = to_padded(out, rows_q, b, max_seqlen_q);
    const at::Tensor lse_p = lse_to_padded(softmax_lse.contiguous(), rows_q, b, max_seqlen_q,
                                           -std::numeric_limits<double>::infinity());
    BwdBuffers pb = prepare_bwd(params, dout_p, q_p, k_p, v_p, out_p, lse_p, vs.scale, is_causal,
                                /*causal_bottom_right=*/true, leftpad, std::nullopt, dq_atomic,
                                dlse_pad, window_size_left, window_size_right, softcap,
                                alibi_slopes);
    launch_bwd(params, dq_atomic, q.get_device());
    return {from_padded(pb.dq, rows_q), from_padded(pb.dk, rows_k), from_padded(pb.dv, rows_k)};
  }
  const std::optional<at::Tensor> dlse4 =
      grad_softmax_lse.has_value() ? std::optional<at::Tensor>(grad_softmax_lse->unsqueeze(0))
                                   : std::nullopt;
  BwdBuffers bufs = prepare_bwd(params, dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0),
                                v.unsqueeze(0), out.unsqueeze(0), softmax_lse.unsqueeze(0),
                                vs.scale, is_causal, /*causal_bottom_right=*/true, std::nullopt,
                                std::nullopt, dq_atomic, dlse4, window_size_left,
                                window_size_right, softcap, alibi_slopes);
  // The kernels write the rows of the sequences only: tokens of no sequence get 0 (and dQ
  // comes from the zeroed accumulator in the atomic mode).
  bufs.dk.zero_();
  bufs.dv.zero_();
  if (!dq_atomic) bufs.dq.zero_();
  set_varlen_params(params, vs.batch, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                    seqused_k, is_causal, window_size_left, window_size_right);
  params.do_batch_stride = params.dq_batch_stride = 0;
  params.dk_batch_stride = params.dv_batch_stride = 0;
  at::Tensor rng;  // the forward's [seed, offset] on q's device, read by the kernels
  if (dropout_p > 0.0) rng = set_params_dropout_from(params, dropout_p, *rng_state, q);
  launch_bwd(params, dq_atomic, q.get_device());
  return {bufs.dq.squeeze(0), bufs.dk.squeeze(0), bufs.dv.squeeze(0)};
}

// ---- CPU reference: the dense op per sequence --------------------------------------------------

namespace {
struct CpuSeq {
  int64_t q0, q1, k0, k1;  // rows of the packed q / k; keys k0 .. k1 - 1 are attended
};
std::vector<CpuSeq> cpu_sequences(const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k,
                                  const std::optional<at::Tensor>& seqused_k) {
  const auto cq = cpu_offsets(cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q);
  const auto ck = cpu_offsets(cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k);
  std::vector<CpuSeq> seqs;
  at::Tensor used;
  if (seqused_k.has_value()) used = seqused_k->to(at::kCPU, at::kLong).contiguous();
  for (size_t b = 0; b + 1 < cq.size(); ++b) {
    int64_t len_k = ck[b + 1] - ck[b];
    // seqused_k as the kernels' key range: clamped into [0, len_k].
    if (used.defined()) len_k = std::clamp<int64_t>(used.data_ptr<int64_t>()[b], 0, len_k);
    seqs.push_back({cq[b], cq[b + 1], ck[b], ck[b] + len_k});
  }
  return seqs;
}

std::optional<at::Tensor> slopes_of(const std::optional<at::Tensor>& alibi_slopes, int64_t b) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  return alibi_slopes->dim() == 2 ? (*alibi_slopes)[b] : *alibi_slopes;
}
}  // namespace

namespace {
std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, const at::Tensor* rng_in) {
  const VarlenShape vs = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, seqused_k, window_size_left,
                                      window_size_right, softcap, alibi_slopes);
  check_dropout_p(dropout_p);
  if (rng_in != nullptr) check_rng_state(*rng_in, q);
  const int64_t total_q = q.size(0), h = q.size(1), d = q.size(2);
  at::Tensor out = at::zeros({total_q, h, d}, q.options());
  at::Tensor lse = at::full({h, total_q}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(at::kFloat));
  const auto seqs = cpu_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  seqused_k);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const CpuSeq& s = seqs[b];
    if (s.q1 == s.q0) continue;
    const at::Tensor qb = q.slice(0, s.q0, s.q1).unsqueeze(0);
    const at::Tensor kb = k.slice(0, s.k0, s.k1).unsqueeze(0);
    const at::Tensor vb = v.slice(0, s.k0, s.k1).unsqueeze(0);
    const auto slopes = slopes_of(alibi_slopes, static_cast<int64_t>(b));
    // The kernels number sequence b's heads b * h + head (its mask's slices).
    auto [o, l] = dropout_p > 0.0
                      ? mha_fwd_dropout_seeded_cpu_at(
                            qb, kb, vb, dropout_p, *rng_in, vs.scale, is_causal,
                            /*causal_bottom_right=*/true, std::nullopt, std::nullopt,
                            window_size_left, window_size_right, softcap, slopes, std::nullopt,
                            static_cast<int64_t>(b) * h)
                      : mha_fwd_cpu(qb, kb, vb, vs.scale, is_causal, /*causal_bottom_right=*/true,
                                    std::nullopt, std::nullopt, window_size_left,
                                    window_size_right, softcap, slopes);
    out.slice(0, s.q0, s.q1).copy_(o[0]);
    lse.slice(1, s.q0, s.q1).copy_(l[0]);
  }
  return {out, lse};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  return varlen_fwd_cpu_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, is_causal, seqused_k, window_size_left,
                             window_size_right, softcap, alibi_slopes, 0.0, nullptr);
}

std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_dropout_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  return varlen_fwd_cpu_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, is_causal, seqused_k, window_size_left,
                             window_size_right, softcap, alibi_slopes, dropout_p, &rng_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    bool deterministic, const std::optional<at::Tensor>& grad_softmax_lse,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  const VarlenShape vs = check_varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                          seqused_k, grad_softmax_lse, window_size_left,
                                          window_size_right, softcap, alibi_slopes);
  check_dropout_backward(dropout_p, rng_state, q);
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), q.options());
  at::Tensor dv = at::zeros(k.sizes(), q.options());
  const auto seqs = cpu_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  seqused_k);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const CpuSeq& s = seqs[b];
    if (s.q1 == s.q0 || s.k1 == s.k0) continue;  // no query or no key: zero gradients
    std::optional<at::Tensor> dlse;
    if (grad_softmax_lse.has_value()) {
      dlse = grad_softmax_lse->slice(1, s.q0, s.q1).unsqueeze(0).contiguous();
    }
    auto [gq, gk, gv] = mha_bwd_cpu_at(
        nullptr, dout.slice(0, s.q0, s.q1).unsqueeze(0), q.slice(0, s.q0, s.q1).unsqueeze(0),
        k.slice(0, s.k0, s.k1).unsqueeze(0), v.slice(0, s.k0, s.k1).unsqueeze(0),
        out.slice(0, s.q0, s.q1).unsqueeze(0),
        softmax_lse.slice(1, s.q0, s.q1).unsqueeze(0).contiguous(), vs.scale, is_causal,
        /*causal_bottom_right=*/true, std::nullopt, std::nullopt, deterministic, dlse,
        window_size_left, window_size_right, softcap,
        slopes_of(alibi_slopes, static_cast<int64_t>(b)), std::nullopt, dropout_p, rng_state,
        static_cast<int64_t>(b) * q.size(1));
    dq.slice(0, s.q0, s.q1).copy_(gq[0]);
    dk.slice(0, s.k0, s.k1).copy_(gk[0]);
    dv.slice(0, s.k0, s.k1).copy_(gv[0]);
  }
  return {dq, dk, dv};
}

}  // namespace flash_sm75
