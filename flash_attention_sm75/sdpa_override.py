"""Transparent SDPA acceleration: the SM75 kernels behind torch's own SDPA on Turing GPUs.

On a Turing GPU (compute capability 7.5), ``torch.nn.functional.scaled_dot_product_attention``
runs float16 attention without a mask on torch's memory-efficient backend: the aten op
``_scaled_dot_product_efficient_attention`` and, for gradients, its autograd formula's
``_scaled_dot_product_efficient_attention_backward``. :func:`enable_sdpa` registers CUDA
kernels for these two ops (``torch.library.Library("aten", "IMPL")``): a call that the
FlashAttention kernels can take runs ``torch.ops.flash_attention_sm75.fwd`` / ``bwd`` and
returns exactly the outputs torch's kernel returns (layouts, the padded log-sum-exp, the RNG
state tensors); every other call runs torch's kernel, reached through the lower-level ops
that torch's CUDA kernel itself calls (``_efficient_attention_forward`` / ``_backward``, with
torch's argument mapping). So every library that calls SDPA (diffusers, timm,
``nn.MultiheadAttention``, transformers' ``"sdpa"`` path, compiled graphs) runs on the kernels
without a code change. :func:`disable_sdpa` destroys the registration and leaves torch's
dispatch table as it was.

Ways to turn it on:

* ``flash_attention_sm75.enable_sdpa()`` / ``disable_sdpa()``, or ``with
  flash_attention_sm75.sdpa_enabled(): ...`` (restores the previous state on exit);
* ``FLASH_ATTENTION_SM75_SDPA=1`` in the environment, honoured when ``flash_attention_sm75``
  is imported (a value that is not understood warns and leaves torch alone: the import never
  fails because of it);
* ``python -m flash_attention_sm75 run script.py args...`` (or ``run -m module args...``) for a
  script that never imports this package.

Which calls run on the kernels: ``dropout_p == 0``, query, key and value accepted by the
rulebook (``_rules.not_supported_reason``: float16, head_dim a multiple of 8 up to 256, aligned,
...) with equal head counts (torch's kernel has no GQA) and no zero size, on a GPU of compute
capability 7.5; ``attn_bias`` (torch passes a mask as a float bias) None or one the kernels read
(``_rules.attn_bias_problem``; in the backward head_dim <= 128, and a bias that requires grad
gets its gradient from the kernels' ``bwd_dbias``). Other GPUs keep torch's kernel for every
call, unless ``treat_as_sm75=True`` (or ``FLASH_ATTENTION_SM75_SDPA_DEVICES=any``): then every GPU of
compute capability >= 7.5 counts as one. That switch is for testing on newer GPUs (which
also need ``torch.nn.attention.sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])`` for torch to
take the efficient path a Turing GPU takes); on them torch's own backends are faster.

:func:`why_not_overridden` says why a call keeps torch's kernel (also logged at DEBUG level on
the ``"flash_attention_sm75"`` logger).

Torch facts this module relies on (torch 2.6 to 2.11; tests/test_sdpa_override.py checks them):

* forward ``(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0., is_causal=False,
  *, scale=None) -> (output, log_sumexp, philox_seed, philox_offset)``: ``output`` is
  ``(B, H, Sq, Dv)``, the ``transpose(1, 2)`` view of a contiguous ``(B, Sq, H, Dv)`` tensor;
  ``log_sumexp`` is float32 ``(B, H, ceil(Sq / 32) * 32)`` (natural log of sum_j exp(scale *
  q.k_j), the padding +inf) or ``(B, H, 0)`` without ``compute_log_sumexp``; the RNG state is two
  empty int64 scalars without dropout, on the CPU, or on the GPU while a CUDA graph captures;
  ``is_causal`` is top-left aligned.
* backward ``(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
  philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None) -> (grad_query,
  grad_key, grad_value, grad_bias)``; autograd passes the forward's saved inputs and outputs and
  ``grad_input_mask = [query, key, value, attn_bias].requires_grad``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import warnings
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from . import _ops, _rules

__all__ = [
    "DEVICES_ENV_VAR",
    "ENV_VAR",
    "OVERRIDDEN_OPS",
    "disable_sdpa",
    "enable_sdpa",
    "is_sdpa_enabled",
    "sdpa_enabled",
    "why_not_overridden",
]

logger = logging.getLogger("flash_attention_sm75")

ENV_VAR = "FLASH_ATTENTION_SM75_SDPA"
"""``1`` / ``true`` / ``yes`` / ``on``: :func:`enable_sdpa` when the package is imported."""

DEVICES_ENV_VAR = "FLASH_ATTENTION_SM75_SDPA_DEVICES"
"""``sm75`` (or unset): only GPUs of compute capability 7.5 run the kernels; ``any``: every GPU
of compute capability >= 7.5 (tests on newer GPUs). Read by :func:`enable_sdpa` when its
``treat_as_sm75`` is None."""


_FWD = "_scaled_dot_product_efficient_attention"
_BWD = "_scaled_dot_product_efficient_attention_backward"
OVERRIDDEN_OPS = ("aten::" + _FWD, "aten::" + _BWD)
"""The aten ops whose kernels :func:`enable_sdpa` replaces."""

# Dispatch keys the kernels are registered for, and the device types whose calls may run on
# the op. CPU tests add "CPU" / "cpu" (the op has a CPU reference implementation; torch has no
# CPU kernel for these ops), which runs the whole autograd path on the CPU.
_DISPATCH_KEYS = ("CUDA",)
_KERNEL_DEVICE_TYPES = ("cuda",)

# torch's lower-level ops, which its CUDA kernels for the two ops call (module attributes so
# that tests can record the calls).
_efficient_attention_forward = torch.ops.aten._efficient_attention_forward.default
_efficient_attention_backward = torch.ops.aten._efficient_attention_backward.default

# torch's sdp::CustomMaskType: NoCustomMask, CausalFromTopLeft (CausalFromBottomRight = 2 unused).
_NO_CUSTOM_MASK, _CAUSAL_FROM_TOP_LEFT = 0, 1
# Since torch 2.8 its kernels split batches above 65535 (the CUDA grid's y/z limit) into chunks.
_MAX_BATCH_SIZE = 65535
_CHUNKS_LARGE_BATCHES = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
_LSE_ALIGN = 32  # torch's log_sumexp rows are padded to a multiple of 32 (kAlignLSE)
_NAMES = ("query", "key", "value", "scale")

_lock = threading.RLock()
_library: Optional[torch.library.Library] = None
_treat_as_sm75 = False


# ----------------------------------------------------------------------------- switches
def _devices_from_environment() -> bool:
    return _ops.env_choice(DEVICES_ENV_VAR, {"": False, "sm75": False, "any": True})


def enable_sdpa(*, treat_as_sm75: Optional[bool] = None) -> None:
    """Run torch's SDPA on the SM75 FlashAttention kernels wherever they can take the call.

    Registers this module's CUDA kernels for ``aten::_scaled_dot_product_efficient_attention``
    and its backward (the ops torch's SDPA runs for float16 on a Turing GPU); calls the kernels
    cannot take keep torch's kernel and torch's results. Calling it again while enabled
    registers nothing more (it only updates ``treat_as_sm75``). Thread-safe.

    Parameters
    ----------
    treat_as_sm75 : bool, optional
        ``True``: every GPU of compute capability >= 7.5 counts as SM75 (testing on newer GPUs;
        torch must also be made to take its efficient path there, e.g. with
        ``torch.nn.attention.sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])``). ``False``: only
        compute capability 7.5. ``None`` (default): ``FLASH_ATTENTION_SM75_SDPA_DEVICES``
        decides (``any`` or ``sm75`` / unset).

    Raises
    ------
    RuntimeError
        If the compiled extension is not available, or another Python library already
        overrides these ops' CUDA kernels.
    ValueError
        If ``treat_as_sm75`` is not a bool or None, or ``FLASH_ATTENTION_SM75_SDPA_DEVICES``
        holds an unknown value.

    Notes
    -----
    The state is process-wide. torch's dispatcher does not expect registrations while other
    threads run these ops: enable before starting the work.
    """
    global _library, _treat_as_sm75
    if treat_as_sm75 is not None:
        _rules.require_bool("enable_sdpa(treat_as_sm75)", treat_as_sm75)
    _ops.require_extension()
    treat = _devices_from_environment() if treat_as_sm75 is None else treat_as_sm75
    with _lock:
        _treat_as_sm75 = treat
        if _library is None:
            _library = _register()


def disable_sdpa() -> None:
    """Give both ops back their torch kernels (destroys the registration; no-op when not
    enabled). Thread-safe."""
    global _library
    with _lock:
        if _library is not None:
            lib, _library = _library, None
            lib._destroy()


def is_sdpa_enabled() -> bool:
    """True between :func:`enable_sdpa` and :func:`disable_sdpa`."""
    return _library is not None


@contextlib.contextmanager
def sdpa_enabled(enabled: bool = True, *, treat_as_sm75: Optional[bool] = None
                 ) -> Iterator[None]:
    """Context manager: :func:`enable_sdpa` (or, with ``enabled=False``, :func:`disable_sdpa`)
    for the block, then the previous state again (enabled or not, and its ``treat_as_sm75``).
    Blocks nest. The state is process-wide, not per thread.

    Examples
    --------
    >>> with flash_attention_sm75.sdpa_enabled():
    ...     image = pipe(prompt).images[0]
    """
    global _treat_as_sm75
    _rules.require_bool("sdpa_enabled(enabled)", enabled)
    with _lock:
        previous = (_library is not None, _treat_as_sm75)
        if enabled:
            enable_sdpa(treat_as_sm75=treat_as_sm75)
        else:
            disable_sdpa()
    try:
        yield
    finally:
        with _lock:
            if previous[0]:
                enable_sdpa(treat_as_sm75=previous[1])
            else:
                disable_sdpa()
                # treat_as_sm75 outlives disable_sdpa() (a later enable_sdpa(treat_as_sm75=None)
                # sets it again, but why_not_overridden reads it meanwhile): restore it too.
                _treat_as_sm75 = previous[1]


def _enable_from_environment() -> None:
    """``import flash_attention_sm75`` calls this: enable when ``FLASH_ATTENTION_SM75_SDPA``
    asks for it. Nothing here fails the import (``import flash_attn`` of the drop-in runs it too,
    and an opt-in speed-up must not break a program): a value of ``FLASH_ATTENTION_SM75_SDPA``
    or ``FLASH_ATTENTION_SM75_SDPA_DEVICES`` that is not understood, a missing extension or a
    failed registration warns (``RuntimeWarning``, naming the variable and the values
    accepted) and leaves torch's SDPA unchanged. :func:`enable_sdpa` called explicitly still
    raises. Under ``python -m flash_attention_sm75`` (the launcher) nothing happens here: the
    launcher enables the override itself and reports a bad value as its own error."""
    if _started_as_launcher():
        return
    try:
        wanted = _ops.env_flag(ENV_VAR)
        treat = _devices_from_environment() if wanted else False
    except ValueError as e:
        warnings.warn(f"{e}; torch's SDPA is left unchanged", RuntimeWarning, stacklevel=3)
        return
    if not wanted:
        return
    if not _ops.EXTENSION_AVAILABLE:
        warnings.warn(f"flash_attention_sm75: {ENV_VAR} is set but the compiled extension is not "
                      f"available ({_ops.EXTENSION_ERROR}; {_ops.BUILD_HINT}); torch's SDPA is "
                      f"left unchanged", RuntimeWarning, stacklevel=3)
        return
    try:
        enable_sdpa(treat_as_sm75=treat)
    except RuntimeError as e:  # another library overrides the ops' CUDA kernels
        warnings.warn(f"{e}; {ENV_VAR} is ignored, torch's SDPA is left unchanged",
                      RuntimeWarning, stacklevel=3)


# Python's short options that take a value (`-W error`, `-Werror`, `-X dev`); `-c` and `-m`
# end the options. Long options: only --check-hash-based-pycs takes one.
_PYTHON_SHORT_OPTIONS_WITH_VALUE = "WX"
_PYTHON_LONG_OPTIONS_WITH_VALUE = ("--check-hash-based-pycs",)
_LAUNCHER_MODULES = ("flash_attention_sm75", "flash_attention_sm75.__main__")


def _started_as_launcher() -> bool:
    """Whether this interpreter was started as ``python [options] -m flash_attention_sm75``
    (the package is imported then before its ``__main__`` runs, and the launcher, not the
    environment, decides). Reads ``sys.orig_argv`` as Python parses its own options: clusters
    of short options (``-Bm``, ``-uWerror``), ``-`` (a script on stdin) and ``--`` (a script
    follows). Starting the launcher from code (``runpy``, calling its ``main``) is not
    recognised: the import then acts on the environment as for any program."""
    argv = sys.orig_argv[1:]
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-", "--") or not arg.startswith("-"):  # a script: not the launcher
            return False
        if arg.startswith("--"):
            i += 2 if arg in _PYTHON_LONG_OPTIONS_WITH_VALUE else 1
            continue
        for j in range(1, len(arg)):
            option = arg[j]
            if option == "c":
                return False
            if option == "m":
                name = arg[j + 1:] or (argv[i + 1] if i + 1 < len(argv) else "")
                return name in _LAUNCHER_MODULES
            if option in _PYTHON_SHORT_OPTIONS_WITH_VALUE:
                if j + 1 == len(arg):  # the value is the next argument
                    i += 1
                break  # the rest of the cluster is the value
        i += 1
    return False


def _register() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # torch warns (once per process) that a kernel is replaced: that is the point.
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered")
            for key in _DISPATCH_KEYS:
                lib.impl(_FWD, _forward, key)
                lib.impl(_BWD, _backward, key)
    except RuntimeError as e:
        lib._destroy()
        raise RuntimeError(f"flash_attention_sm75: enable_sdpa could not register its kernels "
                           f"for {', '.join(OVERRIDDEN_OPS)}: {e}") from e
    return lib


# ----------------------------------------------------------------------------- the rules
def _device_reason(device: torch.device) -> Optional[str]:
    if device.type not in _KERNEL_DEVICE_TYPES:
        return f"query is on {device}, not a CUDA device"
    if device.type != "cuda":
        return None
    cap = _rules.device_capability(device)
    if cap == (7, 5) or (_treat_as_sm75 and cap >= (7, 5)):
        return None
    return (f"{device} has compute capability {cap[0]}.{cap[1]}, not 7.5 (Turing); "
            f"enable_sdpa(treat_as_sm75=True) or {DEVICES_ENV_VAR}=any accepts newer GPUs")


def _forward_reason(query, key, value, attn_bias, dropout_p, scale) -> Optional[str]:
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p!r} (dropout runs on torch's kernel)"
    if not isinstance(query, torch.Tensor):
        return f"query is a {type(query).__name__}"
    reason = _device_reason(query.device)
    if reason is not None:
        return reason
    reason = _rules.not_supported_reason(query, key, value, scale, layout="bhsd",
                                         devices=_KERNEL_DEVICE_TYPES, names=_NAMES)
    if reason is not None:
        return reason
    if query.shape[1] != key.shape[1]:
        return (f"query has {query.shape[1]} heads and key/value {key.shape[1]} (torch's kernel "
                f"takes equal head counts only)")
    if 0 in query.shape or 0 in key.shape:
        return "a zero size (torch's kernel decides the empty result)"
    if attn_bias is not None:  # torch passes masks as a float bias (bool masks turned into -inf)
        return _rules.attn_bias_problem(attn_bias, query, key.shape[2], layout="bhsd",
                                        softmax_scale=scale, scale_name="scale")
    return None


def _like_query_reason(name, t, query) -> Optional[str]:
    if not (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype == query.dtype
            and t.shape == query.shape and t.device == query.device):
        return f"{name} is not a float16 tensor of the query's shape and device"
    return None


def _backward_reason(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p,
                     scale, bias_requires_grad: bool = False) -> Optional[str]:
    reason = (_forward_reason(query, key, value, attn_bias, dropout_p, scale)
              or _like_query_reason("grad_out", grad_out, query)
              or _like_query_reason("out", out, query))
    if reason is not None:
        return reason
    if attn_bias is not None:
        if bias_requires_grad and not _ops.DBIAS_AVAILABLE:
            return "attn_bias requires grad and the extension has no bwd_dbias (older build)"
        reason = _rules.attn_bias_problem(attn_bias, query, key.shape[2], layout="bhsd",
                                          backward=True, bias_grad=bias_requires_grad,
                                          softmax_scale=scale, scale_name="scale")
        if reason is not None:
            return reason
    b, h, s_q = query.shape[:3]
    if not (isinstance(logsumexp, torch.Tensor) and logsumexp.dtype == torch.float32
            and logsumexp.dim() == 3 and logsumexp.shape[0] == b and logsumexp.shape[1] == h
            and logsumexp.shape[2] >= s_q and logsumexp.device == query.device):
        return f"logsumexp is not a float32 (batch, heads, >= seqlen_q) = ({b}, {h}, >= {s_q}) tensor"
    return None


def why_not_overridden(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, *,
                       scale=None) -> Optional[str]:
    """Why :func:`enable_sdpa` would leave this ``_scaled_dot_product_efficient_attention`` call
    (the op's arguments; ``torch.nn.functional.scaled_dot_product_attention`` passes its mask as
    ``attn_bias``) to torch's kernel, or None if the SM75 kernels run it. Metadata only; the
    device rule reads the current ``treat_as_sm75`` setting. ``is_causal`` is accepted either
    way."""
    del is_causal
    if not _ops.EXTENSION_AVAILABLE:
        return f"the compiled extension is not available ({_ops.EXTENSION_ERROR})"
    return _forward_reason(query, key, value, attn_bias, dropout_p, scale)


def _log_fallback(op: str, reason: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s runs on torch's kernel: %s", op, reason)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _empty_rng_state(device: torch.device):
    """torch's philox seed and offset without dropout: empty int64 scalars, on the GPU while a
    CUDA graph captures (they are the capture's RNG scratch space), else on the CPU."""
    on = device if device.type == "cuda" and _capturing() else torch.device("cpu")
    return (torch.empty((), dtype=torch.int64, device=on),
            torch.empty((), dtype=torch.int64, device=on))


# ----------------------------------------------------------------------------- the kernels
def _forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
             *, scale=None):
    """CUDA kernel of ``aten::_scaled_dot_product_efficient_attention`` while enabled."""
    reason = _forward_reason(query, key, value, attn_bias, dropout_p, scale)
    if reason is not None:
        _log_fallback(_FWD, reason)
        return _torch_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p,
                              is_causal, scale)
    # Below autograd already (torch's formula for this op runs above): the op itself, BSHD views.
    kw = {} if attn_bias is None else {"attn_bias": attn_bias}
    out, lse = torch.ops.flash_attention_sm75.fwd(query.transpose(1, 2), key.transpose(1, 2),
                                                  value.transpose(1, 2), scale, is_causal, False,
                                                  **kw)
    if compute_log_sumexp:
        pad = -query.shape[2] % _LSE_ALIGN
        if pad:
            lse = F.pad(lse, (0, pad), value=math.inf)
    else:
        lse = lse.new_empty((query.shape[0], query.shape[1], 0))
    seed, offset = _empty_rng_state(query.device)
    return out.transpose(1, 2), lse, seed, offset


