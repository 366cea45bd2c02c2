"""CPU tests (run in CI): the HF integration's torch fallbacks give 0 for a query row that sees no
key (issue 20), on every fallback path, whatever torch's backend makes of such a row.

A row whose keys are all masked (bool all False, or float all ``-inf``) is 0 on the kernel path;
where the integration falls back (transformers' ``sdpa_attention_forward``, the ``"sdpa"`` entry
the patch replaced, the soft-cap fallback, the per-document mask of packed sequences) it used to
be whatever torch's SDPA backend gives there: 0 from torch 2.11's CPU kernels, but NaN from a
plain softmax (torch's math backend before its safe softmax, and NaN gradients to every key
through such a row) and an average of V from backends that fill masked scores with a finite
number (and from transformers itself when a ``position_bias`` turns a boolean mask into a finite
one). The tests run the fallbacks under torch's own SDPA and under two stand-in backends with
those two behaviours (``torch.nn.functional.scaled_dot_product_attention`` replaced, which
transformers looks up at every call), and check: the empty rows are 0, everything is finite,
gradients are finite and 0 through the empty rows, every other row equals transformers' stock
function under the same backend bit for bit, and a finite "dtype minimum" mask (rows all
``finfo.min``) gives exactly transformers' (finite) result.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402

from flash_attention_sm75 import _masks  # noqa: E402
from flash_attention_sm75.integrations import transformers as hf  # noqa: E402
from devtools.model_configs import build_random_model, make_config  # noqa: E402

_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _clean_state(hf_state):
    original = AttentionInterface._global_mapping["sdpa"]
    hf.remove_patch()
    yield
    hf.remove_patch()
    ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)
    AttentionInterface._global_mapping["sdpa"] = original


def _textbook_sdpa(fill):
    """An SDPA backend computed from the definition in float32, where masked scores get ``fill``:
    ``-inf`` gives NaN rows (and NaN gradients) for rows without keys, a finite number an
    average of V. ``-inf`` entries of float masks become ``fill`` too."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        s = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
        if is_causal:
            visible = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
            s = s.masked_fill(~visible, fill)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                s = s.masked_fill(~attn_mask, fill)
            else:
                s = s + attn_mask.float().clamp(min=fill)
        p = torch.softmax(s, dim=-1)
        if dropout_p:
            p = torch.nn.functional.dropout(p, dropout_p)
        return torch.matmul(p, value.float()).to(query.dtype)

    return sdpa


BACKENDS = {
    "torch": None,  # torch's own SDPA (0 for such rows on torch 2.11's CPU kernels)
    "nan": _textbook_sdpa(float("-inf")),
    "average": _textbook_sdpa(torch.finfo(torch.float32).min),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, monkeypatch):
    fn = BACKENDS[request.param]
    if fn is not None:
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fn)
    return request.param


def _attention_module(family="llama", **overrides):
    """The first attention layer of a tiny random model of a real config (its
    ``num_key_value_groups``, ``is_causal``, ``scaling``)."""
    model = build_random_model(make_config(family, **overrides), dtype=torch.float32, seed=3)
    return model.model.layers[0].self_attn


def _qkv(b, h, h_k, sq, sk, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g), torch.randn(b, h_k, sk, d, generator=g),
            torch.randn(b, h_k, sk, d, generator=g))


def _mask(kind, visible):
    """``visible`` (bool) as the mask kind: bool, additive ``-inf``, or additive ``finfo.min``."""
    if kind == "bool":
        return visible
    fill = float("-inf") if kind == "-inf" else torch.finfo(torch.float32).min
    return torch.zeros(visible.shape).masked_fill(~visible, fill)


def _empty(kind, visible):
    """(B or 1, H or 1, q, 1): rows that see no key (none for a finite-minimum mask)."""
    rows = ~visible.any(-1, keepdim=True)
    return rows if kind != "finite_min" else torch.zeros_like(rows)


