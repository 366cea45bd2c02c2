"""The varlen op (``torch.ops.flash_attention_sm75.varlen_fwd`` / ``varlen_bwd``) and its doors.

flash-attn's packed layout: q ``(total_q, h, d)``, k/v ``(total_k, h_k, d)``, sequence ``b`` the
rows ``cu_seqlens[b]:cu_seqlens[b + 1]``; out ``(total_q, h, d)``, the LSE ``(h, total_q)``.

CPU (run in CI; the op's CPU implementation computes in float64 and rounds once, so outputs are
checked within one fp16 ulp of a per-sequence float64 reference, the LSE within float32
rounding, ``-inf`` rows identical):

* the schemas; the CPU op against ``varlen_attention_ref`` for empty and one-token sequences,
  unequal q/k lengths, causal (bottom-right per sequence), windows, softcap, ALiBi ((h,) and
  (batch, h)) and all of them together, MHA/GQA/MQA; ``seqused_k``; tokens in no sequence;
  the packed LSE against the padded op's per sequence; zero sizes;
* the fakes (shapes, dtypes, strides, devices; ``opcheck``), ``torch.compile(fullgraph=True)``
  of ``flash_attn_varlen_func`` with every score modifier, forward and backward (the
  ``deterministic`` request surviving compilation: tests/test_flash_attn_dropin.py);
* autograd: dq, dk, dv and the gradient through the LSE against float64; the fast path below
  autograd; errors before the op (forward-mode AD, slopes that require grad);
* validation: the op's ``ValueError`` naming the argument, the door's device-side checks;
* the HF integration: ``cu_seq_lens`` and restarting ``position_ids`` run on the varlen op
  (one call), its offsets from ``position_ids``, the fallbacks that remain, and a
  ``DataCollatorWithFlattening`` training step of tiny Llama / Qwen2 models against stock
  per-document attention.

GPU (``@pytest.mark.gpu``, skipped without CUDA): random lengths with empty and one-token
sequences, every score modifier, GQA, head dims, poisoned outputs, the packed LSE; the backward
(dq, dk, dv, the gradient through the LSE) under FlashAttention's criterion (our max error <= 2x
PyTorch's fp16 error + a tiny atol, tests/reference.py); a deterministic backward bitwise
reproducible; the HF training step on the GPU.
"""
import copy
import re
from typing import NamedTuple, Optional

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flash_attention_sm75 import _ops, fa2
from reference import (assert_close_fa, assert_lse_close, assert_lse_exact, assert_out_exact,
                       flash_attn_band, poisoned_cuda_memory, seed_from, varlen_attention_ref)

pytestmark = pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {_ops.EXTENSION_ERROR}")

F16 = torch.float16
I32 = torch.int32

FWD_SCHEMA = (
    "flash_attention_sm75::varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale=None, "
    "bool is_causal=False, Tensor? seqused_k=None, int window_size_left=-1, "
    "int window_size_right=-1, float softcap=0., Tensor? alibi_slopes=None) "
    "-> (Tensor out, Tensor softmax_lse)")
BWD_SCHEMA = (
    "flash_attention_sm75::varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor softmax_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float softmax_scale, bool is_causal, Tensor? seqused_k=None, "
    "bool deterministic=False, Tensor? grad_softmax_lse=None, int window_size_left=-1, "
    "int window_size_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
    "float dropout_p=0., Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)")
# varlen_fwd's with dropout_p and rng_state in flash-attn's varlen position (after max_seqlen_k)
DROPOUT_SCHEMA = FWD_SCHEMA.replace("::varlen_fwd(", "::varlen_fwd_dropout(").replace(
    "SymInt max_seqlen_k, ", "SymInt max_seqlen_k, float dropout_p, Tensor rng_state, ")


def _varlen_fwd():
    return torch.ops.flash_attention_sm75.varlen_fwd


def _varlen_bwd():
    return torch.ops.flash_attention_sm75.varlen_bwd


def _cu(lengths, device="cpu", start=0):
    offsets = [start]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=I32, device=device)


