"""Hugging Face transformers integration.

Two ways to run transformers models on the SM75 FlashAttention kernel:

1. **Registered attention implementation.** Importing this module registers
   :func:`flash_attention_sm75_forward` with ``transformers.AttentionInterface`` (and the
   ``sdpa`` mask builder with ``AttentionMaskInterface``) under two names,
   ``"sm75_attention"`` (recommended: transformers calls it exactly as it calls ``"sdpa"``) and
   ``"flash_attention_sm75"`` (transformers treats names containing "flash" as FlashAttention
   flavours; see :func:`register` for what that changes), so::

       AutoModelForCausalLM.from_pretrained(path, attn_implementation="sm75_attention")
       model.set_attn_implementation("sm75_attention")

   work for every model that dispatches through ``ALL_ATTENTION_FUNCTIONS``.

2. **Patch.** :func:`apply_patch` replaces the ``"sdpa"`` entry of transformers' global attention
   mapping, so Llama, Qwen2, Qwen3 and Mistral models running with ``attn_implementation="sdpa"``
   use the kernel, whether they were loaded before or after the patch (models look the function
   up at every forward). :func:`remove_patch` restores the previous entry; the handle returned by
   :func:`apply_patch` undoes just that call (``handle.remove()``, or as a context manager), so
   nested patches restore exactly the state before them (see :class:`PatchHandle`).

The attention function follows transformers' ``sdpa_attention_forward``: BHSD ``query``,
``key``, ``value``; ``attention_mask`` ``None``, a boolean ``(B, 1, Sq, Sk)`` mask (True = attend)
or an additive float mask; returns ``(output (B, Sq, H, D), None)``. GQA runs natively (K/V with
fewer heads go straight to the op, no ``repeat_kv``).

Masks are classified (:func:`classify_attention_mask`): a mask that is exactly "key range per
batch row" (``leftpad_k[b] <= j < seqused_k[b]``), optionally AND a causal diagonal, runs as key
ranges (the kernel skips the hidden keys' tiles), which covers no mask, causal, left/right
padding, chunked prefill and decode with a cache; with the layer's ``sliding_window`` also that
pattern limited to the last ``sliding_window`` keys (the kernel's window). Any other mask
(arbitrary 4-D masks, packed-sequence/document masks, windowed masks without their
``sliding_window``, float masks with other values), and every mask while torch.compile traces or
a CUDA graph captures (a static cache's decode step under ``mode="reduce-overhead"``), is read
by the kernel itself as its ``attn_bias`` (bool or additive, broadcast over heads in place), as
the rulebook's bias rule allows (with a backward: head_dim up to 128, no softcap). Any
unsupported input (CPU, fp32/bf16, head_dim not a multiple of 8 in [8, 256],
``output_attentions``, a mask the bias rule refuses; on the patched ``"sdpa"`` entry also a
keyword argument outside the allow-list, which the registered names refuse)
calls transformers' own ``sdpa_attention_forward`` with the original arguments (calls with Gemma
2's ``softcap``, which runs on the kernel, fall back to that function with the soft-cap applied,
since torch SDPA has none), and the reason is logged at DEBUG
on the ``"flash_attention_sm75"`` logger and counted in :func:`get_stats`. Packed sequences
(``cu_seq_lens_q/k`` or restarting ``position_ids``, as transformers' FlashAttention path reads
them) run on the varlen op, each document attending to itself, in one call, also with the
per-document mask transformers builds for them without a cache (``use_cache=False``, gradient
checkpointing: recognised by one comparison per mask object); where the kernel cannot run them
(the reasons above, an ``attention_mask`` that says more than the documents, packed
``position_ids`` while tracing or capturing) they run on that fallback with a per-document mask.
While ``torch.compile`` traces or a CUDA graph captures, nothing is read on the host: a mask
goes to the kernel as its bias, read on the device at every replay.
The decision (rules, packed-sequence test, plan of the mask) is taken by the first layer of a
forward and remembered for the others, keyed on every input it reads (``_decision_key``: the mask
object and its version counter, the call's shapes, strides, dtypes, devices, arguments and the
settings); never while tracing or capturing, and never for inference-tensor masks.
On every fallback, as on the kernel path, a query row whose keys are all masked (bool all
False, float all ``-inf``; also a token in no document of a packed call) gives 0 and passes no
gradient, never NaN or an average of V, whatever torch's SDPA backend does with such a row (NaN
or an average on some backends, NaN gradients to every key through it; an average where
transformers turns a boolean mask into a finite one for a ``position_bias``): the fallback runs
those rows unmasked and zeroes them (device ops only, no host read), and every other row is the
fallback's result bit for bit. A finite "dtype minimum" row is not empty: it keeps
transformers' finite result.
Inputs that require grad (training) run on the kernel, whose backward is registered with
autograd.
"""
from __future__ import annotations

import collections.abc
import functools
import logging
import math
import numbers
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad

from .. import _masks, _ops, _packing, _rules
from ..sdpa import is_strict

__all__ = [
    "ATTENTION_NAME",
    "ATTENTION_NAME_PLAIN",
    "DEFAULT_PATCH_MODEL_TYPES",
    "MaskInfo",
    "PatchHandle",
    "apply_patch",
    "classify_attention_mask",
    "configure",
    "flash_attention_sm75_forward",
    "get_stats",
    "is_patched",
    "register",
    "remove_patch",
    "reset_stats",
]

logger = logging.getLogger("flash_attention_sm75")

ATTENTION_NAME = "flash_attention_sm75"
"""Name under which the attention function is registered with transformers; transformers treats
names containing "flash" as FlashAttention flavours (see :func:`register`)."""

ATTENTION_NAME_PLAIN = "sm75_attention"
"""The same attention function under a name transformers treats like any custom implementation
(recommended; see :func:`register`)."""

ATTENTION_NAMES = (ATTENTION_NAME, ATTENTION_NAME_PLAIN)

