"""The SDPA-compatible wrapper: dispatch, fallback, why_not_supported, logging, strict mode.

CPU tests check the fallback (every CPU call falls back) and the kernel branch's plumbing (by
forcing the branch, which then runs the op's CPU implementation). GPU tests compare the kernel
path with the float64 reference and every fallback branch with torch's own SDPA.
"""
import fractions
import logging
import re

import pytest
import torch
import torch.nn.functional as F

import flash_attention_sm75 as fa
from flash_attention_sm75 import _masks, _ops, _rules, sdpa
from reference import assert_close_fa, attention_ref, poisoned_cuda_memory, seed_from

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")

LOGGER = "flash_attention_sm75"


@pytest.fixture(autouse=True)
def _no_strict(monkeypatch):
    # Each test starts in non-strict mode whatever the environment says.
    monkeypatch.delenv(sdpa.STRICT_ENV_VAR, raising=False)
    monkeypatch.setattr(sdpa, "_strict_override", None)


def bhsd(b=2, h=4, h_k=4, s_q=8, s_k=8, d=64, dtype=torch.float16, device="cpu", seed=0,
         d_v=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s_q, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(b, h_k, s_k, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(b, h_k, s_k, d_v or d, generator=g).to(dtype=dtype, device=device)
    return q, k, v


def assert_same_as_torch(args, kwargs):
    """Our wrapper returns torch's result bit for bit, or raises torch's exception."""
    try:
        expected = F.scaled_dot_product_attention(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, we must raise too
        with pytest.raises(type(e)) as ours:
            fa.scaled_dot_product_attention(*args, **kwargs)
        assert str(ours.value) == str(e)
        return None
    out = fa.scaled_dot_product_attention(*args, **kwargs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # Bit for bit, NaN where torch gives NaN (torch's CUDA SDPA returns NaN for a negative scale).
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    return out


def _kernel_ref_check(q, k, v, out, is_causal, scale=None):
    kw = dict(causal=is_causal, causal_bottom_right=False, softmax_scale=scale, layout="bhsd")
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_fa(out, ref, pt)


# --------------------------------------------------------------------- why_not_supported (CPU)


@pytest.fixture
def kernel_device_cpu(monkeypatch):
    """The kernel path's rules for CPU tensors: the rulebook's device rule reads "cpu" (the rules
    are otherwise unchanged; the op has a CPU implementation)."""
    monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", "cpu")


def _reason_cases():
    # Reasons from the rulebook (_rules) name the wrapper's arguments (query, key, value).
    q, k, v = bhsd()
    kg, vg = bhsd(h_k=2)[1:]
    return [
        ("fp32", bhsd(dtype=torch.float32), {}, "query must be float16"),
        ("bf16_value", (q, k, v.bfloat16()), {}, "value must be float16"),
        ("3d", (q[0], k[0], v[0]), {}, "query must be 4-D"),
        ("5d", (q[None], k[None], v[None]), {}, "query must be 4-D"),
        ("mask_and_causal", (q, k, v), {"attn_mask": torch.ones(8, 8, dtype=torch.bool),
                                        "is_causal": True}, "attn_mask and is_causal=True"),
        ("mask_int", (q, k, v), {"attn_mask": torch.ones(8, 8, dtype=torch.int64)},
         "attn_mask dtype torch.int64 is not bool, float32 or the query"),
        ("dropout", (q, k, v), {"dropout_p": 1.0}, "dropout_p must be in [0, 1), got 1.0"),
        ("head_dim_12", bhsd(d=12), {}, "head_dim must be a multiple of 8 from 8 to "),
        ("head_dim_264", bhsd(d=264), {}, "got 264"),
        ("value_head_dim", bhsd(d_v=128), {},
         "key and value must have the same shape, got key [2, 4, 8, 64] and value [2, 4, 8, 128]"),
        ("qk_head_dim", (bhsd(d=128)[0], k, v), {},
         "query and key must have the same head_dim, got 128 and 64"),
        ("batch", (q[:1], k, v), {}, "query and key must have the same batch size, got 1 and 2"),
        ("gqa_disabled", (q, kg, vg), {}, "enable_gqa=False"),
        ("gqa_not_multiple", (bhsd(h=6)[0], bhsd(h_k=4)[1], bhsd(h_k=4)[2]),
         {"enable_gqa": True}, "num_heads (6) must be a multiple of num_heads_k (4)"),
        ("scale_zero", (q, k, v), {"scale": 0.0}, "scale must be a finite number > 0"),
        ("scale_negative", (q, k, v), {"scale": -1.0}, "got -1.0"),
        ("scale_inf", (q, k, v), {"scale": float("inf")}, "got inf"),
        ("nested", (torch.nested.nested_tensor([q[0], q[1]], layout=torch.jagged), k, v), {},
         "query is a nested tensor"),
        ("not_tensor", (q, k.tolist(), v), {}, "key must be a torch.Tensor, got list"),
        ("last_stride", (torch.zeros(2, 4, 64, 8, dtype=torch.float16).transpose(2, 3), k, v),
         {}, "query must have a contiguous last dimension"),
        ("scale_fraction", (q, k, v), {"scale": fractions.Fraction(1, 8)},
         "scale is a fractions.Fraction; a Python float is required"),
        ("scale_bool", (q, k, v), {"scale": True}, "scale is a bool"),
        ("is_causal_int", (q, k, v), {"is_causal": 1}, "is_causal is a int; a bool is required"),
    ]


REASON_CASES = _reason_cases()


@pytest.mark.parametrize("case", REASON_CASES, ids=[c[0] for c in REASON_CASES])
def test_why_not_supported_reasons(case, kernel_device_cpu):
    _, args, kwargs, expected = case
    reason = fa.why_not_supported(*args, **kwargs)
    assert isinstance(reason, str) and expected in reason, reason


def test_cpu_tensors_fall_back_naming_the_device():
    q, k, v = bhsd(h=8, h_k=2)
    assert fa.why_not_supported(q, k, v, enable_gqa=True, is_causal=True, scale=0.1) == (
        "query must be a CUDA tensor, got device cpu")
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        assert "must be a CUDA tensor" in fa.why_not_supported(qg, k, v, enable_gqa=True)
    assert "must be a CUDA tensor" in fa.why_not_supported(qg, k, v, enable_gqa=True)


def test_why_not_supported_extension_missing(monkeypatch):
    monkeypatch.setattr(_ops, "EXTENSION_AVAILABLE", False)
    monkeypatch.setattr(_ops, "EXTENSION_ERROR", "ImportError: boom")
    reason = fa.why_not_supported(*bhsd(device="cpu"))
    assert "extension" in reason and "ImportError: boom" in reason


@pytest.mark.parametrize("kind,expected", [
    ("ok", True),
    ("last_stride", False),
    ("misaligned_ptr", False),
    ("odd_stride", False),
    ("size1_odd_stride", True),
])
def test_kernel_alignment_rule(kind, expected):
    base = torch.zeros(2, 4, 16, 64, dtype=torch.float16)
    t = {
        "ok": base,
        "last_stride": base.transpose(2, 3),
        "misaligned_ptr": base.view(-1)[4:4 + 2 * 4 * 15 * 64].view(2, 4, 15, 64)
        if base.data_ptr() % 16 == 0 else None,
        "odd_stride": torch.zeros(2, 4, 16, 68, dtype=torch.float16)[..., :64],
        # a size-1 dim's stride is never used, so it may be anything
        "size1_odd_stride": torch.zeros(1, 4, 16, 68, dtype=torch.float16)[:, :1, :1, :64],
    }[kind]
    if t is None:
        pytest.skip("CPU allocation not 16-byte aligned")
    assert _rules.is_kernel_aligned(t) is expected


def test_alignment_and_device_checks_trace_under_compile():
    # The CUDA-only part of the rules must trace with fullgraph=True (no data_ptr()).
    torch._dynamo.reset()

    def f(t, other):
        aligned = _rules.is_kernel_aligned(t)
        mismatch = other.device != t.device
        return t * (1 if aligned else 2) + (3 if mismatch else 0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    base = torch.ones(2, 4, 16, 64, dtype=torch.float16)
    odd = torch.ones(2, 4, 16, 68, dtype=torch.float16)[..., :64]
    assert compiled(base, base).max().item() == 1.0
    assert compiled(odd, base).max().item() == 2.0
    assert compiled(base.transpose(2, 3), base).max().item() == 2.0


# ------------------------------------------------------------ the kernel path's rules (CPU)


def _accepts(*args, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    return sdpa.why_not_supported(*args, attn_mask=attn_mask, dropout_p=dropout_p,
                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa) is None


@pytest.mark.parametrize("shape,kwargs", [
    (dict(), {}),
    (dict(h=8, h_k=2), {"enable_gqa": True, "is_causal": True}),
    (dict(h=4, h_k=1, s_q=1, s_k=33, d=128), {"enable_gqa": True, "scale": 0.5}),
    (dict(b=1, h=1, h_k=1, s_q=1, s_k=1), {"scale": 1, "dropout_p": 0}),
])
def test_supported_calls_are_accepted_with_and_without_grad(shape, kwargs, kernel_device_cpu):
    q, k, v = bhsd(**shape)
    assert _accepts(q, k, v, **kwargs)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        assert _accepts(qg, k, v, **kwargs)
    assert _accepts(qg, k, v, **kwargs)  # the backward kernel serves it


def test_forward_mode_ad_falls_back(kernel_device_cpu):
    # The kernel has no jvp formula: the wrapper must leave dual inputs to torch.
    import torch.autograd.forward_ad as fwAD

    q, k, v = bhsd()
    assert _accepts(q, k, v)
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.ones_like(q))
        assert not _accepts(qd, k, v)
        assert "forward-mode AD" in sdpa.why_not_supported(qd, k, v)


def test_forward_mode_ad_on_the_mask_falls_back(kernel_device_cpu):
    # A tangent on the mask alone must not be dropped either (the op has no jvp formula).
    import torch.autograd.forward_ad as fwAD

    q, k, v = bhsd(s_q=5, s_k=9)
    mask = torch.randn(5, 9).half()
    with fwAD.dual_level():
        md = fwAD.make_dual(mask, torch.ones_like(mask))
        assert "attn_mask carries a forward-mode AD tangent" in sdpa.why_not_supported(
            q, k, v, attn_mask=md)
    from flash_attention_sm75 import _ops
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="attn_bias carries"):
        _ops.call_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, False,
                      True, attn_bias=fwAD.make_dual(mask, torch.ones_like(mask)))


def test_learned_mask_head_check_under_dynamic_compile(kernel_device_cpu):
    # Under torch.compile(dynamic=True) a Parameter's head count is a SymInt; `n in (1, h)`
    # evaluated False for an equal one, which refused the mask with a self-contradicting reason.
    q, k, v = bhsd(h=4, h_k=4, s_q=12, s_k=12)
    mask = torch.nn.Parameter(torch.randn(1, 4, 12, 12).half())
    f = torch.compile(lambda q, k, v, m: sdpa.scaled_dot_product_attention(q, k, v, attn_mask=m),
                      backend="aot_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    with sdpa.strict():
        out = f(q, k, v, mask)
    (g,) = torch.autograd.grad(out.float().sum(), mask)
    assert g.shape == mask.shape and torch.isfinite(g).all() and g.abs().sum() > 0
    torch._dynamo.reset()


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_fall_back_to_torch(transform, kernel_device_cpu, monkeypatch):
    # A drop-in SDPA must work under torch.func: the kernel's register_autograd formula cannot
    # serve grad/vjp/jacrev, so the wrapper leaves every torch.func call to torch.
    q, k, v = (t.float() for t in bhsd(s_q=6, s_k=6))
    plain = (q.half(), k.half(), v.half())
    assert _accepts(*plain)  # the kernel path otherwise
    if transform == "vmap":  # a leading batch dimension, so each sample is 4-D
        q, k, v = (torch.stack([t, t.flip(2)]) for t in (q, k, v))
    reasons = []

    def ours(q_, k_, v_):
        reasons.append(sdpa.why_not_supported(q_, k_, v_, is_causal=True))
        return sdpa.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    ref = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)  # noqa: E731
    if transform == "grad":
        got = torch.func.grad(lambda q_: ours(q_.half(), k.half(), v.half()).float().sum())(q)
        want = torch.func.grad(lambda q_: ref(q_.half(), k.half(), v.half()).float().sum())(q)
    else:
        got = torch.func.vmap(ours)(q.half(), k.half(), v.half())
        want = torch.func.vmap(ref)(q.half(), k.half(), v.half())
    assert torch.equal(got, want)
    assert reasons and all("torch.func transform" in r for r in reasons), reasons
    assert _accepts(*plain)  # outside a transform: the kernel again


def test_wrapper_kernel_path_runs_the_op(kernel_device_cpu, op_calls):
    # The accepted call runs the op (its CPU implementation here) with the wrapper's top-left
    # causal alignment, and gives the reference result.
    q, k, v = bhsd(h=8, h_k=2, s_q=6, s_k=9)
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert len(op_calls) == 1 and op_calls[0][3:6] == (None, True, False)
    _kernel_ref_check(q, k, v, out, is_causal=True)


# ----------------------------------------------------------------------------- fallback (CPU)


FALLBACK_CALLS = [
    ("plain", {}),
    ("causal", {"is_causal": True}),
    ("scale", {"scale": 0.3}),
    ("gqa", {"enable_gqa": True, "h_k": 2}),
    ("mask_bool", {"attn_mask": "bool"}),
    ("mask_float", {"attn_mask": "float"}),
    ("fp32", {"dtype": torch.float32}),
    ("head_dim_80", {"d": 80}),
    ("3d", {"three_d": True}),
    ("unequal_lengths_causal", {"is_causal": True, "s_q": 5, "s_k": 11}),
]


def _build_call(spec, device="cpu", seed=0):
    spec = dict(spec)
    shape = {key: spec.pop(key) for key in ("h_k", "d", "dtype", "s_q", "s_k") if key in spec}
    q, k, v = bhsd(device=device, seed=seed, **shape)
    if spec.pop("three_d", False):
        q, k, v = q[0], k[0], v[0]
    mask = spec.get("attn_mask")
    if mask == "bool":
        m = torch.rand(q.shape[-2], k.shape[-2], device=device) > 0.3
        m[:, 0] = True  # no fully masked row (torch would give NaN, and NaN != NaN)
        spec["attn_mask"] = m
    elif mask == "float":
        spec["attn_mask"] = torch.randn(q.shape[-2], k.shape[-2], device=device).to(q.dtype)
    return (q, k, v), spec


@pytest.mark.parametrize("name,spec", FALLBACK_CALLS, ids=[c[0] for c in FALLBACK_CALLS])
def test_cpu_fallback_equals_torch(name, spec):
    args, kwargs = _build_call(spec)
    assert fa.why_not_supported(*args, **kwargs) is not None
    assert assert_same_as_torch(args, kwargs) is not None


def _mask_with_empty_rows(kind, s_q, s_k, dtype, device="cpu"):
    """A mask whose rows 1 and s_q - 1 see no key (4-D, per batch entry: batch 1 only)."""
    g = torch.Generator().manual_seed(s_q * 100 + s_k)
    vis = torch.rand(2, 1, s_q, s_k, generator=g) > 0.4
    vis[..., 0] = True
    vis[:, :, 1] = False
    vis[1, :, s_q - 1] = False
    vis = vis.to(device)
    if kind == "bool":
        return vis
    if kind == "-inf":
        return torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill(~vis, float("-inf"))
    return torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill(
        ~vis, torch.finfo(dtype).min)  # "dtype minimum": rows are not empty


@pytest.mark.parametrize("kind", ["bool", "-inf", "finite_min"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fallback_rows_without_keys_give_zero_and_zero_gradients(kind, dtype):
    # Issue 20: a query row whose keys are all masked comes back as 0 on every path, also where
    # the wrapper falls back to torch (whose backends may give NaN there, and NaN gradients to
    # every key through such a row); the other rows stay torch's result bit for bit.
    q, k, v = bhsd(dtype=dtype, s_q=6, s_k=9, d=16, seed=3)
    mask = _mask_with_empty_rows(kind, 6, 9, dtype)
    assert fa.why_not_supported(q, k, v, attn_mask=mask) is not None  # the fallback path
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fa.scaled_dot_product_attention(*leaves, attn_mask=mask)
    out.float().sum().backward()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    empty = torch.zeros(2, 1, 6, 1, dtype=torch.bool)
    if kind != "finite_min":
        empty[:, :, 1] = True
        empty[1, :, 5] = True
    keep = ~empty.expand(2, 4, 6, 1)[..., 0]
    assert torch.equal(out.detach()[keep], ref[keep])
    assert torch.isfinite(out).all()
    assert (out.detach()[~keep] == 0).all()
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    if kind != "finite_min":
        assert (leaves[0].grad[~keep] == 0).all()  # no gradient through an empty row


def test_fallback_empty_rows_with_broadcast_masks():
    q, k, v = bhsd(dtype=torch.float32, s_q=5, s_k=7, d=16, seed=4)
    m2 = torch.ones(5, 7, dtype=torch.bool)
    m2[3] = False
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=m2)
    assert (out[:, :, 3] == 0).all() and torch.isfinite(out).all()
    m3 = torch.ones(4, 5, 7, dtype=torch.bool)  # 3-D (heads, rows, keys): head 2 row 0 empty
    m3[2, 0] = False
    out3 = fa.scaled_dot_product_attention(q, k, v, attn_mask=m3)
    assert (out3[:, 2, 0] == 0).all() and (out3[:, :2, 0] != 0).any() and torch.isfinite(out3).all()
    m1 = torch.zeros(7, dtype=torch.bool)  # 1-D: torch raises (its IndexError), so do we
    assert_same_as_torch((q, k, v), dict(attn_mask=m1))
    compiled = torch.compile(lambda a, b, c: fa.scaled_dot_product_attention(a, b, c, attn_mask=m2),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_gpu_fallback_rows_without_keys_give_zero(kind):
    # On the GPU, torch's efficient / math backends for a mask the kernels do not take: with a
    # backward at head_dim 192 (the backward reads a bias up to 128).
    q, k, v = bhsd(dtype=torch.float16, s_q=70, s_k=90, d=192, seed=5, device="cuda")
    mask = _mask_with_empty_rows(kind, 70, 90, torch.float16, "cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    assert "no backward at head_dim 192" in fa.why_not_supported(*leaves, attn_mask=mask)
    out = fa.scaled_dot_product_attention(*leaves, attn_mask=mask)
    out.float().sum().backward()
    assert (out[:, :, 1] == 0).all() and (out[1, :, 69] == 0).all()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in leaves)


def test_cpu_fallback_dropout_with_fixed_seed():
    args = bhsd(dtype=torch.float32)
    torch.manual_seed(123)
    out = fa.scaled_dot_product_attention(*args, dropout_p=0.5)
    torch.manual_seed(123)
    expected = F.scaled_dot_product_attention(*args, dropout_p=0.5)
    assert torch.equal(out, expected)
    assert not torch.equal(out, F.scaled_dot_product_attention(*args))  # dropout did happen


def test_cpu_fallback_positional_arguments():
    q, k, v = bhsd()
    mask = torch.rand(8, 8) > 0.5
    assert torch.equal(fa.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.2),
                       F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.2))
    # As in torch, scale and enable_gqa are keyword-only.
    with pytest.raises(TypeError):
        fa.scaled_dot_product_attention(q, k, v, mask, 0.0, False, 0.2)


def test_cpu_fallback_heads_mismatch_raises_like_torch():
    q, k, v = bhsd(h=8, h_k=2)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    assert assert_same_as_torch((q, k, v), {}) is None  # raised the same error


def test_cpu_fallback_backward_matches_torch():
    q, k, v = (t.requires_grad_() for t in bhsd(dtype=torch.float32))
    fa.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_fallback_logs_reason_at_debug(caplog):
    args = bhsd(d=80)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        fa.scaled_dot_product_attention(*args)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert fa.why_not_supported(*args) in records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fa.scaled_dot_product_attention(*args)
    assert not [r for r in caplog.records if r.name == LOGGER]


# ------------------------------------------------------------------------------ strict mode


@pytest.mark.parametrize("is_causal", [0.5, 1, None, torch.tensor(True)])
def test_non_bool_is_causal_is_not_reinterpreted(is_causal):
    # torch's SDPA rejects these; the kernel path must not quietly read them as True / False.
    args = bhsd()
    assert "is_causal is a" in fa.why_not_supported(*args, is_causal=is_causal)
    with pytest.raises((TypeError, RuntimeError)):
        F.scaled_dot_product_attention(*args, is_causal=is_causal)
    with pytest.raises((TypeError, RuntimeError)):
        fa.scaled_dot_product_attention(*args, is_causal=is_causal)
    with fa.strict(), pytest.raises(ValueError, match="is_causal is a"):
        fa.scaled_dot_product_attention(*args, is_causal=is_causal)


def test_zero_kv_heads_with_gqa_raises_instead_of_crashing():
    q, k, v = bhsd()
    with pytest.raises(ValueError, match="key has 0 heads"):
        fa.scaled_dot_product_attention(q, k[:, :0], v[:, :0], enable_gqa=True)


def test_scale_outside_float32_range_falls_back(kernel_device_cpu):
    args = bhsd()
    for scale in (1e-40, 2.4e38):
        assert "[1.18e-38, 1.07e26]" in fa.why_not_supported(*args, scale=scale)


def test_strict_context_manager_raises_reason():
    args = bhsd(dtype=torch.float32)
    reason = fa.why_not_supported(*args)
    with fa.strict():
        assert fa.is_strict()
        with pytest.raises(ValueError) as err:
            fa.scaled_dot_product_attention(*args)
    assert reason in str(err.value) and "strict" in str(err.value)
    assert not fa.is_strict()
    fa.scaled_dot_product_attention(*args)  # falls back again


def test_strict_env_var(monkeypatch):
    args = bhsd()
    for value in ["1", "true", "ON", "yes"]:
        monkeypatch.setenv("FLASH_ATTENTION_SM75_STRICT", value)
        assert fa.is_strict()
        with pytest.raises(ValueError, match="query must be a CUDA tensor"):
            fa.scaled_dot_product_attention(*args)
    for value in ["0", "", "false"]:
        monkeypatch.setenv("FLASH_ATTENTION_SM75_STRICT", value)
        assert not fa.is_strict()
        assert fa.scaled_dot_product_attention(*args).shape == args[0].shape


def test_strict_env_var_rejects_unknown_values(monkeypatch):
    args = bhsd()
    for value in ["2", "strict", "enabled"]:
        monkeypatch.setenv("FLASH_ATTENTION_SM75_STRICT", value)
        with pytest.raises(ValueError, match="FLASH_ATTENTION_SM75_STRICT=.* is not understood"):
            fa.is_strict()
        with pytest.raises(ValueError, match="FLASH_ATTENTION_SM75_STRICT"):
            fa.scaled_dot_product_attention(*args)


def test_set_strict_and_overrides(monkeypatch):
    args = bhsd()
    fa.set_strict(True)
    try:
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            fa.scaled_dot_product_attention(*args)
        with fa.strict(False):  # nested override, restored afterwards
            assert not fa.is_strict()
            fa.scaled_dot_product_attention(*args)
        assert fa.is_strict()
    finally:
        fa.set_strict(None)
    monkeypatch.setenv("FLASH_ATTENTION_SM75_STRICT", "1")
    with fa.strict(False):
        assert torch.equal(fa.scaled_dot_product_attention(*args),
                           F.scaled_dot_product_attention(*args))
    assert fa.is_strict()  # back to following the environment
    with pytest.raises(ValueError, match="set_strict: enabled must be a bool or None"):
        fa.set_strict("yes")
    for bad in (None, "yes", 1):
        with pytest.raises(ValueError, match="strict: enabled must be a bool, got"):
            with fa.strict(bad):
                pass
    assert fa.is_strict()  # a refused strict() changed nothing


def test_strict_env_var_not_understood_warns_at_import():
    # Without the warning a misspelt value reads as off until the first call that falls back.
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FLASH_ATTENTION_SM75_STRICT="Ture",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", "import flash_attention_sm75"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("RuntimeWarning") == 1, r.stderr
    assert "FLASH_ATTENTION_SM75_STRICT='Ture' is not understood" in r.stderr  # as set
    env["FLASH_ATTENTION_SM75_STRICT"] = "1"
    r = subprocess.run([sys.executable, "-c", "import flash_attention_sm75"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr


def test_strict_restored_after_exception():
    with pytest.raises(RuntimeError):
        with fa.strict():
            raise RuntimeError("inside")
    assert not fa.is_strict()


# --------------------------------------------------------- kernel branch plumbing (CPU op)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("s_q,s_k,h,h_k,scale", [(6, 13, 4, 2, None), (13, 6, 4, 4, 0.2),
                                                 (9, 9, 8, 1, None)])
def test_kernel_branch_on_cpu_op(monkeypatch, s_q, s_k, h, h_k, scale, is_causal):
    # Force the kernel branch; on CPU tensors the op's CPU implementation runs. Checks the BHSD
    # <-> BSHD plumbing, the top-left causal alignment, GQA and the scale against the reference.
    calls = []
    monkeypatch.setattr(sdpa, "_metadata_reason", lambda *a, **kw: calls.append(1))
    q, k, v = bhsd(h=h, h_k=h_k, s_q=s_q, s_k=s_k, seed=seed_from(s_q, s_k, h, is_causal))
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                          enable_gqa=h != h_k)
    assert calls == [1]
    assert out.shape == (2, h, s_q, 64) and out.transpose(1, 2).is_contiguous()
    _kernel_ref_check(q, k, v, out, is_causal, scale)
    if h == h_k:
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  is_causal=is_causal, scale=scale)
        assert (out.float() - expected).abs().max().item() < 5e-3


# ------------------------------------------------------------------------------------- GPU


KERNEL_CASES = [
    # (b, h, h_k, s_q, s_k, d, is_causal, scale, enable_gqa)
    (2, 4, 4, 1, 1, 64, False, None, False),
    (2, 4, 4, 1, 1, 128, True, None, False),
    (2, 4, 4, 7, 129, 64, True, None, False),
    (2, 4, 4, 129, 7, 128, True, None, False),
    (1, 2, 2, 1000, 1000, 64, True, None, False),
    (1, 2, 2, 1000, 1000, 128, False, 0.05, False),
    (2, 4, 4, 1, 2048, 64, True, None, False),
    (2, 4, 4, 1, 2048, 128, False, None, False),
    (2, 8, 2, 333, 1000, 128, True, None, True),
    (3, 8, 1, 200, 64, 64, True, None, True),
    (2, 6, 3, 128, 128, 64, False, 0.3, True),
    (4, 4, 4, 127, 128, 128, True, None, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_kernel_path_matches_reference(case):
    b, h, h_k, s_q, s_k, d, is_causal, scale, enable_gqa = case
    q, k, v = bhsd(b, h, h_k, s_q, s_k, d, device="cuda", seed=seed_from(*case))
    assert fa.why_not_supported(q, k, v, None, 0.0, is_causal, scale=scale,
                                enable_gqa=enable_gqa) is None
    with fa.strict(), poisoned_cuda_memory():  # strict: raises if it would fall back
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    assert out.shape == (b, h, s_q, d) and out.dtype == torch.float16
    _kernel_ref_check(q, k, v, out, is_causal, scale)
    # Same semantics as torch's SDPA (top-left causal, GQA mapping) in float32.
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    ref, _ = attention_ref(q, k, v, causal=is_causal, causal_bottom_right=False,
                           softmax_scale=scale, layout="bhsd")
    assert (expected.double() - ref).abs().max().item() < 1e-3  # the reference agrees with torch


@pytest.mark.gpu
def test_gpu_kernel_path_hf_style_views():
    # (B, S, H*D) projections viewed as (B, S, H, D) and transposed to BHSD, as HF models do.
    b, s, h, h_k, d = 2, 300, 8, 2, 64
    x = torch.randn(b, s, (h + 2 * h_k) * d, device="cuda", dtype=torch.float16)
    q = x[..., :h * d].view(b, s, h, d).transpose(1, 2)
    k = x[..., h * d:(h + h_k) * d].view(b, s, h_k, d).transpose(1, 2)
    v = x[..., (h + h_k) * d:].view(b, s, h_k, d).transpose(1, 2)
    assert fa.why_not_supported(q, k, v, is_causal=True, enable_gqa=True) is None
    with poisoned_cuda_memory():
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    _kernel_ref_check(q, k, v, out, True)


def _gpu_fallback_cases():
    return [
        ("fp32", {"dtype": torch.float32}, "float32"),
        ("bf16", {"dtype": torch.bfloat16}, "bfloat16"),
        ("head_dim_12", {"d": 12}, "head_dim must be a multiple of 8 from 8 to "),
        ("head_dim_264", {"d": 264}, "got 264"),
        ("3d", {"three_d": True}, "3-D"),
        ("causal_unequal_fp32", {"is_causal": True, "s_q": 5, "s_k": 11,
                                 "dtype": torch.float32}, "float32"),
        ("scale_negative", {"scale": -0.5}, "scale must be a finite number > 0"),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("name,spec,reason", _gpu_fallback_cases(),
                         ids=[c[0] for c in _gpu_fallback_cases()])
def test_gpu_fallback_equals_torch(name, spec, reason):
    args, kwargs = _build_call(spec, device="cuda", seed=seed_from(name))
    assert reason in fa.why_not_supported(*args, **kwargs)
    assert assert_same_as_torch(args, kwargs) is not None
    with fa.strict(), pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        fa.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.gpu
def test_gpu_dropout_runs_on_the_kernel_with_its_backward_at_every_head_dim(op_calls):
    # dropout_p in [0, 1) runs on the kernel (its own generator: tests/test_dropout.py), its
    # backward too, at head_dim 256 as well.
    q, k, v = bhsd(2, 4, 4, 64, 64, 64, device="cuda")
    assert fa.why_not_supported(q, k, v, dropout_p=0.2) is None
    torch.manual_seed(7)
    out = fa.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    torch.manual_seed(7)
    assert torch.equal(out, fa.scaled_dot_product_attention(q, k, v, dropout_p=0.2,
                                                            is_causal=True))
    assert op_calls == []  # fwd itself is not called: dropout runs fwd_dropout
    assert not torch.equal(out, fa.scaled_dot_product_attention(q, k, v, is_causal=True))
    # head_dim 256 with a backward (its dK/dV kernel's dropout tile): the kernel, reproducible
    q2, k2, v2 = (t.requires_grad_() for t in bhsd(2, 4, 4, 64, 64, 256, device="cuda"))
    assert fa.why_not_supported(q2, k2, v2, dropout_p=0.2) is None
    grads = []
    for _ in range(2):
        torch.manual_seed(7)
        out = fa.scaled_dot_product_attention(q2, k2, v2, dropout_p=0.2, is_causal=True)
        grads.append(torch.autograd.grad(out.float().sum(), (q2, k2, v2)))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_requires_grad_backward_matches_torch():
    # The kernel path, whose grads must match torch's up to fp16 accuracy.
    q, k, v = (t.requires_grad_() for t in bhsd(2, 4, 4, 64, 64, 64, device="cuda"))
    assert fa.why_not_supported(q, k, v) is None
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        # Equal up to fp16 rounding and summation order (atomics); a wrong gradient is O(1) off.
        assert torch.allclose(g.float(), t.grad.float(), atol=1e-2, rtol=2e-2)
    with torch.no_grad():  # no grad needed: the kernel runs
        assert fa.why_not_supported(q, k, v) is None


@pytest.mark.gpu
def test_gpu_fallback_heads_mismatch_raises_like_torch():
    q, k, v = bhsd(2, 8, 2, 16, 16, 64, device="cuda")
    assert "enable_gqa=False" in fa.why_not_supported(q, k, v)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    assert_same_as_torch((q, k, v), {})


@pytest.mark.gpu
def test_gpu_fallback_misaligned_and_odd_strides():
    q, k, v = bhsd(2, 4, 4, 32, 32, 64, device="cuda")
    flat = torch.empty(q.numel() + 4, dtype=torch.float16, device="cuda")
    q_mis = flat[4:].view(q.shape).copy_(q)
    assert "query must be 16-byte aligned" in fa.why_not_supported(q_mis, k, v)
    k_odd = torch.zeros(2, 4, 32, 68, dtype=torch.float16, device="cuda")[..., :64].copy_(k)
    assert "key must be 16-byte aligned with batch/seq/head strides divisible by 8" in (
        fa.why_not_supported(q, k_odd, v))
    for args in [(q_mis, k, v), (q, k_odd, v)]:
        assert assert_same_as_torch(args, {}) is not None


@pytest.mark.gpu
def test_gpu_empty_query_runs_the_op_and_value_head_dim_falls_back():
    q, k, v = bhsd(2, 4, 4, 16, 16, 64, device="cuda")
    empty = q[:, :, :0]
    assert fa.why_not_supported(empty, k, v) is None  # the op returns the empty result
    out = fa.scaled_dot_product_attention(empty, k, v)
    assert out.shape == (2, 4, 0, 64) and out.dtype == torch.float16 and out.is_cuda
    v128 = torch.randn(2, 4, 16, 128, device="cuda", dtype=torch.float16)
    assert "must have the same shape" in fa.why_not_supported(q, k, v128)
    assert_same_as_torch((q, k, v128), {})


@pytest.mark.gpu
def test_gpu_mixed_devices_fall_back_to_torch_error():
    q, k, v = bhsd(2, 4, 4, 16, 16, 64, device="cuda")
    assert "key must be on the same device as query" in fa.why_not_supported(q, k.cpu(), v)
    assert_same_as_torch((q, k.cpu(), v), {})


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_gpu_compile_kernel_path(backend):
    torch._dynamo.reset()
    q, k, v = bhsd(2, 8, 2, 100, 100, 64, device="cuda")

    def f(q, k, v):
        return fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    assert torch.equal(out, f(q, k, v))
    _kernel_ref_check(q, k, v, out, True)


# ------------------------------------------- attn_mask: key ranges run on the kernel (CPU + GPU)


def _range_mask(kind, b, h, s_q, s_k, dtype, device):
    """(mask, leftpad_k, seqused_k, causal_bottom_right) for mask kinds the kernel runs."""
    lo = torch.tensor([0, 3][:b] + [0] * max(0, b - 2), device=device)
    hi = torch.tensor([s_k, s_k - 2][:b] + [s_k] * max(0, b - 2), device=device)
    j = torch.arange(s_k, device=device)
    pad = (j >= lo[:, None]) & (j < hi[:, None])  # (b, s_k): left and right key padding
    causal = False
    if kind == "key_padding_bool":
        mask = pad[:, None, None, :]
    elif kind == "key_padding_float":
        mask = torch.zeros(b, 1, 1, s_k, dtype=dtype, device=device).masked_fill(
            ~pad[:, None, None, :], float("-inf"))
    elif kind == "all_true_2d":
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
        lo, hi = torch.zeros_like(lo), torch.full_like(hi, s_k)
    elif kind == "all_zero_float_4d":
        mask = torch.zeros(b, h, s_q, s_k, dtype=dtype, device=device)
        lo, hi = torch.zeros_like(lo), torch.full_like(hi, s_k)
    elif kind == "bottom_right_causal_2d":
        i = torch.arange(s_q, device=device)[:, None]
        mask = j[None, :] <= i + (s_k - s_q)
        lo, hi, causal = torch.zeros_like(lo), torch.full_like(hi, s_k), True
    else:
        raise ValueError(kind)
    return mask, lo.to(torch.int32), hi.to(torch.int32), causal


MASK_KINDS = ["key_padding_bool", "key_padding_float", "all_true_2d", "all_zero_float_4d",
              "bottom_right_causal_2d"]


def _masked_ref_check(q, k, v, out, lo, hi, causal, scale=None):
    kw = dict(causal=causal, causal_bottom_right=True, softmax_scale=scale, layout="bhsd",
              leftpad_k=lo, seqused_k=hi)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_fa(out, ref, pt)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_that_is_a_key_range_runs_the_kernel_cpu(kind, kernel_device_cpu, op_calls):
    q, k, v = bhsd(h=4, h_k=2, s_q=7, s_k=12, seed=seed_from(kind))
    mask, lo, hi, causal = _range_mask(kind, 2, 4, 7, 12, q.dtype, "cpu")
    assert fa.why_not_supported(q, k, v, attn_mask=mask, enable_gqa=True) is None
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert len(op_calls) == 1
    _masked_ref_check(q, k, v, out, lo, hi, causal)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float16, torch.float32])
@pytest.mark.parametrize("stored", ["one_row", "a_row_per_batch"])
def test_an_expanded_mask_is_classified_on_the_values_it_holds(dtype, stored, monkeypatch,
                                                               kernel_device_cpu, op_calls):
    # torch's SDPA callers expand() a padding mask to (B, H, Sq, Sk) as a view of what it holds.
    # Classifying it must work on those values, not on temporaries of the view's whole size (a
    # (4, 16, 8192, 8192) view of one row would cost GiBs of device memory), and answer as the
    # unexpanded mask does.
    b, h, s_q, s_k = 2, 4, 33, 40
    q, k, v = bhsd(b=b, h=h, h_k=h, s_q=s_q, s_k=s_k, seed=seed_from(stored, str(dtype)))
    keep = torch.arange(s_k)[None, :] < torch.tensor([23, 40])[:, None]  # (b, s_k) key padding
    if stored == "one_row":
        keep = keep[:1]
    held = keep if dtype == torch.bool else (
        torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")))
    held = held.view(keep.shape[0], 1, 1, s_k)
    view = held.expand(b, h, s_q, s_k)
    seen = []
    real = _masks._invalid_reason
    monkeypatch.setattr(_masks, "_invalid_reason",
                        lambda mask, invalid: seen.append(mask.numel()) or real(mask, invalid))
    _masks.clear_caches()
    outs = []
    for mask in (held, view):
        assert fa.why_not_supported(q, k, v, attn_mask=mask) is None
        outs.append(fa.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert seen and all(n == held.numel() for n in seen), (seen, held.numel())
    assert len(op_calls) == 2 and torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], _sdpa64(q, k, v, view), atol=2e-3, rtol=0)


def _sdpa64(q, k, v, mask, **kw):
    """torch's SDPA in float64 (the definition, to ~1e-15), rounded to the inputs' dtype."""
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m,
                                          **kw).to(q.dtype)


@pytest.mark.parametrize("name", ["random_bool", "random_float", "random_float32_4d"])
def test_mask_that_is_not_a_key_range_runs_as_a_bias_cpu(name, kernel_device_cpu, op_calls):
    q, k, v = bhsd(s_q=7, s_k=12, seed=seed_from(name))
    g = torch.Generator().manual_seed(1)
    if name == "random_bool":
        mask = torch.rand(7, 12, generator=g) > 0.3
        mask[:, 0] = True
    elif name == "random_float":
        mask = torch.randn(7, 12, generator=g).half()
    else:
        mask = torch.randn(2, 1, 7, 12, generator=g)
    assert fa.why_not_supported(q, k, v, attn_mask=mask) is None
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(op_calls) == 1 and op_calls[0][12] is mask  # read in place, not expanded
    torch.testing.assert_close(out, _sdpa64(q, k, v, mask))


def test_mask_that_requires_grad_runs_as_a_bias_with_its_gradient_cpu(kernel_device_cpu):
    """A learned mask (a relative-position bias) is never turned into key ranges, which would
    drop it from the graph: it reaches the kernel as a bias, even all zeros (a key range's
    look), and its gradient is torch's."""
    q, k, v = bhsd(s_q=7, s_k=12, seed=3)
    g = torch.Generator().manual_seed(4)
    for init in (torch.zeros(7, 12), torch.randn(2, 1, 7, 12, generator=g)):
        mask = init.half().requires_grad_(True)
        assert fa.why_not_supported(q, k, v, attn_mask=mask) is None
        with fa.strict():
            out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        dout = torch.randn(out.shape, generator=g).half()
        (got,) = torch.autograd.grad(out, mask, dout)
        leaf = init.double().requires_grad_(True)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=leaf)
        (want,) = torch.autograd.grad(ref, leaf, dout.double())
        assert got.dtype == torch.float16 and got.shape == mask.shape
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
        assert want.abs().max() > 0.1


