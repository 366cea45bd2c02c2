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
  ``sdpa_mask``'s values, and the model results equal those with ``sdpa_mask`` itself, bitwise.
"""
import copy
import gc

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
def test_a_padded_generate_classifies_each_mask_once(name, grad_mode, classifications,
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
    # one mask per forward (prefill and each decode step), each classified once: by layer 0
    assert len(classifications) == new, classifications
    assert not any(inference for _, inference in classifications)
    decode = [(layer, names) for q_len, layer, names in reads_per_call if q_len == 1]
    assert len(decode) == layers * (new - 1)
    assert all(names == (["tolist"] if layer == 0 else []) for layer, names in decode), decode


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
    values other than 0/-inf/minimum, heads that differ, every key hidden, or a row whose
    visible keys are not one run; else a key range per row."""
    if mask.dtype.is_floating_point:
        allowed = mask == 0
        mins = [torch.finfo(mask.dtype).min]
        if query_dtype is not None and torch.finfo(query_dtype).min >= mins[0]:
            mins.append(torch.finfo(query_dtype).min)
        blocked = torch.isneginf(mask) | sum(mask == m for m in mins).bool()
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