def _backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
              philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    """CUDA kernel of ``aten::_scaled_dot_product_efficient_attention_backward`` while enabled.
    Takes the log-sum-exp of either forward (ours or torch's: the same values and layout)."""
    if grad_out is None:  # torch's kernel: no incoming gradient, four undefined results
        return None, None, None, None
    reason = _backward_reason(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p,
                              scale, bool(grad_input_mask[3]))
    if reason is not None:
        _log_fallback(_BWD, reason)
        # A row that sees no key has LSE -inf (from our forward, and from torch's, which writes
        # -inf there too); torch's backward then computes P = exp(s - lse) = exp(-inf + inf) =
        # NaN for the row. +inf makes that P 0, the row's gradients 0, and changes no row that
        # sees a key (its LSE is finite). One elementwise op on the device.
        logsumexp = logsumexp.masked_fill(logsumexp == -math.inf, math.inf)
        return _torch_backward(grad_out, query, key, value, attn_bias, out, logsumexp,
                               philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal,
                               scale)
    s_q = query.shape[2]
    lse = logsumexp if logsumexp.shape[2] == s_q else logsumexp[:, :, :s_q]
    softmax_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    want_dbias = attn_bias is not None and bool(grad_input_mask[3])
    grads = getattr(torch.ops.flash_attention_sm75, "bwd_dbias" if want_dbias else "bwd")(
        grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2),
        value.transpose(1, 2), out.transpose(1, 2), lse, softmax_scale, is_causal, False, None,
        None, _ops._deterministic_forced(), None,
        **({} if attn_bias is None else {"attn_bias": attn_bias}))
    grad_bias = _ops.reduce_dbias(grads[3], attn_bias) if want_dbias else None
    return grads[0].transpose(1, 2), grads[1].transpose(1, 2), grads[2].transpose(1, 2), grad_bias


