// Compile-time dispatch of runtime flags (shape of FlashAttention's static_switch.h).
// Each switch ends in an error for values it does not know, so an unsupported head dim can never
// silently launch nothing.
#pragma once

#include <stdexcept>
#include <string>

#include "head_dims.h"

#define BOOL_SWITCH(COND, CONST_NAME, ...)      \
  [&] {                                         \
    if (COND) {                                 \
      constexpr static bool CONST_NAME = true;  \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                     \
    }                                           \
  }()

// HEADDIM is the runtime head dim; kHeadDim is its bucket (head_dims.h), the instantiation that
// runs it with the tail handled inside the kernel.
#define HEADDIM_SWITCH(HEADDIM, ...)                                  \
  [&] {                                                               \
    const int headdim_bucket_ = ::flash_sm75::head_dim_bucket(HEADDIM); \
    if (headdim_bucket_ == 64) {                                      \
      constexpr static int kHeadDim = 64;                             \
      return __VA_ARGS__();                                           \
    } else if (headdim_bucket_ == 96) {                               \
      constexpr static int kHeadDim = 96;                             \
      return __VA_ARGS__();                                           \
    } else if (headdim_bucket_ == 128) {                              \
      constexpr static int kHeadDim = 128;                            \
      return __VA_ARGS__();                                           \
    } else if (headdim_bucket_ == 256) {                              \
      constexpr static int kHeadDim = 256;                            \
      return __VA_ARGS__();                                           \
    }                                                                 \
    ::flash_sm75::throw_bad_head_dim(HEADDIM);                        \
  }()
