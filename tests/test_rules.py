"""The rulebook (flash_attention_sm75/_rules.py) against the C++ checks, rule by rule.

One table, ROWS: each row breaks exactly one rule of ``_rules.RULES`` and gives the message
that rule produces. For every row the rulebook's reason matches it, and where the C++ op can
receive the arguments (dense tensors on one device, a float scale) the op raises ValueError with
the same message (up to "got": C++ prints c10 names such as ``Float``). Every rule has a row, so
a rule added to the rulebook without its C++ twin, or the other way round, fails here. The doors
(direct APIs, SDPA wrapper, HF integration) are checked to answer with the rulebook's reason.
"""
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import flash_attention_sm75 as fa
from flash_attention_sm75 import _rules, sdpa

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")
HAS_CUDA = torch.cuda.is_available()


def bshd(b=2, s_q=5, s_k=7, h=4, h_k=2, d=64, dtype=torch.float16, device="cpu"):
    q = torch.randn(b, s_q, h, d).to(dtype=dtype, device=device)
    k = torch.randn(b, s_k, h_k, d).to(dtype=dtype, device=device)
    v = torch.randn(b, s_k, h_k, d).to(dtype=dtype, device=device)
    return q, k, v


def to_bhsd(q, k, v):
    return tuple(t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t
                 for t in (q, k, v))


@dataclass
class Row:
    rule: str                     # the _rules.RULES entry it breaks
    id: str
    make: Callable[[str], tuple]  # device -> ((q, k, v), kwargs of the op / not_supported_reason)
    regex: str                    # the reason (no "flash_attention_sm75: " prefix)
    cpp: bool = True              # the C++ op can receive these arguments
    device: str = "cpu"           # "cuda": needs a GPU
    check: dict = field(default_factory=dict)  # extra not_supported_reason keywords


def _base(**kw):
    return lambda device: (bshd(device=device, **kw), {})


def _with(fn, **kwargs):
    """Row maker from fn(q, k, v) -> (q, k, v), with op keyword arguments."""
    def make(device):
        q, k, v = bshd(device=device)
        return fn(q, k, v), dict(kwargs)
    return make


def _key_range(name, value):
    def make(device):
        v = value(device) if callable(value) else value
        return bshd(device=device), {name: v}
    return make


def _huge(device):
    # 2^31 batches without memory: a batch stride of 0 (the rule reads sizes, not data).
    q, k, v = bshd(b=1, device=device)
    n = 2**31
    return (q.expand(n, *q.shape[1:]), k.expand(n, *k.shape[1:]), v.expand(n, *v.shape[1:])), {}


def _misaligned_pointer(device):
    q, k, v = bshd(device=device)
    flat = torch.empty(q.numel() + 4, dtype=q.dtype, device=device)
    return (flat[4:].view(q.shape), k, v), {}  # 8-byte offset


def _odd_stride(device):
    q, k, v = bshd(device=device)
    k = torch.zeros(2, 7, 2, 68, dtype=k.dtype, device=device)[..., :64]
    return (q, k, v), {}


_HEAD_DIM_MSG = (f"head_dim must be a multiple of {_rules.HEAD_DIM_MULTIPLE} from "
                 f"{_rules.HEAD_DIM_MULTIPLE} to {_rules.MAX_HEAD_DIM}, got ")

