// Host side of the forward op: validate, fill Flash_fwd_params, launch. No op registration
// here (see torch_bindings.cpp).
#include "flash_api.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/block_info.h"
#include "kernels/dropout.h"
#include "kernels/flash.h"
#include "kernels/launch_plan.h"

namespace flash_sm75 {
namespace {

void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.dim() == 4, "flash_attention_sm75: ", name,
                    " must be 4-D (batch, seqlen, num_heads, head_dim) in BSHD layout, got ",
                    t.dim(), "-D of shape ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kHalf, "flash_attention_sm75: ", name,
                    " must be float16 (SM75 tensor cores have no bf16/fp32 MMA), got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t.device());
  TORCH_CHECK_VALUE(t.stride(-1) == 1, "flash_attention_sm75: ", name,
                    " must have a contiguous last dimension (stride(-1) == 1), got strides ",
                    t.strides());
}

}  // namespace

void check_alignment(const at::Tensor& t, const char* name) {
  // The kernel moves 16-byte vectors: 8 fp16 elements.
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3; ++i) ok = ok && (t.size(i) == 1 || t.stride(i) % 8 == 0);
  TORCH_CHECK_VALUE(ok, "flash_attention_sm75: ", name,
                    " must be 16-byte aligned with batch/seq/head strides divisible by 8 "
                    "elements, got strides ",
                    t.strides());
}

namespace {

void check_key_bound(const std::optional<at::Tensor>& t, const char* name, const at::Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt, "flash_attention_sm75: ", name,
                    " must be int32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == q.size(0), "flash_attention_sm75: ", name,
                    " must have shape (batch,) = (", q.size(0), ",), got ", t->sizes());
  TORCH_CHECK_VALUE(t->device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t->device());
  TORCH_CHECK_VALUE(t->is_contiguous(), "flash_attention_sm75: ", name, " must be contiguous");
}

// Zero-size problems (batch, num_heads, seqlen_q or seqlen_k of 0; head_dim is a multiple of 8
// up to 256 once validated): the math definition, without a launch (a CUDA grid of size 0 is an error). Query
// rows that see no key (seqlen_k == 0) get out = 0 and lse = -inf, like any row that sees none.
bool zero_size(const at::Tensor& q, const at::Tensor& k) { return q.numel() == 0 || k.numel() == 0; }

std::tuple<at::Tensor, at::Tensor> zero_size_fwd(const at::Tensor& q) {
  const int64_t b = q.size(0), seqlen_q = q.size(1), h = q.size(2), d = q.size(3);
  return {at::zeros({b, seqlen_q, h, d}, q.options()),
          at::full({b, h, seqlen_q}, -std::numeric_limits<double>::infinity(),
                   q.options().dtype(at::kFloat))};
}

}  // namespace

double check_fwd_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        std::optional<double> softmax_scale,
                        const std::optional<at::Tensor>& leftpad_k,
                        const std::optional<at::Tensor>& seqused_k) {
  check_tensor(q, "q", q);
  check_tensor(k, "k", q);
  check_tensor(v, "v", q);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "flash_attention_sm75: k and v must have the same shape, got k ",
                    k.sizes(), " and v ", v.sizes(),
                    k.size(3) != v.size(3)
                        ? " (a value head_dim different from the query/key head_dim is not supported)"
                        : "");
  TORCH_CHECK_VALUE(k.size(0) == q.size(0), "flash_attention_sm75: q and k must have the same batch size, got ",
                    q.size(0), " and ", k.size(0));
  TORCH_CHECK_VALUE(k.size(3) == q.size(3), "flash_attention_sm75: q and k must have the same head_dim, got ",
                    q.size(3), " and ", k.size(3));
  const int64_t d = q.size(3);
  TORCH_CHECK_VALUE(flash_sm75::head_dim_bucket(d) != 0, "flash_attention_sm75: head_dim must be ",
                    flash_sm75::head_dim_rule(), ", got ", d);
  // Zero-size inputs are valid (the callers return an empty or zero result before any launch),
  // but a q head needs a kv head: no division by zero below or in the kernels.
  TORCH_CHECK_VALUE(k.size(2) > 0 || q.size(2) == 0,
                    "flash_attention_sm75: num_heads_k must be >= 1 when num_heads >= 1 (GQA/MQA: "
                    "num_heads must be a multiple of num_heads_k), got num_heads_k 0 and num_heads ",
                    q.size(2));
  TORCH_CHECK_VALUE(k.size(2) == 0 || q.size(2) % k.size(2) == 0,
                    "flash_attention_sm75: num_heads (", q.size(2), ") must be a multiple of num_heads_k (",
                    k.size(2), ") for GQA/MQA");
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(q.size(i) <= INT32_MAX && k.size(i) <= INT32_MAX,
                      "flash_attention_sm75: batch, seqlen and heads must each be < 2^31");
  }
  check_key_bound(leftpad_k, "leftpad_k", q);
  check_key_bound(seqused_k, "seqused_k", q);
  const double scale = softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
  // Normal in float32, and small enough that no score overflows for any float16 input:
  // scale * log2(e) * |q.k| <= FLT_MAX / 2 with |q.k| <= 256 * 65504^2. The factor 2 absorbs
  // the float32 roundings of scale * log2(e) and of the product (without it the largest score
  // rounds to inf, and inf - inf = NaN in the softmax). The Python side,
  // _rules.SOFTMAX_SCALE_MIN/MAX (the rulebook), uses the same bounds.
  constexpr double kScaleMin = static_cast<double>(FLT_MIN);
  constexpr double kScaleMax =
      static_cast<double>(FLT_MAX) / (2 * 1.4426950408889634 * 256 * 65504.0 * 65504.0);
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale >= kScaleMin && scale <= kScaleMax,
                    "flash_attention_sm75: softmax_scale must be a finite number > 0 within "
                    "[1.18e-38, 1.07e26] (float32 scores must not overflow), got ", scale);
  return scale;
}

