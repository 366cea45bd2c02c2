"""Registration of torch.ops.flash_attention_sm75.fwd: schema, fake (meta) impl, opcheck,
torch.compile / torch.export, the autograd stub, and the package's exports. CPU only."""
import contextlib
import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attention_sm75 as fa
from flash_attention_sm75 import _ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_ext = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                               reason=f"extension not built: {fa.EXTENSION_ERROR}")

SCHEMA = ("flash_attention_sm75::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, "
          "bool is_causal=False, bool causal_bottom_right=True, Tensor? leftpad_k=None, "
          "Tensor? seqused_k=None, int window_size_left=-1, int window_size_right=-1, "
          "float softcap=0., Tensor? alibi_slopes=None, Tensor? attn_bias=None) -> "
          "(Tensor out, Tensor softmax_lse)")


def _op():
    return torch.ops.flash_attention_sm75.fwd


def qkv(b=2, s_q=5, s_k=7, h=4, h_k=2, d=64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g).half().to(device)
    k = torch.randn(b, s_k, h_k, d, generator=g).half().to(device)
    v = torch.randn(b, s_k, h_k, d, generator=g).half().to(device)
    return q, k, v


def test_extension_loaded():
    # Fails (rather than skips) when the compiled library is missing: everything else needs it.
    assert fa.EXTENSION_AVAILABLE, f"flash_attention_sm75._C failed to import: {fa.EXTENSION_ERROR}"
    assert fa.EXTENSION_ERROR is None
    assert isinstance(fa.EXTENSION_AVAILABLE, bool)


@needs_ext
def test_schema_matches_contract():
    assert str(_op().default._schema) == SCHEMA


# ------------------------------------------------------------------------------ fake impl


FAKE_CASES = [
    # (b, s_q, s_k, h, h_k, d, kwargs)
    (2, 5, 7, 4, 2, 64, {}),
    (1, 1, 300, 8, 1, 128, {"is_causal": True}),
    (3, 129, 17, 6, 3, 64, {"is_causal": True, "causal_bottom_right": False,
                            "softmax_scale": 0.5}),
]


@needs_ext
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("b,s_q,s_k,h,h_k,d,kwargs", FAKE_CASES)
def test_fake_shapes_dtypes_strides(b, s_q, s_k, h, h_k, d, kwargs, device):
    # Fake CUDA tensors need no GPU.
    with FakeTensorMode():
        q = torch.empty(b, h, s_q, d, dtype=torch.float16, device=device).transpose(1, 2)
        k = torch.empty(b, s_k, h_k, d, dtype=torch.float16, device=device)
        v = torch.empty(b, s_k, h_k, d, dtype=torch.float16, device=device)
        out, lse = _op()(q, k, v, **kwargs)
    assert out.shape == (b, s_q, h, d) and out.dtype == torch.float16
    assert out.stride() == torch.empty(b, s_q, h, d).stride()  # contiguous BSHD
    assert lse.shape == (b, h, s_q) and lse.dtype == torch.float32
    assert lse.stride() == torch.empty(b, h, s_q).stride()
    assert out.device.type == device and lse.device.type == device


@needs_ext
@pytest.mark.parametrize("layout", ["bshd", "bhsd_view", "sliced"])
def test_fake_matches_real_cpu_metadata(layout):
    q, k, v = qkv(2, 9, 12, 4, 2, 128)
    if layout == "bhsd_view":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "sliced":
        q = torch.cat([q, q], dim=1)[:, 3:12]
    real = _op()(q, k, v, None, True, False)
    mode = FakeTensorMode()
    fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
    with mode:
        fake = _op()(fq, fk, fv, None, True, False)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride(), r.device) == (f.shape, f.dtype, f.stride(), f.device)


@needs_ext
def test_meta_tensors():
    q, k, v = (t.to("meta") for t in qkv(2, 3, 4, 4, 4, 64))
    out, lse = _op()(q, k, v)
    assert out.device.type == "meta" and out.shape == (2, 3, 4, 64)
    assert lse.shape == (2, 4, 3) and lse.dtype == torch.float32


