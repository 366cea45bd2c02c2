"""Integrations with other libraries (imported lazily, so those libraries stay optional).

* :mod:`flash_attention_sm75.integrations.transformers` -- Hugging Face transformers:
  ``attn_implementation="flash_attention_sm75"`` and :func:`apply_patch` /
  :func:`remove_patch` for models running with ``attn_implementation="sdpa"``.

The names below are loaded from the transformers integration on first access; importing it
registers ``"flash_attention_sm75"`` with transformers.
"""
import importlib

__all__ = [
    "apply_patch",
    "remove_patch",
    "is_patched",
    "register",
    "flash_attention_sm75_forward",
    "classify_attention_mask",
    "get_stats",
    "reset_stats",
    "configure",
]


def __getattr__(name):
    if name in __all__:
        module = importlib.import_module(".transformers", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
