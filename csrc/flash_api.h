// C++ entry points of flash-attention-sm75, usable from LibTorch without Python.
//
// Tensors use the BSHD layout (batch, seqlen, heads, head_dim) with any strides whose last
// dimension is contiguous; a BHSD tensor is passed as its transpose(1, 2) view.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels/flash.h"

namespace flash_sm75 {

// Forward attention, FlashAttention-2 algorithm on SM75 tensor cores (CUDA tensors) or a float32
// reference (CPU tensors).
//   q:           batch x seqlen_q x num_heads   x head_dim, float16
//   k, v:        batch x seqlen_k x num_heads_k x head_dim, float16; num_heads % num_heads_k == 0
//   softmax_scale: > 0, default 1/sqrt(head_dim)
//   is_causal:   key j visible to query i iff j <= i + (causal_bottom_right ? seqlen_k - seqlen_q : 0)
//   leftpad_k:   optional int32 (batch,): first visible key per batch entry (default 0)
//   seqused_k:   optional int32 (batch,): one past the last visible key (default seqlen_k)
// Returns (out: batch x seqlen_q x num_heads x head_dim float16, contiguous;
//          softmax_lse: batch x num_heads x seqlen_q float32, contiguous, natural log;
//          rows that see no key get out = 0 and softmax_lse = -inf).
// Zero-size inputs (batch, num_heads (with num_heads_k), seqlen_q or seqlen_k of 0) return
// these shapes without a launch: empty, or with seqlen_k == 0 out = 0 and softmax_lse = -inf.
// Keys outside [leftpad_k, seqused_k) are never read (their values cannot affect the result).
// Throws c10::ValueError (Python ValueError) naming the argument for invalid input, before any
// kernel launch (num_heads_k == 0 with num_heads >= 1 is invalid).
std::tuple<at::Tensor, at::Tensor> mha_fwd(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v,
                                           std::optional<double> softmax_scale, bool is_causal,
                                           bool causal_bottom_right,
                                           const std::optional<at::Tensor>& leftpad_k,
                                           const std::optional<at::Tensor>& seqused_k,
                                           int64_t window_size_left = -1, int64_t window_size_right = -1,
                                           double softcap = 0.0,
                                           const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
                                           const std::optional<at::Tensor>& attn_bias = std::nullopt);

// The same contract computed with ATen ops in float32 on the CPU (reference and fallback).
std::tuple<at::Tensor, at::Tensor> mha_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v,
                                               std::optional<double> softmax_scale,
                                               bool is_causal, bool causal_bottom_right,
                                               const std::optional<at::Tensor>& leftpad_k,
                                               const std::optional<at::Tensor>& seqused_k,
                                               int64_t window_size_left = -1, int64_t window_size_right = -1,
                                               double softcap = 0.0,
                                               const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
                                               const std::optional<at::Tensor>& attn_bias = std::nullopt);

// Attention dropout (kernels/dropout.h): mha_fwd with P -> P * Z / (1 - dropout_p), Z_ij kept
// with probability 1 - dropout_p from Philox4x32-7 seeded by torch's default CUDA generator
// (the CPU reference: its default CPU generator, offset 0). dropout_p in [0, 1) (ValueError
// otherwise). Returns (out, softmax_lse, rng_state): rng_state int64 (2,) [seed, offset] on q's
// device, written by the kernel (so a CUDA-graph replay records what it drew), for mha_bwd.
// The LSE is that of the undropped scores. Never takes the decode kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_fwd_dropout(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    std::optional<double> softmax_scale, bool is_causal, bool causal_bottom_right,
    const std::optional<at::Tensor>& leftpad_k, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_fwd_dropout_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    std::optional<double> softmax_scale, bool is_causal, bool causal_bottom_right,
    const std::optional<at::Tensor>& leftpad_k, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias);
// mha_fwd_dropout drawing from a given rng_state (int64 (2,) [seed, offset], on q's device or
// the CPU) instead of torch's generator: a pure function of its inputs, for torch.compile,
// whose graph draws rng_state with a random op it knows (_ops.call_fwd). The same mask as
// mha_fwd_dropout's call that returned that rng_state. Returns (out, softmax_lse).
std::tuple<at::Tensor, at::Tensor> mha_fwd_dropout_seeded(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias);
std::tuple<at::Tensor, at::Tensor> mha_fwd_dropout_seeded_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias);
// ValueError unless 0 <= dropout_p < 1.
void check_dropout_p(double dropout_p);
// The backward's dropout: dropout_p > 0 needs the forward's rng_state. ValueError naming the
// argument otherwise.
void check_dropout_backward(double dropout_p, const std::optional<at::Tensor>& rng_state,
                            const at::Tensor& q);