int env_choice(const char* name, std::initializer_list<const char*> accepted) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return 0;
  int i = 0;
  for (const char* a : accepted) {
    if (std::strcmp(v, a) == 0) return i;
    ++i;
  }
  std::string list;
  i = 0;
  for (const char* a : accepted) {
    if (i > 0) list += (i + 1 == static_cast<int>(accepted.size())) ? " or " : ", ";
    list += std::string("'") + a + "'";
    ++i;
  }
  TORCH_CHECK_VALUE(false, "flash_attention_sm75: environment variable ", name, " must be ", list,
                    " (or unset), got '", v, "'");
  return 0;
}

// FLASH_SM75_FWD_SMALL_GRID_TILE (d = 64's small-grid tile, prefer_small_grid_tile): 'auto' (or
// unset) = 0, the tile where it pays; 'always' = 1 / 'never' = -1 force the choice (tests,
// tuning).
static int env_tile_choice(const char* name) {
  static constexpr int kChoice[] = {0, 1, -1};
  return kChoice[env_choice(name, {"auto", "always", "never"})];
}

// FLASH_SM75_FWD_L2_PREFETCH (Flash_fwd_params::l2_prefetch, every forward door): 'auto' (or
// unset) = -1, each kernel's own; or the tiles ahead for the forward tiles that prefetch ('0' =
// none, also in the decode kernel; tests, tuning).
int env_l2_prefetch() {
  static constexpr int kTiles[] = {-1, 0, 1, 2, 3, 4, 6, 8};
  return kTiles[env_choice("FLASH_SM75_FWD_L2_PREFETCH", {"auto", "0", "1", "2", "3", "4", "6", "8"})];
}

// kDeviceProfiles index of FLASH_SM75_DEVICE_PROFILE's value.
static int planning_profile_index() {
  static constexpr int kIndex[] = {0, 1, 1, 2};  // native, t4, turing (= t4), rtx2080ti
  return kIndex[env_choice("FLASH_SM75_DEVICE_PROFILE", {"native", "t4", "turing", "rtx2080ti"})];
}

const DeviceProfile* planning_profile() { return kDeviceProfiles[planning_profile_index()]; }

void set_plan_device(Flash_fwd_params& params, int device) {
  params.plan_profile = planning_profile_index();
  params.l2_prefetch = env_l2_prefetch();
  const DeviceProfile* profile = kDeviceProfiles[params.plan_profile];
  params.num_sms = profile != nullptr ? profile->num_sms
                                      : at::cuda::getDeviceProperties(device)->multiProcessorCount;
}

// FLASH_SM75_DECODE: 'auto' (or unset) runs seqlen_q == 1 calls on the split-KV decode kernel
// (plan_decode), 'never' on the prefill kernel (tests, comparisons).
static bool env_decode_enabled() {
  return env_choice("FLASH_SM75_DECODE", {"auto", "never"}) == 0;
}

// FLASH_SM75_FWD_SPLITS: 'auto' (or unset) gives the KV-cache op's prefill-kernel calls key splits
// where plan_fwd_splits finds them worth it, 'never' none (comparisons: bench_kvcache.py).
bool fwd_splits_enabled() {
  return env_choice("FLASH_SM75_FWD_SPLITS", {"auto", "never"}) == 0;
}

bool decode_gqa_on_prefill() {
  return env_choice("FLASH_SM75_DECODE_GQA", {"decode", "prefill"}) == 1;
}

bool group_rows_planned(const at::Tensor& q, const at::Tensor& k, bool is_causal,
                        bool causal_bottom_right, int64_t window_size_left,
                        int64_t window_size_right, bool has_alibi, bool has_bias) {
  if (q.dim() != 4 || k.dim() != 4 || q.numel() == 0 || k.numel() == 0) return false;
  return group_rows_eligible(q.size(1), q.size(2), k.size(2), is_causal, causal_bottom_right,
                             window_size_left, window_size_right, has_alibi, has_bias,
                             /*has_dropout=*/false) &&
         env_decode_enabled() && decode_gqa_on_prefill();
}

GroupRows group_rows_views(const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                           int64_t h_k) {
  const int64_t b = q.size(0), h = q.size(2), d = q.size(3), rows = h / h_k;
  // Query row j of kv head hk is q-head hk * rows + j: rows step by one head, heads by `rows`.
  // The query dimension has size 1, so its stride plays no part.
  auto as_rows = [&](const at::Tensor& t) {
    return t.as_strided({b, rows, h_k, d}, {t.stride(0), t.stride(2), rows * t.stride(2),
                                            t.stride(3)},
                        t.storage_offset());
  };
  return {as_rows(q), as_rows(out), lse.view({b, h_k, rows})};
}

void check_window_size(int64_t window_size_left, int64_t window_size_right) {
  TORCH_CHECK_VALUE(window_size_left >= -1,
                    "flash_attention_sm75: window_size_left must be -1 (no limit) or >= 0, got ",
                    window_size_left);
  TORCH_CHECK_VALUE(window_size_right >= -1,
                    "flash_attention_sm75: window_size_right must be -1 (no limit) or >= 0, got ",
                    window_size_right);
}

void check_score_mod(double softcap, double softmax_scale,
                     const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& q,
                     const std::optional<at::Tensor>& leftpad_k,
                     const std::optional<at::Tensor>& seqused_k) {
  check_score_mod(softcap, softmax_scale, alibi_slopes, q.device(), q.size(0), q.size(2));
  if (!alibi_slopes.has_value()) return;
  TORCH_CHECK_VALUE(!leftpad_k.has_value() && !seqused_k.has_value(),
                    "flash_attention_sm75: alibi_slopes cannot be combined with leftpad_k / "
                    "seqused_k (the ALiBi distance of a key range is not defined here); pass "
                    "alibi_slopes=None or no key ranges");
}

namespace {
// The shortest decimal that reads back as v (Python's repr), for messages about values at a
// boundary, where the stream's default 6 digits can print an out-of-range value as in range.
std::string shortest_repr(double v) {
  std::string text;
  for (int digits = 6; digits <= 17; ++digits) {
    std::ostringstream os;
    os << std::setprecision(digits) << v;
    text = os.str();
    if (std::strtod(text.c_str(), nullptr) == v) break;
  }
  return text;
}
}  // namespace