DEFAULT_PATCH_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""``config.model_type`` values that :func:`apply_patch` routes to the kernel by default."""

# ----------------------------------------------------------------------------------------------
# Settings and statistics
# ----------------------------------------------------------------------------------------------

_SETTINGS: Dict[str, bool] = {
    # q_len == 1 (decode with a KV cache) runs on the kernel.
    "decode_on_kernel": True,
    # Decode masks: False reads them in the decode kernel (its bias), True classifies them into
    # key ranges on the host first (configure's docstring).
    "classify_decode_masks": False,
    # Testing aid: run the op's CPU reference implementation for CPU fp16 tensors
    # instead of falling back (lets the whole classification -> op path run without a GPU).
    "allow_cpu_reference": False,
}

_STATS_LOCK = threading.Lock()
_STATS: Dict[str, Any] = {}
# A reason names the call's shapes, so a fallback at every decode step of a long generate() (or
# of a server's lifetime) is a new reason each time: past this many distinct reasons the rest are
# counted under one key instead of growing the counter without bound.
STATS_MAX_REASONS = 256
OTHER_REASONS = (f"(other reasons: more than {STATS_MAX_REASONS} distinct ones; "
                 "logging at DEBUG names each)")


def reset_stats() -> None:
    """Zero the counters returned by :func:`get_stats`."""
    with _STATS_LOCK:
        _STATS.clear()
        _STATS.update(kernel=0, kernel_prefill=0, kernel_decode=0, fallback=0,
                      reasons=collections.Counter())


reset_stats()


def get_stats() -> Dict[str, Any]:
    """Return a snapshot of how many attention calls ran on the kernel and on the fallback.

    Returns
    -------
    dict
        ``{"kernel": n, "kernel_prefill": n, "kernel_decode": n, "fallback": n,
        "reasons": {reason: n}}``. One count per attention call, i.e. per layer and forward.
        ``kernel_decode`` counts calls with ``q_len == 1``. ``reasons`` keeps at most
        ``STATS_MAX_REASONS`` (256) distinct reasons; further new ones are counted under
        ``OTHER_REASONS``. Calls traced by ``torch.compile``
        are not counted (a lock and a counter on the traced path would break the graph), nor
        are replays of a compiled graph or a CUDA graph, which run no Python.

    Examples
    --------
    >>> reset_stats(); model(input_ids); assert get_stats()["kernel"] > 0
    """
    with _STATS_LOCK:
        snap = dict(_STATS)
        snap["reasons"] = dict(_STATS["reasons"])
    return snap


def _count_kernel(q_len: int) -> None:
    if torch.compiler.is_compiling():  # no lock or Counter on a traced path (see get_stats)
        return
    with _STATS_LOCK:
        _STATS["kernel"] += 1
        _STATS["kernel_decode" if q_len == 1 else "kernel_prefill"] += 1


def _count_fallback(reason: str) -> None:
    if torch.compiler.is_compiling():
        return
    with _STATS_LOCK:
        _STATS["fallback"] += 1
        reasons = _STATS["reasons"]
        if reason not in reasons and len(reasons) >= STATS_MAX_REASONS:
            reason = OTHER_REASONS
        reasons[reason] += 1
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("transformers attention falls back to torch SDPA: %s", reason)


def configure(*, decode_on_kernel: Optional[bool] = None,
              allow_cpu_reference: Optional[bool] = None,
              classify_decode_masks: Optional[bool] = None) -> Dict[str, bool]:
    """Change the integration's settings; arguments left as ``None`` are unchanged.

    Parameters
    ----------
    decode_on_kernel : bool, optional
        Run ``q_len == 1`` calls (decode with a KV cache) on the kernel (default ``True``).
        ``False`` sends every decode step to torch SDPA.
    classify_decode_masks : bool, optional
        Default ``False``: a decode step's mask goes to the decode kernel as its bias, never
        read on the host (no host synchronisation per forward; the kernel skips the key blocks
        the mask hides from every row). ``True``: it is classified into per-row key ranges on
        the host first, as prefill masks are (one host synchronisation per forward; the plain
        decode kernel then reads only the range's keys, 2-7 us per call less on an H200).
    allow_cpu_reference : bool, optional
        Run the op's CPU reference implementation for CPU fp16 inputs instead of falling
        back (default ``False``). A testing aid: it is slow, but exercises mask classification and
        the op call without a GPU.

    Returns
    -------
    dict
        The previous settings, which can be passed back as ``configure(**previous)``.

    Raises
    ------
    ValueError
        If a setting is given as anything but ``True``, ``False`` or ``None`` (nothing changes).
    """
    for name, value in (("decode_on_kernel", decode_on_kernel),
                        ("allow_cpu_reference", allow_cpu_reference),
                        ("classify_decode_masks", classify_decode_masks)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"flash_attention_sm75: configure({name}=...) must be True, False or "
                             f"None, got {_rules.type_name(value)} {value!r}")
    previous = dict(_SETTINGS)
    if decode_on_kernel is not None:
        _SETTINGS["decode_on_kernel"] = decode_on_kernel
    if allow_cpu_reference is not None:
        _SETTINGS["allow_cpu_reference"] = allow_cpu_reference
    if classify_decode_masks is not None:
        _SETTINGS["classify_decode_masks"] = classify_decode_masks
    return previous


# ----------------------------------------------------------------------------------------------
# Mask classification (flash_attention_sm75._masks, shared with the SDPA wrapper)
# ----------------------------------------------------------------------------------------------

MaskInfo = _masks.MaskInfo
classify_attention_mask = _masks.classify_attention_mask
_Classification = _masks._Classification
_host_reads_allowed = _masks.host_reads_allowed
_POSITION_IDS_CACHE = _masks.POSITION_IDS_CACHE


def _clear_classification_cache() -> None:
    """Forget every cached classification and every remembered decision (tests, benchmarks)."""
    _masks.clear_caches()
    _DOCUMENT_MASK_CACHE.clear()
    _clear_decisions()


# ----------------------------------------------------------------------------------------------
# The attention function
# ----------------------------------------------------------------------------------------------

_SDPA_POSITIONAL = ("dropout", "scaling", "is_causal", "position_bias")

# ---- The keyword arguments transformers passes, and how each is honoured (an allow-list) ----
# Packed (padding-free) inputs: token t of the flattened batch belongs to the document
# i with cu_seq_lens[i] <= t < cu_seq_lens[i + 1]; max_length_* are only size hints.
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Change the result, and neither the kernel nor torch SDPA (the fallback) applies them: the
# registered implementation raises for them rather than return the unmodified attention.
_REFUSED_KWARGS = ("s_aux", "sinks")
# Model-level arguments that reach attention functions through **kwargs without entering the
# attention itself (transformers 5.x call sites).
_INERT_KWARGS = frozenset({
    "use_cache", "output_hidden_states", "return_dict", "cache_position", "past_key_values",
    "past_key_value", "position_embeddings", "layer_idx", "output_router_logits",
    "encoder_hidden_states",
    # DataCollatorWithFlattening(return_seq_idx=True), which sentence-transformers sets: a
    # per-token sequence index for Mamba-style layers; attention reads cu_seq_lens_*.
    "seq_idx",
    # Trainer's loss normalisation (a token count), which TransformersKwargs carries into every
    # attention call of a model whose loss accepts it.
    "num_items_in_batch",
    # Tokenizer / processor outputs that a decoder's forward passes on through **kwargs when it
    # does not read them (a tokenizer that returns token_type_ids, processors called with
    # return_mm_token_type_ids=True); the models that use them build their masks from them.
    "token_type_ids", "mm_token_type_ids",
})
# Continuous batching (generate_batch) passes its paged cache's bookkeeping through the model's
# **kwargs into every attention call. The cache's update has used them before attention runs,
# so query / key / value are what stock SDPA reads; these calls fall back (a per-document mask
# over cu_seq_lens_*; compared with stock "sdpa" generation in test_transformers_contract.py).
# A block_table that is set (keys in pages) is not among them: refused, as any other.
_CB_KWARGS = frozenset({"read_index", "write_index", "logits_indices", "logits_processor_args"})
_HANDLED_KWARGS = (frozenset(_SDPA_POSITIONAL) | frozenset(_PACKED_KWARGS)
                   | frozenset(_REFUSED_KWARGS) | _INERT_KWARGS
                   | {"output_attentions", "sliding_window", "position_ids", "deterministic",
                      "softcap"})


def _bind_sdpa_args(args: tuple, kwargs: dict) -> Dict[str, Any]:
    """Arguments after ``attention_mask``, named as in ``sdpa_attention_forward``."""
    bound = {"dropout": 0.0, "scaling": None, "is_causal": None, "position_bias": None}
    for name, value in zip(_SDPA_POSITIONAL, args):
        bound[name] = value
    for name in _SDPA_POSITIONAL:
        if name in kwargs:
            bound[name] = kwargs[name]
    return bound


def _unknown_kwargs(kwargs: dict) -> list:
    """Keyword arguments outside the allow-list that are set (``None`` means "not used")."""
    if _HANDLED_KWARGS.issuperset(kwargs):  # the usual call, one set operation
        return []
    return sorted(name for name, value in kwargs.items()
                  if name not in _HANDLED_KWARGS and value is not None)


def _position_bias_is_zero(position_bias: torch.Tensor, query: torch.Tensor) -> bool:
    """T5's cross-attention passes a bias of zeros, (1, H, q_len, kv_len): nothing to add. Not
    one that requires grad (a learned bias that is zero now still needs its gradient)."""
    if not (isinstance(position_bias, torch.Tensor) and position_bias.device == query.device
            and _host_reads_allowed(position_bias)):
        return False
    if position_bias.requires_grad and torch.is_grad_enabled():
        return False
    return not bool(position_bias.any())  # one host read


def _softcap_kwarg(kwargs: dict) -> float:
    """transformers' ``softcap`` (Gemma 2 passes ``config.attn_logit_softcapping``) as the op's
    float: ``None`` is off (0.0); otherwise a finite number > 0 (transformers' eager attention
    divides by it, and reads a negative value as its absolute value while flash-attn reads it
    as off: both that and 0 are refused rather than guessed)."""
    cap = kwargs.get("softcap")
    if cap is None:
        return 0.0
    if (isinstance(cap, bool) or not isinstance(cap, numbers.Real)
            or not 0 < cap < math.inf):
        shown = (f"a tensor of shape {list(cap.shape)}" if isinstance(cap, torch.Tensor)
                 else repr(cap))
        raise ValueError(f"flash_attention_sm75: softcap must be None (off) or a finite number "
                         f"> 0 (attention logit soft-capping), got {shown}")
    return float(cap)


def _softcap_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          is_causal=None, position_bias=None, softcap=None, **kwargs):
    """The fallback of calls with ``softcap``, which torch SDPA cannot apply: transformers'
    ``sdpa_attention_forward`` (the same arguments, mask conventions and ``(B, q_len, H, D)``
    result) with the scaled scores soft-capped, ``softcap * tanh(s / softcap)``, before the mask,
    as Gemma 2's eager attention does. Computed in float32 with the ``(q_len, kv_len)`` scores
    materialized. Rows that see no key give 0 through :func:`_call_fallback`, which calls this
    function with those rows unmasked (a NaN row here would also give NaN gradients). Other
    keyword arguments are ignored, as ``sdpa_attention_forward`` ignores them."""
    b, h, q_len, d = query.shape
    kv_len = key.shape[2]
    groups = h // key.shape[1] if key.shape[1] else 1
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scale = d ** -0.5 if scaling is None else float(scaling)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias.float()
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if attention_mask is None:
        if is_causal and q_len > 1:  # torch SDPA's is_causal: top-left aligned
            visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~visible, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask.float()
    probs = torch.softmax(scores, dim=-1)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _unsupported_reason(module, query, key, value, attention_mask, bound, kwargs,
                        softcap: float = 0.0) -> Optional[str]:
    """The integration's own rules (transformers' arguments, an allow-list), then the rulebook
    (``_rules``), then the module's head grouping and the autograd mode. None: the kernel can
    run the call once the mask is planned (:func:`_plan`)."""
    unknown = _unknown_kwargs(kwargs)
    if unknown:
        return (f"keyword argument(s) {unknown} are not understood by the kernel path (they "
                f"could change the result)")
    if kwargs.get("output_attentions", False):
        return "output_attentions=True"
    for name in _REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name} is not supported by the kernel"
    if kwargs.get("deterministic") and not _ops.is_deterministic_backward():
        return ("deterministic=True while FLASH_SM75_BWD_DQ=atomic makes the backward "
                "non-deterministic")
    dropout = bound["dropout"]
    if dropout is None:
        dropout = 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        return f"dropout={dropout!r} is not a real number"
    if torch.jit.is_tracing():
        return "torch.jit tracing"
    if not _ops.EXTENSION_AVAILABLE:
        return f"the compiled extension is not available ({_ops.EXTENSION_ERROR})"
    # CPU tensors run the op's reference implementation only as a testing aid; misaligned
    # tensors are copied by _bshd_for_kernel, so the alignment rule is not a reason here.
    devices = ("cuda", "cpu") if _SETTINGS["allow_cpu_reference"] else ("cuda",)
    reason = _rules.not_supported_reason(query, key, value, bound["scaling"], layout="bhsd",
                                         devices=devices, check_alignment=False,
                                         names=("query", "key", "value", "scaling"),
                                         softcap=softcap, dropout_p=float(dropout))
    if reason is not None:
        return reason
    if bound["position_bias"] is not None and not _position_bias_is_zero(bound["position_bias"],
                                                                          query):
        # (Unpacked calls take _position_bias_attention before these rules.)
        return "position_bias with packed sequences is not supported by the kernel"
    h, h_k = query.shape[1], key.shape[1]
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and groups >= 1 and h != h_k * groups:
        return (f"module.num_key_value_groups={groups} does not match query heads {h} / key "
                f"heads {h_k}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            return f"attention_mask of type {type(attention_mask).__name__}"
        if attention_mask.device != query.device:
            return "attention_mask is on another device"
    return _ops.autograd_reason(query, key, value, any_transform=True,
                                attn_bias=attention_mask if isinstance(attention_mask, torch.Tensor)
                                else None, bias_name="attention_mask")


def _plan(module, query, key, attention_mask, is_causal, sliding_window=None,
          flash_semantics=False, value=None, softcap: float = 0.0,
          dropout: float = 0.0, scaling: Optional[float] = None) -> "_Classification":
    """Map the call onto the op (``MaskInfo``) or return the reason to fall back.

    A mask that is no key range (or one not read on the host: torch.compile tracing, CUDA-graph
    capture) goes to the kernel as its ``attn_bias`` (``kind == "bias"``: the op reads it in
    place, broadcast over heads) when the rulebook's bias rule allows it (``value``, ``softcap``:
    the backward's limits when a gradient will flow).

    ``sliding_window`` (transformers' argument for sliding layers) is a hint for recognising a
    windowed mask; without a mask and with ``flash_semantics`` it is applied as transformers'
    FlashAttention path applies it: ``window_size = (sliding_window - 1, sliding_window - 1)``
    (causal: the right side is the diagonal), bottom-right aligned on all keys.
    """
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if q_len == 1 and not _SETTINGS["decode_on_kernel"]:
        return None, "decode (q_len == 1) is configured to use torch SDPA"
    if not _is_window(sliding_window):
        sliding_window = None  # not a window (the flash path rejects it: _window_kwarg)
    if attention_mask is None and flash_semantics and sliding_window is not None \
            and kv_len > sliding_window:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        causal = bool(q_len > 1 and is_causal)
        window = (sliding_window - 1, sliding_window - 1)
        return MaskInfo(causal, kv_len, None, None, "window" if not causal else "causal+window",
                        window), None
    if attention_mask is None:
        # transformers' rule (sdpa_attention_forward): causal only for q_len > 1 without a mask,
        # torch SDPA's top-left alignment. With kv_len > q_len (prefill into an empty static
        # cache) SDPA slices the keys to q_len, where top-left == bottom-right.
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        causal = bool(q_len > 1 and is_causal)
        if not causal:
            return MaskInfo(False, kv_len, None, None, "none"), None
        if kv_len < q_len:
            return None, f"causal without a mask and kv_len {kv_len} < q_len {q_len}"
        return MaskInfo(True, q_len, None, None, "causal"), None
    # A learned mask: as key ranges it would leave the graph; its gradient comes from the
    # kernel's bias. Decode: the mask goes to the decode kernel as its bias, never read on the
    # host. Classifying it into key ranges cost a host synchronisation per forward (H200:
    # 0.2-0.9 ms with the sync, and the CPU stops queueing work); reading it costs the kernel
    # 2-7 us per call, and it skips the 32-key steps the mask hides from every row (left
    # padding, a static cache's unfilled slots) as key ranges would.
    learned = isinstance(attention_mask, torch.Tensor) and attention_mask.requires_grad \
        and torch.is_grad_enabled()
    if learned or (q_len == 1 and isinstance(attention_mask, torch.Tensor)
                   and not _SETTINGS["classify_decode_masks"]
                   and not _rules.backward_may_follow(query, key, value, dropout_p=dropout)):
        problem = _rules.attn_bias_problem(attention_mask, query, kv_len, layout="bhsd",
                                           softcap=softcap, name="attention_mask",
                                           softmax_scale=scaling, scale_name="scaling")
        if problem is None:
            return MaskInfo(False, kv_len, None, None, "bias"), None
        if learned:
            return None, f"attention_mask requires grad and the kernel cannot read it: {problem}"
    info, reason = classify_attention_mask(attention_mask, b, q_len, kv_len, query.dtype,
                                           sliding_window=sliding_window)
    if info is None and isinstance(attention_mask, torch.Tensor):
        problem = _rules.attn_bias_problem(attention_mask, query, kv_len, layout="bhsd",
                                           backward=_rules.backward_may_follow(
                                               query, key, value, dropout_p=dropout),
                                           softcap=softcap,
                                           name="attention_mask",
                                           softmax_scale=scaling, scale_name="scaling")
        if problem is None:  # (the plan holds no tensor: the mask is the call's own)
            return MaskInfo(False, kv_len, None, None, "bias"), None
        reason = f"{reason}; and the kernel cannot read it as a bias: {problem}"
    return info, reason


# ----------------------------------------------------------------------------------------------
# Packed sequences and sliding windows without a mask (FlashAttention semantics)
# ----------------------------------------------------------------------------------------------


def _is_causal(module, is_causal) -> bool:
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def _is_window(window) -> bool:
    """Whether transformers' ``sliding_window`` is a window: a positive int (not a bool)."""
    return isinstance(window, int) and not isinstance(window, bool) and window >= 1


def _window_kwarg(kwargs: dict) -> Optional[int]:
    """transformers' ``sliding_window``: a positive int or None (anything else raises)."""
    window = kwargs.get("sliding_window")
    if window is not None and not _is_window(window):
        raise ValueError(f"flash_attention_sm75: sliding_window must be a positive int or None, "
                         f"got {window!r}")
    return window


class _Packing(NamedTuple):
    """How a call packs documents into its (flattened) tokens.

    ``cu_q`` / ``cu_k``: int64 offsets on the query's device (``cu_seq_lens_q/k``, the batch
    rows concatenated), or ``pos``: the 1-D positions of one row (restarting ``position_ids``).
    ``max_q`` / ``max_k``: the longest document, a host int, where known without a host read
    (transformers' ``max_length_q/k``; for ``position_ids``, from the one cached host read),
    else None. ``cu_varlen``: the int32 offsets the varlen op takes, where known (position_ids:
    built on the device from the same read), else None (``cu_seq_lens``: converted when used).
    """

    source: str
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    pos: Optional[torch.Tensor] = None
    max_q: Optional[int] = None
    max_k: Optional[int] = None
    cu_varlen: Optional[torch.Tensor] = None


def _max_length(value) -> Optional[int]:
    """transformers' ``max_length_q/k`` as a host int, or None (a tensor or a SymInt is not read:
    that would be a host synchronisation)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _cu_seq_lens(kwargs: dict, query, key) -> Optional[_Packing]:
    """The packing given by ``cu_seq_lens_q/k`` (offsets converted to int64 on the query's
    device), or None when neither is given. Raises ``ValueError`` for malformed ones."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if cu is not None and not (isinstance(cu, torch.Tensor) and cu.dim() == 1
                                   and not cu.dtype.is_floating_point and cu.numel() >= 1):
            raise ValueError(f"flash_attention_sm75: {name} must be a 1-D integer tensor of "
                             f"cumulative sequence lengths starting at 0, got {cu!r}")
    max_q, max_k = (_max_length(kwargs.get("max_length_q")),
                    _max_length(kwargs.get("max_length_k")))
    # One of the two alone describes both (self-attention over the same packed tokens).
    if cu_q is None:
        cu_q, max_q = cu_k, max_k
    if cu_k is None:
        cu_k, max_k = cu_q, max_q
    dev = query.device
    return _Packing("cu_seq_lens_q/k", cu_q=cu_q.to(device=dev, dtype=torch.int64),
                    cu_k=cu_k.to(device=dev, dtype=torch.int64), max_q=max_q, max_k=max_k)


