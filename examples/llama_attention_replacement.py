#!/usr/bin/env python3
"""Run models that use ``attn_implementation="sdpa"`` on the SM75 FlashAttention kernel.

This module re-exports :func:`apply_patch` and :func:`remove_patch` (the interface of the earlier
port), implemented in :mod:`flash_attention_sm75.integrations.transformers`::

    from llama_attention_replacement import apply_patch, remove_patch

    apply_patch()          # every Llama/Qwen2/Qwen3/Mistral model on "sdpa" now uses the kernel,
    ...                    # loaded before or after this call
    remove_patch()         # exactly the previous behaviour again

    with apply_patch():    # or scoped
        model.generate(...)

The patch replaces transformers' global ``"sdpa"`` attention entry (models look it up at every
forward). Calls the kernel cannot run (CPU, fp32/bf16, head_dim not a multiple of 8 up to 256,
masks other than causal + padding, ...) go to the original SDPA function. New code can instead
load models with ``attn_implementation="flash_attention_sm75"`` (see hf_generate.py).

Run as a script, it demonstrates the patch on a Llama-3.2-1B-shaped model (random weights, 4
layers by default) or a local checkpoint (``--model PATH``). Progress (model building, the three
forward passes) is logged to stderr; the results go to stdout.
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
from flash_attention_sm75.integrations.transformers import (  # noqa: E402,F401
    apply_patch,
    get_stats,
    is_patched,
    remove_patch,
    reset_stats,
)

__all__ = ["apply_patch", "remove_patch", "is_patched"]

logger = logging.getLogger("llama_attention_replacement")


def main(argv=None):
    from devtools.model_configs import REALISTIC_CONFIGS, TINY_CONFIGS, load_model

    p = argparse.ArgumentParser(description="apply_patch()/remove_patch() demo")
    p.add_argument("--model", default=None, help="local checkpoint directory")
    p.add_argument("--config", default="llama-3.2-1b",
                   choices=sorted(set(REALISTIC_CONFIGS) | set(TINY_CONFIGS)),
                   help="named config for random weights (default llama-3.2-1b)")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="decoder layers of the random-weight model (default 4)")
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    check_device(p, "--device", args.device)
    check_model_dir(p, "--model", args.model)
    # Progress lines ("[12:00:01] message") on stderr; stdout keeps the results.
    logging.basicConfig(format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", level=logging.INFO)

    device = torch.device(args.device)
    if device.type == "cpu":
        logger.warning("warning: running on the CPU, which takes about 2-3 minutes with the "
                       "default settings (building the model, then three forward passes)")
    # Loaded BEFORE the patch, with the stock "sdpa" attention.
    t0 = time.perf_counter()
    logger.info("loading %s on %s%s...", args.model or args.config, device,
                "" if args.model else " (random weights)")
    model = load_model(args.model or args.config, dtype=torch.float16, device=device,
                       attn_implementation="sdpa",
                       num_hidden_layers=None if args.model else args.layers)
    logger.info("model ready in %.1f s", time.perf_counter() - t0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (2, args.prompt_len), generator=g)
    am = torch.ones_like(ids)
    am[1, : args.prompt_len // 3] = 0  # a left-padded row
    ids, am = ids.to(device), am.to(device)

    # Decoder layers, for progress inside a forward pass (tens of seconds each on a CPU).
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])

    def logits(step, every_s=5.0):
        t = last = time.perf_counter()
        logger.info("forward pass %d/3 (%s), batch %d x %d tokens...", step,
                    ["stock SDPA", "patched", "after remove_patch()"][step - 1], *ids.shape)

        def layer_done(i):
            def hook(module, inputs, output):  # observes only: returns None, output unchanged
                nonlocal last
                now = time.perf_counter()
                if i + 1 == len(layers):
                    last = now
                    logger.info("forward pass %d/3: all %d decoder layers done (%.1f s); "
                                "computing the logits...", step, len(layers), now - t)
                elif now - last >= every_s:
                    last = now
                    logger.info("forward pass %d/3: decoder layer %d/%d done (%.1f s)", step,
                                i + 1, len(layers), now - t)
            return hook

        hooks = [layer.register_forward_hook(layer_done(i)) for i, layer in enumerate(layers)]
        try:
            with torch.inference_mode():
                out = model(input_ids=ids, attention_mask=am).logits.float()
        finally:
            for h in hooks:
                h.remove()
        logger.info("forward pass %d/3 done in %.1f s", step, time.perf_counter() - t)
        return out

    stock = logits(1)
    with apply_patch():
        reset_stats()
        patched = logits(2)
        stats = get_stats()
        print(f"patched: attention calls on the kernel {stats['kernel']}, on torch SDPA "
              f"{stats['fallback']} {stats['reasons'] or ''}")
    assert not is_patched()
    real = am.bool()
    print(f"max |patched - stock| logits over real tokens: "
          f"{(patched - stock)[real].abs().max().item():.4g}")
    reset_stats()
    again = logits(3)
    print(f"after remove_patch(): kernel calls {get_stats()['kernel']}, identical to stock: "
          f"{torch.equal(again, stock)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
