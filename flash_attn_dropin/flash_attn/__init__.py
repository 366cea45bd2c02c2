"""``flash_attn`` drop-in for NVIDIA Turing (sm_75): flash-attn 2's API on flash-attention-sm75.

Installed only on purpose (``pip install ./flash_attn_dropin`` in the flash-attention-sm75
repository): the distribution is named ``flash-attn``, so it replaces a real flash-attn in that
environment, and transformers' ``attn_implementation="flash_attention_2"`` runs these functions.
The code lives in ``flash_attention_sm75.fa2`` (functions) and ``flash_attention_sm75.bert_padding``;
see their docstrings for shapes, dtypes and the errors raised for features the SM75 kernels do
not have (:class:`UnsupportedFeatureError`: dropout; sliding windows, soft-capping and ALiBi
run).
"""
from .flash_attn_interface import *  # noqa: F401,F403  (flash-attn's package layout)
from .flash_attn_interface import __all__  # noqa: F401

__version__ = "2.8.3+sm75"
SM75_DROPIN = True
"""Marks this package as flash-attention-sm75's drop-in (a real flash-attn has no such name)."""
