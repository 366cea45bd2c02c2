"""CPU tests of the HF integration's host work per forward (run in CI, no GPU needed).

transformers hands one mask object to every layer of a forward; deciding how it maps onto the
kernel (classification: element-wise passes over the mask and one host read, a synchronisation
on a GPU) must happen once per forward, not once per layer, including under
``torch.inference_mode()``, where tensors have no version counter to key a cache on. And the
decode step must not read anything on the host beyond that:

* classifications per ``generate()`` (counted calls into the classifier) and host reads per
  attention call (``devtools.host_reads.HostReadCounter``, which sees ``.item()``,
  ``.tolist()``, ``bool(t)``, ...): one per forward with a padding mask, none without one;
* the per-object cache never answers for another tensor or a mutated one (in-place change,
  a new mask in the freed one's memory, inference tensors, other call sizes);
* the mask builders (registered names, and the ``"sdpa"`` builder while patched) give
  ``sdpa_mask``'s values, and the model results equal those with ``sdpa_mask`` itself, bitwise;
* the decision remembered for layers 1..L-1 (``_decision_key``) is never used for a call whose
  inputs differ: every call of a layer sequence does what the full path does, through new or
  changed masks, settings, position_ids, windows, causality, forward AD and torch.compile.
"""
import copy
import gc
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    causal_mask_function,
    sdpa_mask,
)
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from flash_attention_sm75 import _masks, _ops  # noqa: E402
from flash_attention_sm75.sdpa import strict  # noqa: E402
from flash_attention_sm75.integrations import transformers as hf  # noqa: E402
from devtools.host_reads import HostReadCounter  # noqa: E402
from devtools.model_configs import build_random_model, make_config  # noqa: E402
# _clean_state (autouse): settings, patch, statistics and caches reset around each test
from test_transformers import _clean_state, _hf_mask, _padded_batch  # noqa: E402,F401

needs_op = pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                              reason=f"extension not built: {_ops.EXTENSION_ERROR}")


@pytest.fixture(autouse=True)
def _registries():
    """transformers' attention and mask-builder registries as they were before the test."""
    saved = [(m, dict(m)) for m in (AttentionInterface._global_mapping,
                                    AttentionMaskInterface._global_mapping)]
    yield
    for mapping, entries in saved:
        mapping.clear()
        mapping.update(entries)


@pytest.fixture
def classifications(monkeypatch):
    """The arguments of every call into the mask classifier (cache misses)."""
    calls = []
    inner = _masks._classify_uncached

    def counting(mask, *args, **kwargs):
        calls.append((tuple(mask.shape), mask.is_inference()))
        return inner(mask, *args, **kwargs)

    monkeypatch.setattr(_masks, "_classify_uncached", counting)
    return calls


@pytest.fixture
def reads_per_call(monkeypatch):
    """(q_len, layer_idx, host reads) of every call into the attention function."""
    calls = []
    inner = hf._attention

    def counting(fallback, module, query, *args, **kwargs):
        with HostReadCounter() as reads:
            out = inner(fallback, module, query, *args, **kwargs)
        calls.append((query.shape[2], module.layer_idx, reads.names))
        return out

    monkeypatch.setattr(hf, "_attention", counting)
    return calls


def _generate(model, ids, am, new_tokens, grad_mode):
    with grad_mode():
        return model.generate(ids, attention_mask=am, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)


# ---------------------------------------------------------------------------------------------
# Once per forward, not once per layer
# ---------------------------------------------------------------------------------------------


@needs_op
@pytest.mark.parametrize("grad_mode", [torch.inference_mode, torch.no_grad],
                         ids=["inference_mode", "no_grad"])
@pytest.mark.parametrize("name", [hf.ATTENTION_NAME_PLAIN, "patched sdpa"])
def test_a_padded_generate_classifies_the_prefill_mask_once_and_no_decode_mask(name, grad_mode, classifications,
                                                     reads_per_call):
    hf.configure(allow_cpu_reference=True)
    layers, new = 3, 4
    model = build_random_model("qwen2", dtype=torch.float16, seed=1, num_hidden_layers=layers,
                               attn_implementation="sdpa" if name == "patched sdpa" else name)
    if name == "patched sdpa":
        hf.apply_patch()
    ids, am = _padded_batch([9, 4, 7], seed=2)
    _generate(model, ids, am, new, grad_mode)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == layers and stats["kernel_decode"] == layers * (new - 1)
    assert stats["fallback"] == 0, stats
    # the prefill's mask classified once (by layer 0); the decode steps' masks never: the
    # decode kernel reads them as its bias, so a decode step reads nothing on the host
    assert len(classifications) == 1 and classifications[0][0][2] > 1, classifications
    assert not any(inference for _, inference in classifications)
    decode = [(layer, names) for q_len, layer, names in reads_per_call if q_len == 1]
    assert len(decode) == layers * (new - 1)
    assert all(names == [] for layer, names in decode), decode


@needs_op
@pytest.mark.parametrize("grad_mode", [torch.inference_mode, torch.no_grad],
                         ids=["inference_mode", "no_grad"])
