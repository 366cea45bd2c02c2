"""The flash_attn drop-in (flash_attention_sm75.fa2, .bert_padding, flash_attn_dropin/) on the CPU.

The op's CPU implementation computes in float64 and rounds once, so everything here is checked
for exactness against float64 references: outputs within one float16 ulp of the reference,
LSE within float32 rounding, ``-inf`` rows identical. Gradients (the CPU backward is float32)
within the repository's CPU bound (1e-2 of the largest reference gradient). Shapes are small:
the whole file takes a few seconds.

* signatures: names, order, defaults of flash-attn 2.8.3's public functions (written out here
  from its documented API);
* every feature the kernels lack raises UnsupportedFeatureError naming it; the "off" values run;
* dense, varlen (random cu_seqlens with empty and one-token sequences, unequal q/k lengths,
  causal bottom-right per sequence, GQA, paged keys) and KV-cache calls (append in place,
  leftpad, causal chunks, rotary, cache_batch_idx, block_table) against per-sequence float64;
* bert_padding round trips, and the same results as transformers' own pad/unpad helpers;
* the package: ``pip install`` of flash_attn_dropin/, its metadata, transformers'
  ``is_flash_attn_2_available()`` accepting it, and a tiny Llama through
  ``attn_implementation="flash_attention_2"`` on the CPU (CUDA availability faked: the model
  runs on the op's CPU implementation).
"""
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

from flash_attention_sm75 import _ops, bert_padding, fa2
from reference import (assert_lse_exact, assert_out_exact, attention_ref, flash_attn_band,
                       varlen_attention_ref)

pytestmark = pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {_ops.EXTENSION_ERROR}")

F16 = torch.float16


# ------------------------------------------------------------------------------- signatures
# flash-attn 2.8.3's documented public API (flash_attn/flash_attn_interface.py, bert_padding.py):
# every parameter positional-or-keyword, in this order, with these defaults.
_OPTS = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
         "alibi_slopes=None, deterministic=False, return_attn_probs=False")
FA2_SIGNATURES = {
    "flash_attn_func": "q, k, v, " + _OPTS,
    "flash_attn_qkvpacked_func": "qkv, " + _OPTS,
    "flash_attn_kvpacked_func": "q, kv, " + _OPTS,
    "flash_attn_varlen_func": ("q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                               + _OPTS + ", block_table=None"),
    "flash_attn_varlen_qkvpacked_func": "qkv, cu_seqlens, max_seqlen, " + _OPTS,
    "flash_attn_varlen_kvpacked_func": ("q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                        "max_seqlen_k, " + _OPTS),
    "flash_attn_with_kvcache": (
        "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
        "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
        "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
        "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False"),
}
BERT_PADDING_SIGNATURES = {
    "pad_input": "hidden_states, indices, batch, seqlen",
    "unpad_input": "hidden_states, attention_mask, unused_mask=None",
    "index_first_axis": "input, indices",
    "index_put_first_axis": "values, indices, first_axis_dim",
    "unpad_input_for_concatenated_sequences": "hidden_states, attention_mask_in_length",
}


def _params(spec):
    sig = inspect.signature(eval(f"lambda {spec}: None"))  # noqa: S307 (a literal above)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _actual(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_signature_is_flash_attn_2s(name):
    assert _actual(getattr(fa2, name)) == _params(FA2_SIGNATURES[name])


@pytest.mark.parametrize("name", sorted(BERT_PADDING_SIGNATURES))
def test_bert_padding_signature_is_flash_attn_2s(name):
    assert _actual(getattr(bert_padding, name)) == _params(BERT_PADDING_SIGNATURES[name])


# ------------------------------------------------------------------------------- exactness
def assert_grad_close(g, ref, what):
    assert not torch.isnan(g).any(), what
    bound = 1e-2 * max(1.0, ref.abs().max().item())
    assert (g.double() - ref).abs().max().item() <= bound, what


def rand(*shape, grad=False, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    t = torch.randn(*shape, dtype=F16)
    return t.requires_grad_(True) if grad else t


# ------------------------------------------------------------------------------- options
BAD_OPTIONS = [
    (dict(dropout_p=0.1, return_attn_probs=True), "return_attn_probs=True with dropout_p=0.1",
     "accepted: return_attn_probs=False"),
]  # softcap, alibi_slopes (tests/test_scoremod.py) and dropout (tests/test_dropout.py) run


@pytest.mark.parametrize("api,kwargs,names,accepted", [
    (api, *case) for api in ("varlen",) for case in BAD_OPTIONS])
def test_unsupported_feature_raises_naming_it(api, kwargs, names, accepted):
    q, k, v = rand(1, 6, 4, 16), rand(1, 9, 2, 16), rand(1, 9, 2, 16)
    with pytest.raises(fa2.UnsupportedFeatureError) as e:
        if api == "func":
            fa2.flash_attn_func(q, k, v, **kwargs)
        elif api == "varlen":
            cu_q, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
            fa2.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 6, 9, **kwargs)
        else:
            with torch.no_grad():
                fa2.flash_attn_with_kvcache(q, k, v, **kwargs)
    msg = str(e.value)
    assert isinstance(e.value, NotImplementedError) and isinstance(e.value, ValueError)
    assert names in msg and accepted in msg, msg


def test_every_option_runs_together_in_dense_and_packed_calls(monkeypatch):
    # softcap, ALiBi, deterministic=True (also under FLASH_SM75_BWD_DQ=atomic) and dropout run
    # together, dense and packed, forward and backward.
    q = rand(1, 4, 2, 16)
    monkeypatch.setenv("FLASH_SM75_BWD_DQ", "atomic")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for p in (0.0, 0.5):
        kw = dict(softcap=1.0, alibi_slopes=torch.ones(2), deterministic=True)
        leaf = q.detach().requires_grad_()
        dense = fa2.flash_attn_func(leaf, leaf, leaf, p, **kw)
        packed = fa2.flash_attn_varlen_func(leaf[0], leaf[0], leaf[0], cu, cu, 4, 4, p, **kw)
        (dense.float().sum() + packed.float().sum()).backward()
        for out in (dense, packed[None], leaf.grad):
            assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.fixture
def bwd_flags(monkeypatch):
    """The ``deterministic`` argument of every call of ``torch.ops.flash_attention_sm75.bwd``
    and ``varlen_bwd``, in call order."""
    flags = []
    for name, index in (("bwd", 11), ("varlen_bwd", 13)):
        real = getattr(torch.ops.flash_attention_sm75, name)
        monkeypatch.setattr(torch.ops.flash_attention_sm75, name,
                            lambda *a, real=real, index=index: flags.append(a[index]) or real(*a),
                            raising=False)
    return flags


def _dense_and_varlen(deterministic):
    """flash_attn_func and flash_attn_varlen_func on the same tensors, outputs summed."""
    q = rand(1, 4, 2, 16, grad=True, seed=3)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    return (fa2.flash_attn_func(q, q, q, deterministic=deterministic).float().sum()
            + fa2.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 3, 3,
                                         deterministic=deterministic).float().sum())


def test_deterministic_true_makes_its_own_backward_deterministic(monkeypatch, bwd_flags):
    # flash-attn's deterministic=True is a request for that call's backward: it holds whatever
    # the global setting is when the backward runs (the atomic dQ mode here).
    monkeypatch.setenv("FLASH_SM75_BWD_DQ", "atomic")
    from flash_attention_sm75 import deterministic_backward

    with deterministic_backward():  # deterministic at forward time only
        det = _dense_and_varlen(True)
        plain = _dense_and_varlen(False)
    assert torch.equal(det, plain)  # the same forward
    det.backward()
    plain.backward()
    assert bwd_flags == [True, True, False, False]
    bwd_flags.clear()
    loss = _dense_and_varlen(True)
    with deterministic_backward(False):
        loss.backward()
    assert bwd_flags == [True, True]
    bwd_flags.clear()
    loss = _dense_and_varlen(False)
    with deterministic_backward():  # without the flag the setting at backward time decides
        loss.backward()
    assert bwd_flags == [True, True]
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        fa2.flash_attn_func(rand(1, 4, 2, 16), rand(1, 4, 2, 16), rand(1, 4, 2, 16),
                            deterministic=1)


@pytest.mark.parametrize("api", ["flash_attn_func", "flash_attn_varlen_func"])
def test_deterministic_true_survives_torch_compile(monkeypatch, api):
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setenv("FLASH_SM75_BWD_DQ", "atomic")
    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: gm,
                           bw_compiler=lambda gm, _: graphs.append(gm) or gm)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    call, bwd, index = {
        "flash_attn_func": (lambda q, det: fa2.flash_attn_func(q, q, q, deterministic=det),
                            torch.ops.flash_attention_sm75.bwd.default, 11),
        "flash_attn_varlen_func": (lambda q, det: fa2.flash_attn_varlen_func(
            q[0], q[0], q[0], cu, cu, 3, 3, deterministic=det),
            torch.ops.flash_attention_sm75.varlen_bwd.default, 13)}[api]
    flags = {}
    for det in (True, False):
        torch._dynamo.reset()
        q = rand(1, 4, 2, 16, grad=True)
        fn = torch.compile(lambda q: call(q, det), fullgraph=True, backend=backend)
        fn(q).float().sum().backward()
        [node] = [n for n in graphs[-1].graph.nodes if n.target is bwd]
        flags[det] = node.args[index] if len(node.args) > index else False
    assert flags == {True: True, False: False}


