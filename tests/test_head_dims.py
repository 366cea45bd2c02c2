"""Every head dim: a multiple of 8 up to the largest bucket (head_dims.h, _rules.HEAD_DIMS).

A head dim d runs on the instantiation of the smallest bucket >= d with the columns past d
zero-filled on load and never stored. These tests run forward (prefill and the q_len = 1 decode
kernel), LSE and both backward modes at the head dims of real models (MiniLM 32, SD1.5 40 / 80 /
160, SigLIP 72, Phi-2 80, Phi-3 96, Gemma 256) and at the edges of each bucket, against float64
with FlashAttention's criterion. The inputs' rows are wider than d with NaN in the gap, so a
kernel that reads a column past d poisons its result, and outputs are poisoned too.
"""
from __future__ import annotations

import pytest
import torch

import flash_attention_sm75 as fa
from flash_attention_sm75 import _rules
from reference import (assert_close_fa, assert_lse_close, attention_ref, poisoned_cuda_memory,
                       seed_from)
from test_backward import check_against_reference, cuda_only

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")

# The grid of the issue, then each bucket's smallest and largest tail.
GRID_DIMS = [8, 32, 40, 72, 80, 96, 120, 136, 160, 192, 256]
EDGE_DIMS = sorted({x for b in _rules.HEAD_DIM_BUCKETS for x in (b - 8, b)} - set(GRID_DIMS))
CAUSAL_MODES = [(False, True), (True, True), (True, False)]  # (causal, bottom_right)
SEQLENS = [(113, 203), (203, 113), (1, 300), (65, 65)]


def _dim(d):
    """d as a parameter; marked to skip (with the reason) when no bucket takes it yet."""
    reason = f"head_dim {d} > the largest bucket {_rules.MAX_HEAD_DIM}"
    return pytest.param(d, marks=pytest.mark.skipif(d not in _rules.HEAD_DIMS, reason=reason))


def nan_gapped(b, s, h, d, gen, device="cuda"):
    """(b, s, h, d) fp16 view of rows d + 8 wide whose last 8 columns are NaN."""
    t = torch.full((b, s, h, d + 8), float("nan"), dtype=torch.float16)
    t[..., :d] = torch.randn(b, s, h, d, generator=gen).to(torch.float16)
    return t.to(device)[..., :d]


def make_case(b, sq, sk, h, h_k, d):
    g = torch.Generator().manual_seed(seed_from(b, sq, sk, h, h_k, d))
    return (nan_gapped(b, sq, h, d, g), nan_gapped(b, sk, h_k, d, g), nan_gapped(b, sk, h_k, d, g),
            nan_gapped(b, sq, h, d, g))


@cuda_only
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("d", [_dim(d) for d in GRID_DIMS + EDGE_DIMS])
def test_forward_and_lse(d, causal, bottom_right, seqlens):
    sq, sk = seqlens
    q, k, v, _ = make_case(2, sq, sk, 6, 2, d)
    with poisoned_cuda_memory():
        out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, causal, bottom_right, None,
                                                      None)
    assert out.shape == q.shape and lse.shape == (2, 6, sq)
    kw = dict(causal=causal, causal_bottom_right=bottom_right)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("d", [_dim(d) for d in GRID_DIMS + EDGE_DIMS])
def test_backward(d, causal, bottom_right, seqlens, deterministic):
    sq, sk = seqlens
    q, k, v, do = make_case(2, sq, sk, 6, 2, d)
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=deterministic)


@cuda_only
@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("d", [_dim(d) for d in (40, 80, 96, 136, 200, 256)])
def test_decode_with_key_ranges(d, ratio):
    # q_len = 1 runs the split-KV decode kernel; GQA groups are packed in one CTA (or split).
    b, h_k, sk = 3, 2, 700
    q, k, v, _ = make_case(b, 1, sk, h_k * ratio, h_k, d)
    lp = torch.tensor([0, 5, 300], dtype=torch.int32, device="cuda")
    su = torch.tensor([700, 650, 301], dtype=torch.int32, device="cuda")
    with poisoned_cuda_memory():
        out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True, lp, su)
    kw = dict(causal=True, causal_bottom_right=True, leftpad_k=lp, seqused_k=su)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)


@cuda_only
@pytest.mark.parametrize("d", [_dim(d) for d in (40, 80, 160, 256)])
def test_sdpa_wrapper_and_autograd(d):
    # The SDPA-compatible wrapper (BHSD) runs the kernel at these head dims, with autograd.
    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(2, 4, 77, d, generator=g).half().cuda().requires_grad_()
               for _ in range(3))
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                           is_causal=True)
    pt = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    err, err_pt = ((x.double() - ref).abs().max().item() for x in (out, pt))
    assert err <= 2 * err_pt + 1e-3, (err, err_pt)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert fa.why_not_supported(q, k, v, is_causal=True) is None


def test_rulebook_takes_every_multiple_of_8():
    for d in range(1, _rules.MAX_HEAD_DIM + 17):
        q = torch.zeros(1, 3, 2, d, dtype=torch.float16)
        reason = _rules.not_supported_reason(q, q, q, check_alignment=False)
        ok = d % 8 == 0 and d <= _rules.MAX_HEAD_DIM
        assert (reason is None) == ok, (d, reason)
        assert ok or reason.startswith("head_dim must be a multiple of 8 from 8 to ")
        assert (d in _rules.HEAD_DIMS) == ok
        assert (_rules.head_dim_bucket(d) >= d) == ok
