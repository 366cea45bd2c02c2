"""Input validation of the public API (ValueError naming the argument, before any launch) and
the documentation of the public signatures."""
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import flash_attention_sm75 as fa
from flash_attention_sm75 import _ops, interface, sdpa

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")


def bshd(b=2, s_q=5, s_k=7, h=4, h_k=2, d=64, dtype=torch.float16, device="cpu"):
    q = torch.randn(b, s_q, h, d).to(dtype=dtype, device=device)
    k = torch.randn(b, s_k, h_k, d).to(dtype=dtype, device=device)
    v = torch.randn(b, s_k, h_k, d).to(dtype=dtype, device=device)
    return q, k, v


def to_bhsd(q, k, v):
    return tuple(t.transpose(1, 2) for t in (q, k, v))


def _cases():
    """(id, (q, k, v), kwargs, regex); tensors in BSHD, converted for the BHSD function."""
    q, k, v = bshd()
    return [
        ("q_not_tensor", (q.tolist(), k, v), {}, r"q must be a torch\.Tensor, got list"),
        ("q_nested", (torch.nested.nested_tensor([q[0], q[1, :3]], layout=torch.jagged), k, v),
         {}, r"q is a nested tensor; a dense 4-D tensor"),
        ("q_3d", (q[0], k, v), {}, r"q must be 4-D .* got 3-D of shape \[5, 4, 64\]"),
        ("k_5d", (q, k.unsqueeze(0), v), {}, r"k must be 4-D .* got 5-D"),
        ("q_fp32", (q.float(), k, v), {}, r"q must be float16 .* got torch\.float32"),
        ("k_bf16", (q, k.bfloat16(), v), {}, r"k must be float16 .* got torch\.bfloat16"),
        ("v_fp32", (q, k, v.float()), {}, r"v must be float16 .* got torch\.float32"),
        ("device", (q, k.to("meta"), v), {}, r"k must be on the same device as q \(cpu\), got meta"),
        # sparse layouts used to pass the checks above and fail on their strides (zeros)
        ("q_sparse", (q.to_sparse(), k, v), {},
         r"q must be a strided \(dense\) tensor, got torch\.sparse_coo; convert it with "
         r"q\.to_dense\(\)"),
        ("v_sparse", (q, k, v.to_sparse()), {},
         r"v must be a strided \(dense\) tensor, got torch\.sparse_coo"),
        # zero-size inputs are valid (an empty or zero result), except kv heads 0 under q heads
        ("kv_heads_zero", (q, k[:, :, :0], v[:, :, :0]), {},
         r"num_heads_k must be >= 1 when num_heads >= 1 \(GQA/MQA: num_heads must be a multiple "
         r"of num_heads_k\), got num_heads_k 0 and num_heads 4"),
        ("kv_heads_zero_seqlen0", (q[:, :0], k[:, :0, :0], v[:, :0, :0]), {},
         r"num_heads_k must be >= 1 .* got num_heads_k 0 and num_heads 4"),
        ("kv_heads_zero_v", (q, k, v[:, :, :0]), {}, r"k and v must have the same shape"),
        ("last_stride", (q, k, v.transpose(1, 3).contiguous().transpose(1, 3)), {},
         r"v must have a contiguous last dimension \(stride\(-1\) == 1\)"),
        ("kv_shape", (q, k, v[:, :6]), {}, r"k and v must have the same shape"),
        ("batch", (q[:1], k, v), {}, r"q and k must have the same batch size, got 1 and 2"),
        ("head_dim_mismatch", (q, k[..., :32], v[..., :32]), {},
         r"q and k must have the same head_dim, got 64 and 32"),
        ("head_dim_80", bshd(d=80), {}, r"head_dim must be 64 or 128, got 80"),
        ("head_dim_32", bshd(d=32), {}, r"head_dim must be 64 or 128, got 32"),
        ("head_dim_256", bshd(d=256), {}, r"head_dim must be 64 or 128, got 256"),
        ("gqa", bshd(h=6, h_k=4), {},
         r"num_heads \(6\) must be a multiple of num_heads_k \(4\)"),
        ("kv_heads_more", bshd(h=2, h_k=4), {},
         r"num_heads \(2\) must be a multiple of num_heads_k \(4\)"),
        ("scale_zero", (q, k, v), {"softmax_scale": 0.0},
         r"softmax_scale must be a finite number > 0 within \[1\.2e-38, 2\.1e26\] \(float32 "
         r"scores must not overflow\), got 0\.0"),
        # float32 arithmetic in the kernel: a denormal scale flushes to 0, a huge one overflows
        ("scale_denormal", (q, k, v), {"softmax_scale": 1e-40}, r"softmax_scale .* 1e-40"),
        ("scale_huge", (q, k, v), {"softmax_scale": 2.4e38}, r"softmax_scale .* 2\.4e\+38"),
        # finite in float32, but scores of float16 inputs could overflow (inf - inf = NaN)
        ("scale_overflows_scores", (q, k, v), {"softmax_scale": 1e30}, r"softmax_scale .* 1e\+30"),
        ("scale_above_bound", (q, k, v), {"softmax_scale": 2.2e26}, r"softmax_scale .* 2\.2e\+26"),
        ("scale_tensor", (q, k, v), {"softmax_scale": torch.tensor(0.5)},
         r"softmax_scale must be a real number \(float or int\), got torch\.Tensor"),
        ("scale_negative", (q, k, v), {"softmax_scale": -0.5}, r"softmax_scale must be .* -0\.5"),
        ("scale_nan", (q, k, v), {"softmax_scale": float("nan")}, r"softmax_scale .* nan"),
        ("scale_inf", (q, k, v), {"softmax_scale": float("inf")}, r"softmax_scale .* inf"),
        ("scale_str", (q, k, v), {"softmax_scale": "0.1"}, r"softmax_scale .* '0\.1'"),
        ("scale_bool", (q, k, v), {"softmax_scale": True}, r"softmax_scale .* True"),
    ]


