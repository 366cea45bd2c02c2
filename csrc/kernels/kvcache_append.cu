// See kvcache_append.h. One thread per 16-byte chunk of a new (batch, row, kv head) row of K
// and the same chunk of V: loads and stores are 16-byte vectors, coalesced along the head dim.
#include "kvcache_append.h"

#include <c10/macros/Macros.h>

#include <algorithm>

namespace flash_sm75 {

namespace {

__global__ void kvcache_append_kernel(const KvAppendParams p) {
  const int chunks = p.d / 8;
  const int64_t total = static_cast<int64_t>(p.b) * p.seqlen_new * p.h_k * chunks;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first < p.b) p.seqused_k[first] = p.cache_seqlens[first] + p.seqlen_new;
  for (int64_t idx = first; idx < total; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(idx % chunks);
    int64_t rest = idx / chunks;
    const int hk = static_cast<int>(rest % p.h_k);
    rest /= p.h_k;
    const int i = static_cast<int>(rest % p.seqlen_new);
    const int bidb = static_cast<int>(rest / p.seqlen_new);
    const int64_t pos = static_cast<int64_t>(p.cache_seqlens[bidb]) + i;
    if (pos < 0 || pos >= p.seqlen_cache) continue;
    int64_t slot, row;  // the cache's batch (or page) index and row within it
    if (p.block_table != nullptr) {
      slot = p.block_table[bidb * p.block_table_batch_stride + pos / p.page_block_size];
      row = pos % p.page_block_size;
      if (slot < 0 || slot >= p.num_pages) continue;
    } else {
      slot = bidb;
      row = pos;
    }
    const uint4 kval = *reinterpret_cast<const uint4*>(
        p.k_new + bidb * p.kn_batch_stride + i * p.kn_row_stride + hk * p.kn_head_stride + c * 8);
    const uint4 vval = *reinterpret_cast<const uint4*>(
        p.v_new + bidb * p.vn_batch_stride + i * p.vn_row_stride + hk * p.vn_head_stride + c * 8);
    *reinterpret_cast<uint4*>(p.k_cache + slot * p.kc_batch_stride + row * p.kc_row_stride +
                              hk * p.kc_head_stride + c * 8) = kval;
    *reinterpret_cast<uint4*>(p.v_cache + slot * p.vc_batch_stride + row * p.vc_row_stride +
                              hk * p.vc_head_stride + c * 8) = vval;
  }
}

__global__ void kvcache_check_kernel(const KvCheckParams p) {
  const int64_t total = static_cast<int64_t>(p.b) * p.blocks;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int bidb = static_cast<int>(i / p.blocks), col = static_cast<int>(i % p.blocks);
    const int64_t end = static_cast<int64_t>(p.cache_seqlens[bidb]) + p.seqlen_new;
    if (col == 0) {
      CUDA_KERNEL_ASSERT_MSG(end >= p.seqlen_new && end <= p.seqlen_cache,
                             "flash_attention_sm75: cache_seqlens must be in [0, seqlen_cache - "
                             "seqlen_new]");
    }
    if (p.block_table != nullptr && static_cast<int64_t>(col) * p.page_block_size < end) {
      const int e = p.block_table[bidb * p.block_table_batch_stride + col];
      CUDA_KERNEL_ASSERT_MSG(e >= 0 && e < p.num_pages,
                             "flash_attention_sm75: block_table (or cache_batch_idx) entries of "
                             "pages that hold keys must be in [0, k_cache.shape[0])");
    }
  }
}

}  // namespace

void run_kvcache_check(const KvCheckParams& params, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = static_cast<int64_t>(params.b) * params.blocks;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 1024);
  if (blocks > 0) {
    kvcache_check_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  }
}

void run_kvcache_append(const KvAppendParams& params, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = static_cast<int64_t>(params.b) * params.seqlen_new * params.h_k *
                        (params.d / 8);
  int64_t blocks = (std::max<int64_t>(total, params.b) + kThreads - 1) / kThreads;
  if (blocks > 65535) blocks = 65535;  // grid-stride beyond
  kvcache_append_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
}

}  // namespace flash_sm75
