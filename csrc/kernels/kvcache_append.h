// Appending new keys / values to a KV cache in place (flash_attn_with_kvcache's k / v), one
// launch for both, plain or paged. Host API: csrc/flash_kvcache_api.cpp.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace flash_sm75 {

struct KvAppendParams {
  // New rows (b, seqlen_new, h_k, d), fp16, 16-byte aligned rows (strides in elements).
  const __half* k_new;
  const __half* v_new;
  int64_t kn_batch_stride, kn_row_stride, kn_head_stride;
  int64_t vn_batch_stride, vn_row_stride, vn_head_stride;
  // The cache: (b_cache, seqlen_cache, h_k, d), or pages (num_pages, page_block_size, h_k, d)
  // with block_table; the batch strides are then the page strides.
  __half* k_cache;
  __half* v_cache;
  int64_t kc_batch_stride, kc_row_stride, kc_head_stride;
  int64_t vc_batch_stride, vc_row_stride, vc_head_stride;
  const int* cache_seqlens;  // (b,): batch entry b's new row i goes to row cache_seqlens[b] + i
  const int* block_table;    // (b, blocks) int32 or nullptr
  int64_t block_table_batch_stride;
  int page_block_size;       // rows per page (paged), unused otherwise
  int num_pages;
  int b, seqlen_new, h_k, d, seqlen_cache;
  int* seqused_k;            // out, (b,): cache_seqlens[b] + seqlen_new, the attended key count
};

struct KvCheckParams {
  const int* cache_seqlens;  // (b,)
  const int* block_table;    // (b, blocks) int32 or nullptr
  int64_t block_table_batch_stride;
  int blocks;                // the table's columns (1 without a table)
  int page_block_size;
  int num_pages;
  int b, seqlen_new, seqlen_cache;
};

// The values the KV-cache op relies on, checked on the device before anything is written (a
// host read would cost a synchronisation per call and break CUDA-graph capture): cache_seqlens[b]
// in [0, seqlen_cache - seqlen_new] and the table entries of the pages that hold keys in
// [0, num_pages). A bad value is a device-side assertion (the CUDA error surfaces at the next
// synchronisation and leaves the context unusable, as torch's device asserts do); the kernels
// queued after it on the stream do not run.
void run_kvcache_check(const KvCheckParams& params, cudaStream_t stream);

// Rows whose target lies outside the cache (or in a page outside [0, num_pages)) are not
// written: the callers check the values on the device first; this keeps every write in bounds
// even without that check.
void run_kvcache_append(const KvAppendParams& params, cudaStream_t stream);

}  // namespace flash_sm75