def _check(out, ref, empty):
    """``out`` and ``ref`` are (B, q, H, D); ``empty`` (B', H', q, 1) broadcasts to them."""
    rows = empty.transpose(1, 2).expand(out.shape[:-1] + (1,))[..., 0]
    assert torch.isfinite(out).all()
    assert (out.detach()[rows] == 0).all()
    assert torch.equal(out.detach()[~rows], ref.detach()[~rows])
    return rows


def _backward(out, leaves, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * w).sum().backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all()


# ---------------------------------------------------------------------------------------------
# Direct calls of the registered function: transformers' sdpa_attention_forward as fallback
# ---------------------------------------------------------------------------------------------

def _causal_padded(b, sq, sk, pad):
    """transformers' causal + left-padding mask (bottom-right causal, ``pad[i]`` padding keys in
    row i): the padded queries of row i see no key."""
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    vis = (j <= i).expand(b, 1, sq, sk).clone()
    for r, p in enumerate(pad):
        vis[r, :, :, :p] = False
    return vis


@pytest.mark.parametrize("kind", ["bool", "-inf", "finite_min"])
@pytest.mark.parametrize("case", ["prefill", "prefill-per-head", "decode-per-head", "2-d"])
def test_registered_fallback_rows_without_keys_are_zero(backend, kind, case):
    module = _attention_module()  # Llama: 2 heads, 1 KV head
    h, h_k = 2, 1
    if case == "prefill":
        q, k, v = _qkv(2, h, h_k, 6, 6)
        vis = _causal_padded(2, 6, 6, [0, 3])
    elif case == "prefill-per-head":  # head 1 of row 0 hides everything from query 4
        q, k, v = _qkv(2, h, h_k, 6, 6)
        vis = _causal_padded(2, 6, 6, [0, 2]).expand(2, h, 6, 6).clone()
        vis[0, 1, 4] = False
    elif case == "decode-per-head":  # q_len 1 with a per-head mask: transformers packs GQA
        q, k, v = _qkv(2, h, h_k, 1, 7)
        vis = torch.ones(2, h, 1, 7, dtype=torch.bool)
        vis[1, 0] = False
    else:  # a 2-D (q, k) mask, broadcast by torch over batch and heads
        q, k, v = _qkv(2, h, h_k, 5, 5)
        vis = torch.ones(5, 5, dtype=torch.bool).tril()
        vis[2] = False
    mask = _mask(kind, vis)
    empty = _empty(kind, vis)
    empty = empty.reshape((1,) * (4 - empty.dim()) + tuple(empty.shape))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = hf.flash_attention_sm75_forward(module, *leaves, mask, dropout=0.0,
                                                   scaling=module.scaling)
    assert weights is None
    assert hf.get_stats()["fallback"] == 1  # CPU: the fallback path
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=module.scaling)
    _check(out, ref, empty)
    _backward(out, leaves)
    rows = empty.transpose(1, 2).expand(out.shape[:-1] + (1,))
    assert (leaves[0].grad.transpose(1, 2)[rows.expand(out.shape)] == 0).all()
    if kind == "finite_min" or backend == "torch":
        # No row without keys for torch's backend (its CPU kernels give them 0): the gradients
        # are the stock function's.
        stock = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, _ = sdpa_attention_forward(module, *stock, mask, dropout=0.0,
                                        scaling=module.scaling)
        _backward(ref, stock)
        for a, b in zip(leaves, stock):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def test_dropout_fallback_draws_as_stock(backend):
    # Training with attention dropout falls back: the rows without keys are 0 and every other
    # row is stock's under the same seed (the same dropout draws: the shapes are unchanged).
    module = _attention_module()
    q, k, v = _qkv(2, 2, 1, 6, 6)
    vis = _causal_padded(2, 6, 6, [0, 3])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out, _ = hf.flash_attention_sm75_forward(module, *leaves, vis, dropout=0.3)
    torch.manual_seed(7)
    ref, _ = sdpa_attention_forward(module, q, k, v, vis, dropout=0.3)
    _check(out, ref, ~vis.any(-1, keepdim=True))
    _backward(out, leaves)


