"""``attn_bias`` in the kernels: torch's ``attn_mask`` (a bool mask, True = attend, or an additive
fp16 / bf16 / fp32 bias) read by the forward, decode and backward kernels through its strides.

softmax(scale * q.k + bias), the bias added after softcap and ALiBi; any shape that broadcasts
to (B, H, Sq, Sk) (broadcast dimensions read with stride 0, never expanded in memory); a row the
bias hides entirely gives out 0 and lse -inf; finite biases (a dtype-minimum padding mask) keep
the result finite. Tested against an independent float64 definition (``reference.attention_ref``
with ``attn_bias``) with FlashAttention's criterion: the op's CPU reference (CI) and the CUDA
kernels (forward, LSE, decode, backward in both dQ modes), the rules, and the doors.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flash_attention_sm75 as fa
from flash_attention_sm75 import _rules
from reference import (assert_close_fa, assert_lse_close, attention_ref, poisoned_cuda_memory,
                       seed_from)
from test_backward import dq_mode

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")
ops = torch.ops.flash_attention_sm75
HAS_CUDA = torch.cuda.is_available()

DTYPES = [torch.bool, torch.float16, torch.bfloat16, torch.float32]
# Shapes relative to (B, H, Sq, Sk): what each dimension of the bias is (full or 1), as torch
# broadcasts (trailing dimensions aligned).
SHAPES = {
    "k": lambda b, h, sq, sk: (sk,),
    "qk": lambda b, h, sq, sk: (sq, sk),
    "b1qk": lambda b, h, sq, sk: (b, 1, sq, sk),
    "b11k": lambda b, h, sq, sk: (b, 1, 1, sk),
    "1h1k": lambda b, h, sq, sk: (1, h, 1, sk),
    "hqk": lambda b, h, sq, sk: (h, sq, sk),
    "bhqk": lambda b, h, sq, sk: (b, h, sq, sk),
}


def make_bias(kind, dtype, b, h, sq, sk, device, seed=0, layout="plain"):
    """A random bias of ``SHAPES[kind]``: bool with ~30% False (column 0 always True, so no
    row is empty unless a test makes it so), or values ~N(0, 2) with ~10% -inf.
    ``layout``: "plain" (contiguous), "transposed" (a (.., Sk, Sq) tensor's transpose: column
    stride Sq), "expanded" (the full (B, H, Sq, Sk) shape as an expand of the kind's shape:
    stride 0)."""
    g = torch.Generator().manual_seed(seed)
    shape = SHAPES[kind](b, h, sq, sk)
    if layout == "transposed" and len(shape) >= 2:
        base = torch.rand(*shape[:-2], shape[-1], shape[-2], generator=g).transpose(-1, -2)
    else:
        base = torch.rand(*shape, generator=g)
    if dtype == torch.bool:
        t = base > 0.3
        t[..., 0] = True
    else:
        noise = torch.randn(base.shape, generator=g) * 2.0
        t = noise.masked_fill(base < 0.1, float("-inf"))
        t[..., 0] = noise[..., 0]
        t = t.to(dtype)
    if layout == "transposed" and len(shape) >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # keep the transposed strides
    t = t.to(device)
    if layout == "expanded":
        t = t.expand(b, h, sq, sk)
    return t


def qkv(b, sq, sk, h, h_k, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=torch.float16)  # noqa
    return mk(b, sq, h, d), mk(b, sk, h_k, d), mk(b, sk, h_k, d)


def check_forward(q, k, v, bias, causal=False, bottom_right=True, softcap=0.0, slopes=None,
                  window=(-1, -1), scale=None):
    with poisoned_cuda_memory() if q.is_cuda else _Null():
        out, lse = ops.fwd(q, k, v, scale, causal, bottom_right, None, None, *window, softcap,
                           slopes, bias)
    kw = dict(causal=causal, causal_bottom_right=bottom_right, window_size=window,
              softcap=softcap, alibi_slopes=slopes, attn_bias=bias, softmax_scale=scale)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_fa(out, ref, pt)
    assert_lse_close(lse, lse_ref)
    return out, lse


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bias_ref(q, k, v, bias, causal, bottom_right, dtype):
    """Differentiable BSHD attention with the bias, in ``dtype`` (float64: the reference;
    float16: the PyTorch baseline, softmax in float32). Rows that see no key give 0."""
    b, sq, h, d = q.shape
    sk, h_k = k.shape[1], k.shape[2]
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(h // h_k, 1), vd.repeat_interleave(h // h_k, 1)
    scale = 1.0 / math.sqrt(d)
    s = (qd * scale) @ kd.transpose(-1, -2) if dtype == torch.float16 else \
        (qd @ kd.transpose(-1, -2)) * scale
    s = s.float() if dtype == torch.float16 else s
    if bias.dtype == torch.bool:
        vis = bias.expand(b, h, sq, sk)
    else:
        s = s + bias.to(device=s.device, dtype=s.dtype)
        vis = (bias != float("-inf")).expand(b, h, sq, sk)
    if causal:
        off = sk - sq if bottom_right else 0
        i = torch.arange(sq, device=q.device).view(sq, 1)
        j = torch.arange(sk, device=q.device).view(1, sk)
        vis = vis & (j <= i + off)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(~vis.any(-1, keepdim=True), 0.0).to(dtype)
    return (p @ vd).transpose(1, 2)


def check_backward(q, k, v, bias, causal=False, bottom_right=True, deterministic=True):
    g = torch.Generator().manual_seed(7)
    do = torch.randn(q.shape, generator=g).to(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = ops.fwd(q, k, v, scale, causal, bottom_right, None, None, -1, -1, 0.0, None, bias)
    with dq_mode("separate" if deterministic else "atomic"):
        with poisoned_cuda_memory() if q.is_cuda else _Null():
            dq, dk, dv = ops.bwd(do, q, k, v, out, lse, scale, causal, bottom_right, None, None,
                                 deterministic, None, -1, -1, 0.0, None, bias)
    results = {}
    for dtype in (torch.float64, torch.float16):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        o = bias_ref(*leaves, bias, causal, bottom_right, dtype)
        results[dtype] = torch.autograd.grad(o, leaves, do.to(o.dtype))
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv), results[torch.float64],
                                   results[torch.float16]):
        assert not torch.isnan(ours).any(), name
        err = (ours.double() - ref).abs().max().item()
        err_pt = (pt.double() - ref).abs().max().item()
        print(f"{name}: ours {err:.3e} pt fp16 {err_pt:.3e}")
        assert err <= 2 * err_pt + 1e-3, f"{name}: ours {err:.3e} vs pytorch fp16 {err_pt:.3e}"
    return dq, dk, dv


# ------------------------------------------------------------------------------------ CPU (CI)
# The op's CPU reference implementation: the same contract, float64.

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(SHAPES))
def test_cpu_reference_reads_every_shape_and_dtype(kind, dtype):
    q, k, v = qkv(2, 5, 7, 4, 2, 16, "cpu", seed=seed_from(kind, str(dtype)))
    bias = make_bias(kind, dtype, 2, 4, 5, 7, "cpu", seed=3)
    check_forward(q, k, v, bias)
    check_forward(q, k, v, bias, causal=True, softcap=2.0)


@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_cpu_reference_reads_strided_and_expanded_biases(layout):
    q, k, v = qkv(2, 6, 9, 2, 2, 16, "cpu", seed=4)
    bias = make_bias("qk", torch.float16, 2, 2, 6, 9, "cpu", seed=5, layout=layout)
    assert bias.stride() != bias.contiguous().stride()
    check_forward(q, k, v, bias)


def test_cpu_backward_matches_autograd_of_the_definition():
    q, k, v = qkv(2, 6, 9, 4, 2, 16, "cpu", seed=6)
    for dtype in DTYPES:
        check_backward(q, k, v, make_bias("b1qk", dtype, 2, 4, 6, 9, "cpu", seed=8),
                       causal=True)


def test_rows_the_bias_hides_give_zero_and_minus_inf_cpu():
    q, k, v = qkv(2, 4, 6, 2, 2, 16, "cpu", seed=9)
    mask = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    mask[0, :, 1] = False                      # batch 0, query 1: no key
    add = torch.zeros(2, 1, 4, 6).masked_fill(~mask, float("-inf"))
    for bias in (mask, add, add.half(), add.bfloat16()):
        out, lse = ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, bias)
        assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, :, 1]).all()
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    # a finite "dtype minimum" row is not empty: finite, the definition's softmax
    for fmin, dtype in ((torch.finfo(torch.float16).min, torch.float16),
                        (torch.finfo(torch.float32).min, torch.float32)):
        bias = torch.zeros(2, 1, 4, 6, dtype=dtype).masked_fill(~mask, fmin)
        out, lse = ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, bias)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_bias_checks_name_the_argument():
    q, k, v = qkv(2, 5, 7, 4, 2, 16, "cpu")
    good = torch.zeros(7)
    with pytest.raises(ValueError, match="attn_bias of shape \\[4, 7\\] does not broadcast"):
        ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, torch.zeros(4, 7))
    out, lse = ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, good)
    do = torch.randn_like(out)
    with pytest.raises(ValueError, match="attn_bias with softcap has no backward"):
        ops.bwd(do, q, k, v, out, lse, 0.25, False, True, None, None, True, None, -1, -1, 1.0,
                None, good)
    q2, k2, v2 = qkv(1, 3, 3, 1, 1, 136, "cpu")
    o2, l2 = ops.fwd(q2, k2, v2, None, False, True, None, None, -1, -1, 0.0, None, good[:3])
    with pytest.raises(ValueError, match="attn_bias has no backward at head_dim 136"):
        ops.bwd(o2, q2, k2, v2, o2, l2, 0.1, False, True, None, None, True, None, -1, -1, 0.0,
                None, good[:3])
    # the rulebook gives the same reasons before any launch
    assert _rules.attn_bias_problem(torch.zeros(4, 7), q, 7).startswith(
        "attn_bias of shape [4, 7] does not broadcast")
    assert "head_dim 136" in _rules.attn_bias_problem(good[:3], q2, 3, backward=True)
    assert _rules.attn_bias_problem(good[:3], q2, 3) is None  # forward only: fine
    # a slice of exactly 2^31 - 1 addressable elements passes (int32 offsets), one more does not
    # (meta tensors: strides without memory)
    qm = torch.empty(2, 5, 4, 16, dtype=torch.float16, device="meta")
    big = torch.empty_strided((2, 1, 5, 7), (0, 0, 0, (2**31 - 1) // 6), device="meta")
    assert _rules.attn_bias_problem(big, qm, 7) is None
    bigger = torch.empty_strided((2, 1, 5, 7), (0, 0, 0, (2**31 - 1) // 6 + 1), device="meta")
    assert "spans" in _rules.attn_bias_problem(bigger, qm, 7)


def check_bias_gradient(kind, dtype, causal, device, b=2, sq=37, sk=45, h=4, h_k=2, d=64,
                        layout="plain", deterministic=False, window=(-1, -1)):
    """The bias's gradient (and q, k, v's) through ``_ops.call_fwd``'s autograd against the
    float64 autograd of ``attention_ref`` with the bias as a leaf, FlashAttention's criterion
    (the baseline: ``attention_ref(upcast=False, reorder_ops=True)``, the fp16 computation of
    flash-attn's tests, with the bias a leaf in ``dtype``). That baseline, not one with an fp32
    softmax: the backward's D = rowsum(dO o O) reads the fp16 output, as every fused kernel's
    (FlashAttention's, torch's mem-efficient) does, which puts ~2^-12 |dO| |O| sqrt(d) into
    every dS of a row; an fp32-softmax baseline, free of it, was 2.5-3x more accurate on the
    (Sk,)-shaped fp32 bias sums at d = 96, and the op's CPU reference (float32 math, the same D)
    missed it as the kernel did."""
    from flash_attention_sm75 import _ops

    seed = seed_from(kind, str(dtype), causal, layout, d)
    q, k, v = (t.requires_grad_(True) for t in qkv(b, sq, sk, h, h_k, d, device, seed=seed))
    base = make_bias(kind, dtype, b, h, sq, sk, device, seed=seed + 1,
                     layout="plain" if layout == "expanded" else layout)
    leaf = base.detach().clone().requires_grad_(True)
    bias = leaf.expand(b, h, sq, sk) if layout == "expanded" else leaf
    with poisoned_cuda_memory() if q.is_cuda else _Null():
        out, _ = _ops.call_fwd(q, k, v, None, causal, True, None, None, *window,
                               attn_bias=bias, deterministic=deterministic)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2)).to(out)
    got = torch.autograd.grad(out, (q, k, v, leaf), g)
    assert got[3].dtype == leaf.dtype and got[3].shape == leaf.shape
    results = {}
    for upcast in (True, False):
        leaves = [x.detach().to(torch.float64 if upcast else x.dtype).requires_grad_(True)
                  for x in (q, k, v)]
        bl = base.detach().to(torch.float64 if upcast else dtype).requires_grad_(True)
        bx = bl.expand(b, h, sq, sk) if layout == "expanded" else bl
        o, _ = attention_ref(*leaves, causal=causal, attn_bias=bx, upcast=upcast,
                             reorder_ops=not upcast, window_size=window)
        results[upcast] = torch.autograd.grad(o, leaves + [bl], g.to(o.dtype))
    for name, ours, ref, pt in zip(("dq", "dk", "dv", "dbias"), got, results[True],
                                   results[False]):
        assert torch.isfinite(ours).all(), name
        err = (ours.double() - ref).abs().max().item()
        err_pt = (pt.double() - ref).abs().max().item()
        print(f"{name}: ours {err:.3e} pt fp16 {err_pt:.3e}")
        assert err <= 2 * err_pt + 1e-3, f"{name}: ours {err:.3e} vs pytorch fp16 {err_pt:.3e}"
    return got


@pytest.mark.parametrize("kind", ["k", "qk", "b11k", "1h1k", "bhqk"])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_gradient_cpu_reference(kind, causal):
    check_bias_gradient(kind, torch.float32, causal, "cpu", d=16)
    # in a sliding window's band: 0 outside it (causal: the window's left edge only)
    check_bias_gradient(kind, torch.float16, causal, "cpu", d=16, window=(9, -1 if causal else 4))


def test_bias_gradient_rules_and_the_raw_op_cpu():
    """A bias that requires grad gets its gradient, also in a sliding window's band; the rule's
    limits apply to it even when q, k and v do not require grad."""
    from flash_attention_sm75 import _ops

    q, k, v = qkv(1, 3, 4, 2, 2, 16, "cpu")
    bias = torch.randn(4, requires_grad=True)
    out, _ = _ops.call_fwd(q, k, v, None, False, True, attn_bias=bias)  # only the bias learns
    (gb,) = torch.autograd.grad(out.float().sum(), bias)
    assert gb.shape == (4,) and torch.isfinite(gb).all()
    with torch.no_grad():  # no gradient can flow: fine
        _ops.call_fwd(q, k, v, None, False, True, attn_bias=bias)
    assert _rules.not_supported_reason(q, k, v, attn_bias=bias, window_size=(2, 0),
                                       devices=("cpu",)) is None
    out, _ = ops.fwd(q, k, v, None, True, True, None, None, 2, 0, 0.0, None, bias)
    (gw,) = torch.autograd.grad(out.float().sum(), bias)
    assert gw.shape == (4,) and torch.isfinite(gw).all()
    with pytest.raises(ValueError, match="bwd_dbias needs attn_bias"):
        ops.bwd_dbias(out, q, k, v, out, torch.zeros(1, 2, 3), 0.25, False, True)


def test_autograd_through_the_op_with_a_bias_cpu():
    from flash_attention_sm75 import _ops

    q, k, v = (t.requires_grad_(True) for t in qkv(2, 5, 8, 2, 1, 16, "cpu", seed=11))
    bias = make_bias("b11k", torch.bool, 2, 2, 5, 8, "cpu", seed=12)
    out, _ = _ops.call_fwd(q, k, v, None, True, True, attn_bias=bias)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad(bias_ref(*leaves, bias, True, True, torch.float64), leaves,
                              g.double())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3)


def test_compile_fullgraph_with_a_bias_cpu():
    from flash_attention_sm75 import _ops

    q, k, v = qkv(2, 5, 8, 2, 2, 16, "cpu", seed=13)
    bias = make_bias("b1qk", torch.float32, 2, 2, 5, 8, "cpu", seed=14)
    f = torch.compile(lambda *a: _ops.call_fwd(*a, None, False, True, attn_bias=bias)[0],
                      fullgraph=True, backend="aot_eager")
    eager, _ = ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, bias)
    assert torch.equal(f(q, k, v), eager)


# ------------------------------------------------------------------------------------ GPU
GPU_SHAPES = [(2, 67, 200, 8, 2), (1, 128, 128, 4, 4), (3, 1, 1000, 8, 1), (2, 300, 41, 2, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_every_shape_and_dtype(kind, dtype, d, causal):
    b, sq, sk, h, h_k = GPU_SHAPES[seed_from(kind, str(dtype), d) % len(GPU_SHAPES)]
    q, k, v = qkv(b, sq, sk, h, h_k, d, "cuda", seed=seed_from(kind, d))
    bias = make_bias(kind, dtype, b, h, sq, sk, "cuda", seed=seed_from(kind, str(dtype)))
    check_forward(q, k, v, bias, causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [8, 40, 72, 96, 120, 136, 192, 256])
@pytest.mark.parametrize("layout", ["plain", "transposed", "expanded"])
def test_gpu_forward_head_dims_and_strides(d, layout):
    q, k, v = qkv(2, 97, 131, 4, 2, d, "cuda", seed=seed_from(d, layout))
    bias = make_bias("b1qk" if layout != "expanded" else "b11k", torch.float16, 2, 4, 97, 131,
                     "cuda", seed=d, layout=layout)
    check_forward(q, k, v, bias)
    check_forward(q, k, v, bias, causal=True, bottom_right=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sk", [1, 37, 4096, 20000])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=str)
def test_gpu_decode_reads_the_bias(d, sk, dtype):
    # q_len = 1 runs the decode kernel (split-KV and its merge for long caches): HF's decode
    # step with a static cache's mask.
    q, k, v = qkv(3, 1, sk, 16, 4, d, "cuda", seed=seed_from(d, sk))
    bias = make_bias("b11k", dtype, 3, 16, 1, sk, "cuda", seed=sk)
    check_forward(q, k, v, bias)
    check_forward(q, k, v, make_bias("bhqk", dtype, 3, 16, 1, sk, "cuda", seed=sk + 1),
                  softcap=5.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bias_with_every_modifier(d):
    q, k, v = qkv(2, 129, 257, 8, 2, d, "cuda", seed=d)
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / 8) for i in range(8)], device="cuda")
    bias = make_bias("b1qk", torch.float16, 2, 8, 129, 257, "cuda", seed=1)
    check_forward(q, k, v, bias, causal=True, softcap=3.0, slopes=slopes)
    check_forward(q, k, v, bias, window=(40, 0))
    check_forward(q, k, v, bias, causal=True, window=(64, 0), slopes=slopes)
    check_forward(q, k, v, bias, scale=0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_hidden_rows_and_huge_finite_biases():
    q, k, v = qkv(2, 70, 90, 4, 2, 64, "cuda", seed=21)
    mask = make_bias("b1qk", torch.bool, 2, 4, 70, 90, "cuda", seed=22)
    mask[0, :, 3] = False
    mask[1, :, 69] = False
    for bias in (mask, torch.zeros(mask.shape, device="cuda").masked_fill(~mask, -math.inf)):
        out, lse = check_forward(q, k, v, bias)
        assert (out[0, 3] == 0).all() and torch.isneginf(lse[0, :, 3]).all()
        assert (out[1, 69] == 0).all() and torch.isneginf(lse[1, :, 69]).all()
    rows = mask.any(-1).all(1)  # (b, sq): the rows that see a key
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        fmin = torch.finfo(dtype).min
        bias = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(~mask, fmin)
        out, lse = ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, bias)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), dtype
        # every other row: as the -inf mask (the minimum is below every score by far)
        ref, _ = ops.fwd(q, k, v, None, False, True, None, None, -1, -1, 0.0, None, mask)
        torch.testing.assert_close(out[rows], ref[rows], atol=2e-3, rtol=0)
        # a row of only the minimum: the definition's softmax, max-subtracted in float64 (the
        # constant cancels at fp16's minimum; at fp32's and bf16's every score rounds to it and
        # the row averages V, as torch's does); the kernel's fp32 keeps raw scores to 2^-4 next
        # to fp16's minimum / scale
        s64 = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, 2))
        p64 = torch.softmax(s64 / 8.0 + bias.double(), dim=-1)
        ref64 = torch.einsum("bhqk,bkhd->bqhd", p64, v.double().repeat_interleave(2, 2))
        torch.testing.assert_close(out[~rows].double(), ref64[~rows], atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_backward(d, dtype, deterministic):
    q, k, v = qkv(2, 131, 197, 4, 2, d, "cuda", seed=seed_from(d, str(dtype)))
    bias = make_bias("b1qk", dtype, 2, 4, 131, 197, "cuda", seed=d)
    check_backward(q, k, v, bias, causal=False, deterministic=deterministic)
    check_backward(q, k, v, make_bias("k", dtype, 2, 4, 131, 197, "cuda", seed=d + 1),
                   causal=True, bottom_right=False, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bias_gradient(d, kind, dtype, causal):
    """The bias's gradient from the dQ kernel (dS, summed over the broadcast dimensions) and
    q, k, v's, every shape and float dtype, odd and unequal lengths, GQA."""
    check_bias_gradient(kind, dtype, causal, "cuda", b=2, sq=131, sk=197, h=4, h_k=2, d=d)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [40, 64, 96, 128])
