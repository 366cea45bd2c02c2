"""Reference attention, tolerance criterion and GPU test helpers (shared by the test modules).

Written from the op contract (docs/CONTRACT.md), independently of the kernel code:

* :func:`visible_mask` -- which key each query sees (causal in both alignments, per-batch key
  ranges from ``leftpad_k``/``seqused_k`` clamped into ``[0, seqlen_k]`` as the contract says).
* :func:`attention_ref` -- attention in float64 (``upcast=True``), or the "PyTorch fp16" baseline
  (``upcast=False, reorder_ops=True``: the same math done with fp16 tensors, the way an ordinary
  fp16 PyTorch implementation would compute it), after FlashAttention's ``attention_ref``.
* :func:`assert_close_fa` -- FlashAttention's criterion: ``max|ours - ref| <= 2 * max|pt_fp16 -
  ref| + atol`` with FA3's floor ``atol = 2 * max|(ref + 0.3 - 0.3) - ref|`` (evaluated in fp16:
  the rounding error of an fp16 number of the output's magnitude).
* :func:`assert_lse_close` -- the log-sum-exp against the float64 one.
* :func:`poisoned_cuda_memory` -- make uninitialized CUDA memory NaN around an op call.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Optional

import torch

# LSE tolerance: |lse - lse_ref| <= LSE_ATOL + LSE_RTOL * |lse_ref|. The kernel computes scores
# from fp16 inputs with fp32 accumulation and the LSE in fp32, so the expected error is ~1e-5
# (dominated by fp32 rounding of scores of magnitude up to ~60 in the large-input tests); the
# bound leaves a 10x margin while still catching a wrong scale, a wrong log base or a lost key.
LSE_ATOL = 2e-4
LSE_RTOL = 3e-5


def seed_from(*params) -> int:
    """A fixed seed derived from the test parameters (stable across runs and processes)."""
    return zlib.crc32(repr(params).encode()) & 0x7FFFFFFF


def visible_mask(batch: int, seqlen_q: int, seqlen_k: int, causal: bool = False,
                 causal_bottom_right: bool = True, leftpad_k: Optional[torch.Tensor] = None,
                 seqused_k: Optional[torch.Tensor] = None, device="cpu",
                 window_size=(-1, -1)) -> torch.Tensor:
    """Bool (batch, 1, seqlen_q, seqlen_k): True where query i may attend key j.

    ``window_size = (left, right)`` (flash-attn): key j only if ``i + off - left <= j <=
    i + off + right`` with ``off`` the causal alignment's offset; -1 = unbounded side; causal
    sets right to 0."""
    row = torch.arange(seqlen_q, device=device).view(1, seqlen_q, 1)
    col = torch.arange(seqlen_k, device=device).view(1, 1, seqlen_k)
    if leftpad_k is not None:
        start = leftpad_k.to(device=device, dtype=torch.int64).clamp(0, seqlen_k)
    else:
        start = torch.zeros(batch, dtype=torch.int64, device=device)
    if seqused_k is not None:
        end = torch.maximum(seqused_k.to(device=device, dtype=torch.int64), start).clamp(max=seqlen_k)
    else:
        end = torch.full((batch,), seqlen_k, dtype=torch.int64, device=device)
    vis = (col >= start.view(batch, 1, 1)) & (col < end.view(batch, 1, 1))
    offset = seqlen_k - seqlen_q if causal_bottom_right else 0
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        vis = vis & (col <= row + offset + right)
    if left >= 0:
        vis = vis & (col >= row + offset - left)
    return vis.unsqueeze(1)


def flash_attn_band(window, causal, seqlen_k):
    """The band flash-attn runs for ``window_size`` over ``seqlen_k`` keys (the cache's rows or
    max_seqlen_k), in the reference's terms (-1: no limit): its mha_fwd sets the right side to
    0 when causal and treats a side >= seqlen_k as -1; its set_params_fprop then gives an
    unlimited side the value seqlen_k when the other side is limited. A left side of seqlen_k
    hides nothing (kept -1); a right side of seqlen_k hides keys from row i when
    i + 2 seqlen_k - seqlen_q < seqlen_k - 1."""
    left, right = (max(w, -1) for w in window)
    if causal:
        right = 0
    left, right = (-1 if w >= seqlen_k else w for w in (left, right))
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def apply_score_mods(scores, softcap=0.0, alibi_slopes=None, causal_bottom_right=True):
    """flash-attn's score modifiers on scaled scores (B, H, Sq, Sk), in their dtype: ``softcap``
    > 0 maps s to softcap * tanh(s / softcap); ``alibi_slopes`` (H,) or (B, H) then subtract
    slope * |i + off - j| with off the causal alignment's offset (Sk - Sq bottom-right, 0
    top-left)."""
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        b, h, s_q, s_k = scores.shape
        off = s_k - s_q if causal_bottom_right else 0
        i = torch.arange(s_q, device=scores.device).view(s_q, 1)
        j = torch.arange(s_k, device=scores.device).view(1, s_k)
        dist = (i + off - j).abs().to(scores.dtype)
        slopes = alibi_slopes.to(device=scores.device, dtype=scores.dtype)
        scores = scores - slopes.reshape(-1 if slopes.dim() == 2 else 1, h, 1, 1) * dist
    return scores


def attention_ref(q, k, v, *, causal=False, causal_bottom_right=True, softmax_scale=None,
                  leftpad_k=None, seqused_k=None, layout="bshd", upcast=True, reorder_ops=False,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None):
    """Attention by the definition. Returns ``(out, lse)``.

    q: (B, Sq, H, D), k/v: (B, Sk, Hk, D) for ``layout="bshd"``; (B, H, S, D) for ``"bhsd"``.
    GQA: query head i uses kv head i // (H // Hk). ``upcast=True``: computed in float64, out and
    lse float64. ``upcast=False``: computed in the input dtype (``reorder_ops=True`` scales q
    before the matmul, as an fp16 implementation would), out in that dtype, lse float32.
    Rows that see no key: out 0, lse -inf. ``out`` is returned in the input layout.
    ``softcap`` / ``alibi_slopes``: :func:`apply_score_mods`. ``attn_bias``: a bool mask (True =
    attend) or an additive bias broadcasting to (B, H, Sq, Sk) (torch's ``attn_mask``), added
    after the modifiers; rows it hides entirely give out 0, lse -inf.
    """
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> (B, H, S, D)
    elif layout != "bhsd":
        raise ValueError(layout)
    b, h, s_q, d = q.shape
    h_k, s_k = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dtype = torch.float64 if upcast else q.dtype
    qh = q.to(dtype)
    kh = k.to(dtype).repeat_interleave(h // h_k, dim=1)
    vh = v.to(dtype).repeat_interleave(h // h_k, dim=1)
    if reorder_ops:
        scores = torch.matmul(qh * scale, kh.transpose(-1, -2))
    else:
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    scores = apply_score_mods(scores, softcap, alibi_slopes, causal_bottom_right)
    vis = visible_mask(b, s_q, s_k, causal, causal_bottom_right, leftpad_k, seqused_k, q.device,
                       window_size)
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            vis = vis & attn_bias.to(q.device)
        else:
            scores = scores + attn_bias.to(device=q.device, dtype=scores.dtype)
            vis = vis & (attn_bias.to(q.device) != float("-inf"))
    scores = scores.masked_fill(~vis, float("-inf"))
    if upcast:
        lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
        p = torch.exp(scores - lse.unsqueeze(-1))
    else:
        lse = torch.logsumexp(scores.float(), dim=-1)
        p = torch.softmax(scores, dim=-1)
    p = torch.where(vis, p, torch.zeros((), dtype=p.dtype, device=p.device))  # NaN rows -> 0
    out = torch.matmul(p, vh)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out, lse


def assert_out_exact(out, ref, what="out"):
    """fp16 ``out`` within one fp16 ulp of the float64 ``ref``: the op's CPU reference computes
    in float64 and rounds once, so its results (through any door) meet this."""
    assert out.dtype == torch.float16 and out.shape == ref.shape, (what, out.shape, ref.shape)
    err = (out.double() - ref).abs()
    tol = ref.abs() * 2.0**-10 + 2.0**-24
    assert bool((err <= tol).all()), f"{what}: max err {err.max().item():.3e}"


def assert_lse_exact(lse, ref, what="lse", atol=1e-7):
    """float32 ``lse`` within a float32 rounding (+ atol) of the float64 ``ref``, with the same
    ``-inf`` rows (rows that see no key)."""
    assert lse.dtype == torch.float32 and lse.shape == ref.shape, (what, lse.shape, ref.shape)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), f"{what}: -inf rows differ"
    fin = torch.isfinite(ref)
    err = (lse.double() - ref)[fin].abs()
    assert bool((err <= ref[fin].abs() * 2.0**-22 + atol).all()), f"{what}: {err.max():.3e}"


def varlen_attention_ref(q, k, v, cu_q, cu_k, causal, *, softmax_scale=None, window=(-1, -1),
                         softcap=0.0, alibi_slopes=None, seqused_k=None, upcast=True,
                         reorder_ops=False):
    """Packed (varlen) attention per sequence, flash-attn's per-sequence definition (bottom-right
    causal, window and ALiBi distances within each sequence): ``(out (total_q, H, D), lse (H,
    total_q))`` for the tokens ``cu_q[0]:cu_q[-1]``; a sequence without keys gives 0 and
    ``-inf``. ``alibi_slopes``: (H,) or (batch, H). ``seqused_k`` (batch,): only the first
    ``seqused_k[b]`` keys of sequence b exist (its length for the alignment too), as in
    flash-attn. ``upcast`` / ``reorder_ops``: as :func:`attention_ref` (float64 by default; the
    "PyTorch fp16" baseline with ``upcast=False, reorder_ops=True``)."""
    out_dtype = torch.float64 if upcast else q.dtype
    lse_dtype = torch.float64 if upcast else torch.float32
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].unsqueeze(0)
        k_end = int(cu_k[b + 1])
        if seqused_k is not None:
            k_end = min(k_end, int(cu_k[b]) + int(seqused_k[b]))
        ks, vs = k[cu_k[b]:k_end].unsqueeze(0), v[cu_k[b]:k_end].unsqueeze(0)
        if qs.shape[1] == 0:
            continue
        if ks.shape[1] == 0:  # no keys: zeros and -inf (attention_ref needs one key column)
            outs.append(torch.zeros(qs.shape[1:], dtype=out_dtype, device=q.device))
            lses.append(torch.full((qs.shape[2], qs.shape[1]), -math.inf, dtype=lse_dtype,
                                   device=q.device))
            continue
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        o, lse = attention_ref(qs, ks, vs, causal=causal, softmax_scale=softmax_scale,
                               window_size=window, softcap=softcap, alibi_slopes=slopes,
                               upcast=upcast, reorder_ops=reorder_ops)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:
        return (torch.zeros((0,) + tuple(q.shape[1:]), dtype=out_dtype, device=q.device),
                torch.zeros((q.shape[1], 0), dtype=lse_dtype, device=q.device))
    return torch.cat(outs), torch.cat(lses, dim=1)


def fa_atol(ref: torch.Tensor) -> float:
    """FA3's absolute floor: twice the fp16 rounding error of numbers of the reference's size."""
    ref16 = ref.detach().to(torch.float16)
    return 2.0 * ((ref16 + 0.3 - 0.3) - ref16).abs().max().item()


def assert_close_fa(out, ref, pt, name="out", atol=None):
    """Assert ``max|out - ref| <= 2 * max|pt - ref| + atol`` (FlashAttention's criterion).

    ``ref``: high-precision reference; ``pt``: the "PyTorch fp16" baseline. Prints the max and
    mean errors first (visible with ``pytest -s`` or on failure).
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: output contains NaN"
    assert torch.isfinite(out).all(), f"{name}: output contains inf"
    out64, ref64, pt64 = out.double(), ref.double(), pt.double()
    err = (out64 - ref64).abs()
    pt_err = (pt64 - ref64).abs()
    atol = fa_atol(ref64) if atol is None else atol
    bound = 2.0 * pt_err.max().item() + atol
    print(f"{name}: max err {err.max().item():.3e} mean {err.mean().item():.3e} | "
          f"pt fp16 max {pt_err.max().item():.3e} mean {pt_err.mean().item():.3e} | "
          f"atol {atol:.3e} bound {bound:.3e}")
    assert err.max().item() <= bound, (
        f"{name}: max error {err.max().item():.3e} > 2 * pt fp16 error "
        f"{pt_err.max().item():.3e} + atol {atol:.3e} (at index "
        f"{tuple(int(i) for i in torch.nonzero(err == err.max())[0])})")


def assert_lse_close(lse, lse_ref, name="lse", atol=LSE_ATOL, rtol=LSE_RTOL):
    """Assert float32 LSE matches the float64 one: same -inf rows, no NaN, close elsewhere."""
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}"
    assert lse.shape == lse_ref.shape, f"{name}: shape {tuple(lse.shape)} != {tuple(lse_ref.shape)}"
    assert not torch.isnan(lse).any(), f"{name}: contains NaN"
    ref_empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), ref_empty), (
        f"{name}: -inf rows differ ({int(torch.isneginf(lse).sum())} vs {int(ref_empty.sum())})")
    finite = ~ref_empty
    if not finite.any():
        print(f"{name}: every row is empty (-inf)")
        return
    assert torch.isfinite(lse[finite]).all(), f"{name}: inf where the reference is finite"
    diff = (lse.double() - lse_ref)[finite].abs()
    tol = atol + rtol * lse_ref[finite].abs()
    print(f"{name}: max err {diff.max().item():.3e} mean {diff.mean().item():.3e} "
          f"(tol {atol:.1e} + {rtol:.1e}*|lse|)")
    bad = diff > tol
    assert not bad.any(), (f"{name}: {int(bad.sum())} values off; worst {diff.max().item():.3e}")


