"""Score modifiers in the kernels: flash-attn's ``softcap`` and ``alibi_slopes``.

With ``s = softmax_scale * q.k``: ``softcap > 0`` maps ``s -> softcap * tanh(s / softcap)``
(Gemma 2), then ``alibi_slopes`` (H,) or (B, H) subtract ``slope * |i + off - j|`` (``off`` the
causal alignment's offset, ``seqlen_k - seqlen_q`` bottom-right, also without causal, as
flash-attn). The kernels apply them in the score-mod instantiations (csrc/kernels/score_mod.h).
Tested against an independent float64 definition (``reference.apply_score_mods``) with
FlashAttention's criterion: the op's CPU reference and CUDA kernels, forward, LSE, both backward
modes, decode, windows, GQA; and the op's argument checks.
"""
from __future__ import annotations

import pytest
import torch

import flash_attention_sm75 as fa
from reference import (assert_close_fa, assert_lse_close, assert_lse_exact, assert_out_exact,
                       attention_ref, poisoned_cuda_memory, seed_from, varlen_attention_ref)
from test_backward import check_against_reference, cuda_only, make_inputs

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")
ops = torch.ops.flash_attention_sm75

CAUSAL_MODES = [(False, True), (True, True), (True, False)]  # (causal, bottom_right)
# (softcap, alibi): capped hard (tanh saturates: scaled scores have a standard deviation of 1
# here), Gemma 2's 50 (barely capped), ALiBi alone, both.
MODS = [(0.5, False), (50.0, False), (0.0, True), (3.0, True)]
MOD_IDS = ["cap0.5", "cap50", "alibi", "cap3+alibi"]


def slopes_for(b, h, per_batch, device):
    """ALiBi slopes as BLOOM builds them (2^(-8 i / h)), per batch entry distinct when asked."""
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    if per_batch:
        base = base.unsqueeze(0) * torch.linspace(1.0, 2.0, b).unsqueeze(1)
    return base.to(device)


def _check_forward(q, k, v, causal, bottom_right, softcap, slopes, window=(-1, -1)):
    with poisoned_cuda_memory() if q.is_cuda else _null():
        out, lse = ops.fwd(q, k, v, None, causal, bottom_right, None, None, *window, softcap,
                           slopes)
    kw = dict(causal=causal, causal_bottom_right=bottom_right, window_size=window,
              softcap=softcap, alibi_slopes=slopes)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------ CPU (CI)
@pytest.mark.parametrize("softcap,alibi", MODS, ids=MOD_IDS)
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("seqlens", [(9, 9), (5, 12), (12, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cpu_reference_op_applies_the_mods(seqlens, causal, bottom_right, softcap, alibi):
    # The op's CPU implementation (csrc/flash_api.cpp cpu_mod_scores) against the independent
    # definition, forward and backward (the softcap's derivative in dS).
    sq, sk = seqlens
    g = torch.Generator().manual_seed(seed_from(seqlens, causal, bottom_right, softcap, alibi))
    q, k, v, do = (torch.randn(2, s, h, 16, generator=g).half()
                   for s, h in ((sq, 4), (sk, 2), (sk, 2), (sq, 4)))
    slopes = slopes_for(2, 4, True, "cpu") if alibi else None
    _check_forward(q, k, v, causal, bottom_right, softcap, slopes)
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=True,
                            softcap=softcap, alibi_slopes=slopes)


def test_mods_change_the_result_and_zero_means_off():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 7, 2, 16, generator=g).half() * 3 for _ in range(3))
    plain = ops.fwd(q, k, v, None, True, True)
    off = ops.fwd(q, k, v, None, True, True, None, None, -1, -1, 0.0, None)
    assert torch.equal(plain[0], off[0]) and torch.equal(plain[1], off[1])
    capped = ops.fwd(q, k, v, None, True, True, None, None, -1, -1, 0.3, None)
    alibi = ops.fwd(q, k, v, None, True, True, None, None, -1, -1, 0.0, slopes_for(1, 2, False, "cpu"))
    assert not torch.equal(capped[1], plain[1]) and not torch.equal(alibi[1], plain[1])


@pytest.mark.parametrize("softcap,msg", [(-1.0, "softcap must be a finite number >= 0"),
                                         (float("nan"), "softcap must be a finite number >= 0"),
                                         (float("inf"), "softcap must be a finite number >= 0")])