def _packed_position_ids(kwargs: dict, query, key, module=None) -> Optional[_Packing]:
    """The packing given by ``position_ids`` of one batch row that restart, or None.

    transformers' FlashAttention rule (``_is_packed_sequence``): one batch row, more than one
    query, and positions that restart: a new sequence begins wherever the position equals the
    row's minimum (tokens before the first such position form a document of their own). Read
    on the host once per ``position_ids`` object (transformers passes one tensor to every
    layer): whether it packs, and the number and longest length of its documents, with which
    the varlen op's offsets are built on the device (cached with the answer). While tracing or
    capturing, where nothing may be read, any such row is treated as packed, without offsets
    (the documents mask then equals the plain one if it is not). ``module``: the attention
    layer; its ``config`` and ``layer_idx`` let an inference tensor's cached answer be checked
    against the tensor's values once per forward instead of once per layer
    (``PerTensorCache.get``).
    """
    original = kwargs.get("position_ids")
    b, _, q_len, _ = query.shape
    if not (isinstance(original, torch.Tensor) and b == 1 and q_len > 1
            and key.shape[2] == q_len and original.dim() in (1, 2)
            and original.shape[-1] == q_len and original.numel() == q_len
            and not original.dtype.is_floating_point):
        return None
    source = "position_ids restart within a row"
    if not _host_reads_allowed(query):  # (the device the positions are read on)
        return _Packing(source, pos=original.reshape(-1).to(query.device))
    extra = (query.device,)
    layer = getattr(module, "layer_idx", None)
    owner = getattr(module, "config", None)
    position = (owner, layer, query) if type(layer) is int and owner is not None else None
    hit = _POSITION_IDS_CACHE.get(original, extra, position)
    if hit is not None and not hit[0]:
        return None  # the common case: cached, not packed (no view or device copy to make)
    pos = original.reshape(-1).to(query.device)
    if hit is None:
        idx = torch.arange(q_len, device=pos.device)
        restarts = pos == pos.min()
        starts = restarts | (idx == 0)  # the first token begins a document in any case
        first = torch.cummax(torch.where(starts, idx, 0), 0).values
        packed, n_docs, longest = torch.stack([
            restarts[1:].any() | ~restarts[0], starts.sum(), (idx - first).max() + 1]).tolist()
        cu = None
        if packed:  # the starts in order, then q_len: no host read (n_docs is known)
            begin = torch.sort(torch.where(starts, idx, q_len)).values[:n_docs]
            cu = torch.cat([begin, idx.new_full((1,), q_len)]).to(torch.int32)
        hit = (bool(packed), cu, int(longest))
        _POSITION_IDS_CACHE.put(original, extra, hit, position)
    packed, cu, longest = hit
    if not packed:
        return None
    return _Packing(source, pos=pos, max_q=longest, max_k=longest, cu_varlen=cu)


def _documents_mask(doc_q, doc_k, rel_q, rel_k, offset, causal: bool,
                    window: Optional[int]) -> torch.Tensor:
    """(1, 1, Tq, Tk) bool: query token i sees key j iff both are in one document and, within
    it, j is on or before the bottom-right diagonal (causal) and inside the window."""
    visible = doc_q[:, None] == doc_k[None, :]
    if causal or window is not None:
        # > 0: key j is that many positions before query i's diagonal.
        dist = (rel_q + offset)[:, None] - rel_k[None, :]
        if causal:
            visible &= dist >= 0
        if window is not None:
            visible &= (dist < window) if causal else (dist.abs() < window)
    return visible[None, None]


def _explicit_mask(packing: _Packing, query, key, attention_mask, causal: bool,
                   window: Optional[int]) -> torch.Tensor:
    """The mask stating what transformers' FlashAttention path computes for a packed call, for
    torch SDPA (the fallback): boolean, on the device, built without host reads (capture and
    compile safe), in the flattened token layout for ``cu_seq_lens`` (batch rows concatenated),
    AND-ed with ``attention_mask``."""
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    dev = query.device
    if packing.cu_q is not None:
        cu_q, cu_k = packing.cu_q, packing.cu_k
        t_q, t_k = b * q_len, b * kv_len
        iq = torch.arange(t_q, device=dev)
        ik = torch.arange(t_k, device=dev)
        # Document of each token; tokens past the last boundary get ids no key/query shares.
        doc_q = torch.searchsorted(cu_q[1:], iq, right=True)
        doc_k = torch.searchsorted(cu_k[1:], ik, right=True)
        n_q, n_k = cu_q.numel() - 1, cu_k.numel() - 1
        doc_q = torch.where(doc_q < n_q, doc_q, -1)
        doc_k = torch.where(doc_k < n_k, doc_k, -2)
        last_q = cu_q[torch.clamp(doc_q, 0, max(n_q - 1, 0))]
        last_k = cu_k[torch.clamp(doc_k, 0, max(n_k - 1, 0))]
        rel_q, rel_k = iq - last_q, ik - last_k
        n = min(n_q, n_k)
        if n > 0:
            len_q = cu_q[1:n + 1] - cu_q[:n]
            len_k = cu_k[1:n + 1] - cu_k[:n]
            offset = (len_k - len_q)[torch.clamp(doc_q, 0, n - 1)]  # bottom-right per document
        else:
            offset = torch.zeros_like(rel_q)
        mask = _documents_mask(doc_q, doc_k, rel_q, rel_k, offset, causal, window)
    else:
        pos = packing.pos
        starts = pos == pos.min()
        doc = torch.cumsum(starts.to(torch.int64), 0)
        idx = torch.arange(q_len, device=dev)
        # Index of the first token of each token's document (0 before the first start).
        first = torch.cummax(torch.where(starts, idx, 0), 0).values
        rel = idx - first
        mask = _documents_mask(doc, doc, rel, rel, torch.zeros_like(rel), causal, window)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = mask & attention_mask
        else:
            inside = mask
            # Other documents' keys: -inf (a finite minimum such as float16's would not hide a
            # key whose score is far above the document's own).
            mask = torch.where(inside, attention_mask,
                               float("-inf")).to(attention_mask.dtype)
            # A row whose keys in its document are all -inf (or a token in no document) sees no
            # key: all -inf, so that it gives 0 (_call_fallback).
            none = ~(inside & (attention_mask != float("-inf"))).any(-1, keepdim=True)
            mask = mask.masked_fill(none, float("-inf"))
    return mask


