"""CPU tests: the HF integration honours every argument transformers passes (run in CI).

* packed sequences (``cu_seq_lens_q/k`` and restarting ``position_ids``) give the
  per-document result on every path (registered names; the varlen op via its CPU reference and
  the per-document-mask fallback), for a function call, a whole model with the cache on or
  off, a ``DataCollatorWithFlattening`` training step and a Qwen2.5-VL-shaped vision tower;
* the keyword-argument allow-list: unknown arguments raise on the registered names (a sparse
  attention's ``indices``) and fall back on the patched ``"sdpa"`` entry (strict mode: raise),
  inert ones (Trainer's ``num_items_in_batch`` among them) run on the kernel, continuous
  batching's bookkeeping falls back and generates stock's tokens, ``s_aux`` / ``sinks`` raise (``softcap`` runs: test_transformers.py),
  T5's all-zero ``position_bias``
  runs on the kernel;
* ``torch.compile(fullgraph=True)`` of tiny Qwen2/Llama models traces and equals eager;
* sentence-transformers loads a model with either registered name, and a model that declares
  ``_compatible_flash_implementations`` builds with ``"sm75_attention"``.
"""
import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from flash_attention_sm75 import _ops  # noqa: E402
from flash_attention_sm75.integrations import transformers as hf  # noqa: E402
from devtools.model_configs import build_random_model  # noqa: E402
from test_transformers import _Attn, _qkv  # noqa: E402  (the module-attention stand-in, inputs)

needs_op = pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                              reason=f"extension not built: {_ops.EXTENSION_ERROR}")


@pytest.fixture(autouse=True)
def _clean_state(hf_state):
    yield


def _per_document(q, k, v, cu_q, cu_k, causal, window=None):
    """float32 torch SDPA on each document alone (flattened token layout, bottom-right causal
    per document), (1, Tq, H, D): the definition of packed attention."""
    b, h, sq, d = q.shape
    h_k, sk = k.shape[1], k.shape[2]
    qf = q.float().transpose(0, 1).reshape(h, b * sq, d)
    kf = k.float().transpose(0, 1).reshape(h_k, b * sk, d).repeat_interleave(h // h_k, 0)
    vf = v.float().transpose(0, 1).reshape(h_k, b * sk, d).repeat_interleave(h // h_k, 0)
    out = torch.zeros(h, b * sq, d)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        rows = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        cols = torch.arange(k1 - k0)[None, :]
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if causal:
            allowed &= cols <= rows
        if window is not None:
            allowed &= (rows - cols < window) if causal else ((rows - cols).abs() < window)
        out[:, q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            qf[:, q0:q1], kf[:, k0:k1], vf[:, k0:k1], attn_mask=allowed)
    return out.transpose(0, 1).reshape(b, sq, h, d)


# ---------------------------------------------------------------------------------------------
# Packed sequences: the function
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel_path", [False, True], ids=["fallback", "kernel-path"])
@pytest.mark.parametrize("case", ["issue", "causal-gqa", "bidirectional", "cross-lengths",
                                  "batch2", "int32-one-cu", "window"])
def test_cu_seq_lens_give_the_per_document_result(case, kernel_path):
    # The example: head_dim 64, cu_seq_lens = [0, 10, 24]; before the fix the whole
    # packed row ran as one sequence (max abs difference 1.6).
    if kernel_path:
        if not _ops.EXTENSION_AVAILABLE:
            pytest.skip("extension not built")
        hf.configure(allow_cpu_reference=True)  # without packing this call runs on the op
    b, h, h_k, causal, window = 1, 4, 4, True, None
    cu_q = cu_k = [0, 10, 24]
    if case == "causal-gqa":
        h_k, cu_q = 2, [0, 3, 4, 17, 17, 24]
        cu_k = cu_q
    elif case == "bidirectional":
        causal = False  # vision towers pass is_causal=False
        cu_q = cu_k = [0, 7, 16, 24]
    elif case == "cross-lengths":
        cu_q, cu_k = [0, 5, 12], [0, 9, 20]
    elif case == "batch2":
        b, cu_q = 2, [0, 5, 12, 20, 24]  # documents over the flattened (2 x 12) tokens
        cu_k = cu_q
    elif case == "window":
        window, cu_q = 4, [0, 11, 24]
        cu_k = cu_q
    sq, sk = cu_q[-1] // b, cu_k[-1] // b
    q, k, v = _qkv(b, h, h_k, sq, sk, 64, seed=len(case))
    kwargs = dict(cu_seq_lens_q=torch.tensor(cu_q), cu_seq_lens_k=torch.tensor(cu_k),
                  max_length_q=max(torch.tensor(cu_q).diff()).item(),
                  max_length_k=max(torch.tensor(cu_k).diff()).item(), is_causal=causal)
    if case == "int32-one-cu":
        kwargs = dict(cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32))
    if window is not None:
        kwargs["sliding_window"] = window
    out, _ = hf.flash_attention_sm75_forward(_Attn(h, h_k), q, k, v, None, **kwargs)
    ref = _per_document(q, k, v, cu_q, cu_k, causal, window)
    assert out.shape == (b, sq, h, 64) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    stats = hf.get_stats()
    if kernel_path:  # one call of the varlen op over the flattened tokens
        assert stats["kernel"] == 1 and stats["fallback"] == 0, stats
    else:  # CPU tensors: torch SDPA with the per-document mask
        assert stats["kernel"] == 0 and stats["fallback"] == 1
        assert any("packed" in r and "CUDA" in r for r in stats["reasons"]), stats


def test_cu_seq_lens_combine_with_a_mask_and_strict_mode_raises():
    q, k, v = _qkv(1, 2, 2, 12, 12, 64, seed=3)
    cu = [0, 5, 12]
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    mask[..., 3] = False  # a hidden key inside the first document
    out, _ = hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, mask,
                                             cu_seq_lens_q=torch.tensor(cu),
                                             cu_seq_lens_k=torch.tensor(cu))
    docs = torch.zeros(12, 12, dtype=torch.bool)
    docs[:5, :5] = docs[5:, 5:] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask & docs).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    from flash_attention_sm75 import strict
    with strict(), pytest.raises(ValueError, match="packed"):
        hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None, cu_seq_lens_q=torch.tensor(cu))
    with pytest.raises(ValueError, match="cu_seq_lens_q must be a 1-D integer tensor"):
        hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None,
                                        cu_seq_lens_q=torch.tensor([0.0, 12.0]))