def test_op_rejects_bad_softcap(softcap, msg):
    q = torch.randn(1, 4, 2, 16).half()
    with pytest.raises(ValueError, match=msg):
        ops.fwd(q, q, q, None, False, True, None, None, -1, -1, softcap, None)
    with pytest.raises(ValueError, match=msg):
        ops.bwd(q, q, q, q, q, torch.zeros(1, 2, 4), 0.25, False, True, None, None, True, None,
                -1, -1, softcap, None)


@pytest.mark.parametrize("slopes,msg", [
    (torch.ones(2, dtype=torch.float64), "alibi_slopes must be float32"),
    (torch.ones(3), r"alibi_slopes must have shape \(num_heads,\) = \(2,\)"),
    (torch.ones(2, 2), r"or \(batch, num_heads\) = \(1, 2\)"),
    (torch.ones(1, 2, 1), "alibi_slopes must have shape"),
    (torch.ones(1, 4)[:, ::2], "alibi_slopes must be contiguous in its last dimension"),
])
def test_op_rejects_bad_alibi_slopes(slopes, msg):
    q = torch.randn(1, 4, 2, 16).half()
    with pytest.raises(ValueError, match=msg):
        ops.fwd(q, q, q, None, False, True, None, None, -1, -1, 0.0, slopes)


def test_op_refuses_alibi_with_key_ranges():
    q = torch.randn(2, 4, 2, 16).half()
    lp = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="alibi_slopes cannot be combined with leftpad_k / seqused_k"):
        ops.fwd(q, q, q, None, False, True, lp, None, -1, -1, 0.0, torch.ones(2))


def test_slopes_requiring_grad_are_refused_not_silently_zero():
    q, k, v = (torch.randn(1, 5, 2, 16).half().requires_grad_() for _ in range(3))
    slopes = torch.ones(2, requires_grad=True)
    from flash_attention_sm75 import _ops

    with pytest.raises(ValueError, match="alibi_slopes must not require grad"):
        _ops.call_fwd(q, k, v, None, True, True, alibi_slopes=slopes)
    out, _ = ops.fwd(q, k, v, None, True, True, None, None, -1, -1, 0.0, slopes)  # the raw op
    with pytest.raises(NotImplementedError, match="no gradient for alibi_slopes"):
        out.float().sum().backward()


def test_softcap_and_alibi_trace_under_torch_compile():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 6, 2, 16, generator=g).half() for _ in range(3))
    slopes = slopes_for(1, 2, False, "cpu")

    def attend(q, k, v):
        return ops.fwd(q, k, v, None, True, True, None, None, -1, -1, 2.0, slopes)[0]

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), attend(q, k, v))


# ---------------------------------------------------------------------------------------- GPU
DIMS = [40, 64, 96, 128, 256]
SEQLENS = [(203, 203), (113, 260), (260, 113), (1, 700)]