# Whether a mask states exactly a packing's documents (_mask_is_the_documents), per mask object
# (inference masks too: a hit checks their values against a copy on the device, no host read).
_DOCUMENT_MASK_CACHE = _masks.PerTensorCache(verify_inference=True)


def _mask_is_the_documents(packing: _Packing, query, key, attention_mask, causal: bool,
                           window: Optional[int], source: torch.Tensor) -> bool:
    """Whether ``attention_mask`` says exactly what the packing's documents say (each document
    attending to itself, ``causal`` and ``window`` within it; :func:`_explicit_mask` without a
    mask): the mask transformers builds from restarting ``position_ids`` when it builds one (no
    cache: training with ``use_cache=False``, gradient checkpointing). Then the varlen op gives
    that mask's result at the documents' cost. Bool masks, or float ones of 0 and ``-inf`` /
    the float32 or bfloat16 minimum only (float16's does not hide a key exactly:
    ``_masks._blocked_values``), of one batch row (any head count), on the query's device, not
    requiring grad under grad mode (a learned mask's gradient needs the mask on the kernel);
    one host read per mask object (``source``: the packing's tensor, part of the cache key),
    never while tracing or capturing (False there: the caller falls back with the mask)."""
    b, _, q_len, _ = query.shape
    m = attention_mask
    if not (isinstance(m, torch.Tensor) and m.dim() == 4 and m.shape[0] == 1 and b == 1
            and m.shape[-2:] == (q_len, key.shape[2]) and m.device == query.device
            and (m.dtype == torch.bool or m.dtype.is_floating_point)
            and not (m.requires_grad and torch.is_grad_enabled())
            and _host_reads_allowed(m)):
        return False
    # An inference tensor has no version counter: restarting position_ids are checked against
    # their cached values at each use (_packed_position_ids), inference cu_seq_lens are not, so
    # those are compared again at every call.
    cacheable = not source.is_inference() or packing.cu_q is None
    extra = ("documents", id(source), source.data_ptr(),
             None if source.is_inference() else source._version, causal, window)
    hit = _DOCUMENT_MASK_CACHE.get(m, extra) if cacheable else None
    if hit is None:
        docs = _explicit_mask(packing, query, key, None, causal, window)
        if m.dtype == torch.bool:
            same = (m == docs).all()
        else:
            seen = m == 0
            hidden = _masks._blocked_values(m, None)  # -inf, the float32 / bf16 minimum
            same = ((seen | hidden) & (seen == docs)).all()
        hit = bool(same)  # the one host read
        if cacheable:
            _DOCUMENT_MASK_CACHE.put(m, extra, hit)
    return hit


class _VarlenPlan(NamedTuple):
    """The varlen op's arguments for a packed call (flattened tokens)."""

    cu_q: torch.Tensor  # int32 on the query's device
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    window_size: Tuple[int, int]


def _plan_varlen(packing: _Packing, query, key, attention_mask, causal: bool,
                 window: Optional[int]) -> "Tuple[Optional[_VarlenPlan], Optional[str]]":
    """Map a packed call onto the varlen op, or return the reason it cannot run there. Checks
    ``cu_seq_lens_q/k`` on the device (``ValueError`` on the CPU, a device-side assertion on
    CUDA) against the tokens and the longest document (``max_length_q/k`` when transformers
    passes them as ints, else the number of tokens, which bounds every document)."""
    if attention_mask is not None:
        return None, "an attention_mask with packed sequences (applied on torch SDPA)"
    if not _ops.VARLEN_AVAILABLE:
        return None, ("the compiled extension has no varlen op (built from older sources; "
                      "rebuild it)")
    b, _, q_len, _ = query.shape
    t_q, t_k = b * q_len, b * key.shape[2]
    if packing.cu_q is not None:
        if packing.cu_q.shape != packing.cu_k.shape:
            return None, (f"cu_seq_lens_q and cu_seq_lens_k hold different numbers of documents "
                          f"({packing.cu_q.numel() - 1} and {packing.cu_k.numel() - 1})")
        max_q = t_q if packing.max_q is None else packing.max_q
        max_k = t_k if packing.max_k is None else packing.max_k
        _packing.check_cu_seqlens(packing.cu_q, t_q, max_q, "cu_seq_lens_q")
        _packing.check_cu_seqlens(packing.cu_k, t_k, max_k, "cu_seq_lens_k")
        cu_q = packing.cu_q.to(torch.int32)
        cu_k = cu_q if packing.cu_k is packing.cu_q else packing.cu_k.to(torch.int32)
    else:
        if packing.cu_varlen is None:
            return None, ("packed position_ids while torch.compile traces or a CUDA graph "
                          "captures (the documents are read on the host)")
        cu_q = cu_k = packing.cu_varlen
        max_q = max_k = packing.max_q
    # transformers' FlashAttention window: (sliding_window - 1) keys on each side (causal: the
    # right side is the diagonal), per document.
    w = (-1, -1) if window is None else (window - 1, window - 1)
    return _VarlenPlan(cu_q, cu_k, max_q, max_k, causal, w), None


def _run_varlen(query, key, value, scaling, plan: _VarlenPlan, softcap: float = 0.0,
                dropout_p: float = 0.0):
    """The varlen op on the flattened tokens of BHSD ``query``, ``key``, ``value`` (with
    attention dropout ``dropout_p``: ``varlen_fwd_dropout``); returns ``(B, q_len, H, D)``."""
    b, h, q_len, d = query.shape
    kv_len, h_k = key.shape[2], key.shape[1]
    q = _bshd_for_kernel(query).reshape(b * q_len, h, d)
    k = _bshd_for_kernel(key).reshape(b * kv_len, h_k, d)
    v = _bshd_for_kernel(value).reshape(b * kv_len, h_k, d)
    scale = None if scaling is None else float(scaling)
    out, _ = _ops.call_varlen_fwd(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale,
                                  plan.causal, None, *plan.window_size, softcap,
                                  dropout_p=dropout_p)
    return out.view(b, q_len, h, d)


def _packed_attention(fallback, module, query, key, value, attention_mask, bound, kwargs,
                      softcap: float):
    """A packed call (``cu_seq_lens_q/k``, or restarting ``position_ids``) with transformers'
    FlashAttention semantics: each document attends to itself (bottom-right causal and the
    window within it). On the varlen op when the call allows it, else on ``fallback`` with the
    per-document mask (:func:`_explicit_mask`). None when the call is not packed."""
    window = _window_kwarg(kwargs)
    b = query.shape[0]
    packing = _cu_seq_lens(kwargs, query, key)
    if packing is not None:
        if b > 1 and attention_mask is not None:
            raise ValueError("flash_attention_sm75: cu_seq_lens_q/k with a batch of more than one "
                             "row and an attention_mask: pass the packed tokens as one row")
    else:
        packing = _packed_position_ids(kwargs, query, key, module)
        if packing is None:
            return None
    # The mask transformers builds carries causality and the window; without one, they come
    # from is_causal / module.is_causal and sliding_window, as in transformers' FlashAttention.
    no_mask = attention_mask is None
    causal = no_mask and _is_causal(module, bound["is_causal"]) and query.shape[2] > 1
    reason = _unsupported_reason(module, query, key, value, attention_mask, bound, kwargs,
                                 softcap)
    varlen_mask = attention_mask
    if reason is None and not no_mask:
        # A mask that states exactly the documents (transformers' own, built from the packed
        # position_ids when there is no cache) says nothing the varlen op does not.
        doc_causal = _is_causal(module, bound["is_causal"]) and query.shape[2] > 1
        # the tensor transformers hands every layer (the cache key's part of the packing)
        source = next((kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids")
                       if kwargs.get(n) is not None), None)
        if isinstance(source, torch.Tensor) and _mask_is_the_documents(
                packing, query, key, attention_mask, doc_causal, window, source):
            varlen_mask, causal = None, doc_causal
    window = window if no_mask or varlen_mask is None else None
    plan = None
    if reason is None:
        plan, reason = _plan_varlen(packing, query, key, varlen_mask, causal, window)
    if reason is None:
        out, reason = _try_kernel(
            lambda: _run_varlen(query, key, value, bound["scaling"], plan, softcap,
                                _dropout_of(bound)),
            query.shape[2])
        if out is not None:
            return out, None
    mask = _explicit_mask(packing, query, key, attention_mask, causal, window)
    _fall_back(f"packed sequences ({packing.source}) on torch SDPA with a per-document mask: "
               f"{reason}")
    return _call_with_mask(fallback, module, query, key, value, mask, bound, kwargs)


def _position_bias_attention(fallback, module, query, key, value, attention_mask, args, bound,
                             kwargs, softcap: float):
    """A call with a relative-position bias (T5's ``position_bias``, (1 or B, H, q_len, kv_len)):
    the bias transformers' SDPA path adds, built by transformers' own
    ``create_position_bias_mask`` (the position bias where the mask or causality lets a key be
    seen, the dtype's minimum elsewhere; -inf across a row a boolean mask leaves no key, which
    the kernel then gives 0), with that path's key crop for a causal call into a
    longer cache, goes to the kernel as its ``attn_bias``; in training the learned bias gets
    its gradient from the kernel's backward (through ``create_position_bias_mask`` to the
    relative-attention embedding). Anything the kernel cannot run falls back to ``fallback``
    with the original arguments."""
    reason = _unsupported_reason(module, query, key, value, attention_mask,
                                 dict(bound, position_bias=None), kwargs, softcap)
    if reason is None and query.shape[2] == 1 and not _SETTINGS["decode_on_kernel"]:
        reason = "decode (q_len == 1) is configured to use torch SDPA"
    if reason is None:
        create_position_bias_mask = getattr(_sdpa_attention_module(),
                                            "create_position_bias_mask", None)
        if create_position_bias_mask is None:  # pragma: no cover - transformers without it
            reason = ("position_bias: this transformers version has no "
                      "create_position_bias_mask")
    if reason is None:
        position_bias = bound["position_bias"]
        q_len, kv_len = query.shape[2], key.shape[2]
        is_causal = _is_causal(module, bound["is_causal"])
        is_causal = q_len > 1 and attention_mask is None and is_causal
        k, v = key, value
        if is_causal and kv_len > q_len:  # transformers' crop (prefill into an empty cache)
            k, v = key[:, :, :q_len], value[:, :, :q_len]
            position_bias = position_bias[:, :, :, :q_len]
        bias = create_position_bias_mask(position_bias, attention_mask, is_causal, query, k)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            # transformers fills hidden keys with the dtype's finite minimum, so a query row
            # with no visible key (a left-padded decoder's padded queries) would average V.
            # Those rows hide their keys as -inf: the kernel gives them 0 and no gradient, as
            # the fallback does (_call_fallback). Device ops, no host read.
            bias = bias.masked_fill(~attention_mask.any(-1, keepdim=True), float("-inf"))
        problem = _rules.attn_bias_problem(bias, query, k.shape[2], layout="bhsd",
                                           backward=_rules.backward_may_follow(
                                               query, key, value, dropout_p=_dropout_of(bound)),
                                           softcap=softcap, name="position_bias",
                                           softmax_scale=bound["scaling"], scale_name="scaling")
        if problem is None:
            info = MaskInfo(False, k.shape[2], None, None, "bias")
            out, reason = _try_kernel(
                lambda: _run_kernel(query, k, v, bound["scaling"], info, softcap, mask=bias,
                                    dropout_p=_dropout_of(bound)),
                q_len)
            if out is not None:
                return out, None
        else:
            reason = f"position_bias as the kernel's bias: {problem}"
    _fall_back(reason)
    return _call_fallback(fallback, module, query, key, value, attention_mask, *args, **kwargs)


