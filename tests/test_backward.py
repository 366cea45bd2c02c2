"""Backward pass of flash_attention_sm75: gradients against a float64 autograd reference.

GPU tests (skipped without CUDA) use FlashAttention's criterion: for each of dq, dk, dv,
``max|ours - ref64| <= 2 * max|pt16 - ref64| + atol``, where ``pt16`` is the same attention
computed by PyTorch in float16 (matmuls in fp16, softmax in fp32) and differentiated by autograd.
CPU tests check the float32 CPU implementation of ``bwd`` and the autograd wiring.
"""
from __future__ import annotations

import contextlib
import math
import os
import re

import pytest
import torch

ext = pytest.importorskip("flash_attention_sm75._C", reason="extension not built")
from flash_attention_sm75 import deterministic_backward  # noqa: E402
from reference import (apply_score_mods, cuda_kernels_run, kernel_streams,  # noqa: E402
                       visible_mask)

HAS_CUDA = torch.cuda.is_available()


def cuda_only(fn):
    # `gpu` marker: conftest.py skips it without a GPU of compute capability >= 7.5.
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))

ops = torch.ops.flash_attention_sm75


# ---------------------------------------------------------------------------------------------
# Reference
def attention_ref(q, k, v, scale, causal, bottom_right, leftpad_k=None, seqused_k=None,
                  dtype=torch.float64, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """BSHD attention in `dtype` (float64 reference, or float16 = the PyTorch baseline with an
    fp32 softmax). Rows that see no key output 0. Differentiable."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(H // Hk, 1)
    vd = vd.repeat_interleave(H // Hk, 1)
    s = (qd * scale) @ kd.transpose(-1, -2) if dtype == torch.float16 else (qd @ kd.transpose(-1, -2)) * scale
    s = apply_score_mods(s, softcap, alibi_slopes, bottom_right)
    vis = visible_mask(B, Sq, Sk, causal, bottom_right, leftpad_k, seqused_k, q.device,
                       window_size)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s.float() if dtype == torch.float16 else s, dim=-1)
    p = p.masked_fill(~vis.any(-1, keepdim=True), 0.0).to(dtype)
    return (p @ vd).transpose(1, 2)


def make_inputs(B, Sq, Sk, H, Hk, D, device, layout="bshd", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.float16)

    if layout == "bhsd":  # non-contiguous BSHD views of BHSD storage
        q = rnd(B, H, Sq, D).transpose(1, 2)
        k = rnd(B, Hk, Sk, D).transpose(1, 2)
        v = rnd(B, Hk, Sk, D).transpose(1, 2)
        do = rnd(B, H, Sq, D).transpose(1, 2)
    elif layout == "sliced":  # every head is a slice of a wider row (strides % 8 == 0)
        q = rnd(B, Sq, H, D + 8)[..., :D]
        k = rnd(B, Sk, Hk, D + 8)[..., :D]
        v = rnd(B, Sk, Hk, D + 8)[..., :D]
        do = rnd(B, Sq, H, D + 8)[..., :D]
    else:
        q, k, v, do = rnd(B, Sq, H, D), rnd(B, Sk, Hk, D), rnd(B, Sk, Hk, D), rnd(B, Sq, H, D)
    return q, k, v, do


def grads(fn, q, k, v, do, dtype=torch.float64):
    """Autograd gradients of fn with leaves in `dtype` (float64 for the reference, so its
    gradients are not rounded back to fp16; float16 for the PyTorch baseline)."""
    q, k, v = (x.detach().to(dtype).requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.to(out.dtype))
    return out, dq, dk, dv


@contextlib.contextmanager
def dq_mode(mode):
    """Select the backward's dQ kernel for the calls inside the block (env read per call)."""
    prev = os.environ.get("FLASH_SM75_BWD_DQ")
    os.environ["FLASH_SM75_BWD_DQ"] = mode
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("FLASH_SM75_BWD_DQ", None)
        else:
            os.environ["FLASH_SM75_BWD_DQ"] = prev


def check_against_reference(q, k, v, do, causal, bottom_right, lp=None, su=None,
                            deterministic=False, atol=1e-3, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    mods = dict(softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = ops.fwd(q, k, v, scale, causal, bottom_right, lp, su, *window_size, softcap,
                       alibi_slopes)
    # deterministic=False exercises the atomic-dQ kernel (opt-in via FLASH_SM75_BWD_DQ=atomic);
    # deterministic=True the separate dQ kernel, which is also the default.
    with dq_mode("separate" if deterministic else "atomic"):
        dq, dk, dv = ops.bwd(do, q, k, v, out, lse, scale, causal, bottom_right, lp, su,
                             deterministic, None, *window_size, softcap, alibi_slopes)
    for t in (dq, dk, dv):
        assert t.dtype == torch.float16 and t.is_contiguous()
        assert not torch.isnan(t).any()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    _, dq_ref, dk_ref, dv_ref = grads(
        lambda a, b, c: attention_ref(a, b, c, scale, causal, bottom_right, lp, su,
                                      window_size=window_size, **mods), q, k, v, do)
    _, dq_pt, dk_pt, dv_pt = grads(
        lambda a, b, c: attention_ref(a, b, c, scale, causal, bottom_right, lp, su,
                                      dtype=torch.float16, window_size=window_size, **mods),
        q, k, v, do, dtype=torch.float16)
    for name, ours, ref, pt in (("dq", dq, dq_ref, dq_pt), ("dk", dk, dk_ref, dk_pt),
                                ("dv", dv, dv_ref, dv_pt)):
        err = (ours.double() - ref).abs().max().item()
        err_pt = (pt.double() - ref).abs().max().item()
        assert err <= 2 * err_pt + atol, f"{name}: ours {err:.3e} vs pytorch fp16 {err_pt:.3e}"
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# GPU
CAUSAL_MODES = [(False, True), (True, True), (True, False)]  # (is_causal, bottom_right)
SEQLENS = [(1, 1), (7, 7), (127, 129), (129, 127), (1, 1000), (1000, 7), (1000, 1000), (113, 203)]


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES)
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_seqlens(d, seqlens, causal, bottom_right, deterministic):
    Sq, Sk = seqlens
    q, k, v, do = make_inputs(2, Sq, Sk, 4, 2, d, "cuda", seed=Sq * 7 + Sk)
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=deterministic)


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("h,h_k", [(4, 4), (4, 2), (8, 2), (8, 1)])  # MHA, GQA 2 and 4, MQA
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_gqa(d, causal, bottom_right, h, h_k, deterministic):
    q, k, v, do = make_inputs(2, 257, 300, h, h_k, d, "cuda", seed=h * 10 + h_k)
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=deterministic)