@pytest.mark.parametrize("kernel_path", [False, True], ids=["fallback", "kernel-path"])
def test_restarting_position_ids_give_the_per_document_result(kernel_path):
    if kernel_path:
        if not _ops.EXTENSION_AVAILABLE:
            pytest.skip("extension not built")
        hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(1, 4, 2, 24, 24, 64, seed=5)
    cu = [0, 10, 24]
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    out, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, position_ids=pos)
    torch.testing.assert_close(out.float(), _per_document(q, k, v, cu, cu, True),
                               atol=2e-3, rtol=2e-3)
    assert hf.get_stats()["kernel" if kernel_path else "fallback"] == 1
    # RoBERTa-style positions start at padding_idx + 1: a restart is "the row's minimum again".
    out2, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, position_ids=pos + 2)
    assert torch.equal(out2, out)
    # One sequence (positions counting up from any start): not packed, plain path.
    hf.reset_stats()
    plain = torch.arange(5, 29)[None]
    out3, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, position_ids=plain)
    ref3, _ = sdpa_attention_forward(_Attn(4, 2), q, k, v, None)
    if kernel_path:
        assert hf.get_stats()["kernel"] == 1
        torch.testing.assert_close(out3, ref3, atol=2e-3, rtol=2e-3)
    else:
        assert torch.equal(out3, ref3)


def test_the_patched_sdpa_entry_keeps_stock_semantics_for_packing_kwargs():
    # Under apply_patch the call means what it means to stock SDPA, which reads neither
    # cu_seq_lens nor position_ids (the mask transformers builds carries packing there).
    q, k, v = _qkv(1, 2, 2, 12, 12, 64, seed=6)
    kwargs = dict(cu_seq_lens_q=torch.tensor([0, 5, 12]), cu_seq_lens_k=torch.tensor([0, 5, 12]))
    ours, _ = hf._attention(sdpa_attention_forward, _Attn(2, 2), q, k, v, None, (), kwargs)
    stock, _ = sdpa_attention_forward(_Attn(2, 2), q, k, v, None, **kwargs)
    assert torch.equal(ours, stock)


# ---------------------------------------------------------------------------------------------
# Packed sequences: models
# ---------------------------------------------------------------------------------------------


