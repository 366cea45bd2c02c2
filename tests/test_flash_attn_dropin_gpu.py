"""GPU tests of the flash_attn drop-in (skipped without CUDA; the CPU file checks exactness).

* flash-attn's public functions on shapes of the kind its own test suite uses (written anew:
  lengths that are not multiples of the tiles, seqlen_q above and below seqlen_k, one-token
  queries, head dims from 32 to 256 including one that is not a multiple of 8, MHA / GQA / MQA),
  forward, LSE and gradients against float64 with FlashAttention's criterion
  (tests/reference.py: ``max|ours - ref| <= 2 * max|pytorch fp16 - ref| + atol``);
* varlen (random lengths with empty and one-token sequences) and the KV cache (decode, causal
  chunks, rotary, paged) against per-sequence float64;
* transformers' ``attn_implementation="flash_attention_2"`` through the installed drop-in on tiny
  random Llama and Qwen2 models: prefill, a padded batch, greedy generation and a training step
  against ``"sdpa"`` and a float32 reference (the tolerance scheme of
  tests/test_transformers_gpu.py: ours may err at most about as much as stock fp16 SDPA).
"""
import copy
import math

import pytest
import torch

from flash_attention_sm75 import _ops, fa2
from reference import assert_close_fa, assert_lse_close, attention_ref, seed_from

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                       reason=f"extension not built: {_ops.EXTENSION_ERROR}"),
]

DEV = "cuda"
F16 = torch.float16


def _rand(*shape, grad=False):
    t = torch.randn(*shape, device=DEV, dtype=F16)
    return t.requires_grad_(True) if grad else t


def _check_against_float64(fn, q, k, v, ref_fn, g=None, names=("q", "k", "v")):
    """Forward (and with ``g`` the gradients) of ``fn(q, k, v) -> (out, lse)`` against
    ``ref_fn(q, k, v, upcast, reorder) -> (out, lse)`` in float64, FlashAttention's criterion."""
    out, lse = fn(q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_(g is not None) for t in (q, k, v))
    ref, ref_lse = ref_fn(q64, k64, v64, True, False)
    qpt, kpt, vpt = (t.detach().clone().requires_grad_(g is not None) for t in (q, k, v))
    pt, _ = ref_fn(qpt, kpt, vpt, False, True)
    assert_close_fa(out, ref, pt)
    assert_lse_close(lse, ref_lse)
    if g is None:
        return
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    pts = torch.autograd.grad(pt, (qpt, kpt, vpt), g)
    for name, a, r, p in zip(names, grads, refs, pts):
        # the absolute slack of tests/test_backward.py (a gradient that is exactly 0 in float64,
        # e.g. dq with one key, is a cancellation of O(1) terms in float32)
        assert_close_fa(a, r, p, name="d" + name, atol=1e-3)


# (seqlen_q, seqlen_k): ragged tails, q shorter and longer than k, single-token queries
DENSE_LENGTHS = [(1, 239), (7, 1), (97, 97), (113, 203), (128, 320), (256, 129), (509, 509),
                 (1024, 1000), (2, 2048)]