# ------------------------------------------------------------------ torch's kernels, reached
def _torch_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal,
                   scale):
    """What torch's CUDA kernel of the forward op does (aten/src/ATen/native/transformers/cuda/
    attention.cu): ``_efficient_attention_forward`` on BSHD views, top-left causal mask type,
    no sequence-length tensors, the output transposed back; batches above 65535 in chunks."""
    mask_type = _CAUSAL_FROM_TOP_LEFT if is_causal else _NO_CUSTOM_MASK

    def run(q, k, v, bias):
        out, lse, seed, offset, _, _ = _efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, None, None, None,
            None, dropout_p, mask_type, compute_log_sumexp, scale=scale)
        return out.transpose(1, 2), lse, seed, offset

    batch = query.shape[0]
    if not (_CHUNKS_LARGE_BATCHES and batch > _MAX_BATCH_SIZE):
        return run(query, key, value, attn_bias)
    if dropout_p != 0.0:
        raise RuntimeError(f"Efficient attention cannot produce valid seed and offset outputs "
                           f"when the batch size exceeds ({_MAX_BATCH_SIZE}).")
    parts = [run(query[i:i + _MAX_BATCH_SIZE], key[i:i + _MAX_BATCH_SIZE],
                 value[i:i + _MAX_BATCH_SIZE],
                 None if attn_bias is None else attn_bias[i:i + _MAX_BATCH_SIZE])
             for i in range(0, batch, _MAX_BATCH_SIZE)]
    # Without dropout the RNG state is unused (empty tensors); the first chunk's is returned.
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), parts[0][2],
            parts[0][3])