@needs_ext
@pytest.mark.parametrize("name", ["dim", "kv_shape", "batch", "head_dim_mismatch"])
def test_fake_checks_the_shapes_it_derives_outputs_from(name):
    # The fake checks shapes only (torch._check); what the kernels accept is the rulebook's
    # (tests/test_rules.py), asked by every public function before the op.
    q, k, v = qkv(2, 5, 7, 4, 2, 64)
    bad = {"dim": (q[0], k, v), "kv_shape": (q, k, v[:, :6]), "batch": (q[:1], k, v),
           "head_dim_mismatch": (q, k[..., :32], v[..., :32])}[name]
    mode = FakeTensorMode()
    fq, fk, fv = (mode.from_tensor(t) for t in bad)
    with mode, pytest.raises(RuntimeError, match="^flash_attention_sm75: "):
        _op()(fq, fk, fv)


@needs_ext
@pytest.mark.parametrize("name", ["k", "v", "seqused_k"])
def test_a_meta_tensor_among_real_ones_raises_instead_of_returning_garbage(name):
    # A meta tensor sends the call to the fake, which used to allocate outputs on q's device
    # and return them uninitialised.
    q, k, v = qkv(1, 3, 5, 2, 2, 64)
    args = {"k": k, "v": v, "seqused_k": torch.full((1,), 5, dtype=torch.int32)}
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} must be on the same device as q \\(cpu\\), got meta"):
        _op()(q, args["k"], args["v"], None, False, True, None, args["seqused_k"])
    out, lse = _op()(q, k, v)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="dout must be on the same device as q"):
        torch.ops.flash_attention_sm75.bwd(dout.to("meta"), q, k, v, out, lse, 0.125, False, True)


# ------------------------------------------------------------------------------- opcheck


OPCHECK_CASES = [
    ("basic", (2, 5, 7, 2, 2, 64), {}),
    ("gqa_causal_br", (2, 9, 4, 4, 2, 64), {"is_causal": True}),
    ("mqa_causal_tl", (1, 6, 11, 4, 1, 128), {"is_causal": True, "causal_bottom_right": False}),
    ("scale", (2, 3, 3, 2, 2, 128), {"softmax_scale": 0.25}),
    ("key_ranges", (3, 4, 10, 2, 1, 64),
     {"leftpad_k": torch.tensor([0, 2, 9], dtype=torch.int32),
      "seqused_k": torch.tensor([10, 8, 3], dtype=torch.int32), "is_causal": True}),
]


@needs_ext
@pytest.mark.parametrize("name,shape,kwargs", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
@pytest.mark.parametrize("bhsd", [False, True])
def test_opcheck(name, shape, kwargs, bhsd):
    q, k, v = qkv(*shape)
    if bhsd:  # transposed views, as flash_attention_forward passes them
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    result = torch.library.opcheck(_op().default, (q, k, v), kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


# -------------------------------------------------------------------- compile / export


@needs_ext
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_flash_attn_func(backend):
    torch._dynamo.reset()
    q, k, v = qkv(2, 6, 9, 4, 2, 64)

    def f(q, k, v):
        out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.float() * 2, lse

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out_c, lse_c = compiled(q, k, v)
    out_e, lse_e = f(q, k, v)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)


@needs_ext
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_flash_attention_forward_bhsd(backend):
    torch._dynamo.reset()
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv(2, 6, 9, 4, 2, 128))
    f = lambda q, k, v: fa.flash_attention_forward(q, k, v, causal=True, softmax_scale=0.2)  # noqa: E731
    out_c = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    out_e = f(q, k, v)
    assert torch.equal(out_c, out_e) and out_c.stride() == out_e.stride()


@needs_ext
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_raw_op_dynamic_shapes(backend):
    torch._dynamo.reset()

    def f(q, k, v, lp):
        out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, False, lp, None)
        return out + 1, lse

    compiled = torch.compile(f, fullgraph=True, backend=backend, dynamic=True)
    for s_q, s_k in [(5, 9), (8, 13), (3, 4)]:
        q, k, v = qkv(2, s_q, s_k, 4, 2, 64)
        lp = torch.tensor([0, 1], dtype=torch.int32)
        got, want = compiled(q, k, v, lp), f(q, k, v, lp)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_ext
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_sdpa_wrapper_cpu_fallback(backend):
    torch._dynamo.reset()
    q, k, v = (t.transpose(1, 2) for t in qkv(2, 6, 6, 4, 2, 64))

    def f(q, k, v):
        return fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out_c = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)
    assert torch.equal(out_c, expected)