ROWS = [
    Row("tensor", "q_not_tensor", _with(lambda q, k, v: (q.tolist(), k, v)),
        r"q must be a torch\.Tensor, got list", cpp=False),
    Row("tensor", "q_nested",
        _with(lambda q, k, v: (torch.nested.nested_tensor([q[0], q[1, :3]], layout=torch.jagged),
                               k, v)),
        r"q is a nested tensor; a dense 4-D tensor", cpp=False),
    Row("tensor", "q_sparse", _with(lambda q, k, v: (q.to_sparse(), k, v)),
        r"q must be a strided \(dense\) tensor, got torch\.sparse_coo; convert it with "
        r"q\.to_dense\(\)", cpp=False),
    Row("tensor", "v_sparse", _with(lambda q, k, v: (q, k, v.to_sparse())),
        r"v must be a strided \(dense\) tensor, got torch\.sparse_coo", cpp=False),
    Row("rank", "q_3d", _with(lambda q, k, v: (q[0], k, v)),
        r"q must be 4-D .* got 3-D of shape \[5, 4, 64\]"),
    Row("rank", "k_5d", _with(lambda q, k, v: (q, k.unsqueeze(0), v)), r"k must be 4-D .* got 5-D"),
    Row("dtype", "q_fp32", _with(lambda q, k, v: (q.float(), k, v)),
        r"q must be float16 .* got torch\.float32"),
    Row("dtype", "k_bf16", _with(lambda q, k, v: (q, k.bfloat16(), v)),
        r"k must be float16 .* got torch\.bfloat16"),
    Row("dtype", "v_fp32", _with(lambda q, k, v: (q, k, v.float())),
        r"v must be float16 .* got torch\.float32"),
    # A CPU and a meta tensor cannot reach one C++ kernel (the dispatcher picks one backend);
    # the GPU row below sends a CPU k to the CUDA kernel.
    Row("same_device", "device", _with(lambda q, k, v: (q, k.to("meta"), v)),
        r"k must be on the same device as q \(cpu\), got meta", cpp=False),
    Row("same_device", "device_cuda", _with(lambda q, k, v: (q, k.cpu(), v)),
        r"k must be on the same device as q \(cuda:0\), got cpu", device="cuda"),
    Row("last_dim", "last_stride",
        _with(lambda q, k, v: (q, k, v.transpose(1, 3).contiguous().transpose(1, 3))),
        r"v must have a contiguous last dimension \(stride\(-1\) == 1\)"),
    Row("kv_shape", "kv_shape", _with(lambda q, k, v: (q, k, v[:, :6])),
        r"k and v must have the same shape"),
    Row("kv_shape", "kv_heads_zero_v", _with(lambda q, k, v: (q, k, v[:, :, :0])),
        r"k and v must have the same shape"),
    Row("kv_shape", "value_head_dim", _with(lambda q, k, v: (q, k, v[..., :32])),
        r"k and v must have the same shape, got k \[.*\] and v \[.*, 32\] \(a value head_dim "
        r"different from the query/key head_dim is not supported\)"),
    Row("batch", "batch", _with(lambda q, k, v: (q[:1], k, v)),
        r"q and k must have the same batch size, got 1 and 2"),
    Row("head_dim_match", "head_dim_mismatch", _with(lambda q, k, v: (q, k[..., :32], v[..., :32])),
        r"q and k must have the same head_dim, got 64 and 32"),
    Row("head_dim", "head_dim_12", _base(d=12), _HEAD_DIM_MSG + "12"),
    Row("head_dim", "head_dim_4", _base(d=4), _HEAD_DIM_MSG + "4"),
    Row("head_dim", "head_dim_264", _base(d=264), _HEAD_DIM_MSG + "264"),
    # Zero-size inputs are valid (an empty or zero result), except kv heads 0 under q heads.
    Row("kv_heads", "kv_heads_zero", _with(lambda q, k, v: (q, k[:, :, :0], v[:, :, :0])),
        r"num_heads_k must be >= 1 when num_heads >= 1 \(GQA/MQA: num_heads must be a multiple "
        r"of num_heads_k\), got num_heads_k 0 and num_heads 4"),
    Row("kv_heads", "kv_heads_zero_seqlen0",
        _with(lambda q, k, v: (q[:, :0], k[:, :0, :0], v[:, :0, :0])),
        r"num_heads_k must be >= 1 .* got num_heads_k 0 and num_heads 4"),
    Row("gqa", "gqa", _base(h=6, h_k=4), r"num_heads \(6\) must be a multiple of num_heads_k \(4\)"),
    Row("gqa", "kv_heads_more", _base(h=2, h_k=4),
        r"num_heads \(2\) must be a multiple of num_heads_k \(4\)"),
    Row("extent", "batch_2pow31", _huge, r"batch, seqlen and heads must each be < 2\^31"),
    Row("key_range", "leftpad_int64", _key_range("leftpad_k", torch.zeros(2, dtype=torch.int64)),
        r"leftpad_k must be int32, got torch\.int64"),
    Row("key_range", "seqused_shape", _key_range("seqused_k", torch.zeros(3, dtype=torch.int32)),
        r"seqused_k must have shape \(batch,\) = \(2,\), got \[3\]"),
    Row("key_range", "leftpad_2d", _key_range("leftpad_k", torch.zeros(2, 1, dtype=torch.int32)),
        r"leftpad_k must have shape \(batch,\)"),
    Row("key_range", "seqused_device",
        _key_range("seqused_k", torch.zeros(2, dtype=torch.int32, device="meta")),
        r"seqused_k must be on the same device as q \(cpu\), got meta", cpp=False),
    Row("key_range", "leftpad_strided",
        _key_range("leftpad_k", torch.zeros(4, dtype=torch.int32)[::2]),
        r"leftpad_k must be contiguous"),
    Row("key_range", "leftpad_list", _key_range("leftpad_k", [0, 0]),
        r"leftpad_k must be a torch\.Tensor or None, got list", cpp=False),
    Row("key_range", "seqused_sparse",
        _key_range("seqused_k", torch.full((2,), 7, dtype=torch.int32).to_sparse()),
        r"seqused_k must be a strided \(dense\) tensor, got torch\.sparse_coo", cpp=False),
    Row("key_range", "leftpad_cuda_on_cpu_q",
        _key_range("leftpad_k", torch.zeros(2, dtype=torch.int32)),
        r"leftpad_k must be on the same device as q \(cuda:0\), got cpu", device="cuda"),
    Row("softmax_scale", "scale_zero", _with(lambda *t: t, softmax_scale=0.0),
        r"softmax_scale must be a finite number > 0 within \[1\.18e-38, 1\.07e26\] \(float32 "
        r"scores must not overflow\), got 0\.0"),
    # float32 arithmetic in the kernel: a denormal scale flushes to 0, a huge one overflows
    Row("softmax_scale", "scale_denormal", _with(lambda *t: t, softmax_scale=1e-40),
        r"softmax_scale .* 1e-40"),
    Row("softmax_scale", "scale_huge", _with(lambda *t: t, softmax_scale=2.4e38),
        r"softmax_scale .* 2\.4e\+38"),
    # finite in float32, but scores of float16 inputs could overflow (inf - inf = NaN)
    Row("softmax_scale", "scale_overflows_scores", _with(lambda *t: t, softmax_scale=1e30),
        r"softmax_scale .* 1e\+30"),
    Row("softmax_scale", "scale_above_bound", _with(lambda *t: t, softmax_scale=2.2e26),
        r"softmax_scale .* 2\.2e\+26"),
    Row("softmax_scale", "scale_negative", _with(lambda *t: t, softmax_scale=-0.5),
        r"softmax_scale must be .* -0\.5"),
    Row("softmax_scale", "scale_nan", _with(lambda *t: t, softmax_scale=float("nan")),
        r"softmax_scale .* nan"),
    Row("softmax_scale", "scale_inf", _with(lambda *t: t, softmax_scale=float("inf")),
        r"softmax_scale .* inf"),
    Row("softmax_scale", "scale_tensor", _with(lambda *t: t, softmax_scale=torch.tensor(0.5)),
        r"softmax_scale must be a real number \(float or int\), got torch\.Tensor", cpp=False),
    Row("softmax_scale", "scale_str", _with(lambda *t: t, softmax_scale="0.1"),
        r"softmax_scale .* '0\.1'", cpp=False),
    Row("softmax_scale", "scale_bool", _with(lambda *t: t, softmax_scale=True),
        r"softmax_scale .* True", cpp=False),
    Row("window_size", "window_left_minus_2", _with(lambda *t: t, window_size=(-2, -1)),
        r"window_size_left must be -1 \(no limit\) or >= 0, got -2"),
    Row("window_size", "window_right_minus_5", _with(lambda *t: t, window_size=(3, -5)),
        r"window_size_right must be -1 \(no limit\) or >= 0, got -5"),
    Row("window_size", "window_not_pair", _with(lambda *t: t, window_size=(3,)),
        r"window_size must be a pair \(left, right\) of ints, each -1 \(no limit\) or >= 0, "
        r"got tuple \(3,\)", cpp=False),
    Row("window_size", "window_float", _with(lambda *t: t, window_size=(3.0, 0)),
        r"window_size_left must be an int, -1 \(no limit\) or >= 0, got float 3\.0", cpp=False),
    Row("softcap", "softcap_negative", _with(lambda *t: t, softcap=-1.0),
        r"softcap must be a finite number >= 0 \(0: no soft-capping\), got -1\.0"),
    Row("softcap", "softcap_nan", _with(lambda *t: t, softcap=float("nan")),
        r"softcap must be a finite number >= 0 \(0: no soft-capping\), got nan"),
    Row("softcap", "softcap_inf", _with(lambda *t: t, softcap=float("inf")),
        r"softcap must be a finite number >= 0 \(0: no soft-capping\), got inf"),
    Row("softcap", "softcap_str", _with(lambda *t: t, softcap="30"),
        r"softcap must be a real number \(float or int\), finite and >= 0 \(0: no "
        r"soft-capping\), got str '30'", cpp=False),
    # The kernels' float32 factors scale / softcap and softcap / scale: inf (NaN scores) or 0.
    Row("softcap", "softcap_over_scale_too_large",
        _with(lambda *t: t, softcap=1e37, softmax_scale=1e-3),
        r"softcap / softmax_scale must be within \[2\^-100, 2\^100\] \(float32 factors of the "
        r"soft-cap\), got softcap 1e\+37 and softmax_scale 0\.001"),
    Row("softcap", "softcap_over_scale_too_small", _with(lambda *t: t, softcap=1e-40),
        r"softcap / softmax_scale must be within \[2\^-100, 2\^100\] \(float32 factors of the "
        r"soft-cap\), got softcap 1e-40 and softmax_scale 0\.125"),
    Row("softcap", "softcap_bool", _with(lambda *t: t, softcap=True),
        r"softcap must be a real number .* got bool True", cpp=False),
    Row("softcap", "softcap_tensor", _with(lambda *t: t, softcap=torch.tensor(30.0)),
        r"softcap must be a real number .* got torch\.Tensor", cpp=False),
    Row("alibi_slopes", "alibi_float64", _with(lambda *t: t, alibi_slopes=torch.ones(4).double()),
        r"alibi_slopes must be float32, got torch\.float64"),
    Row("alibi_slopes", "alibi_fp16", _with(lambda *t: t, alibi_slopes=torch.ones(4).half()),
        r"alibi_slopes must be float32, got torch\.float16"),
    Row("alibi_slopes", "alibi_shape_kv_heads", _with(lambda *t: t, alibi_slopes=torch.ones(2)),
        r"alibi_slopes must have shape \(num_heads,\) = \(4,\) or \(batch, num_heads\) = "
        r"\(2, 4\), got \[2\]"),
    Row("alibi_slopes", "alibi_shape_batch", _with(lambda *t: t, alibi_slopes=torch.ones(3, 4)),
        r"alibi_slopes must have shape \(num_heads,\) = \(4,\) or \(batch, num_heads\) = "
        r"\(2, 4\), got \[3, 4\]"),
    Row("alibi_slopes", "alibi_shape_3d", _with(lambda *t: t, alibi_slopes=torch.ones(2, 4, 1)),
        r"alibi_slopes must have shape .* got \[2, 4, 1\]"),
    Row("alibi_slopes", "alibi_strided", _with(lambda *t: t, alibi_slopes=torch.ones(2, 8)[:, ::2]),
        r"alibi_slopes must be contiguous in its last dimension, got strides \[8, 2\]"),
    Row("alibi_slopes", "alibi_with_key_range",
        _with(lambda *t: t, alibi_slopes=torch.ones(4),
              seqused_k=torch.full((2,), 7, dtype=torch.int32)),
        r"alibi_slopes cannot be combined with leftpad_k / seqused_k \(the ALiBi distance of a "
        r"key range is not defined here\); pass alibi_slopes=None or no key ranges"),
    Row("alibi_slopes", "alibi_meta", _with(lambda *t: t, alibi_slopes=torch.ones(4, device="meta")),
        r"alibi_slopes must be on q's device \(cpu\), got meta", cpp=False),
    Row("alibi_slopes", "alibi_cpu_on_cuda_q",
        _with(lambda *t: t, alibi_slopes=torch.ones(4)),
        r"alibi_slopes must be on q's device \(cuda:0\), got cpu", device="cuda"),
    Row("alibi_slopes", "alibi_list", _with(lambda *t: t, alibi_slopes=[1.0] * 4),
        r"alibi_slopes must be a torch\.Tensor or None, got list", cpp=False),
    Row("alibi_slopes", "alibi_sparse", _with(lambda *t: t, alibi_slopes=torch.ones(4).to_sparse()),
        r"alibi_slopes must be a strided \(dense\) tensor, got torch\.sparse_coo", cpp=False),
    # The op has no slope gradient; call_fwd and the rulebook refuse (the C++ op cannot know).
    Row("alibi_slopes", "alibi_requires_grad",
        _with(lambda *t: t, alibi_slopes=torch.ones(4, requires_grad=True)),
        r"alibi_slopes must not require grad: the kernels compute no gradient for the slopes "
        r"\(pass alibi_slopes\.detach\(\) to treat them as constants\)", cpp=False),
    Row("attn_bias", "bias_int32", _with(lambda *t: t, attn_bias=torch.ones(7, dtype=torch.int32)),
        r"attn_bias must be bool \(True = attend\), float16, bfloat16 or float32, got "
        r"torch\.int32"),
    Row("attn_bias", "bias_float64", _with(lambda *t: t, attn_bias=torch.zeros(5, 7).double()),
        r"attn_bias must be bool .* got torch\.float64"),
    Row("attn_bias", "bias_rows_mismatch", _with(lambda *t: t, attn_bias=torch.zeros(3, 7)),
        r"attn_bias of shape \[3, 7\] does not broadcast to \(batch, num_heads, seqlen_q, "
        r"seqlen_k\) = \(2, 4, 5, 7\) \(1-D to 4-D, trailing dimensions aligned, each of that "
        r"size or 1\)"),
    Row("attn_bias", "bias_kv_heads", _with(lambda *t: t, attn_bias=torch.zeros(2, 2, 5, 7)),
        r"attn_bias of shape \[2, 2, 5, 7\] does not broadcast"),
    Row("attn_bias", "bias_5d", _with(lambda *t: t, attn_bias=torch.zeros(1, 2, 4, 5, 7)),
        r"attn_bias of shape \[1, 2, 4, 5, 7\] does not broadcast"),
    Row("attn_bias", "bias_0d", _with(lambda *t: t, attn_bias=torch.zeros(())),
        r"attn_bias of shape \[\] does not broadcast"),
    Row("attn_bias", "bias_meta", _with(lambda *t: t, attn_bias=torch.zeros(7, device="meta")),
        r"attn_bias must be on q's device \(cpu\), got meta", cpp=False),
    Row("attn_bias", "bias_list", _with(lambda *t: t, attn_bias=[0.0] * 7),
        r"attn_bias must be a torch\.Tensor or None, got list", cpp=False),
    Row("attn_bias", "bias_cpu_on_cuda_q", _with(lambda *t: t, attn_bias=torch.zeros(7)),
        r"attn_bias must be on q's device \(cuda:0\), got cpu", device="cuda"),
    # The backward's limits, when a gradient will flow (the C++ backward checks them:
    # tests/test_attn_bias.py).
    Row("attn_bias", "bias_softcap_backward",
        _with(lambda q, k, v: (q.requires_grad_(), k, v), attn_bias=torch.zeros(7), softcap=5.0),
        r"attn_bias with softcap has no backward here \(softcap = 5\.0\); pass softcap=0 or "
        r"no attn_bias", cpp=False),
    # A bias that requires grad gets its gradient (also in a sliding window's band:
    # tests/test_attn_bias.py); it takes the backward's limits even when q, k and v do not
    # require grad.
    Row("attn_bias", "bias_grad_softcap",
        _with(lambda *t: t, attn_bias=torch.zeros(7, requires_grad=True), softcap=5.0),
        r"attn_bias with softcap has no backward here", cpp=False),
    Row("dropout_p", "dropout_one", _with(lambda *t: t, dropout_p=1.0),
        r"dropout_p must be in \[0, 1\), got 1\.0"),
    Row("dropout_p", "dropout_negative", _with(lambda *t: t, dropout_p=-0.25),
        r"dropout_p must be in \[0, 1\), got -0\.25"),
    Row("dropout_p", "dropout_str", _with(lambda *t: t, dropout_p="0.1"),
        r"dropout_p must be a real number in \[0, 1\), got str", cpp=False),
    # (A dropout's backward runs at every head dim, padded or packed.)
    # CPU tensors reach the op's CPU reference (the dispatcher's choice), never the C++ device
    # rule of the CUDA kernel; doors that run CUDA only ask the rulebook with devices=("cuda",).
    Row("device", "cpu_where_cuda_only", _base(), r"q must be a CUDA tensor, got device cpu",
        cpp=False, check=dict(devices=("cuda",))),
    Row("alignment", "misaligned_pointer", _misaligned_pointer,
        r"q must be 16-byte aligned with batch/seq/head strides divisible by 8 elements",
        device="cuda"),
    Row("alignment", "odd_stride", _odd_stride, r"k must be 16-byte aligned", device="cuda"),
]