@cuda_only
@pytest.mark.parametrize("layout", ["bhsd", "sliced"])
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_strided(d, layout):
    q, k, v, do = make_inputs(2, 200, 190, 4, 2, d, "cuda", layout=layout, seed=3)
    assert not q.is_contiguous()
    check_against_reference(q, k, v, do, True, True)


# The 8-warp dK/dV tile (Bwd_tile_config<d>::Traits) of the head dims with a K-in-registers
# tile, as its kernel name prints it: the atomic mode runs it.
_DKDV_8WARP_TRAITS = {64: "64, 64, 64, 8", 128: "128, 32, 64, 8"}


@cuda_only
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES)
@pytest.mark.parametrize("seqlens,heads", [((127, 129), (4, 2)), ((1000, 1000), (8, 1)),
                                           ((1, 1000), (4, 4))])
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_dkdv_kernel_choice(d, seqlens, heads, causal, bottom_right, deterministic):
    # d = 64 and 128, the plain family without a window: the deterministic mode runs the
    # K-in-registers dK/dV kernel (Bwd_tile_config<d>::KregTraits, 4-warp CTAs, several per
    # Turing SM), the atomic mode the 8-warp kernel of Traits with the dQ atomics, on every GPU
    # (the plan a Turing SM, 64 KiB of shared memory, runs). It must be exact either way.
    Sq, Sk = seqlens
    q, k, v, do = make_inputs(2, Sq, Sk, *heads, d, "cuda", seed=Sq + Sk)
    names = cuda_kernels_run(lambda: check_against_reference(q, k, v, do, causal, bottom_right,
                                                             deterministic=deterministic), "dkdv")
    assert len(names) == 1, names
    name = next(iter(names))
    if deterministic:
        # <traits <d, queries per tile, warps, CTAs per SM, V in registers>, Is_causal>
        found = re.search(r"flash_bwd_dkdv_kreg_kernel<(?:flash_sm75::)?"
                          rf"Flash_bwd_dkdv_kreg_traits<{d}, \d+, 4, \d+, (?:true|false)>, "
                          r"(true|false)>", name)
        assert found, names
        assert found.group(1) == str(causal).lower()
        return
    # Template arguments: <traits, Is_causal, Atomic_dq, Is_local, Is_ext, Drop_only>.
    # (The traits' trailing defaults, column splits and kDropout, may be printed, and so may
    # Drop_only's default.)
    found = re.search(r"flash_bwd_dkdv_kernel<(?:flash_sm75::)?Flash_bwd_kernel_traits<"
                      rf"{_DKDV_8WARP_TRAITS[d]}"
                      r"(?:, 1)?(?:, true)?>, (true|false), (true|false), (true|false), "
                      r"(true|false)(?:, (true|false))?>", name)
    assert found, names
    assert found.group(1) == str(causal).lower() and found.group(2) == "true"
    # No window, no score mods, no dropout: neither the local, the score-mod nor the
    # dropout-only instantiation.
    assert found.group(3) == "false" and found.group(4) == "false"
    assert found.group(5) in (None, "false")