@contextlib.contextmanager
def poisoned_cuda_memory(device=None, nbytes: int = 64 << 20):
    """Make memory that the op allocates inside this block start as NaN.

    The op allocates its own outputs with ``at::empty``, so a test cannot pre-fill them; a
    kernel that leaves some output elements unwritten would then return whatever the allocator
    handed out, often zeros from a previous test, and pass. Two layers make such garbage NaN:

    1. Poison the caching allocator: release the cached blocks, allocate a large-pool block and
       a few small-pool blocks, fill them with 0xFF bytes (NaN both as fp16 and as fp32) and free
       them; the allocator hands these cached blocks out for the next allocations.
    2. Turn on ``torch.use_deterministic_algorithms`` with
       ``torch.utils.deterministic.fill_uninitialized_memory`` (its default), under which
       ``empty`` on CUDA fills floating-point tensors with NaN, wherever the block comes from.

    A probe ``torch.empty`` inside the block is asserted to be NaN, so the poisoning itself is
    checked. Only call the op under test inside the block (deterministic mode can make other
    ops, e.g. cuBLAS ones, warn).
    """
    device = torch.device(device if device is not None else "cuda")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    big = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)
    small = [torch.empty(1 << 19, dtype=torch.uint8, device=device).fill_(0xFF) for _ in range(8)]
    del big, small
    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        probe = torch.empty(1024, dtype=torch.float16, device=device)
        assert torch.isnan(probe).all(), "poisoning CUDA memory did not work"
        del probe
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)


def cuda_kernels_run(fn, name_part: str) -> set:
    """Names of the CUDA kernels containing name_part that fn() launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if name_part in e.key}


def kernel_streams(fn) -> dict:
    """{kernel name: set of stream ids} of the CUDA kernels fn() launches (torch.profiler: a
    device event's device_resource_id is its stream)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    streams = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            streams.setdefault(e.name, set()).add(e.device_resource_id)
    return streams
