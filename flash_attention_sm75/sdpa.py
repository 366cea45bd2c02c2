"""Drop-in replacement for ``torch.nn.functional.scaled_dot_product_attention``.

:func:`scaled_dot_product_attention` has torch's signature and semantics. It runs the SM75
FlashAttention kernel when the call is supported and otherwise calls torch's own SDPA with the
same arguments, logging the reason at DEBUG level on the ``"flash_attention_sm75"`` logger.
:func:`why_not_supported` says why a call would fall back. In strict mode (environment variable
``FLASH_ATTENTION_SM75_STRICT=1``, :func:`set_strict`, or the :func:`strict` context manager) an
unsupported call raises ``ValueError`` instead of falling back.
"""
from __future__ import annotations

import contextlib
import logging
import numbers
import warnings
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from . import _masks, _ops, _rules

__all__ = ["scaled_dot_product_attention", "why_not_supported", "strict", "set_strict",
           "is_strict"]

logger = logging.getLogger("flash_attention_sm75")

STRICT_ENV_VAR = "FLASH_ATTENTION_SM75_STRICT"

# None: follow the environment variable; True/False: set by set_strict()/strict().
_strict_override: Optional[bool] = None

# The device type of the kernel path. CPU tests and benchmarks/host_overhead.py set it to "cpu"
# to run the kernel path on CPU tensors (the op has a CPU reference implementation).
_KERNEL_DEVICE_TYPE = "cuda"
# How the rulebook's messages name the tensors: torch's SDPA argument names.
_NAMES = ("query", "key", "value", "scale")


def set_strict(enabled: Optional[bool]) -> None:
    """Turn strict mode on or off for the whole process.

    Parameters
    ----------
    enabled : bool or None
        ``True``: :func:`scaled_dot_product_attention` raises ``ValueError`` for calls it cannot
        run on the FlashAttention kernel instead of falling back to torch. ``False``: always
        fall back. ``None``: follow the ``FLASH_ATTENTION_SM75_STRICT`` environment variable
        again (strict if it is ``1``, ``true``, ``yes`` or ``on``; off if unset, empty, ``0``,
        ``false``, ``no`` or ``off``; any other value raises ``ValueError``), the initial state.

    Raises
    ------
    ValueError
        If ``enabled`` is not a bool or None.
    """
    global _strict_override
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"flash_attention_sm75.set_strict: enabled must be a bool or None, got "
                         f"{enabled!r}")
    _strict_override = enabled


def is_strict() -> bool:
    """Return whether strict mode is on (see :func:`set_strict`).

    Returns
    -------
    bool
        The :func:`set_strict` / :func:`strict` setting if one is in force, else the value of
        ``FLASH_ATTENTION_SM75_STRICT``.

    Raises
    ------
    ValueError
        If ``FLASH_ATTENTION_SM75_STRICT`` decides and holds an unrecognised value.
    """
    if _strict_override is not None:
        return _strict_override
    return _ops.env_flag(STRICT_ENV_VAR)


