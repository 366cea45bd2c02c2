#!/usr/bin/env python3
"""Generate with a transformers model on the SM75 FlashAttention kernel.

Offline by default: a Qwen2-0.5B-shaped model with random weights from a fixed seed (the shapes,
not the knowledge, of the real checkpoint), fed random prompt tokens. With ``--model PATH`` a local
checkpoint is loaded (``local_files_only``), and its tokenizer, if present, encodes ``--prompt``.

The model is loaded with ``attn_implementation="flash_attention_sm75"``; the script prints how
many attention calls ran on the kernel and how many fell back to torch SDPA (and why), and with
``--compare`` runs the same generation on stock SDPA and compares the tokens. Progress (model
loading, generation steps on the CPU) is logged to stderr; the results go to stdout.

Examples::

    python3 examples/hf_generate.py                         # random Qwen2-0.5B shapes, GPU
    python3 examples/hf_generate.py --batch 4 --compare     # left-padded batch, vs stock SDPA
    python3 examples/hf_generate.py --model /models/Qwen2-0.5B --prompt "The capital of France"
    python3 examples/hf_generate.py --config llama-2-7b     # head_dim 128, 2 layers
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from devtools.cli import check_device, check_model_dir, positive_int  # noqa: E402
from devtools.model_configs import REALISTIC_CONFIGS, TINY_CONFIGS, load_model  # noqa: E402
from flash_attention_sm75.integrations import transformers as hf  # noqa: E402

CONFIG_NAMES = set(REALISTIC_CONFIGS) | set(TINY_CONFIGS)
DEFAULT_PROMPT = "FlashAttention on Turing GPUs"

logger = logging.getLogger("hf_generate")


def generation_progress(prompt_len, new_tokens, label, every_s=5.0):
    """A stopping criterion that never stops generation, only logs how far it got (the first
    token, then at most every ``every_s`` seconds, and the last)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Progress(StoppingCriteria):
        def __init__(self):
            self.t0 = self.last = time.perf_counter()

        def __call__(self, input_ids, scores, **kwargs):
            done = input_ids.shape[-1] - prompt_len
            now = time.perf_counter()
            if done <= 1 or done >= new_tokens or now - self.last >= every_s:
                self.last = now
                logger.info("%s: %d/%d new tokens (%.1f s)", label, done, new_tokens,
                            now - self.t0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Progress()])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local checkpoint directory")
    p.add_argument("--config", default="qwen2-0.5b", choices=sorted(CONFIG_NAMES),
                   help="named config for random weights (default qwen2-0.5b): the real-shape "
                        "qwen2-0.5b, llama-3.2-1b, llama-2-7b, gemma-3-1b (head_dim 256), "
                        "phi-3-mini (96), phi-2 (80), or a tiny llama/qwen2/qwen3/mistral/"
                        "gemma3/phi3/phi")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="override the number of layers")
    p.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help="prompt text (needs a tokenizer in --model; otherwise random tokens)")
    p.add_argument("--prompt-len", type=positive_int, default=128,
                   help="random prompt length when there is no tokenizer")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="batch size; rows get shorter prompts (left padded) when > 1")
    p.add_argument("--new-tokens", type=positive_int, default=32,
                   help="tokens to generate (greedy), default 32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda if available, else cpu (every call then falls back)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--compare", action="store_true", help="also run stock SDPA and compare")
    args = p.parse_args(argv)
    check_device(p, "--device", args.device)
    check_model_dir(p, "--model", args.model)
    return args