ROWS_BY_ID = {r.id: r for r in ROWS}
assert len(ROWS_BY_ID) == len(ROWS)


def _params(rows):
    marks = lambda r: [pytest.mark.gpu] if r.device == "cuda" else []  # noqa: E731
    return [pytest.param(r, id=r.id, marks=marks(r)) for r in rows]


def _build(row):
    if row.device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return row.make(row.device)


def _head(msg: str) -> str:
    # C++ and Python print dtypes and devices differently; compare up to the value printed.
    return msg.split(", got")[0].split(" got ")[0].strip()


def test_every_rule_has_a_row():
    # The capability rule cannot be broken on any GPU that runs these tests (sm >= 7.5); it has
    # its own test below.
    assert {r.rule for r in ROWS} | {"capability"} == set(_rules.RULES)


@pytest.mark.parametrize("row", _params(ROWS))
def test_rulebook_reason(row):
    (q, k, v), kwargs = _build(row)
    reason = _rules.not_supported_reason(q, k, v, **kwargs, **row.check)
    assert reason is not None and re.match(row.regex, reason), (reason, row.regex)


@pytest.mark.parametrize("row", _params([r for r in ROWS if r.cpp]))
def test_cpp_check_gives_the_rulebook_message(row):
    (q, k, v), kwargs = _build(row)
    reason = _rules.not_supported_reason(q, k, v, **kwargs)
    ops = torch.ops.flash_attention_sm75
    # fwd_dropout: fwd's arguments with dropout_p after v
    op, head = ((ops.fwd_dropout, (q, k, v, kwargs["dropout_p"])) if "dropout_p" in kwargs
                else (ops.fwd, (q, k, v)))
    with pytest.raises(ValueError, match="^flash_attention_sm75: ") as cpp:
        op(*head, kwargs.get("softmax_scale"), False, True, kwargs.get("leftpad_k"),
           kwargs.get("seqused_k"), *kwargs.get("window_size", (-1, -1)),
           kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"), kwargs.get("attn_bias"))
    assert _head(str(cpp.value)) == _head("flash_attention_sm75: " + reason)


# The direct APIs take no key ranges (the op and the HF integration pass them).
# flash-attn's API has no attn_bias (the op and the SDPA wrapper's attn_mask take it).
_API_ROWS = [r for r in ROWS if r.rule not in ("key_range", "attn_bias") and not r.check
             and r.id != "alibi_with_key_range"]


@pytest.mark.parametrize("row", _params(_API_ROWS))
def test_direct_apis_raise_the_rulebook_reason_before_the_op(row, op_calls):
    (q, k, v), kwargs = _build(row)
    regex = "^flash_attention_sm75: " + row.regex
    with pytest.raises(ValueError, match=regex):
        fa.flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=regex):
        fa.flash_attention_forward(*to_bhsd(q, k, v), **kwargs)
    assert op_calls == []  # rejected before reaching the op (so before any kernel launch)