def _call_with_mask(fallback, module, query, key, value, mask, bound, kwargs):
    """``fallback`` (torch SDPA) with an explicit mask, in the flattened layout of the mask."""
    b, h, q_len, d = query.shape
    kv_len = key.shape[2]
    if mask.shape[-2] != q_len:  # cu_seq_lens over a batch of several rows: one packed row
        query = query.transpose(0, 1).reshape(1, h, b * q_len, d)
        key = key.transpose(0, 1).reshape(1, key.shape[1], b * kv_len, key.shape[-1])
        value = value.transpose(0, 1).reshape(1, value.shape[1], b * kv_len, value.shape[-1])
    rest = {k: v for k, v in kwargs.items() if k not in _SDPA_POSITIONAL and k not in
            _PACKED_KWARGS and k not in ("position_ids", "sliding_window")}
    out, weights = _call_fallback(fallback, module, query, key, value, mask,
                                  dropout=bound["dropout"], scaling=bound["scaling"],
                                  is_causal=bound["is_causal"],
                                  position_bias=bound["position_bias"], **rest)
    return out.reshape(b, q_len, *out.shape[2:]), weights


def _call_fallback(fallback, module, query, key, value, attention_mask, *args, **kwargs):
    """``fallback(module, query, key, value, attention_mask, *args, **kwargs)`` (transformers'
    ``sdpa_attention_forward``, the ``"sdpa"`` entry the patch replaced, or
    :func:`_softcap_sdpa_forward`), except that a query row whose keys are all masked (bool all
    False, or float all ``-inf``) gives 0, as on the kernel path, instead of what torch's
    backend makes of it (NaN or an average of V on some backends, an average of V where
    ``position_bias`` turns a boolean mask into a finite one, and NaN gradients to every key
    through such a row). Those rows are run unmasked and zeroed (``_masks.without_empty_rows``,
    shared with the SDPA wrapper), so their gradients are 0 too; every other row is the
    fallback's result bit for bit, and a mask without such rows (a finite "dtype minimum" row is
    not one) gives the same result as before. Device ops only: no host read, traceable, and
    capturable in a CUDA graph.

    ``fallback`` returns transformers' ``(output (B, q_len, H, D), weights)``. Its weights
    (``None`` from transformers' SDPA function, which has none even with
    ``output_attentions=True``) are returned as they are, except a ``(B, H, q_len, kv_len)``
    tensor from a replaced ``"sdpa"`` entry, whose rows without keys are zeroed too (the
    probabilities of a row that sees no key are 0, consistent with its output)."""
    split = _masks.without_empty_rows(attention_mask)
    if split is None or split[1].dim() > 4 or query.dim() != 4:
        return fallback(module, query, key, value, attention_mask, *args, **kwargs)
    visible, empty = split
    out, weights = fallback(module, query, key, value, visible, *args, **kwargs)
    rows = empty.reshape((1,) * (4 - empty.dim()) + tuple(empty.shape))  # (B, H, q_len, 1)
    out = out.masked_fill(rows.transpose(1, 2), 0.0)
    if isinstance(weights, torch.Tensor) and weights.dim() == 4:
        weights = weights.masked_fill(rows, 0.0)
    return out, weights


def _bshd_for_kernel(x: torch.Tensor) -> torch.Tensor:
    """BHSD tensor -> BSHD view the kernel accepts (a copy only if strides/alignment demand)."""
    t = x.transpose(1, 2)
    return _aligned_for_kernel(t) if t.is_cuda else t  # is_cuda: no device object per call


def _aligned_for_kernel(t: torch.Tensor) -> torch.Tensor:
    """A CUDA BSHD view, or a copy of it where its strides or address break the alignment
    rule."""
    if _rules.is_kernel_aligned(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _dropout_of(bound: dict) -> float:
    """The call's attention dropout (transformers passes ``dropout=module.attention_dropout``
    in training, 0.0 in eval) as the op's float; the rules have checked it."""
    dropout = bound["dropout"]
    return 0.0 if dropout is None else float(dropout)


def _run_kernel(query, key, value, scaling, info: MaskInfo, softcap: float = 0.0,
                checked: bool = False, mask: Optional[torch.Tensor] = None,
                dropout_p: float = 0.0) -> torch.Tensor:
    """The op on BHSD tensors as ``info`` plans it; ``checked``: the caller has established what
    ``_ops.call_fwd_checked`` requires (a remembered decision, see ``_decision_key``, never with
    dropout); ``mask``: the call's attention mask, the op's ``attn_bias`` for a ``"bias"`` plan;
    ``dropout_p``: attention dropout on the kernel."""
    if info.kind == "bias":
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if q.is_cuda:
            q, k, v = _aligned_for_kernel(q), _aligned_for_kernel(k), _aligned_for_kernel(v)
        scale = None if scaling is None else float(scaling)
        out, _ = _ops.call_fwd(q, k, v, scale, False, True, None, None, -1, -1, softcap,
                               None, mask, dropout_p=dropout_p)
        return out
    kv_len = info.kv_len
    if kv_len != key.shape[2]:
        key = key[:, :, :kv_len]
        value = value[:, :, :kv_len]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if q.is_cuda:  # _bshd_for_kernel's alignment rule (the rules put k and v on q's device)
        q, k, v = _aligned_for_kernel(q), _aligned_for_kernel(k), _aligned_for_kernel(v)
    scale = None if scaling is None else float(scaling)
    if dropout_p:
        out, _ = _ops.call_fwd(q, k, v, scale, info.causal, True, info.leftpad_k, info.seqused_k,
                               *info.window_size, softcap, dropout_p=dropout_p)
        return out
    call = _ops.call_fwd_checked if checked else _ops.call_fwd
    out, _ = call(q, k, v, scale, info.causal, True, info.leftpad_k, info.seqused_k,
                  *info.window_size, softcap)
    return out


def _try_kernel(run: Callable[[], torch.Tensor], q_len: int) -> Tuple[
        Optional[torch.Tensor], Optional[str]]:
    """``(run(), None)``, counted as a kernel call, or ``(None, reason)`` when the op rejects
    the inputs (its validation raises ``ValueError``, the contract). While torch.compile traces
    there is no try/except on the traced path: the op checks at run time."""
    if torch.compiler.is_compiling():
        out = run()
    else:
        try:
            out = run()
        except ValueError as e:
            return None, f"kernel rejected the inputs: {e}"
    _count_kernel(q_len)
    return out, None


_SDPA_ATTENTION_MODULE: list = []


def _sdpa_attention_module():
    """transformers.integrations.sdpa_attention, imported once. :func:`register` imports it, so
    that no call traced by torch.compile meets an import statement (dynamo cannot trace one:
    "Bad import result", an error under ``fullgraph=True``)."""
    if not _SDPA_ATTENTION_MODULE:
        from transformers.integrations import sdpa_attention

        _SDPA_ATTENTION_MODULE.append(sdpa_attention)
    return _SDPA_ATTENTION_MODULE[0]


def _stock_sdpa_forward() -> Callable:
    """transformers' ``sdpa_attention_forward``, read from its module at every call (a patched
    attribute is followed)."""
    return _sdpa_attention_module().sdpa_attention_forward


def _fall_back(reason: str) -> None:
    if is_strict():
        raise ValueError(f"flash_attention_sm75: strict mode, cannot run on the kernel: {reason}")
    _count_fallback(reason)


# ----------------------------------------------------------------------------------------------
# The decision, taken once per forward (remembered for the other layers)
# ----------------------------------------------------------------------------------------------
#
# transformers calls the attention function once per layer, and every layer of a forward hands
# it the same mask object, the same position_ids, the same kwargs and q/k/v of the same sizes:
# the decision (allow-list, rulebook, packed-sequence test, plan of the mask) is the same for
# all of them, and taking it again cost ~6-8 us of host time per layer and decode step on the
# CPU benchmark (the rulebook alone ~4), as much as stock "sdpa" spends on its whole call
# (benchmarks/NOTES.md, "HF integration host time"). So it is remembered, keyed on everything
# it reads:
#
# * the call's metadata: q/k/v shapes, strides, dtypes and devices, the mask object (identity
#   through a weak reference, data pointer, shape, strides, dtype, device and version counter,
#   as _masks.PerTensorCache keys a classification), sliding_window, the effective is_causal,
#   module.num_key_value_groups, the registered-or-patched flavour and both settings;
# * conditions checked at every call, under which the decision reads nothing else (any other
#   call takes the full path, exactly as before, and is not remembered): no torch.compile /
#   torch.jit tracing or CUDA-graph capture (nothing may be read or cached on the host there:
#   the full path hands masks to torch SDPA), no forward-mode AD level or torch.func transform
#   (the autograd rules), the extension loaded, keyword arguments inside the allow-list and no
#   positional ones, dropout 0, a valid float scaling or None, no position_bias, cu_seq_lens,
#   sinks, output_attentions or deterministic, a mask that is not an inference tensor (no
#   version counter: an in-place change would go unseen; the full path classifies those at
#   every call), and position_ids that do not pack documents (tested at every call, through
#   their own per-object cache, before the memo is consulted).
#
# A new forward with a mask builds a new mask object, which no entry matches; without a mask the
# decision is a function of the key alone, so an entry of an earlier forward with the same key
# is that forward's decision, rightly. What is not remembered runs per call as before: the op
# (its own checks: a ValueError still falls back with its reason), strict mode, the statistics
# and the fallback itself.

_DECISIONS_SIZE = 32  # a few forwards' worth of (mask, call sizes): sliding + full layers, steps
_DECISIONS: Dict[tuple, tuple] = {}  # key -> (weak reference to the mask or None, info, reason)
_DECISIONS_LOCK = threading.Lock()  # inserts and evictions; lookups are one dict.get


def _clear_decisions() -> None:
    with _DECISIONS_LOCK:
        _DECISIONS.clear()


# Keyword arguments a remembered decision may see (present with any value the key checks);
# any other (position_bias, cu_seq_lens_*, max_length_*, s_aux, sinks, or one outside the
# allow-list), even as None, sends the call to the full path.
_MEMO_KWARGS = _INERT_KWARGS | {"dropout", "scaling", "is_causal", "sliding_window", "softcap",
                                "position_ids", "output_attentions", "deterministic"}


def _decision_key(module, query, key, value, attention_mask, args, kwargs,
                  flash_semantics: bool) -> Optional[tuple]:
    """The key under which this call's decision is remembered, or None when the call must take
    the full path (and not be remembered): see the comment above. Metadata reads only."""
    # is_compiling() first: dynamo folds it, so a traced call never reaches the rest.
    # (torch._C._is_tracing() is torch.jit.is_tracing() outside TorchScript, which this is.)
    if torch.compiler.is_compiling() or torch._C._is_tracing() or args \
            or not (_MEMO_KWARGS.issuperset(kwargs) and _ops.EXTENSION_AVAILABLE):
        return None
    get = kwargs.get
    flag = get("output_attentions")
    if flag is not None and flag is not False:
        return None
    flag = get("deterministic")
    if flag is not None and flag is not False:
        return None
    dropout = get("dropout")
    if dropout is not None and not ((type(dropout) is float or type(dropout) is int)
                                    and dropout == 0):
        return None
    # A valid scale from BIAS_SCALE_MIN on passes the rules whatever its value (it goes to the
    # op per call); below it a mask the kernel would read as a bias is refused, and any invalid
    # value's reason quotes it: those take the full path.
    scaling = get("scaling")
    if scaling is not None and not (type(scaling) is float and _rules.BIAS_SCALE_MIN
                                    <= scaling <= _rules.SOFTMAX_SCALE_MAX):
        return None
    window = get("sliding_window")
    if window is not None and not (type(window) is int and window >= 1):
        return None  # the full path raises (registered names) or ignores it (the patch)
    is_causal = get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    groups = getattr(module, "num_key_value_groups", None)
    if type(is_causal) is not bool or (groups is not None and type(groups) is not int):
        return None
    if getattr(_forward_ad, "_current_level", 0) >= 0 \
            or torch._C._are_functorch_transforms_active():
        return None
    try:
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        if attention_mask is None:
            mask = None
        elif isinstance(attention_mask, torch.Tensor) and not attention_mask.is_inference():
            m = attention_mask
            mask = (id(m), m.data_ptr(), m.shape, m.stride(), m.dtype, m.device, m._version)
        else:
            return None
        qs = query.shape
        # Whether a gradient will flow: a bias plan's rules depend on it (its backward's limits),
        # and a mask that requires grad is never classified into key ranges.
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                            or value.requires_grad
                                            or (mask is not None and attention_mask.requires_grad))
        # stride() raises for nested and sparse tensors: the full path words their reason.
        # The softcap: a bias plan's backward rule reads it (a float as transformers passes
        # it; anything else takes the full path).
        softcap = get("softcap")
        if softcap is not None and type(softcap) is not float:
            return None
        memo = (flash_semantics, _SETTINGS["decode_on_kernel"], _SETTINGS["allow_cpu_reference"],
                _SETTINGS["classify_decode_masks"],
                window, is_causal, groups, mask, grad, softcap,
                qs, query.stride(), query.dtype, query.device,
                key.shape, key.stride(), key.dtype, key.device,
                value.shape, value.stride(), value.dtype, value.device)
        several = len(qs) == 4 and qs[0] == 1 and qs[2] > 1
    except Exception:  # anything that is not a plain dense tensor
        return None
    # Packed position_ids (one batch row, several queries): tested at every call, through their
    # own per-object cache, as the full path tests them; the key does not hold them.
    if flash_semantics and several and _packed_position_ids(kwargs, query, key,
                                                            module) is not None:
        return None
    return memo


