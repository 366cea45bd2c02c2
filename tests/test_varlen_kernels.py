"""Packed (varlen) sequences on the CUDA kernels: the ops ``varlen_fwd`` / ``varlen_bwd``.

flash-attn's varlen layout (q ``(total_q, H, D)``, k / v ``(total_k, Hk, D)``, int32
``cu_seqlens``) and semantics (causal, window and ALiBi bottom-right per sequence, ``seqused_k``,
the packed ``(H, total_q)`` LSE), checked against a float64 per-sequence definition with
FlashAttention's criterion: random lengths with empty and one-token sequences, unequal q / k
lengths, rows before the first and after the last sequence (they must come back 0 / -inf / zero
gradients), GQA, every head-dim bucket and tails, softcap, ALiBi, both dQ modes, NaN-poisoned
allocations. The Python doors (flash_attn_varlen_func, the HF integration) have their own tests.
"""
from __future__ import annotations

import math

import pytest
import torch

import flash_attention_sm75 as fa
from reference import (assert_close_fa, assert_lse_close, attention_ref, poisoned_cuda_memory,
                       seed_from)
from test_backward import cuda_only, dq_mode

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")
ops = torch.ops.flash_attention_sm75

# (lengths of q, lengths of k): empty, one token, unequal, longer than a tile.
LENGTHS = {
    "mixed": ([70, 0, 1, 133, 9], [50, 3, 0, 201, 9]),
    "self": ([64, 1, 257, 31], [64, 1, 257, 31]),
    "decode-like": ([1, 1, 2, 1], [300, 17, 64, 1]),
}
GAP = (3, 5)  # rows before the first sequence and after the last: no sequence's


def packed_inputs(lens_q, lens_k, h, hk, d, seed):
    g = torch.Generator().manual_seed(seed)

    def cu(lens):
        c = torch.tensor([GAP[0]] + list(lens)).cumsum(0)
        return c.to(torch.int32).cuda()

    cu_q, cu_k = cu(lens_q), cu(lens_k)
    tq, tk = int(cu_q[-1]) + GAP[1], int(cu_k[-1]) + GAP[1]
    q, do = (torch.randn(tq, h, d, generator=g).half().cuda() for _ in range(2))
    k, v = (torch.randn(tk, hk, d, generator=g).half().cuda() for _ in range(2))
    return q, k, v, do, cu_q, cu_k


def per_sequence(q, k, v, cu_q, cu_k, seqused, causal, window, softcap, slopes, upcast):
    """out (total_q, H, D) and lse (H, total_q) by the definition, per sequence; rows of no
    sequence 0 / -inf. ``upcast=False``: the fp16 computation PyTorch would do."""
    dtype = torch.float64 if upcast else q.dtype
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if seqused is not None:
            k1 = k0 + min(max(int(seqused[b]), 0), k1 - k0)
        if q1 == q0 or k1 == k0:
            continue
        s = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        o, l = attention_ref(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
                             causal=causal, window_size=window, softcap=softcap, alibi_slopes=s,
                             upcast=upcast, reorder_ops=not upcast)
        out[q0:q1] = o[0].to(dtype)
        lse[:, q0:q1] = l[0].double()
    return out, lse


def slopes_for(b, h):
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    return (base.unsqueeze(0) * torch.linspace(1.0, 2.0, b).unsqueeze(1)).cuda()


def run_fwd(q, k, v, cu_q, cu_k, causal, window=(-1, -1), softcap=0.0, slopes=None,
            seqused=None):
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    with poisoned_cuda_memory():
        return ops.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, None, causal, seqused, *window,
                              softcap, slopes), (max_q, max_k)


def check_forward(q, k, v, cu_q, cu_k, causal, window=(-1, -1), softcap=0.0, slopes=None,
                  seqused=None):
    (out, lse), _ = run_fwd(q, k, v, cu_q, cu_k, causal, window, softcap, slopes, seqused)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    args = (q, k, v, cu_q, cu_k, seqused, causal, window, softcap, slopes)
    out_ref, lse_ref = per_sequence(*args, upcast=True)
    out_pt, _ = per_sequence(*args, upcast=False)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)
    # Rows of no sequence: exactly 0 and -inf.
    assert (out[:GAP[0]] == 0).all() and (out[-GAP[1]:] == 0).all()
    assert torch.isneginf(lse[:, :GAP[0]]).all() and torch.isneginf(lse[:, -GAP[1]:]).all()
    return out, lse


def check_backward(q, k, v, do, cu_q, cu_k, causal, deterministic, window=(-1, -1), softcap=0.0,
                   slopes=None, seqused=None, atol=1e-3):
    (out, lse), (max_q, max_k) = run_fwd(q, k, v, cu_q, cu_k, causal, window, softcap, slopes,
                                         seqused)
    scale = 1.0 / math.sqrt(q.shape[-1])
    with dq_mode("separate" if deterministic else "atomic"), poisoned_cuda_memory():
        dq, dk, dv = ops.varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale,
                                    causal, seqused, deterministic, None, *window, softcap,
                                    slopes)
    grads = {}
    for upcast in (True, False):
        dtype = torch.float64 if upcast else torch.float16
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, _ = per_sequence(*leaves, cu_q, cu_k, seqused, causal, window, softcap, slopes,
                            upcast=upcast)
        o.backward(do.to(dtype))
        grads[upcast] = [t.grad for t in leaves]
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[True], grads[False]):
        assert ours.shape == ref.shape and not torch.isnan(ours).any(), name
        err = (ours.double() - ref).abs().max().item()
        err_pt = (pt.double() - ref).abs().max().item()
        assert err <= 2 * err_pt + atol, f"{name}: ours {err:.3e} vs pytorch fp16 {err_pt:.3e}"
    for t in (dq,):
        assert (t[:GAP[0]] == 0).all() and (t[-GAP[1]:] == 0).all()
    for t in (dk, dv):
        assert (t[:GAP[0]] == 0).all() and (t[-GAP[1]:] == 0).all()
    return dq, dk, dv


