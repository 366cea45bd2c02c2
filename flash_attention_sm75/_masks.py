"""Attention masks as the kernel sees them: classification into per-row key ranges.

The kernel applies no mask tensor. It sees, per batch row ``b``, the keys
``leftpad_k[b] <= j < seqused_k[b]``, optionally intersected with a bottom-right causal diagonal.
:func:`classify_attention_mask` decides whether a boolean or additive mask is exactly such a
pattern and with which arguments; the SDPA wrapper and the transformers integration both ask it.
It reads the mask on the host (one synchronisation), so it refuses while ``torch.compile`` traces
or a CUDA graph captures (:func:`host_reads_allowed`): a decision taken at capture would be
replayed with whatever the mask holds later.
"""
from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch

__all__ = ["MaskInfo", "classify_attention_mask", "host_reads_allowed", "PerTensorCache"]



@dataclass(frozen=True)
class MaskInfo:
    """How an attention mask maps onto the op's arguments.

    Attributes
    ----------
    causal : bool
        Pass ``is_causal=True`` (bottom-right aligned: key ``j`` visible to query ``i`` iff
        ``j <= i + kv_len - q_len``).
    kv_len : int
        Number of keys to pass to the op (``key[:, :, :kv_len]``); smaller than the key length
        when the mask hides every key beyond it (e.g. a static cache's unused slots), which moves
        the causal diagonal accordingly.
    leftpad_k, seqused_k : torch.Tensor or None
        int32 ``(B,)`` tensors on the mask's device: keys ``leftpad_k[b] <= j < seqused_k[b]``
        are visible in batch row ``b``. ``None`` means no key-range restriction.
    kind : str
        Human-readable category (``"none"``, ``"causal"``, ``"causal+key-range"``,
        ``"causal+key-range (truncated keys)"``, ``"key-range"``, and those with ``"+window"``).
    window_size : (int, int)
        The op's sliding window ``(left, right)`` (bottom-right aligned like ``causal``);
        ``(-1, -1)``: none.
    """

    causal: bool
    kv_len: int
    leftpad_k: Optional[torch.Tensor]
    seqused_k: Optional[torch.Tensor]
    kind: str
    window_size: Tuple[int, int] = (-1, -1)


_Classification = Tuple[Optional[MaskInfo], Optional[str]]


def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether the integration may read ``t``'s values on the host (one synchronisation).

    Not while ``torch.compile`` / ``torch.jit`` trace (a data-dependent branch breaks the graph
    or fails ``fullgraph=True``) and not while a CUDA graph captures (a synchronisation is
    illegal there, and a decision taken at capture would be replayed with whatever the tensor
    holds later). On those paths the integration takes decisions from shapes alone and leaves
    data-dependent work (a mask) to torch SDPA, which reads it on the device at every replay.
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