def _docs(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


@needs_op
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_a_mask_stating_the_documents_runs_on_the_varlen_op(mask_dtype, monkeypatch):
    # transformers builds a per-document mask from packed position_ids when there is no cache
    # (use_cache=False, gradient checkpointing): that mask says nothing the varlen op does
    # not, so the call runs there (checked once per mask object); any other mask falls back.
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(1, 4, 2, 24, 24, 64, seed=31)
    cu = [0, 10, 24]
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    docs = torch.zeros(24, 24, dtype=torch.bool)
    docs[:10, :10] = docs[10:, 10:] = True
    docs &= torch.ones(24, 24, dtype=torch.bool).tril()
    mask = docs[None, None]
    if mask_dtype != torch.bool:
        mask = torch.zeros(1, 1, 24, 24, dtype=mask_dtype).masked_fill(
            ~mask, torch.finfo(mask_dtype).min)
    built = []
    real = hf._explicit_mask
    monkeypatch.setattr(hf, "_explicit_mask", lambda *a: built.append(a[3]) or real(*a))
    plain, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, position_ids=pos)
    for _ in range(3):  # layers of one forward: the same mask object
        out, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, mask, position_ids=pos)
        assert torch.equal(out, plain)
    stats = hf.get_stats()
    assert stats["kernel"] == 4 and stats["fallback"] == 0, stats
    assert built == [None]  # the documents mask, built for the one comparison
    torch.testing.assert_close(out.float(), _per_document(q, k, v, cu, cu, True),
                               atol=2e-3, rtol=2e-3)
    # One more hidden key, or a bidirectional module under this causal mask: not the documents
    other = mask.clone()
    if mask_dtype == torch.bool:
        other[..., 15, 12] = False
    else:
        other[..., 15, 12] = torch.finfo(mask_dtype).min
    hf.reset_stats()
    out2, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, other, position_ids=pos)
    out3, _ = hf.flash_attention_sm75_forward(_Attn(4, 2, is_causal=False), q, k, v, mask,
                                              position_ids=pos)
    stats = hf.get_stats()
    assert stats["kernel"] == 0 and stats["fallback"] == 2, stats
    assert not torch.equal(out2, plain)
    torch.testing.assert_close(out3, out, atol=2e-3, rtol=2e-3)  # the mask's result still
    # float16's minimum (-65504) does not hide a key exactly: not the documents, the mask's own
    # result on the fallback (the same here, where no score is near 65504 above another)
    half = torch.zeros(1, 1, 24, 24, dtype=torch.float16).masked_fill(
        ~docs[None, None], torch.finfo(torch.float16).min)
    hf.reset_stats()
    built.clear()
    out4, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, half, position_ids=pos)
    assert hf.get_stats()["kernel"] == 0 and hf.get_stats()["fallback"] == 1, hf.get_stats()
    torch.testing.assert_close(out4, out, atol=2e-3, rtol=2e-3)
    # A learned mask (requires grad) equal to the documents still gets its gradient: the
    # fallback with the mask, never the varlen op without it
    if mask_dtype != torch.bool:
        learned = torch.zeros(1, 4, 1, 24, dtype=mask_dtype, requires_grad=True)
        qg = q.detach().requires_grad_()
        out4, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), qg, k, v, learned + mask,
                                                  position_ids=pos)
        (g,) = torch.autograd.grad(out4.float().sum(), learned)
        assert g.abs().sum() > 0
    # Under inference_mode the mask (an inference tensor) is compared once too
    built.clear()
    with torch.inference_mode():
        inf_mask = mask.clone()
        for _ in range(3):
            out5, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, inf_mask,
                                                      position_ids=pos)
            assert torch.equal(out5, plain)
    assert built == [None]


@needs_op
def test_packed_training_without_a_cache_runs_on_the_varlen_op():
    # DataCollatorWithFlattening-style rows, use_cache=False and gradient checkpointing (which
    # turns the cache off): every layer on the varlen op, the same loss and gradients as with
    # the cache (where transformers builds no mask).
    hf.configure(allow_cpu_reference=True)
    model = build_random_model("llama", dtype=torch.float16, seed=5,
                               attn_implementation="flash_attention_sm75").train()
    docs = _docs([9, 14, 5], seed=6)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    n_layers = model.config.num_hidden_layers

    def step(**extra):
        model.zero_grad(set_to_none=True)
        hf.reset_stats()
        loss = model(input_ids=ids, position_ids=pos, labels=ids, **extra).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], hf.get_stats()

    ref_loss, ref_grads, stats = step(use_cache=True)
    assert stats["kernel"] == n_layers and stats["fallback"] == 0, stats
    for extra, checkpointing in ((dict(use_cache=False), False), ({}, True)):
        if checkpointing:
            model.activation_checkpointing_enable() if hasattr(
                model, "activation_checkpointing_enable") else model.gradient_checkpointing_enable()
        loss, grads, stats = step(**extra)
        assert stats["kernel"] >= n_layers and stats["fallback"] == 0, stats
        assert torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            assert torch.equal(g, r)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["flash_attention_sm75", "sm75_attention"])