@needs_ext
def test_compile_rejects_bad_input_at_trace_time():
    torch._dynamo.reset()
    q, k, v = qkv(1, 4, 4, 2, 2, 64)
    f = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, softmax_scale=-1.0),
                      fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        f(q, k, v)
    if "Observed exception" in str(info.value):
        # torch 2.6's dynamo raises Unsupported("Observed exception") for an exception raised in
        # traced user code, without its message (newer torch passes the message on).
        assert type(info.value).__name__ == "Unsupported"
    else:
        assert "softmax_scale must be a finite number > 0" in str(info.value)


@needs_ext
def test_export():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True)[0]

    q, k, v = qkv(2, 5, 7, 4, 2, 64)
    ep = torch.export.export(M(), (q, k, v))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.flash_attention_sm75.fwd.default in targets
    assert torch.equal(ep.module()(q, k, v), M()(q, k, v))


# ------------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("enabled", ["x", 1, None])
def test_deterministic_backward_takes_a_bool(enabled, monkeypatch):
    with pytest.raises(ValueError, match=r"deterministic_backward\(enabled\) must be a bool"):
        with fa.deterministic_backward(enabled):
            pass
    # Only FLASH_SM75_BWD_DQ=atomic makes the (CUDA) backward use atomics, and the context
    # manager (or torch.use_deterministic_algorithms) overrides it.
    monkeypatch.delenv("FLASH_SM75_BWD_DQ", raising=False)
    with fa.deterministic_backward(False):
        assert fa.is_deterministic_backward()
    monkeypatch.setenv("FLASH_SM75_BWD_DQ", "atomic")
    with fa.deterministic_backward(False):
        assert not fa.is_deterministic_backward()
        with fa.deterministic_backward():
            assert fa.is_deterministic_backward()
        assert not fa.is_deterministic_backward()


@needs_ext
@pytest.mark.parametrize("enabled", [True, False])
def test_deterministic_backward_reaches_other_threads(enabled, monkeypatch):
    # PyTorch runs the backward of CUDA tensors on its autograd device threads, not on the
    # thread that called backward(): the setting must reach the backward op from another
    # thread. Here the backward (of CPU tensors) runs on a worker thread while the block is
    # active on this one, and the op's `deterministic` argument is recorded.
    import threading

    real_bwd = torch.ops.flash_attention_sm75.bwd
    seen = []

    def recording_bwd(*args):
        seen.append(args[11])  # deterministic
        return real_bwd(*args)

    monkeypatch.setattr(torch.ops.flash_attention_sm75, "bwd", recording_bwd)
    q, k, v = (t.requires_grad_() for t in qkv(1, 8, 8, 2, 2, 64))
    out = fa.flash_attn_func(q, k, v)
    with fa.deterministic_backward(enabled):
        worker = threading.Thread(target=lambda: out.float().sum().backward())
        worker.start()
        worker.join()
    assert seen == [enabled]
    assert q.grad is not None and torch.isfinite(q.grad).all()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_op_ignores_autocast(dtype):
    # The CPU implementation computes with ATen ops: under torch.autocast its matmuls ran in
    # bfloat16 and the lse came out bfloat16 (then backward rejected it). Same results as
    # without autocast, lse float32, backward runs.
    q, k, v = (t.requires_grad_() for t in qkv(2, 9, 12, 4, 2, 64))
    with torch.autocast("cpu", dtype=dtype):
        out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    with torch.no_grad():
        want_out, want_lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    g = torch.randn_like(out)
    with torch.autocast("cpu", dtype=dtype):
        grads = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(
        torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True)[0], (q, k, v), g)
    for got, w in zip(grads, want):
        assert got.dtype == torch.float16 and torch.equal(got, w)