CASES = _cases()


@pytest.fixture
def calls(op_calls):
    """The argument tuples of every call that reaches torch.ops.flash_attention_sm75.fwd."""
    return op_calls


def bhsd_args(q, k, v):
    """A case's BSHD arguments as the BHSD function takes them (non-4-D values unchanged)."""
    return tuple(t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t
                 for t in (q, k, v))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attn_func_errors(case, calls):
    _, (q, k, v), kwargs, regex = case
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex):
        fa.flash_attn_func(q, k, v, **kwargs)
    assert calls == []  # rejected before reaching the op (so before any kernel launch)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attention_forward_errors(case, calls):
    _, (q, k, v), kwargs, regex = case
    args = bhsd_args(q, k, v)
    # The same rules and messages; shapes are printed as the caller passed them.
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex):
        fa.flash_attention_forward(*args, **kwargs)
    assert calls == []


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fast_rule_check_rejects_every_bad_case(case):
    # validate_fwd_inputs skips the per-rule checks when _passes_all_rules says the input is
    # valid, so it must never accept what _validate rejects.
    _, (q, k, v), kwargs, _ = case
    scale = kwargs.get("softmax_scale")
    assert not _ops._passes_all_rules(q, k, v, scale, 2)
    args = bhsd_args(q, k, v)
    assert not _ops._passes_all_rules(*args, scale, 1)


@pytest.mark.parametrize("shape", [dict(), dict(h=4, h_k=4), dict(h=8, h_k=1), dict(d=128),
                                   dict(b=1, s_q=1, s_k=1, h=1, h_k=1)])
@pytest.mark.parametrize("scale", [None, 0.125, 1])
def test_fast_rule_check_accepts_valid_input(shape, scale):
    q, k, v = bshd(**shape)
    assert _ops._passes_all_rules(q, k, v, scale, 2)
    assert _ops._passes_all_rules(*to_bhsd(q, k, v), scale, 1)
    # and _validate agrees (raises nothing)
    _ops._validate(_ops._raise_value_error, q, k, v, scale, None, None, "bshd", True)