// ValueError unless rng_state is an int64 (2,) contiguous tensor on q's device or the CPU.
void check_rng_state(const at::Tensor& rng_state, const at::Tensor& q);
// params.dropout, keep threshold and 1 / (1 - p).
void set_params_dropout(Flash_fwd_params& params, double dropout_p);
// set_params_dropout with a given [seed, offset] (rng_state: int64 (2,), checked by
// check_rng_state) read on the device by the kernels (kernels/dropout.h): copied to q's device
// if it lives on the CPU. Returns that device tensor, which the caller keeps alive until the
// launches are queued (params points into it); nothing is written back.
at::Tensor set_params_dropout_from(Flash_fwd_params& params, double dropout_p,
                                   const at::Tensor& rng_state, const at::Tensor& q);
// The keep mask Z (bool, CPU, (batch, heads, seqlen_q, seqlen_k)) that the kernels draw for
// rng_state: the reference of the kernels' generator (slice index batch * heads + head).
at::Tensor dropout_keep_mask(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t seqlen_q, int64_t seqlen_k, double dropout_p);
// The same mask for slices bh0 .. bh0 + batch * heads - 1 of the kernels' numbering (one
// sequence of a packed call is slices b * heads + head: bh0 = b * heads, batch = 1).
at::Tensor dropout_keep_mask_at(const at::Tensor& rng_state, int64_t bh0, int64_t batch,
                                int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                                double dropout_p);
// p * Z / (1 - dropout_p) for p of shape (batch, heads, seqlen_q, seqlen_k) on the CPU, Z from
// slices bh0 onwards (dropout_keep_mask_at).
at::Tensor cpu_dropout(const at::Tensor& p, const at::Tensor& rng_state, double dropout_p,
                       int64_t bh0 = 0);
// mha_fwd_dropout_seeded_cpu whose mask starts at slice dropout_bh0 (dropout_keep_mask_at): the
// CPU reference of one sequence of a packed call (mha_varlen_fwd_dropout_cpu).
std::tuple<at::Tensor, at::Tensor> mha_fwd_dropout_seeded_cpu_at(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, int64_t dropout_bh0);

// attn_bias (torch SDPA's attn_mask): an additive bias or a boolean mask on the scaled scores,
// softmax(softmax_scale * q.k + bias), added in fp32 after softcap and ALiBi; bool means True =
// attend (False: -inf). dtype bool, float16, bfloat16 or float32; any shape that broadcasts to
// (batch, num_heads, seqlen_q, seqlen_k) as torch broadcasts (1-D to 4-D, trailing dimensions
// aligned), any strides, on q's device; read in place (broadcast dimensions through stride 0,
// never expanded in memory). A row whose keys are all masked (False / -inf) gives out = 0 and
// softmax_lse = -inf; a finite bias keeps the result finite. Returns the (batch, num_heads,
// seqlen_q, seqlen_k) broadcast view; ValueError naming attn_bias otherwise (also when one
// (batch, head) slice spans 2^31 elements or more, and for a floating bias at a softmax_scale
// below kBiasScaleMin).
at::Tensor check_attn_bias(const at::Tensor& attn_bias, const at::Tensor& q, int64_t seqlen_k,
                           double softmax_scale);
