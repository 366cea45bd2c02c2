"""Input validation of the public API (ValueError naming the argument, before any launch) and
the documentation of the public signatures. The rules themselves, rule by rule against the C++
checks, are tests/test_rules.py."""
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import flash_attention_sm75 as fa
from flash_attention_sm75 import _ops, _rules, interface, sdpa
from test_rules import bshd, to_bhsd  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")


@pytest.fixture
def calls(op_calls):
    """The argument tuples of every call that reaches torch.ops.flash_attention_sm75.fwd."""
    return op_calls


# Zero-size inputs: (b, s_q, s_k, h, h_k). Valid on every rule; num_heads_k 0 only with
# num_heads 0.
ZERO_SIZE_SHAPES = [dict(b=0), dict(h=0, h_k=0), dict(h=0, h_k=2), dict(s_q=0), dict(s_k=0),
                    dict(s_q=0, s_k=0), dict(b=0, h=0, h_k=0), dict(b=0, s_q=0, s_k=0, h=0, h_k=0),
                    dict(s_k=0, h=8, h_k=1), dict(b=0, d=128)]


@pytest.mark.parametrize("shape", ZERO_SIZE_SHAPES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_zero_size_inputs_pass_every_rule(shape, calls):
    q, k, v = bshd(**shape)
    assert _rules.not_supported_reason(q, k, v) is None
    assert _rules.not_supported_reason(*to_bhsd(q, k, v), layout="bhsd") is None
    b = q.shape[0]
    _rules.check_inputs(q, k, v, 0.5, torch.zeros(b, dtype=torch.int32),
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
    # (q, k, v, softmax_scale, is_causal, causal_bottom_right) + leftpad_k, seqused_k, the
    # window (none) and the score mods (none)
    assert calls[0][3:] == (0.1, True, True, None, None, -1, -1, 0.0, None)
    out_b = fa.flash_attention_forward(*to_bhsd(q, k, v), causal=True, softmax_scale=0.1)
    assert len(calls) == 2 and calls[1][3:] == (0.1, True, True, None, None, -1, -1, 0.0, None)
    assert calls[1][0].data_ptr() == q.data_ptr()  # a view, not a copy
    assert torch.equal(out_b.transpose(1, 2), out)


@pytest.mark.parametrize("kwargs,regex", [
    ({"dropout_p": 1.0}, r"dropout_p must be in \[0, 1\), got 1\.0"),
    ({"dropout_p": True}, r"dropout_p must be a real number in \[0, 1\), got bool"),
])
def test_fa2_options_outside_their_rules_raise_before_the_op(kwargs, regex, calls):
    q, k, v = bshd()
    with pytest.raises(ValueError, match="^flash_attention_sm75: " + regex):
        fa.flash_attn_func(q, k, v, causal=True, **kwargs)
    assert calls == []


def test_fa2_options_at_their_off_values_run_as_without_them(calls):
    # FlashAttention-2 call sites (HF's, e.g.) pass dropout_p=0.0 by keyword: that must just run.
    q, k, v = bshd()
    out = fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.1, causal=True,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert torch.equal(out, fa.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True))
    assert [c[3:] for c in calls] == [(0.1, True, True, None, None, -1, -1, 0.0, None)] * 2


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


_SPARSE_LAYOUTS = [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                   torch.sparse_bsc]


@pytest.mark.filterwarnings("ignore:Sparse (CSR|CSC|BSR|BSC) tensor support is in beta")
@pytest.mark.parametrize("layout", _SPARSE_LAYOUTS, ids=str)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attention_forward"])
def test_sparse_layouts_are_rejected_naming_the_argument(layout, name, fn, calls, monkeypatch):
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
    # the SDPA entry point falls back for them and names the reason (on its kernel device)
    monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", "cpu")
    if fn == "flash_attention_forward":
        arg = {"q": "query", "k": "key", "v": "value"}[name]
        reason = fa.why_not_supported(dense["q"], dense["k"], dense["v"])
        assert reason.startswith(f"{arg} must be a strided (dense) tensor, got {layout}")


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
    # the key-range arguments too (the rulebook's check, which every door asks)
    q, k, v = bshd()
    lp = torch.zeros(q.shape[0], dtype=dtype)
    if dtype != torch.int32:
        cpp = _message(torch.ops.flash_attention_sm75.fwd, q, k, v, None, False, True, lp, None)
        msg = _message(_rules.check_inputs, q, k, v, None, lp)
        assert msg.endswith(f"leftpad_k must be int32, got {dtype}"), msg
        assert "got " + re.search(r"got (\S+)$", cpp).group(1) not in msg, msg


def test_validate_accepts_valid_and_rejects_bad_layout():
    q, k, v = bshd()
    _rules.check_inputs(q, k, v, 0.5, torch.zeros(2, dtype=torch.int32),
                        torch.full((2,), 7, dtype=torch.int32))
    _rules.check_inputs(*to_bhsd(q, k, v), layout="bhsd")
    with pytest.raises(ValueError, match="layout must be 'bshd' or 'bhsd'"):
        _rules.check_inputs(q, k, v, layout="sbhd")


def test_extension_missing_raises_runtime_error(monkeypatch):
    monkeypatch.setattr(_ops, "EXTENSION_AVAILABLE", False)
    monkeypatch.setattr(_ops, "EXTENSION_ERROR", "ImportError: test")
    with pytest.raises(RuntimeError, match="could not be imported .*ImportError: test"):
        fa.flash_attn_func(*bshd())
    with pytest.raises(RuntimeError, match="could not be imported"):
        fa.flash_attention_forward(*to_bhsd(*bshd()))


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
        "q", "k", "v", "causal", "softmax_scale", "return_lse", "window_size", "softcap",
        "alibi_slopes", "dropout_p"]


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