# Cases whose arguments the C++ op itself can receive (dense tensors on one device, a float
# scale): its check_fwd_inputs must reject them with the message the Python rules give.
_CPP_CASES = [c for c in CASES if c[0] not in (
    "q_not_tensor", "q_nested", "q_sparse", "v_sparse", "device", "scale_tensor", "scale_str",
    "scale_bool")]


def _message_head(msg):
    # C++ and Python print dtypes differently (Float vs torch.float32); compare up to "got".
    return msg.split(", got")[0].split(" got ")[0].strip()


@pytest.mark.parametrize("case", _CPP_CASES, ids=[c[0] for c in _CPP_CASES])
def test_cpp_op_rejects_with_the_python_message(case):
    _, (q, k, v), kwargs, regex = case
    with pytest.raises(ValueError, match="^flash_attention_sm75: ") as cpp:
        torch.ops.flash_attention_sm75.fwd(q, k, v, kwargs.get("softmax_scale"))
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex) as py:
        fa.flash_attn_func(q, k, v, **kwargs)
    assert _message_head(str(cpp.value)) == _message_head(str(py.value))


# Zero-size inputs: (b, s_q, s_k, h, h_k). Valid on every rule; num_heads_k 0 only with
# num_heads 0.
ZERO_SIZE_SHAPES = [dict(b=0), dict(h=0, h_k=0), dict(h=0, h_k=2), dict(s_q=0), dict(s_k=0),
                    dict(s_q=0, s_k=0), dict(b=0, h=0, h_k=0), dict(b=0, s_q=0, s_k=0, h=0, h_k=0),
                    dict(s_k=0, h=8, h_k=1), dict(b=0, d=128)]


@pytest.mark.parametrize("shape", ZERO_SIZE_SHAPES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_zero_size_inputs_pass_every_rule(shape, calls):
    q, k, v = bshd(**shape)
    assert _ops._passes_all_rules(q, k, v, None, 2)
    assert _ops._passes_all_rules(*to_bhsd(q, k, v), None, 1)
    _ops._validate(_ops._raise_value_error, q, k, v, None, None, None, "bshd", True)
    _ops._validate(_ops._raise_value_error, *to_bhsd(q, k, v), None, None, None, "bhsd", True)
    b = q.shape[0]
    _ops.validate_fwd_inputs(q, k, v, 0.5, torch.zeros(b, dtype=torch.int32),
                             torch.full((b,), 3, dtype=torch.int32))
    torch.ops.flash_attention_sm75.fwd(q, k, v)  # the C++ rules (raise if not)
    # and the public functions reach the op
    fa.flash_attn_func(q, k, v)
    fa.flash_attention_forward(*to_bhsd(q, k, v))
    assert len(calls) == 3


def test_numpy_scale_is_accepted_as_a_float():
    np = pytest.importorskip("numpy")
    q, k, v = bshd()
    ref = fa.flash_attn_func(q, k, v, softmax_scale=float(np.float32(0.1)))
    for scale in (np.float32(0.1), np.float64(float(np.float32(0.1)))):
        assert torch.equal(fa.flash_attn_func(q, k, v, softmax_scale=scale), ref)
        assert torch.equal(fa.flash_attention_forward(*to_bhsd(q, k, v), softmax_scale=scale),
                           ref.transpose(1, 2))


def test_bhsd_head_count_error_points_at_flash_attn_func():
    q, k, v = bshd(b=1, s_q=6, s_k=6, h=4, h_k=4)
    # BSHD tensors given to the BHSD function: seqlen (6) is read as heads, heads (4) as seqlen
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple .*use flash_attn_func"):
        fa.flash_attention_forward(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match=r"must be a multiple of num_heads_k \(4\) for GQA/MQA$"):
        fa.flash_attn_func(*to_bhsd(q, k[:, :4], v[:, :4]))  # BSHD message: the C++ op's


def test_bhsd_messages_name_the_bhsd_layout():
    q, k, v = to_bhsd(*bshd())
    with pytest.raises(ValueError, match=r"\(batch, num_heads, seqlen, head_dim\) in BHSD layout"):
        fa.flash_attention_forward(q[0], k, v)
    with pytest.raises(ValueError, match=r"\(batch, seqlen, num_heads, head_dim\) in BSHD layout"):
        fa.flash_attn_func(q[0], k, v)


def test_valid_input_reaches_the_op(calls):
    q, k, v = bshd()
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True)
    assert len(calls) == 1 and out.shape == q.shape
    # (q, k, v, softmax_scale, is_causal, causal_bottom_right)
    assert calls[0][3:] == (0.1, True, True, None, None)  # + leftpad_k, seqused_k
    out_b = fa.flash_attention_forward(*to_bhsd(q, k, v), causal=True, softmax_scale=0.1)
    assert len(calls) == 2 and calls[1][3:] == (0.1, True, True, None, None)
    assert calls[1][0].data_ptr() == q.data_ptr()  # a view, not a copy
    assert torch.equal(out_b.transpose(1, 2), out)


