// Compile-time dispatch of runtime flags (shape of FlashAttention's static_switch.h).
// Each switch ends in an error for values it does not know, so an unsupported head dim can never
// silently launch nothing.
#pragma once

#include <stdexcept>
#include <string>

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

#define HEADDIM_SWITCH(HEADDIM, ...)                                                  \
  [&] {                                                                               \
    if (HEADDIM == 64) {                                                              \
      constexpr static int kHeadDim = 64;                                             \
      return __VA_ARGS__();                                                           \
    } else if (HEADDIM == 128) {                                                      \
      constexpr static int kHeadDim = 128;                                            \
      return __VA_ARGS__();                                                           \
    }                                                                                 \
    throw std::invalid_argument("flash_attention_sm75: head_dim must be 64 or 128, got " + \
                                std::to_string(HEADDIM));                             \
  }()