void check_score_mod(double softcap, double softmax_scale,
                     const std::optional<at::Tensor>& alibi_slopes, const c10::Device& device,
                     int64_t b, int64_t h) {
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                    "flash_attention_sm75: softcap must be a finite number >= 0 (0: no "
                    "soft-capping), got ", softcap);
  // The kernels cap raw scores as tanh(s * scale / softcap) * (softcap / scale) in float32: both
  // factors must be normal floats, with room below so that flushing a tiny s * scale / softcap
  // to 0 changes a score by under 2^-26 * scale (_rules.SOFTCAP_RATIO_MIN/MAX, the rulebook).
  TORCH_CHECK_VALUE(softcap == 0 || (softcap / softmax_scale >= kSoftcapRatioMin &&
                                     softcap / softmax_scale <= kSoftcapRatioMax),
                    "flash_attention_sm75: softcap / softmax_scale must be within [2^-100, "
                    "2^100] (float32 factors of the soft-cap), got softcap ",
                    shortest_repr(softcap), " and softmax_scale ", shortest_repr(softmax_scale));
  if (!alibi_slopes.has_value()) return;
  const at::Tensor& a = *alibi_slopes;
  TORCH_CHECK_VALUE(a.scalar_type() == at::kFloat,
                    "flash_attention_sm75: alibi_slopes must be float32, got ", a.scalar_type());
  TORCH_CHECK_VALUE(a.device() == device, "flash_attention_sm75: alibi_slopes must be on q's "
                    "device (", device, "), got ", a.device());
  const bool shape_ok = (a.dim() == 1 && a.size(0) == h) ||
                        (a.dim() == 2 && a.size(0) == b && a.size(1) == h);
  TORCH_CHECK_VALUE(shape_ok, "flash_attention_sm75: alibi_slopes must have shape (num_heads,) = (",
                    h, ",) or (batch, num_heads) = (", b, ", ", h, "), got ", a.sizes());
  TORCH_CHECK_VALUE(a.numel() == 0 || a.stride(-1) == 1,
                    "flash_attention_sm75: alibi_slopes must be contiguous in its last dimension, "
                    "got strides ", a.strides());
}

at::Tensor check_attn_bias(const at::Tensor& bias, const at::Tensor& q, int64_t seqlen_k,
                           double softmax_scale) {
  const auto dt = bias.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kBool || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat,
                    "flash_attention_sm75: attn_bias must be bool (True = attend), float16, "
                    "bfloat16 or float32, got ", dt);
  // Below kBiasScaleMin (flash_api.h) the kernels' clamp of raw biases would change finite
  // values that are no mask.
  TORCH_CHECK_VALUE(dt == at::kBool || softmax_scale >= kBiasScaleMin,
                    "flash_attention_sm75: a ", dt, " attn_bias needs softmax_scale >= 2^-27 "
                    "(7.45e-09; below it the kernels would clamp finite bias values), got ",
                    softmax_scale);
  TORCH_CHECK_VALUE(bias.device() == q.device(), "flash_attention_sm75: attn_bias must be on q's "
                    "device (", q.device(), "), got ", bias.device());
  const int64_t b = q.size(0), sq = q.size(1), h = q.size(2);
  const std::vector<int64_t> target{b, h, sq, seqlen_k};
  bool ok = bias.dim() >= 1 && bias.dim() <= 4;
  for (int64_t i = 0; ok && i < bias.dim(); ++i) {
    const int64_t size = bias.size(bias.dim() - 1 - i), want = target[3 - i];
    ok = size == want || size == 1;
  }
  TORCH_CHECK_VALUE(ok, "flash_attention_sm75: attn_bias of shape ", bias.sizes(),
                    " does not broadcast to (batch, num_heads, seqlen_q, seqlen_k) = (", b, ", ",
                    h, ", ", sq, ", ", seqlen_k, ") (1-D to 4-D, trailing dimensions aligned, "
                    "each of that size or 1)");
  const at::Tensor view = bias.expand(target);  // stride 0 where broadcast: no copy
  bool in_range = true;
  for (int i = 0; i < 4; ++i) in_range = in_range && view.stride(i) >= 0;
  const int64_t extent = (sq - 1) * view.stride(2) + (seqlen_k - 1) * view.stride(3);
  TORCH_CHECK_VALUE(in_range && extent <= INT32_MAX,
                    "flash_attention_sm75: attn_bias's (batch, head) slice spans ", extent + 1,
                    " elements with strides ", view.strides(), "; the kernels address up to 2^31 "
                    "(a (seqlen_q, seqlen_k) slice of fewer elements, non-negative strides)");
  return view;
}

void set_params_bias(Flash_fwd_params& params, const at::Tensor& view, double softmax_scale) {
  params.bias_ptr = view.data_ptr();
  switch (view.scalar_type()) {
    case at::kBool: params.bias_kind = 1; break;
    case at::kHalf: params.bias_kind = 2; break;
    case at::kBFloat16: params.bias_kind = 3; break;
    default: params.bias_kind = 4; break;  // float32 (check_attn_bias)
  }
  params.bias_scale = static_cast<float>(1.0 / softmax_scale);
  params.bias_raw_max =
      static_cast<float>(FLT_MAX / (2.0 * std::max(1.0, softmax_scale * M_LOG2E)));
  params.bias_batch_stride = view.stride(0);
  params.bias_head_stride = view.stride(1);
  params.bias_row_stride = view.stride(2);
  params.bias_col_stride = view.stride(3);
  const int64_t pair_bytes = 2 * static_cast<int64_t>(view.element_size());
  bool pairs = view.stride(3) == 1 &&
               reinterpret_cast<uintptr_t>(view.data_ptr()) % pair_bytes == 0;
  for (int i = 0; i < 3; ++i) pairs = pairs && (view.size(i) == 1 || view.stride(i) % 2 == 0);
  params.bias_pairs = pairs;
}