# Rows the SDPA wrapper rejects for its own reason first (torch's argument contract: a Python
# float scale) or that it never sees in this form.
_SDPA_OWN = {"scale_tensor", "scale_str", "scale_bool", "cpu_where_cuda_only",
             "window_left_minus_2", "window_right_minus_5", "window_not_pair", "window_float"}
# torch's SDPA has no soft-capping or ALiBi argument; its dropout_p is the wrapper's own
# argument (tests/test_dropout.py checks that door).
_NOT_IN_SDPA = {"softcap", "alibi_slopes", "dropout_p"}


@pytest.mark.parametrize("row", _params([r for r in _API_ROWS if r.id not in _SDPA_OWN
                                         and r.rule not in _NOT_IN_SDPA]))
def test_sdpa_wrapper_falls_back_with_the_rulebook_reason(row, monkeypatch):
    (q, k, v), kwargs = _build(row)
    monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", row.device)
    args = to_bhsd(q, k, v)
    expected = _rules.not_supported_reason(*args, kwargs.get("softmax_scale"), layout="bhsd",
                                           devices=(row.device,),
                                           names=("query", "key", "value", "scale"))
    assert expected is not None
    reason = sdpa.why_not_supported(*args, scale=kwargs.get("softmax_scale"), enable_gqa=True)
    assert reason == expected


