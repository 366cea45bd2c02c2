// One batch entry's geometry: its lengths, where its rows start, its key range, its diagonals
// and where its LSE rows are. Every kernel asks this struct instead of reading params directly,
// so that packed (varlen) sequences and per-sequence diagonals are one place.
//
// Plain instantiations (Is_ext = false) take every value from params exactly as before (the
// expressions fold to the same code: their SASS is unchanged). Extended ones (Is_ext) read
// cu_seqlens_q / cu_seqlens_k and per_seq_offset (flash.h):
//   * packed q: row 0 of entry b is row cu_seqlens_q[b] of the tensor, its length the difference
//     of consecutive offsets; the LSE is (h, total_q): entry b's rows at cu_seqlens_q[b] of each
//     head's total_q. Packed k likewise with cu_seqlens_k (the key range then clamps into it).
//   * per-sequence diagonals: the offsets are relative to the entry's bottom-right corner,
//     key_end - seqlen_q (flash-attn's varlen / KV-cache causal, window and ALiBi).
// Offsets are clamped into the packed tensors so that bad values can never make a kernel read
// or write out of bounds (at worst an entry is empty); callers check the values (on the device)
// before the launch.
#pragma once

#include <cuda_fp16.h>

#include "block_info.h"
#include "flash.h"

namespace flash_sm75 {

// A load of an int the compiler cannot merge with an earlier load of it, so that a value needed
// only at a kernel's start and end does not stay live (in a register) through its loops.
__device__ __forceinline__ int reload_int(const int* ptr) {
#ifdef __CUDA_ARCH__
  int v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
#else
  return *reinterpret_cast<const volatile int*>(ptr);
#endif
}

template <bool Is_ext>
struct SeqInfo {
  // Plain instantiations read params at each use, exactly the expressions the kernels had
  // before this struct existed (a copy in a register measurably changed ptxas's schedule of the
  // backward kernels). Extended ones keep four values of the entry; the diagonals are derived
  // where used and the key side (length, first row) is re-read where needed, because the
  // backward's dK/dV kernels run at the 255-register cap. The d = 256 backward has no register
  // to spare at all (its extended dK/dV kernel uses exactly 255): every form of these values
  // tried there spilled 16-48 bytes (kept in registers, re-read, or parked in shared memory),
  // so that tile takes SeqInfo<false> (score modifiers only) and packed calls at d = 256 run
  // the backward on a padded copy (flash_varlen_api.cpp), except a dropout's, whose dK/dV tile
  // and the dQ kernel have the registers (Flash_bwd_kernel_traits::kPackedSeq).
  const Flash_fwd_params& p;
  int key_start_, key_end_, sq_, q_row0_;  // Is_ext only
  int bidb_;

  __device__ __forceinline__ SeqInfo(const Flash_fwd_params& params, int bidb)
      : p(params), bidb_(bidb) {
    if constexpr (Is_ext) {
      // Packed rows are < 2^31 (the op checks the sizes).
      if (p.cu_seqlens_q != nullptr) {
        const int start = imin(imax(p.cu_seqlens_q[bidb], 0), p.total_q);
        const int end = imin(imax(p.cu_seqlens_q[bidb + 1], start), p.total_q);
        q_row0_ = start;
        sq_ = imin(end - start, p.seqlen_q);
      } else {
        q_row0_ = 0;
        sq_ = p.seqlen_q;
      }
      const KeyRange kr = key_range(seqlen_k(), p.leftpad_k, p.seqused_k, bidb);
      key_start_ = kr.key_start;
      key_end_ = kr.key_end;
    }
  }

  // The key side of a packed entry, from cu_seqlens_k (clamped into the packed rows).
  __device__ __forceinline__ int k_row0() const {
    if (p.cu_seqlens_k == nullptr) return 0;
    return imin(imax(reload_int(p.cu_seqlens_k + bidb_), 0), p.total_k);
  }
  __device__ __forceinline__ int seqlen_k() const {
    if constexpr (!Is_ext) {
      return p.seqlen_k;
    } else {
      if (p.cu_seqlens_k == nullptr) return p.seqlen_k;
      const int start = k_row0();
      return imin(imax(reload_int(p.cu_seqlens_k + bidb_ + 1), start), p.total_k) - start;
    }
  }