def _remember(memo: tuple, attention_mask, info: Optional[MaskInfo],
              reason: Optional[str]) -> None:
    ref = None
    if attention_mask is not None:
        try:
            ref = weakref.ref(attention_mask)
        except TypeError:  # pragma: no cover
            return
    with _DECISIONS_LOCK:
        while len(_DECISIONS) >= _DECISIONS_SIZE:
            del _DECISIONS[next(iter(_DECISIONS))]  # the oldest
        _DECISIONS[memo] = (ref, info, reason)


def _attention(fallback: Callable, module, query, key, value, attention_mask, args, kwargs,
               flash_semantics: bool = False):
    """The kernel, or ``fallback`` with the caller's arguments.

    ``flash_semantics`` (the registered implementations): packed sequences and a sliding window
    without a mask are honoured as transformers' FlashAttention path honours them (through an
    explicit mask on ``fallback``). Without it (the patched ``"sdpa"`` entry) the call means
    what it means to stock SDPA, which reads neither.

    ``softcap`` (Gemma 2) runs on the kernel; a call with it that cannot (or packed sequences)
    falls back to :func:`_softcap_sdpa_forward`, never to ``fallback``, which cannot apply it.
    """
    softcap = 0.0 if kwargs.get("softcap") is None else _softcap_kwarg(kwargs)
    if softcap:
        fallback = _softcap_sdpa_forward
    # The decision of layers 1..L-1 is layer 0's (see _decision_key).
    memo = _decision_key(module, query, key, value, attention_mask, args, kwargs,
                         flash_semantics)
    hit = None if memo is None else _DECISIONS.get(memo)
    # The mask must be the very object the entry was made for (its id and data pointer may be
    # a freed mask's).
    if hit is not None and (hit[0] is None or hit[0]() is attention_mask):
        info, reason = hit[1], hit[2]
        if reason is None:  # _try_kernel, where nothing traces (the key says so)
            try:
                out = _run_kernel(query, key, value, kwargs.get("scaling"), info, softcap,
                                  checked=True, mask=attention_mask)
            except ValueError as e:
                reason = f"kernel rejected the inputs: {e}"
            else:
                _count_kernel(query.shape[2])
                return out, None
    else:
        bound = _bind_sdpa_args(args, kwargs)
        if flash_semantics and memo is None:  # (with a memo key the call packs nothing)
            packed = _packed_attention(fallback, module, query, key, value, attention_mask,
                                       bound, kwargs, softcap)
            if packed is not None:
                return packed
        position_bias = bound["position_bias"]
        if position_bias is not None:
            if not _position_bias_is_zero(position_bias, query):
                return _position_bias_attention(fallback, module, query, key, value,
                                                attention_mask, args, bound, kwargs, softcap)
            bound = dict(bound, position_bias=None)  # all zeros: nothing to add (one host read)
        reason = _unsupported_reason(module, query, key, value, attention_mask, bound, kwargs,
                                     softcap)
        info = None
        if reason is None:
            info, reason = _plan(module, query, key, attention_mask, bound["is_causal"],
                                 kwargs.get("sliding_window"), flash_semantics, value, softcap,
                                 _dropout_of(bound), bound["scaling"])
        if memo is not None:
            _remember(memo, attention_mask, info, reason)
        if reason is None:
            out, reason = _try_kernel(
                lambda: _run_kernel(query, key, value, bound["scaling"], info, softcap,
                                    mask=attention_mask, dropout_p=_dropout_of(bound)),
                query.shape[2])
            if out is not None:
                return out, None
    _fall_back(reason)
    if flash_semantics and attention_mask is None and _is_window(kwargs.get("sliding_window")):
        bound = _bind_sdpa_args(args, kwargs)
        window = _window_mask(module, query, key, bound["is_causal"], kwargs["sliding_window"])
        if window is not None:
            lo, mask = window
            return _call_with_mask(fallback, module, query, key[:, :, lo:], value[:, :, lo:],
                                   mask, bound, kwargs)
    return _call_fallback(fallback, module, query, key, value, attention_mask, *args, **kwargs)


def _window_mask(module, query, key, is_causal,
                 sliding_window) -> Optional[Tuple[int, torch.Tensor]]:
    """transformers' FlashAttention window of a call without a mask, stated to torch SDPA (the
    fallback): ``(lo, mask)``, the first key any query sees and the ``(1, 1, q_len, kv_len - lo)``
    bool mask over the keys from ``lo`` on. The window :func:`_plan` gives the kernel:
    ``(sliding_window - 1, sliding_window - 1)``, causal for ``q_len > 1``, bottom-right aligned
    on all keys (query ``i``'s diagonal is key ``i + kv_len - q_len``). Keys before ``lo`` are
    never seen, so the fallback gets neither them nor a mask column for them (a decode step
    against a long cache attends over the window's keys only). None where the window hides no
    key (``kv_len <= sliding_window``) or ``sliding_window`` is no window; then the call means
    what it means without one. Device ops only (no host read: traceable and capturable); the
    mask is built from 1-D positions (no q_len x kv_len integer matrix)."""
    if not _is_window(sliding_window) or key.shape[2] <= sliding_window:
        return None
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = q_len > 1 and _is_causal(module, is_causal)
    lo = max(0, kv_len - q_len - sliding_window + 1)
    dev = query.device
    diag = torch.arange(kv_len - q_len, kv_len, device=dev)[:, None]  # each query's diagonal
    keys = torch.arange(lo, kv_len, device=dev)[None, :]
    visible = keys > diag - sliding_window
    visible &= (keys <= diag) if causal else (keys < diag + sliding_window)
    return lo, visible[None, None]