def _case(lens_q, lens_k, h, h_k, d, seed, device="cpu", grad=False, extra_q=0, extra_k=0):
    """Packed q, k, v for these lengths (``extra_*`` tokens in no sequence at the end)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + extra_q, sum(lens_k) + extra_k
    q = torch.randn(tq, h, d, generator=g).to(device=device, dtype=F16)
    k = torch.randn(tk, h_k, d, generator=g).to(device=device, dtype=F16)
    v = torch.randn(tk, h_k, d, generator=g).to(device=device, dtype=F16)
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v, _cu(lens_q, device), _cu(lens_k, device)


def _slopes(kind, batch, h, device="cpu"):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(batch * 31 + h)
    shape = (h,) if kind == "heads" else (batch, h)
    return (torch.rand(shape, generator=g) * 0.5 + 0.05).to(device)


def _max(lengths):
    return max(lengths, default=0)


def assert_grad_close(g, ref, what):
    """The CPU bound of tests/test_flash_attn_dropin.py: 1e-2 of the largest reference gradient
    (at least 1e-2)."""
    assert g.shape == ref.shape, (what, g.shape, ref.shape)
    assert not torch.isnan(g).any(), what
    bound = 1e-2 * max(1.0, ref.abs().max().item())
    err = (g.double() - ref).abs().max().item()
    assert err <= bound, f"{what}: max err {err:.3e} > {bound:.3e}"


# empty and one-token sequences, q longer and shorter than k, a batch of one, no keys at all
LENGTHS = [
    ([3, 0, 1, 5, 2, 4], [4, 2, 0, 5, 7, 1]),
    ([1, 1, 1], [6, 0, 3]),
    ([9], [4]),
    ([0, 6, 2], [0, 6, 11]),
    ([4, 3], [0, 0]),
]
# (window, softcap, alibi kind): flash-attn's score modifiers, alone and together
MODS = {
    "plain": ((-1, -1), 0.0, None),
    "window": ((2, 1), 0.0, None),
    "window-left": ((3, -1), 0.0, None),
    "softcap": ((-1, -1), 1.5, None),
    "alibi": ((-1, -1), 0.0, "heads"),
    "alibi-batch": ((-1, -1), 0.0, "batch"),
    "all": ((2, 3), 2.0, "batch"),
}


def test_varlen_ops_are_built():
    # Fails (rather than skips) when the extension lacks the varlen ops: the doors need them.
    assert _ops.VARLEN_AVAILABLE, "torch.ops.flash_attention_sm75.varlen_fwd is missing"


def test_schemas():
    assert str(_varlen_fwd().default._schema) == FWD_SCHEMA
    assert str(_varlen_bwd().default._schema) == BWD_SCHEMA
    twin = torch.ops.flash_attention_sm75.varlen_fwd_deterministic_bwd.default._schema
    assert str(twin) == FWD_SCHEMA.replace("::varlen_fwd(", "::varlen_fwd_deterministic_bwd(")
    drop = torch.ops.flash_attention_sm75.varlen_fwd_dropout.default._schema
    assert str(drop) == DROPOUT_SCHEMA


# ------------------------------------------------------------------------------- the CPU op
@pytest.mark.parametrize("mods", sorted(MODS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,h_k,d", [(4, 2, 32), (3, 1, 24), (2, 2, 64)])
@pytest.mark.parametrize("lens", LENGTHS, ids=[f"L{i}" for i in range(len(LENGTHS))])
def test_cpu_op_matches_the_per_sequence_reference(lens, h, h_k, d, causal, mods):
    lens_q, lens_k = lens
    window, cap, alibi = MODS[mods]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, h, h_k, d, seed_from(lens, h, d, causal, mods))
    slopes = _slopes(alibi, len(lens_q), h)
    scale = 0.3 if mods == "softcap" else None
    out, lse = _varlen_fwd()(q, k, v, cu_q, cu_k, _max(lens_q), _max(lens_k), scale, causal,
                             None, *window, cap, slopes)
    assert out.shape == q.shape and out.dtype == F16 and out.is_contiguous()
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, causal, softmax_scale=scale,
                                        window=window, softcap=cap, alibi_slopes=slopes)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)
    # the door: one call of the same op with the window as flash-attn reads it (over
    # max_seqlen_k keys), flash-attn's return values
    def op(max_k):
        return _varlen_fwd()(q, k, v, cu_q, cu_k, _max(lens_q), max_k, scale, causal, None,
                             *flash_attn_band(window, causal, max_k), cap, slopes)

    o, l, s = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, _max(lens_q), _max(lens_k),
                                         softmax_scale=scale, causal=causal, window_size=window,
                                         softcap=cap, alibi_slopes=slopes,
                                         return_attn_probs=True)
    want, want_lse = op(_max(lens_k))
    assert torch.equal(o, want) and torch.equal(l, want_lse) and s.numel() == 0
    # a larger max_seqlen than needed changes only what flash-attn's reading of the window
    # derives from max_seqlen_k
    o2 = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, _max(lens_q) + 3, _max(lens_k) + 5,
                                    softmax_scale=scale, causal=causal, window_size=window,
                                    softcap=cap, alibi_slopes=slopes)
    assert torch.equal(o2, op(_max(lens_k) + 5)[0])
    if flash_attn_band(window, causal, _max(lens_k)) == (window[0], 0 if causal else window[1]):
        assert torch.equal(o, out)


def test_the_packed_lse_is_the_padded_ops_per_sequence():
    # Layout: (h, total_q), sequence b's columns cu_q[b]:cu_q[b+1]; the padded op on the one
    # sequence gives (1, h, len_q): the same numbers (both round float64 once).
    lens_q, lens_k = [5, 1, 7, 3], [5, 9, 2, 3]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 4, 2, 32, 41)
    out, lse = _varlen_fwd()(q, k, v, cu_q, cu_k, 7, 9, None, True)
    for b in range(4):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        o, l = torch.ops.flash_attention_sm75.fwd(q[None, q0:q1], k[None, k0:k1],
                                                  v[None, k0:k1], None, True, True)
        assert torch.equal(out[q0:q1], o[0]) and torch.equal(lse[:, q0:q1], l[0]), b


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("alibi", [None, "batch"])
def test_seqused_k_attends_the_first_keys_of_each_sequence(causal, alibi):
    # flash-attn's seqused_k: sequence b has seqused_k[b] keys (also for the bottom-right
    # alignment of the causal diagonal and the ALiBi distance); its other keys are not read.
    lens_q, lens_k = [3, 4, 1, 2], [6, 4, 5, 3]
    used = torch.tensor([2, 4, 0, 3], dtype=I32)
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 4, 2, 32, 43)
    slopes = _slopes(alibi, 4, 4)
    out, lse = _varlen_fwd()(q, k, v, cu_q, cu_k, 4, 6, None, causal, used, -1, -1, 0.0, slopes)
    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, causal, alibi_slopes=slopes,
                                        seqused_k=used)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)
    # keys past seqused_k are not read: NaN there changes nothing
    k2, v2 = k.clone(), v.clone()
    for b in range(4):
        k2[int(cu_k[b]) + int(used[b]):int(cu_k[b + 1])] = float("nan")
        v2[int(cu_k[b]) + int(used[b]):int(cu_k[b + 1])] = float("nan")
    out2, lse2 = _varlen_fwd()(q, k2, v2, cu_q, cu_k, 4, 6, None, causal, used, -1, -1, 0.0,
                               slopes)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_tokens_in_no_sequence_get_zero_and_minus_inf_and_no_gradient():
    lens_q, lens_k = [3, 0, 4], [2, 5, 4]
    q, k, v, _, _ = _case(lens_q, lens_k, 2, 2, 16, 44, grad=True, extra_q=5, extra_k=4)
    cu_q, cu_k = _cu(lens_q, start=2), _cu(lens_k, start=1)  # rows before and after: none
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True,
                                             return_attn_probs=True)
    outside_q = [0, 1, 9, 10, 11]
    assert (out[outside_q] == 0).all() and torch.isneginf(lse[:, outside_q]).all()
    ref, ref_lse = varlen_attention_ref(q.detach(), k.detach(), v.detach(), cu_q, cu_k, True)
    assert_out_exact(out[2:9], ref)
    assert_lse_exact(lse[:, 2:9], ref_lse)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq[outside_q] == 0).all()
    assert (dk[[0, 12, 13, 14]] == 0).all() and (dv[[0, 12, 13, 14]] == 0).all()
    assert dk[1:12].abs().max() > 0


def test_zero_sizes():
    h, d = 2, 16
    empty = torch.zeros(0, h, d, dtype=F16)
    for cu in (torch.zeros(1, dtype=I32), torch.zeros(3, dtype=I32)):
        out, lse = _varlen_fwd()(empty, empty, empty, cu, cu, 0, 0)
        assert out.shape == (0, h, d) and lse.shape == (h, 0)
        out, lse, _ = fa2.flash_attn_varlen_func(empty, empty, empty, cu, cu, 0, 0,
                                                 return_attn_probs=True)
        assert out.shape == (0, h, d) and lse.shape == (h, 0)
    # queries, no keys at all: zeros and -inf, zero gradients
    q = torch.randn(5, h, d, dtype=F16, requires_grad=True)
    kv = torch.zeros(0, 1, d, dtype=F16, requires_grad=True)
    out, lse, _ = fa2.flash_attn_varlen_func(q, kv, kv, _cu([2, 3]), _cu([0, 0]), 3, 0,
                                             causal=True, return_attn_probs=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert (dq == 0).all()


def test_head_dims_not_a_multiple_of_8_are_padded_by_the_door():
    lens_q, lens_k = [3, 5], [4, 5]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 4, 2, 20, 45, grad=True)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    assert out.shape == (8, 4, 20)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = varlen_attention_ref(q64, k64, v64, cu_q, cu_k, True)
    assert_out_exact(out, ref.detach())
    g = torch.randn_like(out)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g),
                          torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert_grad_close(a, b, "d" + name)


def test_alibi_and_paged_keys_run_as_one_call_of_the_varlen_op(varlen_op_calls, op_calls):
    # Before the varlen op: one padded-op call per sequence after a host read of the lengths.
    lens_q, lens_k = [3, 0, 4, 2], [5, 2, 4, 6]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 4, 2, 16, 46)
    slopes = _slopes("batch", 4, 4)
    fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, causal=True, alibi_slopes=slopes)
    assert len(varlen_op_calls) == 1 and op_calls == []
    # paged keys (block_table) too: pages gathered, each sequence's length as seqused_k
    kp, vp = k.new_zeros(4, 8, 2, 16), v.new_zeros(4, 8, 2, 16)
    table = torch.tensor([[2], [0], [3], [1]], dtype=I32)
    for b in range(4):
        n = lens_k[b]
        kp[table[b, 0], :n], vp[table[b, 0], :n] = k[cu_k[b]:cu_k[b] + n], v[cu_k[b]:cu_k[b] + n]
    out = fa2.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 6, causal=True,
                                     alibi_slopes=slopes, block_table=table)
    assert len(varlen_op_calls) == 2 and op_calls == []
    assert varlen_op_calls[1][9].tolist() == lens_k  # seqused_k
    ref, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, True, alibi_slopes=slopes)
    assert_out_exact(out, ref)


# ------------------------------------------------------------------------------- autograd
BACKWARD_CASES = {
    "causal-gqa": (True, (-1, -1), 0.0, None, (4, 2)),
    "bidirectional-mqa": (False, (-1, -1), 0.0, None, (4, 1)),
    "softcap": (False, (-1, -1), 1.5, None, (2, 2)),
    "all-mods": (True, (3, 0), 2.0, "batch", (4, 2)),
    "window-alibi": (False, (2, 2), 0.0, "heads", (2, 1)),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
def test_backward_matches_float64_with_the_gradient_of_the_lse(case):
    causal, window, cap, alibi, (h, h_k) = BACKWARD_CASES[case]
    lens_q, lens_k = [3, 0, 1, 5, 2], [4, 2, 0, 5, 7]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, h, h_k, 32, seed_from("bwd", case), grad=True)
    slopes = _slopes(alibi, 5, h)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=causal,
                                             window_size=window, softcap=cap,
                                             alibi_slopes=slopes, return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, ref_lse = varlen_attention_ref(q64, k64, v64, cu_q, cu_k, causal, window=window,
                                        softcap=cap, alibi_slopes=slopes)
    g = torch.randn_like(out)
    g_lse = torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0.0)
    for with_lse in (False, True):
        outs, refs = (out, lse), (ref, ref_lse)
        gs, gs64 = (g, g_lse), (g.double(), g_lse.double())
        if not with_lse:
            outs, refs, gs, gs64 = outs[:1], refs[:1], gs[:1], gs64[:1]
        grads = torch.autograd.grad(outs, (q, k, v), gs, retain_graph=True)
        want = torch.autograd.grad(refs, (q64, k64, v64), gs64, retain_graph=True,
                                   allow_unused=True)
        for name, a, b in zip("qkv", grads, want):
            b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
            assert_grad_close(a, b, f"d{name} (lse: {with_lse})")
    # the keys of the empty-query sequence (1) get exactly zero gradient
    dk = torch.autograd.grad(out, k, g)[0]
    assert (dk[4:6] == 0).all()


def test_lse_gradient_alone():
    # A loss of the LSE only (grad_out None): the formula passes zeros for dout.
    q, k, v, cu_q, cu_k = _case([3, 4], [5, 2], 2, 2, 16, 47, grad=True)
    _, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, return_attn_probs=True)
    grads = torch.autograd.grad(lse.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    _, ref_lse = varlen_attention_ref(q64, k64, v64, cu_q, cu_k, False)
    want = torch.autograd.grad(ref_lse.sum(), (q64, k64, v64), allow_unused=True)
    for name, a, b in zip("qkv", grads, want):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        assert_grad_close(a, b, "d" + name)


def test_packed_forms_give_the_gradients_of_the_unpacked_call():
    lens = [4, 1, 6]
    cu = _cu(lens)
    g = torch.Generator().manual_seed(48)
    qkv = torch.randn(11, 3, 4, 32, generator=g).to(F16).requires_grad_(True)
    out = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, causal=True)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(1))
    ref = fa2.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    assert torch.equal(out, ref)
    go = torch.randn_like(out)
    out.backward(go)
    ref.backward(go)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 1))


@pytest.fixture
def below_autograd(monkeypatch):
    """For every call of varlen_fwd: True if it was dispatched below the autograd layer."""
    seen = []
    real = torch.ops.flash_attention_sm75.varlen_fwd
    key = torch._C.DispatchKey.AutogradFunctionality
    monkeypatch.setattr(torch.ops.flash_attention_sm75, "varlen_fwd",
                        lambda *a: seen.append(
                            torch._C._dispatch_tls_is_dispatch_key_excluded(key)) or real(*a))
    return seen


def test_fast_path_below_autograd_only_when_no_gradient_can_flow(below_autograd):
    q, k, v, cu_q, cu_k = _case([3, 4], [3, 4], 2, 2, 16, 49)
    ref = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, causal=True)
    q.requires_grad_(True)
    with torch.no_grad():
        fast = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, causal=True)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, causal=True)
    # With a gradient to flow, the op runs below autograd inside the eager autograd function
    # (_ops._eager_function), whose gradient must be the registered formula's.
    assert below_autograd == [True, True, True]
    assert torch.equal(fast, ref) and torch.equal(out, ref)
    assert fast.grad_fn is None and out.grad_fn is not None
    g = torch.randn_like(out)
    want = torch.autograd.grad(torch.ops.flash_attention_sm75.varlen_fwd(
        q, k, v, cu_q, cu_k, 4, 4, None, True)[0], q, g)[0]
    got = torch.autograd.grad(out, q, g)[0]
    assert got.abs().max() > 0 and torch.equal(got, want)


def test_errors_before_the_op(below_autograd):
    import torch.autograd.forward_ad as fwAD

    q, k, v, cu_q, cu_k = _case([3, 4], [3, 4], 4, 2, 16, 50)
    with pytest.raises(ValueError, match="alibi_slopes must not require grad"):
        fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4,
                                   alibi_slopes=torch.ones(4, requires_grad=True))
    with pytest.raises(NotImplementedError, match="forward-mode AD"), fwAD.dual_level():
        fa2.flash_attn_varlen_func(q, fwAD.make_dual(k, torch.ones_like(k)), v, cu_q, cu_k, 4, 4)
    with pytest.raises(NotImplementedError, match="torch.func reverse-mode transforms"):
        torch.func.grad(lambda v_: fa2.flash_attn_varlen_func(
            q, k, v_, cu_q, cu_k, 4, 4).float().sum())(v)
    assert below_autograd == []
    # shapes in the caller's packed layout, not the 4-D views the rulebook checks
    with pytest.raises(ValueError, match=re.escape("got k [7, 2, 16] and v [7, 2, 8] (a value "
                                                   "head_dim different")):
        fa2.flash_attn_varlen_func(q, k, v[..., :8], cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match=re.escape("got k [7, 2, 16] and v [7, 1, 16]")):
        fa2.flash_attn_varlen_func(q, k, v[:, :1], cu_q, cu_k, 4, 4)
    # the raw op refuses a slope gradient rather than return a silent zero
    slopes = torch.ones(4, requires_grad=True)
    out, _ = _varlen_fwd()(q.requires_grad_(True), k, v, cu_q, cu_k, 4, 4, None, False, None, -1,
                           -1, 0.0, slopes)
    with pytest.raises(NotImplementedError, match="no gradient for alibi_slopes"):
        out.float().sum().backward()


def test_double_backward_raises():
    q, k, v, cu_q, cu_k = _case([3, 4], [3, 4], 2, 2, 16, 51, grad=True)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4)
    (dq,) = torch.autograd.grad(out.float().sum(), (q,), create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.float().sum().backward()


# ------------------------------------------------------------------------------- fakes
def _fake_inputs(device, total_q=11, total_k=13, h=4, h_k=2, d=64, batch=3, transposed=False):
    q = torch.empty(total_q, h, d, dtype=F16, device=device)
    if transposed:  # any strides with a contiguous last dim
        q = torch.empty(h, total_q, d, dtype=F16, device=device).transpose(0, 1)
    k = torch.empty(total_k, h_k, d, dtype=F16, device=device)
    v = torch.empty(total_k, h_k, d, dtype=F16, device=device)
    cu = torch.zeros(batch + 1, dtype=I32, device=device)
    return q, k, v, cu


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("transposed", [False, True])
def test_fake_shapes_dtypes_strides(device, transposed):
    # Fake CUDA tensors need no GPU.
    with FakeTensorMode():
        q, k, v, cu = _fake_inputs(device, transposed=transposed)
        out, lse = _varlen_fwd()(q, k, v, cu, cu, 5, 6, None, True)
        dq, dk, dv = _varlen_bwd()(out, q, k, v, out, lse, cu, cu, 5, 6, 0.125, True)
        twin = torch.ops.flash_attention_sm75.varlen_fwd_deterministic_bwd(q, k, v, cu, cu, 5, 6)
    assert out.shape == (11, 4, 64) and out.dtype == F16 and out.is_contiguous()
    assert lse.shape == (4, 11) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert dq.shape == (11, 4, 64) and dk.shape == dv.shape == (13, 2, 64)
    assert all(t.is_contiguous() and t.dtype == F16 for t in (dq, dk, dv))
    assert all(t.device.type == device for t in (out, lse, dq, dk, dv))
    assert twin[0].shape == out.shape and twin[1].shape == lse.shape


def test_fake_matches_real_cpu_metadata():
    lens_q, lens_k = [3, 0, 4], [5, 2, 4]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 4, 2, 32, 52)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # strided
    real = _varlen_fwd()(q, k, v, cu_q, cu_k, 4, 5, None, True)
    real_b = _varlen_bwd()(real[0], q, k, v, real[0], real[1], cu_q, cu_k, 4, 5, 0.2, True)
    mode = FakeTensorMode()
    fake_in = [mode.from_tensor(t) for t in (q, k, v, cu_q, cu_k, real[0], real[1])]
    with mode:
        fq, fk, fv, fcq, fck, fo, fl = fake_in
        fake = _varlen_fwd()(fq, fk, fv, fcq, fck, 4, 5, None, True)
        fake_b = _varlen_bwd()(fo, fq, fk, fv, fo, fl, fcq, fck, 4, 5, 0.2, True)
    for r, f in zip(real + real_b, fake + fake_b):
        assert (r.shape, r.dtype, r.stride(), r.device) == (f.shape, f.dtype, f.stride(), f.device)


def test_meta_tensors_and_the_fakes_checks():
    q, k, v, cu = (t.to("meta") for t in _fake_inputs("cpu"))
    out, lse = _varlen_fwd()(q, k, v, cu, cu, 5, 6)
    assert out.device.type == "meta" and out.shape == (11, 4, 64) and lse.shape == (4, 11)
    for bad in ((q[None], k, v, cu, cu), (q, k, v[:5], cu, cu), (q, k[..., :32], v[..., :32], cu, cu),
                (q, k, v, cu, cu[:2])):
        with pytest.raises(RuntimeError, match="^flash_attention_sm75: "):
            _varlen_fwd()(*bad, 5, 6)


@pytest.mark.parametrize("name", ["k", "cu_seqlens_k", "seqused_k"])
def test_a_meta_tensor_among_real_ones_raises_instead_of_returning_garbage(name):
    q, k, v, cu_q, cu_k = _case([3, 4], [3, 4], 2, 2, 64, 53)
    args = {"k": k, "cu_seqlens_k": cu_k, "seqused_k": torch.tensor([3, 4], dtype=I32)}
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} must be on the same device as q"):
        _varlen_fwd()(q, args["k"], v, cu_q, args["cu_seqlens_k"], 4, 4, None, False,
                      args["seqused_k"])


OPCHECK_CASES = {
    "causal-gqa": ([3, 0, 4], [5, 2, 4], (4, 2), dict(is_causal=True)),
    "mods": ([2, 5], [6, 3], (2, 1), dict(is_causal=True, window_size_left=2, softcap=1.5,
                                          softmax_scale=0.3)),
    "alibi": ([4, 1], [2, 5], (2, 2), dict(alibi_slopes=torch.tensor([0.25, 0.5]))),
    "seqused": ([2, 3], [4, 5], (2, 2), dict(seqused_k=torch.tensor([3, 1], dtype=I32))),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case):
    lens_q, lens_k, (h, h_k), kwargs = OPCHECK_CASES[case]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, h, h_k, 32, seed_from("opcheck", case))
    result = torch.library.opcheck(_varlen_fwd().default,
                                   (q, k, v, cu_q, cu_k, _max(lens_q), _max(lens_k)), kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------------- compile
def _ops_in(graphs) -> set:
    """Names of the flash_attention_sm75 ops that FX graphs call (an OpOverloadPacket prints
    as ``flash_attention_sm75.<op>``, an OpOverload as ``flash_attention_sm75.<op>.default``)."""
    names = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            parts = str(node.target).split(".")
            if node.op == "call_function" and parts[0] == "flash_attention_sm75":
                names.add(parts[1])
    return names


def test_compile_fullgraph_forward_and_backward_with_every_modifier():
    torch._dynamo.reset()
    lens_q, lens_k = [3, 0, 4, 1], [5, 2, 4, 3]
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 4, 2, 16, 54, grad=True)
    slopes = _slopes("batch", 4, 4)
    kw = dict(causal=True, window_size=(2, 0), softcap=1.5, alibi_slopes=slopes,
              return_attn_probs=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fa2.flash_attn_varlen_func, fullgraph=True, backend=backend)
    out, lse, _ = compiled(q, k, v, cu_q, cu_k, 4, 5, **kw)
    ref, ref_lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    ops = _ops_in(graphs)
    assert "varlen_fwd" in ops and "fwd" not in ops  # one varlen call, no padded detour
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out, lse.masked_fill(torch.isneginf(lse), 0).sum()), (q, k, v),
                                (g, None))
    want = torch.autograd.grad((ref, ref_lse.masked_fill(torch.isneginf(ref_lse), 0).sum()),
                               (q, k, v), (g, None))
    for a, b in zip(grads, want):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="no sequence longer than the max_seqlen passed"):
        compiled(q, k, v, cu_q, cu_k, 3, 5, **kw)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_backends(backend):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _case([3, 0, 4], [5, 2, 4], 4, 2, 32, 55, grad=True)
    f = torch.compile(lambda *a: fa2.flash_attn_varlen_func(*a, causal=True), fullgraph=True,
                      backend=backend)
    out = f(q, k, v, cu_q, cu_k, 4, 5)
    ref = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert torch.equal(a, b)


def test_compile_dynamic_one_graph_for_every_packed_size():
    # Packed training changes the token count and the longest document every batch: with
    # dynamic shapes one graph must serve them all (formatting the sizes into the device
    # check's message, int() of max_seqlen for the backward, or an `int` schema specialised
    # each one: a recompilation per batch, an error at the recompile limit under fullgraph).
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()

    def f(q, k, v, cu, max_seqlen):
        return fa2.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in range(torch._dynamo.config.recompile_limit + 2):
        lens = [3 + n, 5, 2 + 2 * n]
        q, k, v, cu, _ = _case(lens, lens, 4, 2, 32, 70 + n, grad=True)
        out = compiled(q, k, v, cu, max(lens))
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref = f(q, k, v, cu, max(lens))
        assert torch.equal(out, ref)
        for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
            assert torch.equal(a, b)
    assert counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------------------- validation
def _bad_op_call(name):
    q, k, v, cu_q, cu_k = _case([3, 4], [3, 4], 4, 2, 64, 57)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=None,
                alibi_slopes=None)
    if name == "q":
        args["q"] = q.float()
    elif name == "k":
        args["k"] = k[:, :, :32]
    elif name == "v":
        args["v"] = v[:6]
    elif name == "cu_seqlens_q":
        args["cu_seqlens_q"] = cu_q.long()
    elif name == "cu_seqlens_k":
        args["cu_seqlens_k"] = cu_k[:2]
    elif name == "seqused_k":
        args["seqused_k"] = torch.tensor([1, 2], dtype=torch.int64)
    elif name == "alibi_slopes":
        args["alibi_slopes"] = torch.ones(3)
    elif name == "num_heads":
        args["q"] = torch.zeros(7, 3, 64, dtype=F16)
    elif name == "head_dim":
        args["q"], args["k"], args["v"] = q[..., :12], k[..., :12], v[..., :12]
    return args


@pytest.mark.parametrize("name", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                                  "alibi_slopes", "num_heads", "head_dim"])
def test_the_op_raises_value_error_naming_the_argument(name):
    a = _bad_op_call(name)
    with pytest.raises(ValueError, match=rf"^flash_attention_sm75: .*\b{name}\b"):
        _varlen_fwd()(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 4, 4, None,
                      False, a["seqused_k"], -1, -1, 0.0, a["alibi_slopes"])


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu.long(), cu, 4, 4),
     "cu_seqlens_q must be int32"),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu, cu[:2], 4, 4),
     re.escape("cu_seqlens_q and cu_seqlens_k must have the same length")),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu, cu, 4, 3),
     re.escape("cu_seqlens_k must be non-decreasing offsets starting at >= 0 and ending at <= "
               "the number of packed tokens (7), with no sequence longer than the max_seqlen "
               "passed (3)")),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu + 1, cu, 4, 4),
     "cu_seqlens_q must be non-decreasing offsets"),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu.flip(0), cu, 7, 7),
     "cu_seqlens_q must be non-decreasing offsets"),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4,
                                                    alibi_slopes=torch.ones(3, 4)),
     re.escape("alibi_slopes must have shape (num_heads,) = (4,) or (batch, num_heads) = (2, 4)")),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q, k, v, cu, cu, -1, 4),
     "max_seqlen_q must be an int >= 0"),
    (lambda q, k, v, cu: fa2.flash_attn_varlen_func(q.float(), k, v, cu, cu, 4, 4),
     "q must be float16"),
])
def test_the_door_raises_value_error_before_the_op(call, match, varlen_op_calls):
    q, k, v, cu, _ = _case([3, 4], [3, 4], 4, 2, 64, 58)
    with pytest.raises(ValueError, match=match):
        call(q, k, v, cu)
    assert varlen_op_calls == []


# ------------------------------------------------------------------------------- HF integration
try:
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - the op tests above run without it
    hf = None
else:
    from flash_attention_sm75.integrations import transformers as hf
    from test_transformers import _Attn, _qkv




def _packed_ref(q, k, v, cu_q, cu_k, causal, **kw):
    """float64 per-document attention of BHSD tensors in the flattened token layout:
    (1, total_q, H, D) and the packed tokens of q, k, v."""
    b, h, sq, d = q.shape
    pq, pk, pv = (t.transpose(1, 2).reshape(-1, t.shape[1], d) for t in (q, k, v))
    out, _ = varlen_attention_ref(pq, pk, pv, cu_q, cu_k, causal, **kw)
    return out


@pytest.mark.parametrize("case", ["causal-gqa", "cross-lengths", "batch2", "softcap",
                                  "window", "bidirectional", "no-max-length"])
def test_hf_cu_seq_lens_run_on_the_varlen_op(case, hf_state, varlen_op_calls, op_calls):
    hf.configure(allow_cpu_reference=True)
    b, h, h_k, causal, window, cap = 1, 4, 2, True, None, None
    cu_q = cu_k = [0, 3, 4, 11, 11, 16]
    if case == "cross-lengths":
        cu_q, cu_k = [0, 5, 12], [0, 9, 20]
    elif case == "batch2":
        b, cu_q = 2, [0, 5, 12, 16]
        cu_k = cu_q
    elif case == "softcap":
        cap = 2.0
    elif case == "window":
        window = 3
    elif case == "bidirectional":
        causal = False
    sq, sk = cu_q[-1] // b, cu_k[-1] // b
    q, k, v = _qkv(b, h, h_k, sq, sk, 64, seed=len(case) + 60)
    if cap:
        q, k = q * 3, k * 3
    kwargs = dict(cu_seq_lens_q=torch.tensor(cu_q), cu_seq_lens_k=torch.tensor(cu_k),
                  is_causal=causal)
    if case != "no-max-length":
        kwargs.update(max_length_q=max(torch.tensor(cu_q).diff()).item(),
                      max_length_k=max(torch.tensor(cu_k).diff()).item())
    if window:
        kwargs["sliding_window"] = window
    if cap:
        kwargs["softcap"] = cap
    with torch.no_grad():
        out, weights = hf.flash_attention_sm75_forward(_Attn(h, h_k), q, k, v, None, **kwargs)
    assert weights is None and out.shape == (b, sq, h, 64) and out.dtype == F16
    stats = hf.get_stats()
    assert stats["kernel"] == 1 and stats["fallback"] == 0, stats
    assert len(varlen_op_calls) == 1 and op_calls == []
    call = varlen_op_calls[0]
    assert call[3].dtype == I32 and call[3].tolist() == cu_q and call[4].tolist() == cu_k
    if case == "no-max-length":  # the number of tokens bounds every document
        assert call[5:7] == (b * sq, b * sk)
    else:
        assert call[5:7] == (kwargs["max_length_q"], kwargs["max_length_k"])
    w = (-1, -1) if window is None else (window - 1, window - 1)
    ref = _packed_ref(q, k, v, _cu_list(cu_q), _cu_list(cu_k), causal, window=w,
                      softcap=cap or 0.0)
    assert_out_exact(out.reshape(-1, h, 64), ref)


def _cu_list(cu):
    return torch.tensor(cu, dtype=I32)


def test_hf_cu_seq_lens_beyond_max_length_raise(hf_state):
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(1, 2, 2, 8, 8, 64, seed=61)
    with pytest.raises(ValueError, match="cu_seq_lens_q must be non-decreasing offsets"):
        hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None,
                                        cu_seq_lens_q=torch.tensor([0, 5, 8]), max_length_q=4)


def test_hf_position_ids_give_the_varlen_offsets(hf_state, varlen_op_calls):
    hf.configure(allow_cpu_reference=True)
    # tokens before the first restart form a document of their own (transformers' rule: a
    # document begins where the position equals the row's minimum)
    pos = torch.tensor([[3, 4, 0, 1, 2, 0, 1, 2, 3, 0]])
    q, k, v = _qkv(1, 4, 2, 10, 10, 64, seed=62)
    with torch.no_grad():
        out, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, position_ids=pos)
        out2, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, position_ids=pos)
    assert hf.get_stats()["kernel"] == 2 and hf.get_stats()["fallback"] == 0
    assert len(varlen_op_calls) == 2
    cu = varlen_op_calls[0][3]
    assert cu.dtype == I32 and cu.tolist() == [0, 2, 5, 9, 10]
    assert varlen_op_calls[0][5:7] == (4, 4)  # the longest document
    assert varlen_op_calls[1][3] is cu  # the second layer reuses the cached offsets
    assert torch.equal(out, out2)
    ref = _packed_ref(q, k, v, cu, cu, True)
    assert_out_exact(out.reshape(-1, 4, 64), ref)
    # positions that do not restart: not packed, the plain kernel path
    hf.reset_stats()
    with torch.no_grad():
        hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None,
                                        position_ids=torch.arange(2, 12)[None])
    assert hf.get_stats()["kernel"] == 1 and len(varlen_op_calls) == 2


def test_hf_packed_fallbacks_that_remain(hf_state):
    # An attention_mask with cu_seq_lens: the documents mask AND the mask on torch SDPA; CPU
    # tensors without the reference op: torch SDPA; the reasons say so.
    q, k, v = _qkv(1, 2, 2, 12, 12, 64, seed=63)
    cu = torch.tensor([0, 5, 12])
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None, cu_seq_lens_q=cu)
    hf.configure(allow_cpu_reference=True)
    hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, mask, cu_seq_lens_q=cu)
    hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None, cu_seq_lens_q=cu,
                                    cu_seq_lens_k=torch.tensor([0, 4, 8, 12]))
    stats = hf.get_stats()
    assert stats["kernel"] == 0 and stats["fallback"] == 3, stats
    reasons = " | ".join(stats["reasons"])
    assert reasons.count("packed sequences (cu_seq_lens_q/k)") == 3, reasons
    assert "must be a CUDA tensor" in reasons and "an attention_mask" in reasons
    assert "different numbers of documents" in reasons


def test_hf_packed_calls_under_torch_compile(hf_state):
    # cu_seq_lens need no host read: the varlen op in the graph. Packed position_ids are read
    # on the host: the compiled graph takes the per-document mask on torch SDPA. Both equal
    # eager.
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(1, 4, 2, 10, 10, 64, seed=64)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]])
    cu = torch.tensor([0, 3, 8, 10], dtype=I32)
    mod = _Attn(4, 2)
    for kwargs, on_varlen in ((dict(cu_seq_lens_q=cu, max_length_q=5), True),
                              (dict(position_ids=pos), False)):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        with torch.no_grad():
            eager, _ = hf.flash_attention_sm75_forward(mod, q, k, v, None, **kwargs)
            fn = torch.compile(lambda q, k, v, kw=kwargs: hf.flash_attention_sm75_forward(
                mod, q, k, v, None, **kw)[0], fullgraph=True, backend=backend)
            got = fn(q, k, v)
        assert ("varlen_fwd" in _ops_in(graphs)) == on_varlen
        torch.testing.assert_close(got, eager, atol=2e-3, rtol=2e-3)


# Loss scale, as in tests/test_transformers.py (fp16 gradients of random-weight models).
_LOSS_SCALE = 1024.0


def _flattened_batch(flash_kwargs, device, vocab=128):
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(65)
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in (7, 12, 1, 9)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs and "position_ids" in batch
    return {name: t.to(device) if isinstance(t, torch.Tensor) else t
            for name, t in batch.items()}


def _step(model, batch, **extra):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **extra)
    (out.loss * _LOSS_SCALE).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.detach().float(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _training_step_matches_per_document(family, flash_kwargs, device):
    """A DataCollatorWithFlattening batch (documents of 7, 12, 1 and 9 tokens in one row):
    the training step of an fp16 model on the varlen op (the cache left on, so transformers
    builds no mask and the attention reads cu_seq_lens / position_ids) against stock fp16 SDPA
    with the per-document mask transformers builds from position_ids (use_cache=False), both
    measured against the float32 model: our loss and every parameter's gradient within 2x stock's
    error + 1e-3 (tests/test_transformers.py's criterion)."""
    from devtools.model_configs import build_random_model, make_config

    cfg = make_config(family, num_attention_heads=4, num_key_value_heads=2)
    base = build_random_model(cfg, dtype=F16, device=device, seed=66).train()
    ref32 = copy.deepcopy(base).float()
    batch = _flattened_batch(flash_kwargs, device)
    loss_stock, g_stock = _step(base, batch, use_cache=False)
    loss32, g32 = _step(ref32, batch, use_cache=False)
    ours = copy.deepcopy(base)
    ours.set_attn_implementation("flash_attention_sm75")
    hf.reset_stats()
    loss_ours, g_ours = _step(ours, batch)
    stats = hf.get_stats()
    layers = cfg.num_hidden_layers
    assert stats["kernel_prefill"] == layers and stats["fallback"] == 0, stats
    # ...and attending across the documents gives another loss (so the comparison tests it)
    cross = dict(batch)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                 "position_ids"):
        cross.pop(name, None)
    loss_cross, _ = _step(ref32, cross, use_cache=False)
    assert abs(loss_cross - loss32) > 1e-3
    assert abs(loss_ours - loss32) <= 2 * abs(loss_stock - loss32) + 1e-3
    for name in g32:
        assert torch.isfinite(g_ours[name]).all(), name
        e_ours, e_stock = _rel(g_ours[name], g32[name]), _rel(g_stock[name], g32[name])
        assert e_ours <= 2 * e_stock + 1e-3, (name, e_ours, e_stock)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_flattened_training_step_on_the_cpu_op(family, flash_kwargs, hf_state):
    hf.configure(allow_cpu_reference=True)
    _training_step_matches_per_document(family, flash_kwargs, "cpu")