@cuda_only
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_dq_stream_same_and_side_agree(d, monkeypatch):
    # FLASH_SM75_BWD_DQ_STREAM: the dQ kernel on a second stream (default) or on the caller's
    # stream: the same kernels, so bitwise the same gradients; both exact; and the dQ kernel
    # runs on a stream of its own exactly in the "side" mode.
    q, k, v, do = make_inputs(2, 333, 517, 8, 2, d, "cuda", seed=21)
    results = {}
    for mode in ("side", "same"):
        monkeypatch.setenv("FLASH_SM75_BWD_DQ_STREAM", mode)
        streams = kernel_streams(lambda: results.__setitem__(
            mode, check_against_reference(q, k, v, do, True, True, deterministic=True)))
        dkdv = set().union(*(s for n, s in streams.items() if "flash_bwd_dkdv" in n))
        dq = set().union(*(s for n, s in streams.items() if "flash_bwd_dq_kernel" in n))
        assert len(dkdv) == 1 and len(dq) == 1, streams
        assert (dkdv != dq) == (mode == "side"), (mode, dkdv, dq)
    for a, b in zip(results["side"], results["same"]):
        assert torch.equal(a, b)


@cuda_only
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_cuda_graph_capture(d, monkeypatch):
    # The side stream forks from and joins the caller's stream through events, so the backward
    # can be captured in a CUDA graph (torch.compile mode="reduce-overhead" does): the replay
    # must compute the gradients of new inputs copied into the captured tensors (a dQ kernel
    # left out of the capture would leave dq stale or unwritten).
    monkeypatch.delenv("FLASH_SM75_BWD_DQ_STREAM", raising=False)
    scale = d ** -0.5
    static = make_inputs(2, 300, 300, 4, 2, d, "cuda", seed=1)
    out, lse = ops.fwd(*static[:3], scale, True, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph asks
        ops.bwd(static[3], *static[:3], out, lse, scale, True, True, None, None, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.bwd(static[3], *static[:3], out, lse, scale, True, True, None, None, True)
    fresh = make_inputs(2, 300, 300, 4, 2, d, "cuda", seed=2)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    new_out, new_lse = ops.fwd(*static[:3], scale, True, True)
    out.copy_(new_out)
    lse.copy_(new_lse)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = ops.bwd(static[3], *static[:3], out, lse, scale, True, True, None, None, True)
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


@cuda_only
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("d", [64, 128])
def test_nan_input_reaches_what_it_reaches_in_the_reference(d, where, deterministic):
    # One NaN element in q (query 37 of head 1) or k (key 37 of kv head 1), not causal: out,
    # lse and the gradients must be NaN exactly where the float64 definition's are (the whole
    # head group's dK / dV, one dQ row, ...), never hidden behind a finite value (a forward
    # that reported the row as empty, lse = -inf, or a backward that clamped a NaN exponent to 0
    # did) and never spread to other heads.
    q, k, v, do = make_inputs(2, 70, 90, 4, 2, d, "cuda", seed=11)
    (q if where == "q" else k)[1, 37, 1, 5] = float("nan")
    scale = 1.0 / math.sqrt(d)
    out, lse = ops.fwd(q, k, v, scale, False, True)
    with dq_mode("separate" if deterministic else "atomic"):
        dq, dk, dv = ops.bwd(do, q, k, v, out, lse, scale, False, True, None, None,
                             deterministic)
    refs = grads(lambda a, b, c: attention_ref(a, b, c, scale, False, True), q, k, v, do)
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), refs):
        nan_ref = torch.isnan(ref)
        assert nan_ref.any() and not nan_ref.all(), f"{name}: the probe must be partial"
        assert torch.equal(torch.isnan(ours), nan_ref), f"{name}: NaN pattern differs"
    rows_nan = torch.isnan(refs[0]).any(-1).transpose(1, 2)  # (B, H, Sq)
    assert torch.equal(torch.isnan(lse), rows_nan), "lse: NaN rows differ from the output's"