@cuda_only
@pytest.mark.parametrize("softcap,alibi", MODS, ids=MOD_IDS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("d", DIMS)
def test_forward_and_lse(d, causal, bottom_right, seqlens, softcap, alibi):
    sq, sk = seqlens
    q, k, v, _ = make_inputs(2, sq, sk, 6, 2, d, "cuda", seed=seed_from(d, seqlens, softcap))
    slopes = slopes_for(2, 6, sq % 2 == 1, "cuda") if alibi else None
    _check_forward(q, k, v, causal, bottom_right, softcap, slopes)


@cuda_only
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
@pytest.mark.parametrize("softcap,alibi", MODS, ids=MOD_IDS)
@pytest.mark.parametrize("seqlens", SEQLENS[:3], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("d", DIMS)
def test_backward(d, causal, bottom_right, seqlens, softcap, alibi, deterministic):
    sq, sk = seqlens
    q, k, v, do = make_inputs(2, sq, sk, 4, 2, d, "cuda", seed=seed_from(d, seqlens, softcap, 1))
    slopes = slopes_for(2, 4, True, "cuda") if alibi else None
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=deterministic,
                            softcap=softcap, alibi_slopes=slopes)


@cuda_only
@pytest.mark.parametrize("window", [(40, 0), (37, 45), (-1, 9)])
@pytest.mark.parametrize("softcap,alibi", MODS[::3], ids=MOD_IDS[::3])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_with_sliding_windows(d, softcap, alibi, window):
    # Gemma 2's local layers: softcap with a window (and ALiBi with one), the local kernels.
    q, k, v, do = make_inputs(1, 230, 230, 4, 2, d, "cuda", seed=seed_from(d, window, softcap))
    slopes = slopes_for(1, 4, False, "cuda") if alibi else None
    _check_forward(q, k, v, True, True, softcap, slopes, window)
    for det in (True, False):
        check_against_reference(q, k, v, do, window == (40, 0), True, deterministic=det,
                                window_size=window, softcap=softcap, alibi_slopes=slopes)


@cuda_only
@pytest.mark.parametrize("softcap,alibi", MODS, ids=MOD_IDS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_kernel_applies_the_mods(d, softcap, alibi):
    # seqlen_q = 1: the split-KV decode kernel (and its merge), GQA groups of 4.
    from reference import cuda_kernels_run

    q, k, v, _ = make_inputs(3, 1, 3001, 8, 2, d, "cuda", seed=seed_from(d, softcap, alibi))
    slopes = slopes_for(3, 8, True, "cuda") if alibi else None
    names = cuda_kernels_run(lambda: _check_forward(q, k, v, True, True, softcap, slopes), "")
    assert any("decode" in n for n in names), names


@cuda_only
def test_saturated_and_huge_scores_stay_finite():
    # scaled scores ~ 400 against a cap of 20: tanh saturates to +-1 exactly, its derivative underflows to 0; nothing NaN.
    q, k, v, do = make_inputs(1, 130, 130, 2, 2, 64, "cuda", seed=3)
    q, k = q * 20, k * 20
    check_against_reference(q, k, v, do, True, True, deterministic=True, softcap=20.0)


# ============================================================================ the doors
# flash_attn_func / flash_attention_forward (the rulebook's softcap and alibi_slopes rules) and
# the flash-attn drop-in (fa2.py: flash-attn's semantics, per sequence for varlen / KV cache).
# CPU tests run the op's float64 reference (CI); the GPU tests run the kernels.

import numpy as np  # noqa: E402

from flash_attention_sm75 import _rules, fa2  # noqa: E402


def _qkv(b, sq, sk, h, h_k, d, device="cpu", seed=0, grad=False, gain=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, sq, h, d, generator=g) * gain).half()
    k = (torch.randn(b, sk, h_k, d, generator=g) * gain).half()
    v = torch.randn(b, sk, h_k, d, generator=g).half()
    return tuple(t.to(device).requires_grad_(grad) for t in (q, k, v))


def _ref(q, k, v, causal, softcap, slopes, window=(-1, -1), scale=None):
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap,
              alibi_slopes=slopes)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    return out_ref, lse_ref, out_pt


DOOR_MODS = [(0.0, None), (0.7, None), (30.0, None), (0.0, "h"), (4.0, "bh")]
DOOR_IDS = ["plain", "cap0.7", "cap30", "alibi_h", "cap4+alibi_bh"]


def _slopes(kind, b, h, device="cpu"):
    return None if kind is None else slopes_for(b, h, kind == "bh", device)