@pytest.mark.parametrize("causal", [False, True])
def test_off_values_run_and_change_nothing(causal):
    q, k, v = rand(2, 5, 4, 16), rand(2, 7, 2, 16), rand(2, 7, 2, 16)
    ref = fa2.flash_attn_func(q, k, v, causal=causal)
    # windows that hide no key (left >= seqlen_k - 1; right >= seqlen_q - 1 or causal), softcap
    # <= 0 (off in flash-attn), dropout 0 as an int
    for kw in (dict(window_size=(6, 4)), dict(window_size=(100, -1)), dict(softcap=-1.0),
               dict(dropout_p=0), dict(window_size=[-1, -1])):
        assert torch.equal(fa2.flash_attn_func(q, k, v, causal=causal, **kw), ref), kw
    if causal:  # flash-attn replaces the right window by 0 when causal
        assert torch.equal(fa2.flash_attn_func(q, k, v, causal=True, window_size=(6, 0)), ref)


@pytest.mark.parametrize("call,match", [
    (lambda q: fa2.flash_attn_func(q.to(torch.bfloat16), q.to(torch.bfloat16), q.to(torch.bfloat16)),
     "q must be float16"),
    (lambda q: fa2.flash_attn_func(q, q, q, causal=1), "causal must be a bool"),
    (lambda q: fa2.flash_attn_func(q, q, q, window_size=3), "window_size must be a pair"),
    (lambda q: fa2.flash_attn_func(q, q, q, 0.0, -1.0), "softmax_scale must be"),
    (lambda q: fa2.flash_attn_func(q[0], q[0], q[0]), "q must be 4-D"),
    (lambda q: fa2.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4]),
                                          torch.tensor([0, 4]), 4, 4), "cu_seqlens_q must be int32"),
    (lambda q: fa2.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                          torch.tensor([0, 4], dtype=torch.int32), 3, 4),
     "no sequence longer than the max_seqlen passed"),
    (lambda q: fa2.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 3, 2], dtype=torch.int32),
                                          torch.tensor([0, 2, 4], dtype=torch.int32), 4, 4),
     "non-decreasing"),
    (lambda q: fa2.flash_attn_varlen_func(q, q, q, torch.tensor([0, 4], dtype=torch.int32),
                                          torch.tensor([0, 4], dtype=torch.int32), 4, 4),
     "q must be a 3-D tensor"),
    (lambda q: fa2.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                          torch.tensor([0, 4], dtype=torch.int32), 4.0, 4),
     "max_seqlen_q must be an int"),
    (lambda q: fa2.flash_attn_with_kvcache(q, q, q, k=q), "k and v must be given together"),
    (lambda q: fa2.flash_attn_with_kvcache(q, q, q, k=q, v=q), "cache_seqlens must be given"),
])
def test_invalid_arguments_raise_value_error_naming_them(call, match):
    q = rand(1, 4, 2, 16)
    with pytest.raises(ValueError, match=match) as e:
        with torch.no_grad():
            call(q)
    assert not isinstance(e.value, fa2.UnsupportedFeatureError)


# ------------------------------------------------------------------------------- dense
@pytest.mark.parametrize("sq,sk", [(1, 9), (5, 5), (7, 3), (12, 17)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk,d", [(4, 4, 64), (6, 2, 32), (3, 1, 20)])
def test_flash_attn_func_exact(sq, sk, causal, h, hk, d):
    q, k, v = rand(2, sq, h, d, seed=sq * 31 + sk), rand(2, sk, hk, d), rand(2, sk, hk, d)
    out, lse, s_dmask = fa2.flash_attn_func(q, k, v, 0.0, None, causal, return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)
    assert s_dmask.shape == (0,) and s_dmask.dtype == F16  # flash-attn's value for dropout_p=0
    assert fa2.flash_attn_func(q, k, v, causal=causal).shape == (2, sq, h, d)


def test_flash_attn_func_positional_order_and_scale():
    q, k, v = rand(1, 6, 2, 24, seed=3), rand(1, 6, 2, 24), rand(1, 6, 2, 24)
    out = fa2.flash_attn_func(q, k, v, 0.0, 0.3, True)  # dropout_p, softmax_scale, causal
    assert_out_exact(out, attention_ref(q, k, v, causal=True, softmax_scale=0.3)[0])


def test_packed_forms_equal_flash_attn_func_forward_and_backward():
    qkv = rand(2, 9, 3, 4, 32, grad=True, seed=5)
    out = fa2.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(2))
    ref = fa2.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    q2 = q.detach()
    kv = rand(2, 11, 2, 2, 32, seed=6)
    o_kv, lse_kv, _ = fa2.flash_attn_kvpacked_func(q2, kv, return_attn_probs=True)
    o, lse, _ = fa2.flash_attn_func(q2, kv[:, :, 0], kv[:, :, 1], return_attn_probs=True)
    assert torch.equal(o_kv, o) and torch.equal(lse_kv, lse)


def test_flash_attn_func_backward_matches_float64():
    q, k, v = rand(2, 7, 4, 20, grad=True, seed=7), rand(2, 9, 2, 20, grad=True), rand(2, 9, 2, 20, grad=True)
    out = fa2.flash_attn_func(q, k, v, causal=True)  # head_dim 20: zero-padded to 24 and back
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=True)[0]
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for name, a, b in zip("qkv", grads, refs):
        assert a.shape == b.shape
        assert_grad_close(a, b, "d" + name)