def test_position_bias_with_a_boolean_mask():
    # transformers turns a boolean mask into bias-or-finfo.min when there is a position_bias
    # (T5): a row without keys then averages V even on torch's own backend.
    module = _attention_module()
    q, k, v = _qkv(2, 2, 1, 6, 6)
    vis = _causal_padded(2, 6, 6, [0, 3])
    bias = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(5))
    for mask in (vis, _mask("-inf", vis)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = hf.flash_attention_sm75_forward(module, *leaves, mask, position_bias=bias)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, position_bias=bias)
        _check(out, ref, ~vis.any(-1, keepdim=True))
        _backward(out, leaves)


@pytest.mark.parametrize("q_len", [6, 1])
def test_position_bias_with_a_boolean_mask_on_the_kernel_path(q_len):
    # The kernel path of the same call (the CPU reference op stands in for the kernels): the bias
    # it is handed must hide the keys of a row without any as -inf, not transformers' finite
    # minimum, or that row averages V (a left-padded T5 decoder's padded queries). Its rows with
    # keys match the fallback's, its empty rows are 0, and no gradient flows through them: the
    # learned position bias gets 0 there.
    module = _attention_module()
    q, k, v = (t.half() for t in _qkv(2, 2, 1, q_len, 6))  # the kernels' dtype
    vis = _causal_padded(2, q_len, 6, [0, 3 if q_len > 1 else 6])
    empty = ~vis.any(-1, keepdim=True)  # (B, 1, q, 1)
    assert empty.any() and not empty.all()
    bias = torch.randn(2, 2, q_len, 6, generator=torch.Generator().manual_seed(5)).half()
    ref, _ = hf.flash_attention_sm75_forward(module, q, k, v, vis, position_bias=bias)  # fallback
    hf.configure(allow_cpu_reference=True, decode_on_kernel=True)
    hf.reset_stats()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, _ = hf.flash_attention_sm75_forward(module, *leaves[:3], vis, position_bias=leaves[3])
    assert hf.get_stats()["kernel"] == 1, hf.get_stats()
    rows = empty.transpose(1, 2).expand(out.shape[:-1] + (1,))[..., 0]
    assert (out.detach()[rows] == 0).all()
    torch.testing.assert_close(out.detach()[~rows], ref[~rows], atol=2e-3, rtol=2e-3)
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert (leaves[3].grad.masked_select(empty) == 0).all()
    assert (leaves[3].grad.masked_select(~empty) != 0).any()


def test_output_attentions_fallback_keeps_no_weights(backend):
    # transformers' SDPA function returns no attention weights (None) even when asked; the
    # fallback returns what it returns, with the rows without keys zeroed in the output.
    module = _attention_module()
    q, k, v = _qkv(2, 2, 1, 6, 6)
    vis = _causal_padded(2, 6, 6, [4, 0])
    out, weights = hf.flash_attention_sm75_forward(module, q, k, v, vis, output_attentions=True)
    assert weights is None
    ref, _ = sdpa_attention_forward(module, q, k, v, vis)
    _check(out, ref, ~vis.any(-1, keepdim=True))


def test_softcap_fallback_rows_without_keys_have_zero_gradients():
    # Gemma 2's softcap falls back (CPU) to the soft-capped SDPA semantics: the empty rows are 0
    # and give no NaN to any gradient.
    module = _attention_module()
    q, k, v = _qkv(2, 2, 1, 6, 6)
    vis = _causal_padded(2, 6, 6, [0, 3])
    for kind in ("bool", "-inf"):
        mask = _mask(kind, vis)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = hf.flash_attention_sm75_forward(module, *leaves, mask, softcap=2.0)
        ref, _ = hf._softcap_sdpa_forward(module, q, k, v, vis | ~vis.any(-1, keepdim=True),
                                          softcap=2.0)
        _check(out, ref, ~vis.any(-1, keepdim=True))
        _backward(out, leaves)