# ---------------------------------------------------------------------- direct APIs (CPU)
@pytest.mark.parametrize("softcap,alibi", DOOR_MODS, ids=DOOR_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(6, 6), (4, 9), (9, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_direct_apis_apply_softcap_and_alibi(seqlens, causal, softcap, alibi):
    sq, sk = seqlens
    q, k, v = _qkv(2, sq, sk, 4, 2, 16, seed=seed_from(seqlens, causal, softcap, alibi))
    slopes = _slopes(alibi, 2, 4)
    out_ref, lse_ref, out_pt = _ref(q, k, v, causal, softcap, slopes)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True, softcap=softcap,
                                  alibi_slopes=slopes)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    out_b, lse_b = fa.flash_attention_forward(*bhsd, causal=causal, return_lse=True,
                                              softcap=softcap, alibi_slopes=slopes)
    assert torch.equal(out_b.transpose(1, 2), out) and torch.equal(lse_b, lse)


def test_direct_apis_take_any_real_softcap_and_the_window():
    q, k, v = _qkv(1, 7, 11, 2, 2, 16, seed=3)
    slopes = slopes_for(1, 2, False, "cpu")
    ref = fa.flash_attn_func(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes,
                             window_size=(4, 0))
    out_ref, _, out_pt = _ref(q, k, v, True, 3.0, slopes, window=(4, 0))
    assert_close_fa(ref, out_ref, out_pt)
    for cap in (3, np.float32(3.0), np.float64(3.0), np.int64(3)):
        assert torch.equal(fa.flash_attn_func(q, k, v, causal=True, softcap=cap,
                                              alibi_slopes=slopes, window_size=(4, 0)), ref), cap
    # 0 is off: the plain result, bitwise
    assert torch.equal(fa.flash_attn_func(q, k, v, softcap=0), fa.flash_attn_func(q, k, v))


def test_direct_apis_backward_with_softcap_and_alibi():
    q, k, v = _qkv(2, 9, 9, 4, 2, 16, seed=21, grad=True)
    slopes = slopes_for(2, 4, True, "cpu")
    out = fa.flash_attn_func(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes)
    do = torch.randn_like(out)
    out.backward(do)
    dq, dk, dv = check_against_reference(q.detach(), k.detach(), v.detach(), do, True, True,
                                         deterministic=True, softcap=3.0, alibi_slopes=slopes)
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert torch.equal(got, want), name
    # slopes that require grad run where no gradient is recorded
    with torch.no_grad():
        fa.flash_attn_func(q, k, v, alibi_slopes=slopes.clone().requires_grad_())


@pytest.mark.parametrize("kwargs,regex", [
    (dict(softcap=-1.0), r"softcap must be a finite number >= 0 \(0: no soft-capping\), got -1\.0"),
    (dict(softcap=float("nan")), r"softcap must be a finite number >= 0 .* got nan"),
    (dict(softcap=float("inf")), r"softcap must be a finite number >= 0 .* got inf"),
    (dict(softcap="50"), r"softcap must be a real number \(float or int\).* got str '50'"),
    (dict(softcap=None), r"softcap must be a real number .* got NoneType None"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), r"alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(2)), r"alibi_slopes must have shape \(num_heads,\) = \(4,\) or "
                                       r"\(batch, num_heads\) = \(1, 4\), got \[2\]"),
    (dict(alibi_slopes=torch.ones(4, 1)), r"alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(1, 8)[:, ::2]), r"alibi_slopes must be contiguous in its last"),
    (dict(alibi_slopes=torch.ones(4, requires_grad=True)),
     r"alibi_slopes must not require grad.*alibi_slopes\.detach\(\)"),
    (dict(alibi_slopes=[0.5] * 4), r"alibi_slopes must be a torch\.Tensor or None, got list"),
])
def test_direct_apis_reject_bad_mods_before_the_op(kwargs, regex, op_calls):
    q, k, v = _qkv(1, 5, 5, 4, 2, 16)
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex):
        fa.flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex):
        fa.flash_attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), **kwargs)
    assert op_calls == []


def test_rulebook_states_the_mod_rules():
    q, k, v = _qkv(2, 5, 5, 4, 2, 16)
    ok = torch.ones(4)
    assert _rules.not_supported_reason(q, k, v, softcap=50.0, alibi_slopes=ok) is None
    assert _rules.not_supported_reason(q, k, v, alibi_slopes=torch.ones(2, 4)) is None
    assert _rules.not_supported_reason(q, k, v, softcap=np.float16(2.0)) is None
    assert "softcap" in _rules.not_supported_reason(q, k, v, softcap=-0.5)
    lp = torch.zeros(2, dtype=torch.int32)
    reason = _rules.not_supported_reason(q, k, v, leftpad_k=lp, alibi_slopes=ok)
    assert reason.startswith("alibi_slopes cannot be combined with leftpad_k / seqused_k")
    # BHSD: heads are dim 1
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    assert _rules.not_supported_reason(*bhsd, layout="bhsd", alibi_slopes=ok) is None
    assert "= (4,)" in _rules.not_supported_reason(*bhsd, layout="bhsd", alibi_slopes=ok[:2])
    # the gradient rule follows grad mode
    needs = torch.ones(4, requires_grad=True)
    assert "require grad" in _rules.not_supported_reason(q, k, v, alibi_slopes=needs)
    with torch.no_grad():
        assert _rules.not_supported_reason(q, k, v, alibi_slopes=needs) is None
    assert _rules.RULES.index("softcap") < _rules.RULES.index("alibi_slopes") \
        < _rules.RULES.index("alignment")


