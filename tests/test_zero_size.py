"""Zero-size inputs on every API: batch 0, num_heads 0 (with num_heads_k 0),
seqlen_q 0, seqlen_k 0, their combinations, GQA.

By the definition the result is empty, or, where there are query rows but no keys
(seqlen_k == 0), out = 0 and lse = -inf; gradients are zeros of the inputs' shapes. The op
returns that before any launch (CUDA and CPU implementations, and the fake allocates the same),
the direct APIs and the backward pass it through, and the SDPA wrapper computes it itself on its
fallback paths (torch 2.11's SDPA crashes the process with SIGFPE for 0 heads on the CPU).
num_heads_k == 0 with num_heads >= 1 stays a ValueError naming num_heads_k.

CPU tests run everywhere; the ``gpu`` ones skip without a CUDA GPU.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attention_sm75 as fa
from flash_attention_sm75 import _rules, sdpa

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")

# (id, b, s_q, s_k, h, h_k)
CASES = [
    ("batch0", 0, 5, 7, 4, 2),
    ("heads0", 2, 5, 7, 0, 0),
    ("q_heads0_gqa", 2, 5, 7, 0, 2),
    ("seqlen_q0", 2, 0, 7, 4, 2),
    ("seqlen_k0", 2, 5, 0, 4, 2),
    ("seqlen_k0_mha_s1", 3, 1, 0, 2, 2),  # seqlen_q 1: the decode kernel's shape on CUDA
    ("seqlen_k0_mqa", 1, 9, 0, 8, 1),
    ("seqlen_q0_k0", 2, 0, 0, 4, 4),
    ("batch0_heads0", 0, 5, 7, 0, 0),
    ("batch0_seqlen_k0", 0, 5, 0, 4, 1),
    ("all0", 0, 0, 0, 0, 0),
]
IDS = [c[0] for c in CASES]
MODES = {"none": (False, True), "bottom_right": (True, True), "top_left": (True, False)}


def bshd(b, s_q, s_k, h, h_k, d=64, device="cpu", requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g).half().to(device)
    k = torch.randn(b, s_k, h_k, d, generator=g).half().to(device)
    v = torch.randn(b, s_k, h_k, d, generator=g).half().to(device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def check_fwd_result(out, lse, b, s_q, h, d, device):
    """Shapes, dtypes, layout (contiguous BSHD out, contiguous lse) and values: out 0, lse -inf
    (every query row of a zero-size problem sees no key)."""
    assert out.shape == (b, s_q, h, d) and out.dtype == torch.float16
    assert lse.shape == (b, h, s_q) and lse.dtype == torch.float32
    assert out.device.type == device and lse.device.type == device
    assert out.is_contiguous() and lse.is_contiguous()
    assert torch.equal(out.cpu(), torch.zeros(b, s_q, h, d, dtype=torch.float16))
    assert torch.isneginf(lse).all()


def check_zero_grads(grads, inputs):
    for name, g, t in zip(("dq", "dk", "dv"), grads, inputs):
        assert g is not None, name
        assert g.shape == t.shape and g.dtype == t.dtype and g.device == t.device, name
        assert torch.equal(g.cpu(), torch.zeros(t.shape, dtype=t.dtype)), name


# ------------------------------------------------------------------------------ the op (CPU)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_cpu(case, d, mode):
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bshd(b, s_q, s_k, h, h_k, d)
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, *MODES[mode])
    check_fwd_result(out, lse, b, s_q, h, d, "cpu")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_cpu_with_key_ranges_and_strided_views(case):
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bshd(b, s_q, s_k, h, h_k)
    # BHSD storage as BSHD views (flash_attention_forward's layout), and per-batch key ranges
    lp = torch.zeros(b, dtype=torch.int32)
    su = torch.full((b,), s_k, dtype=torch.int32)
    qv, kv, vv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    out, lse = torch.ops.flash_attention_sm75.fwd(qv, kv, vv, 0.5, True, True, lp, su)
    check_fwd_result(out, lse, b, s_q, h, 64, "cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # fake CUDA tensors need no GPU
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fake_allocates_what_the_op_returns(case, device):
    _, b, s_q, s_k, h, h_k = case
    real = torch.ops.flash_attention_sm75.fwd(*bshd(b, s_q, s_k, h, h_k), None, True, True)
    with FakeTensorMode():
        q = torch.empty(b, s_q, h, 64, dtype=torch.float16, device=device)
        k = torch.empty(b, s_k, h_k, 64, dtype=torch.float16, device=device)
        out, lse = torch.ops.flash_attention_sm75.fwd(q, k, k, None, True, True)
    for r, f in zip(real, (out, lse)):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
        assert f.device.type == device


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bwd_op_cpu(case, with_dlse):
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bshd(b, s_q, s_k, h, h_k)
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True)
    dout = torch.randn(out.shape).half()
    dlse = torch.randn(lse.shape) if with_dlse else None
    grads = torch.ops.flash_attention_sm75.bwd(dout, q, k, v, out, lse, 0.125, True, True, None,
                                                None, False, dlse)
    check_zero_grads(grads, (q, k, v))
    for g in grads:
        assert g.is_contiguous()


@pytest.mark.parametrize("case", CASES[:4], ids=IDS[:4])
def test_opcheck(case):
    _, b, s_q, s_k, h, h_k = case
    result = torch.library.opcheck(torch.ops.flash_attention_sm75.fwd.default,
                                   bshd(b, s_q, s_k, h, h_k), {"is_causal": True})
    assert set(result.values()) == {"SUCCESS"}, result


# -------------------------------------------------------------------------- direct APIs


API = {
    "flash_attn_func": lambda q, k, v, causal: fa.flash_attn_func(q, k, v, causal=causal,
                                                                   return_lse=True),
    "flash_attention_forward": lambda q, k, v, causal: _bhsd_api(q, k, v, causal),
}


def _bhsd_api(q, k, v, causal):
    out, lse = fa.flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), causal=causal, return_lse=True)
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # BHSD
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("api", list(API))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_direct_apis_forward_and_backward(case, api, causal):
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bshd(b, s_q, s_k, h, h_k, requires_grad=True)
    out, lse = API[api](q, k, v, causal)
    check_fwd_result(out.detach(), lse.detach(), b, s_q, h, 64, "cpu")
    assert out.requires_grad and out.grad_fn is not None  # autograd connected
    # loss.backward() works and gives zero gradients of the inputs' shapes (lse enters too:
    # its finite part is empty, so its gradient is 0)
    loss = out.float().sum() + lse.masked_fill(torch.isinf(lse), 0).sum()
    loss.backward()
    check_zero_grads((q.grad, k.grad, v.grad), (q, k, v))


@pytest.mark.parametrize("api", list(API))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_direct_apis_without_grad(case, api):
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bshd(b, s_q, s_k, h, h_k)
    with torch.inference_mode():
        out, lse = API[api](q, k, v, True)
    check_fwd_result(out, lse, b, s_q, h, 64, "cpu")


# num_heads_k == 0 with num_heads >= 1: a ValueError naming num_heads_k, never a division by zero
# (a SIGFPE would end the test process).
KV_HEADS_ZERO = [(2, 5, 7, 4), (0, 5, 7, 4), (2, 0, 0, 1), (2, 5, 0, 8)]  # (b, s_q, s_k, h)
KV0_MSG = r"^flash_attention_sm75: num_heads_k must be >= 1 when num_heads >= 1"


@pytest.mark.parametrize("b,s_q,s_k,h", KV_HEADS_ZERO)
def test_kv_heads_zero_under_q_heads_raises_on_every_api(b, s_q, s_k, h):
    q, k, v = bshd(b, s_q, s_k, h, 0)
    with pytest.raises(ValueError, match=KV0_MSG + rf".*got num_heads_k 0 and num_heads {h}$"):
        torch.ops.flash_attention_sm75.fwd(q, k, v)
    with pytest.raises(ValueError, match=KV0_MSG):
        fa.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=KV0_MSG + ".*in the BHSD layout"):
        fa.flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(ValueError, match=KV0_MSG):
        _rules.check_inputs(q, k, v)
    out = torch.zeros(q.shape, dtype=torch.float16)
    lse = torch.zeros(b, h, s_q)
    with pytest.raises(ValueError, match=KV0_MSG):
        torch.ops.flash_attention_sm75.bwd(out, q, k, v, out, lse, 0.125, False, True)


# ------------------------------------------------------------------------------ SDPA wrapper


def bhsd(b, h, h_k, s_q, s_k, d=64, d_v=None, dtype=torch.float16, device="cpu",
         requires_grad=False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, s_q, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(b, h_k, s_k, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(b, h_k, s_k, d_v or d, generator=g).to(dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


@pytest.fixture(autouse=True)
def _no_strict(monkeypatch):
    monkeypatch.delenv(sdpa.STRICT_ENV_VAR, raising=False)
    monkeypatch.setattr(sdpa, "_strict_override", None)


@pytest.fixture
def no_torch_sdpa(monkeypatch):
    """Fail if the wrapper hands the call to torch's SDPA (which crashes for some of these)."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch's SDPA was called with a zero-size input")

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", refuse)


