"""GPU tests of the transformers integration on realistic model shapes (skipped without CUDA).

Models: random weights (fixed seed, fp16) with the shapes of Qwen2-0.5B (all 24 layers, GQA 14/2,
head_dim 64), Llama-3.2-1B (4 of 16 layers, GQA 32/8, head_dim 64) and Llama-2-7B (2 layers,
MHA 32/32, head_dim 128); see devtools/model_configs.py.

Tolerance. Ours and stock SDPA are both fp16 pipelines; they differ only in the attention kernel,
and every fp16 matmul/norm around it rounds differently as soon as its input differs by one ulp,
so a fixed absolute tolerance on the logits would be a guess that depends on depth and logit
scale. Instead each test measures the error that stock fp16 SDPA itself makes against a float32
reference (the same weights upcast to fp32, torch's MATH SDPA backend, TF32 off) and requires ours
to be of the same size:

* max |ours - ref32| <= 2 * max |stock - ref32| + 0.02
* mean |ours - ref32| <= 1.5 * mean |stock - ref32| + 1e-3
* top-1 agreement(ours, ref32) >= top-1 agreement(stock, ref32) - 0.05

A wrong mask is far above these bounds: on 4 layers of the Qwen2-0.5B shapes (fp32, CPU),
dropping the causal mask changes the logits by max 4.2 / mean 0.54, hiding only the diagonal key
by max 2.3 / mean 0.15, while the fp16 error of the 24-layer model (batch 1, 128 tokens, CPU) is
max ~0.007 / mean ~0.001; an attention kernel as accurate as torch's fp16 kernels lands at
ratios near 1. Only real tokens are compared: rows of left-padding queries see no key (ours
returns 0 there, stock SDPA something else).

Greedy generation is checked by teacher forcing: our generated sequence is fed to the stock fp16
model and to the fp32 reference in one forward, and our per-step logits are compared like the
prefill logits with looser bounds (3x + 0.03 on the max, 2x + 2e-3 on the mean), since
incremental decoding adds its own fp16 rounding differences against a one-shot forward; >= 90% of
our greedy tokens must be the stock model's teacher-forced argmax (random-weight logits have near
ties: top-1/top-2 gaps average ~0.13 for a logit std of ~0.6 at this vocabulary size, so fp16
noise flips ~1-4% of them). Each test prints max abs diff, mean abs diff and top-1 agreement.

Training (test_training_gradients_match_stock_sdpa): two-layer fp16 Llama models (head_dim 64
with GQA, head_dim 128), loss.backward() through the kernel's backward; every parameter's
gradient must be as close to the float32 model's as stock fp16 SDPA's is (relative norm per
parameter, ours <= 2x stock + 5e-3; see the test's docstring).
"""
import copy
import gc
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

transformers = pytest.importorskip("transformers")

from flash_attention_sm75 import _ops  # noqa: E402
from reference import cuda_kernels_run  # noqa: E402
from flash_attention_sm75.integrations import transformers as hf  # noqa: E402
from devtools.model_configs import (  # noqa: E402
    build_random_model,
    make_config,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ops.EXTENSION_AVAILABLE,
                       reason=f"extension not built: {_ops.EXTENSION_ERROR}"),
]

# name -> number of layers (None: the real depth)
MODELS = {"qwen2-0.5b": None, "llama-3.2-1b": 4, "llama-2-7b": 2,
          # head dims 256, 96, 80 (the buckets' tails run them: head_dims.h)
          "gemma-3-1b": 2, "phi-3-mini": 2, "phi-2": 2}
PROMPT_LEN = 257                   # batch 1: crosses several 64/128-row tiles, ragged tail
PADDED_LENGTHS = [203, 150, 77, 19]  # batch 4, left padded
NEW_TOKENS = 32
DEVICE = "cuda"

_MODEL_CACHE = {}


def _model(name):
    if name not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        gc.collect()
        torch.cuda.empty_cache()
        _MODEL_CACHE[name] = build_random_model(
            name, dtype=torch.float16, device=DEVICE, seed=0,
            attn_implementation="flash_attention_sm75", num_hidden_layers=MODELS[name])
    return _MODEL_CACHE[name]


