"""``flash_attn`` drop-in for NVIDIA Turing (sm_75): flash-attn 2's API on flash-attention-sm75.

Installed only on purpose (``pip install ./flash_attn_dropin`` in the flash-attention-sm75
repository): the distribution is named ``flash-attn``, so it takes the place of a real
flash-attn in that environment (its build refuses while one is installed), and transformers'
``attn_implementation="flash_attention_2"`` runs these functions.
The code lives in ``flash_attention_sm75.fa2`` (functions) and ``flash_attention_sm75.bert_padding``;
see their docstrings for shapes, dtypes and the errors raised for features the SM75 kernels do
not have (:class:`UnsupportedFeatureError`: ``return_attn_probs=True`` with dropout; sliding
windows, soft-capping, ALiBi and dropout, dense and packed, run).

flash-attention-sm75 is not a declared dependency (it is not on PyPI, and a requirement of its
name could be met by someone else's upload there): importing this package checks that it is
installed, at ``MIN_FLASH_ATTENTION_SM75`` or newer, and raises ``ImportError`` with the install
command otherwise.
"""
import re as _re

__version__ = "2.8.3+sm75"
SM75_DROPIN = True
"""Marks this package as flash-attention-sm75's drop-in (a real flash-attn has no such name)."""

MIN_FLASH_ATTENTION_SM75 = "0.1.0"
"""The oldest flash-attention-sm75 with what this drop-in imports (``fa2``, ``bert_padding``)."""

_INSTALL = ("install flash-attention-sm75 from its repository (it is not on PyPI): "
            "`pip install --no-build-isolation .` at the repository root (its README: Set-up), "
            "or `pip uninstall flash-attn` to remove this drop-in")


def _release(version: str) -> tuple:
    match = _re.match(r"\d+(\.\d+)*", version or "")
    return tuple(int(x) for x in match.group(0).split(".")) if match else ()


try:
    import flash_attention_sm75 as _sm75
except ImportError as _e:
    raise ImportError(
        f"flash_attn {__version__} is flash-attention-sm75's drop-in and needs the "
        f"flash_attention_sm75 package, which cannot be imported ({_e}); {_INSTALL}") from _e
_found = getattr(_sm75, "__version__", "unknown")
if _release(_found) < _release(MIN_FLASH_ATTENTION_SM75):
    raise ImportError(
        f"flash_attn {__version__} needs flash-attention-sm75 >= {MIN_FLASH_ATTENTION_SM75}, "
        f"found {_found} ({getattr(_sm75, '__file__', '?')}); {_INSTALL}")
try:
    from flash_attention_sm75 import bert_padding as _bert_padding, fa2 as _fa2  # noqa: F401
except ImportError as _e:
    raise ImportError(
        f"flash_attn {__version__} needs flash_attention_sm75.fa2 and .bert_padding, which "
        f"cannot be imported from flash-attention-sm75 {_found} ({_e}); {_INSTALL}") from _e

from .flash_attn_interface import *  # noqa: E402,F401,F403  (flash-attn's package layout)
from .flash_attn_interface import __all__  # noqa: E402,F401