def _last_dim_strided(t):
    """``t``'s values in a tensor whose last dimension is not contiguous (stride 2)."""
    wide = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
    wide[..., ::2] = t.detach()
    out = wide[..., ::2]
    assert out.stride(-1) == 2 and torch.equal(out, t)
    return out.requires_grad_(t.requires_grad)


def test_last_dim_that_is_not_contiguous_is_copied_as_flash_attn_does():
    """flash-attn 2 copies a q / k / v whose last dimension is not contiguous
    (``maybe_contiguous``); its functions here used to refuse one with a ValueError."""
    q, k, v = rand(2, 5, 4, 32, seed=41), rand(2, 7, 2, 32), rand(2, 7, 2, 32)
    ref = fa2.flash_attn_func(q, k, v, causal=True)
    for i in range(3):
        args = [q, k, v]
        args[i] = _last_dim_strided(args[i])
        assert torch.equal(fa2.flash_attn_func(*args, causal=True), ref), f"argument {i}"
    # the gradient reaches the strided leaf
    qs = _last_dim_strided(q.detach().requires_grad_(True))
    qc = q.detach().requires_grad_(True)
    g = torch.randn_like(ref)
    fa2.flash_attn_func(qs, k, v, causal=True).backward(g)
    fa2.flash_attn_func(qc, k, v, causal=True).backward(g)
    assert torch.equal(qs.grad, qc.grad)
    # varlen
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32)
    qv, kv, vv = q[0], k[0], v[0]
    ref_v = fa2.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 3, 4, causal=True)
    got_v = fa2.flash_attn_varlen_func(_last_dim_strided(qv), kv, _last_dim_strided(vv),
                                       cu_q, cu_k, 3, 4, causal=True)
    assert torch.equal(got_v, ref_v)
    # the KV cache: q and the new keys / values may be copied; the caches are written in place
    kc, vc = rand(2, 16, 2, 32, seed=42), rand(2, 16, 2, 32)
    kn, vn = rand(2, 2, 2, 32), rand(2, 2, 2, 32)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    with torch.no_grad():
        ref_c = fa2.flash_attn_with_kvcache(q[:, :1], kc, vc, kn, vn, cache_seqlens=lens)
        got_c = fa2.flash_attn_with_kvcache(_last_dim_strided(q[:, :1]), kc2, vc2,
                                            _last_dim_strided(kn), _last_dim_strided(vn),
                                            cache_seqlens=lens)
    assert torch.equal(got_c, ref_c) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    with pytest.raises(ValueError, match="k_cache must have a contiguous last dimension"):
        with torch.no_grad():
            fa2.flash_attn_with_kvcache(q[:, :1], _last_dim_strided(kc), vc, kn, vn,
                                        cache_seqlens=lens)


# ------------------------------------------------------------------------------- varlen
def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def _varlen_case(seed, lens_q, lens_k, h, hk, d, grad=False):
    torch.manual_seed(seed)
    q = rand(sum(lens_q), h, d, grad=grad)
    k = rand(sum(lens_k), hk, d, grad=grad)
    v = rand(sum(lens_k), hk, d, grad=grad)
    return q, k, v, _cu(lens_q), _cu(lens_k)


def _varlen_ref(q, k, v, cu_q, cu_k, causal, scale=None, window=(-1, -1)):
    return varlen_attention_ref(q, k, v, cu_q, cu_k, causal, softmax_scale=scale, window=window)


# empty and one-token sequences, q longer and shorter than k, a batch of one
VARLEN_LENGTHS = [
    ([3, 0, 1, 5, 2, 4], [4, 2, 0, 5, 7, 1]),
    ([1, 1, 1], [6, 0, 3]),
    ([9], [4]),
    ([0, 6, 2], [0, 6, 11]),
]


@pytest.mark.parametrize("lens", VARLEN_LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk,d", [(4, 2, 32), (2, 2, 24)])
def test_varlen_exact(lens, causal, h, hk, d):
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = _varlen_case(len(lens_q) * 7 + d, lens_q, lens_k, h, hk, d)
    out, lse, s_dmask = fa2.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_attn_probs=True)
    ref, ref_lse = _varlen_ref(q, k, v, cu_q, cu_k, causal)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)  # flash-attn's packed (nheads, total_q)
    assert s_dmask.numel() == 0
    # larger max_seqlen than needed: more padding, the same answer
    out2 = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q) + 3, max(lens_k) + 5,
                                      causal=causal)
    assert torch.equal(out2, out)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_matches_float64(causal):
    lens_q, lens_k = [3, 0, 1, 5, 2], [4, 2, 0, 5, 7]
    q, k, v, cu_q, cu_k = _varlen_case(11, lens_q, lens_k, 4, 2, 32, grad=True)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=causal)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = _varlen_ref(q64, k64, v64, cu_q, cu_k, causal)
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.double(), allow_unused=True)
    for name, a, b in zip("qkv", grads, refs):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        assert_grad_close(a, b, "d" + name)
    # keys of the empty-query sequence (sequence 1) and of nothing get exactly zero gradient
    assert (grads[1][4:6] == 0).all() and (grads[2][4:6] == 0).all()


def test_varlen_packed_forms_and_paged_keys_equal_varlen_func():
    lens_q, lens_k = [3, 0, 4, 1], [5, 2, 4, 0]
    q, k, v, cu_q, cu_k = _varlen_case(12, lens_q, lens_k, 4, 2, 16)
    ref, ref_lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True,
                                                 return_attn_probs=True)
    o, lse, _ = fa2.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu_q, cu_k, 4, 5,
                                                    causal=True, return_attn_probs=True)
    assert torch.equal(o, ref) and torch.equal(lse, ref_lse)
    # paged keys: pages of 3 rows, shuffled, sequence b's keys in block_table[b]
    page, nblk = 3, 2
    kp, vp = torch.zeros(9, page, 2, 16, dtype=F16), torch.zeros(9, page, 2, 16, dtype=F16)
    table = torch.tensor([[4, 7], [0, 2], [8, 1], [5, 6]], dtype=torch.int32)
    for b in range(4):
        for j in range(lens_k[b]):
            kp[table[b, j // page], j % page] = k[cu_k[b] + j]
            vp[table[b, j // page], j % page] = v[cu_k[b] + j]
    o, lse, _ = fa2.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 5, causal=True,
                                           return_attn_probs=True, block_table=table)
    assert torch.equal(o, ref) and torch.equal(lse, ref_lse)
    assert nblk * page >= max(lens_k)

    qkv = rand(7, 3, 2, 16, seed=13)
    cu = _cu([4, 3])
    o = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, causal=True)
    assert torch.equal(o, fa2.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 4,
                                                     4, causal=True))


def test_varlen_tokens_outside_the_sequences_get_zero_and_tensor_max_seqlen():
    q, k, v, _, _ = _varlen_case(14, [8], [8], 2, 2, 16)
    cu = torch.tensor([1, 3, 6], dtype=torch.int32)  # tokens 0, 6, 7 belong to no sequence
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu, cu, torch.tensor(3), 3,
                                             return_attn_probs=True)
    assert (out[[0, 6, 7]] == 0).all() and torch.isneginf(lse[:, [0, 6, 7]]).all()
    ref, ref_lse = _varlen_ref(q, k, v, cu, cu, False)
    assert_out_exact(out[1:6], ref)
    assert_lse_exact(lse[:, 1:6], ref_lse)