def test_mask_under_torch_compile_runs_as_a_bias(kernel_device_cpu):
    # No host read of the mask while tracing: the op reads it at run time (fullgraph).
    q, k, v = bhsd(s_q=5, s_k=9)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(fa.scaled_dot_product_attention, fullgraph=True, backend=backend)
    out = f(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, _sdpa64(q, k, v, mask))
    mask[0, ..., :3] = False  # the compiled graph reads the new values
    torch.testing.assert_close(f(q, k, v, attn_mask=mask), _sdpa64(q, k, v, mask))
    calls = [n for n in graphs[0].graph.nodes if "flash_attention_sm75" in str(n.target)]
    assert len(graphs) == 1 and len(calls) == 1 and calls[0].kwargs.get("attn_bias") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_mask_that_is_a_key_range_runs_the_kernel(kind, d):
    q, k, v = bhsd(b=2, h=8, h_k=2, s_q=67, s_k=200, d=d, device="cuda",
                   seed=seed_from(kind, d))
    mask, lo, hi, causal = _range_mask(kind, 2, 8, 67, 200, q.dtype, "cuda")
    assert fa.why_not_supported(q, k, v, attn_mask=mask, enable_gqa=True) is None
    with poisoned_cuda_memory():
        out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    _masked_ref_check(q, k, v, out, lo, hi, causal)