class PerTensorCache:
    """A few results keyed on a tensor object, for values transformers hands to every layer.

    transformers passes the same mask (and ``position_ids``) tensor to each layer of a forward,
    so deciding once per object saves a host synchronisation per layer. An entry is used only
    for the same object (weak reference) with the same data pointer, shape, strides, dtype,
    device, version counter and ``extra`` key (one entry per object and ``extra``); tensors
    without a version counter (inference tensors, which can change in place unseen) are not
    cached, unless ``verify_inference`` (then each hit checks their values against a copy, on
    the device, failing loudly on a change). Writes that bypass the version counter (through ``t.data`` or a NumPy view) are not
    seen either, as autograd does not see them. Callers use it only where
    :func:`host_reads_allowed` holds, so no entry is consulted or made under tracing or
    capture.
    """

    def __init__(self, size: int = 8, verify_inference: bool = False) -> None:
        self._size = size
        # verify_inference: inference tensors are cached too, with a copy of their values; a hit
        # enqueues a comparison with the copy that fails loudly (torch._assert_async: an error
        # on the CPU, a device-side assertion on CUDA) if they changed in place. For small
        # tensors read on every layer (position_ids under inference_mode, as generate() runs):
        # one small kernel per layer instead of a host synchronisation per layer.
        self._verify_inference = verify_inference
        self._lock = threading.Lock()
        self._entries: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()

    def _signature(self, t: torch.Tensor, extra: tuple) -> Optional[tuple]:
        # Inference tensors have no version counter. Asked first: reading their _version raises
        # a C++ error whose backtrace costs ~50 us, twice per call (get and put).
        if t.is_inference():
            if not self._verify_inference:
                return None
            return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, "inference") + extra
        try:
            version = t._version
        except RuntimeError:  # any other tensor without one
            return None
        # t.shape (a torch.Size) and t.stride() are tuples already.
        return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, version) + extra

    def get(self, t: torch.Tensor, extra: tuple,
            position: Optional[tuple] = None) -> Optional[Any]:
        """The cached value for ``t`` and ``extra``, or None.

        ``position``: where in a forward the asking call is, ``(owner, layer, call)``: ``owner``
        an object the layers of one model share (transformers' config), ``layer`` the asking
        layer's index (``layer_idx``), ``call`` an object that lives only during the asking call
        (its query tensor); or None. An inference tensor's hit is checked against its copy
        (three launches) unless the previous get or put on the entry came from the same owner
        at a lower layer, or from this same call: within one forward the layers of a model ask
        in increasing order, so the values are checked once per forward, at its first layer.
        Every other sequence checks: another model, a layer that is not above the last one (a
        new forward), a call without a position. An in-place change between two layers of one
        forward is not seen, as writes through ``.data`` are not."""
        signature = self._signature(t, extra)
        if signature is None:
            return None
        key = (id(t), extra)
        with self._lock:
            hit = self._entries.get(key)
            if hit is None or hit[0]() is not t or hit[1] != signature:
                return None
            self._entries.move_to_end(key)
            last = hit[4][0]
            hit[4][0] = _position_record(position)
        if hit[3] is not None and _same_forward(last, position):
            return hit[2]  # the forward's first call here checked the values
        if hit[3] is not None:  # an inference tensor: its values must be the ones cached
            torch._assert_async((t == hit[3]).all(),
                                "flash_attention_sm75: a tensor whose values were cached "
                                "(position_ids) was changed in place under inference_mode; "
                                "pass a new tensor instead")
        return hit[2]

    def put(self, t: torch.Tensor, extra: tuple, value: Any,
            position: Optional[tuple] = None) -> None:
        signature = self._signature(t, extra)
        if signature is None:
            return
        try:
            ref = weakref.ref(t)
        except TypeError:  # pragma: no cover
            return
        snapshot = t.detach().clone() if t.is_inference() else None
        key = (id(t), extra)
        with self._lock:
            for k in [k for k, v in self._entries.items() if v[0]() is None]:
                del self._entries[k]
            # [position]: that of the last get or put (see get), mutable in place.
            self._entries[key] = (ref, signature, value, snapshot, [_position_record(position)])
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _position_record(position: Optional[tuple]) -> Optional[tuple]:
    """PerTensorCache's record of a get / put position: weak references to its owner and call
    (neither is kept alive; a dead one matches nothing), the layer as is."""
    if position is None:
        return None
    owner, layer, call = position
    try:
        return weakref.ref(owner), layer, weakref.ref(call)
    except TypeError:  # pragma: no cover - an owner without weak references: always check
        return None


def _same_forward(last: Optional[tuple], position: Optional[tuple]) -> bool:
    """Whether ``position`` follows ``last`` within one forward (see PerTensorCache.get)."""
    if last is None or position is None:
        return False
    owner, layer, call = position
    if last[0]() is not owner:
        return False
    return layer > last[1] or (layer == last[1] and last[2]() is call)


_MASK_CACHE = PerTensorCache()
# Packed-sequence detection from position_ids (the transformers integration).
POSITION_IDS_CACHE = PerTensorCache(verify_inference=True)


