"""CPU tests of the Hugging Face transformers integration (run in CI, no GPU needed).

* registration of ``attn_implementation="flash_attention_sm75"`` (``from_pretrained``,
  ``from_config``, ``set_attn_implementation``) for tiny random Llama/Qwen2/Qwen3/Mistral models;
* apply_patch/remove_patch: models loaded before and after, idempotence, context manager,
  nesting (each handle undoes its own call, in any order),
  restoration of the exact previous entry, model-type filter;
* on CPU every call falls back and the logits equal stock SDPA bitwise (``torch.equal``);
* mask classification on constructed masks (transformers' own mask builders and hand-made ones):
  which run on the kernel with which ``leftpad_k``/``seqused_k``, which fall back;
* the kernel path end to end through the op's CPU reference implementation
  (``configure(allow_cpu_reference=True)``), compared with torch SDPA on real tokens;
* Gemma 2's ``softcap``: on the kernel on every mask path (classified masks, windows, no mask)
  against transformers' Gemma 2 eager attention; the fallbacks (CPU, fp32, packed sequences,
  decode off) apply it; a tiny Gemma-2-shaped model's prefill and generate on the kernel match
  the fp32 eager model;
* training: ``loss.backward()`` through the kernel path (the op's CPU reference forward and
  backward), registered name and patch, full and left-padded batches: every parameter's
  gradient against stock SDPA's.
"""
import copy
import logging
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from flash_attention_sm75 import _ops, _rules  # noqa: E402
from flash_attention_sm75.integrations import transformers as hf  # noqa: E402
from devtools.model_configs import (  # noqa: E402
    REALISTIC_CONFIGS,
    TINY_CONFIGS,
    build_random_model,
    make_config,
)

FAMILIES = sorted(TINY_CONFIGS)  # gemma3, llama, mistral, phi, phi3, qwen2, qwen3

needs_op = pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                              reason=f"extension not built: {_ops.EXTENSION_ERROR}")


@pytest.fixture(autouse=True)
def _clean_state():
    original_sdpa = AttentionInterface._global_mapping["sdpa"]
    settings = hf.configure()
    hf.remove_patch()
    hf.reset_stats()
    hf._clear_classification_cache()
    yield
    hf.remove_patch()
    hf.configure(**settings)
    ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)
    AttentionInterface._global_mapping["sdpa"] = original_sdpa
    hf._clear_classification_cache()


def _padded_batch(lengths, vocab=128, seed=0, side="left"):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            am[b, s - n:] = 1
        else:
            am[b, :n] = 1
    ids = ids.masked_fill(am == 0, 0)
    return ids, am


def _logits(model, ids, am):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=am).logits


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


def test_registered_with_transformers():
    hf.register()
    hf.register()  # idempotent
    assert "flash_attention_sm75" in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert ALL_ATTENTION_FUNCTIONS["flash_attention_sm75"] is hf.flash_attention_sm75_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_sm75"].__wrapped__ is sdpa_mask
    import flash_attention_sm75
    assert flash_attention_sm75.apply_patch is hf.apply_patch
    assert flash_attention_sm75.remove_patch is hf.remove_patch
    from flash_attention_sm75 import integrations
    assert integrations.get_stats is hf.get_stats