def _torch_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                    philox_offset, dropout_p, grad_input_mask, is_causal, scale):
    """What torch's CUDA kernel of the backward op does (attention_backward.cu):
    ``_efficient_attention_backward`` on BSHD views, the sequence lengths as the maxima,
    ``bias_requires_grad = grad_input_mask[3]``, the gradients transposed back; batches above
    65535 in chunks written into tensors strided like the inputs."""
    mask_type = _CAUSAL_FROM_TOP_LEFT if is_causal else _NO_CUSTOM_MASK

    def run(go, q, k, v, bias, o, lse):
        gq, gk, gv, gb = _efficient_attention_backward(
            go.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias,
            o.transpose(1, 2), None, None, q.shape[2], k.shape[2], lse, dropout_p, philox_seed,
            philox_offset, mask_type, grad_input_mask[3], scale=scale, num_splits_key=None)
        return gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2), gb

    batch = query.shape[0]
    if not (_CHUNKS_LARGE_BATCHES and batch > _MAX_BATCH_SIZE):
        return run(grad_out, query, key, value, attn_bias, out, logsumexp)
    if dropout_p != 0.0:
        raise RuntimeError(f"Efficient attention backward cannot handle dropout when the batch "
                           f"size exceeds ({_MAX_BATCH_SIZE}).")
    grads = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
             if need else None for t, need in zip((query, key, value), grad_input_mask[:3])]
    grad_bias = (torch.zeros_like(attn_bias) if grad_input_mask[3] and attn_bias is not None
                 else None)
    for i in range(0, batch, _MAX_BATCH_SIZE):
        j = i + _MAX_BATCH_SIZE
        lse = logsumexp[i:j] if logsumexp.numel() > 0 else logsumexp
        chunk = run(grad_out[i:j], query[i:j], key[i:j], value[i:j],
                    None if attn_bias is None else attn_bias[i:j], out[i:j], lse)
        for g, c in zip(grads, chunk[:3]):
            if g is not None and c is not None:
                g[i:j].copy_(c)
        if grad_bias is not None and chunk[3] is not None:
            grad_bias.add_(chunk[3])
    return grads[0], grads[1], grads[2], grad_bias