def broadcast_base(t: torch.Tensor, dims: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``t`` with every broadcast dimension (stride 0, size > 1) among ``dims`` (default: all)
    narrowed to size 1: the values an ``expand()``-ed view holds, without its size. Element-wise
    work on the result allocates what the view stores, not what it spans."""
    for d in range(t.dim()) if dims is None else dims:
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


# A finite "dtype minimum" in an additive mask hides a key exactly (its weight is 0 in torch's
# float32 softmax, as when the key is skipped) only if it outweighs any gap between two scores
# the kernels form: the float32 / bfloat16 minimum (-3.4e38) does. Float16's (-65504) does not:
# a hidden key whose score is 65504 above the row's visible ones keeps its weight in torch, so a
# mask holding it is not a key range; it runs as a bias (exact) or falls back.
_BLOCKING_MINIMUM = -1e38


def _blocked_values(mask: torch.Tensor, query_dtype: Optional[torch.dtype]) -> torch.Tensor:
    blocked = torch.isneginf(mask)
    mins = [torch.finfo(mask.dtype).min]
    if query_dtype is not None and query_dtype.is_floating_point and query_dtype != mask.dtype:
        qmin = torch.finfo(query_dtype).min
        if qmin >= mins[0]:  # representable in the mask's dtype
            mins.append(qmin)
    for value in mins:
        if value <= _BLOCKING_MINIMUM:
            blocked |= mask == value
    return blocked


def _describe_mismatch(allowed: torch.Tensor) -> str:
    """Name the way a boolean (B, Sq, Sk) mask departs from 'causal AND key range' (one sync)."""
    sk = allowed.shape[-1]
    as_int = allowed.to(torch.int32)
    count = as_int.sum(-1)
    first = as_int.argmax(-1)
    end = sk - as_int.flip(-1).argmax(-1)
    nonempty = count > 0
    holes = (nonempty & (count != end - first)).any()
    big = torch.iinfo(torch.int64).max
    first64 = first.to(torch.int64)
    start_min = torch.where(nonempty, first64, big).amin(-1)
    start_max = torch.where(nonempty, first64, -1).amax(-1)
    moving_start = (start_max > start_min).any()
    holes_, moving_ = torch.stack([holes, moving_start]).tolist()
    if holes_:
        return ("mask rows have non-contiguous visible keys (packed-sequence/document or "
                "arbitrary mask)")
    if moving_:
        return ("the first visible key moves with the query (sliding-window, chunked or "
                "packed-sequence mask)")
    return "mask is not causal AND a per-row key range (arbitrary mask)"


def _invalid_reason(mask: torch.Tensor, invalid: list) -> Optional[str]:
    """Why the mask's values cannot run at all, from the flags gathered by
    :func:`_classify_uncached` (float masks: other values, empty rows hidden by a finite
    minimum; masks with heads: a difference between heads), or None."""
    if mask.dtype != torch.bool and invalid[0]:
        return ("float attention_mask has values other than 0, -inf and the float32 / bfloat16 "
                "minimum (float16's minimum, -65504, is one: it does not hide a key whose score "
                "is 65504 above the visible ones)")
    if mask.dtype != torch.bool and invalid[1]:
        return ("a query row sees no key but is hidden by the dtype's finite minimum, not "
                "-inf (torch averages V over such a row; the kernel gives 0)")
    if mask.shape[1] > 1 and invalid[-1]:
        return "attention_mask differs between heads"
    return None


def _classify_single_row(mask: torch.Tensor, row: torch.Tensor, flags: list, batch_size: int,
                         kv_len: int) -> "_Classification":
    """A mask with one query row, ``row`` its (bm, kv_len) boolean "visible" values: decode
    (q_len == 1), or a mask the same for every query. Its only pattern is a key range (one row
    has no causal diagonal to speak of; the same keys for every query are not causal), so the
    general passes are not needed: the visible keys of a row are a range iff they form at most
    one run. About half the device work of the general case (ten small kernels for a boolean
    mask), and the same single host read: ``flags`` (:func:`_classify_uncached`'s) with the
    largest run count and visible-key count."""
    r = row.to(torch.int32)
    count = r.sum(-1, dtype=torch.int32)  # visible keys per row
    lo = r.argmax(-1).to(torch.int32)  # the first (0 in an empty row)
    hi = lo + count  # one past the last when they are one run (0 in an empty row)
    runs = (r[:, 1:] > r[:, :-1]).sum(-1, dtype=torch.int32) + r[:, 0]  # runs of visible keys
    values = torch.stack([f.to(torch.int32) for f in flags]
                         + [runs.amax(), count.amax()]).tolist()
    max_runs, max_count = values[-2:]
    reason = _invalid_reason(mask, values[:-2])
    if reason is not None:
        return None, reason
    if max_count == 0:
        return None, "attention_mask hides every key"
    if max_runs > 1:
        return None, _describe_mismatch(row[:, None, :])
    if row.shape[0] != batch_size:
        lo = lo.expand(batch_size).contiguous()
        hi = hi.expand(batch_size).contiguous()
    return MaskInfo(False, kv_len, lo, hi, "key-range"), None


def _classify_uncached(mask: torch.Tensor, batch_size: int, q_len: int, kv_len: int,
                       query_dtype: Optional[torch.dtype],
                       exact_empty_rows: bool = False,
                       sliding_window: Optional[int] = None) -> "_Classification":
    if mask.dim() != 4:
        return None, f"attention_mask is {mask.dim()}-D, expected a 4-D (B, 1, q_len, kv_len) mask"
    bm, hm, sqm, skm = mask.shape
    if skm != kv_len:
        return None, f"attention_mask has {skm} key columns but there are {kv_len} keys"
    if bm not in (1, batch_size) or sqm not in (1, q_len):
        return None, (f"attention_mask shape {list(mask.shape)} does not broadcast to "
                      f"({batch_size}, *, {q_len}, {kv_len})")
    if kv_len == 0 or q_len == 0:
        return None, "empty query or key sequence"
    # An expanded mask (stride-0 batch, head or query dimensions, as torch's SDPA callers build
    # them) is classified on the one slice it holds: the passes below would otherwise allocate
    # temporaries of its full (B, H, q_len, kv_len) size on the device.
    mask = broadcast_base(mask, dims=(0, 1, 2))
    bm, hm, sqm, skm = mask.shape

    # The 0-d flags below are gathered into one host sync at the end.
    flags = []
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.dtype.is_floating_point:
        allowed = mask == 0
        blocked = _blocked_values(mask, query_dtype)
        flags.append(~(allowed | blocked).all())
        # A row that sees no key but is hidden (partly) by a *finite* minimum is not empty to
        # torch: the same huge number is added to those scores and softmax averages V over them.
        # The kernel returns 0 for an empty row, so such a mask must fall back.
        if exact_empty_rows:
            flags.append((~allowed.any(-1) & (blocked & ~torch.isneginf(mask)).any(-1)).any())
        else:
            flags.append(torch.zeros((), dtype=torch.bool, device=mask.device))
    else:
        return None, f"attention_mask dtype {mask.dtype} is neither bool nor floating point"

    if hm > 1:
        flags.append((allowed != allowed[:, :1]).any())
    allowed = allowed[:, 0]  # (bm, sqm, kv_len)
    n_invalid = len(flags)
    if sqm == 1:
        return _classify_single_row(mask, allowed[:, 0], flags, batch_size, kv_len)

    dev = allowed.device
    col_any = allowed.any(dim=1)  # (bm, kv_len): key j visible to some query of row b
    col_i32 = col_any.to(torch.int32)
    has_any = col_any.any(dim=-1)
    lo = torch.where(has_any, col_i32.argmax(-1), 0)
    hi = torch.where(has_any, kv_len - col_i32.flip(-1).argmax(-1), 0)
    max_hi = hi.max()

    j = torch.arange(kv_len, device=dev)
    in_range = (j >= lo[:, None]) & (j < hi[:, None])  # (bm, kv_len)

    # Candidate A: causal, bottom-right on the full key length (dynamic cache, no cache).
    # Candidate B: causal, bottom-right on keys [0, max(seqused)) (static cache slots unused).
    # Candidate C: key range only (bidirectional padding masks; decode).
    # Candidates A' and B' (a sliding_window hint, transformers' sliding layers): A and B whose
    # rows also see only the window's last `sliding_window` keys up to the diagonal (the op's
    # window (sliding_window - 1, 0)). A mask matching both A and A' (no row reaches past its
    # window) runs as A.
    # Here sqm == q_len > 1 (one query row went to _classify_single_row).
    windowed = sliding_window is not None
    i = torch.arange(q_len, device=dev)[:, None]
    for off in (kv_len - q_len, max_hi - q_len):
        expected = in_range[:, None, :] & (j[None, :] <= i + off)[None]
        flags.append(expected.bitwise_xor_(allowed).any())
        del expected
    flags.append((allowed ^ in_range[:, None, :]).any())
    if windowed:
        for off in (kv_len - q_len, max_hi - q_len):
            dist = (i + off) - j[None, :]
            expected = in_range[:, None, :] & ((dist >= 0) & (dist < sliding_window))[None]
            flags.append(expected.bitwise_xor_(allowed).any())
            del expected, dist
    else:
        flags.extend([torch.ones((), dtype=torch.bool, device=dev)] * 2)

    values = torch.stack([f.to(torch.int64) for f in flags] + [max_hi.to(torch.int64)]).tolist()
    invalid = values[:n_invalid]
    mis_a, mis_b, mis_c, mis_aw, mis_bw, max_hi_val = values[n_invalid:]

    reason = _invalid_reason(mask, invalid)
    if reason is not None:
        return None, reason

    if bm != batch_size:
        lo = lo.expand(batch_size)
        hi = hi.expand(batch_size)
    leftpad = lo.to(torch.int32).contiguous()
    seqused = hi.to(torch.int32).contiguous()

    if max_hi_val == 0:
        return None, "attention_mask hides every key"
    if not mis_a:
        return MaskInfo(True, kv_len, leftpad, seqused, "causal+key-range"), None
    if not mis_b:
        return MaskInfo(True, int(max_hi_val), leftpad, seqused,
                        "causal+key-range (truncated keys)"), None
    if not mis_c:
        return MaskInfo(False, kv_len, leftpad, seqused, "key-range"), None
    window = (sliding_window - 1, 0) if windowed else (-1, -1)
    if not mis_aw:
        return MaskInfo(True, kv_len, leftpad, seqused, "causal+key-range+window", window), None
    if not mis_bw:
        return MaskInfo(True, int(max_hi_val), leftpad, seqused,
                        "causal+key-range+window (truncated keys)", window), None
    return None, _describe_mismatch(allowed)


def classify_attention_mask(
    attention_mask: torch.Tensor,
    batch_size: int,
    q_len: int,
    kv_len: int,
    query_dtype: Optional[torch.dtype] = None,
    exact_empty_rows: bool = False,
    sliding_window: Optional[int] = None,
) -> Tuple[Optional[MaskInfo], Optional[str]]:
    """Decide whether a transformers attention mask runs on the kernel, and with which arguments.

    The op sees, per batch row ``b``, the keys ``leftpad_k[b] <= j < seqused_k[b]``, optionally
    intersected with a bottom-right causal diagonal. The mask is accepted only if it equals such a
    pattern **exactly**: the key range is derived from the columns the mask uses anywhere in the
    row (``leftpad_k`` = first, ``seqused_k`` = last + 1), the pattern is rebuilt and compared
    element-wise with the mask. Three patterns are tried: causal on all ``kv_len`` keys (no cache
    or a dynamic cache, left/right padding, chunked prefill), causal on the keys before
    ``max(seqused_k)`` (a static cache whose later slots are unused) and no causal diagonal
    (bidirectional padding masks; decode, where one query row makes the diagonal irrelevant).

    Parameters
    ----------
    attention_mask : torch.Tensor
        4-D ``(B or 1, 1 or H, q_len or 1, kv_len)`` mask: bool (True = attend) or floating point
        additive (0 = attend, ``-inf`` or the float32 / bfloat16 minimum = masked; any other
        value, float16's minimum -65504 included, makes it no key range: a hidden key whose
        score exceeds the visible ones by 65504 keeps its weight in torch). A mask that differs
        between heads is no key range either.
    batch_size, q_len, kv_len : int
        Sizes of the query and key tensors.
    query_dtype : torch.dtype, optional
        dtype of the query; the minimum of this dtype also counts as "masked" in a float mask of
        a wider dtype (where it is the float32 / bfloat16 minimum).
    exact_empty_rows : bool, optional
        ``True`` (the SDPA wrapper, a drop-in for torch): a float mask in which a query row sees
        no key but is hidden by the finite minimum rather than ``-inf`` falls back, since torch
        averages V over such a row and the kernel gives 0. ``False`` (default; transformers,
        where such rows are padding queries whose outputs no real token reads): those rows are
        0, as every row that sees no key.
    sliding_window : int, optional
        A window the mask may carry (transformers passes its sliding layers' ``sliding_window``):
        two more causal patterns are tried, A and B whose query rows see only the last
        ``sliding_window`` keys up to their diagonal; such a mask runs with the op's
        ``window_size = (sliding_window - 1, 0)``. Only a hint: the mask decides.

    Returns
    -------
    info : MaskInfo or None
        The op arguments, or ``None`` if the mask must fall back.
    reason : str or None
        Why it falls back (``None`` when ``info`` is given).

    Notes
    -----
    Cost: a few element-wise passes over the mask and **one** host synchronisation (a single
    ``.tolist()`` of the stacked 0-d flags); a mask that falls back costs one more to name the
    reason. The result is cached per mask object (transformers passes the same mask tensor to
    every layer of a forward), keyed on identity (weak reference), data pointer, shape, strides
    and version counter; inference tensors (no version counter) are classified at every call.

    While ``torch.compile`` traces or a CUDA graph captures, no mask is read on the host: the
    answer is ``(None, reason)`` and the caller hands the mask to torch SDPA, which reads it on
    the device at every replay (a key range decided at capture would be replayed stale).
    """
    if not host_reads_allowed(attention_mask):
        return None, ("a mask cannot be classified while torch.compile traces or a CUDA graph "
                      "captures (no host read of device values there); torch SDPA applies it")
    window = None if sliding_window is None else int(sliding_window)
    extra = (int(batch_size), int(q_len), int(kv_len), query_dtype, bool(exact_empty_rows), window)
    hit = _MASK_CACHE.get(attention_mask, extra)
    if hit is not None:
        return hit
    result = _classify_uncached(attention_mask, int(batch_size), int(q_len), int(kv_len),
                                query_dtype, exact_empty_rows, window)
    _MASK_CACHE.put(attention_mask, extra, result)
    return result


def clear_caches() -> None:
    """Forget every cached classification (tests)."""
    _MASK_CACHE.clear()
    POSITION_IDS_CACHE.clear()


# ----------------------------------------------------------------------------------------------
# Rows that see no key, on the paths that fall back to torch (the SDPA wrapper, the transformers
# integration): one implementation for both.
# ----------------------------------------------------------------------------------------------


def without_empty_rows(attn_mask) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(visible_mask, empty)`` for a dense bool or float mask, else None (nothing to do).

    ``empty`` marks the query rows that see no key (bool: all False; float: all ``-inf``; a
    finite "dtype minimum" row is not empty: torch adds that number and averages V over those
    keys), as a bool tensor with the mask's dimensions and a last dimension of 1.
    ``visible_mask`` is the mask with those rows made fully visible (True / 0.0) and every
    other row unchanged (same shape and dtype). A caller runs torch with ``visible_mask`` and
    zeroes the ``empty`` rows of its output: 0 forward (the kernel's answer and the definition's
    limit) and 0 gradients through those rows, whatever torch's backend makes of a row without
    keys (NaN from some, an average of V from others, NaN gradients to every key through such a
    row), and every other row exactly torch's.

    Device ops only (no host read, no branch on values): traceable by torch.compile and
    capturable in a CUDA graph. Dimensions broadcast by stride 0 (an expanded mask) are read
    once and stay expanded in ``visible_mask`` (no copy the size of the broadcast mask), and
    ``empty`` has size 1 there.
    """
    if (not isinstance(attn_mask, torch.Tensor) or attn_mask.is_nested
            or attn_mask.layout != torch.strided or attn_mask.dim() == 0
            or attn_mask.shape[-1] == 0
            or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())):
        return None
    base = broadcast_base(attn_mask)
    if base.dtype == torch.bool:
        empty = ~base.any(dim=-1, keepdim=True)
        visible = base | empty
    else:
        empty = (base == float("-inf")).all(dim=-1, keepdim=True)
        visible = base.masked_fill(empty, 0.0)
    if visible.shape != attn_mask.shape:
        visible = visible.expand(attn_mask.shape)
    return visible, empty