@pytest.mark.parametrize("kind", ["k", "b11k", "bhqk"])
@pytest.mark.parametrize("window", [(37, 0), (20, 9), (0, 70)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bias_gradient_in_a_sliding_window(d, kind, window, causal):
    """The band kernels (a window's left edge) store dS too; the tiles the band prunes keep
    the buffer's zeros."""
    check_bias_gradient(kind, torch.float16 if kind != "bhqk" else torch.float32, causal,
                        "cuda", b=2, sq=131, sk=197, h=4, h_k=2, d=d, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["transposed", "expanded"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_bias_gradient_strides_and_modes(layout, deterministic):
    check_bias_gradient("b1qk", torch.float16, True, "cuda", b=3, sq=200, sk=77, h=6, h_k=3,
                        d=64, layout=layout, deterministic=deterministic)
    # one query row, a key tail past every 64-key tile
    check_bias_gradient("hqk", torch.float32, False, "cuda", b=1, sq=1, sk=1000, h=8, h_k=1,
                        d=128, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_bias_gradient_with_dropout_hidden_rows_and_bitwise_repeats():
    """With dropout the gradient is the dropped dS (checked against the mask's definition
    through finite totals and seeds); rows the bias hides give zero gradient; a repeat is
    bitwise equal (the dQ kernel writes each element once, no atomics)."""
    from flash_attention_sm75 import _ops

    q, k, v = (t.requires_grad_(True) for t in qkv(2, 150, 150, 4, 4, 64, "cuda", seed=31))
    # full (B, H, Sq, Sk): its gradient is dS itself, per head
    bias = make_bias("bhqk", torch.float32, 2, 4, 150, 150, "cuda", seed=32)
    bias[0, :, 5] = -math.inf  # a row that sees no key
    leaf = bias.clone().requires_grad_(True)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(33)).to(q)

    def grads(p, seed=0):
        torch.manual_seed(seed)
        out, _ = _ops.call_fwd(q, k, v, None, False, True, attn_bias=leaf, dropout_p=p)
        return torch.autograd.grad(out, (q, k, v, leaf), g)

    a, b = grads(0.0), grads(0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (a[3][0, :, 5] == 0).all() and (a[0][0, 5] == 0).all()
    assert torch.isfinite(a[3]).all() and a[3].abs().sum() > 0
    # hidden positions (-inf) get 0
    assert (a[3][torch.isneginf(bias)] == 0).all()
    d1, d1b, d2 = grads(0.2, seed=1), grads(0.2, seed=1), grads(0.2, seed=2)
    assert torch.equal(d1[3], d1b[3]) and not torch.equal(d1[3], d2[3])
    # dropout's dS is dS of the same call's dQ: sum_k dS_qk * k_k * scale = dq
    dq_from_dbias = torch.einsum("bhqk,bkhd->bqhd", d1[3].double(), k.double()) / 8.0
    torch.testing.assert_close(dq_from_dbias, d1[0].double(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_sdpa_wrapper_learned_position_bias_trains_on_the_kernel():
    """A Swin / T5-style learned relative-position bias (1, H, S, S) passed as SDPA's
    attn_mask: on the kernel in strict mode, gradients of q, k, v and the bias against
    float64 torch SDPA with FlashAttention's criterion (fp16 torch SDPA as the baseline)."""
    from flash_attention_sm75 import sdpa

    g = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(3, 6, 49, 32, generator=g).half().cuda().requires_grad_(True)
               for _ in range(3))
    table = (torch.randn(1, 6, 49, 49, generator=g) * 0.5).half().cuda().requires_grad_(True)
    dout = torch.randn(3, 6, 49, 32, generator=g).half().cuda()
    with sdpa.strict():
        out = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=table)
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    res = {}
    for dt in (torch.float64, torch.float16):
        leaves = [x.detach().to(dt).requires_grad_(True) for x in (q, k, v, table)]
        o = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3])
        res[dt] = torch.autograd.grad(o, leaves, dout.to(dt))
    for name, ours, ref, pt in zip(("dq", "dk", "dv", "dbias"), got, res[torch.float64],
                                   res[torch.float16]):
        err = (ours.double() - ref).abs().max().item()
        err_pt = (pt.double() - ref).abs().max().item()
        assert err <= 2 * err_pt + 1e-3, f"{name}: ours {err:.3e} vs pytorch fp16 {err_pt:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_t5_training_runs_the_learned_bias_on_the_kernel():
    """A tiny T5 in train mode (dropout off to compare): every attention call on the kernel,
    the loss and every gradient, the relative-attention embedding's included, as stock SDPA's
    (float32 model) to fp16 accuracy."""
    import copy

    transformers = pytest.importorskip("transformers")
    from transformers import T5Config, T5ForConditionalGeneration

    from flash_attention_sm75.integrations import transformers as hf

    cfg = T5Config(vocab_size=128, d_model=256, d_kv=64, d_ff=256, num_layers=2,
                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                   dropout_rate=0.0)
    torch.manual_seed(17)
    ref = T5ForConditionalGeneration(cfg).cuda().train()
    ours = copy.deepcopy(ref).half()
    ref.set_attn_implementation("sdpa")
    ours.set_attn_implementation("sm75_attention")
    g = torch.Generator().manual_seed(18)
    ids = torch.randint(1, 128, (2, 70), generator=g).cuda()
    am = torch.ones_like(ids)
    am[1, 50:] = 0
    labels = torch.randint(1, 128, (2, 33), generator=g).cuda()
    hf.reset_stats()
    loss_ours = ours(input_ids=ids, attention_mask=am, labels=labels).loss
    stats = hf.get_stats()
    if stats["kernel"] + stats["fallback"] == 0:
        pytest.skip(f"T5 of transformers {transformers.__version__} does not call "
                    f"registered attention functions")
    assert stats["fallback"] == 0, stats
    loss_ours.backward()
    loss_ref = ref(input_ids=ids, attention_mask=am, labels=labels).loss
    loss_ref.backward()
    assert abs(loss_ours.item() - loss_ref.item()) < 2e-2 * abs(loss_ref.item())
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        if p_ref.grad is None:
            continue
        assert p_ours.grad is not None and torch.isfinite(p_ours.grad).all(), name
        rel = ((p_ours.grad.float() - p_ref.grad).norm() / p_ref.grad.norm().clamp_min(1e-12))
        assert rel.item() < 5e-2, f"{name}: relative gradient error {rel.item():.3e}"
    emb = [n for n, _ in ours.named_parameters() if "relative_attention_bias" in n]
    assert emb  # the learned bias is among the parameters compared above


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_backward_hidden_rows_give_zero_gradients():
    q, k, v = qkv(1, 40, 50, 2, 2, 64, "cuda", seed=31)
    mask = torch.ones(1, 1, 40, 50, dtype=torch.bool, device="cuda")
    mask[..., 7, :] = False
    mask[..., :, 11] = False  # key 11 hidden from everyone: dk, dv 0 there
    dq, dk, dv = check_backward(q, k, v, mask)
    assert (dq[0, 7] == 0).all() and (dk[0, 11] == 0).all() and (dv[0, 11] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_sdpa_wrapper_runs_masks_on_the_kernel_in_a_cuda_graph():
    # The mask is read on the device at every replay: capture once, change the mask in place.
    q, k, v = (t.transpose(1, 2) for t in qkv(2, 33, 77, 4, 4, 64, "cuda", seed=41))
    mask = make_bias("b1qk", torch.bool, 2, 4, 33, 77, "cuda", seed=42)
    fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # warm-up (classification)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for seed in (43, 44):
        mask.copy_(make_bias("b1qk", torch.bool, 2, 4, 33, 77, "cuda", seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_sdpa_wrapper_training_with_a_mask_matches_torch():
    q, k, v = (t.transpose(1, 2).requires_grad_(True)
               for t in qkv(2, 65, 65, 4, 4, 128, "cuda", seed=51))
    mask = make_bias("b1qk", torch.float16, 2, 4, 65, 65, "cuda", seed=52)
    assert fa.why_not_supported(q, k, v, attn_mask=mask) is None
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask.double())
    refs = torch.autograd.grad(ref, leaves, g.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    for a, b in zip(got, refs):
        torch.testing.assert_close(a.double(), b, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_nan_bias_where_the_band_hides_keys_is_never_read_into_the_result(d):
    # The mask wins over the bias at hidden positions (forward and both backward kernels): a
    # bias buffer with garbage above the causal diagonal gives the result of a clean one.
    q, k, v = qkv(2, 70, 90, 4, 2, d, "cuda", seed=61)
    bias = make_bias("b1qk", torch.float16, 2, 4, 70, 90, "cuda", seed=62)
    hidden = torch.ones(70, 90, dtype=torch.bool, device="cuda").triu(90 - 70 + 1)
    dirty = bias.masked_fill(hidden, float("nan"))
    clean = bias.masked_fill(hidden, 0.0)
    for deterministic in (False, True):
        with dq_mode("separate" if deterministic else "atomic"):
            outs = []
            for b_ in (dirty, clean):
                out, lse = ops.fwd(q, k, v, None, True, True, None, None, -1, -1, 0.0, None, b_)
                do = torch.ones_like(out)
                grads = ops.bwd(do, q, k, v, out, lse, d ** -0.5, True, True, None, None,
                                deterministic, None, -1, -1, 0.0, None, b_)
                outs.append((out, lse) + tuple(grads))
        for a, b_ in zip(*outs):
            assert torch.isfinite(a).all() and torch.equal(a, b_)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scale", [0.125, 1.0, 4.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_dtype_minimum_rows_stay_finite_at_any_scale(scale, dtype):
    # raw = bias / scale, and exponents take raw * scale * log2(e): at scale >= ln 2 a raw value
    # clamped only at FLT_MAX would overflow there (inf - inf = NaN). T5 runs at scale 1.
    q, k, v = qkv(2, 40, 60, 2, 2, 64, "cuda", seed=63)
    mask = torch.ones(2, 1, 40, 60, dtype=torch.bool, device="cuda")
    mask[0, :, 5] = False
    bias = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(
        ~mask, torch.finfo(dtype).min)
    out, lse = ops.fwd(q, k, v, scale, False, True, None, None, -1, -1, 0.0, None, bias)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # the hidden row averages V (every score equal after the minimum), as torch's softmax
    vmean = v.float().mean(1)[0]  # (h, d)
    torch.testing.assert_close(out[0, 5].float(), vmean, atol=2e-3, rtol=0)
    do = torch.randn_like(out)
    grads = ops.bwd(do, q, k, v, out, lse, scale, False, True, None, None, True, None, -1, -1,
                    0.0, None, bias)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_fp16_bias_at_the_smallest_accepted_scale():
    # The kernels read fp16 biases without the clamp of raw values (bias / scale); at the
    # smallest scale a floating bias is accepted with (BIAS_SCALE_MIN) fp16's extremes are still
    # far inside it. Forward and backward agree with the same bias given as float32 (which the
    # kernels clamp; nothing reaches it here), stay finite for a row hidden by fp16's minimum,
    # and are right.
    scale = _rules.BIAS_SCALE_MIN
    q, k, v = qkv(2, 33, 70, 4, 2, 64, "cuda", seed=64)
    g = torch.Generator().manual_seed(65)
    bias = (torch.randn(2, 4, 33, 70, generator=g) * 2).to(torch.float16)
    bias[0, 1, 7] = torch.finfo(torch.float16).min
    bias[1, :, :, 3] = float("-inf")
    bias = bias.cuda()
    out, lse = ops.fwd(q, k, v, scale, False, True, None, None, -1, -1, 0.0, None, bias)
    out32, lse32 = ops.fwd(q, k, v, scale, False, True, None, None, -1, -1, 0.0, None,
                           bias.float())
    # The fp16 reads may fuse the scaling into the add (one rounding fewer): equal up to that.
    torch.testing.assert_close(out, out32, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse, lse32, rtol=1e-5, atol=0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out[0, 7, 1].float(), v.float()[0, :, 0].mean(0), atol=2e-3,
                               rtol=0)  # hidden by the minimum: the average of V, as torch
    keep = torch.ones(2, 33, 4, dtype=torch.bool, device="cuda")
    keep[0, 7, 1] = False
    ref, _ = attention_ref(q, k, v, attn_bias=bias, softmax_scale=scale)
    pt, _ = attention_ref(q, k, v, attn_bias=bias, softmax_scale=scale, upcast=False,
                          reorder_ops=True)
    assert_close_fa(out[keep].view(1, -1, 1, 64), ref[keep].view(1, -1, 1, 64),
                    pt[keep].view(1, -1, 1, 64))
    do = torch.randn_like(out)
    grads = ops.bwd(do, q, k, v, out, lse, scale, False, True, None, None, True, None, -1, -1,
                    0.0, None, bias)
    grads32 = ops.bwd(do, q, k, v, out, lse, scale, False, True, None, None, True, None, -1, -1,
                      0.0, None, bias.float())
    for a, b in zip(grads, grads32):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_floating_bias_below_the_smallest_scale_is_refused(dtype):
    # The kernels add a bias in raw units (bias / softmax_scale) and clamp raw values beyond
    # ~1.7e38 (for dtype-minimum masks): below BIAS_SCALE_MIN that clamp would change finite
    # biases that are no mask (at 1e-35 a row of [-3000, -2000] would weigh its keys equally).
    # Refused by the rulebook and the op (CPU here, before any launch on CUDA); a bool mask and
    # the bound itself are accepted.
    q, k, v = qkv(1, 5, 7, 2, 2, 64, "cpu", seed=3)
    bias = torch.randn(1, 2, 5, 7).to(dtype)
    small = _rules.BIAS_SCALE_MIN / 2
    reason = _rules.attn_bias_problem(bias, q, 7, softmax_scale=small)
    assert reason is not None and "softmax_scale >= 2^-27" in reason, reason
    assert _rules.not_supported_reason(q, k, v, small, attn_bias=bias) == reason
    assert _rules.attn_bias_problem(bias, q, 7, softmax_scale=_rules.BIAS_SCALE_MIN) is None
    assert _rules.attn_bias_problem(bias, q, 7) is None  # the default scale, 1 / 8
    assert _rules.attn_bias_problem(bias > 0, q, 7, softmax_scale=small) is None
    with pytest.raises(ValueError, match=r"softmax_scale >= 2\^-27"):
        ops.fwd(q, k, v, small, False, True, None, None, -1, -1, 0.0, None, bias)
    out, lse = ops.fwd(q, k, v, small, False, True, None, None, -1, -1, 0.0, None, bias > 0)
    with pytest.raises(ValueError, match=r"softmax_scale >= 2\^-27"):
        ops.bwd(torch.randn_like(out), q, k, v, out, lse, small, False, True, None, None, True,
                None, -1, -1, 0.0, None, bias)
    # The SDPA wrapper's bias rule (CUDA-only door; its mask-as-bias check runs on any device)
    # is given the call's scale: a mask below the bound falls back.
    from flash_attention_sm75 import sdpa as sdpa_door
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    why = sdpa_door._bias_reason(qb, kb, vb, bias, "no key ranges", 0.0, small)
    assert why is not None and "scale >= 2^-27" in why, why
    assert sdpa_door._bias_reason(qb, kb, vb, bias, "no key ranges", 0.0,
                                  _rules.BIAS_SCALE_MIN) is None