@cuda_only
@pytest.mark.parametrize("name,value,message", [
    *[("FLASH_SM75_BWD_DQ", v, "FLASH_SM75_BWD_DQ must be 'separate' or 'atomic'")
      for v in ("ATOMIC", "1", "atomic ")],
    *[("FLASH_SM75_BWD_DQ_STREAM", v, "FLASH_SM75_BWD_DQ_STREAM must be 'side' or 'same'")
      for v in ("SIDE", "0", "side ")],
])
def test_bwd_env_rejects_bad_values(name, value, message, monkeypatch):
    q, k, v, do = make_inputs(1, 65, 65, 2, 2, 128, "cuda")
    out, lse = ops.fwd(q, k, v, None, False, True)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):  # non-deterministic: both variables are read
        ops.bwd(do, q, k, v, out, lse, 0.125, False, True, None, None, False)


@cuda_only
def test_bwd_unaligned_dout_is_copied():
    # e.g. the expanded gradient of out.sum(): stride 0 everywhere
    q, k, v, _ = make_inputs(1, 65, 65, 2, 2, 64, "cuda")
    do = torch.ones(1, 1, 1, 1, device="cuda", dtype=torch.float16).expand(1, 65, 2, 64)
    check_against_reference(q, k, v, do, False, True)


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_key_ranges(d, causal, bottom_right, deterministic):
    B, S = 4, 300
    q, k, v, do = make_inputs(B, S, S, 4, 2, d, "cuda", seed=11)
    lp = torch.tensor([0, 5, 100, S], dtype=torch.int32, device="cuda")  # last: no key at all
    su = torch.tensor([S, 250, 120, S], dtype=torch.int32, device="cuda")
    dq, dk, dv = check_against_reference(q, k, v, do, causal, bottom_right, lp, su,
                                         deterministic=deterministic)
    for b in range(B):
        lo, hi = int(lp[b]), int(su[b])
        outside = torch.ones(S, dtype=torch.bool, device="cuda")
        outside[lo:max(lo, hi)] = False
        assert (dk[b][outside] == 0).all() and (dv[b][outside] == 0).all()
    assert (dq[3] == 0).all()  # rows that saw no key: zero gradient, not NaN