def flash_attention_sm75_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    *args: Any,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """transformers attention function running the SM75 FlashAttention kernel.

    Same signature and return as transformers' ``sdpa_attention_forward``; registered as
    ``"flash_attention_sm75"`` and ``"sm75_attention"`` by :func:`register`.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer. ``module.is_causal`` (when ``is_causal`` is not given) and
        ``module.num_key_value_groups`` are honoured.
    query : torch.Tensor
        ``(B, H, q_len, D)``.
    key, value : torch.Tensor
        ``(B, H_kv, kv_len, D)``; ``H % H_kv == 0`` (GQA/MQA run natively, no K/V copy).
    attention_mask : torch.Tensor or None
        As built by transformers for SDPA: ``None`` (causal when ``q_len > 1``, as in
        ``sdpa_attention_forward``), a boolean 4-D mask or an additive float mask. See
        :func:`classify_attention_mask` for which masks run on the kernel.
    *args, **kwargs
        The arguments transformers passes (an allow-list; any other argument that is not
        ``None`` raises ``ValueError``, last item below):

        * ``dropout`` (default 0.0; transformers passes ``module.attention_dropout`` in
          training: attention dropout on the kernel, as torch's semantics, from torch's CUDA
          generator, padded and packed calls at every head dim; calls whose mask needs a bias
          backward the kernels lack fall back, in training and out of it alike: a dropout
          call decides as if a gradient flows, so that a reentrant checkpoint's recompute
          takes the same path), ``scaling`` (default ``1/sqrt(D)``),
          ``is_causal`` (default ``module.is_causal``), ``position_bias`` (all zeros, as T5's
          cross-attention passes, runs on the kernel without a bias; any other, T5's
          relative-position bias, runs as the kernel's ``attn_bias`` combined with the mask by
          transformers' ``create_position_bias_mask``, with its gradient in training);
        * ``cu_seq_lens_q``, ``cu_seq_lens_k`` (``max_length_q``/``max_length_k`` are only
          size hints): packed sequences, as transformers' FlashAttention path reads them; and
          ``position_ids`` of one batch row that restart (a new sequence wherever the position
          equals the row's minimum). Each sequence attends only to itself (bottom-right causal
          within it when causal, and the ``sliding_window`` within it without a mask). These run
          on the varlen op over the flattened tokens, one call: ``cu_seq_lens`` as given
          (checked on the device against the tokens and ``max_length_q/k`` when those are ints:
          a ``ValueError`` on the CPU, a device-side assertion on CUDA; without them the number
          of tokens bounds the documents, at some cost in idle thread blocks), restarting
          ``position_ids`` through offsets built on the device after one host read per
          ``position_ids`` object (shared by the layers). They run on the fallback with a
          per-document mask built on the device when the kernel cannot run the call (any reason
          of this list), with an ``attention_mask`` (AND-ed into the documents mask), with
          ``cu_seq_lens_q`` and ``cu_seq_lens_k`` of different lengths, and for packed
          ``position_ids`` while torch.compile traces or a CUDA graph captures (nothing is read
          on the host there);
        * ``sliding_window``: carried by transformers' mask (a causal, padded or static-cache
          mask whose rows see only the last ``sliding_window`` keys runs on the kernel's
          window); without a mask, a window shorter than the keys runs on the kernel with
          ``window_size = (sliding_window - 1, sliding_window - 1)`` as transformers'
          FlashAttention path applies it, and a call that falls back gets the same window as
          an explicit mask built on the device (also a decode step configured for torch SDPA);
        * ``output_attentions=True`` falls back (torch SDPA returns no weights either: the
          weights returned are ``None``);
          ``deterministic=True`` falls back only when ``FLASH_SM75_BWD_DQ=atomic`` makes our
          backward non-deterministic;
        * ``softcap`` (Gemma 2's ``attn_logit_softcapping``): ``None`` or a finite number > 0;
          runs on the kernel (each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``),
          on every path above (classified masks, windows, no mask); where the kernel cannot
          run (a fallback reason, packed sequences), the fallback is
          :func:`_softcap_sdpa_forward`, ``sdpa_attention_forward`` with the soft-cap applied
          (torch SDPA has none);
        * ``s_aux`` / ``sinks``: raise ``ValueError`` (see Raises);
        * model-level arguments that do not enter the attention (``use_cache``,
          ``cache_position``, ``past_key_values``, ``position_embeddings``,
          ``output_hidden_states``, ``return_dict``, ``layer_idx``, ``output_router_logits``,
          ``encoder_hidden_states``, ``seq_idx``, ``num_items_in_batch``, ``token_type_ids``,
          ``mm_token_type_ids``) are ignored, as ``sdpa_attention_forward`` ignores them;
        * continuous batching's cache bookkeeping (``read_index``, ``write_index``,
          ``logits_indices``, ``logits_processor_args``; used by the cache before attention)
          falls back, with the packed sequences' per-document mask;
        * any other keyword argument that is set raises ``ValueError`` (see Raises): under a
          name other than ``"eager"`` / ``"sdpa"`` a model may pass what it would otherwise
          fold into the mask (DeepSeek-V3.2's top-k ``indices``), which the SDPA fallback
          would ignore.

    Returns
    -------
    attn_output : torch.Tensor
        ``(B, q_len, H, D)``, the layout transformers expects from attention functions.
    attn_weights : None

    Notes
    -----
    Unsupported calls run transformers' ``sdpa_attention_forward`` with the unchanged arguments
    (bitwise the stock result on every row that sees a key), or with the explicit mask
    described above, after logging the reason at DEBUG on the ``"flash_attention_sm75"`` logger
    and counting it in :func:`get_stats`. In strict mode
    (:func:`flash_attention_sm75.set_strict`) they raise ``ValueError`` instead. Rows of queries
    that see no key (left padding; bool mask rows all False, float rows all ``-inf``) are 0 with
    zero gradients on every path, the kernel's and the fallbacks' (:func:`_call_fallback`), as
    are tokens in no document of ``cu_seq_lens``; a row hidden only by a finite "dtype minimum"
    keeps the fallback's finite result. While ``torch.compile`` traces or a
    CUDA graph captures, nothing is read on the host: a mask goes to the kernel as its
    ``attn_bias`` (where the rulebook's bias rule allows it; otherwise to the fallback), read on
    the device at every replay; packed ``position_ids`` go to the fallback with a per-document
    mask, and ``cu_seq_lens`` run on the varlen op there.
    Host time: layer 0 of a forward takes the decision (and the mask's one host read); layers
    1..L-1 find it remembered under the same mask object and call metadata, so they pay a key
    and the op call only (see ``_decision_key`` for what the key holds and when it is not used).

    Raises
    ------
    ValueError
        In strict mode, for a call that would fall back (the message gives the reason); when a
        call falls back and ``FLASH_ATTENTION_SM75_STRICT`` holds an unrecognised value; for
        ``s_aux`` / ``sinks`` (learned attention sinks, gpt-oss), which neither the kernel nor
        the SDPA fallback implements; for a keyword argument outside the list above; for a
        ``softcap`` that is not ``None`` or a finite number > 0; for malformed
        ``cu_seq_lens_q/k`` or ``sliding_window`` (on the varlen op's path, ``cu_seq_lens``
        whose offsets decrease, leave the tokens or exceed ``max_length_q/k``: on the CPU; on
        CUDA a device-side assertion).
    """
    for name, what in (("s_aux", "learned attention sinks"), ("sinks", "learned attention sinks")):
        if name in kwargs and kwargs[name] is not None:
            # transformers' SDPA function ignores sinks (falling back to it would silently
            # compute the unmodified attention).
            shown = kwargs[name]
            shown = f"a tensor of shape {list(shown.shape)}" if isinstance(shown, torch.Tensor) \
                else repr(shown)
            raise ValueError(
                f"flash_attention_sm75: {name}={shown} ({what}) is not supported, and "
                f"transformers' SDPA fallback does not apply it; load this model with "
                f"attn_implementation='eager'")
    # Under these names (not "eager" / "sdpa") a model may hand attention what it would
    # otherwise have folded into the mask (DeepSeek-V3.2's top-k `indices`): torch SDPA, the
    # fallback, would ignore it, so an argument outside the allow-list is refused here.
    unknown = [name for name in _unknown_kwargs(kwargs) if name not in _CB_KWARGS]
    if unknown:
        raise ValueError(
            f"flash_attention_sm75: keyword argument(s) {unknown} are not supported: "
            f"transformers passes some arguments only to attention implementations other than "
            f"'eager' and 'sdpa' (for example a sparse attention's top-k `indices`), where they "
            f"change the result, and the SDPA fallback would ignore them; load this model with "
            f"attn_implementation='sdpa' or 'eager'")
    return _attention(_stock_sdpa_forward(), module, query, key, value, attention_mask, args,
                      kwargs, flash_semantics=True)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

_REGISTER_LOCK = threading.RLock()


def _version_counted(builder: Callable) -> Callable:
    """``builder`` (a transformers mask builder such as ``sdpa_mask``) whose masks have a version
    counter.

    Under ``torch.inference_mode()`` (where ``generate()`` is often called) every tensor is an
    inference tensor, which has no version counter, so the classification cache
    (``_masks.PerTensorCache``) cannot tell the mask from one mutated in place and never keeps
    it: every layer of a forward would classify the same mask again, with a host read each.
    The builder runs with inference mode off instead; the mask (the builder's own values) is an
    ordinary tensor, classified once per forward. Not while torch.compile or torch.jit trace
    (nothing is cached there), and a builder that cannot run outside inference mode (a mask
    function updating an inference tensor in place) runs as given.
    """

    @functools.wraps(builder)
    def build(*args, **kwargs):
        # is_compiling() first: dynamo cannot trace is_inference_mode_enabled().
        if (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
                and torch.is_inference_mode_enabled()):
            try:
                with torch.inference_mode(False):
                    return builder(*args, **kwargs)
            except RuntimeError as e:
                if "inference" not in str(e).lower():
                    raise
        return builder(*args, **kwargs)

    build._flash_attention_sm75_version_counted = True
    return build


_MASK_BUILDERS: Dict[Callable, Callable] = {}


def _kernel_mask_builder(builder: Callable) -> Callable:
    """The one :func:`_version_counted` wrapper of ``builder`` (registration is idempotent)."""
    wrapper = _MASK_BUILDERS.get(builder)
    if wrapper is None:
        wrapper = _MASK_BUILDERS[builder] = _version_counted(builder)
    return wrapper


def _install_flash_name_guard() -> None:
    """Stop transformers from trying to import a FlashAttention package for our name.

    transformers treats every ``attn_implementation`` containing ``"flash"`` as a FlashAttention
    flavour and, when a model is created or switched, calls ``lazy_import_flash_attention(name)``,
    which looks for ``flash_attn`` or a hub kernel and raises for ``"flash_attention_sm75"``;
    sentence-transformers calls the same function (from
    ``transformers.modeling_flash_attention_utils``) to ask whether a varlen function exists.
    The guard, installed in both modules that expose the function, answers for our name only:
    no FlashAttention functions (``None`` for each, so sentence-transformers keeps padded
    batches); every other name goes to transformers' function unchanged.
    """
    import importlib

    for module_name in ("transformers.modeling_utils",
                        "transformers.modeling_flash_attention_utils"):
        try:
            module = importlib.import_module(module_name)
        except Exception:  # pragma: no cover
            continue
        original = getattr(module, "lazy_import_flash_attention", None)
        if original is None or getattr(original, "_flash_attention_sm75_guard", False):
            continue
        module.lazy_import_flash_attention = _guarded_lazy_import(original)


def _guarded_lazy_import(original: Callable) -> Callable:
    """``original`` (transformers' ``lazy_import_flash_attention``), answering for our names."""

    @functools.wraps(original)
    def lazy_import_flash_attention(implementation, *args, **kwargs):
        base = (implementation.split("|")[-1] if isinstance(implementation, str)
                else implementation)
        if base in ATTENTION_NAMES:
            return (None, None, None, None, None), (None, None)
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._flash_attention_sm75_guard = True
    return lazy_import_flash_attention