def test_configs_have_the_real_shapes():
    q = make_config("qwen2-0.5b")
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads,
            q.intermediate_size, q.vocab_size) == (896, 24, 14, 2, 4864, 151936)
    assert q.hidden_size // q.num_attention_heads == 64
    ll = make_config("llama-3.2-1b")
    assert (ll.hidden_size, ll.num_hidden_layers, ll.num_attention_heads, ll.num_key_value_heads,
            ll.head_dim, ll.intermediate_size, ll.vocab_size) == (2048, 16, 32, 8, 64, 8192, 128256)
    l2 = make_config("llama-2-7b", num_hidden_layers=3)
    assert (l2.hidden_size, l2.num_attention_heads, l2.num_key_value_heads, l2.head_dim,
            l2.intermediate_size, l2.vocab_size, l2.num_hidden_layers) == (
                4096, 32, 32, 128, 11008, 32000, 3)
    g3 = make_config("gemma-3-1b")
    assert (g3.hidden_size, g3.num_attention_heads, g3.num_key_value_heads, g3.head_dim,
            g3.vocab_size) == (1152, 4, 1, 256, 262144)
    p3 = make_config("phi-3-mini")
    assert (p3.hidden_size, p3.num_attention_heads, p3.vocab_size) == (3072, 32, 32064)
    assert p3.hidden_size // p3.num_attention_heads == 96
    p2 = make_config("phi-2")
    assert (p2.hidden_size, p2.num_attention_heads, p2.vocab_size) == (2560, 32, 51200)
    assert p2.hidden_size // p2.num_attention_heads == 80
    # Gemma 3's attention kinds follow the layer count (the model refuses a mismatch).
    assert make_config("gemma-3-1b", num_hidden_layers=7).layer_types.count("full_attention") == 1
    assert make_config("gemma3", num_hidden_layers=1).layer_types == ["full_attention"]
    assert set(REALISTIC_CONFIGS) == {"qwen2-0.5b", "llama-3.2-1b", "llama-2-7b", "gemma-3-1b",
                                      "phi-3-mini", "phi-2"}
    with pytest.raises(KeyError):
        make_config("no-such-model")


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_with_attn_implementation(tmp_path, family):
    model = build_random_model(family, dtype=torch.float32, seed=1)
    model.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="flash_attention_sm75", dtype=torch.float32)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    assert ours.config._attn_implementation == "flash_attention_sm75"
    assert stock.config._attn_implementation == "sdpa"
    ids, am = _padded_batch([9, 5, 2], seed=2)
    hf.reset_stats()
    a = _logits(ours.eval(), ids, am)
    stats = hf.get_stats()
    b = _logits(stock.eval(), ids, am)
    assert torch.equal(a, b)
    # CPU: every call falls back (2 layers -> 2 calls), with the reason recorded.
    assert stats["kernel"] == 0 and stats["fallback"] == 2
    assert any("must be a CUDA tensor" in r for r in stats["reasons"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_set_attn_implementation_cpu_logits_equal(family, dtype):
    model = build_random_model(family, dtype=dtype, seed=3)
    ids, am = _padded_batch([11, 7, 11, 1], seed=4)
    stock = _logits(model, ids, am)
    stock_nomask = _logits(model, ids[:1], None)
    model.set_attn_implementation("flash_attention_sm75")
    assert model.config._attn_implementation == "flash_attention_sm75"
    ours = _logits(model, ids, am)
    ours_nomask = _logits(model, ids[:1], None)
    assert torch.equal(ours, stock)
    assert torch.equal(ours_nomask, stock_nomask)
    model.set_attn_implementation("sdpa")
    assert torch.equal(_logits(model, ids, am), stock)


def test_from_config_and_generate_cpu_equal():
    cfg = make_config("qwen2")
    torch.manual_seed(5)
    ours = AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_sm75").eval()
    stock = copy.deepcopy(ours)
    stock.set_attn_implementation("sdpa")
    ids, am = _padded_batch([6, 3, 6], seed=6)
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        a = ours.generate(ids, **kw)
        b = stock.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# Patch
# ---------------------------------------------------------------------------------------------


def test_patch_models_loaded_before_and_after():
    before = build_random_model("llama", dtype=torch.float32, seed=7)
    ids, am = _padded_batch([8, 4], seed=8)
    reference = _logits(before, ids, am)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    handle = hf.apply_patch()
    assert hf.is_patched()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original
    after = build_random_model("llama", dtype=torch.float32, seed=7)
    assert after.config._attn_implementation == "sdpa"
    hf.reset_stats()
    a = _logits(before, ids, am)
    b = _logits(after, ids, am)
    stats = hf.get_stats()
    assert stats["fallback"] == 4 and stats["kernel"] == 0  # both models were routed to us
    assert torch.equal(a, reference) and torch.equal(b, reference)

    assert hf.remove_patch() is True
    assert not hf.is_patched()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    assert AttentionInterface._global_mapping["sdpa"] is original
    hf.reset_stats()
    assert torch.equal(_logits(before, ids, am), reference)
    assert hf.get_stats()["fallback"] == 0  # no longer routed
    del handle


def test_patch_twice_is_harmless_and_remove_restores():
    original = AttentionInterface._global_mapping["sdpa"]
    hf.apply_patch()
    wrapper = AttentionInterface._global_mapping["sdpa"]
    second = hf.apply_patch()
    assert AttentionInterface._global_mapping["sdpa"] is wrapper
    assert wrapper.__wrapped__ is original  # one wrapper, around the original
    assert second.installed is False
    assert hf.remove_patch() is True
    assert AttentionInterface._global_mapping["sdpa"] is original
    assert hf.remove_patch() is False
    assert AttentionInterface._global_mapping["sdpa"] is original


def test_patch_context_manager_and_nesting():
    original = AttentionInterface._global_mapping["sdpa"]
    with hf.apply_patch() as handle:
        assert handle.installed and hf.is_patched()
        with hf.apply_patch():
            assert hf.is_patched()
        assert hf.is_patched()  # the inner block did not install it, so it does not remove it
    assert not hf.is_patched()
    assert AttentionInterface._global_mapping["sdpa"] is original
    # exceptions inside the block still restore
    with pytest.raises(RuntimeError):
        with hf.apply_patch():
            raise RuntimeError("boom")
    assert AttentionInterface._global_mapping["sdpa"] is original


def _routed(model, ids, am):
    """Whether the model's attention calls go through our wrapper (on CPU every routed call
    falls back and is counted; calls that are not routed are not counted)."""
    hf.reset_stats()
    _logits(model, ids, am)
    return hf.get_stats()["fallback"] > 0


@pytest.fixture(scope="module")
def llama_qwen2():
    return (build_random_model("llama", dtype=torch.float32, seed=13),
            build_random_model("qwen2", dtype=torch.float32, seed=13),
            *_padded_batch([4, 3], seed=14))


@pytest.mark.parametrize("outer_types", [None, hf.DEFAULT_PATCH_MODEL_TYPES],
                         ids=["all", "default"])
def test_nested_patch_restores_the_outer_model_types(outer_types, llama_qwen2):
    llama, qwen2, ids, am = llama_qwen2
    original = AttentionInterface._global_mapping["sdpa"]
    with hf.apply_patch(outer_types):
        assert _routed(llama, ids, am) and _routed(qwen2, ids, am)
        wrapper = AttentionInterface._global_mapping["sdpa"]
        with hf.apply_patch(["llama"]):
            assert _routed(llama, ids, am) and not _routed(qwen2, ids, am)
            with hf.apply_patch(["qwen2"]):  # any depth
                assert not _routed(llama, ids, am) and _routed(qwen2, ids, am)
            assert _routed(llama, ids, am) and not _routed(qwen2, ids, am)
        # the inner exit brings back the outer call's model types, not {"llama"}
        assert _routed(llama, ids, am) and _routed(qwen2, ids, am)
        assert hf._PATCH.model_types == (None if outer_types is None else frozenset(outer_types))
        assert AttentionInterface._global_mapping["sdpa"] is wrapper
    assert not hf.is_patched()
    assert AttentionInterface._global_mapping["sdpa"] is original
    assert not _routed(llama, ids, am)


def test_patch_handles_removed_out_of_order(llama_qwen2):
    llama, qwen2, ids, am = llama_qwen2
    original = AttentionInterface._global_mapping["sdpa"]
    outer = hf.apply_patch(None)
    inner = hf.apply_patch(["llama"])
    assert outer.installed and not inner.installed
    # removing the outer first: as if it had never been applied, the inner one stays in effect
    assert outer.remove() is True
    assert not outer.active and inner.active and hf.is_patched()
    assert _routed(llama, ids, am) and not _routed(qwen2, ids, am)
    assert outer.remove() is False  # twice: nothing changes
    assert hf.is_patched() and _routed(llama, ids, am)
    # the last layer to go puts the original function back, whoever installed the wrapper
    assert inner.remove() is True
    assert not hf.is_patched()
    assert AttentionInterface._global_mapping["sdpa"] is original
    assert not _routed(llama, ids, am) and not _routed(qwen2, ids, am)


def test_inner_handle_remove_undoes_only_its_call(llama_qwen2):
    llama, qwen2, ids, am = llama_qwen2
    with hf.apply_patch(None):
        inner = hf.apply_patch(["llama"])
        inner.remove()
        assert hf.is_patched()  # the outer call is still in effect, with its model types
        assert _routed(llama, ids, am) and _routed(qwen2, ids, am)
    assert not hf.is_patched()


def test_stale_handle_after_remove_patch_leaves_a_later_patch_alone(llama_qwen2):
    llama, qwen2, ids, am = llama_qwen2
    original = AttentionInterface._global_mapping["sdpa"]
    old_outer = hf.apply_patch(None)
    old_inner = hf.apply_patch(["llama"])
    assert hf.remove_patch() is True  # removes every layer at once
    assert AttentionInterface._global_mapping["sdpa"] is original
    assert not old_outer.active and not old_inner.active
    new = hf.apply_patch(["qwen2"])
    with old_inner:  # exiting a stale handle does nothing
        pass
    assert old_outer.remove() is False
    assert new.active and hf.is_patched()
    assert _routed(qwen2, ids, am) and not _routed(llama, ids, am)
    new.remove()
    assert AttentionInterface._global_mapping["sdpa"] is original


def test_apply_patch_and_configure_reject_bad_arguments():
    before = dict(AttentionInterface._global_mapping)
    with pytest.raises(ValueError, match=r"got the string 'llama'; write \['llama'\]"):
        hf.apply_patch("llama")
    for bad in ([5], 5):
        with pytest.raises(ValueError, match="iterable of model_type strings"):
            hf.apply_patch(bad)
    assert dict(AttentionInterface._global_mapping) == before  # nothing was patched
    settings = hf.configure()
    for kw in ({"decode_on_kernel": "no"}, {"allow_cpu_reference": 1}):
        with pytest.raises(ValueError, match="must be True, False or None"):
            hf.configure(**kw)
    assert hf.configure() == settings


def test_patch_model_type_filter():
    llama = build_random_model("llama", dtype=torch.float32, seed=9)
    qwen2 = build_random_model("qwen2", dtype=torch.float32, seed=9)
    ids, am = _padded_batch([5, 3], seed=10)
    with hf.apply_patch(model_types=["llama"]):
        hf.reset_stats()
        _logits(qwen2, ids, am)
        assert hf.get_stats()["fallback"] == 0
        _logits(llama, ids, am)
        assert hf.get_stats()["fallback"] == 2
    with hf.apply_patch():  # default: the four families
        for fam in sorted(hf.DEFAULT_PATCH_MODEL_TYPES):
            m = build_random_model(fam, dtype=torch.float32, seed=9)
            hf.reset_stats()
            _logits(m, ids, am)
            assert hf.get_stats()["fallback"] == 2, fam


def test_patch_local_mapping_and_foreign_override():
    def custom(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = custom  # instance-local override
    hf.apply_patch()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not custom
    hf.remove_patch()
    assert ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"] is custom
    del ALL_ATTENTION_FUNCTIONS["sdpa"]

    original = AttentionInterface._global_mapping["sdpa"]
    hf.apply_patch()
    ours = AttentionInterface._global_mapping["sdpa"]
    calls = []

    def foreign(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)

    AttentionInterface.register("sdpa", foreign)  # someone wraps us after the patch
    hf.remove_patch()
    assert AttentionInterface._global_mapping["sdpa"] is foreign  # left in place
    model = build_random_model("llama", dtype=torch.float32, seed=11)
    ids, am = _padded_batch([4, 2], seed=12)
    hf.reset_stats()
    _logits(model, ids, am)
    assert calls and hf.get_stats()["fallback"] == 0  # our wrapper is a pass-through now
    AttentionInterface._global_mapping["sdpa"] = original


# ---------------------------------------------------------------------------------------------
# Mask classification
# ---------------------------------------------------------------------------------------------


def _hf_mask(batch, q_len, kv_len, pad2d=None, q_offset=0, mask_function=causal_mask_function):
    return sdpa_mask(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                     kv_offset=0, mask_function=mask_function,
                     attention_mask=None if pad2d is None else pad2d.bool(),
                     allow_is_causal_skip=False)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _assert_info(info, reason, causal, kv_len, leftpad, seqused):
    assert reason is None, reason
    assert info.causal is causal
    assert info.kv_len == kv_len
    assert info.leftpad_k.dtype == torch.int32 and info.seqused_k.dtype == torch.int32
    assert torch.equal(info.leftpad_k, _i32(leftpad))
    assert torch.equal(info.seqused_k, _i32(seqused))


def test_classify_causal():
    mask = _hf_mask(2, 7, 7)
    info, reason = hf.classify_attention_mask(mask, 2, 7, 7)
    _assert_info(info, reason, True, 7, [0, 0], [7, 7])


def test_classify_left_padding():
    _, am = _padded_batch([4, 7, 1], side="left")
    mask = _hf_mask(3, 7, 7, am)
    info, reason = hf.classify_attention_mask(mask, 3, 7, 7)
    _assert_info(info, reason, True, 7, [3, 0, 6], [7, 7, 7])
    assert info.kind == "causal+key-range"


def test_classify_right_padding():
    _, am = _padded_batch([4, 7, 1], side="right")
    mask = _hf_mask(3, 7, 7, am)
    info, reason = hf.classify_attention_mask(mask, 3, 7, 7)
    _assert_info(info, reason, True, 7, [0, 0, 0], [4, 7, 1])


def test_classify_chunked_prefill_with_cache():
    # 5 tokens already in a dynamic cache, 4 new queries: kv_len 9, bottom-right causal.
    _, am = _padded_batch([9, 6], side="left")
    mask = _hf_mask(2, 4, 9, am, q_offset=5)
    info, reason = hf.classify_attention_mask(mask, 2, 4, 9)
    _assert_info(info, reason, True, 9, [0, 3], [9, 9])


def test_classify_decode():
    _, am = _padded_batch([9, 6, 2], side="left")
    mask = _hf_mask(3, 1, 9, am, q_offset=8)
    info, reason = hf.classify_attention_mask(mask, 3, 1, 9)
    _assert_info(info, reason, False, 9, [0, 3, 7], [9, 9, 9])
    assert info.kind == "key-range"


def test_classify_static_cache_prefill_truncates_keys():
    # Static cache of 16 slots, prompt of 5 tokens: slots 5..15 are unused (masked for all rows).
    _, am = _padded_batch([5, 3], side="left")
    mask = _hf_mask(2, 5, 16, am)
    info, reason = hf.classify_attention_mask(mask, 2, 5, 16)
    _assert_info(info, reason, True, 5, [0, 2], [5, 5])
    assert "truncated" in info.kind


def test_classify_bidirectional_padding():
    _, am = _padded_batch([6, 2], side="right")
    mask = _hf_mask(2, 6, 6, am, mask_function=bidirectional_mask_function)
    info, reason = hf.classify_attention_mask(mask, 2, 6, 6)
    _assert_info(info, reason, False, 6, [0, 0], [6, 2])


def test_classify_broadcast_batch():
    mask = _hf_mask(1, 5, 5)
    info, reason = hf.classify_attention_mask(mask, 3, 5, 5)
    _assert_info(info, reason, True, 5, [0, 0, 0], [5, 5, 5])


@pytest.mark.parametrize("blocked", ["-inf", "min"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_classify_float_masks(blocked, dtype):
    _, am = _padded_batch([6, 3], side="left")
    allowed = _hf_mask(2, 6, 6, am)
    value = float("-inf") if blocked == "-inf" else torch.finfo(dtype).min
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, value)
    info, reason = hf.classify_attention_mask(mask, 2, 6, 6, torch.float16)
    if blocked == "min" and dtype == torch.float16:
        # -65504 does not hide a key from a score 65504 above the visible ones: no key range
        assert info is None and "float16's minimum, -65504, is one" in reason
    else:
        _assert_info(info, reason, True, 6, [0, 3], [6, 6])


@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.float32])
def test_float16_minimum_is_a_bias_not_a_hidden_key(mask_dtype, monkeypatch):
    """A key 'hidden' by float16's minimum whose score is 70000 above the visible key's keeps
    its weight in torch (float32 softmax of s - 65504). Such masks were read as key ranges (the
    key dropped): the SDPA wrapper returned the visible key's value where torch returns the
    hidden one's. Now they are no key range; on the kernel they run as a bias."""
    import flash_attention_sm75 as fa
    from flash_attention_sm75 import sdpa
    q = torch.zeros(1, 1, 1, 8)
    k, v = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8)
    q[..., 0] = 1.0
    k[0, 0, 1, 0] = 1.0  # key 1's score: 70000, key 0's: 0
    v[0, 0, :, 0] = torch.tensor([1.0, -1.0])
    m = torch.tensor([0.0, torch.finfo(torch.float16).min], dtype=mask_dtype).view(1, 1, 1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=m.double(), scale=70000.0)
    assert ref[0, 0, 0, 0] == -1.0  # torch: the "hidden" key wins
    monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", "cpu")  # the kernel path, CPU reference
    assert fa.why_not_supported(q.half(), k.half(), v.half(), attn_mask=m, scale=70000.0) is None
    out = fa.scaled_dot_product_attention(q.half(), k.half(), v.half(), attn_mask=m,
                                          scale=70000.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=0)
    allowed = _hf_mask(1, 4, 4)
    mask = torch.zeros(allowed.shape, dtype=mask_dtype).masked_fill(
        ~allowed, torch.finfo(torch.float16).min)
    info, reason = hf.classify_attention_mask(mask, 1, 4, 4, torch.float16)
    assert info is None and "float16's minimum" in reason


@pytest.mark.parametrize("odd", [-1e4, -1.0, 0.5])
def test_classify_float_mask_odd_values_fall_back(odd):
    allowed = _hf_mask(2, 5, 5)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    mask[0, 0, 4, 1] = odd
    info, reason = hf.classify_attention_mask(mask, 2, 5, 5, torch.float16)
    assert info is None and "values other than" in reason


def test_classify_arbitrary_mask_falls_back():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.5
    mask[..., 0] = True
    info, reason = hf.classify_attention_mask(mask, 2, 6, 6)
    assert info is None and reason


def test_classify_hole_in_key_range_falls_back():
    mask = _hf_mask(1, 6, 6).clone()
    mask[0, 0, 5, 2] = False  # one key hidden from one query only
    info, reason = hf.classify_attention_mask(mask, 1, 6, 6)
    assert info is None and "non-contiguous" in reason


def test_classify_packed_sequences_fall_back():
    packed = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    fn = and_masks(causal_mask_function, packed_sequence_mask_function(packed))
    mask = _hf_mask(1, 8, 8, mask_function=fn)
    info, reason = hf.classify_attention_mask(mask, 1, 8, 8)
    assert info is None and "packed" in reason


def test_classify_sliding_window_falls_back():
    mask = _hf_mask(2, 8, 8, mask_function=sliding_window_causal_mask_function(3))
    info, reason = hf.classify_attention_mask(mask, 2, 8, 8)
    assert info is None and "sliding-window" in reason


@pytest.mark.parametrize("case", ["causal", "left-pad", "chunked", "static-cache"])
def test_classify_sliding_window_with_the_hint_runs_with_the_window(case):
    # transformers passes sliding layers' `sliding_window`: the mask then matches a causal
    # pattern whose rows see the last `sliding_window` keys, the op's window (w - 1, 0).
    w = 3
    fn = sliding_window_causal_mask_function(w)
    _, left = _padded_batch([9, 4, 7], side="left")
    _, left12 = _padded_batch([12, 5, 9], side="left")
    mask, sq, sk, kv_len, kind = {
        "causal": (_hf_mask(3, 9, 9, mask_function=fn), 9, 9, 9, "causal+key-range+window"),
        "left-pad": (_hf_mask(3, 9, 9, left, mask_function=fn), 9, 9, 9, "+window"),
        "chunked": (_hf_mask(3, 4, 12, left12, q_offset=8, mask_function=fn), 4, 12, 12,
                    "+window"),
        "static-cache": (_hf_mask(3, 9, 16, torch.cat([left, torch.zeros(3, 7, dtype=left.dtype)],
                                                      1), mask_function=fn), 9, 16, 9,
                         "window (truncated keys)"),
    }[case]
    info, reason = hf.classify_attention_mask(mask, 3, sq, sk, sliding_window=w)
    assert reason is None, reason
    assert info.causal and info.window_size == (w - 1, 0) and kind in info.kind
    assert info.kv_len == kv_len
    # The op's visibility with these arguments is exactly the mask.
    from reference import visible_mask
    vis = visible_mask(3, sq, kv_len, True, True, info.leftpad_k, info.seqused_k,
                       window_size=info.window_size)
    assert torch.equal(vis, mask[..., :kv_len] if mask.shape[1] == 1 else mask)
    # A wrong hint does not make the mask run (the mask decides).
    info, reason = hf.classify_attention_mask(mask, 3, sq, sk, sliding_window=w + 1)
    assert info is None and "sliding-window" in reason


def _prefill_on_kernel_matches_fp32(model, ref_impl, lengths, seed):
    """A padded prefill of ``model`` (fp16, our attention) runs both layers on the kernel and
    matches a float32 copy with transformers' ``ref_impl`` attention on the real tokens.
    Returns (ref32, ids, attention_mask, reference logits, real-token mask)."""
    ref32 = copy.deepcopy(model).float()
    ref32.set_attn_implementation(ref_impl)
    ids, am = _padded_batch(lengths, seed=seed)
    ours = _logits(model, ids, am)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == 2 and stats["fallback"] == 0, stats
    ref = _logits(ref32, ids, am)
    real = am.bool()
    torch.testing.assert_close(ours.float()[real], ref[real], atol=1e-2, rtol=1e-2)
    return ref32, ids, am, ref, real


@needs_op
@pytest.mark.parametrize("family,window", [("mistral", 5), ("gemma3", 6), ("qwen2", 4)])
def test_sliding_window_models_run_the_kernel_window_via_cpu_reference(family, window):
    """Mistral / Gemma-3 / Qwen2 with a window shorter than the prompts: padded prefill and
    generation run on the kernel (its window), matching stock SDPA with transformers' masks."""
    hf.configure(allow_cpu_reference=True)
    over = dict(sliding_window=window)
    if family == "qwen2":
        over.update(use_sliding_window=True, max_window_layers=0)
    model = build_random_model(make_config(family, **over), dtype=torch.float16, seed=21,
                               attn_implementation="flash_attention_sm75")
    ref32, ids, am, ref, real = _prefill_on_kernel_matches_fp32(model, "sdpa", [24, 9, 17], 22)
    # The window changes the result (so the comparison above tests it).
    full = copy.deepcopy(ref32)
    full.config.sliding_window = 4096
    for layer in full.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 4096
    assert (_logits(full, ids, am)[real] - ref[real]).abs().max() > 0.05

    _generate_on_kernel_matches_fp32(model, ref32, ids, am)


@needs_op
def test_sliding_window_without_a_mask_runs_the_kernel_window():
    # transformers' FlashAttention semantics: no mask, a window shorter than the keys ->
    # window_size (w - 1, w - 1) (the right side is the diagonal when causal).
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(2, 4, 2, 11, 11, 64, seed=5)
    mod = _Attn(4, 2)
    with torch.inference_mode():
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, None, sliding_window=4)
    assert hf.get_stats()["kernel"] == 1 and hf.get_stats()["fallback"] == 0
    mask = _hf_mask(2, 11, 11, mask_function=sliding_window_causal_mask_function(4))
    with torch.inference_mode():
        ref, _ = sdpa_attention_forward(mod, q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def _window_reference(q, k, v, window, causal):
    """float64 attention with transformers' FlashAttention window: query i (bottom-right aligned
    on the keys) sees key j iff 0 <= dist < window (causal) or |dist| < window, dist = i +
    kv_len - q_len - j; a row that sees no key gives 0. BHSD in, BSHD out (as the attention
    functions return)."""
    sq, sk = q.shape[2], k.shape[2]
    dist = (torch.arange(sq)[:, None] + sk - sq) - torch.arange(sk)[None, :]
    visible = (dist >= 0) & (dist < window) if causal else dist.abs() < window
    rep = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(rep, 1) for t in (k, v))
    s = (q.double() @ kd.transpose(-1, -2)) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    p = p.masked_fill(~visible.any(-1, keepdim=True), 0.0)  # a row that sees no key: 0
    return (p @ vd).transpose(1, 2)