def test_packed_row_logits_equal_each_document_alone(name, use_cache):
    # position_ids restart per document and there is no attention_mask, as with
    # DataCollatorWithFlattening. With the cache on, transformers builds no packed mask, so the
    # function must read position_ids itself (as transformers' FlashAttention path does).
    docs = _docs([9, 14, 5], seed=1)
    model = build_random_model("llama", dtype=torch.float32, seed=2, attn_implementation=name)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=use_cache).logits[0]
        alone = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_data_collator_with_flattening_training_step_matches_per_document(flash_kwargs):
    from transformers import DataCollatorWithFlattening

    docs = _docs([7, 12, 4], seed=3)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    if flash_kwargs:
        assert "cu_seq_lens_q" in batch
    model = build_random_model("qwen2", dtype=torch.float32, seed=4,
                               attn_implementation="flash_attention_sm75").train()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")

    def step(m, **extra):
        m.zero_grad(set_to_none=True)
        out = m(**batch, **extra)  # the cache left on (the config's default use_cache=True)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    loss, grads = step(model)
    # Stock SDPA without a cache builds the per-document mask from position_ids: the reference.
    loss_ref, grads_ref = step(ref, use_cache=False)
    torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=1e-6)
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], atol=1e-6, rtol=1e-5, msg=n)
    # ...and it differs from attending across documents (what the packed row gave before).
    loss_cross, _ = step(ref)
    assert abs(loss_cross - loss_ref) > 1e-4


def test_qwen2_5_vl_vision_tower_matches_sdpa():
    # Under a "flash" name the vision tower packs the images and passes cu_seq_lens with
    # attention_mask=None and is_causal=False; under other names it calls once per image.
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    cfg = Qwen2_5_VLVisionConfig(depth=2, hidden_size=160, num_heads=2, intermediate_size=64,
                                 out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                                 spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1],
                                 in_channels=3)
    assert cfg.hidden_size // cfg.num_heads == 80  # the head_dim
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    tokens = int(grid.prod(-1).sum())
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(tokens, 3 * 2 * 2 * 2, generator=g)
    outs = {}
    for name in ("sdpa", "flash_attention_sm75", "sm75_attention"):
        cfg._attn_implementation = name
        torch.manual_seed(8)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
            cfg, attn_implementation=name).eval()
        with torch.no_grad():
            out = tower(pixels, grid_thw=grid)
        outs[name] = getattr(out, "pooler_output", None)
        if outs[name] is None:
            outs[name] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    for name in ("flash_attention_sm75", "sm75_attention"):
        torch.testing.assert_close(outs[name], outs["sdpa"], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The keyword-argument allow-list
# ---------------------------------------------------------------------------------------------


@needs_op
def test_unknown_keyword_raises_on_the_registered_function():
    """Under the registered names a model may pass what it folds into the mask only for "eager"
    / "sdpa" (DeepSeek-V3.2's top-k ``indices``); the SDPA fallback would ignore it, so it is
    refused (it used to fall back and return dense attention)."""
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(1, 2, 2, 6, 6, 64, seed=9)
    sparse = torch.arange(6)
    for name in ("indices", "block_indices", "block_table"):
        with pytest.raises(ValueError, match=rf"\['{name}'\] are not supported.*"
                                             r"attn_implementation='sdpa' or 'eager'"):
            hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None, **{name: sparse})
    assert hf.get_stats()["kernel"] == 0 and hf.get_stats()["fallback"] == 0
    # None means "not used"
    hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None, indices=None)
    assert hf.get_stats()["kernel"] == 1
    # The patched "sdpa" entry means what stock SDPA means: it falls back to it (strict: raises)
    hf.reset_stats()
    out, _ = hf._attention(sdpa_attention_forward, _Attn(2, 2), q, k, v, None, (),
                           {"indices": sparse})
    ref, _ = sdpa_attention_forward(_Attn(2, 2), q, k, v, None, indices=sparse)
    assert torch.equal(out, ref)
    stats = hf.get_stats()
    assert stats["kernel"] == 0 and any("['indices']" in r for r in stats["reasons"]), stats
    from flash_attention_sm75 import strict
    with strict(), pytest.raises(ValueError, match="indices"):
        hf._attention(sdpa_attention_forward, _Attn(2, 2), q, k, v, None, (),
                      {"indices": sparse})