@pytest.fixture(scope="module", autouse=True)
def _free_models():
    yield
    _MODEL_CACHE.clear()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _state():
    settings = hf.configure(allow_cpu_reference=False)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    hf.remove_patch()
    hf.reset_stats()
    yield
    hf.remove_patch()
    hf.configure(**settings)
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _left_padded(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, s - n:] = 1
    ids = ids.masked_fill(am == 0, 0)
    return ids.to(DEVICE), am.to(DEVICE)


def _logits(model, impl, ids, am):
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=am).logits.float()
    model.set_attn_implementation("flash_attention_sm75")
    return out


def _reference(model):
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("sdpa")
    return ref


def _ref_logits(ref, ids, am):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
        return ref(input_ids=ids, attention_mask=am).logits.float()


def _metrics(x, y):
    d = (x - y).abs()
    return {"max": d.max().item(), "mean": d.mean().item(),
            "top1": (x.argmax(-1) == y.argmax(-1)).float().mean().item()}


def _check(label, ours, stock, ref, max_factor=2.0, mean_factor=1.5, max_slack=0.02,
           mean_slack=1e-3):
    m_os = _metrics(ours, stock)
    m_or = _metrics(ours, ref)
    m_sr = _metrics(stock, ref)
    print(f"\n[{label}] ours-vs-stock max {m_os['max']:.4g} mean {m_os['mean']:.3g} "
          f"top1 {m_os['top1']:.4f} | ours-vs-fp32 max {m_or['max']:.4g} mean "
          f"{m_or['mean']:.3g} top1 {m_or['top1']:.4f} | stock-vs-fp32 max {m_sr['max']:.4g} "
          f"mean {m_sr['mean']:.3g} top1 {m_sr['top1']:.4f}")
    assert torch.isfinite(ours).all()
    assert m_or["max"] <= max_factor * m_sr["max"] + max_slack, (m_or, m_sr)
    assert m_or["mean"] <= mean_factor * m_sr["mean"] + mean_slack, (m_or, m_sr)
    assert m_or["top1"] >= m_sr["top1"] - 0.05, (m_or, m_sr)
    return m_os


@pytest.mark.parametrize("name,batch", [(n, b) for n in MODELS for b in ("b1", "b4-left-padded")])
def test_prefill_logits_match_stock_sdpa(name, batch):
    model = _model(name)
    vocab = model.config.vocab_size
    if batch == "b1":
        ids, am = _left_padded([PROMPT_LEN], vocab, seed=1)
    else:
        ids, am = _left_padded(PADDED_LENGTHS, vocab, seed=2)
    _prefill_on_kernel_matches_stock(model, ids, am, f"{name} {batch} prefill")


def _prefill_on_kernel_matches_stock(model, ids, am, label, keep_ref=False):
    """Every layer's prefill runs the kernel (no fallback) and the real tokens' logits match
    stock SDPA against the fp32 reference (_check); returns the fp32 model if asked."""
    hf.reset_stats()
    ours = _logits(model, "flash_attention_sm75", ids, am)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == model.config.num_hidden_layers, stats
    assert stats["fallback"] == 0, stats
    stock = _logits(model, "sdpa", ids, am)
    ref = _reference(model)
    ref_logits = _ref_logits(ref, ids, am)
    if not keep_ref:
        del ref
        ref = None
    real = am.bool()
    _check(label, ours[real], stock[real], ref_logits[real])
    return ref