@pytest.mark.parametrize("case", ["fp32", "decode", "not-causal", "cpu", "chunk", "more-queries",
                                  "is-causal-kwarg", "long-cache-decode"])
def test_sliding_window_without_a_mask_on_the_fallback(case):
    # The registered entries honour transformers' FlashAttention window without a mask on the
    # kernel (test above); a call that falls back must give the same window (an explicit mask
    # for torch SDPA), not the call without it. Before: stock SDPA without a mask.
    sq, sk, w, causal = {"chunk": (5, 17), "more-queries": (12, 8),
                         "long-cache-decode": (1, 300)}.get(case, (11, 11)) + (4, True)
    if case in ("decode", "long-cache-decode"):
        hf.configure(decode_on_kernel=False)
        sq = 1
    dtype = torch.float16 if case in ("decode", "cpu", "long-cache-decode") else torch.float32
    if case != "cpu":
        hf.configure(allow_cpu_reference=True)  # the kernel would run: something else refuses
    q, k, v = _qkv(2, 4, 2, sq, sk, 64, dtype=dtype, seed=8)
    mod = _Attn(4, 2, is_causal=case not in ("not-causal", "is-causal-kwarg"))
    kw = {"is_causal": True} if case == "is-causal-kwarg" else {}  # the keyword wins
    if case == "not-causal":
        causal = False
    calls = 2 if case == "chunk" else 1  # the second: the memoised decision's fallback
    with torch.inference_mode():
        outs = [hf.flash_attention_sm75_forward(mod, q, k, v, None, sliding_window=w, **kw)[0]
                for _ in range(calls)]
    assert hf.get_stats()["fallback"] == calls, hf.get_stats()
    ref = _window_reference(q, k, v, w, causal and sq > 1)
    for out in outs:
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    # The window hides keys here: without it the result differs (so the check above tests it).
    plain = _window_reference(q, k, v, sk + sq, causal and sq > 1)
    assert (plain - ref).abs().max() > 0.05


