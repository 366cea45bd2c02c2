"""Sliding-window attention: flash-attn's ``window_size = (left, right)``.

Query ``i`` sees key ``j`` only if ``i + off - left <= j <= i + off + right`` (``off`` the
causal alignment's offset, ``seqlen_k - seqlen_q`` bottom-right; -1 = unbounded side; causal
sets ``right = 0``). The kernels run any window as one diagonal band on the masked
instantiations, skipping the key tiles outside it. Tested against an independent float64
definition (``reference.visible_mask``) with FlashAttention's criterion: the op (CPU reference
and CUDA kernels, forward, LSE, both backward modes, decode), the direct APIs and the rulebook.
"""
from __future__ import annotations

import pytest
import torch

import flash_attention_sm75 as fa
from reference import (assert_close_fa, assert_lse_close, attention_ref, poisoned_cuda_memory,
                       seed_from)
from test_backward import check_against_reference, cuda_only
from test_head_dims import make_case

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")
ops = torch.ops.flash_attention_sm75

# (left, right): narrower than a tile, spanning tiles, one-sided, the diagonal alone, and wider
# than every key (the same as no window).
WINDOWS = [(16, -1), (100, 0), (37, 45), (-1, 9), (0, 0), (300, 300), (5000, -1)]
CAUSAL_MODES = [(False, True), (True, True), (True, False)]  # (causal, bottom_right)
SEQLENS = [(203, 203), (113, 260), (260, 113)]


def _ref(q, k, v, causal, bottom_right, window, lp=None, su=None):
    kw = dict(causal=causal, causal_bottom_right=bottom_right, window_size=window,
              leftpad_k=lp, seqused_k=su)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    return out_ref, lse_ref, out_pt


def _check_forward(q, k, v, causal, bottom_right, window, lp=None, su=None):
    """The op on CUDA (outputs poisoned first) against the float64 definition."""
    with poisoned_cuda_memory():
        out, lse = ops.fwd(q, k, v, None, causal, bottom_right, lp, su, *window)
    out_ref, lse_ref, out_pt = _ref(q, k, v, causal, bottom_right, window, lp, su)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)


# ------------------------------------------------------------------------------------ CPU (CI)
@pytest.mark.parametrize("window", WINDOWS + [(3, 2), (0, -1)])
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("seqlens", [(9, 9), (5, 12), (12, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cpu_reference_op_applies_the_window(seqlens, causal, bottom_right, window):
    # The op's CPU implementation (csrc/flash_api.cpp, the band of band_diagonals) against the
    # independent definition, forward and backward.
    sq, sk = seqlens
    g = torch.Generator().manual_seed(seed_from(seqlens, causal, bottom_right, window))
    q, k, v, do = (torch.randn(2, s, h, 16, generator=g).half()
                   for s, h in ((sq, 4), (sk, 2), (sk, 2), (sq, 4)))
    out, lse = ops.fwd(q, k, v, None, causal, bottom_right, None, None, *window)
    out_ref, lse_ref, out_pt = _ref(q, k, v, causal, bottom_right, window)
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=True,
                            window_size=window)


def test_window_wider_than_the_keys_is_no_window():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 7, 2, 16, generator=g).half() for _ in range(3))
    for causal in (False, True):
        plain = ops.fwd(q, k, v, None, causal, True)
        wide = ops.fwd(q, k, v, None, causal, True, None, None, 7, 7)
        assert torch.equal(plain[0], wide[0]) and torch.equal(plain[1], wide[1])


@pytest.mark.parametrize("big", [2**63 - 1, 2**62, 2**40, 2**31 - 1])
@pytest.mark.parametrize("seqlens", [(5, 3), (3, 5), (4, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_huge_windows_are_no_window(seqlens, big):
    # sys.maxsize as "unbounded" (a Python caller's natural choice): the band's off - left and
    # off + right overflowed 64 bits in band_diagonals and every key was hidden (out 0, lse -inf).
    sq, sk = seqlens
    g = torch.Generator().manual_seed(sq * 10 + sk)
    q = torch.randn(2, sq, 2, 16, generator=g).half()
    k, v = (torch.randn(2, sk, 2, 16, generator=g).half() for _ in range(2))
    for causal in (False, True):
        plain = ops.fwd(q, k, v, None, causal, True)
        for window in ((big, -1), (-1, big), (big, big)):
            out, lse = ops.fwd(q, k, v, None, causal, True, None, None, *window)
            assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), (causal, window)
        out = fa.flash_attn_func(q, k, v, causal=causal, window_size=(big, big))
        assert torch.equal(out, plain[0])


def test_window_from_an_int_argument_under_torch_compile_fullgraph():
    # A second value of an int argument makes torch.compile retrace it as a SymInt (automatic
    # dynamic); the rulebook's identity test `window_size is not NO_WINDOW` could not be traced
    # then, and fullgraph=True raised on that call.
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 9, 4, 16, generator=g).half()
    k, v = (torch.randn(1, 13, 2, 16, generator=g).half() for _ in range(2))

    def attend(q, k, v, left):
        return fa.flash_attn_func(q, k, v, causal=True, window_size=(left, 0))

    def attend_bhsd(q, k, v, left):
        return fa.flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), window_size=[left, 1])

    for fn in (attend, attend_bhsd):
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        for left in (1, 2, 5):
            assert torch.equal(compiled(q, k, v, left), fn(q, k, v, left)), (fn.__name__, left)