@cuda_only
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_deterministic_bitwise(d):
    q, k, v, do = make_inputs(2, 1000, 1000, 8, 2, d, "cuda", seed=5)
    scale = d ** -0.5
    out, lse = ops.fwd(q, k, v, scale, True, True)
    first = ops.bwd(do, q, k, v, out, lse, scale, True, True, None, None, True)
    for _ in range(3):
        again = ops.bwd(do, q, k, v, out, lse, scale, True, True, None, None, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_through_fwd(deterministic):
    q, k, v, do = make_inputs(2, 300, 300, 4, 2, 64, "cuda", seed=9)
    scale = 0.125
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    with deterministic_backward(deterministic):
        out, _ = ops.fwd(q, k, v, scale, True, True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    _, dq_ref, dk_ref, dv_ref = grads(
        lambda a, b, c: attention_ref(a, b, c, scale, True, True), q, k, v, do)
    for ours, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert (ours.double() - ref).abs().max().item() < 2e-2


@cuda_only
def test_deterministic_backward_context_reaches_the_cuda_backward(monkeypatch):
    # PyTorch runs the backward of CUDA tensors on its autograd device thread: the context
    # manager must reach it there (a thread-local flag would not). Under
    # FLASH_SM75_BWD_DQ=atomic, the block forces the separate dQ kernel, else the atomic path
    # (dK/dV kernel with dQ atomics + the fp32 -> fp16 convert kernel) runs.
    monkeypatch.setenv("FLASH_SM75_BWD_DQ", "atomic")
    q, k, v, do = make_inputs(1, 200, 200, 2, 2, 64, "cuda", seed=4)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    for forced in (False, True):
        out, _ = ops.fwd(q, k, v, 0.125, True, True)

        def step():
            with deterministic_backward(forced):
                torch.autograd.grad(out, (q, k, v), do)

        names = cuda_kernels_run(step, "flash_bwd")
        assert any("flash_bwd_dq_kernel" in n for n in names) == forced, names
        assert any("flash_bwd_convert_dq_kernel" in n for n in names) == (not forced), names


@cuda_only
def test_grad_through_lse():
    # loss uses softmax_lse too: its gradient must be included (d lse_i / d s_ij = P_ij)
    q, k, v, do = make_inputs(1, 150, 170, 2, 1, 64, "cuda", seed=2)
    scale = 0.125
    glse = torch.randn(1, 2, 150, device="cuda", dtype=torch.float32)
    q1, k1, v1 = (x.detach().requires_grad_(True) for x in (q, k, v))
    out, lse = ops.fwd(q1, k1, v1, scale, True, True)
    torch.autograd.backward((out, lse), (do, glse))

    q2, k2, v2 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    s = (q2.transpose(1, 2) @ k2.transpose(1, 2).repeat_interleave(2, 1).transpose(-1, -2)) * scale
    vis = visible_mask(1, 150, 170, True, True, device="cuda")
    s = s.masked_fill(~vis, float("-inf"))
    lse_ref = torch.logsumexp(s, -1)
    o_ref = (torch.softmax(s, -1) @ v2.transpose(1, 2).repeat_interleave(2, 1)).transpose(1, 2)
    torch.autograd.backward((o_ref, lse_ref), (do.double(), glse.double()))
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        assert (a.grad.double() - b.grad).abs().max().item() < 2e-2


@cuda_only
def test_bwd_memory_is_linear():
    # N = 16k: an N x N fp32 matrix per head would be 1 GiB; the backward must stay O(N).
    N, H, D = 16384, 4, 64
    q, k, v, do = make_inputs(1, N, N, H, H, D, "cuda", seed=1)
    out, lse = ops.fwd(q, k, v, None, True, True)
    torch.cuda.synchronize()
    for deterministic in (False, True):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads_ = ops.bwd(do, q, k, v, out, lse, D ** -0.5, True, True, None, None, deterministic)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        io_bytes = q.numel() * 2  # one (N, H, D) fp16 tensor = 8 MiB
        # dq, dk, dv (3 io) + fp32 dq accumulator (2 io) + D; far below N^2 * 4 bytes (1 GiB).
        assert peak <= 8 * io_bytes, f"peak {peak / 2**20:.1f} MiB"
        del grads_


# ---------------------------------------------------------------------------------------------
# CPU: the float32 implementation against float64 autograd, and the autograd wiring.
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES)
@pytest.mark.parametrize("Sq,Sk,h,h_k", [(5, 9, 4, 2), (9, 5, 4, 1), (33, 33, 2, 2), (1, 17, 4, 4)])
@pytest.mark.parametrize("d", [64, 128])
def test_cpu_bwd_matches_autograd(d, Sq, Sk, h, h_k, causal, bottom_right):
    q, k, v, do = make_inputs(2, Sq, Sk, h, h_k, d, "cpu", seed=Sq + Sk)
    lp = torch.tensor([0, 2], dtype=torch.int32)
    su = torch.tensor([Sk, max(2, Sk - 2)], dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    out, lse = ops.fwd(q, k, v, scale, causal, bottom_right, lp, su)
    dq, dk, dv = ops.bwd(do, q, k, v, out, lse, scale, causal, bottom_right, lp, su)
    _, dq_ref, dk_ref, dv_ref = grads(
        lambda a, b, c: attention_ref(a, b, c, scale, causal, bottom_right, lp, su), q, k, v, do)
    for ours, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert not torch.isnan(ours).any()
        # fp16 output rounding + D computed from the fp16 `out`
        assert (ours.double() - ref).abs().max().item() <= 1e-2 * max(1.0, ref.abs().max().item())


def test_cpu_autograd_and_no_key_rows():
    B, S = 2, 12
    q, k, v, do = make_inputs(B, S, S, 2, 1, 64, "cpu", seed=4)
    lp = torch.tensor([0, S], dtype=torch.int32)  # batch 1 sees no key
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out, _ = ops.fwd(q, k, v, None, False, True, lp, None)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_training_step_matches_eager_cpu(backend):
    import flash_attention_sm75 as fa
    torch._dynamo.reset()
    q, k, v, _ = make_inputs(2, 9, 11, 4, 2, 64, "cpu", seed=9)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))

    def step(q, k, v):
        return (fa.flash_attn_func(q, k, v, causal=True).float() ** 2).sum()

    loss_c = torch.compile(step, backend=backend, fullgraph=True)(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = step(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    assert torch.equal(loss_c, loss_e)
    assert all(torch.equal(a, b) for a, b in zip(grads_c, grads_e))


def test_double_backward_raises():
    q, k, v, do = make_inputs(1, 9, 11, 2, 1, 64, "cpu", seed=8)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out, _ = ops.fwd(q, k, v, None, True, True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        (dq.float().sum() + dk.float().sum() + dv.float().sum()).backward()


def test_opcheck_bwd_cpu():
    q, k, v, do = make_inputs(1, 9, 11, 4, 2, 64, "cpu", seed=6)
    out, lse = ops.fwd(q, k, v, 0.125, True, True)
    torch.library.opcheck(ops.bwd.default, (do, q, k, v, out, lse, 0.125, True, True))
    lp = torch.tensor([1], dtype=torch.int32)
    torch.library.opcheck(ops.bwd.default, (do, q, k, v, out, lse, 0.125, False, True, lp, None,
                                            True, torch.randn(1, 4, 9)))


def test_opcheck_fwd_autograd_cpu():
    q, k, v, _ = make_inputs(1, 9, 11, 4, 2, 64, "cpu", seed=7)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    torch.library.opcheck(ops.fwd.default, (q, k, v, 0.125, True, True))