def test_hf_integration_falls_back_with_the_rulebook_reason():
    hf = pytest.importorskip("flash_attention_sm75.integrations.transformers")
    previous = hf.configure(allow_cpu_reference=True)
    try:
        for row in (ROWS_BY_ID[i] for i in ("head_dim_12", "q_fp32", "gqa", "batch", "scale_nan")):
            (q, k, v), kwargs = row.make("cpu")
            args = to_bhsd(q, k, v)
            bound = {"dropout": 0.0, "scaling": kwargs.get("softmax_scale"), "is_causal": None,
                     "position_bias": None}
            reason = hf._unsupported_reason(torch.nn.Module(), *args, None, bound, {})
            assert reason == _rules.not_supported_reason(
                *args, kwargs.get("softmax_scale"), layout="bhsd", devices=("cuda", "cpu"),
                check_alignment=False, names=("query", "key", "value", "scaling")), row.id
    finally:
        hf.configure(**previous)


@pytest.mark.parametrize("shape", [dict(), dict(h=4, h_k=4), dict(h=8, h_k=1), dict(d=128),
                                   dict(b=1, s_q=1, s_k=1, h=1, h_k=1), dict(b=0), dict(s_k=0),
                                   dict(h=0, h_k=0), dict(s_q=0, s_k=0)])
