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
from reference import assert_close_fa, assert_lse_close, attention_ref, poisoned_cuda_memory, seed_from
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