def check_sdpa_result(out, shape, dtype, device="cpu"):
    assert out.shape == shape and out.dtype == dtype and out.device.type == device
    assert torch.equal(out.detach().cpu(), torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"dropout_p": 0.5}, {"scale": 0.3},
                                {"attn_mask": "bool"}, {"attn_mask": "float"}],
                         ids=["plain", "causal", "dropout", "scale", "bool_mask", "float_mask"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sdpa_fallback_returns_the_zero_result(case, dtype, kw, no_torch_sdpa):
    # CPU tensors (and float32 / bfloat16) fall back; a zero-size call must not reach torch's
    # SDPA (SIGFPE for 0 heads) and gives the definition's result with gradients.
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bhsd(b, h, h_k, s_q, s_k, d_v=32, dtype=dtype, requires_grad=True)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.ones(s_q, s_k, dtype=torch.bool)
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.zeros(b, 1, s_q, s_k, dtype=dtype)
    assert sdpa.why_not_supported(q, k, v, enable_gqa=h != h_k, **kw) is not None
    out = fa.scaled_dot_product_attention(q, k, v, enable_gqa=h != h_k, **kw)
    check_sdpa_result(out, (b, h, s_q, 32), dtype)
    out.float().sum().backward()
    check_zero_grads((q.grad, k.grad, v.grad), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c[4] > 0], ids=[c[0] for c in CASES if c[4] > 0])