def test_varlen_zero_sizes():
    q = torch.zeros(0, 2, 16, dtype=F16)
    empty = torch.zeros(1, dtype=torch.int32)
    assert fa2.flash_attn_varlen_func(q, q, q, empty, empty, 0, 0).shape == (0, 2, 16)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    out, lse, _ = fa2.flash_attn_varlen_func(q, q, q, cu, cu, 0, 0, return_attn_probs=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


# ------------------------------------------------------------------------------- KV cache
def _cache_ref(q, kc, vc, start, end, causal, rows=None, scale=None, window=(-1, -1),
               alibi_slopes=None):
    """Per batch entry b: q[b] over cache rows [start[b], end[b]) of cache entry rows[b]."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        r = b if rows is None else int(rows[b])
        ks = kc[r, int(start[b]):int(end[b])].unsqueeze(0)
        vs = vc[r, int(start[b]):int(end[b])].unsqueeze(0)
        slopes = None if alibi_slopes is None else (
            alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        o, lse = attention_ref(q[b:b + 1], ks, vs, causal=causal and q.shape[1] > 1,
                               softmax_scale=scale, window_size=window, alibi_slopes=slopes)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("leftpad", [False, True])
def test_kvcache_append_and_attend_exact(seqlen_q, causal, leftpad):
    torch.manual_seed(seqlen_q * 10 + causal * 2 + leftpad)
    B, S, h, hk, d, new = 3, 16, 4, 2, 32, 2
    q = rand(B, seqlen_q, h, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    k, v = rand(B, new, hk, d), rand(B, new, hk, d)
    seqlens = torch.tensor([5, 0, 14], dtype=torch.int32)
    lp = torch.tensor([2, 0, 9], dtype=torch.int32) if leftpad else None
    kc0, vc0 = kc.clone(), vc.clone()
    with torch.no_grad():
        out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                               cache_leftpad=lp, causal=causal,
                                               return_softmax_lse=True, num_splits=3)
    exp_k, exp_v = kc0.clone(), vc0.clone()
    for b in range(B):
        exp_k[b, seqlens[b]:seqlens[b] + new] = k[b]
        exp_v[b, seqlens[b]:seqlens[b] + new] = v[b]
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)  # appended in place, nothing else
    start = lp if leftpad else torch.zeros(B, dtype=torch.int32)
    ref, ref_lse = _cache_ref(q, exp_k, exp_v, start, seqlens + new, causal)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


# Causal chunks (seqlen_q > 1), windows and ALiBi against cache_seqlens: per-sequence bottom-right
# alignment is the kernels' own, so these run as ONE KV-cache op call on the cache in place
# (no gathered copy, no host read of the lengths, no per-sequence loop).
@pytest.mark.parametrize("case", ["causal_chunk", "window", "alibi_decode", "alibi_causal"])
def test_kvcache_per_sequence_alignment_is_one_kvcache_op_call(case, op_calls, varlen_op_calls,
                                                               kvcache_op_calls):
    torch.manual_seed(len(case))
    B, S, h, hk, d, new = 3, 16, 4, 2, 32, 2
    seqlen_q = 1 if case == "alibi_decode" else 3
    causal = case in ("causal_chunk", "alibi_causal")
    window = (3, 1) if case == "window" else (-1, -1)
    slopes = torch.rand(B, h) if case.startswith("alibi") else None
    q = rand(B, seqlen_q, h, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    k, v = rand(B, new, hk, d), rand(B, new, hk, d)
    seqlens = torch.tensor([5, 0, 14], dtype=torch.int32)
    with torch.no_grad():
        out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                               causal=causal, window_size=window,
                                               alibi_slopes=slopes, return_softmax_lse=True)
    assert len(kvcache_op_calls) == 1 and not op_calls and not varlen_op_calls
    ref, ref_lse = _cache_ref(q, kc, vc, torch.zeros(B, dtype=torch.int32), seqlens + new,
                              causal, window=window, alibi_slopes=slopes)
    assert out.shape == q.shape and lse.shape == (B, h, seqlen_q)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


# Sliding windows (flash-attn's window_size), per sequence and bottom-right aligned, against the
# float64 definition (reference.visible_mask) of the window flash-attn's kernels run.
WINDOWS = [(2, 2), (-1, 0), (3, -1), (0, 0), (-5, 1)]


def test_one_sided_window_hides_keys_as_flash_attn_does():
    # flash-attn: window (1, -1) with 5 queries over 2 keys reads the right side as seqlen_k = 2,
    # so row i sees keys j <= i - 1 (and j >= i - 4): row 0 sees none (out 0, lse -inf), row 1
    # key 0 only. The op's own -1 (no limit) would show row 0 both keys.
    q, k, v = rand(1, 5, 2, 32, seed=3), rand(1, 2, 2, 32), rand(1, 2, 2, 32)
    out, lse, _ = fa2.flash_attn_func(q, k, v, window_size=(1, -1), return_attn_probs=True)
    assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, :, 0]).all()
    ref, ref_lse = attention_ref(q[:, 1:2], k[:, :1], v[:, :1])
    assert_out_exact(out[:, 1:2], ref)
    assert_lse_exact(lse[:, :, 1:2], ref_lse)
    full, _ = attention_ref(q, k, v)
    assert not torch.allclose(out[:, 0].float(), full[:, 0].float())


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(5, 5), (7, 3), (6, 13)])
def test_flash_attn_func_window_exact(sq, sk, causal, window):
    q, k, v = rand(2, sq, 4, 32, seed=sq * 7 + sk), rand(2, sk, 2, 32), rand(2, sk, 2, 32)
    out, lse, _ = fa2.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal,
                                 window_size=flash_attn_band(window, causal, sk))
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


@pytest.mark.parametrize("window", WINDOWS[:4], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_LENGTHS[:2])
def test_varlen_window_exact(lens, causal, window):
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = _varlen_case(11, lens_q, lens_k, 4, 2, 32)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, window_size=window,
                                             return_attn_probs=True)
    ref, ref_lse = _varlen_ref(q, k, v, cu_q, cu_k, causal,
                               window=flash_attn_band(window, causal, max(lens_k)))
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


@pytest.mark.parametrize("window", [(3, -1), (2, 1), (0, 0)], ids=str)
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_window_exact(seqlen_q, causal, window):
    torch.manual_seed(seqlen_q + 3 * causal)
    B, S, h, hk, d, new = 3, 16, 4, 2, 32, 2
    q = rand(B, seqlen_q, h, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    k, v = rand(B, new, hk, d), rand(B, new, hk, d)
    seqlens = torch.tensor([5, 0, 12], dtype=torch.int32)
    lp = torch.tensor([2, 0, 9], dtype=torch.int32)
    with torch.no_grad():
        out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                               cache_leftpad=lp, causal=causal,
                                               window_size=window, return_softmax_lse=True)
    ref, ref_lse = _cache_ref(q, kc, vc, lp, seqlens + new, causal,
                              window=flash_attn_band(window, causal and seqlen_q > 1, S))
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


def test_kvcache_without_new_keys_and_int_seqlens():
    q, kc, vc = rand(2, 3, 2, 16, seed=21), rand(2, 10, 2, 16), rand(2, 10, 2, 16)
    with torch.no_grad():
        full = fa2.flash_attn_with_kvcache(q, kc, vc, causal=True)
        part = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, causal=True)
    assert_out_exact(full, attention_ref(q, kc, vc, causal=True)[0])
    assert_out_exact(part, attention_ref(q, kc[:, :7], vc[:, :7], causal=True)[0])


def _rotary_ref(x, cos, sin, pos, interleaved):
    """float64 rotation of x (B, S, H, D) at positions pos (B, S), rounded to fp16."""
    rd = 2 * cos.shape[1]
    c = cos.double()[pos].unsqueeze(2)
    s = sin.double()[pos].unsqueeze(2)
    x64 = x.double()
    xr = x64[..., :rd]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat((a * c - b * s, a * s + b * c), -1)
    return torch.cat((rot, x64[..., rd:]), -1).to(F16)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_rotary(interleaved, causal):
    torch.manual_seed(30 + interleaved + 2 * causal)
    B, S, h, hk, d, new, sq = 2, 12, 2, 1, 32, 3, 3
    q, kc, vc = rand(B, sq, h, d), rand(B, S, hk, d), rand(B, S, hk, d)
    k, v = rand(B, new, hk, d), rand(B, new, hk, d)
    angles = torch.arange(S).double().view(-1, 1) * torch.rand(8).double().view(1, -1)
    cos, sin = angles.cos().to(F16), angles.sin().to(F16)  # rotary_dim 16 of head_dim 32
    seqlens = torch.tensor([2, 7], dtype=torch.int32)
    kc0, vc0 = kc.clone(), vc.clone()
    with torch.no_grad():
        out = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, seqlens, causal=causal,
                                          rotary_interleaved=interleaved)
    pos_k = seqlens.long().view(-1, 1) + torch.arange(new).view(1, -1)
    k_rot = _rotary_ref(k, cos, sin, pos_k, interleaved)
    for b in range(B):  # the cache holds the rotated keys (fp32 vs fp64 rotation: <= 1 ulp)
        got = kc[b, seqlens[b]:seqlens[b] + new]
        assert_out_exact(got, k_rot[b].double(), "rotated k")
        assert torch.equal(vc[b, seqlens[b]:seqlens[b] + new], v[b])
    # q at cache_seqlens + i when causal, else all at cache_seqlens (flash-attn's rule)
    pos_q = seqlens.long().view(-1, 1) + (torch.arange(sq).view(1, -1) if causal else 0)
    q_rot = _rotary_ref(q, cos, sin, pos_q.expand(B, sq), interleaved)
    ref, _ = _cache_ref(q_rot, kc, vc, torch.zeros(B), seqlens + new, causal)
    assert (out.double() - ref).abs().max().item() <= 2e-3


def test_kvcache_batch_idx_and_paged_equal_plain():
    torch.manual_seed(40)
    B, S, hk, d, new, page = 2, 12, 2, 16, 2, 4
    q = rand(B, 3, 4, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    k, v = rand(B, new, hk, d), rand(B, new, hk, d)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    for causal in (False, True):
        plain_k, plain_v = kc.clone(), vc.clone()
        with torch.no_grad():
            ref = fa2.flash_attn_with_kvcache(q, plain_k, plain_v, k, v, cache_seqlens=seqlens,
                                              causal=causal)
            # the same rows inside a larger cache, selected by cache_batch_idx
            big_k, big_v = rand(5, S, hk, d), rand(5, S, hk, d)
            idx = torch.tensor([3, 1], dtype=torch.int32)
            big_k[idx.long()], big_v[idx.long()] = kc, vc
            out = fa2.flash_attn_with_kvcache(q, big_k, big_v, k, v, cache_seqlens=seqlens,
                                              cache_batch_idx=idx, causal=causal)
            assert torch.equal(out, ref)
            assert torch.equal(big_k[idx.long()], plain_k)
            # paged: 3 pages of 4 rows per sequence, in shuffled blocks
            table = torch.tensor([[5, 0, 2], [1, 4, 3]], dtype=torch.int32)
            pk, pv = torch.zeros(6, page, hk, d, dtype=F16), torch.zeros(6, page, hk, d, dtype=F16)
            pk.view(-1, hk, d)[(table.long() * page).repeat_interleave(page, 1)
                               + torch.arange(S) % page] = kc
            pv.view(-1, hk, d)[(table.long() * page).repeat_interleave(page, 1)
                               + torch.arange(S) % page] = vc
            out = fa2.flash_attn_with_kvcache(q, pk, pv, k, v, cache_seqlens=seqlens,
                                              block_table=table, causal=causal)
        assert torch.equal(out, ref)
        gathered = pk[table.long()].flatten(1, 2)
        assert torch.equal(gathered, plain_k)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


# (keyword arguments, the argument the error must name): indices out of range, checked before
# the cache is written (8 cache rows, 3 new keys; paged: 2 pages of 4 rows per sequence)
BAD_CACHE_INDICES = [
    (dict(cache_seqlens=_i32(2, 6)), "cache_seqlens must be in [0, seqlen_cache - seqlen_new] = [0, 5]"),
    (dict(cache_seqlens=_i32(-1, 2)), "cache_seqlens must be in"),
    (dict(cache_seqlens=6), "cache_seqlens must be in [0, seqlen_cache - seqlen_new] = [0, 5], got 6"),
    (dict(cache_seqlens=-1), "cache_seqlens must be in"),
    (dict(cache_seqlens=_i32(0, 9), k=None, v=None), "cache_seqlens must be in"),
    (dict(cache_seqlens=_i32(9, 0), k=None, v=None, causal=True), "cache_seqlens must be in"),
    (dict(cache_batch_idx=_i32(0, 2)), "cache_batch_idx must hold cache rows in [0, k_cache.shape[0] = 2)"),
    (dict(cache_batch_idx=_i32(-1, 0)), "cache_batch_idx must hold"),
    (dict(block_table=_i32(0, 1, 2, 4).view(2, 2)), "block_table must hold block indices in [0, num_blocks = 4)"),
    (dict(block_table=_i32(0, -1, 2, 3).view(2, 2)), "block_table must hold"),  # page 1 holds keys
    (dict(block_table=_i32(0, 1, 2, 3).view(2, 2), k=None, v=None, cache_seqlens=None,
          block_table_bad=(0, 1, 7)), "block_table must hold"),  # all pages are keys then
    (dict(rotary=True, causal=True, q_rows=4), "rotary_cos / rotary_sin must have a row"),
    (dict(k_rows=9), "k has 9 new keys, more than the cache holds (seqlen_cache = 8)"),
]


@pytest.mark.parametrize("kwargs,match", BAD_CACHE_INDICES,
                         ids=[f"{i}-{m.split()[0]}" for i, (_, m) in enumerate(BAD_CACHE_INDICES)])
def test_kvcache_bad_indices_raise_before_writing(kwargs, match):
    # Previously: a raw IndexError naming no argument with k_cache written and v_cache not, or
    # (negative cache_seqlens) keys silently written at the end of the cache and clamped away.
    kwargs = dict(kwargs)
    paged = "block_table" in kwargs
    bad_entry = kwargs.pop("block_table_bad", None)
    if bad_entry is not None:
        kwargs["block_table"][bad_entry[:2]] = bad_entry[2]
    rotary = kwargs.pop("rotary", False)
    q = rand(2, kwargs.pop("q_rows", 1), 4, 16, seed=5)
    kc, vc = (rand(4, 4, 2, 16), rand(4, 4, 2, 16)) if paged else (rand(2, 8, 2, 16), rand(2, 8, 2, 16))
    new = kwargs.pop("k_rows", 3)
    args = dict(k=rand(2, new, 2, 16), v=rand(2, new, 2, 16), cache_seqlens=_i32(2, 5))
    if rotary:
        args.update(rotary_cos=rand(8, 4), rotary_sin=rand(8, 4), cache_seqlens=_i32(5, 0))
    args.update(kwargs)
    before_k, before_v = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=re.escape(match)), torch.no_grad():
        fa2.flash_attn_with_kvcache(q, kc, vc, **args)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)  # nothing written
    # the same call with valid values runs (and writes both caches when it appends)
    args.update(cache_seqlens=_i32(2, 5) if args.get("k") is not None and new <= 3 else None)
    args.pop("cache_batch_idx", None)
    if paged:
        args["block_table"] = _i32(0, 1, 2, 3).view(2, 2)
    if rotary:
        args.update(causal=False)
    if new > 3:
        args.update(k=None, v=None)
    with torch.no_grad():
        fa2.flash_attn_with_kvcache(q, kc, vc, **args)
    if args.get("k") is not None:
        assert not torch.equal(kc, before_k) and not torch.equal(vc, before_v)


def test_kvcache_and_varlen_ignore_block_table_entries_of_pages_without_keys():
    # flash-attn reads only the pages that hold keys; callers may leave the others unset (-1).
    q, k, v = rand(2, 1, 4, 16, seed=6), rand(2, 2, 2, 16), rand(2, 2, 2, 16)
    kc, vc = rand(5, 4, 2, 16), rand(5, 4, 2, 16)
    full, holes = _i32(3, 1, 0, 4).view(2, 2), _i32(3, -1, 0, 99).view(2, 2)
    with torch.no_grad():
        for causal in (False, True):
            kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            ref = fa2.flash_attn_with_kvcache(q, kc1, vc1, k, v, cache_seqlens=_i32(1, 2),
                                              block_table=full, causal=causal)
            out = fa2.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=_i32(1, 2),
                                              block_table=holes, causal=causal)
            assert torch.equal(out, ref) and torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    cu_q, cu_k = _cu([1, 1]), _cu([3, 4])
    ref = fa2.flash_attn_varlen_func(q.flatten(0, 1), kc, vc, cu_q, cu_k, 1, 4, block_table=full)
    out = fa2.flash_attn_varlen_func(q.flatten(0, 1), kc, vc, cu_q, cu_k, 1, 4, block_table=holes)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match=re.escape("block_table must hold block indices in [0, "
                                                   "num_blocks = 5)")):
        fa2.flash_attn_varlen_func(q.flatten(0, 1), kc, vc, cu_q, _cu([5, 4]), 1, 5,
                                   block_table=holes)


def test_varlen_and_kvcache_compile_fullgraph_on_cpu():
    # The device-side checks of cu_seqlens and the cache indices stay in the graph
    # (torch._assert_async) instead of a data-dependent bool() that fullgraph=True refuses.
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _varlen_case(21, [3, 0, 4], [5, 2, 4], 4, 2, 16, grad=True)
    varlen = torch.compile(fa2.flash_attn_varlen_func, fullgraph=True)
    ref = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    out = varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    assert torch.equal(out, ref)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(RuntimeError, match="no sequence longer than the max_seqlen passed"):
        varlen(q, k, v, cu_q, cu_k, 3, 5, causal=True)

    kvcache = torch.compile(fa2.flash_attn_with_kvcache, fullgraph=True)
    qd, kn, vn = rand(2, 1, 4, 16), rand(2, 2, 2, 16), rand(2, 2, 2, 16)
    kc, vc = rand(2, 8, 2, 16), rand(2, 8, 2, 16)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    with torch.no_grad():
        ref = fa2.flash_attn_with_kvcache(qd, kc_ref, vc_ref, kn, vn, cache_seqlens=_i32(3, 6))
        out = kvcache(qd, kc, vc, kn, vn, cache_seqlens=_i32(3, 6))
        assert torch.equal(out, ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
        with pytest.raises(RuntimeError, match="cache_seqlens must be in"):
            kvcache(qd, kc, vc, kn, vn, cache_seqlens=_i32(3, 7))
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_kvcache_refuses_gradients():
    q = rand(1, 1, 2, 16, grad=True)
    kc = rand(1, 4, 2, 16)
    with pytest.raises(fa2.UnsupportedFeatureError, match="no backward.*torch.no_grad"):
        fa2.flash_attn_with_kvcache(q, kc, kc)
    with torch.no_grad():
        assert fa2.flash_attn_with_kvcache(q, kc, kc).shape == (1, 1, 2, 16)


# ------------------------------------------------------------------------------- bert_padding
def test_unpad_pad_round_trip_and_gradients():
    torch.manual_seed(50)
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]])
    unused = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    packed, idx, cu, max_len, used = bert_padding.unpad_input(x, mask, unused)
    assert packed.shape == (8, 2, 4) and max_len == 4 and isinstance(max_len, int)
    assert cu.tolist() == [0, 4, 4, 8] and cu.dtype == torch.int32
    assert used.tolist() == [3, 0, 4] and used.dtype == torch.int32
    back = bert_padding.pad_input(packed, idx, 3, 5)
    keep = (mask + unused).bool()[..., None, None]
    assert torch.equal(back, torch.where(keep, x, torch.zeros(())))
    back.sum().backward()
    assert torch.equal(x.grad, keep.expand_as(x).float())
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        bert_padding.index_first_axis(torch.zeros(3), torch.tensor([0]))


def test_padding_matches_transformers_helpers():
    mfau = pytest.importorskip("transformers.modeling_flash_attention_utils")
    torch.manual_seed(51)
    x = torch.randn(4, 6, 3, 8)
    mask = (torch.rand(4, 6) > 0.4).long()
    ours = bert_padding.unpad_input(x, mask)
    theirs = mfau._unpad_input(x, mask)
    for a, b in zip(ours, theirs):
        assert (a == b) if isinstance(a, int) else torch.equal(a, b)
    assert torch.equal(bert_padding.pad_input(ours[0], ours[1], 4, 6),
                       mfau._pad_input(theirs[0], theirs[1], 4, 6))


def test_unpad_concatenated_sequences():
    x = torch.arange(2 * 6).view(2, 6, 1).float()
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed, idx, cu, max_len = bert_padding.unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 11] and max_len == 6
    assert idx.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert torch.equal(packed[:, 0], x.flatten()[idx])


# ------------------------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def dropin_site(tmp_path_factory):
    from dropin_env import install_dropin

    return install_dropin(str(tmp_path_factory.mktemp("flash_attn_dropin")))


def test_dropin_installs_with_flash_attn_metadata(dropin_site, monkeypatch):
    import importlib
    import importlib.metadata as md
    import os

    from dropin_env import DROPIN_SRC, dropin_visible

    with dropin_visible(monkeypatch, dropin_site):
        import flash_attn
        import flash_attn.bert_padding
        import flash_attn.flash_attn_interface

        assert flash_attn.__file__.startswith(dropin_site)
        dist = md.distribution("flash-attn")
        assert dist.metadata["Name"] == "flash-attn"
        assert dist.version == flash_attn.__version__ == "2.8.3+sm75"
        assert "flash-attn" in md.packages_distributions()["flash_attn"]
        with open(os.path.join(DROPIN_SRC, "pyproject.toml")) as f:
            assert f'version = "{flash_attn.__version__}"' in f.read()
        # no install-time dependency: flash-attention-sm75 is not on PyPI (a requirement of
        # that name could be met by someone else's upload); flash_attn checks it at import
        assert not dist.requires
        assert flash_attn.SM75_DROPIN is True
        for name in FA2_SIGNATURES:
            assert getattr(flash_attn, name) is getattr(fa2, name)
            assert getattr(flash_attn.flash_attn_interface, name) is getattr(fa2, name)
        for name in BERT_PADDING_SIGNATURES:
            assert getattr(flash_attn.bert_padding, name) is getattr(bert_padding, name)
        assert importlib.util.find_spec("flash_attn.layers") is None


def test_transformers_accepts_the_dropin(dropin_site, monkeypatch):
    import importlib.util

    pytest.importorskip("transformers")
    from transformers.utils import import_utils

    from dropin_env import dropin_visible

    installed_before = importlib.util.find_spec("flash_attn") is not None
    with monkeypatch.context() as mp, dropin_visible(mp, dropin_site, fake_cuda=True):
        assert import_utils.is_flash_attn_2_available()
        assert import_utils.is_flash_attn_greater_or_equal("2.3.3")
        assert not import_utils.is_flash_attn_4_available()
    with monkeypatch.context() as mp, dropin_visible(mp, dropin_site, fake_cuda=False):
        # as for a real flash-attn: not available without a CUDA device
        assert import_utils.is_flash_attn_greater_or_equal("2.3.3")
        assert not import_utils.is_flash_attn_2_available()
    # and nothing is left behind: flash_attn importable only if it was before, caches re-read
    assert (importlib.util.find_spec("flash_attn") is not None) == installed_before
    if not installed_before:
        assert not import_utils.is_flash_attn_greater_or_equal("2.3.3")


def test_transformers_flash_attention_2_runs_the_dropin_on_cpu(dropin_site, monkeypatch,
                                                               varlen_op_calls):
    """A tiny Llama through attn_implementation="flash_attention_2": padded prefill (unpad ->
    the varlen op -> pad), greedy decoding with a cache, and a training step, against "sdpa" on the
    same fp16 weights (CPU: the op's float64 implementation, so the two differ only by
    transformers' own fp16 rounding around attention)."""
    pytest.importorskip("transformers")
    from devtools.model_configs import build_random_model, make_config

    from dropin_env import dropin_visible

    with dropin_visible(monkeypatch, dropin_site, fake_cuda=True):
        cfg = make_config("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        model = build_random_model(cfg, dtype=F16, device="cpu", seed=0,
                                   attn_implementation="flash_attention_2")
        assert model.config._attn_implementation == "flash_attention_2"
        ids = torch.randint(1, cfg.vocab_size, (3, 9))
        am = torch.ones_like(ids)
        am[1, :4] = 0
        am[2, :8] = 0  # one real token
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=am).logits.float()
            n_calls = len(varlen_op_calls)
            kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=3, do_sample=False,
                      pad_token_id=0, return_dict_in_generate=True, output_logits=True)
            gen = model.generate(**kw)
            model.set_attn_implementation("sdpa")
            stock = model(input_ids=ids, attention_mask=am).logits.float()
            gen_stock = model.generate(**kw)
        assert n_calls == cfg.num_hidden_layers  # every layer ran the varlen op, on the
        for call in varlen_op_calls[:n_calls]:    # unpadded tokens of the three rows
            assert call[0].shape[0] == 15 and call[3].tolist() == [0, 9, 14, 15]
        real = am.bool()
        tol = 5e-3
        assert (ours - stock)[real].abs().max().item() <= tol
        # Greedy decoding: the same tokens, step by step, while the two agree; the steps' logits
        # close. Random fp16 weights give near ties, where a difference within the tolerance
        # may pick the other token (seen with torch 2.15's CPU SDPA): that is accepted only when
        # stock's own logits of the two tokens are within twice the tolerance, and the row's
        # later steps (on different inputs) are not compared.
        for row in range(ids.shape[0]):
            for step, (lo, ls) in enumerate(zip(gen.logits, gen_stock.logits)):
                assert (lo[row].float() - ls[row].float()).abs().max().item() <= tol, (row, step)
                t_ours = int(gen.sequences[row, ids.shape[1] + step])
                t_stock = int(gen_stock.sequences[row, ids.shape[1] + step])
                if t_ours != t_stock:
                    gap = (ls[row, t_stock] - ls[row, t_ours]).float().abs().item()
                    assert gap <= 2 * tol, (row, step, t_ours, t_stock, gap)
                    break

        # one training step: the gradient reaches every parameter, close to sdpa's
        labels = ids.masked_fill(am == 0, -100)
        grads = {}
        for impl in ("flash_attention_2", "sdpa"):
            model.set_attn_implementation(impl)
            model.train().zero_grad(set_to_none=True)
            logits = model(input_ids=ids, attention_mask=am).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            (loss * 1024).backward()
            grads[impl] = {n: p.grad.float() for n, p in model.named_parameters()}
        for name, g in grads["sdpa"].items():
            ours_g = grads["flash_attention_2"][name]
            assert torch.isfinite(ours_g).all(), name
            rel = ((ours_g - g).norm() / g.norm().clamp_min(1e-12)).item()
            assert rel <= 2e-2, (name, rel)