@needs_ext
@pytest.mark.parametrize("mode", ["none", "bottom_right", "top_left"])
@pytest.mark.parametrize("s_q,s_k,h,h_k", [(7, 13, 4, 2), (13, 13, 2, 2), (9, 20, 4, 1)])
def test_backward_cpu_matches_reference(s_q, s_k, h, h_k, mode):
    from reference import assert_close_fa, attention_ref

    is_causal, bottom_right = {"none": (False, True), "bottom_right": (True, True),
                               "top_left": (True, False)}[mode]
    q, k, v = (t.requires_grad_() for t in qkv(2, s_q, s_k, h, h_k, 64, seed=s_q + s_k))
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, is_causal, bottom_right)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    kw = dict(causal=is_causal, causal_bottom_right=bottom_right)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves64, **kw)[0], leaves64, g.double())
    leaves16 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pt = torch.autograd.grad(attention_ref(*leaves16, upcast=False, reorder_ops=True, **kw)[0],
                             leaves16, g)
    for name, ours, r, p in zip(("dq", "dk", "dv"), grads, ref, pt):
        assert ours.shape == r.shape and ours.dtype == torch.float16
        assert_close_fa(ours, r, p, name)


# ------------------------------------------------------ fast path below autograd (call_fwd)


def _public_paths(monkeypatch):
    """Every public function that calls the op, as ``name -> f(q, k, v) -> BSHD out`` on BSHD
    tensors, all causal. The SDPA wrapper's kernel branch is forced (it falls back for CPU
    tensors); its causal mask is top-left, so callers use seqlen_q == seqlen_k."""
    from flash_attention_sm75 import sdpa

    monkeypatch.setattr(sdpa, "_metadata_reason", lambda *a, **kw: None)

    def bhsd(f):
        return lambda q, k, v: f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 is_causal=True, enable_gqa=True).transpose(1, 2)

    return {
        "call_fwd": lambda q, k, v: _ops.call_fwd(q, k, v, None, True, True)[0],
        "flash_attn_func": lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True),
        "flash_attention_forward": lambda q, k, v: fa.flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2),
        "sdpa": bhsd(fa.scaled_dot_product_attention),
    }


PUBLIC_PATHS = ["call_fwd", "flash_attn_func", "flash_attention_forward", "sdpa"]


@pytest.fixture
def below_autograd(monkeypatch):
    """For every call that reaches the op: True if it was dispatched below the autograd layer."""
    seen = []
    real_op = torch.ops.flash_attention_sm75.fwd
    key = torch._C.DispatchKey.AutogradFunctionality

    def spy(*args):
        seen.append(torch._C._dispatch_tls_is_dispatch_key_excluded(key))
        return real_op(*args)

    monkeypatch.setattr(torch.ops.flash_attention_sm75, "fwd", spy)
    return seen


@needs_ext
@pytest.mark.parametrize("path", PUBLIC_PATHS)
def test_gradients_flow_when_inputs_require_grad(path, monkeypatch, below_autograd):
    # Fails if the no-grad fast path were taken while a gradient is needed: the result would
    # have no grad_fn and q, k, v no gradients. Eager calls run the op below autograd inside
    # the eager autograd function (_ops._eager_function), whose gradients must be the
    # registered formula's, bit for bit.
    f = _public_paths(monkeypatch)[path]
    q, k, v = (t.requires_grad_() for t in qkv(2, 7, 7, 4, 2, 64))
    out = f(q, k, v)
    assert len(below_autograd) == 1
    assert out.requires_grad and out.grad_fn is not None
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(real_fwd(q, k, v)[0], (q, k, v), g)
    for got, w in zip(grads, want):
        assert got.abs().max() > 0 and torch.equal(got, w)


@needs_ext
@pytest.mark.parametrize("path", PUBLIC_PATHS)
def test_output_modified_in_place_fails_the_backward_loudly(path, monkeypatch):
    # The backward reads the forward's output: modified in place, autograd's version check
    # refuses the backward (never a gradient of the modified values). The BHSD doors' output is
    # a view autograd records, transposed outside the eager autograd function.
    f = _public_paths(monkeypatch)[path]
    q, k, v = (t.requires_grad_() for t in qkv(2, 7, 7, 4, 2, 64))
    out = f(q, k, v)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