@pytest.mark.parametrize("scale", [None, 0.125, 1])
def test_valid_input_passes_every_rule_and_the_cpp_check(shape, scale):
    q, k, v = bshd(**shape)
    b = q.shape[0]
    key_range = dict(leftpad_k=torch.zeros(b, dtype=torch.int32),
                     seqused_k=torch.full((b,), 3, dtype=torch.int32))
    assert _rules.not_supported_reason(q, k, v, scale) is None
    assert _rules.not_supported_reason(q, k, v, scale, **key_range) is None
    assert _rules.not_supported_reason(*to_bhsd(q, k, v), scale, layout="bhsd") is None
    torch.ops.flash_attention_sm75.fwd(q, k, v, scale, False, True, key_range["leftpad_k"],
                                       key_range["seqused_k"])  # raises if C++ disagrees


def test_misaligned_cpu_tensors_pass_the_alignment_rule():
    # The CPU reference reads any strided tensor; the 16-byte rule is the CUDA kernels'.
    (q, k, v), _ = _misaligned_pointer("cpu")
    assert _rules.not_supported_reason(q, k, v) is None
    assert _rules.not_supported_reason(q, k, v, check_alignment=True) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_capability_rule(monkeypatch):
    q, k, v = bshd(device="cuda")
    assert _rules.not_supported_reason(q, k, v) is None
    monkeypatch.setattr(_rules, "_capability", lambda index: (7, 0))
    reason = _rules.not_supported_reason(q, k, v)
    assert reason == "needs a GPU of compute capability >= 7.5 (Turing or newer), got 7.0"
    with pytest.raises(ValueError, match=re.escape(reason)):
        fa.flash_attn_func(q, k, v)