@pytest.mark.parametrize("name", ["qwen2-0.5b", "gemma-3-1b", "phi-3-mini", "phi-2"])
def test_greedy_generate_left_padded_teacher_forced(name):
    model = _model(name)
    n_layers = model.config.num_hidden_layers
    ids, am = _left_padded(PADDED_LENGTHS, model.config.vocab_size, seed=3)
    prompt_len = ids.shape[1]

    hf.reset_stats()
    model.set_attn_implementation("flash_attention_sm75")
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW_TOKENS,
                             do_sample=False, use_cache=True,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    stats = hf.get_stats()
    seq = gen.sequences
    assert seq.shape == (len(PADDED_LENGTHS), prompt_len + NEW_TOKENS)
    assert stats["kernel_prefill"] == n_layers, stats
    decode_calls = n_layers * (NEW_TOKENS - 1)
    if hf.configure()["decode_on_kernel"]:
        assert stats["kernel_decode"] == decode_calls and stats["fallback"] == 0, stats
    else:
        assert stats["fallback"] == decode_calls, stats

    ours = torch.stack(list(gen.logits), dim=1).float()  # (B, NEW_TOKENS, V)
    full_am = torch.cat([am, torch.ones(am.shape[0], NEW_TOKENS, dtype=am.dtype,
                                        device=am.device)], dim=1)
    window = slice(prompt_len - 1, prompt_len + NEW_TOKENS - 1)
    stock = _logits(model, "sdpa", seq, full_am)[:, window]
    ref = _reference(model)
    ref_logits = _ref_logits(ref, seq, full_am)[:, window]
    del ref
    per_step = (ours - stock).abs().amax(dim=(0, 2))
    print(f"\n[{name} generate] per-step max |ours - stock teacher-forced|: "
          f"{[round(x, 4) for x in per_step.tolist()]}")
    m = _check(f"{name} generate {NEW_TOKENS} tokens", ours.flatten(0, 1), stock.flatten(0, 1),
               ref_logits.flatten(0, 1), max_factor=3.0, mean_factor=2.0, max_slack=0.03,
               mean_slack=2e-3)
    # our greedy tokens are what the stock model predicts under teacher forcing
    agree = (seq[:, prompt_len:] == stock.argmax(-1)).float().mean().item()
    print(f"[{name} generate] greedy tokens == stock teacher-forced argmax: {agree:.4f}; "
          f"ours-vs-stock top1 {m['top1']:.4f}")
    assert agree >= 0.9