@needs_op
def test_sparse_attention_model_is_refused_not_run_dense():
    """A tiny DeepSeek-V3.2 (top-k sparse attention): stock "sdpa" folds the selection into the
    mask; under our names transformers passes it as ``indices``. It used to fall back to torch
    SDPA without it (dense attention: a different result); it raises now."""
    cls = getattr(transformers, "DeepseekV32ForCausalLM", None)
    if cls is None:
        pytest.skip("this transformers has no DeepSeek-V3.2")
    hf.configure(allow_cpu_reference=True)
    cfg = transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, index_topk=4,
        index_head_dim=16, index_n_heads=2, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        sparse = model(ids).logits  # stock sdpa, the selection in the mask
        model.config.index_topk = 4096
        for mod in model.modules():
            if hasattr(mod, "index_topk"):
                mod.index_topk = 4096
        dense = model(ids).logits
        model.config.index_topk = 4
        for mod in model.modules():
            if hasattr(mod, "index_topk"):
                mod.index_topk = 4
        assert (sparse - dense).abs().max() > 1e-3  # the selection matters here
        for name in ("flash_attention_sm75", "sm75_attention"):
            model.set_attn_implementation(name)
            with pytest.raises(ValueError, match=r"\['indices'\] are not supported"):
                model(ids)


@needs_op
def test_inert_keywords_run_on_the_kernel():
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(2, 4, 2, 6, 6, 64, seed=10)
    kwargs = dict(use_cache=True, output_hidden_states=False, return_dict=True,
                  cache_position=torch.arange(6), past_key_values=object(),
                  position_embeddings=(torch.ones(1), torch.ones(1)), layer_idx=1,
                  output_router_logits=False, position_ids=torch.arange(6)[None].expand(2, 6),
                  seq_idx=torch.zeros(2, 6, dtype=torch.int32), encoder_hidden_states=None,
                  sliding_window=None, deterministic=True, output_attentions=False,
                  num_items_in_batch=torch.tensor(12))
    out, _ = hf.flash_attention_sm75_forward(_Attn(4, 2), q, k, v, None, **kwargs)
    ref, _ = sdpa_attention_forward(_Attn(4, 2), q, k, v, None)
    assert hf.get_stats()["kernel"] == 1, hf.get_stats()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def _tiny_llama(**extra):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, initializer_range=0.3,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                   **extra)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@needs_op
def test_trainer_s_num_items_in_batch_runs_on_the_kernel():
    """Trainer adds ``num_items_in_batch`` to the inputs of a model whose loss takes it, and it
    reaches every attention call; it used to send every layer of every step to the fallback."""
    hf.configure(allow_cpu_reference=True)
    model = _tiny_llama().half().train()
    model.set_attn_implementation("sm75_attention")
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(18)).loss.backward()
    stats = hf.get_stats()
    assert stats["kernel"] == 2 and stats["fallback"] == 0, stats


@needs_op
def test_token_type_ids_passed_to_a_decoder_run_on_the_kernel():
    """A tokenizer that returns token_type_ids, passed whole to a decoder's forward
    (``model(**batch)``, sentence-transformers): transformers carries them through **kwargs into
    every attention call, where stock SDPA ignores them; they must not be refused."""
    hf.configure(allow_cpu_reference=True)
    model = _tiny_llama().half().eval()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for name in ("sm75_attention", "flash_attention_sm75"):
            model.set_attn_implementation(name)
            hf.reset_stats()
            out = model(input_ids=ids, token_type_ids=torch.zeros_like(ids),
                        mm_token_type_ids=torch.zeros_like(ids)).logits
            assert hf.get_stats()["kernel"] == 2, hf.get_stats()
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@needs_op
def test_continuous_batching_falls_back_and_generates_stock_tokens():
    """generate_batch passes its cache's bookkeeping (read_index, write_index, logits_indices,
    logits_processor_args) to attention: not refused; those calls fall back with the packed
    sequences' per-document mask and give stock "sdpa" generation's tokens."""
    if not hasattr(transformers.LlamaForCausalLM, "generate_batch"):
        pytest.skip("this transformers has no continuous batching")
    hf.configure(allow_cpu_reference=True)
    base = _tiny_llama().half().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 9, 3)]
    gc = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
    ref = []
    for p in prompts:
        with torch.no_grad():
            ref.append(base.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist())
    model = copy.deepcopy(base)
    model.set_attn_implementation("flash_attention_sm75")
    with torch.no_grad():
        out = model.generate_batch(inputs=prompts, generation_config=gc)
    got = [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.split("_")[-1]))]
    assert got == ref
    stats = hf.get_stats()
    assert stats["fallback"] > 0 and any("read_index" in r for r in stats["reasons"]), stats