@pytest.mark.parametrize("kwargs,regex", [
    ({"dropout_p": 0.1}, r"dropout_p=0\.1 \(only 0\.0"),
    ({"dropout_p": True}, r"dropout_p=True \(only 0\.0"),
    ({"window_size": (256, 0)}, r"window_size=\(256, 0\) \(only \(-1, -1\)"),
    ({"window_size": (-1,)}, r"window_size=\(-1,\) \(only \(-1, -1\)"),
    ({"softcap": 50.0}, r"softcap=50\.0 \(only 0\.0"),
    ({"alibi_slopes": torch.ones(4)}, r"alibi_slopes is not None"),
])
def test_fa2_options_other_than_off_raise_before_the_op(kwargs, regex, calls):
    q, k, v = bshd()
    with pytest.raises(ValueError, match="unsupported FlashAttention-2 option: " + regex):
        fa.flash_attn_func(q, k, v, causal=True, **kwargs)
    assert calls == []


def test_fa2_options_at_their_off_values_run_as_without_them(calls):
    # FlashAttention-2 call sites (HF's, e.g.) pass dropout_p=0.0 by keyword: that must just run.
    q, k, v = bshd()
    out = fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.1, causal=True,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert torch.equal(out, fa.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True))
    assert [c[3:] for c in calls] == [(0.1, True, True, None, None)] * 2


@pytest.mark.parametrize("ret", [False, True])
def test_return_lse_forms(ret):
    q, k, v = bshd()
    res = fa.flash_attn_func(q, k, v, return_lse=ret)
    res_b = fa.flash_attention_forward(*to_bhsd(q, k, v), return_lse=ret)
    if ret:
        assert isinstance(res, tuple) and len(res) == 2 and res[1].shape == (2, 4, 5)
        assert isinstance(res_b, tuple) and len(res_b) == 2 and torch.equal(res[1], res_b[1])
    else:
        assert isinstance(res, torch.Tensor) and isinstance(res_b, torch.Tensor)


@pytest.mark.parametrize("kwargs,regex", [
    ({"leftpad_k": torch.zeros(2, dtype=torch.int64)}, r"leftpad_k must be int32, got torch\.int64"),
    ({"seqused_k": torch.zeros(3, dtype=torch.int32)},
     r"seqused_k must have shape \(batch,\) = \(2,\), got \[3\]"),
    ({"leftpad_k": torch.zeros(2, 1, dtype=torch.int32)}, r"leftpad_k must have shape \(batch,\)"),
    ({"seqused_k": torch.zeros(2, dtype=torch.int32, device="meta")},
     r"seqused_k must be on the same device as q \(cpu\), got meta"),
    ({"leftpad_k": torch.zeros(4, dtype=torch.int32)[::2]}, r"leftpad_k must be contiguous"),
    ({"leftpad_k": [0, 0]}, r"leftpad_k must be a torch\.Tensor or None, got list"),
    ({"seqused_k": torch.full((2,), 7, dtype=torch.int32).to_sparse()},
     r"seqused_k must be a strided \(dense\) tensor, got torch\.sparse_coo"),
])
def test_key_range_argument_errors(kwargs, regex):
    q, k, v = bshd()
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex):
        _ops.validate_fwd_inputs(q, k, v, **kwargs)