def test_flash_attn_func_with_mods_under_torch_compile_fullgraph():
    # Different softcap values (floats that torch.compile may trace symbolically on a
    # recompilation) and both slope shapes must trace with fullgraph=True.
    q, k, v = _qkv(2, 6, 9, 4, 2, 16, seed=4)

    def attend(q, k, v, cap, slopes):
        return fa.flash_attn_func(q, k, v, causal=True, softcap=cap, alibi_slopes=slopes)

    def attend_bhsd(q, k, v, cap, slopes):
        return fa.flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), softcap=cap,
                                          alibi_slopes=slopes).transpose(1, 2)

    for fn in (attend, attend_bhsd):
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        for cap, per_batch in ((1.0, False), (2.5, True), (0.0, False), (7.0, True)):
            slopes = slopes_for(2, 4, per_batch, "cpu")
            assert torch.equal(compiled(q, k, v, cap, slopes), fn(q, k, v, cap, slopes)), \
                (fn.__name__, cap)
        assert torch.equal(compiled(q, k, v, 3.0, None), fn(q, k, v, 3.0, None))


# ---------------------------------------------------------------- flash-attn drop-in (CPU)
def test_fa2_dense_with_mods_under_torch_compile_fullgraph():
    # a second softcap value is traced symbolically: the drop-in's checks must trace it
    q, k, v = _qkv(2, 6, 9, 4, 2, 16, seed=14)

    def attend(q, k, v, cap, slopes):
        return fa2.flash_attn_func(q, k, v, causal=True, softcap=cap, alibi_slopes=slopes)

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    for cap, per_batch in ((1.0, False), (2.5, True), (-1.0, False), (7.0, True)):
        slopes = slopes_for(2, 4, per_batch, "cpu")
        assert torch.equal(compiled(q, k, v, cap, slopes), attend(q, k, v, cap, slopes)), cap


@pytest.mark.parametrize("softcap,alibi", DOOR_MODS[1:], ids=DOOR_IDS[1:])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(5, 5), (3, 8), (8, 3)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fa2_dense_functions_apply_the_mods(seqlens, causal, softcap, alibi):
    sq, sk = seqlens
    q, k, v = _qkv(2, sq, sk, 4, 2, 24, seed=seed_from("fa2", seqlens, causal, softcap, alibi))
    slopes = _slopes(alibi, 2, 4)
    out, lse, _ = fa2.flash_attn_func(q, k, v, 0.0, None, causal, softcap=softcap,
                                      alibi_slopes=slopes, return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)
    assert_out_exact(out, ref)  # head_dim 24: zero-padded to 32, as flash-attn does
    assert_lse_exact(lse, ref_lse, atol=1e-6)
    o2 = fa2.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), causal=causal, softcap=softcap,
                                      alibi_slopes=slopes)
    assert torch.equal(o2, out)
    if sq == sk:
        qkv = torch.stack((q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)), 2)
        o3 = fa2.flash_attn_qkvpacked_func(qkv, causal=causal, softcap=softcap,
                                           alibi_slopes=slopes)
        ref3, _ = attention_ref(*qkv.unbind(2), causal=causal, softcap=softcap,
                                alibi_slopes=slopes)
        assert_out_exact(o3, ref3)


def test_fa2_softcap_follows_flash_attn():
    q, k, v = _qkv(1, 5, 7, 2, 2, 16, seed=6)
    plain = fa2.flash_attn_func(q, k, v, causal=True)
    for cap in (0.0, -1.0, -1e30, 0):  # flash-attn: softcap <= 0 is off
        assert torch.equal(fa2.flash_attn_func(q, k, v, causal=True, softcap=cap), plain), cap
    for cap in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=r"softcap must be a finite number") as e:
            fa2.flash_attn_func(q, k, v, softcap=cap)
        assert not isinstance(e.value, fa2.UnsupportedFeatureError)
    with pytest.raises(ValueError, match="softcap must be a real number"):
        fa2.flash_attn_func(q, k, v, softcap="30")


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: fa2.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64)),
     "alibi_slopes must be float32"),
    (lambda q, k, v: fa2.flash_attn_func(q, k, v, alibi_slopes=torch.ones(1)),  # nheads_k's
     r"alibi_slopes must have shape \(num_heads,\) = \(2,\)"),
    (lambda q, k, v: fa2.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, requires_grad=True)),
     "alibi_slopes must not require grad"),
    (lambda q, k, v: fa2.flash_attn_varlen_func(
        q[0], k[0], v[0], torch.tensor([0, 2, 5], dtype=torch.int32),
        torch.tensor([0, 3, 7], dtype=torch.int32), 3, 4, alibi_slopes=torch.ones(1, 2)),
     r"alibi_slopes must have shape \(num_heads,\) = \(2,\) or \(batch, num_heads\) = \(2, 2\)"),
    (lambda q, k, v: fa2.flash_attn_with_kvcache(q, k, v, alibi_slopes=torch.ones(3, 2)),
     r"alibi_slopes must have shape .* = \(1, 2\)"),
])
def test_fa2_bad_slopes_raise_value_error_naming_them(call, match):
    q, k, v = _qkv(1, 5, 7, 2, 1, 16, seed=7)
    with pytest.raises(ValueError, match=match) as e:
        if "kvcache" in match or "(1, 2)" in match:
            with torch.no_grad():
                call(q, k, v)
        else:
            call(q, k, v)
    assert not isinstance(e.value, fa2.UnsupportedFeatureError)


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _varlen_ref(q, k, v, cu_q, cu_k, causal, softcap, slopes, window=(-1, -1)):
    return varlen_attention_ref(q, k, v, cu_q, cu_k, causal, window=window, softcap=softcap,
                                alibi_slopes=slopes)