# ------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def _wide(window, left, right):
    """MODS' window scaled to tens of keys (an unbounded side stays -1)."""
    return tuple(w * f if w >= 0 else -1 for w, f in zip(window, (left, right)))


def _random_lengths(n, hi, g, specials=(0, 1)):
    lens = torch.randint(0, hi, (n,), generator=g).tolist()
    return lens + list(specials)


def _gpu_fwd_check(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, window=(-1, -1), cap=0.0,
                   slopes=None, scale=None, seqused_k=None):
    with poisoned_cuda_memory():
        out, lse = _varlen_fwd()(q, k, v, cu_q, cu_k, _max(lens_q), _max(lens_k), scale, causal,
                                 seqused_k, *window, cap, slopes)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == F16
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    kw = dict(softmax_scale=scale, window=window, softcap=cap, alibi_slopes=slopes,
              seqused_k=None if seqused_k is None else seqused_k.cpu())
    cu_q, cu_k = cu_q.cpu(), cu_k.cpu()  # the reference slices on the host
    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, causal, **kw)
    pt, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, causal, upcast=False, reorder_ops=True,
                                 **kw)
    q0, q1 = int(cu_q[0]), int(cu_q[-1])
    assert_close_fa(out[q0:q1], ref, pt)
    assert_lse_close(lse[:, q0:q1], ref_lse)
    if q0 > 0 or q1 < q.shape[0]:  # tokens in no sequence: 0 and -inf, written (not NaN)
        rows = torch.cat([torch.arange(q0), torch.arange(q1, q.shape[0])])
        assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()
    return out, lse