def test_decode_without_padding_reads_nothing_on_the_host(grad_mode, classifications,
                                                          reads_per_call):
    hf.configure(allow_cpu_reference=True)
    model = build_random_model("llama", dtype=torch.float16, seed=3, num_hidden_layers=2,
                               attn_implementation=hf.ATTENTION_NAME_PLAIN)
    ids, am = _padded_batch([8, 8], seed=4)  # no padding: transformers passes no mask
    _generate(model, ids, am, 4, grad_mode)
    assert hf.get_stats()["kernel_decode"] == 2 * 3
    assert classifications == []
    decode = [names for q_len, _, names in reads_per_call if q_len == 1]
    assert len(decode) == 6 and all(names == [] for names in decode), decode


# ---------------------------------------------------------------------------------------------
# The cache never answers for another or a changed tensor
# ---------------------------------------------------------------------------------------------


def _decode_mask(lengths, kv_len):
    """transformers' decode mask (B, 1, 1, kv_len) for left-padded rows of these lengths."""
    _, am = _padded_batch(lengths, side="left")
    am = torch.nn.functional.pad(am, (kv_len - am.shape[1], 0))
    return _hf_mask(len(lengths), 1, kv_len, am, q_offset=kv_len - 1)


def test_a_mask_mutated_in_place_is_classified_again(classifications):
    with torch.inference_mode():
        mask = _decode_mask([6, 3], 6)
        mask = hf._kernel_mask_builder(sdpa_mask)(
            batch_size=2, q_length=1, kv_length=6, q_offset=5, kv_offset=0,
            mask_function=causal_mask_function, attention_mask=mask[:, 0, 0],
            allow_is_causal_skip=False)
        assert not mask.is_inference()
        info, _ = hf.classify_attention_mask(mask, 2, 1, 6)
        assert info.leftpad_k.tolist() == [0, 3]
        assert hf.classify_attention_mask(mask, 2, 1, 6)[0] is info  # cached
        mask[1, 0, 0, 4] = False  # a hole in row 1, in place (inference mode allows it)
        info2, reason = hf.classify_attention_mask(mask, 2, 1, 6)
        assert info2 is None and "non-contiguous" in reason
        mask[1, 0, 0, :4] = False  # row 1 now sees key 5 only
        info3, _ = hf.classify_attention_mask(mask, 2, 1, 6)
        assert info3.leftpad_k.tolist() == [0, 5] and info3.seqused_k.tolist() == [6, 6]
    assert len(classifications) == 3


def test_a_new_mask_in_the_freed_memory_is_classified_again(classifications):
    first = _decode_mask([6, 3], 6).clone()
    info, _ = hf.classify_attention_mask(first, 2, 1, 6)
    assert info.leftpad_k.tolist() == [0, 3]
    address = first.data_ptr()
    del first
    gc.collect()
    second = _decode_mask([2, 5], 6).clone()  # same shape; usually the same memory and id
    info2, _ = hf.classify_attention_mask(second, 2, 1, 6)
    assert info2.leftpad_k.tolist() == [4, 1], (address == second.data_ptr())
    assert len(classifications) == 2


def test_inference_tensors_are_never_cached(classifications):
    with torch.inference_mode():
        mask = _decode_mask([6, 3], 6)
    assert mask.is_inference()
    assert hf.classify_attention_mask(mask, 2, 1, 6)[0].leftpad_k.tolist() == [0, 3]
    with torch.inference_mode():
        mask[0, 0, 0, :2] = False  # no version counter would see this
    assert hf.classify_attention_mask(mask, 2, 1, 6)[0].leftpad_k.tolist() == [2, 3]
    assert len(classifications) == 2


def test_other_call_sizes_get_their_own_entry(classifications):
    mask = _hf_mask(1, 4, 4).clone()  # (1, 1, 4, 4): broadcast over any batch
    two, _ = hf.classify_attention_mask(mask, 2, 4, 4)
    three, _ = hf.classify_attention_mask(mask, 3, 4, 4)
    assert two.causal and two.leftpad_k.shape == (2,) and three.leftpad_k.shape == (3,)
    assert hf.classify_attention_mask(mask, 2, 4, 4)[0] is two
    assert hf.classify_attention_mask(mask, 3, 4, 4)[0] is three
    assert len(classifications) == 2


# ---------------------------------------------------------------------------------------------
# One query row (decode): the lean classification agrees with the definition
# ---------------------------------------------------------------------------------------------