_SPARSE_LAYOUTS = [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                   torch.sparse_bsc]


@pytest.mark.filterwarnings("ignore:Sparse (CSR|CSC|BSR|BSC) tensor support is in beta")
@pytest.mark.parametrize("layout", _SPARSE_LAYOUTS, ids=str)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attention_forward"])
def test_sparse_layouts_are_rejected_naming_the_argument(layout, name, fn, calls):
    dense = dict(zip("qkv", bshd() if fn == "flash_attn_func" else to_bhsd(*bshd())))
    # values in [1, 2): no zeros, so every batch of a compressed layout has the same nnz
    t = (torch.rand(dense[name].shape) + 1).half()
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    dense[name] = t.to_sparse(layout=layout, blocksize=(1, 1) if blocked else None)
    assert dense[name].layout == layout
    regex = (rf"^flash_attention_sm75: {name} must be a strided \(dense\) tensor, got "
             rf"{re.escape(str(layout))}; convert it with {name}\.to_dense\(\)")
    with pytest.raises(ValueError, match=regex):
        getattr(fa, fn)(dense["q"], dense["k"], dense["v"])
    assert calls == []
    # the SDPA entry point falls back for them and names the reason
    if fn == "flash_attention_forward":
        arg = {"q": "query", "k": "key", "v": "value"}[name]
        reason = fa.why_not_supported(dense["q"], dense["k"], dense["v"])
        assert reason.startswith(f"{arg} is a {layout} tensor; only strided (dense)")


_BAD_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32,
               torch.int8, torch.uint8, torch.bool, torch.complex64]