@pytest.mark.parametrize("sq,sk", [(11, 11), (1, 40)])
def test_sliding_window_fallback_under_torch_compile_matches_eager(sq, sk):
    # The window mask is built on the device from the shapes: a compiled graph (fullgraph, no
    # host read) gives the eager result, prefill and decode.
    q, k, v = _qkv(2, 4, 2, sq, sk, 64, dtype=torch.float32, seed=4)
    mod = _Attn(4, 2)

    def step(q, k, v):
        return hf.flash_attention_sm75_forward(mod, q, k, v, None, sliding_window=4)[0]

    torch._dynamo.reset()
    with torch.inference_mode():
        eager = step(q, k, v)
        compiled = torch.compile(step, backend="eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)  # fp32 reassociation
    torch.testing.assert_close(eager.double(), _window_reference(q, k, v, 4, sq > 1),
                               atol=2e-3, rtol=2e-3)


def test_sliding_window_and_softcap_without_a_mask_agree_on_kernel_and_fallback():
    # Gemma 2's softcap falls back to its own SDPA function: the window must reach it too.
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(2, 4, 2, 11, 11, 64, seed=3)
    mod = _Attn(4, 2)
    with torch.inference_mode():
        kernel, _ = hf.flash_attention_sm75_forward(mod, q, k, v, None, sliding_window=4,
                                                    softcap=3.0)
        q, k, v = q.float(), k.float(), v.float()
        fallback, _ = hf.flash_attention_sm75_forward(mod, q, k, v, None, sliding_window=4,
                                                      softcap=3.0)
        no_window, _ = hf.flash_attention_sm75_forward(mod, q, k, v, None, softcap=3.0)
    stats = hf.get_stats()
    assert stats["kernel"] == 1 and stats["fallback"] == 2, stats
    torch.testing.assert_close(kernel.float(), fallback, atol=2e-3, rtol=2e-3)
    assert (no_window - fallback).abs().max() > 0.05


def test_classify_sliding_window_wider_than_sequence_runs():
    # transformers builds sliding-window masks for Mistral/Qwen2 sliding layers; when the window
    # covers the whole sequence the mask is plain causal and runs on the kernel.
    mask = _hf_mask(2, 8, 8, mask_function=sliding_window_causal_mask_function(4096))
    info, reason = hf.classify_attention_mask(mask, 2, 8, 8)
    _assert_info(info, reason, True, 8, [0, 0], [8, 8])


def test_classify_head_dependent_mask_falls_back():
    mask = _hf_mask(1, 4, 4).expand(1, 2, 4, 4).clone()
    mask[0, 1, 3, 0] = False
    info, reason = hf.classify_attention_mask(mask, 1, 4, 4)
    assert info is None and "heads" in reason
    same = _hf_mask(1, 4, 4).expand(1, 2, 4, 4)
    info, reason = hf.classify_attention_mask(same, 1, 4, 4)
    _assert_info(info, reason, True, 4, [0], [4])


def test_classify_bad_shapes_and_dtypes_fall_back():
    assert hf.classify_attention_mask(torch.ones(4, 4, dtype=torch.bool), 1, 4, 4)[0] is None
    assert hf.classify_attention_mask(_hf_mask(1, 4, 4), 1, 4, 5)[0] is None
    assert hf.classify_attention_mask(_hf_mask(2, 4, 4), 3, 4, 4)[0] is None
    assert hf.classify_attention_mask(_hf_mask(1, 4, 4).long(), 1, 4, 4)[0] is None
    info, reason = hf.classify_attention_mask(torch.zeros(1, 1, 4, 4, dtype=torch.bool), 1, 4, 4)
    assert info is None and "every key" in reason


def test_classification_is_cached_per_mask_object():
    mask = _hf_mask(2, 5, 5).clone()
    first = hf.classify_attention_mask(mask, 2, 5, 5)
    again = hf.classify_attention_mask(mask, 2, 5, 5)
    assert again is first
    other = hf.classify_attention_mask(mask.clone(), 2, 5, 5)
    assert other is not first and other[0].kind == first[0].kind
    mask[0, 0, 4, 2] = False  # in-place change (a hole) bumps the version counter
    changed = hf.classify_attention_mask(mask, 2, 5, 5)
    assert changed is not first and changed[0] is None


class _Attn(torch.nn.Module):
    def __init__(self, heads, kv_heads, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = heads // kv_heads


def test_plan_without_mask():
    q = torch.zeros(2, 4, 6, 64, dtype=torch.float16)
    k = torch.zeros(2, 2, 6, 64, dtype=torch.float16)
    info, _ = hf._plan(_Attn(4, 2), q, k, None, None)
    assert info.causal and info.kv_len == 6 and info.leftpad_k is None
    info, _ = hf._plan(_Attn(4, 2, is_causal=False), q, k, None, None)
    assert not info.causal
    info, _ = hf._plan(_Attn(4, 2), q, k, None, False)  # is_causal kwarg wins over the module
    assert not info.causal
    # empty static cache prefill: SDPA slices the keys to q_len (top-left == bottom-right)
    k_static = torch.zeros(2, 2, 16, 64, dtype=torch.float16)
    info, _ = hf._plan(_Attn(4, 2), q, k_static, None, None)
    assert info.causal and info.kv_len == 6
    # decode without a mask: every key visible
    info, _ = hf._plan(_Attn(4, 2), q[:, :, :1], k_static, None, None)
    assert not info.causal and info.kv_len == 16
    hf.configure(decode_on_kernel=False)
    info, reason = hf._plan(_Attn(4, 2), q[:, :, :1], k_static, None, None)
    assert info is None and "decode" in reason


def test_plan_reads_a_float_mask_as_bias_only_from_the_smallest_scale():
    # A float mask that is no key range goes to the kernel as its bias; below BIAS_SCALE_MIN
    # (where the kernels' clamp of raw biases would change finite values) the plan falls back,
    # naming the module's scaling. A bool mask's plan does not depend on the scale.
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 64, generator=g).half()
    k = torch.randn(2, 2, 6, 64, generator=g).half()
    mask = torch.randn(2, 1, 6, 6, generator=g).half()
    small = _rules.BIAS_SCALE_MIN / 2
    info, reason = hf._plan(_Attn(4, 2), q, k, mask, False, value=k, scaling=small)
    assert info is None and "scaling >= 2^-27" in reason, reason
    info, reason = hf._plan(_Attn(4, 2), q, k, mask, False, value=k,
                            scaling=_rules.BIAS_SCALE_MIN)
    assert reason is None and info.kind == "bias"
    info, reason = hf._plan(_Attn(4, 2), q, k, mask > 0, False, value=k, scaling=small)
    assert reason is None


# ---------------------------------------------------------------------------------------------
# Attention function: fallbacks and the kernel path via the op's CPU reference
# ---------------------------------------------------------------------------------------------


def _qkv(b, h, h_k, sq, sk, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, h_k, sk, d, generator=g).to(dtype)
    v = torch.randn(b, h_k, sk, d, generator=g).to(dtype)
    return q, k, v


def _fallback_case(name):
    q, k, v = _qkv(2, 4, 2, 5, 5, 64)
    mod = _Attn(4, 2)
    mask = _hf_mask(2, 5, 5)
    kwargs = {}
    if name == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif name == "head_dim":
        q, k, v = _qkv(2, 4, 2, 5, 5, 12)  # not a multiple of 8
    elif name == "dropout":
        # dropout runs on the kernel (tests/test_dropout.py); one its rule refuses falls back
        kwargs["dropout"] = 1.0
    elif name == "output_attentions":
        kwargs["output_attentions"] = True
    elif name == "packed":
        packed = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
        mask = _hf_mask(2, 5, 5, mask_function=and_masks(
            causal_mask_function, packed_sequence_mask_function(packed)))
    elif name == "decode_off":
        hf.configure(decode_on_kernel=False)
        q = q[:, :, :1]
        mask = _hf_mask(2, 1, 5, q_offset=4)
    return mod, q, k, v, mask, kwargs


@pytest.mark.parametrize("name,expected", [
    ("cpu", "must be a CUDA tensor"), ("fp32", "must be float16"), ("head_dim", "head_dim"), ("dropout", "dropout_p must be in [0, 1)"),
    ("output_attentions", "output_attentions"), ("decode_off", "decode"),
])
def test_fallback_reasons_and_exact_stock_output(name, expected, caplog):
    if name != "cpu":
        if not _ops.EXTENSION_AVAILABLE:
            pytest.skip("extension not built")
        hf.configure(allow_cpu_reference=True)  # so that only the named problem remains
    mod, q, k, v, mask, kwargs = _fallback_case(name)
    if name == "dropout":
        torch.manual_seed(0)
    with caplog.at_level(logging.DEBUG, logger="flash_attention_sm75"):
        out, weights = hf.flash_attention_sm75_forward(mod, q, k, v, mask, **kwargs)
    if name == "dropout":
        torch.manual_seed(0)
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, **kwargs)
    assert weights is None
    assert torch.equal(out, ref)
    stats = hf.get_stats()
    assert stats["kernel"] == 0 and stats["fallback"] == 1
    (reason,) = stats["reasons"]
    assert expected in reason, reason
    assert any(expected in rec.getMessage() for rec in caplog.records)