@needs_ext
@pytest.mark.parametrize("path", PUBLIC_PATHS)
def test_input_modified_in_place_fails_the_backward_with_the_version_error(path, monkeypatch):
    # The backward reads q, k, v: changed in place after the forward (a non-leaf, as a
    # projection's output is), autograd's version check must refuse the backward with its own
    # message, naming the modified tensor (the eager functions save the inputs themselves, not
    # views of them made without grad, whose error would point at a view the user never made).
    f = _public_paths(monkeypatch)[path]
    x = torch.randn(2, 7, 4, 64, dtype=torch.float16, requires_grad=True)
    q = x * 1
    k, v = (t.requires_grad_() for t in qkv(2, 7, 7, 4, 4, 64)[1:])
    out = f(q, k, v)
    with torch.no_grad():  # as an optimizer step between the forward and the backward
        q.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


@needs_ext
@pytest.mark.parametrize("path", PUBLIC_PATHS)
def test_double_backward_raises_on_every_door(path, monkeypatch):
    f = _public_paths(monkeypatch)[path]
    q, k, v = (t.requires_grad_() for t in qkv(1, 5, 5, 2, 2, 64))
    (dq,) = torch.autograd.grad(f(q, k, v).float().sum(), (q,), create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.float().sum().backward()


@needs_ext
def test_make_fx_traces_the_op_and_its_registered_formula():
    # Tracers without dynamo (make_fx, AOTAutograd) get the op through its registered autograd
    # kernel, not the eager function: a fwd and a bwd node, the eager gradients.
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (t.requires_grad_() for t in qkv(1, 5, 7, 4, 2, 64))
    g = torch.randn(1, 5, 4, 64, dtype=torch.float16)

    def step(q, k, v, g):
        out = fa.flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), g)

    gm = make_fx(step)(q, k, v, g)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.flash_attention_sm75.fwd.default in targets
    assert torch.ops.flash_attention_sm75.bwd.default in targets
    for got, want in zip(gm(q, k, v, g), step(q, k, v, g)):
        assert got.abs().max() > 0 and torch.equal(got, want)


@needs_ext
@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_jit_trace_records_the_op():
    # torch.jit.trace records dispatcher ops: with inputs that require grad the doors call the
    # op through its registered autograd kernel there, never the eager autograd function
    # (which the trace would not contain); the traced function keeps its gradients.
    q, k, v = (t.requires_grad_() for t in qkv(1, 5, 5, 2, 2, 64))
    traced = torch.jit.trace(lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, causal=True),
                             (q, k, v), check_trace=False)
    assert "flash_attention_sm75::fwd" in [n.kind() for n in traced.graph.nodes()]
    g = torch.randn(1, 5, 2, 64, dtype=torch.float16)
    got = torch.autograd.grad(traced(q, k, v), (q, k, v), g)
    want = torch.autograd.grad(real_fwd(q, k, v)[0], (q, k, v), g)
    for a, b in zip(got, want):
        assert a.abs().max() > 0 and torch.equal(a, b)


def real_fwd(q, k, v):
    # The op through its autograd kernel (what the fast path must be equivalent to).
    return torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, True)


@needs_ext
@pytest.mark.parametrize("path", PUBLIC_PATHS)
@pytest.mark.parametrize("context", ["no_input_requires_grad", "no_grad", "inference_mode"])
def test_fast_path_matches_the_op(path, context, monkeypatch, below_autograd):
    f = _public_paths(monkeypatch)[path]
    q, k, v = qkv(2, 7, 7, 4, 2, 64)
    if context != "no_input_requires_grad":
        q.requires_grad_()  # needs no gradient all the same: grad mode is off
    mode = {"no_input_requires_grad": contextlib.nullcontext, "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode}[context]
    with mode():
        out = f(q, k, v)
    assert below_autograd == [True]
    assert not out.requires_grad and out.grad_fn is None
    with torch.no_grad():
        want = real_fwd(q, k, v)[0]
    assert torch.equal(out, want)
    if path == "call_fwd":  # the lse as well
        with mode():
            lse = _ops.call_fwd(q, k, v, None, True, True)[1]
        assert torch.equal(lse, real_fwd(q.detach(), k, v)[1])


@needs_ext
def test_fast_path_not_taken_under_functorch(below_autograd):
    # torch.func transforms manage the autograd keys themselves: under vmap (which works, through
    # torch's per-sample fallback) call_fwd calls the op plainly; under grad it raises its own
    # error before the op (the op's error is torch's, about an autograd.Function).
    q, k, v = qkv(1, 3, 3, 2, 2, 64)
    qs = torch.stack([q, q.flip(1)])
    out = torch.func.vmap(lambda a: _ops.call_fwd(a, k, v, None, False, True)[0])(qs)
    assert below_autograd == [False]
    assert torch.equal(out[1], _ops.call_fwd(qs[1], k, v, None, False, True)[0])
    with pytest.raises(NotImplementedError, match="torch.func reverse-mode transforms"):
        torch.func.grad(lambda a: _ops.call_fwd(a, k, v, None, False, True)[0].float().sum())(q)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda a: torch.ops.flash_attention_sm75.fwd(a, k, v)[0].float().sum())(q)
    assert below_autograd == [False, True, False]  # vmap, the plain call, the raw op under grad