VARLEN_LENGTHS = [([3, 0, 1, 5, 2, 4], [4, 2, 0, 5, 7, 1]), ([6], [3]), ([2, 6], [9, 6])]


def _varlen_case(lens_q, lens_k, h, h_k, d, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sum(lens_q), h, d, generator=g) * 2).half()
    k = (torch.randn(sum(lens_k), h_k, d, generator=g) * 2).half()
    v = torch.randn(sum(lens_k), h_k, d, generator=g).half()
    return [t.requires_grad_(grad) for t in (q, k, v)] + [_cu(lens_q), _cu(lens_k)]


@pytest.mark.parametrize("softcap,alibi", DOOR_MODS[1:], ids=DOOR_IDS[1:])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_LENGTHS, ids=["mixed", "one", "two"])
def test_fa2_varlen_applies_the_mods_per_sequence(lens, causal, softcap, alibi):
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 4, 2, 16,
                                       seed_from(lens, causal, softcap, alibi))
    slopes = _slopes(alibi, len(lens_q), 4)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, softcap=softcap,
                                             alibi_slopes=slopes, return_attn_probs=True)
    ref, ref_lse = _varlen_ref(q, k, v, cu_q, cu_k, causal, softcap, slopes)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse, atol=1e-6)
    # more padding than needed (ALiBi's distances must not see it), and a window
    out2 = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q) + 3, max(lens_k) + 2,
                                      causal=causal, softcap=softcap, alibi_slopes=slopes)
    assert torch.equal(out2, out)
    out_w = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                       causal=causal, softcap=softcap, alibi_slopes=slopes,
                                       window_size=(2, 1))
    ref_w, _ = _varlen_ref(q, k, v, cu_q, cu_k, causal, softcap, slopes, window=(2, 1))
    assert_out_exact(out_w, ref_w, "windowed")