@pytest.mark.parametrize("name,window", [("gemma-3-1b", 64), ("mistral", 100)])
def test_sliding_window_prefill_and_generate_run_the_kernel_window(name, window):
    # Windows shorter than the prompts: transformers' sliding masks run on the kernel's window
    # (no fallback), prefill and decode, and match stock SDPA like the other models.
    config = make_config(name, sliding_window=window)
    if name == "mistral":
        config = make_config(name, sliding_window=window, hidden_size=1024,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    model = build_random_model(config, dtype=torch.float16, device=DEVICE, seed=0,
                               attn_implementation="flash_attention_sm75")
    n_layers = model.config.num_hidden_layers
    ids, am = _left_padded(PADDED_LENGTHS, model.config.vocab_size, seed=4)
    ref = _prefill_on_kernel_matches_stock(model, ids, am, f"{name} window {window} prefill",
                                           keep_ref=True)

    hf.reset_stats()
    model.set_attn_implementation("flash_attention_sm75")
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=16,
                             do_sample=False, use_cache=True, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    stats = hf.get_stats()
    assert stats["fallback"] == 0 and stats["kernel_decode"] == n_layers * 15, stats
    prompt_len = ids.shape[1]
    full_am = torch.cat([am, torch.ones(am.shape[0], 16, dtype=am.dtype, device=am.device)], 1)
    teacher = _ref_logits(ref, gen.sequences, full_am)[:, prompt_len - 1:-1]
    stock_tf = _logits(model, "sdpa", gen.sequences, full_am)[:, prompt_len - 1:-1]
    del ref
    _check(f"{name} window {window} generate", torch.stack(gen.logits, 1).float().flatten(0, 1),
           stock_tf.flatten(0, 1), teacher.flatten(0, 1), max_factor=3.0, mean_factor=2.0,
           max_slack=0.03, mean_slack=2e-3)


def _gemma2_softcap_model():
    """A Gemma-2-shaped fp16 model with random weights: a sliding layer (window 64) and a full
    one, head_dim 256, attention softcap 5, its q / k projections scaled by 4 so that the
    random-weight scores reach a few units, where the cap bends them."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma2", hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, intermediate_size=2048, vocab_size=4096,
        max_position_embeddings=1024, query_pre_attn_scalar=256, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = build_random_model(config, dtype=torch.float16, device=DEVICE, seed=0,
                               attn_implementation="flash_attention_sm75")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def test_gemma2_softcap_prefill_and_generate_run_on_the_kernel():
    # Gemma 2's attention (softcap=attn_logit_softcapping on every call, a sliding layer with a
    # window shorter than the prompts, a full layer, head_dim 256) runs on the kernel, prefill
    # and decode, and matches stock fp16 eager attention (Gemma 2 has no SDPA path) against the
    # fp32 eager model. The q/k projections are scaled so that random-weight scores reach a few
    # units, where a cap of 5 bends them.
    model = _gemma2_softcap_model()
    config = model.config
    ids, am = _left_padded(PADDED_LENGTHS, config.vocab_size, seed=6)
    hf.reset_stats()
    ours = _logits(model, "flash_attention_sm75", ids, am)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == 2 and stats["fallback"] == 0, stats
    stock = _logits(model, "eager", ids, am)
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("eager")
    with torch.inference_mode():
        ref_logits = ref(input_ids=ids, attention_mask=am).logits.float()
    real = am.bool()
    _check("gemma2 softcap prefill", ours[real], stock[real], ref_logits[real])

    hf.reset_stats()
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=16,
                             do_sample=False, use_cache=True, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    stats = hf.get_stats()
    assert stats["fallback"] == 0 and stats["kernel_decode"] == 2 * 15, stats
    prompt_len = ids.shape[1]
    full_am = torch.cat([am, torch.ones(am.shape[0], 16, dtype=am.dtype, device=am.device)], 1)
    with torch.inference_mode():
        teacher = ref(input_ids=gen.sequences, attention_mask=full_am).logits.float()
    teacher = teacher[:, prompt_len - 1:-1]
    stock_tf = _logits(model, "eager", gen.sequences, full_am)[:, prompt_len - 1:-1]
    del ref
    _check("gemma2 softcap generate", torch.stack(gen.logits, 1).float().flatten(0, 1),
           stock_tf.flatten(0, 1), teacher.flatten(0, 1), max_factor=3.0, mean_factor=2.0,
           max_slack=0.03, mean_slack=2e-3)


def test_patched_sdpa_model_runs_kernel():
    name = "llama-3.2-1b"
    model = _model(name)
    n_layers = model.config.num_hidden_layers
    ids, am = _left_padded(PADDED_LENGTHS, model.config.vocab_size, seed=4)
    stock = _logits(model, "sdpa", ids, am)
    model.set_attn_implementation("sdpa")
    try:
        with hf.apply_patch():
            hf.reset_stats()
            with torch.inference_mode():
                patched = model(input_ids=ids, attention_mask=am).logits.float()
            stats = hf.get_stats()
        assert stats["kernel_prefill"] == n_layers and stats["fallback"] == 0, stats
        hf.reset_stats()
        with torch.inference_mode():
            unpatched = model(input_ids=ids, attention_mask=am).logits.float()
        assert hf.get_stats()["kernel"] == 0
    finally:
        model.set_attn_implementation("flash_attention_sm75")
    ours = _logits(model, "flash_attention_sm75", ids, am)
    real = am.bool()
    # After remove_patch() the model runs stock SDPA again, and the patch and the registered name
    # run the same code path. Identical calls are bitwise reproducible on one GPU in practice;
    # the small tolerance only guards against a nondeterministic cuBLAS algorithm choice.
    d_unpatched = (unpatched - stock)[real].abs().max().item()
    d_paths = (patched - ours)[real].abs().max().item()
    print(f"\n[{name} patch] max |unpatched - stock| {d_unpatched:.3g}, "
          f"max |patched - registered| {d_paths:.3g}")
    assert d_unpatched <= 1e-2 and d_paths <= 1e-2


def test_unsupported_dtype_falls_back_on_gpu():
    model = _model("llama-2-7b")
    ids, am = _left_padded([40, 17], model.config.vocab_size, seed=5)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    hf.reset_stats()
    ours = _logits(bf16, "flash_attention_sm75", ids, am)
    stats = hf.get_stats()
    assert stats["kernel"] == 0 and stats["fallback"] == bf16.config.num_hidden_layers
    assert any("must be float16" in r for r in stats["reasons"])
    stock = _logits(bf16, "sdpa", ids, am)
    # The fallback is transformers' sdpa_attention_forward with the same arguments, except on
    # the left padding's query rows, whose keys are all masked: those give 0 on every path of
    # ours (stock SDPA's value there depends on the backend), so only real tokens compare.
    real = am.bool()
    assert torch.isfinite(ours).all()
    assert (ours - stock)[real].abs().max().item() <= 1e-2


# ---------------------------------------------------------------------------------------------
# Training: loss.backward() through the kernel's backward
# ---------------------------------------------------------------------------------------------

# Two-layer Llama models, fp16, random weights (seed 0): head_dim 64 with GQA 16/4 and head_dim
# 128 with MHA 8/8.
# name -> (make_config name, overrides)
TRAIN_CONFIGS = {
    "llama-hd64-gqa": ("llama", dict(hidden_size=1024, num_attention_heads=16,
                                     num_key_value_heads=4, head_dim=64,
                                     intermediate_size=2816, vocab_size=8192)),
    "llama-hd128": ("llama", dict(hidden_size=1024, num_attention_heads=8,
                                  num_key_value_heads=8, head_dim=128, intermediate_size=2816,
                                  vocab_size=8192)),
    # Mistral's sliding window (the kernel's window in forward and backward; stock: its mask).
    "mistral-hd128-window": ("mistral", dict(hidden_size=1024, num_attention_heads=8,
                                             num_key_value_heads=2, head_dim=128,
                                             intermediate_size=2816, vocab_size=8192,
                                             sliding_window=64)),
    # The models' own head dims (256, 96, 80) with fewer heads and a smaller vocabulary.
    "gemma3-hd256": ("gemma-3-1b", dict(vocab_size=8192)),
    # Its sliding layers with a window shorter than the batch (the kernel's window at d = 256).
    "gemma3-hd256-window": ("gemma-3-1b", dict(vocab_size=8192, sliding_window=64)),
    "phi3-hd96": ("phi-3-mini", dict(hidden_size=768, num_attention_heads=8,
                                     num_key_value_heads=8, vocab_size=8192)),
    "phi2-hd80": ("phi-2", dict(hidden_size=640, num_attention_heads=8, num_key_value_heads=8,
                                vocab_size=8192)),
}
TRAIN_LENGTHS = {"b2": [300, 300], "b2-right-padded": [300, 211]}
# Loss scale, as fp16 training uses (torch.amp.GradScaler): with the plain mean loss, the
# activation gradients of these models are at most 5e-5..6e-3 (measured in fp32), most of them
# in fp16's subnormal range; scaled by 4096 they are at most ~25, far from overflow.
TRAIN_LOSS_SCALE = 4096.0


def _train_grads(model, ids, am, labels, math_sdpa=False):
    """Unscaled loss and float32 copies of every parameter's gradient (scaled by the loss
    scale) after one forward/backward; ``math_sdpa`` pins torch's MATH SDPA backend."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=am).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100)
        (loss * TRAIN_LOSS_SCALE).backward()
    # (A parameter without a gradient is left out: the comparisons index ours and stock's by the
    # float32 model's names, so one missing on our side only still fails.)
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name,batch", [("llama-hd64-gqa", "b2"), ("llama-hd128", "b2"),
                                        ("llama-hd64-gqa", "b2-right-padded"),
                                        ("gemma3-hd256", "b2-right-padded"),
                                        ("gemma3-hd256-window", "b2-right-padded"),
                                        ("phi3-hd96", "b2"),
                                        ("phi2-hd80", "b2-right-padded"),
                                        ("mistral-hd128-window", "b2-right-padded")])