@needs_ext
@pytest.mark.parametrize("path", PUBLIC_PATHS)
def test_torch_function_mode_adding_trainable_tensors_keeps_gradients(path, monkeypatch):
    # A __torch_function__ mode runs inside the op call and may bring in tensors that require
    # grad (here an adapter scaling q): the fast path must not hide them from autograd. (No
    # below_autograd spy here: a mode resolves the op by its attribute, which would be the spy.)
    from torch.overrides import TorchFunctionMode

    f = _public_paths(monkeypatch)[path]
    w = torch.rand(64, dtype=torch.float16).add_(0.5).requires_grad_()

    class Adapter(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.flash_attention_sm75.fwd:
                args = (args[0] * w,) + tuple(args[1:])
            return func(*args, **(kwargs or {}))

    q, k, v = qkv(2, 7, 7, 4, 2, 64)
    with Adapter():
        out = f(q, k, v)
    assert out.requires_grad and out.grad_fn is not None
    out.float().sum().backward()
    assert w.grad is not None and w.grad.abs().max() > 0


@needs_ext
@pytest.mark.parametrize("path", ["call_fwd", "flash_attn_func", "flash_attention_forward"])
@pytest.mark.parametrize("api", ["torch.func.jvp", "forward_ad"])
def test_forward_mode_ad_raises(path, api, monkeypatch):
    # No jvp formula: without the check the tangent came back as zeros (torch.func.jvp) or was
    # dropped (forward_ad) when no input required grad.
    import torch.autograd.forward_ad as fwAD

    f = _public_paths(monkeypatch)[path]
    q, k, v = qkv(1, 5, 5, 2, 2, 64)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        if api == "torch.func.jvp":
            torch.func.jvp(lambda v_: f(q, k, v_), (v,), (torch.ones_like(v),))
        else:
            with fwAD.dual_level():
                f(q, fwAD.make_dual(k, torch.ones_like(k)), v)
    assert _ops.forward_ad_input(q, k, v) is None  # outside a dual level


@needs_ext
@pytest.mark.parametrize("path", ["call_fwd", "flash_attn_func", "flash_attention_forward"])
@pytest.mark.parametrize("api", ["grad", "vjp", "jacrev"])
def test_torch_func_reverse_mode_raises_naming_the_library(path, api, monkeypatch):
    # torch.func cannot use a register_autograd formula; torch's own error named an
    # autograd.Function the user never wrote. Ours must come first, from every direct API.
    f = _public_paths(monkeypatch)[path]
    q, k, v = qkv(1, 5, 5, 2, 2, 64)
    loss = lambda v_: f(q, k, v_).float().sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="torch.func reverse-mode transforms"):
        if api == "grad":
            torch.func.grad(loss)(v)
        elif api == "vjp":
            torch.func.vjp(lambda v_: f(q, k, v_), v)
        else:
            torch.func.jacrev(loss)(v)
    assert not _ops.functorch_grad_active()