// The smallest softmax_scale a floating attn_bias runs with (_rules.BIAS_SCALE_MIN): the
// kernels add biases in raw units (bias / softmax_scale) and clamp |raw| > params.bias_raw_max
// (~1.7e38 at scales <= 1), so from 2^-27 on only |bias| > ~1.3e30 (mask sentinels) reaches the
// clamp, and no fp16 value does (the kernels read fp16 biases without it).
constexpr double kBiasScaleMin = 7.450580596923828e-09;  // 2^-27
// A softcap is accepted with softcap / softmax_scale in [2^-100, 2^100] (check_score_mod).
constexpr double kSoftcapRatioMin = 7.888609052210118e-31;  // 2^-100
constexpr double kSoftcapRatioMax = 1.2676506002282294e30;  // 2^100
// params.bias_* from check_attn_bias's view, which must stay alive until the launches are queued.
void set_params_bias(Flash_fwd_params& params, const at::Tensor& bias_view, double softmax_scale);
// The CPU references' bias: the view as float64, bool as 0 / -inf.
at::Tensor cpu_bias(const at::Tensor& bias_view);
// The backward's limits with a bias: no softcap with it, head_dim <= kBwdBiasMaxHeadDim
// (kernels/flash.h). ValueError naming attn_bias otherwise.
void check_bias_backward(const std::optional<at::Tensor>& attn_bias, double softcap, int64_t head_dim);
// mha_bwd_with's bias-gradient output, if requested: attn_bias given, seqlen_q * seqlen_k <=
// kMaxDbiasSlice (the kernel's 32-bit offsets in a (batch, head) slice); then allocated
// zero-filled (float32 (batch, h, seqlen_q, seqlen_k) on q's device; q, k in the kernel layout):
// the tiles a causal mask or a sliding window prunes are never visited and keep their zeros.
constexpr int64_t kMaxDbiasSlice = (int64_t{1} << 31) - 1;
void make_dbias(at::Tensor* dbias, const std::optional<at::Tensor>& attn_bias, const at::Tensor& q,
                const at::Tensor& k);

// Score modifiers (flash-attn's), applied to the scaled scores s = softmax_scale * q.k before the
// mask and the softmax (kernels/score_mod.h):
//   softcap:      finite, >= 0; 0 = off. s -> softcap * tanh(s / softcap) (Gemma 2).
//   alibi_slopes: optional float32 (num_heads,) or (batch, num_heads), last dim contiguous, on
//                 q's device. s -> s - slope * |i + o - j| after the softcap, with o the causal
//                 alignment's offset (seqlen_k - seqlen_q bottom-right, 0 top-left), also
//                 without causal; not combinable with leftpad_k / seqused_k.
// softmax_lse is the log-sum-exp of the modified scores. Invalid values raise ValueError naming
// the argument (before any launch).
void check_score_mod(double softcap, double softmax_scale,
                     const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& q,
                     const std::optional<at::Tensor>& leftpad_k,
                     const std::optional<at::Tensor>& seqused_k);

// The CPU reference of the score modifiers on scaled scores s (batch, num_heads, seqlen_q,
// seqlen_k); with dcap, also the softcap's derivative 1 - tanh^2 (1 without a softcap).
at::Tensor cpu_mod_scores(const at::Tensor& s, double softcap,
                          const std::optional<at::Tensor>& alibi_slopes, bool causal_bottom_right,
                          at::Tensor* dcap = nullptr);

// The same checks for a batch of b entries with h query heads on `device`, without the key-range
// rule (packed sequences define ALiBi's distance per sequence, so key ranges are allowed there).
void check_score_mod(double softcap, double softmax_scale,
                     const std::optional<at::Tensor>& alibi_slopes, const c10::Device& device,
                     int64_t b, int64_t h);

// The kernels' layout rule for a 4-D BSHD tensor: 16-byte aligned data, batch / seq / head
// strides divisible by 8 elements (or of size 1). ValueError naming the argument otherwise.
void check_alignment(const at::Tensor& t, const char* name);

// window_size_left / window_size_right: -1 (no limit on that side) or >= 0; anything else
// raises ValueError naming the argument (before any launch).
void check_window_size(int64_t window_size_left, int64_t window_size_right);

// The value of environment variable `name` as an index into `accepted` (unset or empty: 0, the
// default); any other value raises ValueError naming the variable and the accepted values.
int env_choice(const char* name, std::initializer_list<const char*> accepted);

// The GPU whose launch decisions the kernels plan for (kernels/launch_plan.h, DeviceProfile):
// FLASH_SM75_DEVICE_PROFILE = 'native' (or unset: the device itself, its SM count and the
// occupancy API), 't4' (alias 'turing') or 'rtx2080ti' (that GPU's SM count and compute
// capability 7.5's occupancy rules); any other value raises ValueError naming the variable.
// Returns nullptr for native.
struct DeviceProfile;
const DeviceProfile* planning_profile();
// FLASH_SM75_FWD_L2_PREFETCH's value for Flash_fwd_params::l2_prefetch (-1: 'auto' or unset);
// ValueError for any other value (read by set_plan_device; the KV-cache op reads it before its
// append).
int env_l2_prefetch();
// params.plan_profile and params.num_sms for a call on CUDA device `device`.
void set_plan_device(Flash_fwd_params& params, int device);