HEAD_DIMS = [32, 59, 64, 80, 96, 128, 160, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", DENSE_LENGTHS)
def test_flash_attn_func(sq, sk, causal, d, heads):
    h, hk = heads
    torch.manual_seed(seed_from(sq, sk, causal, d, heads))
    backward = sq * sk <= 128 * 320  # gradients on the smaller shapes
    q, k, v = _rand(2, sq, h, d, grad=backward), _rand(2, sk, hk, d, grad=backward), \
        _rand(2, sk, hk, d, grad=backward)

    def ours(q, k, v):
        out, lse, s = fa2.flash_attn_func(q, k, v, 0.0, None, causal, return_attn_probs=True)
        assert s.numel() == 0
        return out, lse

    def ref(q, k, v, upcast, reorder):
        return attention_ref(q, k, v, causal=causal, upcast=upcast, reorder_ops=reorder)

    _check_against_float64(ours, q, k, v, ref, torch.randn(2, sq, h, d, device=DEV, dtype=F16)
                           if backward else None)


@pytest.mark.parametrize("form", ["qkvpacked", "kvpacked"])
def test_packed_forms(form):
    torch.manual_seed(3)
    if form == "qkvpacked":
        qkv = _rand(2, 200, 3, 4, 64, grad=True)
        out = fa2.flash_attn_qkvpacked_func(qkv, causal=True)
        q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(2))
    else:
        q, kv = _rand(2, 77, 8, 128, grad=True), _rand(2, 300, 2, 2, 128, grad=True)
        out = fa2.flash_attn_kvpacked_func(q, kv, causal=True)
        k, v = (t.detach().requires_grad_(True) for t in kv.unbind(2))
        q = q.detach().requires_grad_(True)
    ref = fa2.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    packed = qkv.grad if form == "qkvpacked" else kv.grad
    parts = [q.grad, k.grad, v.grad] if form == "qkvpacked" else [k.grad, v.grad]
    assert torch.equal(packed, torch.stack(parts, dim=2))


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEV)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 72])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_varlen(causal, d, heads):
    h, hk = heads
    g = torch.Generator().manual_seed(seed_from("varlen", causal, d, heads))
    lens_q = torch.randint(0, 300, (9,), generator=g).tolist() + [0, 1, 257]
    lens_k = torch.randint(0, 300, (9,), generator=g).tolist() + [5, 0, 257]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    torch.manual_seed(seed_from("varlen-data", causal, d))
    q = _rand(sum(lens_q), h, d, grad=True)
    k, v = _rand(sum(lens_k), hk, d, grad=True), _rand(sum(lens_k), hk, d, grad=True)

    def ours(q, k, v):
        out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=causal, return_attn_probs=True)
        return out, lse

    def ref(q, k, v, upcast, reorder):
        outs, lses = [], []
        for b in range(len(lens_q)):
            if lens_q[b] == 0:
                continue
            qs = q[cu_q[b]:cu_q[b + 1]].unsqueeze(0)
            if lens_k[b] == 0:
                outs.append((qs[0] * 0).to(torch.float64 if upcast else q.dtype))
                lses.append(torch.full((h, lens_q[b]), -math.inf, device=DEV,
                                       dtype=torch.float64 if upcast else torch.float32))
                continue
            o, lse = attention_ref(qs, k[cu_k[b]:cu_k[b + 1]].unsqueeze(0),
                                   v[cu_k[b]:cu_k[b + 1]].unsqueeze(0), causal=causal,
                                   upcast=upcast, reorder_ops=reorder)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    _check_against_float64(ours, q, k, v, ref, torch.randn(sum(lens_q), h, d, device=DEV,
                                                           dtype=F16))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 5, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache(causal, seqlen_q, paged):
    torch.manual_seed(seed_from("kvcache", causal, seqlen_q, paged))
    B, S, h, hk, d, new, page = 4, 512, 8, 2, 128, 3, 64
    q = _rand(B, seqlen_q, h, d)
    kc, vc = _rand(B, S, hk, d), _rand(B, S, hk, d)
    k, v = _rand(B, new, hk, d), _rand(B, new, hk, d)
    # the last entry fills the cache to its end with the new keys (or, for 64 causal query
    # rows, whose rotary positions run to cache_seqlens + 63, the rotary table)
    seqlens = torch.tensor([0, 17, 300, S - max(new, seqlen_q if causal else 1)],
                           dtype=torch.int32, device=DEV)
    angles = torch.arange(S, device=DEV).double()[:, None] * torch.rand(32, device=DEV).double()
    cos, sin = angles.cos().to(F16), angles.sin().to(F16)
    kwargs = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=causal,
                  return_softmax_lse=True)
    plain_k, plain_v = kc.clone(), vc.clone()
    with torch.no_grad():
        ref_out, ref_lse = fa2.flash_attn_with_kvcache(q, plain_k, plain_v, k, v, **kwargs)
        if paged:
            perm = torch.randperm(B * S // page, device=DEV)
            table = perm.view(B, S // page).to(torch.int32)
            pk = torch.empty(B * S // page, page, hk, d, device=DEV, dtype=F16)
            pv = torch.empty_like(pk)
            pk[perm] = kc.reshape(B * S // page, page, hk, d)
            pv[perm] = vc.reshape(B * S // page, page, hk, d)
            out, lse = fa2.flash_attn_with_kvcache(q, pk, pv, k, v, block_table=table, **kwargs)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
            assert torch.equal(pk[table.long()].flatten(1, 2), plain_k)
    # the reference: float64 attention over the cache the call left, q rotated as flash-attn
    rd = 2 * cos.shape[1]
    pos = seqlens.long()[:, None] + (torch.arange(seqlen_q, device=DEV)[None]
                                     if causal and seqlen_q > 1 else 0)
    pos = pos.expand(B, seqlen_q)
    c, s = cos[pos].double()[:, :, None], sin[pos].double()[:, :, None]
    x1, x2 = q[..., 0:rd:2].double(), q[..., 1:rd:2].double()
    q_rot = torch.cat((torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2),
                       q[..., rd:].double()), -1).to(F16)
    for b in range(B):
        end = int(seqlens[b]) + new
        o, lse = attention_ref(q_rot[b:b + 1], plain_k[b:b + 1, :end], plain_v[b:b + 1, :end],
                               causal=causal)
        pt, _ = attention_ref(q_rot[b:b + 1], plain_k[b:b + 1, :end], plain_v[b:b + 1, :end],
                              causal=causal, upcast=False, reorder_ops=True)
        assert_close_fa(ref_out[b:b + 1], o, pt, name=f"out[{b}]")
        assert_lse_close(ref_lse[b:b + 1], lse, name=f"lse[{b}]")


# ---------------------------------------------------------------------------------------------
# transformers' flash_attention_2 through the installed drop-in
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dropin_site(tmp_path_factory):
    from dropin_env import install_dropin

    return install_dropin(str(tmp_path_factory.mktemp("flash_attn_dropin")))


@pytest.fixture
def fa2_env(dropin_site, monkeypatch):
    pytest.importorskip("transformers")
    from dropin_env import dropin_visible

    with dropin_visible(monkeypatch, dropin_site):
        from transformers.utils import import_utils

        assert import_utils.is_flash_attn_2_available()
        yield


MODELS = {
    "llama": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  intermediate_size=1024, vocab_size=4096, num_hidden_layers=3),
    "qwen2": dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                  intermediate_size=1024, vocab_size=4096, num_hidden_layers=3),
}
LENGTHS = [203, 150, 77, 19]


def _model(name):
    from devtools.model_configs import build_random_model, make_config

    return build_random_model(make_config(name, **MODELS[name]), dtype=F16, device=DEV, seed=0,
                              attn_implementation="flash_attention_2")


def _batch(lengths, vocab, seed, left=True):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            am[b, s - n:] = 1
        else:
            am[b, :n] = 1
    return ids.masked_fill(am == 0, 0).to(DEV), am.to(DEV)


def _logits(model, impl, ids, am):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am).logits.float()


def _ref_logits(model, ids, am):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("sdpa")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        return ref(input_ids=ids, attention_mask=am).logits.float()


def _check(label, ours, stock, ref, max_factor=2.0, max_slack=0.02, mean_factor=1.5,
           mean_slack=1e-3):
    e_o, e_s = (ours - ref).abs(), (stock - ref).abs()
    top_o = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    top_s = (stock.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\n[{label}] ours-vs-fp32 max {e_o.max():.4g} mean {e_o.mean():.3g} top1 {top_o:.4f} | "
          f"stock-vs-fp32 max {e_s.max():.4g} mean {e_s.mean():.3g} top1 {top_s:.4f}")
    assert torch.isfinite(ours).all()
    assert e_o.max() <= max_factor * e_s.max() + max_slack
    assert e_o.mean() <= mean_factor * e_s.mean() + mean_slack
    assert top_o >= top_s - 0.05


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("batch", ["b1", "b4-left-padded"])
def test_transformers_prefill(fa2_env, op_calls, varlen_op_calls, name, batch):
    model = _model(name)
    assert model.config._attn_implementation == "flash_attention_2"
    lengths = [257] if batch == "b1" else LENGTHS
    ids, am = _batch(lengths, model.config.vocab_size, seed=1)
    ours = _logits(model, "flash_attention_2", ids, am)
    n = model.config.num_hidden_layers
    # b1: flash_attn_func (the padded op, no key ranges); padded: unpad ->
    # flash_attn_varlen_func (the varlen op on the real tokens only) -> pad
    calls, other = (op_calls, varlen_op_calls) if batch == "b1" else (varlen_op_calls, op_calls)
    assert len(calls) == n and not other, "every layer runs the op"
    assert all(c[6] is None for c in op_calls)
    assert all(c[0].shape[0] == sum(lengths) for c in varlen_op_calls)
    stock = _logits(model, "sdpa", ids, am)
    real = am.bool()
    _check(f"{name} {batch} prefill", ours[real], stock[real], _ref_logits(model, ids, am)[real])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_generate(fa2_env, name):
    model = _model(name)
    ids, am = _batch(LENGTHS, model.config.vocab_size, seed=2)
    new = 24
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    seq = gen.sequences
    ours = torch.stack(list(gen.logits), dim=1).float()
    full_am = torch.cat([am, torch.ones(am.shape[0], new, dtype=am.dtype, device=DEV)], 1)
    window = slice(ids.shape[1] - 1, ids.shape[1] + new - 1)
    stock = _logits(model, "sdpa", seq, full_am)[:, window]
    ref = _ref_logits(model, seq, full_am)[:, window]
    _check(f"{name} generate", ours.flatten(0, 1), stock.flatten(0, 1), ref.flatten(0, 1),
           max_factor=3.0, max_slack=0.03, mean_factor=2.0, mean_slack=2e-3)
    agree = (seq[:, ids.shape[1]:] == stock.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("padded", [False, True], ids=["full", "right-padded"])
def test_transformers_training_step(fa2_env, name, padded):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(name).train()
    lengths = [300, 211] if padded else [300, 300]
    ids, am = _batch(lengths, model.config.vocab_size, seed=3, left=False)
    g = torch.Generator().manual_seed(4)
    labels = torch.randint(0, model.config.vocab_size, ids.shape, generator=g).to(DEV)
    labels = labels.masked_fill(am == 0, -100)
    if not padded:
        am = None

    def grads(m, impl=None, math=False):
        if impl is not None:
            m.set_attn_implementation(impl)
        m.zero_grad(set_to_none=True)
        ctx = sdpa_kernel(SDPBackend.MATH) if math else torch.enable_grad()
        with ctx:
            logits = m(input_ids=ids, attention_mask=am).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            (loss * 4096.0).backward()
        return {n: p.grad.float() for n, p in m.named_parameters()}

    g_ours = grads(model, "flash_attention_2")
    g_stock = grads(model, "sdpa")
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("sdpa")
    g_32 = grads(ref, math=True)

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    for pname, g32 in g_32.items():
        assert torch.isfinite(g_ours[pname]).all(), pname
        e_o, e_s = rel(g_ours[pname], g32), rel(g_stock[pname], g32)
        assert e_o <= 2 * e_s + 5e-3, (pname, e_o, e_s)