def test_strict_mode_raises_instead_of_falling_back():
    sdpa_mod = pytest.importorskip("flash_attention_sm75.sdpa")
    if not hasattr(sdpa_mod, "strict"):
        pytest.skip("no strict mode")
    mod, q, k, v, mask, _ = _fallback_case("cpu")
    with sdpa_mod.strict():
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            hf.flash_attention_sm75_forward(mod, q, k, v, mask)


def _real_rows(mask, b, sq):
    """(B, Sq) bool: query rows that see at least one key."""
    if mask is None:
        return torch.ones(b, sq, dtype=torch.bool)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return allowed[:, 0].any(-1).expand(b, sq)


def _kernel_cases():
    _, left = _padded_batch([9, 4, 7], side="left")
    _, right = _padded_batch([9, 4, 7], side="right")
    _, left_dec = _padded_batch([12, 5, 9], side="left")
    causal = _hf_mask(3, 9, 9)
    return {
        "none-causal": (9, 9, None, "causal"),
        "causal-mask": (9, 9, causal, "causal+key-range"),
        "left-pad": (9, 9, _hf_mask(3, 9, 9, left), "causal+key-range"),
        "right-pad": (9, 9, _hf_mask(3, 9, 9, right), "causal+key-range"),
        "left-pad-float": (9, 9, torch.zeros(3, 1, 9, 9, dtype=torch.float16).masked_fill(
            ~_hf_mask(3, 9, 9, left), float("-inf")), "causal+key-range"),
        "chunked-prefill": (4, 12, _hf_mask(3, 4, 12, left_dec, q_offset=8), "causal+key-range"),
        "decode": (1, 12, _hf_mask(3, 1, 12, left_dec, q_offset=11), "key-range"),
        "decode-nomask": (1, 12, None, "none"),
        "static-prefill": (9, 16, _hf_mask(3, 9, 16, left), "truncated"),
        "static-prefill-nomask": (9, 16, None, "causal"),
    }


