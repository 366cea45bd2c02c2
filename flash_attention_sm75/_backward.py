"""Autograd for ``flash_attention_sm75::fwd`` through the backward op ``flash_attention_sm75::bwd``.

:func:`register_backward` (idempotent) registers

* a fake (meta) implementation of ``bwd`` (``torch.compile`` / ``torch.export`` / FakeTensorMode):
  ``dq`` like ``q`` and ``dk``/``dv`` like ``k``/``v``, contiguous BSHD, exactly what the C++
  allocates;
* the autograd formula of ``fwd``: saves ``q, k, v, out, softmax_lse`` (O(N) memory, no
  attention matrix) and calls ``bwd``. A gradient flowing into ``softmax_lse`` (returned with
  ``return_lse=True``) is passed on as ``grad_softmax_lse`` and handled exactly.

Determinism: by default dQ is computed by a separate kernel with no floating-point atomics, so
the backward is bitwise reproducible. That kernel recomputes S, P and dP (about 1.4x the matmul
work of accumulating dQ with fp32 atomics) yet measured as fast or faster on the H200 proxy
(docs/BACKWARD.md). ``FLASH_SM75_BWD_DQ=atomic`` selects the atomic mode (an fp32
``(batch, num_heads, seqlen_q, head_dim)`` accumulator, not reproducible bit for bit); it is
ignored when ``torch.use_deterministic_algorithms(True)`` is in effect or inside
:func:`deterministic_backward`, which always use the separate kernel.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Iterator, Optional

import torch

__all__ = ["deterministic_backward", "is_deterministic_backward", "register_backward"]

_registered = False
# Set by deterministic_backward(), process-wide: PyTorch runs the backward of CUDA tensors on its
# autograd device threads, which a thread-local setting of the caller's thread would not reach.
_forced: Optional[bool] = None
_forced_lock = threading.Lock()


@contextlib.contextmanager
def deterministic_backward(enabled: bool = True) -> Iterator[None]:
    """Within the block, backward passes run in deterministic mode (``enabled=False``: they
    follow ``FLASH_SM75_BWD_DQ`` even under ``torch.use_deterministic_algorithms(True)``).

    The setting is read when the backward runs (``loss.backward()``), not when the forward runs,
    and it is process-wide while the block runs: the backward of CUDA tensors runs on PyTorch's
    autograd device threads, not on the thread that called ``backward()``. Blocks entered on
    several threads at once with different settings race (the last one entered wins).

    Raises ``ValueError`` if ``enabled`` is not a bool.
    """
    from ._ops import require_bool  # (_ops imports this module lazily)

    require_bool("deterministic_backward(enabled)", enabled)
    global _forced
    with _forced_lock:
        prev, _forced = _forced, enabled
    try:
        yield
    finally:
        with _forced_lock:
            _forced = prev


def _deterministic_forced() -> bool:
    """The backward op's ``deterministic`` argument: inside :func:`deterministic_backward`, its
    setting; else ``torch.are_deterministic_algorithms_enabled()``."""
    flag = _forced
    if flag is not None:
        return flag
    return torch.are_deterministic_algorithms_enabled()


def is_deterministic_backward() -> bool:
    """True if the next CUDA backward runs without floating-point atomics (bitwise
    reproducible): always, unless ``FLASH_SM75_BWD_DQ=atomic`` selects fp32 atomics for dQ and
    neither :func:`deterministic_backward` nor ``torch.use_deterministic_algorithms(True)``
    forces the separate dQ kernel. (The CPU backward is always deterministic; the CUDA backward
    rejects other values of ``FLASH_SM75_BWD_DQ`` with ``ValueError`` when it runs.)"""
    return _deterministic_forced() or os.environ.get("FLASH_SM75_BWD_DQ", "") != "atomic"


def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal, causal_bottom_right,
              leftpad_k=None, seqused_k=None, deterministic=False, grad_softmax_lse=None):
    torch._check(dout.shape == q.shape, lambda: "flash_attention_sm75: dout must have the shape of q")
    torch._check(out.shape == q.shape, lambda: "flash_attention_sm75: out must have the shape of q")
    # The C++: at::empty({b, sq, h, d}, q.options()) and at::empty({b, sk, h_k, d}, ...) twice.
    return q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k = inputs
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, leftpad_k, seqused_k)
    ctx.softmax_scale = (1.0 / math.sqrt(q.shape[-1])) if softmax_scale is None else float(softmax_scale)
    ctx.is_causal = bool(is_causal)
    ctx.causal_bottom_right = bool(causal_bottom_right)
    # Unused outputs (usually softmax_lse) get None instead of a materialized zero tensor.
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, softmax_lse, leftpad_k, seqused_k = ctx.saved_tensors
    none = (None,) * 5  # softmax_scale, is_causal, causal_bottom_right, leftpad_k, seqused_k
    if grad_out is None and grad_lse is None:
        return (None, None, None) + none
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flash_attention_sm75.bwd(
        grad_out, q, k, v, out, softmax_lse, ctx.softmax_scale, ctx.is_causal,
        ctx.causal_bottom_right, leftpad_k, seqused_k, _deterministic_forced(), grad_lse)
    return (dq, dk, dv) + none


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    # Without an autograd formula for bwd, torch would let a second backward run and return
    # missing gradients with only a warning; fail loudly instead.
    raise NotImplementedError(
        "flash_attention_sm75: double backward (gradients of gradients, create_graph=True "
        "through the attention backward) is not implemented")


def register_backward() -> bool:
    """Register the fake of ``bwd`` and the autograd formula of ``fwd``. Returns False (and does
    nothing) when the compiled extension, or its ``bwd`` op, is not available."""
    global _registered
    if _registered:
        return True
    try:
        from . import _C  # noqa: F401  (loads the op library)
    except ImportError:
        return False
    if not hasattr(torch.ops.flash_attention_sm75, "bwd"):
        return False
    torch.library.register_fake("flash_attention_sm75::bwd")(_bwd_fake)
    torch.library.register_autograd("flash_attention_sm75::fwd", _fwd_backward,
                                    setup_context=_fwd_setup_context)
    torch.library.register_autograd("flash_attention_sm75::bwd", _bwd_backward,
                                    setup_context=_bwd_setup_context)
    _registered = True
    return True