def build_inputs(args, model, tokenizer):
    if tokenizer is not None:
        words = args.prompt.split()
        # row b drops its last b words, so the rows have different lengths (left padded)
        texts = [" ".join(words[: max(1, len(words) - b)]) for b in range(args.batch)]
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        return enc["input_ids"], enc["attention_mask"], tokenizer.pad_token_id
    g = torch.Generator().manual_seed(args.seed)
    n = args.prompt_len
    ids = torch.randint(1, model.config.vocab_size, (args.batch, n), generator=g)
    am = torch.ones_like(ids)
    for b in range(1, args.batch):
        am[b, : (n * b) // (2 * args.batch)] = 0  # shorter prompts, left padded
    return ids.masked_fill(am == 0, 0), am, 0


def generate(model, ids, am, pad_id, new_tokens, progress=None):
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    extra = {} if progress is None else {"stopping_criteria": progress}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=pad_id, **extra)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def describe(stats):
    lines = [f"  kernel: {stats['kernel']} attention calls "
             f"({stats['kernel_prefill']} prefill, {stats['kernel_decode']} decode)",
             f"  torch SDPA fallback: {stats['fallback']} calls"]
    for reason, n in sorted(stats["reasons"].items(), key=lambda kv: -kv[1]):
        lines.append(f"    {n} x {reason}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    # Progress lines ("[12:00:01] message") on stderr; stdout keeps the results.
    logging.basicConfig(format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    device = torch.device(args.device)
    dtype = torch.float16
    if device.type == "cpu":
        logger.warning("warning: running on the CPU, which takes about a minute with the "
                       "default settings (building the model, then generating)")
        print("note: no GPU; every attention call falls back to torch SDPA on the CPU")
    source = args.model or args.config
    t0 = time.perf_counter()
    logger.info("loading %s on %s%s...", source, device,
                "" if args.model else " (random weights)")
    model = load_model(source, dtype=dtype, device=device, seed=args.seed,
                       attn_implementation="flash_attention_sm75", num_hidden_layers=args.layers)
    logger.info("model ready in %.1f s", time.perf_counter() - t0)
    tokenizer = None
    if args.model:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except Exception as e:  # no tokenizer files: random prompt tokens
            print(f"no tokenizer ({type(e).__name__}); using random prompt tokens")
    else:
        model.generation_config.eos_token_id = None  # random weights: always run new_tokens
    if tokenizer is None and args.prompt != DEFAULT_PROMPT:
        logger.warning("warning: --prompt is ignored without a tokenizer (--model with tokenizer "
                       "files); using %d random prompt tokens (--prompt-len)", args.prompt_len)
    ids, am, pad_id = build_inputs(args, model, tokenizer)
    ids, am = ids.to(device), am.to(device)
    cfg = model.config
    print(f"model: {source} ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads), {dtype}, {device}; "
          f"attn_implementation={cfg._attn_implementation}")
    print(f"batch {ids.shape[0]}, prompt lengths {am.sum(1).tolist()}, "
          f"{args.new_tokens} new tokens")

    # Per-step progress on the CPU only (on a GPU generation takes seconds and its timing is
    # reported, so nothing is added to the generation loop there).
    def progress(label):
        if device.type != "cpu":
            return None
        return generation_progress(ids.shape[1], args.new_tokens, label)

    hf.reset_stats()
    logger.info("generating %d new tokens (batch %d)...", args.new_tokens, ids.shape[0])
    out, seconds = generate(model, ids, am, pad_id, args.new_tokens, progress("generate"))
    new = out[:, ids.shape[1]:]
    print(f"generated {new.numel()} tokens in {seconds:.3f} s "
          f"({new.numel() / seconds:.1f} tokens/s, prefill included)")
    print("which attention ran:")
    print(describe(hf.get_stats()))
    for b in range(out.shape[0]):
        if tokenizer is not None:
            text = tokenizer.decode(out[b], skip_special_tokens=True)
            print(f"[{b}] {text!r}")
        else:
            print(f"[{b}] new token ids: {new[b].tolist()}")

    if args.compare:
        model.set_attn_implementation("sdpa")
        logger.info("--compare: generating again with stock SDPA...")
        stock, stock_s = generate(model, ids, am, pad_id, args.new_tokens,
                                  progress("stock SDPA"))
        model.set_attn_implementation("flash_attention_sm75")
        same = (stock[:, ids.shape[1]:] == new).float().mean().item()
        print(f"stock SDPA: {stock_s:.3f} s; identical tokens: {same * 100:.1f}% "
              "(random-weight models have near-tied logits, so fp16 rounding can flip a few "
              "greedy choices; tests/test_transformers_gpu.py compares logits instead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