@needs_op
@pytest.mark.parametrize("case", sorted(_kernel_cases()))
@pytest.mark.parametrize("heads,d", [((4, 2), 64), ((2, 2), 128), ((4, 1), 64)])
def test_kernel_path_matches_sdpa_on_real_rows(case, heads, d):
    hf.configure(allow_cpu_reference=True)
    sq, sk, mask, kind = _kernel_cases()[case]
    h, h_k = heads
    q, k, v = _qkv(3, h, h_k, sq, sk, d, seed=sum(map(ord, case)))
    mod = _Attn(h, h_k)
    scaling = 0.1 if d == 128 else None
    if mask is not None:
        info, reason = hf.classify_attention_mask(mask, 3, sq, sk, q.dtype)
        assert reason is None and kind in info.kind
    with torch.inference_mode():
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, mask, scaling=scaling)
        ref, _ = sdpa_attention_forward(mod, q.float(), k.float(), v.float(),
                                        None if mask is None else mask.float()
                                        if mask.dtype != torch.bool else mask,
                                        scaling=scaling)
    assert hf.get_stats()["kernel"] == 1, hf.get_stats()
    assert out.shape == (3, sq, h, d) and out.dtype == torch.float16 and out.is_contiguous()
    rows = _real_rows(mask, 3, sq)
    # op: fp16 in, float32 math, fp16 out -> within fp16 rounding of the fp32 SDPA result.
    torch.testing.assert_close(out.float()[rows], ref[rows], atol=2e-3, rtol=2e-3)
    if (~rows).any():  # queries that see no key (left padding) are 0 on our path
        assert torch.all(out[~rows] == 0)