// Input validation shared by both implementations (exposed for the C++ tests). Returns the
// softmax scale to use.
double check_fwd_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        std::optional<double> softmax_scale,
                        const std::optional<at::Tensor>& leftpad_k,
                        const std::optional<at::Tensor>& seqused_k);

// Which keys lie in [leftpad_k[b], seqused_k[b]) (clamped as key_range() in
// csrc/kernels/block_info.h), (batch, 1, seqlen_k, 1) bool on the CPU; k is (batch, seqlen_k,
// num_heads_k, head_dim). The CPU implementations zero the K/V rows outside it.
at::Tensor cpu_key_in_range(const at::Tensor& k, const std::optional<at::Tensor>& leftpad_k,
                            const std::optional<at::Tensor>& seqused_k);

// Which keys each query sees, (batch, 1, seqlen_q, seqlen_k) bool on the CPU: the mask rule of
// csrc/kernels/block_info.h (key ranges clamped into [0, seqlen_k], causal offset), used by the
// CPU reference implementations.
at::Tensor cpu_visibility_mask(const at::Tensor& q, const at::Tensor& k, bool is_causal,
                               bool causal_bottom_right,
                               const std::optional<at::Tensor>& leftpad_k,
                               const std::optional<at::Tensor>& seqused_k,
                               int64_t window_size_left = -1, int64_t window_size_right = -1);

// Fills the kernel parameters from validated tensors (out and softmax_lse already allocated).
void set_params_fprop(Flash_fwd_params& params, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& out, const at::Tensor& softmax_lse,
                      double softmax_scale, bool is_causal, bool causal_bottom_right,
                      const std::optional<at::Tensor>& leftpad_k,
                      const std::optional<at::Tensor>& seqused_k,
                      int64_t window_size_left = -1, int64_t window_size_right = -1,
                      double softcap = 0.0,
                      const std::optional<at::Tensor>& alibi_slopes = std::nullopt);

// ---- backward (csrc/flash_bwd_api.cpp) --------------------------------------------------------
// Gradients of mha_fwd. dout and out: like q (out and softmax_lse are mha_fwd's outputs);
// softmax_scale: the value the forward used (> 0). Returns (dq like q; dk, dv like k, v: h_k
// heads, summed over the q-heads of each kv-head), float16, contiguous BSHD. Rows that saw no
// key give zero gradients; keys outside [leftpad_k, seqused_k) get zero dk/dv and do not affect
// dq. Zero-size inputs return zero gradients of these shapes without a launch.
// deterministic: no floating-point atomics (bitwise reproducible; dQ from a separate kernel
// that recomputes S/P/dP, ~1.4x the matmul work of atomic dQ accumulation). The separate dQ
// kernel is also the default for deterministic=false unless FLASH_SM75_BWD_DQ=atomic.
// grad_softmax_lse: optional gradient flowing into softmax_lse (batch x h x seqlen_q float32).
// dbias (first argument; nullptr: none): receives the gradient of attn_bias before the sum over
// its broadcast dimensions, float32 (batch, h, seqlen_q, seqlen_k) contiguous, dS where a query
// row sees a key and 0 elsewhere; needs attn_bias. It runs the dQ kernel (never atomic dQ).
// Inputs not in the kernel layout (last dim contiguous, 16-byte aligned, strides % 8) are
// copied, not rejected.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_with(
    at::Tensor* dbias, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, bool deterministic,
    const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left = -1, int64_t window_size_right = -1,
    double softcap = 0.0, const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
    const std::optional<at::Tensor>& attn_bias = std::nullopt, double dropout_p = 0.0,
    const std::optional<at::Tensor>& rng_state = std::nullopt);

// The same contract computed with ATen ops in float32 on the CPU.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_cpu_with(
    at::Tensor* dbias, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, bool deterministic,
    const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left = -1, int64_t window_size_right = -1,
    double softcap = 0.0, const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
    const std::optional<at::Tensor>& attn_bias = std::nullopt, double dropout_p = 0.0,
    const std::optional<at::Tensor>& rng_state = std::nullopt);