@pytest.mark.parametrize("name", ["s_aux", "sinks"])
def test_sinks_raise_on_the_registered_function(name):
    q, k, v = _qkv(1, 2, 2, 6, 6, 64, seed=11)
    with pytest.raises(ValueError, match=rf"{name}=.*attn_implementation='eager'"):
        hf.flash_attention_sm75_forward(_Attn(2, 2), q, k, v, None, **{name: torch.zeros(2)})


@needs_op
def test_zero_and_nonzero_position_bias_run_on_the_kernel():
    # T5's cross-attention passes position_bias = zeros (1, H, q_len, kv_len) with scaling 1.
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(2, 4, 4, 5, 7, 64, seed=12)
    mod = _Attn(4, 4, is_causal=False)
    zeros = torch.zeros(1, 4, 5, 7, dtype=torch.float16)
    out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, None, scaling=1.0,
                                             position_bias=zeros)
    ref, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=1.0, position_bias=zeros)
    assert hf.get_stats()["kernel"] == 1
    torch.testing.assert_close(out, ref, atol=4e-3, rtol=4e-3)
    hf.reset_stats()
    bias = torch.randn(1, 4, 5, 7).half()  # a relative-position bias: the kernel's attn_bias
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[1, ..., 5:] = False
    for m in (None, mask, torch.zeros(2, 1, 5, 7).half().masked_fill(~mask, -1e4)):
        hf.reset_stats()
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, m, scaling=1.0, position_bias=bias)
        ref, _ = sdpa_attention_forward(mod, q.float(), k.float(), v.float(),
                                        None if m is None else (m if m.dtype == torch.bool
                                                                else m.float()),
                                        scaling=1.0, position_bias=bias.float())
        assert hf.get_stats()["kernel"] == 1 and hf.get_stats()["fallback"] == 0
        torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=4e-3)
    # causal (a decoder's self-attention without a mask), also into a longer cache (cropped)
    for kv in (5, 7):
        hf.reset_stats()
        causal = _Attn(4, 4, is_causal=True)
        out, _ = hf.flash_attention_sm75_forward(causal, q, k[:, :, :kv], v[:, :, :kv], None,
                                                 scaling=1.0, position_bias=bias[..., :kv])
        ref, _ = sdpa_attention_forward(causal, q.float(), k[:, :, :kv].float(),
                                        v[:, :, :kv].float(), None, scaling=1.0,
                                        position_bias=bias[..., :kv].float())
        assert hf.get_stats()["kernel"] == 1
        torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=4e-3)
    # a learned bias that requires grad runs on the kernel and gets the gradient torch's path
    # gives it (through create_position_bias_mask), with the mask's hidden keys at 0
    for m in (None, mask):
        hf.reset_stats()
        learned = bias.float().clone().requires_grad_(True)
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, m, scaling=1.0,
                                                 position_bias=learned)
        assert hf.get_stats()["kernel"] == 1 and hf.get_stats()["fallback"] == 0
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        (got,) = torch.autograd.grad(out, learned, g)
        ref_leaf = bias.double().clone().requires_grad_(True)
        ref, _ = sdpa_attention_forward(mod, q.double(), k.double(), v.double(), m,
                                        scaling=1.0, position_bias=ref_leaf)
        (want,) = torch.autograd.grad(ref, ref_leaf, g.double())
        # (the op returns fp16 out, which D = rowsum(dO o O) reads: ~1e-3 of rounding)
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
        assert want.abs().max() > 0.1