def _single_row_oracle(mask, batch_size, query_dtype):
    """What a (bm, hm, 1, kv_len) mask must classify as, element by element: fallback for
    values other than 0/-inf/the float32 minimum, heads that differ, every key hidden, or a row whose
    visible keys are not one run; else a key range per row."""
    if mask.dtype.is_floating_point:
        allowed = mask == 0
        mins = [torch.finfo(mask.dtype).min]
        if query_dtype is not None and torch.finfo(query_dtype).min >= mins[0]:
            mins.append(torch.finfo(query_dtype).min)
        # only a minimum that outweighs any score gap hides a key (float16's -65504 does not)
        mins = [m for m in mins if m <= -1e38]
        blocked = torch.isneginf(mask) | sum((mask == m for m in mins),
                                             torch.zeros_like(mask, dtype=torch.bool))
        if not bool((allowed | blocked).all()):
            return "values other than"
    else:
        allowed = mask
    if mask.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return "differs between heads"
    if not bool(allowed.any()):
        return "hides every key"
    lo, hi = [], []
    for row in allowed[:, 0, 0]:
        keys = row.nonzero().flatten().tolist()
        if keys and keys != list(range(keys[0], keys[-1] + 1)):
            return "non-contiguous"
        lo.append(keys[0] if keys else 0)
        hi.append(keys[-1] + 1 if keys else 0)
    if len(lo) == 1:
        lo, hi = lo * batch_size, hi * batch_size
    return lo, hi


def test_single_row_masks_classify_as_their_definition():
    g = torch.Generator().manual_seed(0)
    for trial in range(600):
        b, kv = [(1, 1), (2, 1), (3, 5), (4, 9), (2, 16)][trial % 5]
        bm, hm = (1 if trial % 7 == 0 else b), (2 if trial % 5 == 3 else 1)
        lo = torch.randint(0, kv + 1, (bm, 1, 1, 1), generator=g)
        hi = torch.maximum(lo, torch.randint(0, kv + 1, (bm, 1, 1, 1), generator=g))
        mask = (torch.arange(kv) >= lo) & (torch.arange(kv) < hi)
        mask = mask.expand(bm, hm, 1, kv).clone()
        if trial % 3 == 0:  # a flipped key: a hole, a stray key, a difference between heads
            mask[torch.randint(0, bm, ()), torch.randint(0, hm, ()), 0,
                 torch.randint(0, kv, ())] ^= True
        query_dtype = torch.float16
        if trial % 4 == 1:  # additive float forms
            dtype = torch.float32 if trial % 8 == 1 else torch.float16
            hidden = [float("-inf"), torch.finfo(dtype).min,
                      torch.finfo(torch.float16).min][trial % 3]
            mask = torch.where(mask, torch.zeros((), dtype=dtype),
                               torch.tensor(hidden, dtype=dtype))
            if trial % 16 == 5:
                mask[0, 0, 0, 0] = 0.5
        expected = _single_row_oracle(mask, b, query_dtype)
        q_len = 1 if trial % 2 else 6  # decode, or a mask broadcast over 6 queries
        info, reason = hf.classify_attention_mask(mask, b, q_len, kv, query_dtype)
        if isinstance(expected, str):
            assert info is None and expected in reason, (trial, expected, reason)
        else:
            assert reason is None and info.kind == "key-range" and not info.causal, (trial, reason)
            assert info.kv_len == kv and info.leftpad_k.is_contiguous()
            assert info.leftpad_k.tolist() == expected[0], trial
            assert info.seqused_k.tolist() == expected[1], trial