@cuda_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 2)])
@pytest.mark.parametrize("d", [64, 96, 128, 256, 40, 80, 200])
def test_forward(d, h, hk, lengths, causal):
    lq, lk = LENGTHS[lengths]
    q, k, v, _, cu_q, cu_k = packed_inputs(lq, lk, h, hk, d, seed_from(d, h, lengths, causal))
    check_forward(q, k, v, cu_q, cu_k, causal)


@cuda_only
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", ["mixed", "self"])
@pytest.mark.parametrize("d", [64, 96, 128, 256, 72])
def test_backward(d, lengths, causal, deterministic):
    lq, lk = LENGTHS[lengths]
    q, k, v, do, cu_q, cu_k = packed_inputs(lq, lk, 4, 2, d, seed_from(d, lengths, causal, 7))
    check_backward(q, k, v, do, cu_q, cu_k, causal, deterministic)


# Windows, softcap, ALiBi and seqused_k per sequence (flash-attn's varlen semantics).
VARIANTS = {
    "window": dict(window=(16, 0)),
    "window2": dict(window=(20, 7), causal=False),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "all": dict(window=(33, 0), softcap=2.0, alibi=True),
    "seqused": dict(seqused=True),
    "seqused+alibi": dict(seqused=True, alibi=True),
}


@cuda_only
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_variants(d, variant, deterministic):
    opt = dict(VARIANTS[variant])
    causal = opt.pop("causal", True)
    lq, lk = LENGTHS["mixed"]
    q, k, v, do, cu_q, cu_k = packed_inputs(lq, lk, 4, 2, d, seed_from(d, variant))
    b = len(lq)
    slopes = slopes_for(b, 4) if opt.pop("alibi", False) else None
    seqused = None
    if opt.pop("seqused", False):
        seqused = torch.tensor([40, 2, 0, 150, 100], dtype=torch.int32, device="cuda")
    kw = dict(window=opt.get("window", (-1, -1)), softcap=opt.get("softcap", 0.0),
              slopes=slopes, seqused=seqused)
    check_forward(q, k, v, cu_q, cu_k, causal, **kw)
    check_backward(q, k, v, do, cu_q, cu_k, causal, deterministic, **kw)


@cuda_only
def test_deterministic_backward_is_bitwise_reproducible():
    lq, lk = LENGTHS["mixed"]
    q, k, v, do, cu_q, cu_k = packed_inputs(lq, lk, 8, 2, 128, 11)
    first = check_backward(q, k, v, do, cu_q, cu_k, True, True)
    for _ in range(3):
        again = check_backward(q, k, v, do, cu_q, cu_k, True, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@cuda_only
def test_grad_of_lse_flows_into_the_packed_rows():
    # grad_softmax_lse (H, total_q): d lse_i / d s_ij = P_ij, folded into D.
    lq, lk = [33, 0, 70], [40, 5, 70]
    q, k, v, do, cu_q, cu_k = packed_inputs(lq, lk, 4, 4, 64, 5)
    (out, lse), (max_q, max_k) = run_fwd(q, k, v, cu_q, cu_k, True)
    g = torch.randn_like(lse)
    scale = 1.0 / 8
    dq, dk, dv = ops.varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, True,
                                None, True, g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, l = per_sequence(*leaves, cu_q, cu_k, None, True, (-1, -1), 0.0, None, upcast=True)
    fin = torch.isfinite(l)
    (o * do.double()).sum().add_((l[fin] * g.double()[fin]).sum()).backward()
    for name, ours, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), (t.grad for t in leaves)):
        err = (ours.double() - ref).abs().max().item()
        assert err <= 2e-2 * ref.abs().max().item() + 2e-3, f"{name}: {err:.3e}"


@cuda_only
def test_empty_batch_and_no_keys():
    q, k, v, do, cu_q, cu_k = packed_inputs([5, 7], [0, 0], 2, 2, 64, 3)
    (out, lse), _ = run_fwd(q, k, v, cu_q, cu_k, False)
    assert (out == 0).all() and torch.isneginf(lse).all()
    cu0 = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse = ops.varlen_fwd(q, k, v, cu0, cu0, 0, 0)
    assert (out == 0).all() and torch.isneginf(lse).all()


@cuda_only
@pytest.mark.parametrize("bad,msg", [
    (dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int64)), "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.zeros(4, dtype=torch.int32)), "same length"),
    (dict(q=torch.zeros(2, 4, 8, 64)), "q must be 3-D"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(seqused_k=torch.zeros(5, dtype=torch.int32)), "seqused_k must have shape"),
    (dict(alibi_slopes=torch.zeros(3, 5)), "alibi_slopes must have shape"),
])
def test_rejects_bad_metadata(bad, msg):
    q, k, v, _, cu_q, cu_k = packed_inputs([5, 7], [6, 8], 4, 2, 64, 1)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                max_seqlen_k=8)
    for name, val in bad.items():
        args[name] = val.cuda() if isinstance(val, torch.Tensor) else val
    with pytest.raises(ValueError, match=msg):
        ops.varlen_fwd(**args)