@needs_op
@pytest.mark.parametrize("case", ["zeros", "key_padding", "position_bias_zeros"])
def test_learned_masks_and_biases_keep_their_gradient(case):
    """A mask or position bias that requires grad is the kernel's bias, never key ranges or
    "nothing to add": all zeros and key-padding-shaped ones too (their gradient is not zero)."""
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(2, 4, 4, 6, 6, 64, seed=21)
    mod = _Attn(4, 4, is_causal=False)
    base = torch.zeros(2, 1, 6, 6)
    if case == "key_padding":
        base[1, ..., 4:] = torch.finfo(torch.float32).min
    if case == "position_bias_zeros":
        base = torch.zeros(1, 4, 6, 6)
    leaf = base.clone().requires_grad_(True)
    kw = dict(position_bias=leaf, scaling=1.0) if case == "position_bias_zeros" else {}
    mask = None if case == "position_bias_zeros" else leaf
    out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, mask, **kw)
    assert hf.get_stats()["kernel"] == 1 and hf.get_stats()["fallback"] == 0, hf.get_stats()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(22)).to(out.dtype)
    (got,) = torch.autograd.grad(out, leaf, g)
    ref_leaf = base.double().clone().requires_grad_(True)
    ref_kw = dict(position_bias=ref_leaf, scaling=1.0) if case == "position_bias_zeros" else {}
    ref, _ = sdpa_attention_forward(mod, q.double(), k.double(), v.double(),
                                    None if mask is None else ref_leaf, **ref_kw)
    (want,) = torch.autograd.grad(ref, ref_leaf, g.double())
    assert want.abs().max() > 0.05
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


@needs_op
def test_remembered_decision_knows_the_mask_requires_grad():
    """The per-forward memo: a learned mask planned as a bias under no_grad (no backward
    limits) must not be reused when grad mode is on and the backward cannot take it (head_dim
    256): that call falls back, with torch's gradient."""
    hf.configure(allow_cpu_reference=True)
    q, k, v = _qkv(1, 2, 2, 5, 5, 256, seed=23)
    mod = _Attn(2, 2)
    mask = torch.randn(1, 1, 5, 5).requires_grad_(True)
    with torch.no_grad():
        hf.flash_attention_sm75_forward(mod, q, k, v, mask)
    assert hf.get_stats()["kernel"] == 1
    hf.reset_stats()
    out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, mask)
    assert hf.get_stats()["fallback"] == 1, hf.get_stats()
    (g,) = torch.autograd.grad(out.float().sum(), mask)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