@pytest.mark.parametrize("window,msg", [((-2, -1), "window_size_left must be -1"),
                                        ((0, -3), "window_size_right must be -1")])
def test_op_rejects_bad_windows_naming_the_side(window, msg):
    q = torch.randn(1, 4, 2, 16).half()
    with pytest.raises(ValueError, match=msg):
        ops.fwd(q, q, q, None, False, True, None, None, *window)
    with pytest.raises(ValueError, match=msg):
        ops.bwd(q, q, q, q, q, torch.zeros(1, 2, 4), 0.25, False, True, None, None, True, None,
                *window)


@pytest.mark.parametrize("window", [(1, 2, 3), "ab", (1.5, 0), (True, 0), 4, None])
def test_direct_apis_reject_malformed_windows(window):
    q = torch.randn(1, 4, 2, 16).half()
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attn_func(q, q, q, window_size=window)
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attention_forward(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2),
                                   window_size=window)


def test_direct_apis_on_cpu_match_the_definition():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 10, 2, 16, generator=g).half() for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    out_ref, _, out_pt = _ref(q, k, v, True, True, (3, 0))
    assert_close_fa(out, out_ref, out_pt)
    out_bhsd = fa.flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), window_size=(2, 4))
    out_ref, _, out_pt = _ref(q, k, v, False, True, (2, 4))
    assert_close_fa(out_bhsd.transpose(1, 2), out_ref, out_pt)


# ------------------------------------------------------------------------------------------ GPU
@cuda_only
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("d", [40, 64, 96, 128, 256])
def test_forward_and_lse(d, causal, bottom_right, seqlens, window):
    sq, sk = seqlens
    q, k, v, _ = make_case(2, sq, sk, 6, 2, d)  # rows NaN past d
    _check_forward(q, k, v, causal, bottom_right, window)


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("window", [(16, -1), (37, 45), (-1, 9), (0, 0)], ids=str)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=["full", "causal_br", "causal_tl"])
@pytest.mark.parametrize("d", [40, 64, 96, 128, 256])
def test_backward(d, causal, bottom_right, seqlens, window, deterministic):
    sq, sk = seqlens
    q, k, v, do = make_case(2, sq, sk, 6, 2, d)
    check_against_reference(q, k, v, do, causal, bottom_right, deterministic=deterministic,
                            window_size=window)


@cuda_only
@pytest.mark.parametrize("window", [(100, 0), (37, 45), (0, 0), (-1, 3)], ids=str)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_window_with_key_ranges_forward_and_backward(d, window):
    b, sq, sk = 3, 150, 400
    q, k, v, do = make_case(b, sq, sk, 4, 2, d)
    lp = torch.tensor([0, 37, 200], dtype=torch.int32, device="cuda")
    su = torch.tensor([400, 301, 230], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        _check_forward(q, k, v, causal, True, window, lp, su)
        check_against_reference(q, k, v, do, causal, True, lp, su, deterministic=True,
                                window_size=window)


@cuda_only
@pytest.mark.parametrize("window", [(0, 0), (255, 0), (1000, -1), (-1, 0)], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_decode_kernel_applies_the_window(d, window):
    # q_len = 1 runs the split-KV decode kernel (several splits at 3000 keys), GQA 4.
    b, h_k, sk = 2, 2, 3000
    q, k, v, _ = make_case(b, 1, sk, 4 * h_k, h_k, d)
    su = torch.tensor([3000, 1700], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        _check_forward(q, k, v, causal, True, window, None, su)


@cuda_only
def test_flash_attn_func_window_with_autograd():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 300, 4, 64, generator=g).half().cuda().requires_grad_()
               for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(64, -1))
    do = torch.randn_like(out)
    out.backward(do)
    out_ref, _, out_pt = _ref(q.detach(), k.detach(), v.detach(), True, True, (64, 0))
    assert_close_fa(out.detach(), out_ref, out_pt)
    dq, dk, dv = check_against_reference(q.detach(), k.detach(), v.detach(), do, True, True,
                                         deterministic=True, window_size=(64, 0))
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert torch.equal(got, want), name  # the default backward is deterministic


@cuda_only
def test_window_tiles_outside_are_skipped():
    # The cost follows the window: at 8192 keys a 256-key window must take a fraction of the
    # causal time (tile pruning; the masked kernels would otherwise visit every key tile: 32 of
    # ~32-64 key tiles per query tile, against 2-3). Best of several alternating trials, so that
    # other processes sharing the GPU (pytest-xdist) do not decide the ratio.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 8, 128, generator=g).half().cuda() for _ in range(3))

    def timed(window):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            ops.fwd(q, k, v, None, True, True, None, None, *window)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    for window in ((-1, -1), (255, 0)):
        timed(window)  # warm-up
    full, windowed = float("inf"), float("inf")
    for _ in range(5):
        full = min(full, timed((-1, -1)))
        windowed = min(windowed, timed((255, 0)))
    assert windowed < 0.25 * full, (windowed, full)
