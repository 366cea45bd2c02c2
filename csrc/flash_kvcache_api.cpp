// Host side of the KV-cache op (flash-attn's flash_attn_with_kvcache core): append the new keys /
// values into the cache in place, then attend over each sequence's cache rows, bottom-right
// aligned per sequence, on the kernels directly (plain or paged cache, no gathered copy, no host
// read of the lengths; the index values are checked on the device before the writes). The rotary
// embedding is the Python door's (flash_attention_sm75/fa2.py). No op registration here (see torch_bindings.cpp).
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "flash_api.h"
#include "kernels/flash.h"
#include "kernels/head_dims.h"
#include "kernels/kvcache_append.h"
#include "kernels/launch_plan.h"

namespace flash_sm75 {
namespace {

constexpr int64_t kMaxCacheRows = int64_t{1} << 30;  // keeps every diagonal inside int

struct KvcacheShape {
  double scale;
  int64_t batch, seqlen_q, seqlen_new, seqlen_cache;
  bool paged;
};

void check_int_vector(const std::optional<at::Tensor>& t, const char* name, int64_t batch,
                      const at::Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt, "flash_attention_sm75: ", name,
                    " must be int32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == batch, "flash_attention_sm75: ", name,
                    " must have shape (batch,) = (", batch, ",), got ", t->sizes());
  TORCH_CHECK_VALUE(t->device() == q.device(), "flash_attention_sm75: ", name,
                    " must be on the same device as q (", q.device(), "), got ", t->device());
  TORCH_CHECK_VALUE(t->is_contiguous(), "flash_attention_sm75: ", name, " must be contiguous");
}

// Everything that can be checked without reading device values, before any write or launch.
KvcacheShape check_kvcache(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                           const std::optional<at::Tensor>& v, const at::Tensor& cache_seqlens,
                           const std::optional<at::Tensor>& cache_leftpad,
                           const std::optional<at::Tensor>& block_table,
                           std::optional<double> softmax_scale, int64_t window_size_left,
                           int64_t window_size_right, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes) {
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{q, "q"},
                                {k_cache, "k_cache"}, {v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t.dim() == 4, "flash_attention_sm75: ", name, " must be 4-D, got ",
                      t.dim(), "-D of shape ", t.sizes());
  }
  const int64_t batch = q.size(0);
  TORCH_CHECK_VALUE(batch >= 1 && k_cache.size(0) >= 1, "flash_attention_sm75: q and k_cache "
                    "must have a batch size >= 1, got ", batch, " and ", k_cache.size(0));
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "flash_attention_sm75: v_cache must have "
                    "k_cache's shape ", k_cache.sizes(), ", got ", v_cache.sizes());
  // The caches' own names in their errors (the dense rules below see one-entry views as k, v).
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"},
                                {v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type() && t.device() == q.device(),
                      "flash_attention_sm75: ", name, " must have q's dtype and device (",
                      q.scalar_type(), ", ", q.device(), "), got ", t.scalar_type(), " on ",
                      t.device());
    TORCH_CHECK_VALUE(t.stride(3) == 1 || t.size(3) <= 1, "flash_attention_sm75: ", name,
                      " must be contiguous in its last dimension (head_dim), got strides ",
                      t.strides());
  }
  // dtype, head dims, GQA ratio, device, scale: the dense op's rules on one-entry views (the
  // cache's first dimension is pages or a larger batch).
  const double scale = check_fwd_inputs(q.narrow(0, 0, 1), k_cache.narrow(0, 0, 1),
                                        v_cache.narrow(0, 0, 1), softmax_scale, std::nullopt,
                                        std::nullopt);
  TORCH_CHECK_VALUE(k.has_value() == v.has_value(), "flash_attention_sm75: k and v must be given "
                    "together (new keys and values)");
  int64_t seqlen_new = 0;
  if (k.has_value()) {
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{*k, "k"}, {*v, "v"}}) {
      TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == batch && t.size(2) == k_cache.size(2) &&
                            t.size(3) == k_cache.size(3),
                        "flash_attention_sm75: ", name, " must be (batch, seqlen_new, "
                        "num_heads_k, head_dim) = (", batch, ", *, ", k_cache.size(2), ", ",
                        k_cache.size(3), "), got ", t.sizes());
      TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type() && t.device() == q.device(),
                        "flash_attention_sm75: ", name, " must have q's dtype and device (",
                        q.scalar_type(), ", ", q.device(), "), got ", t.scalar_type(), " on ",
                        t.device());
    }
    TORCH_CHECK_VALUE(k->sizes() == v->sizes(), "flash_attention_sm75: k and v must have the "
                      "same shape, got ", k->sizes(), " and ", v->sizes());
    seqlen_new = k->size(1);
    // Appends into an expanded (self-overlapping) cache would land in rows other entries share.
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"},
                                  {v_cache, "v_cache"}}) {
      TORCH_CHECK_VALUE(seqlen_new == 0 || at::has_internal_overlap(t) != at::MemOverlap::Yes,
                        "flash_attention_sm75: ", name, " must not overlap itself (an expanded "
                        "tensor) when new keys are appended, got strides ", t.strides());
    }
  }
  check_int_vector(cache_seqlens, "cache_seqlens", batch, q);
  check_int_vector(cache_leftpad, "cache_leftpad", batch, q);
  const bool paged = block_table.has_value();
  int64_t seqlen_cache = k_cache.size(1);
  if (paged) {
    const at::Tensor& bt = *block_table;
    TORCH_CHECK_VALUE(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == batch &&
                          bt.size(1) >= 1,
                      "flash_attention_sm75: block_table must be int32 of shape (batch, "
                      "max_num_blocks_per_seq) = (", batch, ", >= 1), got ", bt.scalar_type(),
                      " ", bt.sizes());
    TORCH_CHECK_VALUE(bt.device() == q.device() && (bt.stride(1) == 1 || bt.size(1) == 1),
                      "flash_attention_sm75: block_table must be on q's device (", q.device(),
                      ") with a contiguous last dimension, got ", bt.device(), " strides ",
                      bt.strides());
    const int64_t page = k_cache.size(1);
    TORCH_CHECK_VALUE(page % kPageBlockMultiple == 0 || bt.size(1) == 1,
                      "flash_attention_sm75: page_block_size (k_cache.shape[1]) must be a "
                      "multiple of ", kPageBlockMultiple, " for the paged kernels (or "
                      "block_table a single column), got ", page);
    TORCH_CHECK_VALUE(!cache_leftpad.has_value() || bt.size(1) == 1,
                      "flash_attention_sm75: cache_leftpad cannot be combined with a paged "
                      "block_table (as in flash-attn)");
    seqlen_cache = bt.size(1) * page;
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) >= batch, "flash_attention_sm75: k_cache must have at "
                      "least batch = ", batch, " rows (q's) unless block_table selects them, got ",
                      k_cache.size(0));
  }
  TORCH_CHECK_VALUE(seqlen_cache <= kMaxCacheRows, "flash_attention_sm75: the cache must hold at "
                    "most 2^30 rows per sequence, got ", seqlen_cache);
  TORCH_CHECK_VALUE(seqlen_new <= seqlen_cache, "flash_attention_sm75: k has ", seqlen_new,
                    " new keys, more than the cache holds (seqlen_cache = ", seqlen_cache, ")");
  TORCH_CHECK_VALUE(q.size(1) <= kMaxCacheRows, "flash_attention_sm75: seqlen_q must be at most "
                    "2^30, got ", q.size(1));
  check_window_size(window_size_left, window_size_right);
  check_score_mod(softcap, scale, alibi_slopes, q.device(), batch, q.size(2));
  return {scale, batch, q.size(1), seqlen_new, seqlen_cache, paged};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mha_kvcache_fwd(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k_, const std::optional<at::Tensor>& v_,
    const std::optional<at::Tensor>& cache_leftpad,
    const std::optional<at::Tensor>& block_table, std::optional<double> softmax_scale,
    bool is_causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  const KvcacheShape ks = check_kvcache(q, k_cache, v_cache, k_, v_, cache_seqlens, cache_leftpad,
                                        block_table, softmax_scale, window_size_left,
                                        window_size_right, softcap, alibi_slopes);
  TORCH_CHECK_VALUE(q.is_cuda(), "flash_attention_sm75: q must be a CUDA tensor, got ", q.device());
  check_alignment(q, "q");
  check_alignment(k_cache, "k_cache");
  check_alignment(v_cache, "v_cache");
  c10::cuda::CUDAGuard device_guard{q.device()};
  const auto* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK_VALUE(props->major * 10 + props->minor >= 75,
                    "flash_attention_sm75: needs a GPU of compute capability >= 7.5 (Turing or "
                    "newer), got ", props->major, ".", props->minor);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const int64_t b = ks.batch, sq = ks.seqlen_q, h = q.size(2), h_k = k_cache.size(2),
                d = q.size(3);
  // flash-attn: causal has no effect on a single query row.
  const bool causal = is_causal && sq > 1;
  // Every environment setting the call reads, before anything is launched or written (an
  // unknown value raises ValueError here, not after the append). A one-query GQA call as the
  // group's query rows (FLASH_SM75_DECODE_GQA=prefill): a right window side hides nothing from
  // the one query row, which sits at its sequence's last key, so only a left side makes a
  // window here.
  const bool group_rows = group_rows_planned(q, k_cache, causal, /*causal_bottom_right=*/true,
                                             window_size_left, /*window_size_right=*/-1,
                                             alibi_slopes.has_value(), /*has_bias=*/false);
  (void)decode_enabled();
  (void)fwd_splits_enabled();
  (void)planning_profile();
  (void)env_l2_prefetch();

  // ---- the index values, on the device, before anything is written
  KvCheckParams cp{};
  cp.cache_seqlens = cache_seqlens.data_ptr<int>();
  cp.block_table = ks.paged ? block_table->data_ptr<int>() : nullptr;
  cp.block_table_batch_stride = ks.paged ? block_table->stride(0) : 0;
  cp.blocks = ks.paged ? static_cast<int>(block_table->size(1)) : 1;
  cp.page_block_size = static_cast<int>(k_cache.size(1));
  cp.num_pages = static_cast<int>(k_cache.size(0));
  cp.b = static_cast<int>(b);
  cp.seqlen_new = static_cast<int>(ks.seqlen_new);
  cp.seqlen_cache = static_cast<int>(ks.seqlen_cache);
  run_kvcache_check(cp, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // ---- append (the new rows' copies are the only layout change: they are small)
  at::Tensor seqused = cache_seqlens;
  if (ks.seqlen_new > 0 && h_k > 0) {
    at::Tensor kn = *k_, vn = *v_;
    auto aligned = [](const at::Tensor& t) {
      bool ok = t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
      for (int i = 0; i < 3; ++i) ok = ok && (t.size(i) == 1 || t.stride(i) % 8 == 0);
      return ok;
    };
    if (!aligned(kn)) kn = kn.contiguous();
    if (!aligned(vn)) vn = vn.contiguous();
    seqused = at::empty_like(cache_seqlens);
    KvAppendParams ap{};
    ap.k_new = static_cast<const __half*>(kn.data_ptr());
    ap.v_new = static_cast<const __half*>(vn.data_ptr());
    ap.kn_batch_stride = kn.stride(0);
    ap.kn_row_stride = kn.stride(1);
    ap.kn_head_stride = kn.stride(2);
    ap.vn_batch_stride = vn.stride(0);
    ap.vn_row_stride = vn.stride(1);
    ap.vn_head_stride = vn.stride(2);
    ap.k_cache = static_cast<__half*>(k_cache.data_ptr());
    ap.v_cache = static_cast<__half*>(v_cache.data_ptr());
    ap.kc_batch_stride = k_cache.stride(0);
    ap.kc_row_stride = k_cache.stride(1);
    ap.kc_head_stride = k_cache.stride(2);
    ap.vc_batch_stride = v_cache.stride(0);
    ap.vc_row_stride = v_cache.stride(1);
    ap.vc_head_stride = v_cache.stride(2);
    ap.cache_seqlens = cache_seqlens.data_ptr<int>();
    ap.block_table = ks.paged ? block_table->data_ptr<int>() : nullptr;
    ap.block_table_batch_stride = ks.paged ? block_table->stride(0) : 0;
    ap.page_block_size = static_cast<int>(k_cache.size(1));
    ap.num_pages = static_cast<int>(k_cache.size(0));
    ap.b = static_cast<int>(b);
    ap.seqlen_new = static_cast<int>(ks.seqlen_new);
    ap.h_k = static_cast<int>(h_k);
    ap.d = static_cast<int>(d);
    ap.seqlen_cache = static_cast<int>(ks.seqlen_cache);
    ap.seqused_k = seqused.data_ptr<int>();
    run_kvcache_append(ap, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  at::Tensor out = at::empty({b, sq, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  if (h_k == 0 || ks.seqlen_cache == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }

  // ---- attention: the cache as (b, seqlen_cache) keys; paged through the block table
  const at::Tensor kview = ks.paged ? k_cache : k_cache.narrow(0, 0, b);
  const at::Tensor vview = ks.paged ? v_cache : v_cache.narrow(0, 0, b);
  auto cache_params = [&](Flash_fwd_params& params) {
    params.seqlen_k = static_cast<int>(ks.seqlen_cache);  // paged: the table's rows
    if (ks.paged) {
      params.block_table = block_table->data_ptr<int>();
      params.block_table_batch_stride = block_table->stride(0);
      params.page_block_size = static_cast<int>(k_cache.size(1));
      params.num_pages = static_cast<int>(k_cache.size(0));
    }
  };
  if (group_rows) {
    run_group_rows(q, kview, vview, out, lse, ks.scale, cache_leftpad, seqused, softcap,
                   /*small_grid_tile=*/0, cache_params);
    return {out, lse};
  }
  Flash_fwd_params params;
  set_params_fprop(params, q, kview, vview, out, lse, ks.scale, causal,
                   /*causal_bottom_right=*/true, cache_leftpad, seqused, window_size_left,
                   window_size_right, softcap, alibi_slopes);
  cache_params(params);
  set_plan_device(params, q.get_device());
  params.small_grid_tile = 0;
  // Without a window the split-KV decode kernel runs one query row and short queries against
  // the cache (its rows are (query, q-head) pairs, each with its own bottom-right causal limit
  // and ALiBi diagonal): long caches get key splits. The rest runs the prefill kernels with
  // per-sequence diagonals.
  const int kd = decode_head_dim(head_dim_bucket(static_cast<int>(d)));
  // A window's right side means nothing under causal (flash-attn sets it to 0 then, and the
  // door passes that 0): only a left side, or a right side without causal, is a window.
  const bool windowed = window_size_left >= 0 || (!causal && window_size_right >= 0);
  const bool decode =
      !windowed &&
      plan_decode(params.b, params.h, params.h_k, params.seqlen_q, params.seqlen_k, kd,
                  params.num_sms, decode_enabled(), 8, decode_max_multi_rows(kd)).use;
  if (decode) {
    params.is_causal = false;  // the rows' own limits, not the dense band
    params.decode_causal_rows = causal ? 1 : 0;
    params.decode_rows_from_end = 1;
  } else {
    set_per_seq_diagonals(params, sq, ks.seqlen_cache, causal, window_size_left,
                          window_size_right);
  }
  // The prefill kernels' key splits (plan_fwd_splits): a grid short of one wave over a long
  // cache. Each CTA splits the key blocks its rows see, so a window's keys split as well; the
  // count is planned for the keys a row may see (a window's left side bounds them). Workspace
  // alive until the launches are queued.
  std::pair<at::Tensor, at::Tensor> ws;
  if (!decode && fwd_splits_enabled()) {
    int64_t keys = params.seqlen_k;
    if (window_size_left >= 0) keys = std::min<int64_t>(keys, window_size_left + sq + 1);
    const auto [ctas, slots] = fwd_split_grid(static_cast<int>(d), params.b, params.h,
                                              params.seqlen_q, params.num_sms);
    ws = set_split_workspace(params, q, plan_fwd_splits(ctas, slots, keys), 0);
  }
  run_fwd_planned(params, q, decode, decode_max_multi_rows(kd));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> mha_kvcache_fwd_cpu(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_leftpad,
    const std::optional<at::Tensor>& block_table, std::optional<double> softmax_scale,
    bool is_causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  const KvcacheShape ks = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad,
                                        block_table, softmax_scale, window_size_left,
                                        window_size_right, softcap, alibi_slopes);
  const int64_t b = ks.batch, sq = ks.seqlen_q, h = q.size(2), d = q.size(3);
  const int64_t page = k_cache.size(1);
  // The settings the reference follows (mha_fwd_cpu: a one-query GQA call as the group's query
  // rows), read before anything is written, as the CUDA op reads them.
  (void)group_rows_planned(q, k_cache, is_causal && sq > 1, /*causal_bottom_right=*/true,
                           window_size_left, /*window_size_right=*/-1,
                           alibi_slopes.has_value(), /*has_bias=*/false);
  const at::Tensor lens = cache_seqlens.to(at::kLong).contiguous();
  at::Tensor table = ks.paged ? block_table->to(at::kLong) : at::Tensor();
  // (slot, row) of position `pos` of entry `bi`; slot -1 when it lies outside the cache.
  auto locate = [&](int64_t bi, int64_t pos) -> std::pair<int64_t, int64_t> {
    if (pos < 0 || pos >= ks.seqlen_cache) return {-1, 0};
    if (!ks.paged) return {bi, pos};
    const int64_t slot = table[bi][pos / page].item<int64_t>();
    if (slot < 0 || slot >= k_cache.size(0)) return {-1, 0};
    return {slot, pos % page};
  };
  // Every value first (as the device check kernel does), so that an error writes nothing.
  for (int64_t bi = 0; bi < b; ++bi) {
    const int64_t base = lens.data_ptr<int64_t>()[bi];
    TORCH_CHECK_VALUE(base >= 0 && base + ks.seqlen_new <= ks.seqlen_cache,
                      "flash_attention_sm75: cache_seqlens must be in [0, seqlen_cache - "
                      "seqlen_new] = [0, ", ks.seqlen_cache - ks.seqlen_new, "], got ", base);
    for (int64_t pos = 0; ks.paged && pos < base + ks.seqlen_new; pos += page) {
      TORCH_CHECK_VALUE(locate(bi, pos).first >= 0, "flash_attention_sm75: block_table (or "
                        "cache_batch_idx) entries of pages that hold keys must be in [0, "
                        "k_cache.shape[0] = ", k_cache.size(0), "), got a value outside");
    }
  }
  for (int64_t bi = 0; bi < b; ++bi) {
    const int64_t base = lens.data_ptr<int64_t>()[bi];
    for (int64_t i = 0; i < ks.seqlen_new; ++i) {
      const auto [slot, row] = locate(bi, base + i);
      k_cache[slot][row].copy_((*k)[bi][i]);
      v_cache[slot][row].copy_((*v)[bi][i]);
    }
  }
  at::Tensor out = at::zeros({b, sq, h, d}, q.options());
  at::Tensor lse = at::full({b, h, sq}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(at::kFloat));
  const at::Tensor pads =
      cache_leftpad.has_value() ? cache_leftpad->to(at::kLong).contiguous() : at::Tensor();
  for (int64_t bi = 0; bi < b; ++bi) {
    const int64_t end = std::clamp<int64_t>(lens.data_ptr<int64_t>()[bi] + ks.seqlen_new, 0,
                                            ks.seqlen_cache);
    const int64_t start =
        pads.defined() ? std::clamp<int64_t>(pads.data_ptr<int64_t>()[bi], 0, end) : 0;
    if (end == start || sq == 0) continue;
    std::vector<at::Tensor> krows, vrows;
    for (int64_t pos = start; pos < end; ++pos) {
      const auto [slot, row] = locate(bi, pos);  // checked above
      krows.push_back(k_cache[slot][row]);
      vrows.push_back(v_cache[slot][row]);
    }
    // The attended keys [start, end) as one sequence: bottom-right on them is bottom-right on
    // the entry's end, and ALiBi's distance counts from the same corner.
    // One query row sits at the entry's last key: a right window side hides nothing from it
    // (as the CUDA op plans it).
    auto [o, l] = mha_fwd_cpu(q.narrow(0, bi, 1), at::stack(krows).unsqueeze(0),
                              at::stack(vrows).unsqueeze(0), ks.scale, is_causal && sq > 1,
                              /*causal_bottom_right=*/true, std::nullopt, std::nullopt,
                              window_size_left, sq == 1 ? -1 : window_size_right, softcap,
                              !alibi_slopes.has_value() ? std::nullopt
                              : alibi_slopes->dim() == 2
                                  ? std::optional<at::Tensor>((*alibi_slopes)[bi])
                                  : alibi_slopes);
    out[bi].copy_(o[0]);
    lse[bi].copy_(l[0]);
  }
  return {out, lse};
}

}  // namespace flash_sm75