def test_rulebook_constants_are_what_the_messages_say():
    # The messages are built from the constants; a bucket added to HEAD_DIM_BUCKETS shows up in them.
    (q, k, v), _ = _base(d=_rules.MAX_HEAD_DIM + 8)("cpu")
    reason = _rules.not_supported_reason(q, k, v)
    assert f"to {_rules.MAX_HEAD_DIM}, got {_rules.MAX_HEAD_DIM + 8}" in reason
    assert _rules.DTYPES == (torch.float16,)


def test_head_dim_buckets_agree_with_the_kernels():
    # csrc/kernels/head_dims.h is the C++ side's list; generate_kernels.py instantiates it.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "csrc" / "kernels" / "head_dims.h").read_text()
    buckets = tuple(int(x) for x in re.search(r"kHeadDimBuckets\[\] = \{([^}]*)\}", text)
                    .group(1).split(","))
    assert buckets == _rules.HEAD_DIM_BUCKETS
    assert int(re.search(r"kHeadDimMultiple = (\d+)", text).group(1)) == _rules.HEAD_DIM_MULTIPLE
    for d in range(0, _rules.MAX_HEAD_DIM + 24):
        b = _rules.head_dim_bucket(d)
        if d % _rules.HEAD_DIM_MULTIPLE or not 0 < d <= _rules.MAX_HEAD_DIM:
            assert b == 0 and d not in _rules.HEAD_DIMS
        else:
            assert b == min(x for x in buckets if x >= d) and d in _rules.HEAD_DIMS