@gpu
@pytest.mark.parametrize("mods", sorted(MODS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_gpu_forward(heads, d, causal, mods):
    c = _gpu_case("gpu-fwd", heads, d, causal, mods, 9, 300, 257, (37, 29))
    _gpu_fwd_check(c.q, c.k, c.v, c.cu_q, c.cu_k, c.lens_q, c.lens_k, causal, c.window, c.cap,
                   c.slopes)


class _GpuCase(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    lens_q: list
    lens_k: list
    window: tuple
    cap: float
    slopes: Optional[torch.Tensor]


def _gpu_case(tag, heads, d, causal, mods, n, hi, long, widen, grad=False) -> _GpuCase:
    """``n`` random lengths below ``hi`` for q and k, plus an empty, a one-token and a
    ``long`` sequence; MODS' window widened by ``widen``; CUDA tensors."""
    (h, h_k), (window, cap, alibi) = heads, MODS[mods]
    g = torch.Generator().manual_seed(seed_from(tag, heads, d, causal, mods))
    lens_q = _random_lengths(n, hi, g, (0, 1, long))
    lens_k = _random_lengths(n, hi, g, (5, 0, long))
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, h, h_k, d, seed_from(tag, "data", d), "cuda",
                                grad=grad)
    return _GpuCase(q, k, v, cu_q, cu_k, lens_q, lens_k, _wide(window, *widen), cap,
                    _slopes(alibi, len(lens_q), h, "cuda"))


@gpu
@pytest.mark.parametrize("case", ["many-short", "one-long", "outside-tokens", "seqused",
                                  "strided"])
def test_gpu_forward_layouts(case):
    g = torch.Generator().manual_seed(seed_from("gpu-layouts", case))
    h, h_k, d = 4, 2, 64
    seqused = None
    extra_q = extra_k = 0
    if case == "many-short":
        lens_q = lens_k = torch.randint(0, 40, (200,), generator=g).tolist()
    elif case == "one-long":
        lens_q, lens_k = [4097, 3, 0, 1], [4097, 1, 9, 0]
    else:
        lens_q, lens_k = _random_lengths(6, 200, g), _random_lengths(6, 200, g)
        if case == "outside-tokens":
            extra_q, extra_k = 9, 5
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, h, h_k, d, seed_from("gpu-l", case), "cuda",
                                extra_q=extra_q, extra_k=extra_k)
    if case == "outside-tokens":  # rows before the first and after the last sequence
        cu_q, cu_k = cu_q + 4, cu_k + 2
    if case == "seqused":
        seqused = torch.tensor([n // 2 for n in lens_k], dtype=I32, device="cuda")
    if case == "strided":  # flash-attn's packed qkv: strided views of one tensor
        lens_k = lens_q
        q, k, v, cu_q, cu_k = _case(lens_q, lens_q, h, h, d, 70, "cuda")
        q, k, v = torch.stack([q, k, v], 1).unbind(1)
        assert not q.is_contiguous()
    for causal in (False, True):
        _gpu_fwd_check(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, seqused_k=seqused)


def _gpu_backward(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, window, cap, slopes,
                  deterministic=False):
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, _max(lens_q), _max(lens_k),
                                             causal=causal, window_size=window, softcap=cap,
                                             alibi_slopes=slopes, deterministic=deterministic,
                                             return_attn_probs=True)
    return out, lse


@gpu
@pytest.mark.parametrize("mods", ["plain", "window", "softcap", "alibi-batch", "all"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_gpu_backward_against_float64(heads, d, causal, mods):
    q, k, v, cu_q, cu_k, lens_q, lens_k, window, cap, slopes = _gpu_case(
        "gpu-bwd", heads, d, causal, mods, 7, 200, 129, (23, 17), grad=True)
    out, lse = _gpu_backward(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, window, cap, slopes)
    kw = dict(window=window, softcap=cap, alibi_slopes=slopes)
    cu_q, cu_k = cu_q.cpu(), cu_k.cpu()  # the reference slices on the host
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, ref_lse = varlen_attention_ref(q64, k64, v64, cu_q, cu_k, causal, **kw)
    qpt, kpt, vpt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    pt, pt_lse = varlen_attention_ref(qpt, kpt, vpt, cu_q, cu_k, causal, upcast=False,
                                      reorder_ops=True, **kw)
    assert_close_fa(out, ref, pt)
    assert_lse_close(lse, ref_lse)
    go = torch.randn_like(out)
    g_lse = torch.randn_like(lse).masked_fill(torch.isneginf(ref_lse), 0.0)
    grads = torch.autograd.grad((out, lse), (q, k, v), (go, g_lse))
    refs = torch.autograd.grad((ref, ref_lse), (q64, k64, v64), (go.double(), g_lse.double()),
                               allow_unused=True)
    pts = torch.autograd.grad((pt, pt_lse), (qpt, kpt, vpt), (go, g_lse), allow_unused=True)
    for name, a, r, p in zip("qkv", grads, refs, pts):
        r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
        p = torch.zeros_like(a) if p is None else p
        # the absolute slack of tests/test_backward.py
        assert_close_fa(a, r, p, name="d" + name, atol=1e-3)


@gpu
@pytest.mark.parametrize("env", ["default", "atomic"])
def test_gpu_deterministic_backward_is_bitwise_reproducible(env, monkeypatch):
    if env == "atomic":  # flash-attn's deterministic=True wins over the atomic dQ setting
        monkeypatch.setenv("FLASH_SM75_BWD_DQ", "atomic")
    g = torch.Generator().manual_seed(71)
    lens_q = _random_lengths(12, 400, g, (0, 1, 1000))
    lens_k = _random_lengths(12, 400, g, (7, 0, 1000))
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 8, 2, 128, 72, "cuda", grad=True)
    slopes = _slopes("heads", len(lens_q), 8, "cuda")
    go = torch.randn(q.shape, device="cuda", dtype=F16)
    runs = []
    for _ in range(3):
        out, lse = _gpu_backward(q, k, v, cu_q, cu_k, lens_q, lens_k, True, (-1, -1), 0.0,
                                 slopes, deterministic=True)
        runs.append(torch.autograd.grad((out, lse), (q, k, v),
                                        (go, torch.ones_like(lse).masked_fill(
                                            torch.isneginf(lse), 0.0))))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gpu_hf_flattened_training_step(family, flash_kwargs, hf_state):
    _training_step_matches_per_document(family, flash_kwargs, "cuda")


@gpu
def test_gpu_varlen_is_captured_by_a_cuda_graph():
    # No host synchronisation on the way to the op (the cu_seqlens check is a device-side
    # assertion): the call captures, and replays on new data give the eager results.
    lens_q, lens_k = [100, 0, 1, 37], [120, 5, 0, 37]
    kw = dict(causal=True, window_size=(50, 0), softcap=3.0,
              alibi_slopes=_slopes("batch", 4, 8, "cuda"))
    q, k, v, cu_q, cu_k = _case(lens_q, lens_k, 8, 2, 64, 80, "cuda")
    static = [t.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        fa2.flash_attn_varlen_func(*static, cu_q, cu_k, 100, 120, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa2.flash_attn_varlen_func(*static, cu_q, cu_k, 100, 120, **kw)
    for seed in (81, 82):
        new = _case(lens_q, lens_k, 8, 2, 64, seed, "cuda")[:3]
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        want = fa2.flash_attn_varlen_func(*new, cu_q, cu_k, 100, 120, **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, want), seed