def test_compiled_fallback_rows_without_keys_are_zero(backend):
    module = _attention_module()
    q, k, v = _qkv(2, 2, 1, 6, 6)
    vis = _causal_padded(2, 6, 6, [0, 3])
    torch._dynamo.reset()
    fn = torch.compile(lambda q_, k_, v_, m_: hf.flash_attention_sm75_forward(module, q_, k_, v_,
                                                                            m_)[0],
                       fullgraph=True, backend="eager")
    for mask in (vis, _mask("-inf", vis)):
        out = fn(q, k, v, mask)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask)
        _check(out, ref, ~vis.any(-1, keepdim=True))
    torch._dynamo.reset()


def test_expanded_masks_stay_expanded():
    # A mask broadcast by stride 0 (transformers expands masks built without padding) is read
    # once per distinct row and handed on still expanded: no copy the size of the broadcast.
    vis = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    vis[..., 2, :] = False
    wide = vis.expand(8, 4, 6, 6)
    visible, empty = _masks.without_empty_rows(wide)
    assert visible.shape == wide.shape and visible.stride()[:2] == (0, 0)
    assert empty.shape == (1, 1, 6, 1) and empty[0, 0, :, 0].tolist() == [
        False, False, True, False, False, False]
    assert visible[3, 1, 2].all() and torch.equal(visible[:, :, 3:], wide[:, :, 3:])


# ---------------------------------------------------------------------------------------------
# Packed sequences on the fallback (a per-document 4-D mask)
# ---------------------------------------------------------------------------------------------

def _documents(cu, t):
    """(t,) document of each token (-1: in no document) for offsets ``cu``."""
    doc = torch.full((t,), -1)
    for i in range(len(cu) - 1):
        doc[cu[i]:cu[i + 1]] = i
    return doc