// mha_bwd_cpu_with whose dropout mask starts at slice dropout_bh0 (dropout_keep_mask_at): the
// CPU reference of one sequence of a packed call (mha_varlen_bwd_cpu).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_cpu_at(
    at::Tensor* dbias, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double softmax_scale, bool is_causal,
    bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& seqused_k, bool deterministic,
    const std::optional<at::Tensor>& grad_softmax_lse, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p,
    const std::optional<at::Tensor>& rng_state, int64_t dropout_bh0);

// Without a bias gradient (the op `bwd`): mha_bwd_with / mha_bwd_cpu_with(nullptr, ...).
template <typename... A>
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd(A&&... a) {
  return mha_bwd_with(nullptr, std::forward<A>(a)...);
}
template <typename... A>
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_cpu(A&&... a) {
  return mha_bwd_cpu_with(nullptr, std::forward<A>(a)...);
}

// Key splits (num_splits > 1, keys_per_split: the decode kernel's; the forward kernel divides
// each CTA's own key blocks): set into params with their workspace, the (split,
// b, h, seqlen_q) rows of each split's O (fp32, indexed with d) and of its m then l, which the
// merge kernel reads; the returned tensors stay alive until the launches are queued (params
// points into them). num_splits <= 1: no split, nothing allocated.
std::pair<at::Tensor, at::Tensor> set_split_workspace(Flash_fwd_params& params,
                                                      const at::Tensor& q, int num_splits,
                                                      int keys_per_split);

// Launches the forward for filled params on q's stream: the decode kernel when plan_decode takes
// the call (seqlen_q == 1, or seqlen_q * h / h_k <= max_multi_rows; decode_allowed;
// FLASH_SM75_DECODE not off), with its split workspace, else run_mha_fwd. Kernel errors raise
// ValueError / CUDA errors.
void run_fwd_planned(Flash_fwd_params& params, const at::Tensor& q, bool decode_allowed,
                     int max_multi_rows = 0);
// FLASH_SM75_DECODE is not 'never' (ValueError for an unknown value).
bool decode_enabled();
// FLASH_SM75_FWD_SPLITS is not 'never' (the KV-cache op's prefill-kernel key splits).
bool fwd_splits_enabled();

// A one-query call whose group of q-heads per kv head (GQA / MQA) can run as the query rows of
// a prefill tile (FLASH_SM75_DECODE_GQA=prefill, group_rows_views below): q (b, 1, h, d)
// read as (b, h / h_k, h_k, d), so that each CTA computes S = Q K^T and P V for the whole group
// on tensor cores, where the decode kernel spends h / h_k dot products per key on CUDA cores.
// The rows must then see the same keys and the same scores as the heads they stand for, so
// nothing may depend on the head or on the query's position: no window (either side), no ALiBi,
// no attention bias, no dropout; causal only bottom-right (one query row at the last position
// sees every key; top-left it sees key 0 only, which rows 1.. of a group would not).
inline bool group_rows_eligible(int64_t seqlen_q, int64_t h, int64_t h_k, bool is_causal,
                                bool causal_bottom_right, int64_t window_size_left,
                                int64_t window_size_right, bool has_alibi, bool has_bias,
                                bool has_dropout) {
  return seqlen_q == 1 && h_k > 0 && h > h_k && h % h_k == 0 &&
         (!is_causal || causal_bottom_right) && window_size_left < 0 && window_size_right < 0 &&
         !has_alibi && !has_bias && !has_dropout;
}

// FLASH_SM75_DECODE_GQA: how a one-query call of a GQA group (group_rows_eligible above) runs
// where the decode kernel would take it: 'decode' (or unset) on the
// split-KV decode kernel, 'prefill' as the group's query rows on the prefill kernels (with their
// key splits). ValueError for another value.
bool decode_gqa_on_prefill();
// Whether this call runs as group rows: FLASH_SM75_DECODE_GQA=prefill, FLASH_SM75_DECODE not
// 'never', the call eligible (no dropout: the caller checks), q and k non-empty.
bool group_rows_planned(const at::Tensor& q, const at::Tensor& k, bool is_causal,
                        bool causal_bottom_right, int64_t window_size_left,
                        int64_t window_size_right, bool has_alibi, bool has_bias);