def test_fa2_varlen_packed_forms_paged_keys_and_backward_with_the_mods():
    lens_q, lens_k = [3, 0, 4, 1], [5, 2, 4, 0]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 4, 2, 16, 12, grad=True)
    slopes = slopes_for(4, 4, True, "cpu")
    kw = dict(causal=True, softcap=2.0, alibi_slopes=slopes)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, **kw)
    o = fa2.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu_q, cu_k, 4, 5, **kw)
    assert torch.equal(o, out)
    page = 3
    kp, vp = torch.zeros(9, page, 2, 16, dtype=torch.float16), torch.zeros(9, page, 2, 16,
                                                                          dtype=torch.float16)
    table = torch.tensor([[4, 7], [0, 2], [8, 1], [5, 6]], dtype=torch.int32)
    with torch.no_grad():
        for b in range(4):
            for j in range(lens_k[b]):
                kp[table[b, j // page], j % page] = k[cu_k[b] + j]
                vp[table[b, j // page], j % page] = v[cu_k[b] + j]
    o = fa2.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 5, block_table=table, **kw)
    assert torch.equal(o, out)
    # the backward through the per-sequence calls, against float64 autograd
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = _varlen_ref(q64, k64, v64, cu_q, cu_k, True, 2.0, slopes)
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.double(), allow_unused=True)
    for name, a, b in zip("qkv", grads, refs):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        assert (a.double() - b).abs().max() <= 1e-2 * max(1.0, b.abs().max().item()), name
    qkv = torch.randn(7, 3, 2, 16).half()
    cu = _cu([4, 3])
    o = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, causal=True, alibi_slopes=slopes[:2, :2])
    ref, _ = _varlen_ref(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, True, 0.0, slopes[:2, :2])
    assert_out_exact(o, ref)


def _cache_ref(q, kc, vc, start, end, causal, softcap, slopes, window=(-1, -1)):
    outs, lses = [], []
    for b in range(q.shape[0]):
        ks, vs = kc[b:b + 1, int(start[b]):int(end[b])], vc[b:b + 1, int(start[b]):int(end[b])]
        s = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        o, lse = attention_ref(q[b:b + 1], ks, vs, causal=causal, window_size=window,
                               softcap=softcap, alibi_slopes=s)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("softcap,alibi", DOOR_MODS[1:], ids=DOOR_IDS[1:])
@pytest.mark.parametrize("seqlen_q,causal", [(1, True), (4, False), (4, True)])
@pytest.mark.parametrize("leftpad", [False, True])
def test_fa2_kvcache_applies_the_mods_per_sequence(leftpad, seqlen_q, causal, softcap, alibi):
    B, S, h, h_k, d, new = 3, 16, 4, 2, 16, 2
    q, kc, vc = _qkv(B, seqlen_q, S, h, h_k, d, seed=seed_from(leftpad, seqlen_q, causal, alibi))
    k, v, _ = _qkv(B, new, new, h_k, h_k, d, seed=5)
    seqlens = torch.tensor([5, 0, 13], dtype=torch.int32)
    lp = torch.tensor([2, 0, 9], dtype=torch.int32) if leftpad else None
    slopes = _slopes(alibi, B, h)
    kc0, vc0 = kc.clone(), vc.clone()
    with torch.no_grad():
        out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                               cache_leftpad=lp, causal=causal, softcap=softcap,
                                               alibi_slopes=slopes, return_softmax_lse=True)
    for b in range(B):
        kc0[b, seqlens[b]:seqlens[b] + new], vc0[b, seqlens[b]:seqlens[b] + new] = k[b], v[b]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    start = lp if leftpad else torch.zeros(B, dtype=torch.int32)
    ref, ref_lse = _cache_ref(q, kc, vc, start, seqlens + new, causal and seqlen_q > 1, softcap,
                              slopes)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse, atol=1e-6)