  // per_seq_offset: the entry's bottom-right corner, added to the diagonals (0 otherwise).
  __device__ __forceinline__ int corner() const {
    return p.per_seq_offset ? key_end_ - sq_ : 0;
  }

  // The entry's visible keys, entry-relative (plain: computed where asked, as before).
  __device__ __forceinline__ KeyRange keys(int bidb) const {
    if constexpr (Is_ext) return {key_start_, key_end_};
    else return key_range(p.seqlen_k, p.leftpad_k, p.seqused_k, bidb);
  }
  __device__ __forceinline__ int seqlen_q() const {
    if constexpr (Is_ext) return sq_; else return p.seqlen_q;
  }
  // The band's diagonals (block_info.h) and ALiBi's offset, entry-relative.
  __device__ __forceinline__ int causal_off() const {
    if constexpr (Is_ext) return p.causal_offset + corner();
    else return p.causal_offset;
  }
  __device__ __forceinline__ int window_lower() const {
    if constexpr (Is_ext) {
      return p.window_lower == kNoWindowLower ? kNoWindowLower : p.window_lower + corner();
    } else {
      return p.window_lower;
    }
  }
  __device__ __forceinline__ int alibi_off() const {
    if constexpr (Is_ext) return p.alibi_offset + corner();
    else return p.alibi_offset;
  }

  // Element offset of the entry's row 0 in a tensor with these strides (the batch stride is 0
  // for packed tensors).
  __device__ __forceinline__ int64_t q_offset(int bidb, int64_t batch_stride,
                                              int64_t row_stride) const {
    if constexpr (!Is_ext) return bidb * batch_stride;
    else return bidb * batch_stride + static_cast<int64_t>(q_row0_) * row_stride;
  }
  __device__ __forceinline__ int64_t k_offset(int bidb, int64_t batch_stride,
                                              int64_t row_stride) const {
    if constexpr (!Is_ext) {
      return bidb * batch_stride;
    } else {
      if (p.block_table != nullptr) return 0;  // paged: per tile, paged_base()
      return bidb * batch_stride + static_cast<int64_t>(k_row0()) * row_stride;
    }
  }

  // Paged K/V (flash.h, block_table): the base from which row j of a tile that starts at key
  // `row` is base + j * row_stride, i.e. `base` (the head's offset only) moved to the tile's
  // page and back by the page's first row. Tiles never straddle a page (kPageBlockMultiple).
  // Unpaged: `base` itself.
  __device__ __forceinline__ const __half* paged_base(const __half* base, int row,
                                                      int64_t page_stride,
                                                      int64_t row_stride) const {
    if constexpr (Is_ext) {
      if (p.block_table != nullptr) {
        const int page = row / p.page_block_size;
        const int blk = imin(imax(p.block_table[bidb_ * p.block_table_batch_stride + page], 0),
                             p.num_pages - 1);
        return base + blk * page_stride -
               static_cast<int64_t>(page) * p.page_block_size * row_stride;
      }
    }
    return base;
  }

  // Index of (head, row) of this entry in softmax_lse and the backward's row-indexed workspaces
  // (D, dlse; times the bucket's head dim in dq_accum): (b, h, seqlen_q), or (h, total_q) when
  // q is packed.
  __device__ __forceinline__ int64_t lse_index(int bidb, int head, int row) const {
    if constexpr (Is_ext) {
      if (p.cu_seqlens_q != nullptr) {
        return static_cast<int64_t>(head) * p.total_q + q_row0_ + row;
      }
    }
    return (static_cast<int64_t>(bidb) * p.h + head) * p.seqlen_q + row;
  }
};

}  // namespace flash_sm75