def _generate_on_kernel_matches_fp32(model, ref32, ids, am):
    """generate(): 6 new tokens of a 2-layer model with every prefill and decode call on the
    kernel (no fallback); the logits equal the fp32 model's under teacher forcing."""
    hf.reset_stats()
    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == 2 and stats["kernel_decode"] == 2 * 5, stats
    assert stats["fallback"] == 0, stats
    full_am = torch.cat([am, torch.ones(ids.shape[0], 6, dtype=am.dtype)], dim=1)
    teacher = _logits(ref32, gen.sequences, full_am)[:, ids.shape[1] - 1:-1]
    torch.testing.assert_close(torch.stack(gen.logits, 1).float(), teacher, atol=1e-2, rtol=1e-2)


@needs_op
@pytest.mark.parametrize("family", FAMILIES)
def test_model_kernel_path_via_cpu_reference(family):
    """Whole model: classification + op (CPU reference) vs stock SDPA, padded prefill + generate."""
    hf.configure(allow_cpu_reference=True)
    model = build_random_model(family, dtype=torch.float16, seed=13,
                               attn_implementation="flash_attention_sm75")
    ref32 = copy.deepcopy(model).float()
    ref32.set_attn_implementation("sdpa")
    ids, am = _padded_batch([24, 9, 17], seed=14)
    ours = _logits(model, ids, am)
    assert hf.get_stats()["kernel_prefill"] == 2 and hf.get_stats()["fallback"] == 0
    ref = _logits(ref32, ids, am)
    real = am.bool()
    torch.testing.assert_close(ours.float()[real], ref[real], atol=1e-2, rtol=1e-2)

    _generate_on_kernel_matches_fp32(model, ref32, ids, am)


@needs_op
def test_patched_sdpa_model_runs_kernel_path_via_cpu_reference():
    hf.configure(allow_cpu_reference=True)
    model = build_random_model("qwen3", dtype=torch.float16, seed=15)
    ids, am = _padded_batch([10, 3], seed=16)
    stock = _logits(model, ids, am)
    with hf.apply_patch():
        ours = _logits(model, ids, am)
        assert hf.get_stats()["kernel"] == 2
    real = am.bool()
    torch.testing.assert_close(ours[real].float(), stock[real].float(), atol=1e-2, rtol=1e-2)
    hf.reset_stats()
    assert torch.equal(_logits(model, ids, am), stock)
    assert hf.get_stats()["kernel"] == 0


# ---------------------------------------------------------------------------------------------
# Gemma 2's softcap: on the kernel on every path; the fallback applies it
# ---------------------------------------------------------------------------------------------