def test_fa2_kvcache_mods_without_key_ranges_paged_and_windowed():
    B, S, h, h_k, d = 2, 12, 4, 2, 16
    q, kc, vc = _qkv(B, 3, S, h, h_k, d, seed=31)
    slopes = slopes_for(B, h, True, "cpu")
    with torch.no_grad():
        # the whole cache (no cache_seqlens): one op call, no key ranges
        out = fa2.flash_attn_with_kvcache(q, kc, vc, causal=True, softcap=5.0,
                                          alibi_slopes=slopes)
        ref, _ = attention_ref(q, kc, vc, causal=True, softcap=5.0, alibi_slopes=slopes)
        assert_out_exact(out, ref)
        # a window with an int cache_seqlens (gathered right-aligned, then per sequence)
        out = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=9, causal=True,
                                          window_size=(3, 0), softcap=5.0, alibi_slopes=slopes)
        ref, _ = _cache_ref(q, kc, vc, [0, 0], [9, 9], True, 5.0, slopes, window=(3, 0))
        assert_out_exact(out, ref)
        # a paged cache gives the plain cache's answer
        page = 4
        table = torch.tensor([[2, 0, 5], [1, 4, 3]], dtype=torch.int32)
        kp = torch.zeros(6, page, h_k, d, dtype=torch.float16)
        vp = torch.zeros_like(kp)
        for b in range(B):
            for j in range(S):
                kp[table[b, j // page], j % page] = kc[b, j]
                vp[table[b, j // page], j % page] = vc[b, j]
        seqlens = torch.tensor([7, 11], dtype=torch.int32)
        plain = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                            softcap=5.0, alibi_slopes=slopes)
        paged = fa2.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                            causal=True, softcap=5.0, alibi_slopes=slopes)
        assert torch.equal(paged, plain)
        ref, _ = _cache_ref(q, kc, vc, [0, 0], seqlens, True, 5.0, slopes)
        assert_out_exact(plain, ref)


def test_fa2_causal_alibi_output_is_flash_attn_s():
    # flash-attn's causal kernels add slope * j instead of -slope * |i + off - j|: the same
    # output (a per-row constant), which is what the drop-in matches; the LSE is documented.
    q, k, v = _qkv(1, 4, 7, 2, 2, 16, seed=8)
    slopes = torch.tensor([0.5, 0.25])
    out = fa2.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 4.0
    j = torch.arange(7, dtype=torch.float64)
    scores = scores + slopes.double().view(1, 2, 1, 1) * j  # flash-attn's causal kernel form
    i = torch.arange(4).view(4, 1)
    scores = scores.masked_fill(j.view(1, 7) > i + 3, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())
    assert_out_exact(out, ref)


# ---------------------------------------------------------------------------------- GPU doors
@cuda_only
@pytest.mark.parametrize("softcap,alibi", DOOR_MODS[1:], ids=DOOR_IDS[1:])
@pytest.mark.parametrize("causal", [False, True])
def test_direct_apis_on_the_kernels_with_autograd(causal, softcap, alibi):
    q, k, v = _qkv(2, 157, 211, 4, 2, 64, device="cuda", seed=seed_from(causal, softcap, alibi),
                   grad=True)
    slopes = _slopes(alibi, 2, 4, "cuda")
    out = fa.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)
    out_ref, _, out_pt = _ref(q.detach(), k.detach(), v.detach(), causal, softcap, slopes)
    assert_close_fa(out.detach(), out_ref, out_pt)
    do = torch.randn_like(out)
    out.backward(do)
    dq, dk, dv = check_against_reference(q.detach(), k.detach(), v.detach(), do, causal, True,
                                         deterministic=True, softcap=softcap,
                                         alibi_slopes=slopes)
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert torch.equal(got, want), name
    bhsd = [t.detach().transpose(1, 2) for t in (q, k, v)]
    out_b = fa.flash_attention_forward(*bhsd, causal=causal, softcap=softcap,
                                       alibi_slopes=slopes)
    assert torch.equal(out_b.transpose(1, 2), out.detach())


@cuda_only
@pytest.mark.parametrize("softcap,alibi", DOOR_MODS[1:], ids=DOOR_IDS[1:])
def test_fa2_functions_on_the_kernels(softcap, alibi):
    # dense, varlen (per sequence with ALiBi) and the KV cache on CUDA against float64.
    q, k, v = _qkv(2, 130, 190, 4, 2, 64, device="cuda", seed=seed_from("gpu", softcap, alibi))
    slopes = _slopes(alibi, 2, 4, "cuda")
    out = fa2.flash_attn_func(q, k, v, causal=True, softcap=softcap, alibi_slopes=slopes)
    assert_close_fa(out, *_ref(q, k, v, True, softcap, slopes)[::2])
    lens_q, lens_k = [70, 0, 130, 9], [100, 40, 190, 1]
    qv, kv_, vv, cu_q, cu_k = (t.cuda() for t in _varlen_case(lens_q, lens_k, 4, 2, 64, 9))
    slopes4 = _slopes(alibi, 4, 4, "cuda")
    out = fa2.flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 130, 190, causal=True,
                                     softcap=softcap, alibi_slopes=slopes4)
    ref, _ = _varlen_ref(qv.cpu(), kv_.cpu(), vv.cpu(), cu_q.cpu(), cu_k.cpu(), True, softcap,
                         None if slopes4 is None else slopes4.cpu())
    # fp16 output of fp32 arithmetic: a few fp16 ulps of the float64 result
    assert (out.cpu().double() - ref).abs().max() <= 4e-3 * max(1.0, ref.abs().max().item())
    seqlens = torch.tensor([100, 177], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        out = fa2.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=seqlens, causal=True,
                                          softcap=softcap, alibi_slopes=slopes)
    ref, _ = _cache_ref(q[:, :1].cpu(), k.cpu(), v.cpu(), [0, 0], seqlens.cpu(), False, softcap,
                        None if slopes is None else slopes.cpu())
    assert (out.cpu().double() - ref).abs().max() <= 4e-3 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_alibi_slopes_are_refused_not_a_silent_nan(bad):
    # Every door goes through _ops.call_fwd / call_varlen_fwd, which check the slopes' values
    # (on the CPU a ValueError; on CUDA a device-side assertion, the values live there).
    from flash_attention_sm75 import fa2

    q = torch.randn(1, 5, 2, 32).half()
    slopes = torch.tensor([0.5, bad], dtype=torch.float32)
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        fa2.flash_attn_func(q, q, q, alibi_slopes=slopes)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        fa2.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, alibi_slopes=slopes)