def test_training_gradients_match_stock_sdpa(name, batch):
    """loss.backward() through the kernel gives every parameter the gradient stock SDPA gives.

    loss = cross-entropy of the logits (float32) against random labels (seeded), times the loss
    scale. The three runs share the weights: ours (``"flash_attention_sm75"``), stock fp16 SDPA
    (``"sdpa"``) and the float32 reference (the weights upcast, MATH SDPA backend, TF32 off).
    Tolerance, per parameter, on the relative error ``||g - g32|| / ||g32||``: ours <= 2 x stock's
    + 5e-3, i.e. our gradient is as close to the float32 one as stock fp16 SDPA's is (the same
    criterion as the prefill tests and tests/test_backward.py). Both fp16 pipelines differ from
    fp32 by the fp16 rounding of every matmul, norm and gradient around attention; on the CPU
    (the op's CPU reference kernel, tests/test_transformers.py) both measure ~1e-3 per
    parameter, and a 2% error in dQ, 5% in dK, 1% in the softmax scale, or the causal diagonal
    or the left padding ignored in the backward fails this bound there (run on the CPU with this
    test's shapes, a 2% dQ error gives 2.0e-2 against stock's 1.5e-3 on q_proj).
    ``b2-right-padded``: the second row has 89 padding tokens at the end (label -100), so the
    kernel runs with ``seqused_k``; their query rows still see the real keys, so no row is empty
    in any of the three runs.
    """
    family, overrides = TRAIN_CONFIGS[name]
    model = build_random_model(make_config(family, **overrides), dtype=torch.float16,
                               device=DEVICE, seed=0,
                               attn_implementation="flash_attention_sm75").train()
    n_layers = model.config.num_hidden_layers
    lengths = TRAIN_LENGTHS[batch]
    g = torch.Generator().manual_seed(7)
    s = max(lengths)
    ids = torch.randint(1, model.config.vocab_size, (len(lengths), s), generator=g)
    labels = torch.randint(0, model.config.vocab_size, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n] = 1
    ids, labels = ids.masked_fill(am == 0, 0), labels.masked_fill(am == 0, -100)
    ids, labels, am = ids.to(DEVICE), labels.to(DEVICE), am.to(DEVICE)
    if min(lengths) == s:
        am = None  # no mask: the op's plain causal path

    hf.reset_stats()
    loss_ours, g_ours = _train_grads(model, ids, am, labels)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == n_layers and stats["fallback"] == 0, stats

    model.set_attn_implementation("sdpa")
    loss_stock, g_stock = _train_grads(model, ids, am, labels)
    ref = copy.deepcopy(model).float()
    del model
    loss_32, g_32 = _train_grads(ref, ids, am, labels, math_sdpa=True)
    del ref
    _assert_gradients_as_close_as_stock(f"{name} {batch}", loss_ours, g_ours, loss_stock, g_stock,
                                        loss_32, g_32)