@needs_ext
def test_vmap_of_the_direct_api_still_matches_the_per_sample_calls():
    # vmap is not a reverse-mode transform: it keeps working (torch's per-sample fallback).
    q, k, v = (torch.stack([t, t.flip(1)]) for t in qkv(1, 5, 5, 2, 2, 64))
    out = torch.func.vmap(lambda a, b, c: fa.flash_attn_func(a, b, c, causal=True))(q, k, v)
    for i in range(2):
        assert torch.equal(out[i], fa.flash_attn_func(q[i], k[i], v[i], causal=True))


# ------------------------------------------------------------------------------- package


def test_public_exports():
    for name in ["flash_attention_forward", "flash_attn_func", "scaled_dot_product_attention",
                 "why_not_supported", "strict", "set_strict", "EXTENSION_AVAILABLE",
                 "__version__", "apply_patch", "remove_patch", "deterministic_backward",
                 "is_deterministic_backward"]:
        assert name in fa.__all__, name
    for name in fa.__all__:
        if name not in ("apply_patch", "remove_patch"):
            assert hasattr(fa, name), name
    assert callable(fa.flash_attn_func) and callable(fa.scaled_dot_product_attention)
    with pytest.raises(AttributeError):
        fa.no_such_attribute  # noqa: B018


def test_import_does_not_import_transformers():
    code = ("import sys, flash_attention_sm75 as fa; "
            "assert 'transformers' not in sys.modules, 'transformers imported eagerly'; "
            "assert 'flash_attention_sm75.integrations.transformers' not in sys.modules; "
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_lazy_apply_patch():
    try:
        module = importlib.import_module("flash_attention_sm75.integrations.transformers")
    except ImportError as e:  # written by another part of the project / transformers missing
        pytest.skip(f"integration not importable: {e}")
    assert fa.apply_patch is module.apply_patch
    assert fa.remove_patch is module.remove_patch


# ------------------------------------------------------- keys outside [leftpad_k, seqused_k)


# (leftpad_k, seqused_k) per batch row for seqlen_k = 11: a range inside (keys left and right
# of it hidden), one from 0, one past seqlen_k (clamped to 11), the whole row, an empty range
# (seqused_k < leftpad_k: the row sees nothing) and a negative leftpad_k (clamped to 0).
KEY_RANGES_11 = [(2, 9), (0, 5), (3, 40), (0, 11), (6, 4), (-3, 7)]


def _outside_rows(b, s_k, ranges):
    """Bool (b, s_k): key j of batch row i lies outside the clamped [leftpad_k, seqused_k)."""
    j = torch.arange(s_k)
    lo = torch.tensor([min(max(lp, 0), s_k) for lp, _ in ranges])
    hi = torch.tensor([min(max(su, lo_), s_k) for (_, su), lo_ in zip(ranges, lo.tolist())])
    return (j[None] < lo[:, None]) | (j[None] >= hi[:, None])


def _key_range_runs(device, b, s_q, s_k, h, h_k, d, ranges, is_causal, bottom_right, seed):
    """(finite, poisoned) results of fwd (+ bwd) for the same inputs except the K/V rows outside
    the key ranges: random finite values in the first run, NaN / +inf / -inf in the second.
    Each result: (out, lse, dq, dk, dv) (gradients None without the backward op)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g).half()
    k = torch.randn(b, s_k, h_k, d, generator=g).half()
    v = torch.randn(b, s_k, h_k, d, generator=g).half()
    dout = torch.randn(b, s_q, h, d, generator=g).half()
    outside = _outside_rows(b, s_k, ranges)
    assert outside.any() and (~outside).any()
    poison = torch.tensor([float("nan"), float("inf"), -float("inf")]).half()
    bad = poison[torch.arange(s_k * h_k * d) % 3].view(s_k, h_k, d)
    lp = torch.tensor([r[0] for r in ranges], dtype=torch.int32, device=device)
    su = torch.tensor([r[1] for r in ranges], dtype=torch.int32, device=device)
    results = []
    for fill in ("finite", "poison"):
        kk, vv = k.clone(), v.clone()
        for i in range(b):
            rows = outside[i]
            if fill == "finite":
                kk[i, rows] = torch.randn(kk[i, rows].shape, generator=g).half() * 3
                vv[i, rows] = torch.randn(vv[i, rows].shape, generator=g).half() * 3
            else:
                kk[i, rows] = bad[rows]
                vv[i, rows] = bad.flip(0)[rows]
        qd, kd, vd = (t.to(device).requires_grad_() for t in (q, kk, vv))
        out, lse = torch.ops.flash_attention_sm75.fwd(qd, kd, vd, None, is_causal, bottom_right,
                                                      lp, su)
        grads = torch.autograd.grad(out, (qd, kd, vd), dout.to(device))
        results.append(tuple(t.detach().cpu() if t is not None else None
                             for t in (out, lse) + tuple(grads)))
    return results, outside


def _check_key_range_runs(results, outside, h_k):
    (out, lse, dq, dk, dv), (out_p, lse_p, dq_p, dk_p, dv_p) = results
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    assert torch.isfinite(out_p).all()
    # lse is finite, or -inf exactly for the rows that see no key (their out row is 0).
    assert not torch.isnan(lse_p).any() and not torch.isposinf(lse_p).any()
    assert (out_p.transpose(1, 2)[torch.isneginf(lse_p)] == 0).all()
    if dq is None:
        return
    for name, a, p in (("dq", dq, dq_p), ("dk", dk, dk_p), ("dv", dv, dv_p)):
        assert torch.isfinite(p).all(), name
        assert torch.equal(a, p), name
    # Gradients of keys outside the range are exactly 0.
    hidden = outside[:, :, None, None].expand(-1, -1, h_k, dk_p.shape[-1])
    assert (dk_p[hidden] == 0).all() and (dv_p[hidden] == 0).all()


@needs_ext
@pytest.mark.parametrize("h,h_k", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mode", ["none", "bottom_right", "top_left"])
@pytest.mark.parametrize("s_q", [1, 9])
def test_cpu_keys_outside_the_key_range_are_never_read(h, h_k, mode, s_q):
    # The CPU op read K/V past seqused_k: a NaN there reached the output (0 * NaN in P V) and
    # dq/dk/dv. With NaN/inf in every K and V row outside [leftpad_k, seqused_k) the results
    # must equal those with finite values there, bit for bit, and be finite.
    is_causal, bottom_right = {"none": (False, True), "bottom_right": (True, True),
                               "top_left": (True, False)}[mode]
    results, outside = _key_range_runs("cpu", len(KEY_RANGES_11), s_q, 11, h, h_k, 64,
                                       KEY_RANGES_11, is_causal, bottom_right,
                                       seed=h * 100 + h_k * 10 + s_q)
    _check_key_range_runs(results, outside, h_k)


# (leftpad_k, seqused_k) for seqlen_k = 300: several 64/128-key tiles and decode splits on
# either side of the range; one range past seqlen_k, one empty, one the whole row.
KEY_RANGES_300 = [(17, 150), (0, 64), (130, 400), (0, 300), (100, 90), (-5, 211), (255, 256)]


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,h_k", [(4, 4), (8, 2)])
@pytest.mark.parametrize("mode", ["none", "bottom_right", "top_left"])
@pytest.mark.parametrize("s_q", [1, 77])  # 1: the split-KV decode kernel (FLASH_SM75_DECODE=auto)
def test_gpu_keys_outside_the_key_range_are_never_read(d, h, h_k, mode, s_q):
    is_causal, bottom_right = {"none": (False, True), "bottom_right": (True, True),
                               "top_left": (True, False)}[mode]
    results, outside = _key_range_runs("cuda", len(KEY_RANGES_300), s_q, 300, h, h_k, d,
                                       KEY_RANGES_300, is_causal, bottom_right,
                                       seed=d + h * 100 + h_k * 10 + s_q)
    _check_key_range_runs(results, outside, h_k)
    # and the CUDA result is the CPU op's (which zeroes those rows) up to rounding
    cpu, _ = _key_range_runs("cpu", len(KEY_RANGES_300), s_q, 300, h, h_k, d, KEY_RANGES_300,
                             is_causal, bottom_right, seed=d + h * 100 + h_k * 10 + s_q)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), results[1], cpu[1]):
        if a is not None:
            torch.testing.assert_close(a.float(), c.float(), atol=2e-2, rtol=2e-2,
                                       equal_nan=False, msg=name)