def _gemma2_eager(mod, q, k, v, mask, softcap, scaling=None, is_causal=True):
    """transformers' own Gemma 2 eager attention (softcap, then the additive mask) in float32;
    a missing mask is SDPA's: causal, top-left, when q_len > 1."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    b, _, sq, d = q.shape
    sk = k.shape[2]
    if mask is None:
        mask = _hf_mask(b, sq, sk) if (is_causal and sq > 1) else None
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    mod.head_dim = d
    out, _ = eager_attention_forward(mod, q.float(), k.float(), v.float(),
                                     None if mask is None else mask.float(), scaling=scaling,
                                     softcap=softcap)
    return out


@needs_op
@pytest.mark.parametrize("case", sorted(_kernel_cases()))
def test_softcap_runs_on_the_kernel_on_every_mask_path(case):
    # Gemma 2 passes softcap=attn_logit_softcapping with every call: classified masks (causal,
    # padding, chunked prefill, decode, static cache) and no mask run on the kernel with it.
    hf.configure(allow_cpu_reference=True)
    sq, sk, mask, kind = _kernel_cases()[case]
    q, k, v = _qkv(3, 4, 2, sq, sk, 64, seed=sum(map(ord, case)) + 1)
    q, k = q * 3, k * 3  # scores of a few units, which a cap of 2 bends
    mod = _Attn(4, 2)
    with torch.inference_mode():
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, mask, scaling=0.125, softcap=2.0)
        plain, _ = hf.flash_attention_sm75_forward(mod, q, k, v, mask, scaling=0.125)
    stats = hf.get_stats()
    assert stats["kernel"] == 2 and stats["fallback"] == 0, stats
    ref = _gemma2_eager(mod, q, k, v, mask, 2.0, scaling=0.125)
    rows = _real_rows(mask, 3, sq)
    torch.testing.assert_close(out.float()[rows], ref[rows], atol=2e-3, rtol=2e-3)
    assert (plain.float()[rows] - ref[rows]).abs().max() > 1e-2  # the cap changes the result


@needs_op
@pytest.mark.parametrize("with_mask", [False, True])
def test_softcap_with_sliding_windows_runs_on_the_kernel(with_mask):
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(2, 4, 2, 11, 11, 64, seed=9)
    q, k = q * 3, k * 3
    mod = _Attn(4, 2)
    window_mask = _hf_mask(2, 11, 11, mask_function=sliding_window_causal_mask_function(4))
    with torch.inference_mode():
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, window_mask if with_mask else None,
                                                 sliding_window=4, softcap=3.0)
    assert hf.get_stats()["kernel"] == 1 and hf.get_stats()["fallback"] == 0
    ref = _gemma2_eager(mod, q, k, v, window_mask, 3.0)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["cpu", "fp32", "cu_seq_lens", "decode_off"])
def test_softcap_fallbacks_apply_the_cap(name):
    # Where the kernel cannot run, the fallback is transformers' SDPA semantics with the cap
    # applied (torch SDPA has none: transformers 5.24 raises for softcap, earlier 5.x ignored it).
    # cu_seq_lens: on CPU tensors (the varlen op runs them otherwise: test_varlen.py).
    if name not in ("cpu", "cu_seq_lens"):
        if not _ops.EXTENSION_AVAILABLE:
            pytest.skip("extension not built")
        hf.configure(allow_cpu_reference=True)
    kwargs = {"softcap": 2.0}
    if name == "cu_seq_lens":
        q, k, v = _qkv(1, 4, 2, 7, 7, 64, seed=3)
        mod, mask = _Attn(4, 2), None
        kwargs.update(cu_seq_lens_q=torch.tensor([0, 3, 7]), cu_seq_lens_k=torch.tensor([0, 3, 7]))
        doc = torch.tensor([0, 0, 0, 1, 1, 1, 1])
        ref_mask = (doc[:, None] == doc[None, :]) & torch.ones(7, 7, dtype=torch.bool).tril()
        ref_mask = ref_mask[None, None]
    else:
        mod, q, k, v, mask, _ = _fallback_case(name)
        ref_mask = mask
    q, k = q * 3, k * 3
    with torch.inference_mode():
        out, weights = hf.flash_attention_sm75_forward(mod, q, k, v, mask, **kwargs)
    assert weights is None and out.dtype == q.dtype
    stats = hf.get_stats()
    assert stats["kernel"] == 0 and stats["fallback"] == 1, stats
    ref = _gemma2_eager(mod, q, k, v, ref_mask, 2.0)
    rows = _real_rows(ref_mask, q.shape[0], q.shape[2])
    torch.testing.assert_close(out.float()[rows], ref[rows], atol=2e-3, rtol=2e-3)


@needs_op
def test_softcap_under_the_patched_sdpa_entry_runs_on_the_kernel():
    hf.configure(allow_cpu_reference=True)
    mod, q, k, v, mask, _ = _fallback_case("cpu")
    with torch.inference_mode():
        out, _ = hf._attention(sdpa_attention_forward, mod, q, k, v, mask, (), {"softcap": 5.0})
    assert hf.get_stats()["kernel"] == 1
    torch.testing.assert_close(out.float(), _gemma2_eager(mod, q, k, v, mask, 5.0), atol=2e-3,
                               rtol=2e-3)


@pytest.mark.parametrize("bad", [0.0, 0, -30.0, float("nan"), float("inf"), "50", True,
                                 torch.tensor(50.0)])
def test_bad_softcap_values_raise(bad):
    mod, q, k, v, mask, _ = _fallback_case("cpu")
    with pytest.raises(ValueError, match="softcap must be None .* or a finite number > 0"):
        hf.flash_attention_sm75_forward(mod, q, k, v, mask, softcap=bad)


def _gemma2_config(softcap, window=6):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "gemma2", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, intermediate_size=256, vocab_size=128,
        max_position_embeddings=512, query_pre_attn_scalar=64, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=softcap,
        final_logit_softcapping=None, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@needs_op
def test_gemma2_softcap_model_runs_on_the_kernel_via_cpu_reference():
    """A tiny Gemma-2-shaped model (soft-capped attention, a sliding layer with a window shorter
    than the prompts, a full layer): padded prefill and generate run every attention call on the
    kernel and match stock eager attention in float32."""
    hf.configure(allow_cpu_reference=True)
    model = build_random_model(_gemma2_config(softcap=2.0), dtype=torch.float16, seed=23,
                               attn_implementation="sm75_attention")
    with torch.no_grad():  # random weights give scores of ~0.05: scale them to a few units
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    ref32, ids, am, ref, real = _prefill_on_kernel_matches_fp32(model, "eager", [20, 9, 14], 24)
    # the cap changes the result (so the comparison above tests it)
    uncapped = copy.deepcopy(ref32)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (_logits(uncapped, ids, am)[real] - ref[real]).abs().max() > 0.05

    _generate_on_kernel_matches_fp32(model, ref32, ids, am)


# ---------------------------------------------------------------------------------------------
# Training: loss.backward() through the kernel path (op's CPU reference forward and backward)
# ---------------------------------------------------------------------------------------------

# Loss scale, as fp16 training uses (torch.amp.GradScaler): without it most activation gradients
# of these random-weight models are ~1e-7..1e-5, in fp16's subnormal range, for every pipeline.
_LOSS_SCALE = 1024.0


def _train_grads(model, ids, am, labels):
    """Scaled loss and float32 copies of every parameter's gradient after one backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=am, labels=labels)
    (out.loss * _LOSS_SCALE).backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.float()
    model.zero_grad(set_to_none=True)
    return out.loss.detach().float(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@needs_op
@pytest.mark.parametrize("batch", ["full", "left-padded"])
@pytest.mark.parametrize("path", ["attn_implementation", "apply_patch"])
def test_training_backward_matches_stock_sdpa_via_cpu_reference(path, batch):
    """loss.backward() through the kernel path gives the gradients stock SDPA gives.

    The kernel path takes fp16 inputs only, so the model is fp16 (on CPU, through the op's
    reference forward (float64) and backward (float32)). Ours and stock fp16 SDPA are both compared with the
    float32 model (same weights upcast, stock SDPA): per parameter, the relative error
    ||g - g32|| / ||g32|| of ours must be at most 2x stock's + 1e-3. Both fp16 pipelines measure
    0.6e-3..1.4e-3 here (fp16 rounding of activations and gradients, unit roundoff 4.9e-4,
    through two layers; ours/stock <= 1.1 for every parameter). Deliberately broken backwards
    fail it: dQ off by 2% or the softmax scale by 1% (errors 1e-2..2e-2 on q_proj), dK off by 5%
    (5e-2 on k_proj), the causal diagonal or the left padding ignored in the backward (errors of
    order 1). ``left-padded``: padding tokens carry label -100, as in real training, so padded
    positions contribute no loss (their query rows see no key: 0 on our path).
    """
    hf.configure(allow_cpu_reference=True)
    cfg = make_config("llama", num_attention_heads=4, num_key_value_heads=2)  # GQA, head_dim 64
    base = build_random_model(cfg, dtype=torch.float16, seed=17).train()
    assert base.config.head_dim == 64 and base.config.num_hidden_layers == 2
    ref32 = copy.deepcopy(base).float()
    if batch == "full":
        ids, _ = _padded_batch([20, 20, 20], seed=18)
        am = None  # transformers passes no mask: the op's plain causal path
    else:
        ids, am = _padded_batch([20, 7, 13], seed=18)
    g = torch.Generator().manual_seed(19)
    labels = torch.randint(0, cfg.vocab_size, ids.shape, generator=g)
    if am is not None:
        labels = labels.masked_fill(am == 0, -100)

    loss_stock, g_stock = _train_grads(base, ids, am, labels)
    loss32, g32 = _train_grads(ref32, ids, am, labels)
    hf.reset_stats()
    if path == "attn_implementation":
        ours = copy.deepcopy(base)
        ours.set_attn_implementation("flash_attention_sm75")
        loss_ours, g_ours = _train_grads(ours, ids, am, labels)
    else:
        with hf.apply_patch():
            loss_ours, g_ours = _train_grads(base, ids, am, labels)
    stats = hf.get_stats()
    # the training forward ran on the kernel path (no "inputs require grad" fallback)
    assert stats["kernel_prefill"] == 2 and stats["fallback"] == 0, stats
    hf.reset_stats()
    assert torch.equal(_train_grads(base, ids, am, labels)[0], loss_stock)  # patch removed
    assert hf.get_stats()["kernel"] == 0

    assert set(g_ours) == set(g32)
    assert abs(loss_ours - loss32) <= 2 * abs(loss_stock - loss32) + 1e-3
    for name in g32:
        assert torch.isfinite(g_ours[name]).all(), name
        e_ours, e_stock = _rel(g_ours[name], g32[name]), _rel(g_stock[name], g32[name])
        assert e_ours <= 2 * e_stock + 1e-3, (name, e_ours, e_stock)


def test_fallback_reasons_are_bounded_and_every_call_is_still_counted():
    # A reason names the call's shapes: a fallback at each decode step of a long generate() is a
    # new reason each step, which must not grow get_stats()'s counter without bound.
    hf.reset_stats()
    n = hf.STATS_MAX_REASONS + 44
    for i in range(n):
        hf._fall_back(f"value head_dim differs: v [1, 2, {i + 1}, 64]")
    hf._fall_back("value head_dim differs: v [1, 2, 1, 64]")  # a kept reason still counts
    stats = hf.get_stats()
    assert stats["fallback"] == n + 1
    assert sum(stats["reasons"].values()) == n + 1
    assert len(stats["reasons"]) == hf.STATS_MAX_REASONS + 1
    assert stats["reasons"][hf.OTHER_REASONS] == n - hf.STATS_MAX_REASONS
    assert stats["reasons"]["value head_dim differs: v [1, 2, 1, 64]"] == 2
    hf.reset_stats()
    assert hf.get_stats()["reasons"] == {}