// Views of the same memory for a group-rows call: q and out (b, 1, h, d; last dim contiguous)
// as (b, h / h_k, h_k, d), where row j of kv head hk is q-head hk * (h / h_k) + j (the GQA
// mapping h -> h / (h / h_k)), and lse (b, h, 1), contiguous, as (b, h_k, h / h_k). A kernel
// that runs q with h_k heads against k / v writes out and lse in place through them.
struct GroupRows {
  at::Tensor q, out, lse;
};
GroupRows group_rows_views(const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                           int64_t h_k);

// Runs a group-rows call (group_rows_planned) on the prefill kernels, out and lse written in
// place through group_rows_views: non-causal (its one query row sees every key of its range),
// key splits as plan_fwd_splits plans them for the group's grid; small_grid_tile as
// Flash_fwd_params has it (the dense op: FLASH_SM75_FWD_SMALL_GRID_TILE). `adjust` fills what
// set_params_fprop cannot see (the KV-cache op: the cache's rows, the page table).
void run_group_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, double scale,
                    const std::optional<at::Tensor>& leftpad_k,
                    const std::optional<at::Tensor>& seqused_k, double softcap,
                    int small_grid_tile,
                    const std::function<void(Flash_fwd_params&)>& adjust = {});

// The band's diagonals and ALiBi's offset relative to each batch entry's bottom-right corner
// (params.per_seq_offset: flash-attn's varlen and KV-cache semantics), for entries of at most
// max_seqlen_q queries and max_seqlen_k keys.
void set_per_seq_diagonals(Flash_fwd_params& params, int64_t max_seqlen_q, int64_t max_seqlen_k,
                           bool is_causal, int64_t window_size_left, int64_t window_size_right);

// ---- packed sequences (csrc/flash_varlen_api.cpp) ----------------------------------------------
// flash-attn's varlen attention. q: (total_q, num_heads, head_dim), k, v: (total_k, num_heads_k,
// head_dim), float16, last dim contiguous; sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b +
// 1] - 1 of q (cu_seqlens_k likewise for k, v), int32 (batch + 1,) on q's device; every length
// <= max_seqlen_q / max_seqlen_k (<= 2^30). The values are not checked on the GPU path (that
// would cost a host synchronisation): callers check them on the device (the Python door does);
// out-of-range values are clamped in the kernels, so they can never read or write outside the
// tensors. seqused_k: optional int32 (batch,): only the first seqused_k[b] keys of sequence b are
// attended. Causal, the window and ALiBi are per sequence, bottom-right aligned (query i of
// sequence b sees key j iff j <= i + len_k[b] - len_q[b]). Returns out (total_q, num_heads,
// head_dim) float16 and softmax_lse (num_heads, total_q) float32, flash-attn's packed layout;
// tokens of no sequence and rows that see no key get 0 and -inf. ValueError naming the argument
// for invalid metadata, before any launch.
std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes);
// The same contract on the CPU: mha_fwd_cpu per sequence (float64), offsets checked on the host.
std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes);
// mha_varlen_fwd with attention dropout (kernels/dropout.h) drawn from rng_state, int64 (2,)
// [seed, offset] on q's device or the CPU, read on the device by the kernels (the Python door
// draws it from torch's generator per call: torch.manual_seed reproduces a run, a CUDA graph's
// replay draws anew, a compiled graph sees the draw). Sequence b's mask is the kernels' slices b
// * num_heads + head with its own query / key positions. mha_varlen_bwd takes the same
// dropout_p and rng_state. Returns (out, softmax_lse); the LSE is that of the undropped scores.
std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_dropout(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes);
std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_dropout_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool is_causal,
    const std::optional<at::Tensor>& seqused_k, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes);
// Gradients of mha_varlen_fwd: dq (total_q, num_heads, head_dim), dk, dv (total_k, num_heads_k,
// head_dim) float16, 0 for tokens of no sequence. softmax_lse / grad_softmax_lse: (num_heads,
// total_q) float32. Other layouts of dout / out / q / k / v are copied, not rejected.
// dropout_p > 0: the forward's dropout_p and rng_state (mha_varlen_fwd_dropout).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    bool deterministic, const std::optional<at::Tensor>& grad_softmax_lse,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state);
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool is_causal, const std::optional<at::Tensor>& seqused_k,
    bool deterministic, const std::optional<at::Tensor>& grad_softmax_lse,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state);

