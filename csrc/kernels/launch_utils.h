// Host helpers shared by the launch templates (forward, decode, backward).
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "kernel_traits.h"

namespace flash_sm75 {

// Dynamic shared memory above the 48 KiB default needs a per-kernel opt-in (up to 64 KiB on
// SM75). Throws std::runtime_error if the runtime refuses it.
template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, int bytes) {
  if (bytes > kSm75DefaultSmemPerBlock) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("flash_attention_sm75: cudaFuncSetAttribute failed: ") +
                               cudaGetErrorString(err));
    }
  }
}

// Throws std::runtime_error naming the call if a CUDA runtime call failed.
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attention_sm75: ") + what + " failed: " +
                             cudaGetErrorString(err));
  }
}

}  // namespace flash_sm75
