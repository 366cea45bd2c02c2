"""FlashAttention for NVIDIA Turing (sm_75) GPUs as PyTorch ops.

Public API:

* :func:`flash_attn_func` -- FlashAttention's API, BSHD tensors, bottom-right causal.
* :func:`flash_attention_forward` -- the same for BHSD tensors.
* :func:`scaled_dot_product_attention` -- drop-in for ``torch.nn.functional``'s SDPA (BHSD,
  top-left causal), falling back to torch for unsupported input; :func:`why_not_supported`,
  :func:`strict`, :func:`set_strict` control and explain the fallback.
* :func:`apply_patch` / :func:`remove_patch` -- Hugging Face transformers integration (imported
  lazily, so transformers is optional).
* :func:`deterministic_backward` / :func:`is_deterministic_backward` -- the backward's
  determinism (default: no floating-point atomics; docs/BACKWARD.md).
* :mod:`flash_attention_sm75.fa2` / :mod:`flash_attention_sm75.bert_padding` -- flash-attn 2's
  API (positional order, varlen, KV cache, padding helpers), the code of the optional
  ``flash_attn`` drop-in (``flash_attn_dropin/``); imported on use, not by this package.
* :func:`enable_sdpa` / :func:`disable_sdpa` / :func:`sdpa_enabled` / :func:`is_sdpa_enabled` --
  transparent acceleration: torch's own ``scaled_dot_product_attention`` runs on the kernels on
  Turing GPUs (``sdpa_override``; also ``FLASH_ATTENTION_SM75_SDPA=1`` at import, or
  ``python -m flash_attention_sm75 run script.py``).

The op itself is ``torch.ops.flash_attention_sm75.fwd`` (see docs/CONTRACT.md).
"""
from ._ops import (EXTENSION_AVAILABLE, EXTENSION_ERROR, deterministic_backward,
                   is_deterministic_backward)
from .interface import flash_attention_forward, flash_attn_func
from .sdpa import is_strict, scaled_dot_product_attention, set_strict, strict, why_not_supported
from .sdpa_override import disable_sdpa, enable_sdpa, is_sdpa_enabled, sdpa_enabled

__version__ = "0.1.0"

__all__ = [
    "EXTENSION_AVAILABLE",
    "EXTENSION_ERROR",
    "__version__",
    "apply_patch",
    "deterministic_backward",
    "disable_sdpa",
    "enable_sdpa",
    "flash_attention_forward",
    "flash_attn_func",
    "is_deterministic_backward",
    "is_sdpa_enabled",
    "is_strict",
    "remove_patch",
    "scaled_dot_product_attention",
    "sdpa_enabled",
    "set_strict",
    "strict",
    "why_not_supported",
]

_LAZY = {"apply_patch": ".integrations.transformers", "remove_patch": ".integrations.transformers"}


def __getattr__(name):
    # Imported on first use so that `import flash_attention_sm75` works without transformers.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# FLASH_ATTENTION_SM75_SDPA=1: torch's SDPA runs on the kernels from the import on.
from . import sdpa_override as _sdpa_override  # noqa: E402

_sdpa_override._enable_from_environment()
# A FLASH_ATTENTION_SM75_STRICT value that is not understood warns now, not first at a fallback.
from . import sdpa as _sdpa  # noqa: E402

_sdpa._warn_on_bad_environment()