def _message(fn, *args):
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("dtype", _BAD_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_dtype_errors_use_torch_dtype_names_not_the_cpp_ones(dtype, name):
    # The raw C++ op prints c10 names ("Long", "Half"); the Python API validates first and must
    # print torch's ("torch.int64"), whatever the C++ says.
    args = dict(zip("qkv", bshd()))
    args[name] = args[name].to(dtype)
    cpp = _message(torch.ops.flash_attention_sm75.fwd, args["q"], args["k"], args["v"])
    cpp_name = re.search(r"got (\S+)$", cpp).group(1)
    assert cpp_name != str(dtype)
    for fn, qkv in ((fa.flash_attn_func, (args["q"], args["k"], args["v"])),
                    (fa.flash_attention_forward, to_bhsd(args["q"], args["k"], args["v"]))):
        msg = _message(fn, *qkv)
        assert msg.startswith(f"flash_attention_sm75: {name} must be float16")
        assert msg.endswith(f"got {dtype}") and f"got {cpp_name}" not in msg, msg
    # the key-range arguments too (validate_fwd_inputs is what the wrappers call)
    q, k, v = bshd()
    lp = torch.zeros(q.shape[0], dtype=dtype)
    if dtype != torch.int32:
        cpp = _message(torch.ops.flash_attention_sm75.fwd, q, k, v, None, False, True, lp, None)
        msg = _message(_ops.validate_fwd_inputs, q, k, v, None, lp)
        assert msg.endswith(f"leftpad_k must be int32, got {dtype}"), msg
        assert "got " + re.search(r"got (\S+)$", cpp).group(1) not in msg, msg


def test_validate_accepts_valid_and_rejects_bad_layout():
    q, k, v = bshd()
    _ops.validate_fwd_inputs(q, k, v, 0.5, torch.zeros(2, dtype=torch.int32),
                             torch.full((2,), 7, dtype=torch.int32))
    _ops.validate_fwd_inputs(*to_bhsd(q, k, v), layout="bhsd")
    with pytest.raises(ValueError, match="layout must be 'bshd' or 'bhsd'"):
        _ops.validate_fwd_inputs(q, k, v, layout="sbhd")


def test_extension_missing_raises_runtime_error(monkeypatch):
    monkeypatch.setattr(_ops, "EXTENSION_AVAILABLE", False)
    monkeypatch.setattr(_ops, "EXTENSION_ERROR", "ImportError: test")
    with pytest.raises(RuntimeError, match="could not be imported .*ImportError: test"):
        fa.flash_attn_func(*bshd())
    with pytest.raises(RuntimeError, match="could not be imported"):
        fa.flash_attention_forward(*to_bhsd(*bshd()))


# ------------------------------------------------------------------------------ CUDA-only


@pytest.mark.gpu
def test_cuda_alignment_errors():
    q, k, v = bshd(device="cuda")
    flat = torch.empty(q.numel() + 4, dtype=torch.float16, device="cuda")
    q_misaligned = flat[4:].view(q.shape)  # 8-byte offset
    assert q_misaligned.data_ptr() % 16 != 0
    msg = r"^flash_attention_sm75: q must be 16-byte aligned"
    with pytest.raises(ValueError, match=msg):
        fa.flash_attn_func(q_misaligned, k, v)
    with pytest.raises(ValueError, match=msg):  # the C++ check
        torch.ops.flash_attention_sm75.fwd(q_misaligned, k, v)
    k_odd_stride = torch.zeros(2, 7, 2, 68, dtype=torch.float16, device="cuda")[..., :64]
    with pytest.raises(ValueError, match=r"^flash_attention_sm75: k must be 16-byte aligned"):
        fa.flash_attn_func(q, k_odd_stride, v)
    with pytest.raises(ValueError, match=r"^flash_attention_sm75: k must be 16-byte aligned"):
        torch.ops.flash_attention_sm75.fwd(q, k_odd_stride, v)
    # the fast all-rules check used by validate_fwd_inputs rejects both, accepts the aligned set
    assert not _ops._passes_all_rules(q_misaligned, k, v, None, 2)
    assert not _ops._passes_all_rules(q, k_odd_stride, v, None, 2)
    assert _ops._passes_all_rules(q, k, v, None, 2)


@pytest.mark.gpu
def test_cuda_device_mismatch():
    q, k, v = bshd(device="cuda")
    with pytest.raises(ValueError, match=r"k must be on the same device as q \(cuda:0\), got cpu"):
        fa.flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ValueError, match=r"k must be on the same device as q"):
        torch.ops.flash_attention_sm75.fwd(q, k.cpu(), v)
    lp = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"leftpad_k must be on the same device as q"):
        torch.ops.flash_attention_sm75.fwd(q, k, v, None, False, True, lp)


# ------------------------------------------------------------------------------ docstrings


PUBLIC_FUNCTIONS = [interface.flash_attn_func, interface.flash_attention_forward,
                    sdpa.scaled_dot_product_attention, sdpa.why_not_supported, sdpa.strict,
                    sdpa.set_strict]


def _documented_parameters(doc):
    """Names listed in the numpydoc 'Parameters' section."""
    section = doc.split("Parameters\n")[1].split("\n    Returns\n")[0]
    section = re.split(r"\n    (?:Notes|Raises|Examples)\n", section)[0]
    return re.findall(r"^    (\w+) : ", section, flags=re.M)