def test_dropin_import_without_flash_attention_sm75_says_how_to_install(dropin_site, monkeypatch):
    import types

    from dropin_env import dropin_visible

    with dropin_visible(monkeypatch, dropin_site):
        with monkeypatch.context() as mp:
            mp.setitem(sys.modules, "flash_attention_sm75", None)  # not installed
            with pytest.raises(ImportError, match=r"needs the flash_attention_sm75 package.*"
                                                  r"not on PyPI.*pip install --no-build-isolation"):
                import flash_attn  # noqa: F401
        with monkeypatch.context() as mp:
            old = types.ModuleType("flash_attention_sm75")
            old.__version__ = "0.0.9"
            mp.setitem(sys.modules, "flash_attention_sm75", old)
            with pytest.raises(ImportError, match=r"needs flash-attention-sm75 >= 0\.1\.0, "
                                                  r"found 0\.0\.9.*pip install --no-build-isolation"):
                import flash_attn  # noqa: F401,F811
        import flash_attn  # noqa: F401,F811  (with the real package: imports)

        import flash_attention_sm75

        assert (flash_attn._release(flash_attention_sm75.__version__)
                >= flash_attn._release(flash_attn.MIN_FLASH_ATTENTION_SM75))


def _fake_flash_attn(site_dir, version):
    """A flash-attn distribution's metadata, as pip leaves it, in ``site_dir``."""
    info = os.path.join(site_dir, f"flash_attn-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {version}\n")