def _warn_on_bad_environment() -> None:
    """At import: a ``FLASH_ATTENTION_SM75_STRICT`` value that is not understood warns at once
    (``RuntimeWarning``); :func:`is_strict` raises the same ``ValueError`` when a call would fall
    back, so a misspelt value never reads as off."""
    try:
        is_strict()
    except ValueError as e:
        warnings.warn(f"{e}; calls that would fall back raise this error", RuntimeWarning,
                      stacklevel=3)


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Context manager that turns strict mode on (or off) and restores the previous state.

    Parameters
    ----------
    enabled : bool, optional
        Default ``True``: inside the block unsupported calls of
        :func:`scaled_dot_product_attention` raise ``ValueError(reason)``. ``False`` forces the
        fallback even if ``FLASH_ATTENTION_SM75_STRICT=1``.

    Raises
    ------
    ValueError
        If ``enabled`` is not a bool.

    Notes
    -----
    The state is process-wide (not per thread).

    Examples
    --------
    >>> with flash_attention_sm75.strict():
    ...     out = flash_attention_sm75.scaled_dot_product_attention(q, k, v)
    """
    global _strict_override
    if not isinstance(enabled, bool):
        raise ValueError(f"flash_attention_sm75.strict: enabled must be a bool, got {enabled!r}")
    previous = _strict_override
    set_strict(enabled)
    try:
        yield
    finally:
        _strict_override = previous


def why_not_supported(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Optional[str]:
    """Why :func:`scaled_dot_product_attention` would not use the FlashAttention kernel.

    Takes the arguments of :func:`scaled_dot_product_attention` and reads only their metadata
    (shape, dtype, device, strides, ``requires_grad``), except a mask: once everything else
    passes, ``attn_mask``'s values are classified (a few element-wise device ops and one host
    synchronisation at every call: the wrapper keeps no classification, since a caller's mask
    may be refilled in place through ``.data`` or a NumPy view, which no version counter sees;
    while torch.compile traces or a CUDA graph captures no mask is read and the reason says so).

    Parameters
    ----------
    query : torch.Tensor
        Query, ``(batch, num_heads, seqlen_q, head_dim)`` for the kernel path.
    key : torch.Tensor
        Key, ``(batch, num_heads_k, seqlen_k, head_dim)`` for the kernel path.
    value : torch.Tensor
        Value, same shape as ``key`` for the kernel path.
    attn_mask : torch.Tensor, optional
        Default ``None``. Boolean (True = attend) or additive (float32 or the query's dtype),
        2- to 4-D, broadcast to ``(batch, num_heads, seqlen_q, seqlen_k)`` as torch does. A
        mask that is exactly a per-batch-row key range (``leftpad_k[b] <= j < seqused_k[b]``),
        optionally AND a bottom-right causal diagonal (key-padding masks, all-True / all-zero
        masks; found by reading the mask once per call) runs as key ranges,
        which skip the hidden keys' tiles; any other mask, and every mask while torch.compile
        traces or a CUDA graph captures, is read by the kernel itself as an additive bias
        (through its strides, never expanded). A float mask that requires grad (a learned
        position bias, e.g. Swin's) is always read as a bias and gets its gradient (the
        backward's dS summed over its broadcast dimensions). Falls back: a mask with
        ``is_causal=True`` (torch raises), and with a backward the bias's limits (head_dim
        above 128).
    dropout_p : float, optional
        Default ``0.0``. Attention dropout, applied whenever ``dropout_p > 0`` (in training and
        in eval, as torch's SDPA): run by the kernel (torch's semantics: keep with probability
        ``1 - dropout_p``, scale ``1 / (1 - dropout_p)``; the mask from torch's default CUDA
        generator, so ``torch.manual_seed`` reproduces it, though not torch's own draws). Falls
        back: a value outside ``[0, 1)``, a mask the kernels cannot read with a backward (a
        dropout call is decided as if a gradient flows, so that a reentrant checkpoint's
        recompute takes the same path), and dropout while torch.compile traces with
        ``torch._functorch.config.activation_memory_budget < 1``.
    is_causal : bool, optional
        Default ``False``. Supported either way (top-left alignment, as torch).
    scale : float, optional
        Default ``None`` (``1 / sqrt(head_dim)``). A value outside [1.18e-38, 1.07e26] (the
        range in which no float32 score can overflow) makes the call fall back.
    enable_gqa : bool, optional
        Default ``False``. Needed (as in torch) when ``num_heads != num_heads_k``.

    Returns
    -------
    str or None
        ``None`` if the kernel can run this call, otherwise a human-readable reason (the first
        one found), e.g. ``"query must be float16 (SM75 tensor cores have no bf16/fp32 MMA), got
        torch.float32"``.

    Notes
    -----
    Requirements for the kernel path: the compiled extension is importable; query, key and
    value pass the rulebook (``flash_attention_sm75._rules``: dense (strided) 4-D float16 CUDA
    tensors on one GPU of compute capability >= 7.5, one ``head_dim`` that is a multiple of 8
    from 8 to 256, key and
    value of the same shape, equal batch sizes (no broadcasting), ``num_heads % num_heads_k ==
    0``, last dimension contiguous, data pointers 16-byte aligned, other strides divisible by 8
    elements where that dimension has more than one entry, ``scale`` None or finite within [1.18e-38, 1.07e26]); and the wrapper's own rules:
    ``attn_mask`` None or a mask as above; ``dropout_p`` in ``[0, 1)``; ``is_causal`` a
    bool; ``scale`` a Python float or int; ``enable_gqa=True`` when ``num_heads !=
    num_heads_k``; no forward-mode AD tangent on any input; no ``torch.func`` transform
    (``grad``, ``vjp``, ``jacrev``, ``vmap``) active.

    Under ``torch.compile`` the compute-capability and data-pointer alignment checks are skipped
    (not traceable); the C++ op still checks both at run time and raises instead of falling back.
    Strides, shapes, dtypes and devices are checked as in eager mode.
    """
    reason = _metadata_reason(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa)
    if reason is None and attn_mask is not None and not _zero_size(query, key, value):
        info, reason = _mask_plan(query, key, attn_mask)
        if info is None:
            reason = _bias_reason(query, key, value, attn_mask, reason, dropout_p, scale)
    return reason


def _bias_reason(query, key, value, attn_mask, plan_reason: str,
                 dropout_p: float = 0.0, scale: Optional[float] = None) -> Optional[str]:
    """None when the kernel reads ``attn_mask`` itself as its ``attn_bias`` (a mask that is
    not a key range, or one not read on the host: torch.compile, CUDA-graph capture), else why
    not (with why it is no key range either). With dropout the backward's limits apply even
    without a gradient (``_rules.backward_may_follow``)."""
    problem = _rules.attn_bias_problem(
        attn_mask, query, key.shape[2], layout="bhsd", name="attn_mask",
        backward=_rules.backward_may_follow(query, key, value, dropout_p=dropout_p),
        softmax_scale=scale, scale_name="scale")
    if problem is None:
        return None
    return f"{plan_reason}; and the kernel cannot read it as a bias: {problem}"


_TENSOR_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__


def _defines_its_own_sdpa(t) -> bool:
    """A tensor subclass with its own ``__torch_function__``, to which torch's SDPA hands the
    call: ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left`` / ``causal_lower_right``,
    whose storage is not the mask) or a user's. (``nn.Parameter`` and ``DTensor`` disable it;
    nested tensors, which have one, are the rulebook's: it names them.)"""
    if type(t) is torch.Tensor or not isinstance(t, torch.Tensor) or t.is_nested:
        return False
    tf = type(t).__torch_function__
    tf = getattr(tf, "__func__", tf)
    return tf is not _TENSOR_TORCH_FUNCTION and tf is not torch._C._disabled_torch_function_impl


def _subclass_reason(query, key, value, attn_mask) -> Optional[str]:
    for name, t in zip(("query", "key", "value", "attn_mask"), (query, key, value, attn_mask)):
        if _defines_its_own_sdpa(t):
            return (f"{name} is a {type(t).__module__}.{type(t).__name__}, a tensor subclass that "
                    f"defines what SDPA computes for it (torch hands it the call)")
    return None


def _metadata_reason(query, key, value, attn_mask, dropout_p, is_causal, scale,
                     enable_gqa) -> Optional[str]:
    """Everything :func:`why_not_supported` checks except the mask's values: the wrapper's own
    rules (torch's SDPA arguments), then the rulebook (``_rules``), then the mask's metadata and
    the autograd mode. Straight-line checks: the common kernel-path call costs a few us."""
    if not _ops.EXTENSION_AVAILABLE:
        return f"the compiled extension flash_attention_sm75._C is not available ({_ops.EXTENSION_ERROR})"
    reason = _subclass_reason(query, key, value, attn_mask)
    if reason is not None:
        return reason
    if type(is_causal) is not bool:
        return f"is_causal is a {_rules.type_name(is_causal)}; a bool is required (torch raises)"
    if type(enable_gqa) is not bool:
        return f"enable_gqa is a {_rules.type_name(enable_gqa)}; a bool is required (torch raises)"
    if dropout_p != 0.0 and (isinstance(dropout_p, bool)
                             or not isinstance(dropout_p, numbers.Real)):
        return f"dropout_p is a {_rules.type_name(dropout_p)}; a Python float is required"
    if type(dropout_p) is not float:
        dropout_p = float(dropout_p)
    if scale is not None and type(scale) is not float and (
            not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        return f"scale is a {_rules.type_name(scale)}; a Python float is required"
    reason = _rules.not_supported_reason(query, key, value, scale, layout="bhsd",
                                         devices=(_KERNEL_DEVICE_TYPE,), names=_NAMES,
                                         dropout_p=dropout_p)
    if reason is not None:
        return reason
    if not enable_gqa and query.shape[1] != key.shape[1]:
        return (f"query has {query.shape[1]} heads and key/value have {key.shape[1]}, but "
                f"enable_gqa=False (torch raises an error for this)")
    if attn_mask is not None:
        reason = _mask_metadata_problem(query, key, attn_mask, is_causal)
        if reason is not None:
            return reason
    # torch's SDPA has batching rules and a jvp; the op has neither.
    return _ops.autograd_reason(query, key, value, any_transform=True,
                                attn_bias=attn_mask, bias_name="attn_mask")


def _mask_metadata_problem(query, key, attn_mask, is_causal) -> Optional[str]:
    """Why ``attn_mask`` cannot reach the kernel, from its metadata alone, or None."""
    if not isinstance(attn_mask, torch.Tensor):
        return f"attn_mask is a {type(attn_mask).__name__}, not a torch.Tensor"
    if is_causal:
        return "attn_mask and is_causal=True together (torch raises an error for this)"
    if attn_mask.layout != torch.strided or attn_mask.is_nested:
        return "attn_mask is not a strided (dense) tensor"
    if not (attn_mask.dtype in (torch.bool, torch.float32) or attn_mask.dtype == query.dtype):
        return (f"attn_mask dtype {attn_mask.dtype} is not bool, float32 or the query's "
                f"{query.dtype} (torch raises an error for this)")
    if attn_mask.device != query.device:
        return f"attn_mask is on {attn_mask.device}, query on {query.device}"
    if not 2 <= attn_mask.dim() <= 4:
        # torch 2.11's SDPA rejects a 1-D mask in its default dispatch (IndexError) but its math
        # backend, when forced (sdpa_kernel), broadcasts one: torch decides either way.
        return f"attn_mask is {attn_mask.dim()}-D; 2- to 4-D masks broadcast to (B, H, Sq, Sk)"
    # (== comparisons: under torch.compile(dynamic=True) `n in (1, SymInt)` is False for an
    # equal size)
    if attn_mask.dim() >= 3 and attn_mask.shape[-3] != 1 \
            and attn_mask.shape[-3] != query.shape[1]:
        # torch broadcasts the mask against the query's heads (also with enable_gqa): a head
        # count other than 1 or num_heads is an error there, never a per-kv-head mask.
        return (f"attn_mask has {attn_mask.shape[-3]} heads; it must broadcast to the query's "
                f"{query.shape[1]} (torch raises an error otherwise)")
    return None


def _mask_plan(query, key, attn_mask):
    """``(MaskInfo, None)`` when ``attn_mask`` is exactly a per-row key range (optionally AND a
    bottom-right causal diagonal), else ``(None, reason)``. One host synchronisation; refused
    (reason) while torch.compile traces or a CUDA graph captures."""
    if attn_mask.requires_grad and torch.is_grad_enabled():
        # As key ranges the mask would leave the graph: its gradient must come from the bias.
        return None, "attn_mask requires grad (the kernel reads it as a bias for its gradient)"
    b, _, s_q, _ = query.shape
    s_k = key.shape[2]
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if mask.shape[-1] != s_k:
        return None, f"attn_mask has {mask.shape[-1]} key columns, the keys are {s_k}"
    info, reason = _masks.classify_attention_mask(mask, b, s_q, s_k, query.dtype,
                                                  exact_empty_rows=True)
    if info is None:
        return None, f"attn_mask is not a per-row key range the kernel can run: {reason}"
    return info, None


def _zero_size(query, key, value) -> bool:
    """True for dense tensors whose attention output is empty or all zeros by the definition: a
    size of 0 anywhere but in the q/k head_dim (batch, heads, seqlen_q, seqlen_k, or the value
    head_dim). A zero q/k head_dim alone leaves a non-zero result (every score 0) for torch."""
    if not all(isinstance(t, torch.Tensor) and not t.is_nested and t.layout == torch.strided
               and t.dim() >= 2 for t in (query, key, value)):
        return False
    return 0 in query.shape[:-1] or 0 in key.shape[:-1] or 0 in value.shape


def _zero_kv_heads_message(query, key) -> str:
    return (f"flash_attention_sm75: key has 0 heads (shape {list(key.shape)}) but query has "
            f"{query.shape[-3]}; enable_gqa=True needs num_heads_k >= 1 dividing num_heads")


def _zero_size_attention(query, key, value, attn_mask, enable_gqa):
    """The SDPA of a :func:`_zero_size` call by the definition, softmax(q k^T + mask) v, with
    torch ops that are safe on zero sizes: the products over an empty key (or head_dim)
    dimension are exact zeros, so the result is the empty tensor or zeros, with torch's shape
    (batch dimensions broadcast, ``(..., seqlen_q, head_dim_v)``) and dtype, and autograd
    connected (zero gradients). Shapes torch would reject raise from the matmuls (RuntimeError).
    The scale, is_causal and dropout cannot change a zero result and are not applied."""
    # What torch's SDPA checks before any arithmetic (matmuls of zero-size tensors do not).
    if not (query.dtype == key.dtype == value.dtype and query.dtype.is_floating_point):
        raise RuntimeError(f"flash_attention_sm75: query, key and value must have the same "
                           f"floating-point dtype, got {query.dtype}, {key.dtype} and "
                           f"{value.dtype}")
    if not query.device == key.device == value.device:
        raise RuntimeError(f"flash_attention_sm75: query, key and value must be on one device, "
                           f"got {query.device}, {key.device} and {value.device}")
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        h = query.shape[-3]
        if key.shape[-3] == 0 or value.dim() < 3 or value.shape[-3] == 0:
            raise ValueError(_zero_kv_heads_message(query, key))
        if h % key.shape[-3] != 0 or h % value.shape[-3] != 0:
            raise RuntimeError(f"flash_attention_sm75: query heads ({h}) are not a multiple of "
                               f"key/value heads ({key.shape[-3]}, {value.shape[-3]})")
        key = key.repeat_interleave(h // key.shape[-3], dim=-3)
        value = value.repeat_interleave(h // value.shape[-3], dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = torch.where(attn_mask, scores, scores.new_full((), float("-inf")))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, *, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` on the SM75 FlashAttention kernel.

    Same signature (``scale`` and ``enable_gqa`` keyword-only) and semantics as torch's
    function: supported calls run the FlashAttention-2
    kernel, all others are passed unchanged to
    ``torch.nn.functional.scaled_dot_product_attention`` (or raise in strict mode). The reason of
    each fallback is logged at DEBUG level on the ``"flash_attention_sm75"`` logger; see
    :func:`why_not_supported` for the exact requirements.

    Parameters
    ----------
    query : torch.Tensor
        Query, shape ``(batch, num_heads, seqlen_q, head_dim)``. Kernel path: ``torch.float16``,
        CUDA (compute capability >= 7.5), ``head_dim`` a multiple of 8 in [8, 256], ``stride(-1) == 1``, 16-byte
        aligned, other strides divisible by 8 elements (where that dimension has more than one
        entry). Any other input torch accepts (3-D, 5-D,
        float32, bfloat16, CPU, ...) is handled by the fallback.
    key : torch.Tensor
        Key, shape ``(batch, num_heads_k, seqlen_k, head_dim)``; same requirements as ``query``.
    value : torch.Tensor
        Value, same shape as ``key`` on the kernel path; same requirements as ``query``.
    attn_mask : torch.Tensor, optional
        Default ``None``. Boolean (True = attend) or additive mask as in torch. Key-padding,
        all-True / all-zero and bottom-right causal masks run on the kernel as per-row key
        ranges; any other mask runs on the kernel as an additive bias that it reads in place
        (see :func:`why_not_supported` for what falls back). A query row that sees no key (all
        False, or all ``-inf``) gives 0 and zero gradients on every path (as torch's math backend
        does since torch 2.5; some of torch's other backends give NaN or an average of V there);
        a finite "dtype minimum" mask row is not empty and gives a finite result.
    dropout_p : float, optional
        Default ``0.0``. Dropout probability, applied as torch does (whenever > 0, also in eval
        mode), on the kernel (its own generator, seeded from torch's CUDA generator); a value
        outside [0, 1), and dropout under torch.compile with
        ``torch._functorch.config.activation_memory_budget < 1``, fall back.
    is_causal : bool, optional
        Default ``False``. If ``True``, a causal mask aligned to the **top-left** corner, as in
        torch: query ``i`` sees key ``j`` iff ``j <= i`` (see Notes).
    scale : float, optional
        Default ``None`` means ``1 / sqrt(head_dim)``. Kernel path for values in [1.18e-38,
        1.07e26]; other values (which torch accepts) use the fallback.
    enable_gqa : bool, optional
        Default ``False``. As in torch: if ``True``, ``num_heads`` may be a multiple of
        ``num_heads_k`` and query head ``i`` uses key/value head ``i // (num_heads //
        num_heads_k)``. With ``False`` and different head counts, torch's error is raised
        (strict mode: ``ValueError``).

    Returns
    -------
    torch.Tensor
        Attention output, shape ``(batch, num_heads, seqlen_q, head_dim_v)``, dtype of
        ``query``. On the kernel path it is a ``transpose(1, 2)`` view of a contiguous BSHD tensor
        (as with torch's memory-efficient backend). Zero-size inputs (a batch, head or sequence
        size of 0, any dtype and device) give the result of the definition without calling
        torch's SDPA (which crashes the process for some of them in torch 2.11): an empty tensor,
        or zeros where there are query rows but no keys (``seqlen_k == 0``), with gradients (zeros)
        flowing back to the inputs.

    Raises
    ------
    ValueError
        In strict mode, if the call cannot use the kernel; the message contains the reason.
        Also (any mode) for key/value with zero heads under a query with heads and
        ``enable_gqa=True``, which torch's SDPA does not reject (it crashes the process with a
        division by zero in torch 2.11). Also for an ``attn_mask`` on another device than
        ``query`` (torch's CPU backend reads a meta mask as if it held values).
    TypeError
        From torch's SDPA (fallback path) for a non-bool ``is_causal`` or ``enable_gqa``.
    RuntimeError
        Whatever torch's SDPA raises for invalid input on the fallback path (e.g. different head
        counts with ``enable_gqa=False``).

    Notes
    -----
    ``is_causal`` is top-left aligned, unlike FlashAttention's ``causal`` (bottom-right); they
    agree when ``seqlen_q == seqlen_k``. For ``seqlen_q = 3, seqlen_k = 5`` (1 = visible)::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0

    Algorithm: FlashAttention-2 (T. Dao, 2023, arXiv:2307.08691); FlashAttention (T. Dao et al.,
    2022, arXiv:2205.14135).
    """
    reason = _metadata_reason(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa)
    if reason is None:
        if attn_mask is None:
            out, _ = _ops.call_fwd(query, key, value, scale, is_causal, False,
                                   dropout_p=dropout_p, bhsd_inputs=True)
            return out.transpose(1, 2)
        if _zero_size(query, key, value):  # no keys or no rows: nothing for the mask to select
            return _zero_size_attention(query, key, value, attn_mask, enable_gqa)
        info, reason = _mask_plan(query, key, attn_mask)
        if info is None:
            reason = _bias_reason(query, key, value, attn_mask, reason, dropout_p, scale)
            if reason is None:  # the kernel reads the mask (broadcast, in place)
                out, _ = _ops.call_fwd(query, key, value, scale, False, False,
                                       attn_bias=attn_mask, dropout_p=dropout_p,
                                       bhsd_inputs=True)
                return out.transpose(1, 2)
    if reason is None:
        if info.kv_len != key.shape[2]:
            key, value = key[:, :, :info.kv_len], value[:, :, :info.kv_len]
        out, _ = _ops.call_fwd(query, key, value, scale, info.causal, True,
                               leftpad_k=info.leftpad_k, seqused_k=info.seqused_k,
                               dropout_p=dropout_p, bhsd_inputs=True)
        return out.transpose(1, 2)
    if is_strict():
        raise ValueError(f"flash_attention_sm75: cannot run scaled_dot_product_attention on the "
                         f"FlashAttention kernel (strict mode): {reason}")
    if _subclass_reason(query, key, value, attn_mask) is not None:
        # The subclass's own SDPA, with the call as it is (a CausalBias builds its mask on the
        # query's device, or picks a causal kernel).
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if (enable_gqa and isinstance(key, torch.Tensor) and key.dim() >= 3 and key.shape[-3] == 0
            and isinstance(query, torch.Tensor) and query.dim() >= 3 and query.shape[-3] != 0):
        raise ValueError(_zero_kv_heads_message(query, key))
    if (isinstance(attn_mask, torch.Tensor) and isinstance(query, torch.Tensor)
            and attn_mask.device != query.device and attn_mask.dim() > 0):
        # torch's CPU backend reads a meta mask as if it held values; its other backends raise
        # an error that does not name attn_mask. (A 0-dim CPU tensor combines with any device
        # in torch's arithmetic: torch decides.)
        raise ValueError(f"flash_attention_sm75: attn_mask is on {attn_mask.device} but query is "
                         f"on {query.device}; attn_mask must be on the query's device")
    if (_zero_size(query, key, value) and type(is_causal) is bool
            and isinstance(dropout_p, (int, float)) and isinstance(scale, (int, float, type(None)))
            and isinstance(attn_mask, (torch.Tensor, type(None)))):
        # torch's SDPA crashes the process (SIGFPE) for some of these (0 heads on the CPU).
        # (Arguments of the wrong type go to torch, whose argument parser raises TypeError.)
        return _zero_size_attention(query, key, value, attn_mask, enable_gqa)
    if not torch.compiler.is_compiling():
        logger.debug("scaled_dot_product_attention falls back to torch: %s", reason)
    return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's SDPA with the call's arguments, except that a query row whose keys are all masked
    gives 0 (the kernel's answer, and the definition's limit) instead of what torch's backend
    makes of it (NaN or an average of V on some backends; and NaN in every key's gradient
    through such a row): those rows are run unmasked, then zeroed, so their gradients are 0.
    Every other row is torch's result bit for bit (the mask's other rows are unchanged). The
    rows are found and unmasked on the device (``_masks.without_empty_rows``, shared with the
    transformers integration's fallbacks). With ``is_causal=True`` and a mask, torch gets the
    call as it is (it raises on most backends)."""
    # is_causal with a mask: torch's call as it is (most of its backends raise; which one it
    # picks depends on the mask, which must not be swapped for a copy here).
    split = (_masks.without_empty_rows(attn_mask)
             if isinstance(query, torch.Tensor) and is_causal is not True else None)
    if split is None or split[1].dim() > query.dim():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    visible, empty = split
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible,
                                         dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.masked_fill(empty, 0.0)