@pytest.mark.parametrize("func", PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_docstring_documents_exactly_the_signature(func):
    doc = func.__doc__
    assert doc and "Parameters\n" in doc, f"{func.__name__} has no numpydoc Parameters section"
    params = list(inspect.signature(func).parameters)
    documented = _documented_parameters(doc)
    assert documented == params, (documented, params)  # same names, same order, no phantoms


@pytest.mark.parametrize("func", PUBLIC_FUNCTIONS[:3], ids=lambda f: f.__name__)
def test_docstring_sections_and_sources(func):
    doc = func.__doc__
    for section in ["Parameters", "Returns", "Raises", "Notes"]:
        assert f"\n    {section}\n    {'-' * len(section)}\n" in doc, section
    assert "arXiv:2307.08691" in doc and "arXiv:2205.14135" in doc


def test_direct_api_docstrings_say_bottom_right_and_draw_the_mask():
    for func in (fa.flash_attn_func, fa.flash_attention_forward):
        doc = func.__doc__
        assert "bottom-right" in doc
        assert "seqlen_q != seqlen_k" in doc or "seqlen_q = 2, seqlen_k = 5" in doc
        assert re.search(r"\n\s+0 0\n\s+0 0\n", doc)  # rows without keys drawn
        assert "i // (num_heads // num_heads_k)" in doc
    assert "top-left" in fa.scaled_dot_product_attention.__doc__


def _torch_sdpa_parameters():
    # torch's SDPA is a builtin without __signature__; the aten schema has names, defaults and
    # which arguments are keyword-only.
    schema = torch.ops.aten.scaled_dot_product_attention.default._schema
    return [(a.name, a.default_value, a.kwarg_only) for a in schema.arguments]


def _ours(func):
    return [(n, None if p.default is inspect.Parameter.empty else p.default,
             p.kind is inspect.Parameter.KEYWORD_ONLY)
            for n, p in inspect.signature(func).parameters.items()]


def test_sdpa_signature_equals_torch():
    theirs = _torch_sdpa_parameters()
    assert [t[0] for t in theirs][:3] == ["query", "key", "value"]  # the schema is what we think
    assert _ours(fa.scaled_dot_product_attention) == theirs
    # The docstring's first line in torch names the same parameters in the same order.
    first = F.scaled_dot_product_attention.__doc__.split("->")[0]
    assert re.findall(r"(\w+)(?:=[^,)]*)?[,)]", first.replace("\n", " ")) == [t[0] for t in theirs]
    # why_not_supported takes exactly the same arguments.
    assert _ours(fa.why_not_supported) == theirs


def test_flash_attn_func_signature_follows_flash_attn_order():
    params = inspect.signature(fa.flash_attn_func).parameters.values()
    assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "q", "k", "v", "softmax_scale", "causal", "return_lse"]
    # FlashAttention-2's options are keyword-only, so no FA-2 positional call lands in them.
    assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == [
        "dropout_p", "window_size", "softcap", "alibi_slopes"]
    assert list(inspect.signature(fa.flash_attention_forward).parameters) == [
        "q", "k", "v", "causal", "softmax_scale", "return_lse"]


# ------------------------------------------------------------------ flags and non-finite input


@pytest.mark.parametrize("fn,to_layout", [(lambda *a, **kw: fa.flash_attn_func(*a, **kw), None),
                                          (lambda *a, **kw: fa.flash_attention_forward(*a, **kw), "bhsd")],
                         ids=["flash_attn_func", "flash_attention_forward"])
@pytest.mark.parametrize("flag,value", [("causal", 0.125), ("causal", 1), ("causal", "yes"),
                                        ("return_lse", 1)])
def test_flags_must_be_bool(fn, to_layout, flag, value):
    # A scale passed positionally into `causal` must not silently switch the mask on.
    q, k, v = bshd()
    if to_layout == "bhsd":
        q, k, v = to_bhsd(q, k, v)
    with pytest.raises(ValueError, match=rf"^flash_attention_sm75: {flag} must be a bool"):
        fn(q, k, v, **{flag: value})


def test_cpu_op_propagates_nan_and_zeroes_only_keyless_rows():
    q, k, v = bshd(s_q=5, s_k=5)
    q = q.clone()
    q[0, 1, 0, 0] = float("nan")
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, None, True, False)
    assert torch.isnan(out[0, 1, 0]).all()      # the NaN query row stays NaN (as in torch SDPA)
    assert not torch.isnan(out[1]).any()        # other batch entries are unaffected
    # A row that sees no key (top-left causal with leftpad) is exactly 0 with lse -inf.
    lp = torch.tensor([3, 0], dtype=torch.int32)
    q2, k2, v2 = bshd(s_q=5, s_k=5)
    out2, lse2 = torch.ops.flash_attention_sm75.fwd(q2, k2, v2, None, True, False, lp, None)
    assert torch.equal(out2[0, :3], torch.zeros_like(out2[0, :3]))
    assert torch.isneginf(lse2[0, :, :3]).all() and torch.isfinite(lse2[0, :, 3:]).all()