def test_sdpa_fallback_equals_torch_where_torch_runs(case, dtype, monkeypatch):
    # torch's SDPA survives these (num_heads >= 1): the wrapper's own zero-size result has its
    # shape, dtype and values (zeros), without calling it.
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bhsd(b, h, h_k, s_q, s_k, dtype=dtype)
    torch_sdpa = F.scaled_dot_product_attention
    wants = [torch_sdpa(q, k, v, enable_gqa=h != h_k, **kw) for kw in ({}, {"is_causal": True})]
    calls = []
    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or torch_sdpa(*a, **kw))
    for kw, want in zip(({}, {"is_causal": True}), wants):
        got = fa.scaled_dot_product_attention(q, k, v, enable_gqa=h != h_k, **kw)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)
    assert calls == []


@pytest.mark.parametrize("shapes,enable_gqa,want", [
    # 4-D, 0 heads: torch's CPU SDPA dies with SIGFPE
    (((2, 0, 5, 64), (2, 0, 7, 64), (2, 0, 7, 64)), False, (2, 0, 5, 64)),
    (((2, 0, 5, 64), (2, 0, 7, 64), (2, 0, 7, 64)), True, (2, 0, 5, 64)),
    (((0, 0, 0, 64), (0, 0, 0, 64), (0, 0, 0, 64)), True, (0, 0, 0, 64)),
    (((2, 0, 5, 80), (2, 0, 7, 80), (2, 0, 7, 16)), False, (2, 0, 5, 16)),
    # enable_gqa with 0 in dim -3 (the heads torch divides by) in other ranks
    (((0, 5, 64), (0, 7, 64), (0, 7, 64)), True, (0, 5, 64)),
    (((2, 3, 0, 5, 64), (2, 3, 0, 7, 64), (2, 3, 0, 7, 64)), True, (2, 3, 0, 5, 64)),
    # q heads 0 under GQA with kv heads; a broadcast batch of 1 against 0
    (((2, 0, 5, 64), (2, 2, 7, 64), (2, 2, 7, 64)), True, (2, 0, 5, 64)),
    (((1, 2, 5, 64), (0, 2, 7, 64), (0, 2, 7, 64)), False, (0, 2, 5, 64)),
    # no keys: zeros
    (((2, 4, 5, 64), (2, 2, 0, 64), (2, 2, 0, 32)), True, (2, 4, 5, 32)),
    (((5, 64), (0, 64), (0, 64)), False, (5, 64)),
], ids=["heads0", "heads0_gqa", "all0_gqa", "heads0_hdim80", "3d_batch0_gqa", "5d_heads0_gqa",
        "q_heads0_gqa", "broadcast_batch0", "no_keys_gqa", "2d_no_keys"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_sdpa_wrapper_never_crashes_on_shapes_torch_dies_on(shapes, enable_gqa, want, dtype,
                                                            no_torch_sdpa):
    q, k, v = (torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes)
    out = fa.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
    check_sdpa_result(out, want, dtype)
    out.sum().backward()
    check_zero_grads((q.grad, k.grad, v.grad), (q, k, v))


def test_sdpa_zero_kv_heads_under_q_heads_is_a_value_error():
    for shapes in (((2, 4, 5, 64), (2, 0, 7, 64)), ((0, 4, 5, 64), (0, 0, 7, 64)),
                   ((3, 5, 64), (0, 7, 64)), ((2, 1, 4, 5, 64), (2, 1, 0, 7, 64))):
        q, k = torch.randn(shapes[0]), torch.randn(shapes[1])
        with pytest.raises(ValueError, match=r"key has 0 heads .* but query has [1-9]"):
            fa.scaled_dot_product_attention(q, k, k, enable_gqa=True)


def test_sdpa_zero_size_mismatches_still_raise():
    # Shapes torch rejects are rejected on the zero-size path too (no silent empty result).
    q, k, v = bhsd(0, 4, 2, 5, 7)
    with pytest.raises(RuntimeError):
        fa.scaled_dot_product_attention(q, k, v)  # 4 vs 2 heads without enable_gqa
    with pytest.raises(RuntimeError):
        fa.scaled_dot_product_attention(q, k[..., :32], v)  # head_dim 64 vs 32
    with pytest.raises(RuntimeError, match="same floating-point dtype"):
        fa.scaled_dot_product_attention(q, k.float(), v, enable_gqa=True)  # dtypes differ
    with pytest.raises(RuntimeError, match="same floating-point dtype"):
        fa.scaled_dot_product_attention(*(t.long() for t in (q, k, v)))
    with pytest.raises(RuntimeError, match="on one device"):
        fa.scaled_dot_product_attention(q, k.to("meta"), v)
    with pytest.raises(RuntimeError):
        fa.scaled_dot_product_attention(q[:, :3], k, v, enable_gqa=True)  # 3 % 2 heads


@pytest.mark.parametrize("kw", [dict(is_causal=0.5), dict(dropout_p="x"), dict(scale="a"),
                                dict(attn_mask=[1])], ids=["is_causal", "dropout_p", "scale",
                                                           "attn_mask"])
def test_sdpa_zero_size_with_badly_typed_arguments_raises_torchs_type_error(kw):
    # torch's argument parser rejects these before any arithmetic (no crash): its TypeError.
    q, k, v = bhsd(2, 0, 0, 5, 7)
    with pytest.raises(TypeError):
        fa.scaled_dot_product_attention(q, k, v, **kw)


@pytest.fixture
def kernel_device_cpu(monkeypatch):
    """The kernel path's rules for CPU tensors (the op's CPU implementation runs)."""
    monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", "cpu")


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sdpa_kernel_path_runs_the_op(case, strict, kernel_device_cpu, op_calls, no_torch_sdpa):
    # float16 tensors on the kernel device: no reason to fall back (strict mode does not raise),
    # the op runs and returns the zero result, with gradients.
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bhsd(b, h, h_k, s_q, s_k, requires_grad=True)
    gqa = h != h_k
    assert sdpa.why_not_supported(q, k, v, enable_gqa=gqa, is_causal=True) is None
    with fa.strict(strict):
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    assert len(op_calls) == 1
    check_sdpa_result(out, (b, h, s_q, 64), torch.float16)
    out.float().sum().backward()
    check_zero_grads((q.grad, k.grad, v.grad), (q, k, v))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sdpa_kernel_path_with_a_mask(case, mask_dtype, kernel_device_cpu, no_torch_sdpa):
    # A key-range-capable mask on the kernel path: nothing for it to select, the zero result.
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bhsd(b, h, h_k, s_q, s_k, requires_grad=True)
    mask = torch.ones(b, 1, s_q, s_k, dtype=torch.bool)
    if mask_dtype != torch.bool:
        mask = torch.zeros(b, 1, s_q, s_k, dtype=mask_dtype)
    with fa.strict():
        out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != h_k)
    check_sdpa_result(out, (b, h, s_q, 64), torch.float16)
    out.float().sum().backward()
    check_zero_grads((q.grad, k.grad, v.grad), (q, k, v))


def test_sdpa_strict_mode_still_raises_for_cpu_zero_size():
    q, k, v = bhsd(0, 4, 4, 5, 7)
    with fa.strict(), pytest.raises(ValueError, match="query must be a CUDA tensor"):
        fa.scaled_dot_product_attention(q, k, v)


def test_compiled_flash_attn_func_with_zero_batch():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True),
                      backend="aot_eager", fullgraph=True)
    q, k, v = bshd(0, 5, 7, 4, 2)
    assert f(q, k, v).shape == (0, 5, 4, 64)
    q, k, v = bshd(2, 5, 0, 4, 2)
    out = f(q, k, v)
    assert out.shape == (2, 5, 4, 64) and torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_op_forward_and_backward(case, d, mode):
    # mha_fwd / mha_bwd return before any launch (a grid of size 0 is a CUDA error).
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bshd(b, s_q, s_k, h, h_k, d, device="cuda", requires_grad=True)
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, *MODES[mode])
    torch.cuda.synchronize()
    check_fwd_result(out.detach(), lse.detach(), b, s_q, h, d, "cuda")
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    check_zero_grads(grads, (q, k, v))
    for api in API.values():
        out, lse = api(q.detach(), k.detach(), v.detach(), True)
        check_fwd_result(out, lse, b, s_q, h, d, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_op_with_key_ranges_and_decode_env(case, monkeypatch):
    _, b, s_q, s_k, h, h_k = case
    monkeypatch.setenv("FLASH_SM75_DECODE", "auto")
    q, k, v = bshd(b, s_q, s_k, h, h_k, device="cuda")
    lp = torch.zeros(b, dtype=torch.int32, device="cuda")
    su = torch.full((b,), s_k, dtype=torch.int32, device="cuda")
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True, lp, su)
    torch.cuda.synchronize()
    check_fwd_result(out, lse, b, s_q, h, 64, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_sdpa_wrapper(case, dtype, no_torch_sdpa):
    # float16: the kernel path (the op's early return); float32: the fallback's zero result.
    _, b, s_q, s_k, h, h_k = case
    q, k, v = bhsd(b, h, h_k, s_q, s_k, dtype=dtype, device="cuda", requires_grad=True)
    if dtype == torch.float16:
        assert fa.why_not_supported(q, k, v, enable_gqa=h != h_k) is None
    out = fa.scaled_dot_product_attention(q, k, v, enable_gqa=h != h_k, is_causal=True)
    check_sdpa_result(out, (b, h, s_q, 64), dtype, "cuda")
    out.float().sum().backward()
    check_zero_grads((q.grad, k.grad, v.grad), (q, k, v))