@pytest.mark.parametrize("name", ["finfo_min_batch_row", "finfo_min_causal_rows"])
def test_rows_hidden_by_a_finite_minimum_follow_torch(name, kernel_device_cpu, op_calls):
    # torch adds the same finite minimum to every score of such a row: its softmax is finite
    # (not an empty row). Such masks are no key range; the kernel reads them as a bias and
    # gives the definition's finite result there.
    fmin = torch.finfo(torch.float16).min
    if name == "finfo_min_batch_row":
        q, k, v = bhsd(h=2, h_k=2, s_q=5, s_k=7, seed=21)
        mask = torch.zeros(2, 1, 1, 7, dtype=torch.float16)
        mask[0] = fmin                # batch row 0: every key hidden by the finite minimum
        mask[1, ..., 5:] = fmin       # batch row 1: ordinary key padding
    else:
        q, k, v = bhsd(b=1, h=1, h_k=1, s_q=7, s_k=5, seed=22)
        allowed = torch.ones(7, 5, dtype=torch.bool).tril(5 - 7)  # rows 0-1 see no key
        mask = torch.zeros(7, 5, dtype=torch.float16).masked_fill(~allowed, fmin)
    assert fa.why_not_supported(q, k, v, attn_mask=mask) is None
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(op_calls) == 1 and torch.isfinite(out).all()
    torch.testing.assert_close(out, _sdpa64(q, k, v, mask))
    # the same rows hidden by -inf are empty to torch too: the kernel runs and gives 0 there
    inf_mask = mask.masked_fill(mask == fmin, float("-inf"))
    assert fa.why_not_supported(q, k, v, attn_mask=inf_mask) is None