def test_scale_reason_names_each_door_s_argument(monkeypatch):
    # The scale is softmax_scale in the direct APIs, scale in torch's SDPA, scaling in
    # transformers: each door's message names its own argument.
    q = torch.zeros(1, 3, 2, 64, dtype=torch.float16)
    assert _rules.not_supported_reason(q, q, q, 1e30).startswith("softmax_scale must be")
    monkeypatch.setattr(sdpa, "_KERNEL_DEVICE_TYPE", "cpu")
    args = to_bhsd(q, q, q)
    assert sdpa.why_not_supported(*args, scale=1e30).startswith("scale must be a finite number")
    hf = pytest.importorskip("flash_attention_sm75.integrations.transformers")
    previous = hf.configure(allow_cpu_reference=True)
    try:
        bound = {"dropout": 0.0, "scaling": 1e30, "is_causal": None, "position_bias": None}
        reason = hf._unsupported_reason(torch.nn.Module(), *args, None, bound, {})
        assert reason.startswith("scaling must be a finite number"), reason
    finally:
        hf.configure(**previous)


def test_softcap_ratio_rule_holds_for_the_varlen_and_kvcache_ops():
    # The packed and KV-cache ops share check_score_mod with the dense op: the same rule, raised
    # before anything runs (the cache is not appended to).
    from flash_attention_sm75 import fa2

    regex = r"softcap / softmax_scale must be within \[2\^-100, 2\^100\]"
    q, k, v = (torch.randn(7, 2, 64).half() for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=regex):
        fa2.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, softmax_scale=1e-3, softcap=1e37)
    k_cache, v_cache = torch.randn(2, 8, 2, 64).half(), torch.randn(2, 8, 2, 64).half()
    before = k_cache.clone()
    with pytest.raises(ValueError, match=regex):
        fa2.flash_attn_with_kvcache(q[:2].unsqueeze(1), k_cache, v_cache, k=k[:2].unsqueeze(1),
                                    v=v[:2].unsqueeze(1),
                                    cache_seqlens=torch.tensor([2, 3], dtype=torch.int32),
                                    softcap=1e-40)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("d", [32, 72, 128])
@pytest.mark.parametrize("side", ["max", "min"])
def test_softcap_ratio_boundary_is_the_same_in_the_rulebook_and_the_op(d, side):
    # At the boundary with the default scale (1 / sqrt(d), computed as the op computes it), the
    # rulebook and the op accept and refuse the same softcaps, one ulp apart.
    import math

    q = torch.randn(1, 3, 1, d).half()
    edge = (_rules.SOFTCAP_RATIO_MAX if side == "max" else _rules.SOFTCAP_RATIO_MIN) / math.sqrt(d)
    outside = math.nextafter(edge, math.inf if side == "max" else 0.0)
    for cap, ok in ((edge, True), (outside, False)):
        reason = _rules.not_supported_reason(q, q, q, softcap=cap)
        assert (reason is None) == ok, (cap, reason)
        if ok:
            torch.ops.flash_attention_sm75.fwd(q, q, q, None, False, True, None, None, -1, -1, cap)
        else:
            with pytest.raises(ValueError, match=re.escape(reason)):
                torch.ops.flash_attention_sm75.fwd(q, q, q, None, False, True, None, None, -1, -1,
                                                   cap)