void check_dropout_p(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0,
                    "flash_attention_sm75: dropout_p must be in [0, 1), got ", dropout_p);
}

void set_params_dropout(Flash_fwd_params& params, double dropout_p) {
  params.dropout = 1;
  params.dropout_keep_threshold = dropout_keep_threshold(dropout_p);
  params.dropout_rp = static_cast<float>(1.0 / (1.0 - dropout_p));
}

at::Tensor set_params_dropout_from(Flash_fwd_params& params, double dropout_p,
                                   const at::Tensor& rng_state, const at::Tensor& q) {
  set_params_dropout(params, dropout_p);
  at::Tensor rng = rng_state.to(q.device()).contiguous();
  params.dropout_seed_ptr = rng.data_ptr<int64_t>();
  params.dropout_offset_ptr = rng.data_ptr<int64_t>() + 1;
  params.dropout_offset_add = 0;
  return rng;
}

void check_rng_state(const at::Tensor& rng_state, const at::Tensor& q) {
  TORCH_CHECK_VALUE(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 &&
                        rng_state.size(0) == 2 && rng_state.is_contiguous(),
                    "flash_attention_sm75: rng_state must be the forward's contiguous int64 "
                    "tensor of 2 elements [seed, offset], got dtype ",
                    rng_state.scalar_type(), ", shape ", rng_state.sizes(), " and strides ",
                    rng_state.strides());
  TORCH_CHECK_VALUE(rng_state.device() == q.device() || rng_state.device().is_cpu(),
                    "flash_attention_sm75: rng_state must be on q's device (", q.device(),
                    ") or the CPU, got ", rng_state.device());
}

void check_dropout_backward(double dropout_p, const std::optional<at::Tensor>& rng_state,
                            const at::Tensor& q) {
  check_dropout_p(dropout_p);
  if (dropout_p == 0.0) return;
  TORCH_CHECK_VALUE(rng_state.has_value(),
                    "flash_attention_sm75: dropout_p > 0 needs rng_state, the one the forward "
                    "drew from (fwd_dropout's third output, or the rng_state given to "
                    "fwd_dropout_seeded / varlen_fwd_dropout)");
  check_rng_state(*rng_state, q);
}

// The forward's generator: 4 Philox counter units of torch's default CUDA generator (its
// philox_cuda_state: values now, or device pointers read at each replay under graph capture).
void set_params_dropout_rng_cuda(Flash_fwd_params& params, const at::Tensor& rng_state_out) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState st;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    st = gen->philox_cuda_state(4);
  }
  if (st.captured_) {
    params.dropout_seed_ptr = st.seed_.ptr;
    params.dropout_offset_ptr = st.offset_.ptr;
    params.dropout_offset_add = st.offset_intragraph_;
  } else {
    params.dropout_seed = st.seed_.val;
    params.dropout_offset = st.offset_.val;
  }
  params.dropout_rng_state_out = rng_state_out.data_ptr<int64_t>();
}

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t seqlen_q, int64_t seqlen_k, double dropout_p) {
  return dropout_keep_mask_at(rng_state, 0, batch, heads, seqlen_q, seqlen_k, dropout_p);
}

at::Tensor dropout_keep_mask_at(const at::Tensor& rng_state, int64_t bh0, int64_t batch,
                                int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                                double dropout_p) {
  check_dropout_p(dropout_p);
  TORCH_CHECK_VALUE(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
                    "flash_attention_sm75: rng_state must be an int64 tensor [seed, offset]");
  TORCH_CHECK_VALUE(batch >= 0 && heads >= 0 && seqlen_q >= 0 && seqlen_k >= 0,
                    "flash_attention_sm75: dropout_mask sizes must be >= 0");
  const at::Tensor st = rng_state.to(at::kCPU).contiguous();
  const int64_t* v = st.data_ptr<int64_t>();
  const DropoutRng rng =
      dropout_rng_from(static_cast<uint64_t>(v[0]), static_cast<uint64_t>(v[1]));
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k},
                              at::TensorOptions().dtype(at::kBool));
  bool* m = mask.data_ptr<bool>();
  if (dropout_p == 0.0) return mask.fill_(true);
  const uint32_t thr = dropout_keep_threshold(dropout_p);
  for (int64_t bh = bh0; bh < bh0 + batch * heads; ++bh) {
    for (int64_t i = 0; i < seqlen_q; ++i) {
      for (int64_t j = 0; j < seqlen_k; ++j) {
        *m++ = dropout_keep(rng, static_cast<uint32_t>(bh), static_cast<uint32_t>(i),
                            static_cast<uint32_t>(j), thr);
      }
    }
  }
  return mask;
}

at::Tensor cpu_bias(const at::Tensor& view) {
  const at::Tensor v = view.to(at::kCPU);
  if (v.scalar_type() == at::kBool) {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    return at::where(v, at::zeros({}, f64),
                     at::full({}, -std::numeric_limits<double>::infinity(), f64));
  }
  return v.to(at::kDouble);
}

void check_bias_backward(const std::optional<at::Tensor>& attn_bias, double softcap,
                         int64_t head_dim) {
  if (!attn_bias.has_value()) return;
  TORCH_CHECK_VALUE(softcap == 0.0, "flash_attention_sm75: attn_bias with softcap has no "
                    "backward here (softcap = ", softcap, "); pass softcap=0 or no attn_bias");
  TORCH_CHECK_VALUE(head_dim_bucket(head_dim) <= kBwdBiasMaxHeadDim,
                    "flash_attention_sm75: attn_bias has no backward at head_dim ", head_dim,
                    " (the backward reads a bias up to head_dim ", kBwdBiasMaxHeadDim, ")");
}