@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("kernel_path", [False, True])
def test_causal_bias_masks_are_torch_s(variant, kernel_path, monkeypatch):
    """torch.nn.attention.bias.causal_upper_left / causal_lower_right: tensor subclasses whose
    storage is not the mask (torch's SDPA hands them the call). The wrapper read their storage
    as a mask (a wrong result on the kernel path) or crashed on its fallback path
    (AttributeError); it hands them to torch now."""
    from torch.nn.attention import bias as attn_bias
    if kernel_path:
        monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", "cpu")
    q, k, v = bhsd(b=2, h=2, h_k=2, s_q=5, s_k=9, seed=31)
    mask = getattr(attn_bias, f"causal_{variant}")(5, 9)
    reason = fa.why_not_supported(q, k, v, attn_mask=mask)
    assert reason is not None and "CausalBias" in reason
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    allowed = torch.ones(5, 9, dtype=torch.bool).tril(0 if variant == "upper_left" else 9 - 5)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    with fa.strict(), pytest.raises(ValueError, match="CausalBias"):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("name", ["mask_heads_3_of_2", "mask_heads_kv_under_gqa", "mask_1d"])
def test_masks_torch_rejects_are_left_to_torch(name, kernel_device_cpu):
    if name == "mask_heads_3_of_2":
        q, k, v = bhsd(h=2, h_k=2, s_q=5, s_k=7)
        mask, gqa = torch.ones(2, 3, 1, 7, dtype=torch.bool), False
    elif name == "mask_heads_kv_under_gqa":
        q, k, v = bhsd(h=4, h_k=2, s_q=5, s_k=7)
        mask, gqa = torch.ones(2, 2, 1, 7, dtype=torch.bool), True
    else:
        q, k, v = bhsd(s_q=5, s_k=7)
        mask, gqa = torch.ones(7, dtype=torch.bool), False
    assert fa.why_not_supported(q, k, v, attn_mask=mask, enable_gqa=gqa) is not None
    with pytest.raises(Exception) as theirs:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    with pytest.raises(type(theirs.value)):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