def _pip_install_dropin(tmp_path, env):
    import shutil
    import subprocess

    from dropin_env import DROPIN_SRC

    src, site = tmp_path / "src", tmp_path / "site"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(DROPIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                   "__pycache__"))
    return subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                           "--no-build-isolation", "--no-compile", "--target", str(site),
                           str(src)], capture_output=True, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env})


def test_dropin_build_refuses_to_replace_a_real_flash_attn(tmp_path):
    # pip would uninstall a real flash-attn (same distribution name) without a word.
    fake = tmp_path / "env"
    _fake_flash_attn(str(fake), "2.8.3")
    env = {"PYTHONPATH": str(fake) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = _pip_install_dropin(tmp_path, env)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and not (tmp_path / "site" / "flash_attn").exists()
    assert f"a real flash-attn is installed (flash-attn 2.8.3 in {fake})" in out, out
    assert "pip uninstall flash-attn" in out and "FLASH_ATTN_SM75_DROPIN_REPLACE=1" in out
    r = _pip_install_dropin(tmp_path, {**env, "FLASH_ATTN_SM75_DROPIN_REPLACE": "1"})
    assert r.returncode == 0, r.stderr  # on purpose
    assert (tmp_path / "site" / "flash_attn" / "__init__.py").exists()
    # an installed drop-in (2.8.3+sm75) is no real flash-attn: reinstalling it is fine
    ours = tmp_path / "env_dropin"
    _fake_flash_attn(str(ours), "2.8.3+sm75")
    r = _pip_install_dropin(tmp_path, {"PYTHONPATH": str(ours)})
    assert r.returncode == 0, r.stderr


def test_dropin_build_check_sees_past_pip_build_isolation(tmp_path, monkeypatch):
    # pip's isolated build hides the target environment (PYTHONNOUSERSITE, PYTHONPATH overlay);
    # the backend also asks the interpreter started with -E. A real flash-attn in the user site
    # of a temporary HOME stands for the target environment here.
    import importlib.util

    from dropin_env import DROPIN_SRC

    probe = subprocess.run([sys.executable, "-E", "-c", "import site; print(site.ENABLE_USER_SITE)"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        pytest.skip("this interpreter has no user site (a venv): pip's target environment has "
                    "no hidden part to look past")

    spec = importlib.util.spec_from_file_location(
        "flash_attn_dropin_backend", os.path.join(DROPIN_SRC, "_build", "flash_attn_dropin_backend.py"))
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    user_site = tmp_path / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    _fake_flash_attn(str(user_site), "2.6.3")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    monkeypatch.delenv("FLASH_ATTN_SM75_DROPIN_REPLACE", raising=False)
    assert backend._real_flash_attn_here() == []  # not on this process's path
    assert backend.real_flash_attn_installs() == [["2.6.3", str(user_site)]]
    with pytest.raises(SystemExit, match="flash-attn 2.6.3"):
        backend.check_no_real_flash_attn()
    monkeypatch.setenv("FLASH_ATTN_SM75_DROPIN_REPLACE", "1")
    backend.check_no_real_flash_attn()


@pytest.mark.parametrize("mode", ["plain", "cache_batch_idx", "paged"])
@pytest.mark.parametrize("v_rows", [1, 3])
def test_kvcache_v_cache_of_another_size_raises_before_writing(mode, v_rows):
    # v_cache is written at k_cache's indices: a v_cache with fewer (or more) rows or pages must
    # be refused from the shapes alone, with both caches untouched (an out-of-range index on
    # CUDA is a device-side assert that poisons the context).
    q = rand(2, 1, 2, 16)
    kc = torch.zeros(2, 8 if mode != "paged" else 256, 2, 16, dtype=F16)
    vc = torch.zeros(v_rows, kc.shape[1], 2, 16, dtype=F16)
    k, v = rand(2, 2, 2, 16), rand(2, 2, 2, 16)
    kw = dict(cache_seqlens=torch.tensor([1, 1], dtype=torch.int32))
    if mode == "cache_batch_idx":
        kw["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32)
    if mode == "paged":
        kw["block_table"] = torch.tensor([[0], [1]], dtype=torch.int32)
    kc0, vc0 = kc.clone(), vc.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="v_cache must have k_cache's shape"):
        fa2.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_pads_a_head_dim_that_is_not_a_multiple_of_8(causal):
    # flash-attn pads such head dims (as flash_attn_func and the varlen functions here do); the
    # cache must not be refused before the padding.
    B, S, h, hk, d, new = 2, 12, 4, 2, 20, 2
    q = rand(B, 3, h, d, seed=5)
    kc, vc, k, v = rand(B, S, hk, d), rand(B, S, hk, d), rand(B, new, hk, d), rand(B, new, hk, d)
    seqlens = torch.tensor([4, 9], dtype=torch.int32)
    with torch.no_grad():
        out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                               causal=causal, return_softmax_lse=True)
    ref, ref_lse = _cache_ref(q, kc, vc, torch.zeros(B, dtype=torch.int32), seqlens + new, causal)
    assert out.shape == q.shape
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


def test_kvcache_with_more_cache_rows_than_the_batch_uses_the_first_rows():
    # flash-attn: without cache_batch_idx, batch entry b reads and appends cache row b.
    B, rows, S, h, hk, d = 2, 5, 16, 4, 2, 32
    q = rand(B, 1, h, d, seed=7)
    kc, vc, k, v = rand(rows, S, hk, d), rand(rows, S, hk, d), rand(B, 1, hk, d), rand(B, 1, hk, d)
    seqlens = torch.tensor([3, 11], dtype=torch.int32)
    kc0 = kc.clone()
    with torch.no_grad():
        out = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens)
    assert torch.equal(kc[B:], kc0[B:])  # the rows past the batch untouched
    assert torch.equal(kc[0, 3], k[0, 0]) and torch.equal(kc[1, 11], k[1, 0])
    ref, _ = _cache_ref(q, kc, vc, torch.zeros(B, dtype=torch.int32), seqlens + 1, False)
    assert_out_exact(out, ref)
    with pytest.raises(ValueError, match="at least batch = 2 rows"):
        fa2.flash_attn_with_kvcache(q, kc[:1], vc[:1])


def test_kvcache_refuses_a_cache_that_requires_grad():
    q = rand(1, 1, 2, 32, seed=1)
    kc = rand(1, 8, 2, 32).requires_grad_()
    with pytest.raises(fa2.UnsupportedFeatureError, match="no backward"):
        fa2.flash_attn_with_kvcache(q, kc, kc.detach().clone())


def test_kvcache_on_the_varlen_op_compiles_fullgraph_on_cpu():
    # The per-sequence-aligned KV-cache route (causal chunk, ALiBi, cache_seqlens; the varlen op,
    # test_kvcache_per_sequence_alignment_runs_on_the_varlen_op) under
    # torch.compile(fullgraph=True): the same results and cache writes as eager.
    torch._dynamo.reset()
    kvcache = torch.compile(fa2.flash_attn_with_kvcache, fullgraph=True)
    q, kn, vn = rand(2, 3, 4, 16, seed=4), rand(2, 2, 2, 16), rand(2, 2, 2, 16)
    kc, vc = rand(2, 8, 2, 16), rand(2, 8, 2, 16)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slopes = torch.rand(4)
    kw = dict(causal=True, alibi_slopes=slopes, return_softmax_lse=True)
    with torch.no_grad():
        ref, ref_lse = fa2.flash_attn_with_kvcache(q, kc_ref, vc_ref, kn, vn,
                                                   cache_seqlens=_i32(3, 5), **kw)
        out, lse = kvcache(q, kc, vc, kn, vn, cache_seqlens=_i32(3, 5), **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 5), (3, -1)], ids=str)
def test_causal_calls_hand_the_op_no_right_window_side(window, op_calls, varlen_op_calls):
    # Under causal the op sets the right side itself; the door hands it -1 (not flash-attn's 0),
    # which keeps the one-query GQA paths that take no window (group_rows_eligible) open.
    q, k, v = rand(2, 1, 8, 64, seed=5), rand(2, 16, 2, 64), rand(2, 16, 2, 64)
    out = fa2.flash_attn_func(q, k, v, causal=True, window_size=window)
    assert [c[8:10] for c in op_calls] == [(window[0], -1)]
    assert torch.equal(out, fa2.flash_attn_func(q, k, v, causal=True, window_size=(window[0], 0)))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 16, 32], dtype=torch.int32)
    fa2.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k, 1, 16,
                               causal=True, window_size=window)
    assert [c[10:12] for c in varlen_op_calls] == [(window[0], -1)]