@pytest.mark.parametrize("kind", ["none", "bool", "-inf", "finite_min"])
def test_packed_fallback_rows_without_keys_are_zero(backend, kind):
    # cu_seq_lens over one row of 9 tokens: documents [0, 3), [3, 7); tokens 7 and 8 are in no
    # document. With a mask, query 5 (document 1) sees none of its document's keys.
    module = _attention_module()
    q, k, v = _qkv(1, 2, 1, 9, 9)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    doc = _documents(cu.tolist(), 9)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    documents = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if kind == "none":
        mask, user = None, torch.ones(1, 1, 9, 9, dtype=torch.bool)
        documents &= j <= i  # causal within each document (no mask: module.is_causal)
    else:
        user = (j <= i).expand(1, 1, 9, 9).clone()
        user[..., 5, 3:7] = False
        mask = _mask(kind, user)
    seen = documents & user
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = hf.flash_attention_sm75_forward(module, *leaves, mask, cu_seq_lens_q=cu,
                                             cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    assert hf.get_stats()["fallback"] == 1
    # The fallback's reference: transformers' function with the documents mask (for a float
    # mask, the other documents' keys at -inf: a finite minimum there would let query 5, whose
    # own document's keys are all at the minimum, average over other documents' keys too).
    if kind in ("none", "bool"):
        ref_mask = seen
    else:
        ref_mask = torch.where(documents, mask, float("-inf"))
    ref, _ = sdpa_attention_forward(module, q, k, v, ref_mask)
    empty = ~seen.any(-1, keepdim=True)
    if kind == "finite_min":  # query 5 sees its document's keys at finfo.min: not empty
        empty[..., 5, :] = False
    _check(out, ref, empty)
    assert empty[0, 0, [5, 7, 8], 0].tolist() == [kind != "finite_min" and kind != "none",
                                                  True, True]
    _backward(out, leaves)


def test_packed_position_ids_with_a_mask_fall_back_with_zero_rows(backend):
    # Restarting position_ids with an attention_mask: the per-document mask on the fallback.
    module = _attention_module()
    q, k, v = _qkv(1, 2, 1, 8, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    user = (j <= i).expand(1, 1, 8, 8).clone()
    user[..., 6, 3:] = False  # query 6 (document 1) sees nothing of its document
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    seen = user & (doc[:, None] == doc[None, :])
    for mask in (user, _mask("-inf", user)):
        out, _ = hf.flash_attention_sm75_forward(module, q, k, v, mask, position_ids=pos)
        ref, _ = sdpa_attention_forward(module, q, k, v, seen)
        empty = ~seen.any(-1, keepdim=True)
        assert empty[0, 0, :, 0].tolist() == [False] * 6 + [True, False]
        _check(out, ref, empty)


# ---------------------------------------------------------------------------------------------
# Tiny models of real configs: registered name and the patched "sdpa" entry
# ---------------------------------------------------------------------------------------------

def _left_padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :4] = 0
    return ids.masked_fill(am == 0, 0), am


@pytest.mark.parametrize("path", ["registered", "patched"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_left_padded_models_stay_finite(family, path, monkeypatch):
    # Under a backend giving NaN for rows without keys, a left-padded batch on stock SDPA is NaN
    # everywhere after the first layer (the padded rows' NaN reach every row through V). On the
    # integration's fallback the padded rows are 0: logits and gradients stay finite and equal
    # stock SDPA on torch's own backend on the real tokens.
    ids, am = _left_padded()
    real = am.bool()
    stock = build_random_model(family, dtype=torch.float32, seed=4, attn_implementation="sdpa")
    ref = stock(input_ids=ids, attention_mask=am).logits
    ref[real].sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in stock.named_parameters()}
    ours = build_random_model(family, dtype=torch.float32, seed=4,
                              attn_implementation="sdpa" if path == "patched"
                              else hf.ATTENTION_NAME_PLAIN)
    if path == "patched":
        hf.apply_patch()
    with torch.no_grad():  # torch's backend: the same logits as stock everywhere
        assert torch.equal(ours(input_ids=ids, attention_mask=am).logits, ref.detach())
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", BACKENDS["nan"])
    got = ours(input_ids=ids, attention_mask=am).logits
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[real], ref[real].detach(), atol=1e-4, rtol=1e-4)
    got[real].sum().backward()
    assert hf.get_stats()["fallback"] > 0 and hf.get_stats()["kernel"] == 0
    for n, p in ours.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-4, rtol=1e-3)


def test_replaced_sdpa_entry_weights_are_zeroed_too():
    # A replaced "sdpa" entry that returns attention weights (B, H, q, k): the patch's fallback
    # zeroes the rows without keys in the weights as in the output (probabilities of a row
    # that sees no key are 0).
    def eager_like(module, query, key, value, attention_mask, scaling=None, **kwargs):
        key = key.repeat_interleave(module.num_key_value_groups, dim=1)
        value = value.repeat_interleave(module.num_key_value_groups, dim=1)
        s = torch.matmul(query, key.transpose(-2, -1)) * (scaling or query.shape[-1] ** -0.5)
        s = s.masked_fill(~attention_mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.matmul(p, value).transpose(1, 2), p

    AttentionInterface._global_mapping["sdpa"] = eager_like
    hf.apply_patch(None)
    module = _attention_module()
    q, k, v = _qkv(2, 2, 1, 6, 6)
    vis = _causal_padded(2, 6, 6, [0, 3])
    out, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, vis, scaling=0.25)
    ref, ref_w = eager_like(module, q, k, v, vis, scaling=0.25)
    empty = ~vis.any(-1, keepdim=True)
    _check(out, ref, empty)
    assert torch.isfinite(weights).all()
    assert (weights[empty.expand(2, 2, 6, 1).expand(weights.shape)] == 0).all()
    keep = ~empty.expand(2, 2, 6, 6)
    assert torch.equal(weights[keep], ref_w[keep])