@pytest.mark.parametrize("enable_gqa", [1, 0, "no", "", None, torch.tensor(True)])
def test_non_bool_enable_gqa_raises_like_torch_on_the_kernel_path(enable_gqa, kernel_device_cpu):
    # A truthy string must not switch grouped-query attention on: torch raises TypeError for
    # any non-bool, and the wrapper hands such a call to torch rather than reading its truth.
    q, k, v = bhsd(h=4, h_k=2)
    for kk, vv in ((k, v), (q, q)):
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, kk, vv, enable_gqa=enable_gqa)
        with pytest.raises(TypeError):
            fa.scaled_dot_product_attention(q, kk, vv, enable_gqa=enable_gqa)
    assert "enable_gqa is a" in fa.why_not_supported(q, k, v, enable_gqa=enable_gqa)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_causal_with_a_mask_that_requires_grad_raises_like_torch(mode):
    # torch refuses is_causal with an attn_mask on the backend such a mask selects; the fallback
    # must not swap the mask for a copy that selects another backend and returns a value.
    q, k, v = bhsd(s_q=5, s_k=7)
    mask = torch.zeros(5, 7).requires_grad_()
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        try:
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match=re.escape(str(e)[:40])):
                fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        else:
            got = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
            assert torch.equal(got, want)


def test_mask_on_another_device_is_a_clear_error(kernel_device_cpu):
    q, k, v = bhsd(s_q=3, s_k=3)
    mask = torch.zeros(3, 3, dtype=torch.bool, device="meta")
    assert "attn_mask is on meta" in fa.why_not_supported(q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match="attn_mask is on meta but query is on cpu"):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