def register() -> None:
    """Register the attention function with transformers (idempotent; done on import).

    Registers :func:`flash_attention_sm75_forward` with ``transformers.AttentionInterface`` and
    transformers' SDPA mask builder (``masking_utils.sdpa_mask``) with ``AttentionMaskInterface``
    under two names (without a mask builder transformers would pass no padding mask); the builder
    is wrapped so that its masks have a version counter under ``torch.inference_mode()`` too,
    which lets the integration classify a mask once per forward rather than once per layer
    (the values are ``sdpa_mask``'s):

    * ``"sm75_attention"`` (:data:`ATTENTION_NAME_PLAIN`), recommended: transformers treats it
      like any custom implementation, so every model calls it as it calls ``"sdpa"`` (vision
      towers attend per image, chunked attention and models that list compatible
      FlashAttention kernels keep working);
    * ``"flash_attention_sm75"`` (:data:`ATTENTION_NAME`): transformers treats any name
      containing ``"flash"`` as a FlashAttention flavour: it passes packed inputs as
      ``cu_seq_lens_*`` (honoured, see :func:`flash_attention_sm75_forward`), swaps the name for
      a hub kernel in models that declare ``_compatible_flash_implementations`` (gpt-oss,
      granite-swa, ...), picks the FlashAttention-2 classes of GPT-Neo, Falcon and Bark (which
      need the flash_attn package) and refuses chunked attention past the chunk size (Llama 4).

    Also installs the guard described in :func:`_install_flash_name_guard`.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _sdpa_attention_module()  # imported here, never while torch.compile traces a call
    with _REGISTER_LOCK:
        for name in ATTENTION_NAMES:
            AttentionInterface.register(name, flash_attention_sm75_forward)
            AttentionMaskInterface.register(name, _kernel_mask_builder(sdpa_mask))
        _install_flash_name_guard()


# ----------------------------------------------------------------------------------------------
# Patch of the "sdpa" entry
# ----------------------------------------------------------------------------------------------


class _PatchLayer:
    """One :func:`apply_patch` call still in effect: the ``model_types`` it asked for."""

    __slots__ = ("model_types",)

    def __init__(self, model_types: Optional[frozenset]) -> None:
        self.model_types = model_types


class _PatchState:
    def __init__(self) -> None:
        self.active = False
        # The model_types of the newest layer (what the wrappers read on every call).
        self.model_types: Optional[frozenset] = None
        # (mapping dict, key, previous function, wrapper, alive-flag list, what the entry is)
        self.entries: list = []
        # The apply_patch() calls in effect, oldest first. The wrapper is installed iff this is
        # non-empty, and model_types is the newest layer's.
        self.layers: list = []


_PATCH = _PatchState()


def _make_sdpa_wrapper(previous: Callable) -> Tuple[Callable, list]:
    alive = [True]

    @functools.wraps(previous)
    def sdpa_attention_forward(module, query, key, value, attention_mask=None, *args, **kwargs):
        if alive[0] and _PATCH.active:
            types = _PATCH.model_types
            model_type = getattr(getattr(module, "config", None), "model_type", None)
            if types is None or model_type in types:
                return _attention(previous, module, query, key, value, attention_mask, args,
                                  kwargs)
        return previous(module, query, key, value, attention_mask, *args, **kwargs)

    sdpa_attention_forward._flash_attention_sm75_patch = True
    return sdpa_attention_forward, alive


def _make_sdpa_mask_wrapper(previous: Callable) -> Tuple[Callable, list]:
    """The ``"sdpa"`` mask builder for the routed model types: ``previous``'s masks, with a
    version counter (:func:`_version_counted`), so that the patched attention classifies a mask
    once per forward under ``torch.inference_mode()`` too. Other models get ``previous``'s."""
    alive = [True]
    counted = _version_counted(previous)

    @functools.wraps(previous)
    def sdpa_mask(*args, **kwargs):
        if alive[0] and _PATCH.active:
            types = _PATCH.model_types
            if types is None or getattr(kwargs.get("config"), "model_type", None) in types:
                return counted(*args, **kwargs)
        return previous(*args, **kwargs)

    sdpa_mask._flash_attention_sm75_patch = True
    return sdpa_mask, alive


def _uninstall() -> None:
    """Put the previous ``"sdpa"`` functions back and forget every layer (lock held)."""
    for mapping, key, previous, wrapper, alive, what in _PATCH.entries:
        alive[0] = False
        if mapping.get(key) is wrapper:
            mapping[key] = previous
        else:
            logger.warning("the 'sdpa' %s entry was replaced after apply_patch(); leaving it in "
                           "place (our wrapper inside it is now inactive)", what)
    _PATCH.entries = []
    _PATCH.layers = []
    _PATCH.active = False
    _PATCH.model_types = None


class PatchHandle:
    """Returned by :func:`apply_patch`; undoes that one call (``remove()`` or leaving a ``with``).

    Every :func:`apply_patch` call adds a *layer* (its ``model_types``); the newest layer in
    effect decides which models are routed, and the ``"sdpa"`` wrapper is installed while at
    least one layer is in effect. Undoing a call removes its layer only, so:

    * **Nested use restores exactly the previous state.** After
      ``with apply_patch(None): with apply_patch(["llama"]): ...`` the inner block's exit routes
      every model type again (the outer call's ``None``), and the outer block's exit puts the
      original ``"sdpa"`` function back. The same holds for any depth.
    * **Out-of-order removal is supported**: the state becomes what it would be had the removed
      call never been made. Removing an outer handle while an inner one is in effect keeps the
      patch installed with the inner call's ``model_types``; removing the inner one afterwards
      restores the original ``"sdpa"`` function.
    * Undoing a call twice, or after :func:`remove_patch` (which removes every layer at once),
      does nothing; in particular it never touches a patch applied after that
      :func:`remove_patch`.

    Attributes
    ----------
    installed : bool
        Whether this call put the wrapper in place (``False`` when a patch was already in
        effect); set to ``False`` once the call is undone. It does not decide who removes the
        wrapper: the last layer to go does.
    """

    def __init__(self, installed: bool, layer: Optional[_PatchLayer] = None) -> None:
        self.installed = installed
        self._layer = layer

    @property
    def active(self) -> bool:
        """Whether this call is still in effect (neither undone nor cleared by
        :func:`remove_patch`)."""
        with _REGISTER_LOCK:
            return self._layer is not None and any(x is self._layer for x in _PATCH.layers)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> bool:
        """Undo this :func:`apply_patch` call (its layer only; see the class docstring).

        Returns
        -------
        bool
            ``True`` if the call was in effect and is now undone; ``False`` if it had already
            been undone or cleared by :func:`remove_patch` (nothing changes then).
        """
        with _REGISTER_LOCK:
            layer, self._layer = self._layer, None
            self.installed = False
            index = next((i for i, x in enumerate(_PATCH.layers) if x is layer), None)
            if layer is None or index is None:
                return False
            del _PATCH.layers[index]
            if _PATCH.layers:
                _PATCH.model_types = _PATCH.layers[-1].model_types
            else:
                _uninstall()
        return True


def apply_patch(model_types: Optional[Iterable[str]] = DEFAULT_PATCH_MODEL_TYPES) -> PatchHandle:
    """Route transformers' ``"sdpa"`` attention of Llama/Qwen2/Qwen3/Mistral to the kernel.

    Replaces the ``"sdpa"`` entry of ``transformers.AttentionInterface``'s global mapping (and of
    ``ALL_ATTENTION_FUNCTIONS``' local mapping, if someone overrode it there) with a wrapper.
    Models look the function up at every forward, so models loaded before and after the patch
    are affected. Attention layers whose ``config.model_type`` is not in ``model_types``, and
    calls after :func:`remove_patch`, go to the previous function unchanged. Unsupported calls
    fall back to the previous function too (see :func:`flash_attention_sm75_forward`). The
    ``"sdpa"`` entry of ``AttentionMaskInterface`` is wrapped alongside: for the routed model
    types it builds the same masks with a version counter under ``torch.inference_mode()``
    (see :func:`register`), and both entries are restored together.

    Parameters
    ----------
    model_types : iterable of str or None, optional
        ``config.model_type`` values to route (default :data:`DEFAULT_PATCH_MODEL_TYPES`:
        ``llama``, ``qwen2``, ``qwen3``, ``mistral``). ``None`` routes every model that uses
        ``"sdpa"``.

    Returns
    -------
    PatchHandle
        Undoes this call: ``handle.remove()``, or as a context manager
        (``with apply_patch(): ...``) on exit. See :class:`PatchHandle` for nesting.

    Raises
    ------
    ImportError
        If transformers is not installed (nothing is patched then).
    ValueError
        If ``model_types`` is a single string (write ``["llama"]``, not ``"llama"``) or contains
        anything but strings (nothing is patched then).

    Notes
    -----
    Calls stack: there is never more than one wrapper, and the newest call in effect decides
    ``model_types``. Undoing a call (its handle) brings back the state before it: the
    ``model_types`` of the previous call still in effect, or the original ``"sdpa"`` function
    when it was the only one. Removal in any order is supported (:class:`PatchHandle`).
    :func:`remove_patch` removes the patch whatever the number of calls in effect.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if isinstance(model_types, str):
        raise ValueError(f"flash_attention_sm75: apply_patch(model_types=...) takes an iterable of "
                         f"model_type strings or None, got the string {model_types!r}; write "
                         f"[{model_types!r}]")
    iterable = isinstance(model_types, collections.abc.Iterable)
    types = frozenset(model_types) if iterable else None
    if model_types is not None and (not iterable or not all(isinstance(t, str) for t in types)):
        raise ValueError(f"flash_attention_sm75: apply_patch(model_types=...) takes an iterable of "
                         f"model_type strings or None, got {model_types!r}")
    with _REGISTER_LOCK:
        register()
        layer = _PatchLayer(types)
        installed = not _PATCH.active
        if installed:
            entries = []
            for interface, registry, make, what in (
                    (AttentionInterface, ALL_ATTENTION_FUNCTIONS, _make_sdpa_wrapper, "attention"),
                    (AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS,
                     _make_sdpa_mask_wrapper, "mask builder")):
                maps = [interface._global_mapping]
                local = getattr(registry, "_local_mapping", None)
                if isinstance(local, dict) and "sdpa" in local:
                    maps.append(local)
                for mapping in maps:
                    if "sdpa" not in mapping:  # pragma: no cover - no such builder to wrap
                        continue
                    previous = mapping["sdpa"]
                    wrapper, alive = make(previous)
                    mapping["sdpa"] = wrapper
                    entries.append((mapping, "sdpa", previous, wrapper, alive, what))
            _PATCH.entries = entries
            _PATCH.layers = []
            _PATCH.active = True
        _PATCH.layers.append(layer)
        _PATCH.model_types = types
    return PatchHandle(installed=installed, layer=layer)


def remove_patch() -> bool:
    """Remove the patch entirely: put the previous ``"sdpa"`` function back.

    Unlike :meth:`PatchHandle.remove`, which undoes one :func:`apply_patch` call, this undoes
    all of them at once; their handles then do nothing (and never affect a later patch).

    Returns
    -------
    bool
        ``True`` if a patch was removed, ``False`` if none was active (calling it twice is
        harmless).

    Notes
    -----
    If someone replaced the ``"sdpa"`` entry after :func:`apply_patch` (wrapping ours), their
    entry is left in place and our wrapper inside it becomes a pass-through to the function it
    wrapped.
    """
    with _REGISTER_LOCK:
        if not _PATCH.active:
            return False
        _uninstall()
    return True


def is_patched() -> bool:
    """Return whether :func:`apply_patch` is in effect."""
    return _PATCH.active


try:
    register()
except ImportError as _e:  # pragma: no cover - transformers missing or too old
    logger.debug("transformers integration not registered: %s", _e)