@needs_op
def test_t5_logits_match_sdpa():
    from transformers import T5Config, T5ForConditionalGeneration

    hf.configure(allow_cpu_reference=True)
    cfg = T5Config(vocab_size=64, d_model=128, d_kv=64, d_ff=128, num_layers=2,
                   num_decoder_layers=2, num_heads=2, decoder_start_token_id=0)
    torch.manual_seed(13)
    ref = T5ForConditionalGeneration(cfg).eval().half()
    ours = copy.deepcopy(ref)
    ref.set_attn_implementation("sdpa")
    ours.set_attn_implementation("sm75_attention")
    ids = torch.randint(1, 64, (2, 9))
    dec = torch.randint(1, 64, (2, 6))
    with torch.no_grad():
        a = ours(input_ids=ids, decoder_input_ids=dec).logits
        b = ref.float()(input_ids=ids, decoder_input_ids=dec).logits
    stats = hf.get_stats()
    if stats["kernel"] + stats["fallback"] == 0:
        pytest.skip(f"T5 of transformers {transformers.__version__} does not call "
                    f"registered attention functions")
    # every attention call: encoder and decoder self-attention (relative-position bias, the
    # decoder's causal) and cross-attention (zero bias)
    assert stats["kernel"] == 6 and stats["fallback"] == 0, stats
    torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)
    # a padded encoder batch: the mask and the bias together
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    hf.reset_stats()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
        b = ref(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
    assert hf.get_stats()["fallback"] == 0, hf.get_stats()
    torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------


def _skip_if_stock_model_does_not_compile(family, ids, am):
    """Skip when transformers' own model, on stock SDPA, cannot be compiled with fullgraph=True on
    this torch either (transformers 5.24 on torch 2.6: dynamo cannot trace its kwargs wrapper)."""
    torch._dynamo.reset()
    stock = build_random_model(family, dtype=torch.float16, seed=14, attn_implementation="sdpa")
    try:
        torch.compile(stock, fullgraph=True, backend="aot_eager")(input_ids=ids, attention_mask=am)
    except torch._dynamo.exc.Unsupported as e:
        pytest.skip(f"transformers {transformers.__version__} does not compile with fullgraph=True "
                    f"on torch {torch.__version__} even on stock SDPA: {str(e).splitlines()[0]}")


@pytest.mark.parametrize("kernel_path", [False, True], ids=["fallback", "kernel-path"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_fullgraph_compile_equals_eager(family, padded, kernel_path):
    if kernel_path:
        if not _ops.EXTENSION_AVAILABLE:
            pytest.skip("extension not built")
        hf.configure(allow_cpu_reference=True)
    torch._dynamo.reset()
    model = build_random_model(family, dtype=torch.float16, seed=14,
                               attn_implementation="flash_attention_sm75")
    g = torch.Generator().manual_seed(15)
    ids = torch.randint(1, 128, (2, 11), generator=g)
    am = torch.ones_like(ids)
    if padded:
        am[1, :4] = 0  # left padding
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=am).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        try:
            got = compiled(input_ids=ids, attention_mask=am).logits
        except torch._dynamo.exc.Unsupported:
            _skip_if_stock_model_does_not_compile(family, ids, am)
            raise
    real = am.bool()
    torch.testing.assert_close(got.float()[real], eager.float()[real], atol=1e-2, rtol=1e-2)


def test_fullgraph_compile_as_the_first_call_of_the_process():
    # The first attention call of a process can be a traced one (a training script that compiles
    # its model before anything else): nothing on the traced path may import a module (dynamo:
    # "Bad import result", an error under fullgraph=True). A fresh interpreter, so that no
    # earlier test has already run an eager call.
    if not _ops.EXTENSION_AVAILABLE:
        pytest.skip("extension not built")
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from flash_attention_sm75.integrations import transformers as hf\n"
        "from devtools.model_configs import build_random_model\n"
        "hf.configure(allow_cpu_reference=True)\n"
        "m = build_random_model('llama', dtype=torch.float16, seed=14,\n"
        "                       attn_implementation='sm75_attention')\n"
        "ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(15))\n"
        "am = torch.ones_like(ids); am[1, :4] = 0\n"
        "with torch.no_grad():\n"
        "    got = torch.compile(m, fullgraph=True, backend='eager')(input_ids=ids,\n"
        "                                                          attention_mask=am).logits\n"
        "    want = m(input_ids=ids, attention_mask=am).logits\n"
        "real = am.bool()\n"
        "torch.testing.assert_close(got.float()[real], want.float()[real], atol=1e-2, rtol=1e-2)\n"
        "assert hf.get_stats()['kernel'] > 0\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Loading: sentence-transformers, models with _compatible_flash_implementations
# ---------------------------------------------------------------------------------------------


def _tiny_bert_dir(tmp_path):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=128, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(16)
    BertModel(cfg).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("name", ["flash_attention_sm75", "sm75_attention"])
def test_sentence_transformers_loads_and_encodes(tmp_path, name):
    st = pytest.importorskip("sentence_transformers")
    path = _tiny_bert_dir(tmp_path)
    sentences = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10 w11"]
    ref = st.SentenceTransformer(str(path), device="cpu",
                                 model_kwargs={"attn_implementation": "sdpa"})
    model = st.SentenceTransformer(str(path), device="cpu",
                                   model_kwargs={"attn_implementation": name})
    a = model.encode(sentences, convert_to_tensor=True)
    b = ref.encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flash_lookups_answer_for_our_names_only():
    from transformers import modeling_flash_attention_utils as mfu
    from transformers import modeling_utils as mu

    for fn in (mfu.lazy_import_flash_attention, mu.lazy_import_flash_attention):
        assert fn._flash_attention_sm75_guard
        for name in hf.ATTENTION_NAMES:
            (fa, varlen, *_), _ = fn(name)
            assert fa is None and varlen is None
    calls = []
    guard = hf._guarded_lazy_import(lambda name, *a, **kw: calls.append((name, a, kw)) or "orig")
    assert guard("flash_attention_sm75") != "orig" and guard("sm75_attention") != "orig"
    assert guard("flash_attention_2", allow_all_kernels=True) == "orig"
    assert guard("paged|flash_attention_sm75") != "orig"
    assert calls == [("flash_attention_2", (), {"allow_all_kernels": True})]


def test_model_with_compatible_flash_implementations_builds_under_the_plain_name():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       num_local_experts=2, num_experts_per_tok=1, vocab_size=64,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert getattr(GptOssForCausalLM, "_compatible_flash_implementations", None)
    model = GptOssForCausalLM._from_config(cfg, attn_implementation=hf.ATTENTION_NAME_PLAIN)
    assert model.config._attn_implementation == "sm75_attention"
    # gpt-oss's attention sinks are applied by neither the kernel nor torch SDPA: a clear error
    # at the first forward, never attention without the sinks.
    with pytest.raises(ValueError, match="s_aux=.*attn_implementation='eager'"):
        model(input_ids=torch.randint(0, 64, (1, 5)))