// ---- KV cache (csrc/flash_kvcache_api.cpp) -----------------------------------------------------
// flash-attn's flash_attn_with_kvcache after its rotary embedding. q: (batch, seqlen_q, num_heads,
// head_dim) float16; k_cache, v_cache: (batch_cache >= batch, seqlen_cache, num_heads_k,
// head_dim) (entry b uses row b), or with block_table (batch, max_num_blocks_per_seq) int32
// pages (num_pages, page_block_size, num_heads_k, head_dim) with page_block_size a multiple of
// kPageBlockMultiple (kernels/flash.h), or any size when the table has one column (one page per
// sequence: cache_batch_idx). k, v: optional (batch, seqlen_new, num_heads_k, head_dim), written
// into the caches in place at rows cache_seqlens[b] + i. cache_seqlens: int32 (batch,);
// cache_leftpad: optional int32 (batch,), first attended row (not with a multi-column table).
// Entry b attends to rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), causal / window /
// ALiBi bottom-right aligned on that end (causal has no effect when seqlen_q == 1). Returns out
// (batch, seqlen_q, num_heads, head_dim) float16 and softmax_lse (batch, num_heads, seqlen_q)
// float32. The values of cache_seqlens / block_table are checked on the device, before any write
// (a device-side assertion: reading them would cost a host synchronisation per call and break
// CUDA-graph capture); the kernels also skip writes outside the cache and clamp table entries.
// ValueError naming the argument for invalid metadata, before any write or launch.
std::tuple<at::Tensor, at::Tensor> mha_kvcache_fwd(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    std::optional<double> softmax_scale, bool is_causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes);
// The same contract on the CPU (values checked on the host, ValueError naming the argument):
// the appends, then mha_fwd_cpu per sequence on its attended rows.
std::tuple<at::Tensor, at::Tensor> mha_kvcache_fwd_cpu(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    std::optional<double> softmax_scale, bool is_causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes);

// Output and workspace tensors of one backward call (they own the memory params points to).
struct BwdBuffers {
  at::Tensor dq, dk, dv;  // float16 BSHD outputs
  at::Tensor dsoftmax_sum;  // D, float32 (batch, h, seqlen_q)
  at::Tensor dq_accum;  // float32 (batch, h, seqlen_q, d), zeroed; atomic dQ mode only
  at::Tensor dlse;  // contiguous grad_softmax_lse, if given
  at::Tensor lse;   // contiguous softmax_lse
};

// Allocates the outputs and workspaces of mha_bwd and fills params from inputs that
// check_bwd_inputs accepted and that are already in the kernel layout (used by mha_bwd and by
// scripts/tune_bwd.py).
struct Flash_bwd_params;
BwdBuffers prepare_bwd(Flash_bwd_params& params, const at::Tensor& dout, const at::Tensor& q,
                       const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                       const at::Tensor& softmax_lse, double softmax_scale, bool is_causal,
                       bool causal_bottom_right, const std::optional<at::Tensor>& leftpad_k,
                       const std::optional<at::Tensor>& seqused_k, bool dq_atomic,
                       const std::optional<at::Tensor>& grad_softmax_lse,
                       int64_t window_size_left = -1, int64_t window_size_right = -1,
                       double softcap = 0.0,
                       const std::optional<at::Tensor>& alibi_slopes = std::nullopt);

// The dQ mode of a backward call: fp32 atomics (FLASH_SM75_BWD_DQ=atomic, not deterministic,
// a head dim that has them) or the separate dQ kernel.
bool bwd_uses_atomic_dq(bool deterministic, int64_t head_dim);

// Queues the backward kernels of filled params on the current stream of `device` (the
// deterministic mode's dQ kernel on a side stream, joined before returning).
void launch_bwd(Flash_bwd_params& params, bool dq_atomic, int device);

// Backward input validation (check_fwd_inputs plus dout/out/softmax_lse/grad_softmax_lse).
double check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out,
                        const at::Tensor& softmax_lse, double softmax_scale,
                        const std::optional<at::Tensor>& leftpad_k,
                        const std::optional<at::Tensor>& seqused_k,
                        const std::optional<at::Tensor>& grad_softmax_lse);

}  // namespace flash_sm75