void set_params_fprop(Flash_fwd_params& params, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& out, const at::Tensor& softmax_lse,
                      double softmax_scale, bool is_causal, bool causal_bottom_right,
                      const std::optional<at::Tensor>& leftpad_k,
                      const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
                      int64_t window_size_right, double softcap,
                      const std::optional<at::Tensor>& alibi_slopes) {
  params = Flash_fwd_params{};
  const int64_t b = q.size(0), seqlen_q = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t seqlen_k = k.size(1), h_k = k.size(2);
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.o_ptr = out.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.leftpad_k = leftpad_k.has_value() ? leftpad_k->data_ptr<int>() : nullptr;
  params.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
  params.q_batch_stride = q.stride(0);
  params.q_row_stride = q.stride(1);
  params.q_head_stride = q.stride(2);
  params.k_batch_stride = k.stride(0);
  params.k_row_stride = k.stride(1);
  params.k_head_stride = k.stride(2);
  params.v_batch_stride = v.stride(0);
  params.v_row_stride = v.stride(1);
  params.v_head_stride = v.stride(2);
  params.o_batch_stride = out.stride(0);
  params.o_row_stride = out.stride(1);
  params.o_head_stride = out.stride(2);
  params.b = static_cast<int>(b);
  params.seqlen_q = static_cast<int>(seqlen_q);
  params.seqlen_k = static_cast<int>(seqlen_k);
  params.h = static_cast<int>(h);
  params.h_k = static_cast<int>(h_k);
  params.h_h_k_ratio = static_cast<int>(h / h_k);
  params.d = static_cast<int>(d);
  params.scale_softmax = static_cast<float>(softmax_scale);
  params.scale_softmax_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  // Causal and / or a sliding window: one diagonal band, run by the masked instantiations.
  const BandDiagonals band = band_diagonals(params.seqlen_q, params.seqlen_k, causal_bottom_right,
                                            is_causal, window_size_left, window_size_right);
  params.is_causal = is_causal || window_size_left >= 0 || window_size_right >= 0;
  // Without a band the offset is still the alignment's (unused by the kernels, kept readable).
  params.causal_offset = params.is_causal
                             ? band.upper
                             : causal_offset(params.seqlen_q, params.seqlen_k, causal_bottom_right);
  params.window_lower = band.lower;
  // Score modifiers (kernels/score_mod.h), in the kernels' raw score units.
  if (softcap > 0) {
    params.softcap_in = static_cast<float>(softmax_scale / softcap);
    params.softcap_out = static_cast<float>(softcap / softmax_scale);
  }
  if (alibi_slopes.has_value()) {
    params.alibi_slopes_ptr = alibi_slopes->data_ptr<float>();
    params.alibi_slopes_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  params.alibi_offset = causal_offset(params.seqlen_q, params.seqlen_k, causal_bottom_right);
}

void set_per_seq_diagonals(Flash_fwd_params& params, int64_t max_seqlen_q, int64_t max_seqlen_k,
                           bool is_causal, int64_t window_size_left, int64_t window_size_right) {
  params.per_seq_offset = true;
  // A side beyond `lim` keys hides nothing in any entry (|key_end - seqlen_q| <= 2^30).
  const int64_t lim = std::min<int64_t>(max_seqlen_q + max_seqlen_k + 1, int64_t{1} << 30);
  params.is_causal = is_causal || window_size_left >= 0 || window_size_right >= 0;
  params.causal_offset = static_cast<int>(
      is_causal ? 0 : (window_size_right >= 0 ? std::min(window_size_right, lim) : lim));
  params.window_lower = window_size_left >= 0
                            ? static_cast<int>(-std::min(window_size_left, lim))
                            : kNoWindowLower;
  params.alibi_offset = 0;
}

namespace {
// mha_fwd / mha_fwd_dropout. dropout_p > 0: rng_state (int64 [seed, offset] on q's device) is
// written by the kernel.
std::tuple<at::Tensor, at::Tensor> mha_fwd_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    std::optional<double> softmax_scale, bool is_causal, bool causal_bottom_right,
    const std::optional<at::Tensor>& leftpad_k, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    double dropout_p, at::Tensor* rng_state, const at::Tensor* rng_in = nullptr) {
  const double scale = check_fwd_inputs(q, k, v, softmax_scale, leftpad_k, seqused_k);
  check_window_size(window_size_left, window_size_right);
  check_score_mod(softcap, scale, alibi_slopes, q, leftpad_k, seqused_k);
  const at::Tensor bias =
      attn_bias.has_value() ? check_attn_bias(*attn_bias, q, k.size(1), scale)
                            : at::Tensor();
  check_dropout_p(dropout_p);
  if (rng_in != nullptr) check_rng_state(*rng_in, q);
  TORCH_CHECK_VALUE(q.is_cuda(), "flash_attention_sm75: q must be a CUDA tensor, got ", q.device());
  check_alignment(q, "q");
  check_alignment(k, "k");
  check_alignment(v, "v");

  c10::cuda::CUDAGuard device_guard{q.device()};
  const auto* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK_VALUE(props->major * 10 + props->minor >= 75,
                    "flash_attention_sm75: needs a GPU of compute capability >= 7.5 (Turing or "
                    "newer), got ",
                    props->major, ".", props->minor);
  if (rng_state != nullptr) *rng_state = at::zeros({2}, q.options().dtype(at::kLong));
  if (zero_size(q, k)) return zero_size_fwd(q);

  const int64_t b = q.size(0), seqlen_q = q.size(1), h = q.size(2), d = q.size(3);
  at::Tensor out = at::empty({b, seqlen_q, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, seqlen_q}, q.options().dtype(at::kFloat));
  if (dropout_p == 0.0 &&
      group_rows_planned(q, k, is_causal, causal_bottom_right, window_size_left,
                         window_size_right, alibi_slopes.has_value(), bias.defined())) {
    run_group_rows(q, k, v, out, lse, scale, leftpad_k, seqused_k, softcap,
                   env_tile_choice("FLASH_SM75_FWD_SMALL_GRID_TILE"));
    return {out, lse};
  }

  Flash_fwd_params params;
  set_params_fprop(params, q, k, v, out, lse, scale, is_causal, causal_bottom_right, leftpad_k,
                   seqused_k, window_size_left, window_size_right, softcap, alibi_slopes);
  if (bias.defined()) set_params_bias(params, bias, scale);
  // A given rng_state is read on the device by the kernel (as a captured graph's generator
  // state), so it is copied there first if it lives on the CPU; nothing is written back.
  at::Tensor rng_dev;
  if (dropout_p > 0.0) {
    if (rng_in != nullptr) {
      rng_dev = set_params_dropout_from(params, dropout_p, *rng_in, q);
    } else {
      set_params_dropout(params, dropout_p);
      set_params_dropout_rng_cuda(params, *rng_state);
    }
  }
  set_plan_device(params, q.get_device());
  params.small_grid_tile = env_tile_choice("FLASH_SM75_FWD_SMALL_GRID_TILE");
  // The decode kernel has no dropout: the forward kernels run such a call.
  run_fwd_planned(params, q, /*decode_allowed=*/dropout_p == 0.0);
  return {out, lse};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> mha_fwd(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v,
                                           std::optional<double> softmax_scale, bool is_causal,
                                           bool causal_bottom_right,
                                           const std::optional<at::Tensor>& leftpad_k,
                                           const std::optional<at::Tensor>& seqused_k,
                                           int64_t window_size_left, int64_t window_size_right,
                                           double softcap,
                                           const std::optional<at::Tensor>& alibi_slopes,
                                           const std::optional<at::Tensor>& attn_bias) {
  return mha_fwd_impl(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                      seqused_k, window_size_left, window_size_right, softcap, alibi_slopes,
                      attn_bias, 0.0, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_fwd_dropout(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    std::optional<double> softmax_scale, bool is_causal, bool causal_bottom_right,
    const std::optional<at::Tensor>& leftpad_k, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias) {
  at::Tensor rng_state;
  auto [out, lse] = mha_fwd_impl(q, k, v, softmax_scale, is_causal, causal_bottom_right,
                                 leftpad_k, seqused_k, window_size_left, window_size_right,
                                 softcap, alibi_slopes, attn_bias, dropout_p, &rng_state);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor> mha_fwd_dropout_seeded(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias) {
  return mha_fwd_impl(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                      seqused_k, window_size_left, window_size_right, softcap, alibi_slopes,
                      attn_bias, dropout_p, nullptr, &rng_state);
}

bool decode_enabled() { return env_decode_enabled(); }

std::pair<at::Tensor, at::Tensor> set_split_workspace(Flash_fwd_params& params,
                                                      const at::Tensor& q, int num_splits,
                                                      int keys_per_split) {
  params.num_splits = num_splits;
  params.keys_per_split = keys_per_split;
  if (num_splits <= 1) return {};
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor oaccum =
      at::empty({num_splits, params.b, params.h, params.seqlen_q, params.d}, f32);
  at::Tensor lseaccum = at::empty({2, num_splits, params.b, params.h, params.seqlen_q}, f32);
  params.oaccum_ptr = oaccum.data_ptr<float>();
  params.softmax_lseaccum_ptr = lseaccum.data_ptr<float>();
  return {oaccum, lseaccum};
}

void run_fwd_planned(Flash_fwd_params& params, const at::Tensor& q, bool decode_allowed,
                     int max_multi_rows) {
  std::pair<at::Tensor, at::Tensor> ws;  // decode split workspace, alive until the launches
  try {
    const DecodePlan dp =
        plan_decode(params.b, params.h, params.h_k, params.seqlen_q, params.seqlen_k,
                    flash_sm75::decode_head_dim(flash_sm75::head_dim_bucket(params.d)),
                    params.num_sms, decode_allowed && env_decode_enabled(), 8, max_multi_rows);
    if (dp.use) {
      params.decode_ratio_bucket = dp.ratio_bucket;
      // rows (b, h, seqlen_q): seqlen_q > 1 only with max_multi_rows
      ws = set_split_workspace(params, q, dp.num_splits, dp.keys_per_split);
      run_mha_fwd_decode(params, at::cuda::getCurrentCUDAStream().stream());
    } else {
      run_mha_fwd(params, at::cuda::getCurrentCUDAStream().stream());
    }
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_group_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, double scale,
                    const std::optional<at::Tensor>& leftpad_k,
                    const std::optional<at::Tensor>& seqused_k, double softcap,
                    int small_grid_tile,
                    const std::function<void(Flash_fwd_params&)>& adjust) {
  const GroupRows g = group_rows_views(q, out, lse, k.size(2));
  Flash_fwd_params params;
  set_params_fprop(params, g.q, k, v, g.out, g.lse, scale, /*is_causal=*/false,
                   /*causal_bottom_right=*/true, leftpad_k, seqused_k, -1, -1, softcap,
                   std::nullopt);
  if (adjust) adjust(params);
  set_plan_device(params, q.get_device());
  params.small_grid_tile = small_grid_tile;
  // The group's grid is b * h_k CTAs: a long cache needs key splits to fill the GPU. Splits run
  // on the extended kernels; per-sequence diagonals select them and change nothing here (no
  // band: the rows see every key of their range).
  std::pair<at::Tensor, at::Tensor> ws;
  if (fwd_splits_enabled()) {
    const auto [ctas, slots] =
        fwd_split_grid(params.d, params.b, params.h, params.seqlen_q, params.num_sms);
    const int splits = plan_fwd_splits(ctas, slots, params.seqlen_k);
    if (splits > 1) {
      set_per_seq_diagonals(params, params.seqlen_q, params.seqlen_k, false, -1, -1);
      ws = set_split_workspace(params, g.q, splits, 0);
    }
  }
  run_fwd_planned(params, g.q, /*decode_allowed=*/false);
}

namespace {
// [start, end) of every batch entry as int64 CPU tensors (b,): key_range() of block_info.h.
std::pair<at::Tensor, at::Tensor> cpu_key_bounds(int64_t b, int64_t seqlen_k,
                                                 const std::optional<at::Tensor>& leftpad_k,
                                                 const std::optional<at::Tensor>& seqused_k) {
  const auto idx = at::TensorOptions().dtype(at::kLong);
  at::Tensor start = leftpad_k.has_value() ? leftpad_k->to(at::kCPU, at::kLong).clamp(0, seqlen_k)
                                           : at::zeros({b}, idx);
  at::Tensor end = seqused_k.has_value()
                       ? at::maximum(seqused_k->to(at::kCPU, at::kLong).clamp_max(seqlen_k), start)
                       : at::full({b}, seqlen_k, idx);
  return {start, end};
}
}  // namespace

at::Tensor cpu_key_in_range(const at::Tensor& k, const std::optional<at::Tensor>& leftpad_k,
                            const std::optional<at::Tensor>& seqused_k) {
  const int64_t b = k.size(0), seqlen_k = k.size(1);
  const auto [start, end] = cpu_key_bounds(b, seqlen_k, leftpad_k, seqused_k);
  const at::Tensor j = at::arange(seqlen_k, at::TensorOptions().dtype(at::kLong)).view({1, 1, seqlen_k, 1});
  return j.ge(start.view({b, 1, 1, 1})).logical_and(j.lt(end.view({b, 1, 1, 1})));
}

at::Tensor cpu_visibility_mask(const at::Tensor& q, const at::Tensor& k, bool is_causal,
                               bool causal_bottom_right,
                               const std::optional<at::Tensor>& leftpad_k,
                               const std::optional<at::Tensor>& seqused_k,
                               int64_t window_size_left, int64_t window_size_right) {
  // Vectorised form of key_range() + key_visible() (block_info.h): the same clamping rules and
  // the same band (band_diagonals) as set_params_fprop gives the kernels.
  const int64_t b = q.size(0), seqlen_q = q.size(1), seqlen_k = k.size(1);
  const auto idx = at::TensorOptions().dtype(at::kLong);
  const at::Tensor i = at::arange(seqlen_q, idx).view({1, 1, seqlen_q, 1});
  const at::Tensor j = at::arange(seqlen_k, idx).view({1, 1, 1, seqlen_k});
  const auto [start, end] = cpu_key_bounds(b, seqlen_k, leftpad_k, seqused_k);
  at::Tensor visible = j.ge(start.view({b, 1, 1, 1})).logical_and(j.lt(end.view({b, 1, 1, 1})));
  if (is_causal || window_size_left >= 0 || window_size_right >= 0) {
    const BandDiagonals band =
        band_diagonals(static_cast<int>(seqlen_q), static_cast<int>(seqlen_k), causal_bottom_right,
                       is_causal, window_size_left, window_size_right);
    visible = visible.logical_and(j.le(i + band.upper)).logical_and(j.ge(i + band.lower));
  }
  return visible;  // (b, 1, seqlen_q, seqlen_k) bool
}

at::Tensor cpu_mod_scores(const at::Tensor& s, double softcap,
                          const std::optional<at::Tensor>& alibi_slopes, bool causal_bottom_right,
                          at::Tensor* dcap) {
  at::Tensor out = s;
  if (softcap > 0) {
    const at::Tensor t = at::tanh(s / softcap);
    out = t * softcap;
    if (dcap != nullptr) *dcap = 1 - t * t;
  } else if (dcap != nullptr) {
    *dcap = at::ones({}, s.options());
  }
  if (alibi_slopes.has_value()) {
    const int64_t b = s.size(0), h = s.size(1), seqlen_q = s.size(2), seqlen_k = s.size(3);
    const auto idx = s.options().dtype(at::kLong);
    const at::Tensor i = at::arange(seqlen_q, idx).view({seqlen_q, 1});
    const at::Tensor j = at::arange(seqlen_k, idx).view({1, seqlen_k});
    const int64_t off = causal_offset(static_cast<int>(seqlen_q), static_cast<int>(seqlen_k),
                                      causal_bottom_right);
    const at::Tensor dist = (i + off - j).abs().to(s.scalar_type());  // sq, sk
    const at::Tensor slopes = alibi_slopes->to(at::kCPU, s.scalar_type())
                                  .reshape({alibi_slopes->dim() == 2 ? b : 1, h, 1, 1});
    out = out - slopes * dist;
  }
  return out;
}

namespace {
std::tuple<at::Tensor, at::Tensor> mha_fwd_cpu_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    std::optional<double> softmax_scale, bool is_causal, bool causal_bottom_right,
    const std::optional<at::Tensor>& leftpad_k, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    double dropout_p, at::Tensor* rng_state, const at::Tensor* rng_in = nullptr,
    int64_t dropout_bh0 = 0) {
  const double scale = check_fwd_inputs(q, k, v, softmax_scale, leftpad_k, seqused_k);
  check_window_size(window_size_left, window_size_right);
  check_score_mod(softcap, scale, alibi_slopes, q, leftpad_k, seqused_k);
  const at::Tensor bias =
      attn_bias.has_value() ? check_attn_bias(*attn_bias, q, k.size(1), scale)
                            : at::Tensor();
  check_dropout_p(dropout_p);
  at::Tensor given;
  if (rng_in != nullptr) {
    check_rng_state(*rng_in, q);
    given = rng_in->to(at::kCPU).contiguous();
    rng_state = &given;
  }
  if (rng_state != nullptr && rng_in == nullptr) {
    // The CPU's generator seeds it (torch.manual_seed reproduces the call), offset 0.
    *rng_state = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
    if (dropout_p > 0.0) {
      auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
          std::nullopt, at::detail::getDefaultCPUGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      rng_state->data_ptr<int64_t>()[0] = static_cast<int64_t>(gen->random64());
    }
  }
  if (zero_size(q, k)) return zero_size_fwd(q);
  // FLASH_SM75_DECODE_GQA=prefill: the reference computes the CUDA op's plan, the group's
  // q-heads as query rows through the same views (group_rows_views), so that their mapping is
  // tested where no GPU is.
  if (dropout_p == 0.0 &&
      group_rows_planned(q, k, is_causal, causal_bottom_right, window_size_left,
                         window_size_right, alibi_slopes.has_value(), bias.defined())) {
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({q.size(0), q.size(2), 1}, q.options().dtype(at::kFloat));
    const GroupRows g = group_rows_views(q, out, lse, k.size(2));
    auto [o, l] = mha_fwd_cpu_impl(g.q, k, v, scale, /*is_causal=*/false,
                                   /*causal_bottom_right=*/true, leftpad_k, seqused_k, -1, -1,
                                   softcap, std::nullopt, std::nullopt, 0.0, nullptr);
    g.out.copy_(o);
    g.lse.copy_(l);
    return {out, lse};
  }
  // The ATen ops below must compute in float64 even under torch.autocast (which would run the
  // matmuls in bfloat16 and return a bfloat16 lse).
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t h = q.size(2), h_k = k.size(2);
  // (b, h, s, d) in float64; GQA by repeating K/V heads (the reference may copy). Not float32:
  // fp16 inputs give scores up to ~2^36 (times the scale), where float32 keeps too few bits of
  // the differences between keys (errors of 0.01-0.04 in O at scaled scores ~2^22, as the
  // kernel's exponent forms avoid, DESIGN.md section 2); float64 keeps 29 more. Only the CPU
  // path pays for it.
  at::Tensor qf = q.to(at::kDouble).transpose(1, 2);
  at::Tensor kf = k.to(at::kDouble).transpose(1, 2);
  at::Tensor vf = v.to(at::kDouble).transpose(1, 2);
  if (leftpad_k.has_value() || seqused_k.has_value()) {
    // Keys outside [leftpad_k, seqused_k) never influence anything (a NaN or inf past
    // seqused_k gave NaN through 0 * NaN in P V): their K and V rows are replaced by zeros, as
    // the kernels' loads zero-fill them (load_tile_g2r).
    const at::Tensor outside = cpu_key_in_range(k, leftpad_k, seqused_k).logical_not();
    kf = kf.masked_fill(outside, 0.0);
    vf = vf.masked_fill(outside, 0.0);
  }
  kf = kf.repeat_interleave(h / h_k, 1);
  vf = vf.repeat_interleave(h / h_k, 1);
  at::Tensor s = cpu_mod_scores(at::matmul(qf, kf.transpose(-1, -2)) * scale, softcap,
                                alibi_slopes, causal_bottom_right);  // b, h, sq, sk
  if (bias.defined()) s = s + cpu_bias(bias);

  const at::Tensor visible = cpu_visibility_mask(q, k, is_causal, causal_bottom_right, leftpad_k,
                                                 seqused_k, window_size_left, window_size_right);
  s = s.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  // P = exp(s - max) / sum, not exp(s - lse): at scaled scores ~1e13 and above, float64 loses
  // log(sum) in s - lse (tied keys at the row max got up to m x their weight: inf in fp16 O).
  // The max of a row that sees nothing (-inf) or sees an inf score is replaced by 0, as in
  // at::logsumexp, so that such rows keep lse = -inf / +inf as before.
  const at::Tensor row_max = at::amax(s, -1, /*keepdim=*/true);
  const at::Tensor m =
      row_max.masked_fill(row_max.abs() == std::numeric_limits<double>::infinity(), 0.0);
  const at::Tensor e = at::exp(s - m);
  const at::Tensor row_sum = e.sum(-1, /*keepdim=*/true);
  // Rows that see no key give 0 (0 / 0 there); NaN/inf in the inputs still propagate, as in
  // torch SDPA.
  at::Tensor p = (e / row_sum).masked_fill(row_max.isneginf(), 0.0);
  if (dropout_p > 0.0) {
    p = cpu_dropout(p, *rng_state, dropout_p, dropout_bh0);
  }
  at::Tensor out = at::matmul(p, vf).transpose(1, 2).to(at::kHalf).contiguous();
  at::Tensor lse = (m + at::log(row_sum)).squeeze(-1).to(at::kFloat);  // -inf: row sees nothing
  return {out, lse.contiguous()};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> mha_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v,
                                               std::optional<double> softmax_scale,
                                               bool is_causal, bool causal_bottom_right,
                                               const std::optional<at::Tensor>& leftpad_k,
                                               const std::optional<at::Tensor>& seqused_k,
                                               int64_t window_size_left, int64_t window_size_right,
                                               double softcap,
                                               const std::optional<at::Tensor>& alibi_slopes,
                                               const std::optional<at::Tensor>& attn_bias) {
  return mha_fwd_cpu_impl(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                          seqused_k, window_size_left, window_size_right, softcap, alibi_slopes,
                          attn_bias, 0.0, nullptr);
}

std::tuple<at::Tensor, at::Tensor> mha_fwd_dropout_seeded_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias) {
  return mha_fwd_dropout_seeded_cpu_at(q, k, v, dropout_p, rng_state, softmax_scale, is_causal,
                                       causal_bottom_right, leftpad_k, seqused_k,
                                       window_size_left, window_size_right, softcap,
                                       alibi_slopes, attn_bias, 0);
}

std::tuple<at::Tensor, at::Tensor> mha_fwd_dropout_seeded_cpu_at(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, int64_t dropout_bh0) {
  return mha_fwd_cpu_impl(q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k,
                          seqused_k, window_size_left, window_size_right, softcap, alibi_slopes,
                          attn_bias, dropout_p, nullptr, &rng_state, dropout_bh0);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_fwd_dropout_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    std::optional<double> softmax_scale, bool is_causal, bool causal_bottom_right,
    const std::optional<at::Tensor>& leftpad_k, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias) {
  at::Tensor rng_state;
  auto [out, lse] = mha_fwd_cpu_impl(q, k, v, softmax_scale, is_causal, causal_bottom_right,
                                     leftpad_k, seqused_k, window_size_left, window_size_right,
                                     softcap, alibi_slopes, attn_bias, dropout_p, &rng_state);
  return {out, lse, rng_state};
}

at::Tensor cpu_dropout(const at::Tensor& p, const at::Tensor& rng_state, double dropout_p,
                       int64_t bh0) {
  const at::Tensor keep = dropout_keep_mask_at(rng_state, bh0, p.size(0), p.size(1), p.size(2),
                                               p.size(3), dropout_p);
  return p * keep.to(p.scalar_type()) * (1.0 / (1.0 - dropout_p));
}

}  // namespace flash_sm75