def _tiny_bert(head_dim, dropout=0.0):
    """A BERT-base-shaped encoder (bidirectional, padding masks; HF's BertForMaskedLM) with 2
    layers, 4 heads of ``head_dim`` and a small vocabulary, random weights, fp16 on the GPU."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=512, hidden_size=4 * head_dim, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=8 * head_dim,
                     max_position_embeddings=512, attention_probs_dropout_prob=dropout,
                     hidden_dropout_prob=0.0)
    torch.manual_seed(23)
    return BertForMaskedLM(cfg).to(DEVICE, torch.float16)


def _bert_batch(vocab):
    # Right padding (BERT's tokenizers pad on the right): rows of 200 and 131 tokens.
    g = torch.Generator().manual_seed(29)
    ids = torch.randint(5, vocab, (2, 200), generator=g)
    am = torch.ones(2, 200, dtype=torch.long)
    am[1, 131:] = 0
    labels = torch.randint(5, vocab, (2, 200), generator=g).masked_fill(am == 0, -100)
    return ids.masked_fill(am == 0, 0).to(DEVICE), am.to(DEVICE), labels.to(DEVICE)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bert_eval_and_training_gradients_match_stock_sdpa(head_dim):
    """Issue 20's BERT-family padding masks: a BERT-shaped encoder runs every attention call on
    the kernel, its real tokens' logits and, in train mode (dropout off to compare), its loss
    and every parameter's gradient as close to the float32 model's as stock fp16 SDPA's are
    (the criterion of test_training_gradients_match_stock_sdpa)."""
    model = _tiny_bert(head_dim)
    ids, am, labels = _bert_batch(model.config.vocab_size)
    real = am.bool()
    model.set_attn_implementation("sm75_attention")
    hf.reset_stats()
    with torch.no_grad():
        ours = model.eval()(input_ids=ids, attention_mask=am).logits[real].float()
    stats = hf.get_stats()
    assert stats["kernel"] == model.config.num_hidden_layers and stats["fallback"] == 0, stats
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=am).logits[real].float()
        ref = copy.deepcopy(model).float()
        with sdpa_kernel(SDPBackend.MATH):
            want = ref(input_ids=ids, attention_mask=am).logits[real]
    err, err_stock = (ours - want).abs().max().item(), (stock - want).abs().max().item()
    assert err <= 2 * err_stock + 2e-3, (err, err_stock)

    model.train()
    model.set_attn_implementation("sm75_attention")
    hf.reset_stats()
    loss_ours, g_ours = _train_grads(model, ids, am, labels)
    assert hf.get_stats()["fallback"] == 0, hf.get_stats()
    model.set_attn_implementation("sdpa")
    loss_stock, g_stock = _train_grads(model, ids, am, labels)
    ref.train()
    loss_32, g_32 = _train_grads(ref, ids, am, labels, math_sdpa=True)
    _assert_gradients_as_close_as_stock(f"bert d={head_dim}", loss_ours, g_ours, loss_stock,
                                        g_stock, loss_32, g_32)


def test_bert_training_with_attention_dropout_runs_on_the_kernel():
    """BERT fine-tuning's default attention dropout (0.1) on the kernel: every call there, a
    finite loss and gradients, a seed reproduces the step bit for bit and another seed does
    not (the dropout mask's law itself: tests/test_dropout.py)."""
    model = _tiny_bert(64, dropout=0.1).train()
    model.set_attn_implementation("sm75_attention")
    ids, am, labels = _bert_batch(model.config.vocab_size)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        hf.reset_stats()
        runs.append(_train_grads(model, ids, am, labels))
        stats = hf.get_stats()
        assert stats["kernel"] == model.config.num_hidden_layers and stats["fallback"] == 0, stats
    (l5, g5), (l5b, g5b), (l6, g6) = runs
    assert math.isfinite(l5) and all(torch.isfinite(g).all() for g in g5.values())
    assert l5 == l5b and all(torch.equal(g5[n], g5b[n]) for n in g5)
    assert not all(torch.equal(g5[n], g6[n]) for n in g5)


def _assert_gradients_as_close_as_stock(label, loss_ours, g_ours, loss_stock, g_stock, loss_32,
                                        g_32):
    """Per parameter ``||g - g32|| / ||g32||``: ours <= 2 x stock's + 5e-3, and the loss (see
    test_training_gradients_match_stock_sdpa)."""
    assert math.isfinite(loss_ours)
    worst = (0.0, "")
    for pname, g32 in g_32.items():
        assert torch.isfinite(g_ours[pname]).all(), pname
        e_ours, e_stock = _rel_err(g_ours[pname], g32), _rel_err(g_stock[pname], g32)
        worst = max(worst, (e_ours / max(e_stock, 1e-12), pname))
        assert e_ours <= 2 * e_stock + 5e-3, (pname, e_ours, e_stock)
    e_all = _rel_err(torch.cat([g_ours[p].flatten() for p in g_32]),
                     torch.cat([g.flatten() for g in g_32.values()]))
    e_all_stock = _rel_err(torch.cat([g_stock[p].flatten() for p in g_32]),
                           torch.cat([g.flatten() for g in g_32.values()]))
    print(f"\n[{label} train] loss ours {loss_ours:.6f} stock {loss_stock:.6f} fp32 "
          f"{loss_32:.6f} | all-parameter gradient rel. error ours {e_all:.3g} stock "
          f"{e_all_stock:.3g} | worst ours/stock ratio {worst[0]:.3g} ({worst[1]})")
    assert abs(loss_ours - loss_32) <= 2 * abs(loss_stock - loss_32) + 5e-3


def test_gemma2_softcap_training_gradients_match_stock_eager():
    """Gemma 2 training (issue 20): softcap on every call, a sliding layer (window 64) and a
    full one, head_dim 256, a right-padded batch: every layer's forward and backward on the
    kernel, each parameter's gradient as close to the float32 eager model's as stock fp16
    eager attention's (Gemma 2 has no SDPA path). q / k projections scaled as in the prefill
    test so that the cap of 5 bends the scores."""
    model = _gemma2_softcap_model().train()
    config = model.config
    lengths = TRAIN_LENGTHS["b2-right-padded"]
    g = torch.Generator().manual_seed(8)
    s = max(lengths)
    ids = torch.randint(1, config.vocab_size, (len(lengths), s), generator=g)
    labels = torch.randint(0, config.vocab_size, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n] = 1
    ids, labels = ids.masked_fill(am == 0, 0), labels.masked_fill(am == 0, -100)
    ids, labels, am = ids.to(DEVICE), labels.to(DEVICE), am.to(DEVICE)
    hf.reset_stats()
    loss_ours, g_ours = _train_grads(model, ids, am, labels)
    stats = hf.get_stats()
    assert stats["kernel_prefill"] == 2 and stats["fallback"] == 0, stats
    model.set_attn_implementation("eager")
    loss_stock, g_stock = _train_grads(model, ids, am, labels)
    ref = copy.deepcopy(model).float()
    del model
    loss_32, g_32 = _train_grads(ref, ids, am, labels)
    del ref
    _assert_gradients_as_close_as_stock("gemma2 softcap", loss_ours, g_ours, loss_stock, g_stock,
                                        loss_32, g_32)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: a captured call must read the mask at replay time (issue: stale key ranges)
# ---------------------------------------------------------------------------------------------


class _Attn(torch.nn.Module):
    def __init__(self, heads, kv_heads):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = heads // kv_heads


def _static_decode_mask(valid, kv_len):
    """(B, 1, 1, kv_len) bool, as HF builds for one decode step over a static cache: batch row
    b sees the cache slots [0, valid[b])."""
    j = torch.arange(kv_len, device=DEVICE)
    return (j[None, :] < torch.tensor(valid, device=DEVICE)[:, None])[:, None, None, :]


def test_captured_decode_step_reads_the_mask_at_replay():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(21)
    b, h, h_k, kv_len, d = 3, 8, 2, 96, 64
    q = torch.randn(b, h, 1, d, device=DEVICE, dtype=torch.float16)
    k = torch.randn(b, h_k, kv_len, d, device=DEVICE, dtype=torch.float16)
    v = torch.randn(b, h_k, kv_len, d, device=DEVICE, dtype=torch.float16)
    mod = _Attn(h, h_k)
    mask = _static_decode_mask([10, 40, 70], kv_len)  # the static buffer the graph reads
    # While capturing, the integration reads nothing on the host: the kernel reads the mask
    # itself (attn_bias) at every replay. The stock warm-up calls are restricted to the backends
    # torch has on Turing: on the H200 it would otherwise pick cuDNN attention.
    turing_backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), sdpa_kernel(turing_backends):
        for _ in range(2):  # warm-up, as torch.compile / HF do before capturing
            hf.flash_attention_sm75_forward(mod, q, k, v, mask)
            sdpa_attention_forward(mod, q, k, v, mask)  # the path the capture takes
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sdpa_kernel(turing_backends):
        out, _ = hf.flash_attention_sm75_forward(mod, q, k, v, mask)
    for valid in ([11, 41, 71], [60, 2, 96]):  # the cache grew / was refilled
        mask.copy_(_static_decode_mask(valid, kv_len))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = sdpa_attention_forward(mod, q.float(), k.float(), v.float(), mask)
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_static_cache_generate_under_reduce_overhead_compile_matches_eager():
    # HF generate() with a static cache under torch.compile(mode="reduce-overhead"): the decode
    # step is captured once and replayed while the cache's valid lengths grow.
    cfg = make_config("llama", num_attention_heads=4, num_key_value_heads=2)
    model = build_random_model(cfg, dtype=torch.float16, device=DEVICE, seed=22,
                               attn_implementation="sm75_attention")
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    torch.manual_seed(23)
    ids = torch.randint(1, cfg.vocab_size, (2, 13), device=DEVICE)
    am = torch.ones_like(ids)
    am[1, :5] = 0
    torch._dynamo.reset()
    # generate() compiles the decode step itself for a static cache (the prefill stays eager).
    compile_config = transformers.CompileConfig(fullgraph=False, mode="reduce-overhead")
    kw = dict(attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0,
              cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    ours_out = []
    with torch.no_grad():
        ran = cuda_kernels_run(lambda: ours_out.append(
            model.generate(ids, compile_config=compile_config, **kw)), "flash_fwd")
        ours = ours_out[0]
        ref = stock.generate(ids, **kw)
    # The compiled decode steps read the static cache's mask on the kernel (the extended decode
    # kernel with attn_bias), not through torch SDPA.
    assert any("flash_fwd_decode_kernel" in n and "true>" in n for n in ran), ran
    lo, lr = torch.stack(ours.logits, 1).float(), torch.stack(ref.logits, 1).float()
    assert (ours.sequences == ref.sequences).float().mean() >= 0.9
    assert (lo - lr).abs().max() < 0.05, (lo - lr).abs().max()