class _TensorCalls(torch.overrides.TorchFunctionMode):
    """The tensor functions called (views, shape and attribute reads left out): on a GPU each
    is a kernel launch, a few microseconds of host time."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in ("__get__", "__getitem__", "dim", "size", "stride", "is_inference",
                        "data_ptr"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_a_decode_mask_is_classified_with_few_tensor_calls():
    mask = _decode_mask([34, 29, 34, 10], 34).clone()
    with _TensorCalls() as calls:
        info, _ = hf.classify_attention_mask(mask, 4, 1, 34, torch.float16)
    assert info.leftpad_k.tolist() == [0, 5, 0, 24]
    # 27 before the single-row path (the general one's causal, range and window passes)
    assert len(calls.names) <= 14 and calls.names.count("tolist") == 1, calls.names


# ---------------------------------------------------------------------------------------------
# The mask builders: sdpa_mask's values, with a version counter
# ---------------------------------------------------------------------------------------------


def _builder_kwargs(config, pad=True):
    am = torch.ones(3, 7, dtype=torch.long)
    if pad:
        am[1, :3] = 0
    return dict(batch_size=3, q_length=7, kv_length=7, q_offset=0, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=am, config=config)


def test_the_registered_builder_gives_sdpa_masks_with_a_version_counter():
    hf.register()
    builder = ALL_MASK_ATTENTION_FUNCTIONS[hf.ATTENTION_NAME_PLAIN]
    assert ALL_MASK_ATTENTION_FUNCTIONS[hf.ATTENTION_NAME] is builder
    assert builder.__wrapped__ is sdpa_mask
    kw = _builder_kwargs(make_config("qwen2"))
    with torch.inference_mode():
        ours, stock = builder(**kw), sdpa_mask(**kw)
        assert builder(**_builder_kwargs(None, pad=False)) is None  # the causal skip is kept
    assert not ours.is_inference() and stock.is_inference()
    assert torch.equal(ours, stock) and ours.stride() == stock.stride()
    plain = builder(**kw)  # outside inference mode: sdpa_mask as it is
    assert torch.equal(plain, stock) and not plain.is_inference()


def test_a_builder_that_needs_inference_mode_runs_in_it():
    def in_place(batch_idx, head_idx, q_idx, kv_idx):
        flags.add_(0)  # an in-place update of an inference tensor: only inside inference mode
        return kv_idx <= q_idx

    with torch.inference_mode():
        flags = torch.zeros(1)
        kw = dict(batch_size=1, q_length=3, kv_length=3, mask_function=in_place,
                  allow_is_causal_skip=False)
        mask, stock = hf._kernel_mask_builder(sdpa_mask)(**kw), sdpa_mask(**kw)
    assert mask.is_inference() and torch.equal(mask, stock)


def test_the_patch_wraps_the_sdpa_mask_builder_for_routed_models_only():
    original = AttentionMaskInterface._global_mapping["sdpa"]
    with hf.apply_patch(["llama"]):
        builder = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
        assert builder is not original and builder.__wrapped__ is original
        with torch.inference_mode():
            routed = builder(**_builder_kwargs(make_config("llama")))
            other = builder(**_builder_kwargs(make_config("qwen2")))
            stock = original(**_builder_kwargs(make_config("llama")))
        assert not routed.is_inference() and other.is_inference()
        assert torch.equal(routed, stock) and torch.equal(other, stock)
    assert AttentionMaskInterface._global_mapping["sdpa"] is original


def test_remove_patch_leaves_a_foreign_mask_builder_in_place(caplog):
    original = AttentionMaskInterface._global_mapping["sdpa"]
    hf.apply_patch()
    ours = AttentionMaskInterface._global_mapping["sdpa"]

    def foreign(*args, **kwargs):
        return ours(*args, **kwargs)

    AttentionMaskInterface.register("sdpa", foreign)
    hf.remove_patch()
    assert AttentionMaskInterface._global_mapping["sdpa"] is foreign
    assert "mask builder entry was replaced" in caplog.text
    with torch.inference_mode():  # our wrapper inside it is a pass-through now
        assert foreign(**_builder_kwargs(make_config("llama"))).is_inference()
    AttentionMaskInterface._global_mapping["sdpa"] = original


@needs_op
@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
def test_results_equal_those_with_sdpa_mask_itself(family):
    """The kernel path (op's CPU reference) with our builder against the same model with
    transformers' sdpa_mask registered for the name: bitwise equal logits, prefill and
    generate, under inference_mode."""
    hf.configure(allow_cpu_reference=True)
    model = build_random_model(family, dtype=torch.float16, seed=5,
                               attn_implementation=hf.ATTENTION_NAME_PLAIN)
    ids, am = _padded_batch([10, 4, 7], seed=6)
    ours = _generate(model, ids, am, 4, torch.inference_mode)
    AttentionMaskInterface.register(hf.ATTENTION_NAME_PLAIN, sdpa_mask)
    hf._clear_classification_cache()
    stock = _generate(copy.deepcopy(model), ids, am, 4, torch.inference_mode)
    assert torch.equal(ours.sequences, stock.sequences)
    for x, y in zip(ours.logits, stock.logits):
        assert torch.equal(x, y)
    assert hf.get_stats()["fallback"] == 0


def test_inference_mode_position_ids_are_read_once_and_verified_on_the_device():
    # generate() runs under inference_mode, where position_ids are inference tensors (no version
    # counter): they are cached with a copy of their values, so the packing decision is read on
    # the host once per tensor, not once per layer; a change in place fails loudly on the next
    # layer (torch._assert_async), never a stale answer.
    q = torch.zeros(1, 2, 8, 16)
    with torch.inference_mode():
        pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
        with HostReadCounter() as first:
            a = hf._packed_position_ids({"position_ids": pos}, q, q)
        with HostReadCounter() as again:
            b = hf._packed_position_ids({"position_ids": pos}, q, q)
        assert len(first) == 1 and len(again) == 0
        assert a is not None and b is not None and a.max_q == b.max_q == 4
        assert torch.equal(a.cu_varlen, b.cu_varlen)
        assert a.cu_varlen.tolist() == [0, 3, 7, 8]
        pos[0, 3] = 3  # one document less, in place
        with pytest.raises(RuntimeError, match="changed in place"):
            hf._packed_position_ids({"position_ids": pos}, q, q)


class _Config:
    """A model's config as the attention layers share it (the owner of a forward's calls)."""


def _attention_layers(n, first=0):
    config = _Config()
    return [types.SimpleNamespace(layer_idx=first + i, config=config) for i in range(n)]


def _count_async_checks(monkeypatch) -> list:
    checks = []
    real = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda *a: (checks.append(1), real(*a))[1])
    return checks


def test_inference_position_ids_are_verified_once_per_forward(monkeypatch):
    # With the layers' config and layer_idx, the copy comparison (three launches on a GPU) runs
    # at the first layer of each forward, not at every layer; a change in place between two
    # forwards still fails loudly at the next forward's first layer.
    checks = _count_async_checks(monkeypatch)
    layers = _attention_layers(4)
    q = torch.zeros(1, 2, 8, 16)
    with torch.inference_mode():
        pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
        for forward in range(3):
            for layer in layers:
                qs = q.clone()  # each layer's own query
                for _ in range(2):  # a packed call asks twice (decision key, packed path)
                    packing = hf._packed_position_ids({"position_ids": pos}, qs, qs, layer)
                    assert packing.cu_varlen.tolist() == [0, 3, 7, 8]
            # the first forward's layer 0 fills the cache; each later forward checks once
            assert len(checks) == forward
        pos[0, 3] = 3  # one document less, in place, between forwards
        with pytest.raises(RuntimeError, match="changed in place"):
            hf._packed_position_ids({"position_ids": pos}, q, q, layers[0])
        # Without a layer index (or a config) every call checks.
        checks.clear()
        plain = torch.arange(8)[None]
        for _ in range(3):
            assert hf._packed_position_ids({"position_ids": plain}, q, q) is None
        assert len(checks) == 2


def test_inference_position_ids_checked_when_another_model_takes_them():
    # A buffer refilled in place between two models: the second model's first attention layer
    # (layer_idx 2, as in hybrid stacks whose first layers are not attention) is above the
    # first model's last one, but another model's call is never taken for the same forward.
    first, second = _attention_layers(2), _attention_layers(2, first=2)
    q = torch.zeros(1, 2, 8, 16)
    with torch.inference_mode():
        pos = torch.arange(8)[None]
        for layer in first:
            assert hf._packed_position_ids({"position_ids": pos}, q.clone(), q, layer) is None
        pos.copy_(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]]))
        with pytest.raises(RuntimeError, match="changed in place"):
            hf._packed_position_ids({"position_ids": pos}, q.clone(), q, second[0])


# ---------------------------------------------------------------------------------------------
# The decision remembered across layers (_decision_key): never for another call
# ---------------------------------------------------------------------------------------------
#
# Layers 1..L-1 of a forward reuse layer 0's decision. Each test below runs calls in a layer
# sequence, changes one input between "forwards" (the mask object, the mask in place, the
# settings, position_ids, the window, causality, the autograd or tracing mode), and checks every
# call against the full path: the same call again with the remembered decisions forgotten must
# give the same op arguments (or fallback reason) and the same output, bit for bit.


class _Layer(torch.nn.Module):
    """An attention layer as the attention function sees it."""

    def __init__(self, heads=4, kv_heads=2, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = heads // kv_heads


@pytest.fixture
def outcome(monkeypatch):
    """``outcome(fn)``: ``(fn(), what it did)``, what it did being the op calls made (name and
    the arguments that carry the decision) and the fallback reasons counted."""
    ns = torch.ops.flash_attention_sm75
    ops = []

    def spy(name, real):
        def op(*args, **kw):
            q = args[0]
            if name == "fwd":  # q, k, v, scale, causal, bottom_right, leftpad, seqused, wl, wr, cap
                causal, leftpad, seqused, left, right = args[4], args[6], args[7], args[8], args[9]
                bias = kw.get("attn_bias", args[12] if len(args) > 12 else None)
                ops.append((name, tuple(q.shape), tuple(args[1].shape), causal,
                            None if leftpad is None else leftpad.tolist(),
                            None if seqused is None else seqused.tolist(), left, right,
                            args[10], None if bias is None else id(bias)))
            else:  # varlen_fwd: q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, seqused, wl, wr
                ops.append((name, tuple(q.shape), args[3].tolist(), args[5], args[8], args[10],
                            args[11]))
            return real(*args, **kw)
        return op

    for name in ("fwd", "varlen_fwd"):
        monkeypatch.setattr(ns, name, spy(name, getattr(ns, name)))

    def run(fn):
        before = dict(hf.get_stats()["reasons"])
        n = len(ops)
        out = fn()
        after = hf.get_stats()["reasons"]
        reasons = sorted(r for r in after if after[r] != before.get(r, 0))
        return out, (tuple(ops[n:]), tuple(reasons))

    return run


def _as_full_path(outcome, fn):
    """Run ``fn`` (one attention call), then again with every remembered decision forgotten (the
    full path); assert both did the same, bit for bit. Returns what it did."""
    out, did = outcome(fn)
    hf._clear_decisions()
    ref, expected = outcome(fn)
    assert did == expected
    assert torch.equal(out, ref)
    return did


def _forward(outcome, layers, q, k, v, mask, **kwargs):
    """One "forward": every layer called with the same mask and kwargs (fresh q/k/v views, as
    each layer has its own), each checked against the full path; returns what layer 0 did."""
    did = [_as_full_path(outcome, lambda: hf.flash_attention_sm75_forward(
        layer, q.clone(), k.clone(), v.clone(), mask, **kwargs)[0]) for layer in layers]
    assert all(d == did[0] for d in did), did
    return did[0]


def _decode_qkv(b, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, 1, 16, generator=g).half()
    k = torch.randn(b, 2, kv_len, 16, generator=g).half()
    return q, k, torch.randn(b, 2, kv_len, 16, generator=g).half()


@needs_op
def test_classify_decode_masks_true_classifies_each_decode_mask_once(classifications,
                                                                     reads_per_call):
    # The opt-in: every forward's mask classified once (by layer 0), decode steps included.
    hf.configure(allow_cpu_reference=True, classify_decode_masks=True)
    layers, new = 3, 4
    model = build_random_model("qwen2", dtype=torch.float16, seed=1, num_hidden_layers=layers,
                               attn_implementation=hf.ATTENTION_NAME_PLAIN)
    ids, am = _padded_batch([9, 4, 7], seed=2)
    plain = _generate(model, ids, am, new, torch.no_grad)
    assert len(classifications) == new, classifications
    decode = [(layer, names) for q_len, layer, names in reads_per_call if q_len == 1]
    assert all(names == (["tolist"] if layer == 0 else []) for layer, names in decode), decode
    # the same tokens as the default (the mask read by the decode kernel)
    hf.configure(classify_decode_masks=False)
    again = _generate(model, ids, am, new, torch.no_grad)
    assert torch.equal(plain.sequences, again.sequences)


@needs_op
def test_the_remembered_decision_serves_the_other_layers():
    hf.configure(allow_cpu_reference=True)
    layers = [_Layer() for _ in range(3)]
    q, k, v = _decode_qkv(2, 6)
    mask = _decode_mask([6, 3], 6).clone()
    for layer in layers:
        hf.flash_attention_sm75_forward(layer, q, k, v, mask, dropout=0.0, scaling=0.25,
                                        sliding_window=None, use_cache=True)
    assert len(hf._DECISIONS) == 1  # layer 0 decided; layers 1 and 2 reused it
    assert hf.get_stats()["kernel_decode"] == 3


@needs_op
def test_a_new_mask_in_the_next_forward_is_decided_again(outcome):
    # decode masks classified on the host (as prefill masks are): the memo under test
    hf.configure(allow_cpu_reference=True, classify_decode_masks=True)
    layers = [_Layer(), _Layer()]
    q, k, v = _decode_qkv(2, 6)
    first = _decode_mask([6, 3], 6).clone()
    assert _forward(outcome, layers, q, k, v, first)[0][0][4] == [0, 3]
    second = _decode_mask([2, 6], 6).clone()  # same shapes, another padding
    assert _forward(outcome, layers, q, k, v, second)[0][0][4] == [4, 0]
    # a new mask in the freed one's memory (often the same id and data pointer too)
    del first, second
    gc.collect()
    third = _decode_mask([5, 1], 6).clone()
    assert _forward(outcome, layers, q, k, v, third)[0][0][4] == [1, 5]
    holes = third.clone()
    holes[0, 0, 0, 3] = False  # a hole: not a key range, so the kernel reads it as a bias
    ops, reasons = _forward(outcome, layers, q, k, v, holes)
    assert reasons == () and len(ops) == 1
    assert all(op[4] is None and op[9] == id(holes) for op in ops)


@needs_op
def test_a_new_mask_with_the_freed_ones_id_address_and_version_is_decided_again(outcome,
                                                                                 monkeypatch):
    # What the weak reference in an entry is for: a caching allocator (CUDA's, at every forward)
    # hands the next mask the freed one's memory, and Python often the freed object's id, so a
    # new mask can match every number in the key. Simulated: one storage for both masks (the
    # same address and version count), and every object's id the same in the module.
    hf.configure(allow_cpu_reference=True, classify_decode_masks=True)  # as above
    monkeypatch.setattr(hf, "id", lambda obj: 1, raising=False)
    layers = [_Layer(), _Layer()]
    q, k, v = _decode_qkv(2, 6)
    storage = torch.empty(12, dtype=torch.bool).untyped_storage()

    def mask_in_storage(values):
        m = torch.empty(2, 1, 1, 6, dtype=torch.bool)
        m.set_(storage, 0, (2, 1, 1, 6), (6, 6, 6, 1))
        return m.copy_(values)

    mask = mask_in_storage(_decode_mask([6, 3], 6))
    assert _forward(outcome, layers, q, k, v, mask)[0][0][4] == [0, 3]
    signature = (mask.data_ptr(), mask._version)
    del mask
    mask = mask_in_storage(_decode_mask([2, 6], 6))
    assert (mask.data_ptr(), mask._version) == signature
    assert _forward(outcome, layers, q, k, v, mask)[0][0][4] == [4, 0]


@needs_op
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_mask_changed_in_place_between_forwards_is_decided_again(outcome, mode):
    hf.configure(allow_cpu_reference=True, classify_decode_masks=True)  # as above
    layers = [_Layer(), _Layer()]
    q, k, v = _decode_qkv(2, 6)
    mask = _decode_mask([6, 3], 6).clone()  # an ordinary tensor, as our mask builder gives
    grad_mode = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with grad_mode():
        assert _forward(outcome, layers, q, k, v, mask)[0][0][4] == [0, 3]
        mask[1, 0, 0, :5] = False  # row 1 now sees key 5 only (in place: a version bump)
        assert _forward(outcome, layers, q, k, v, mask)[0][0][4:6] == ([0, 5], [6, 6])
        mask[0, 0, 0, 2] = False  # a hole: read by the kernel as a bias
        ops, reasons = _forward(outcome, layers, q, k, v, mask)
        assert reasons == () and len(ops) == 1
        assert all(op[4] is None and op[9] == id(mask) for op in ops)
        mask[0, 0, 0, 2] = True  # back as it was: decided again, the same
        assert _forward(outcome, layers, q, k, v, mask)[0][0][4:6] == ([0, 5], [6, 6])


@needs_op
def test_inference_tensor_masks_are_never_remembered(outcome):
    # decode masks classified on the host (as prefill masks are): the memo under test
    hf.configure(allow_cpu_reference=True, classify_decode_masks=True)
    layers = [_Layer(), _Layer()]
    q, k, v = _decode_qkv(2, 6)
    with torch.inference_mode():
        mask = _decode_mask([6, 3], 6)
        assert mask.is_inference()  # no version counter: an in-place change is invisible
        assert _forward(outcome, layers, q, k, v, mask)[0][0][4] == [0, 3]
        assert len(hf._DECISIONS) == 0
        mask[0, 0, 0, :2] = False
        assert _forward(outcome, layers, q, k, v, mask)[0][0][4] == [2, 3]


@needs_op
def test_settings_changed_between_forwards_are_honoured(outcome):
    hf.configure(allow_cpu_reference=True)
    layers = [_Layer(), _Layer()]
    q, k, v = _decode_qkv(2, 6)
    mask = _decode_mask([6, 3], 6).clone()
    for _ in range(2):
        assert _forward(outcome, layers, q, k, v, mask)[0][0][0] == "fwd"
        hf.configure(decode_on_kernel=False)
        ops, reasons = _forward(outcome, layers, q, k, v, mask)
        assert ops == () and reasons == ("decode (q_len == 1) is configured to use torch SDPA",)
        hf.configure(decode_on_kernel=True, allow_cpu_reference=False)
        ops, reasons = _forward(outcome, layers, q, k, v, None)
        assert ops == () and "CUDA tensor" in reasons[0]
        hf.configure(allow_cpu_reference=True)
        assert _forward(outcome, layers, q, k, v, None)[0][0][4] is None  # no mask: all keys


@needs_op
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_position_ids_that_pack_in_the_next_forward_take_the_varlen_op(outcome, mode):
    hf.configure(allow_cpu_reference=True)
    layers = [_Layer(), _Layer()]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g).half() for h in (4, 2, 2))
    grad_mode = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with grad_mode():
        plain = torch.arange(8)[None]
        ops, _ = _forward(outcome, layers, q, k, v, None, position_ids=plain)
        assert [op[0] for op in ops] == ["fwd"] and ops[0][3]  # dense, causal
        packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
        ops, _ = _forward(outcome, layers, q, k, v, None, position_ids=packed)
        assert ops[0][:3] == ("varlen_fwd", (8, 4, 16), [0, 3, 7, 8])
        if mode == "no_grad":  # the same object, changed in place (inference: see below)
            plain[0, 4:] = torch.arange(4)
            ops, _ = _forward(outcome, layers, q, k, v, None, position_ids=plain)
            assert ops[0][:3] == ("varlen_fwd", (8, 4, 16), [0, 4, 8])
        else:  # inference position_ids changed in place fail loudly (never a stale answer)
            packed[0, 3] = 3
            with pytest.raises(RuntimeError, match="changed in place"):
                hf.flash_attention_sm75_forward(layers[0], q, k, v, None, position_ids=packed)


@needs_op
def test_layers_with_other_windows_or_causality_get_their_own_decision(outcome):
    hf.configure(allow_cpu_reference=True)
    _, k, v = _decode_qkv(2, 6)
    q = torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(1)).half()
    causal, bidirectional = _Layer(), _Layer(is_causal=False)
    for _ in range(2):  # alternating layers, as sliding / full and encoder / decoder stacks do
        for layer, window, expected in ((causal, None, (True, -1, -1)),
                                        (causal, 3, (True, 2, 2)),
                                        (bidirectional, None, (False, -1, -1)),
                                        (bidirectional, 3, (False, 2, 2)),
                                        (causal, 8, (True, -1, -1))):  # no shorter than the keys
            ops, _ = _as_full_path(outcome, lambda: hf.flash_attention_sm75_forward(
                layer, q, k, v, None, sliding_window=window)[0])
            assert (ops[0][3], ops[0][6], ops[0][7]) == expected
        ops, _ = _as_full_path(outcome, lambda: hf.flash_attention_sm75_forward(
            causal, q, k, v, None, is_causal=False)[0])  # the keyword wins over the module
        assert ops[0][3] is False


@needs_op
# torch's forward-AD machinery scripts helpers on first use (torch's own deprecation warning)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_forward_mode_ad_never_takes_a_remembered_kernel_decision(outcome):
    import torch.autograd.forward_ad as fwAD

    hf.configure(allow_cpu_reference=True)
    layer = _Layer()
    q, k, v = _decode_qkv(2, 6)
    mask = _decode_mask([6, 3], 6).clone()
    assert _forward(outcome, [layer], q, k, v, mask)[0][0][0] == "fwd"  # remembered: kernel
    # Strict mode names the fallback's reason (torch's CPU SDPA has no forward AD either).
    with fwAD.dual_level(), strict():
        dual = fwAD.make_dual(q, torch.ones_like(q))  # the same metadata, with a tangent
        with pytest.raises(ValueError, match="forward-mode AD tangent"):
            outcome(lambda: hf.flash_attention_sm75_forward(layer, dual, k, v, mask))


@needs_op
def test_torch_compile_never_reads_a_remembered_decision():
    # An eager call remembers the kernel decision for this mask; the traced call must not use it
    # (its key range would be frozen into the graph): a mask goes to torch SDPA, read at run time,
    # so another mask of the same shapes gives that mask's result.
    hf.configure(allow_cpu_reference=True)
    layer = _Layer()
    q, k, v = _decode_qkv(2, 6)
    first = _decode_mask([6, 3], 6).clone()
    hf.flash_attention_sm75_forward(layer, q, k, v, first)
    assert len(hf._DECISIONS) == 1
    torch._dynamo.reset()
    fn = torch.compile(lambda m: hf.flash_attention_sm75_forward(layer, q, k, v, m)[0],
                       fullgraph=True, backend="eager")
    try:
        fn(first)
        second = _decode_mask([2, 6], 6).clone()
        hf._clear_decisions()
        expected, _ = hf.flash_attention_sm75_forward(layer, q, k, v, second)
        torch.testing.assert_close(fn(second), expected, atol=2e-3, rtol=2e-3)
    finally:
        torch._dynamo.reset()


class _CountingDict(dict):
    """``hf._DECISIONS`` that counts the lookups answered."""

    hits = 0

    def get(self, key, default=None):
        value = super().get(key, default)
        self.hits += value is not None
        return value


@needs_op
def test_random_call_sequences_match_the_full_path(outcome, monkeypatch):
    """Random sequences of forwards (masks kept, replaced, changed in place, inference tensors;
    settings flipped; decode and prefill; batch 1 and 2; windows; position_ids plain and
    packed; causal and bidirectional layers), every layer's call checked against the full
    path."""
    hf.configure(allow_cpu_reference=True)
    decisions = _CountingDict()
    monkeypatch.setattr(hf, "_DECISIONS", decisions)
    g = torch.Generator().manual_seed(11)
    layers = [_Layer(), _Layer(), _Layer(), _Layer(is_causal=False)]

    def rand(*shape):
        return torch.randn(*shape, generator=g).half()

    masks = {}
    calls = 0
    for trial in range(60):
        pick = torch.randint(0, 1000, (8,), generator=g).tolist()
        b, q_len = (1 + pick[0] % 2), (1 if pick[1] % 2 else 5)
        kv_len = 7
        q, k, v = rand(b, 4, q_len, 16), rand(b, 2, kv_len, 16), rand(b, 2, kv_len, 16)
        slot = (b, q_len, pick[2] % 3)
        if pick[3] % 4 == 0 or slot not in masks:  # a new mask object for this slot
            lengths = [1 + (pick[4] + 3 * i) % kv_len for i in range(b)]
            _, am = _padded_batch(lengths, side="left")
            am = torch.nn.functional.pad(am, (kv_len - am.shape[1], 0))
            mask = _hf_mask(b, q_len, kv_len, am, q_offset=kv_len - q_len).clone()
            if pick[5] % 5 == 0:
                with torch.inference_mode():
                    mask = mask.clone()
            masks[slot] = mask
        mask = masks[slot]
        if pick[6] % 5 == 1:  # in place: flip one key (a hole, a new range, or back)
            with torch.inference_mode():
                mask[pick[7] % b, 0, (pick[7] // 7) % q_len, pick[7] % kv_len] ^= True
        kwargs = {"dropout": 0.0, "scaling": 0.25, "use_cache": True}
        if pick[6] % 3 == 0:
            kwargs["sliding_window"] = 1 + pick[4] % 8
        if b == 1 and q_len > 1 and pick[2] % 2 == 0:
            kwargs["position_ids"] = (torch.arange(q_len)[None] if pick[4] % 2 else
                                      torch.tensor([[0, 1, 0, 1, 2]]))
        if pick[6] % 7 == 2:
            hf.configure(decode_on_kernel=bool(pick[7] % 2))
        use = None if pick[5] % 4 == 3 else mask
        for layer in layers:  # one forward
            _as_full_path(outcome, lambda: hf.flash_attention_sm75_forward(
                layer, q.clone(), k.clone(), v.clone(), use, **kwargs)[0])
            calls += 1
    assert decisions.hits >= calls // 3, (decisions.hits, calls)  # the memo was exercised
    stats = hf.get_stats()
    assert stats["kernel"] >= calls // 2 and stats["fallback"] >= calls // 10, stats
