#!/usr/bin/env python3
"""End-to-end transformers benchmark: our kernel vs stock SDPA (memory-efficient backend).

A Qwen2-0.5B-shaped model (random weights from a fixed seed, fp16; or ``--model PATH``) runs
prefill and greedy generation with

* ``ours``  -- ``attn_implementation="flash_attention_sm75"``;
* ``stock`` -- ``attn_implementation="sdpa"`` under
  ``torch.nn.attention.sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)``: what Turing users get
  today (torch's FlashAttention backend needs sm_80+). If the efficient kernel rejects
  ``enable_gqa`` on this torch, transformers' ``repeat_kv`` path is used for stock, as
  transformers itself does whenever a mask is passed (recorded as ``stock_gqa`` in the JSON).

Both run in the same process on the same model (switched with ``set_attn_implementation``).
For each batch size and prompt length:

* ``prefill ms``: median latency of one forward over the prompt (``use_cache=False``,
  ``logits_to_keep=1`` as in ``generate``, so the vocabulary projection does not dominate);
  ``gen spread %``: (max - min) / median of the generate repetitions. Each implementation is
  warmed up (a prefill and a whole generate) and the timed repetitions of the two alternate
  (ours, stock, stock, ours, ...), so that clock or load drift falls on both alike (one run of
  each in sequence gave 0.93x in one process and 1.58x in another on the same day). Before
  the timed repetitions of each kind each implementation runs one untimed call, and the
  allocator keeps its cached blocks between repetitions (returning them to the driver after
  every call, as before, made each repetition start with cudaMallocs);
* ``gen tok/s``: ``batch * new_tokens / time`` of ``generate(max_new_tokens=N, greedy)``,
  prefill included; ``decode tok/s``: the same without the prefill time;
* ``peak GiB``: ``torch.cuda.max_memory_allocated`` during generate (weights included) and
  ``prefill peak``: during the prefill forward;
* ``--attention-share``: one more prefill per implementation under torch.profiler, its kernels'
  GPU time and the attention kernels' part of it (``prefill_attention_share``): the most any
  attention kernel can take off that prefill.

Generation modes (``--cache``, ``--compile``; recorded as ``generation`` in the JSON): eager
decode steps are host-bound (Python per layer), and on GPU their times spread by 5-94% between
repetitions. ``--cache static`` makes ``generate`` use transformers' ``StaticCache``
(``cache_implementation="static"``), whose fixed shapes let ``generate`` compile the decode
forward by its own rule (``_valid_auto_compile_criteria``): with a static cache on a GPU it runs
``torch.compile(model.__call__, **CompileConfig())`` -- inductor, ``mode="reduce-overhead"``,
i.e. CUDA graphs -- for the decode steps (the prefill stays eager). ``--compile off`` passes
``disable_compile=True``; ``--compile all-devices`` compiles on CPU too (transformers' testing
flag ``CompileConfig._compile_all_devices``; about 30 s of compile for the 2-layer CPU config).
Both implementations run in the same mode; with a static cache the warm-up runs two generates (the
compile, then CUDA-graph recording), so the timed repetitions exclude both (``gen_graphs_compiled``:
graphs compiled in an impl's warm-up; ``graphs_compiled_timed``: any compiled later, should be 0).
transformers allocates a new StaticCache per generate(), so each timed generate still re-records
its CUDA graph once (new static addresses), for both implementations alike. ``--cache
static-reused`` keeps one StaticCache per implementation instead (reset in place and passed to
every generate as its cache -- ``cache`` or ``past_key_values``, the name the installed
transformers' model takes -- as a serving loop keeps one), so the graph recorded in the
warm-up is replayed: the decode steps' time without per-call recording.

Prompts are equal-length random tokens; ``--left-pad`` makes batch rows shorter by 0, 1/8, 2/8,
... of the length (left padded), which exercises the mask path. Outputs: a table on stdout,
``--out`` JSON, ``--png`` plot (matplotlib, optional).

Examples::

    python3 benchmarks/bench_e2e_hf.py --out bench_out/e2e_hf.json --png bench_out/e2e_hf.png
    python3 benchmarks/bench_e2e_hf.py --quick --out /tmp/e2e.json
    python3 benchmarks/bench_e2e_hf.py --quick --cache static --out /tmp/e2e_static.json
    python3 benchmarks/bench_e2e_hf.py --device cpu --config qwen2 --lengths 64 --batches 1 \
        --new-tokens 4 --out /tmp/e2e_cpu.json        # CPU smoke test (tiny model)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import re
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))

import _common as C  # noqa: E402

IMPLS = ("ours", "stock")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="local transformers checkpoint directory (default: random weights)")
    p.add_argument("--config", default="qwen2-0.5b",
                   help="named config for random weights (flash_attention_sm75.integrations."
                        "configs; default qwen2-0.5b)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7,
                   help="timed prefill repetitions per implementation, interleaved (median)")
    p.add_argument("--gen-repeats", type=int, default=5,
                   help="timed generate repetitions per implementation, interleaved (median)")
    p.add_argument("--left-pad", action="store_true", help="left-padded rows of varying length")
    p.add_argument("--decode-on-sdpa", action="store_true",
                   help="ours: run decode steps (q_len == 1) on torch SDPA, only prefill on ours")
    p.add_argument("--impls", default="ours,stock", help="comma list of ours,stock")
    p.add_argument("--cache", choices=("dynamic", "static", "static-reused"), default="dynamic",
                   help="generate()'s KV cache: dynamic (DynamicCache, transformers' default); "
                        "static (cache_implementation='static': preallocated, fixed decode shapes, "
                        "which is what lets generate() compile the decode step; eager decode "
                        "steps are host-bound and spread by 5-94%% on GPU; generate() makes a new "
                        "cache per call, so a compiled step re-records its CUDA graph per call); "
                        "static-reused (one StaticCache per implementation, reset before each "
                        "generate and passed as its cache, as a serving loop keeps one: the "
                        "graph is recorded once and replayed)")
    p.add_argument("--compile", choices=("auto", "off", "all-devices"), default="auto",
                   help="generate()'s own compile of the decode forward. auto: transformers' "
                        "rule (with --cache static on a GPU: torch.compile with CompileConfig "
                        "defaults, mode reduce-overhead = CUDA graphs; never with a dynamic "
                        "cache or on CPU); off: disable_compile=True; all-devices: on CPU too "
                        "(CompileConfig._compile_all_devices; slow, for checking on CPU)")
    p.add_argument("--quick", action="store_true",
                   help="lengths 512 2048, repeats 5/3, 16 new tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results as JSON here")
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    p.add_argument("--attention-share", action="store_true",
                   help="also profile one prefill per implementation (torch.profiler, GPU only): "
                        "its kernels' total time and the attention kernels' share of it, i.e. "
                        "the most an attention kernel can take off that prefill")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths = [512, 2048]
        args.repeats, args.gen_repeats, args.new_tokens = 5, 3, 16
    if args.compile == "all-devices" and args.cache == "dynamic":
        p.error("--compile all-devices needs --cache static (generate() compiles only then)")
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    for s in args.impls:
        if s not in IMPLS:
            p.error(f"unknown impl {s!r}; choose from {IMPLS}")
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> Optional[float]:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def efficient_supports_gqa(device) -> bool:
    """Whether torch's memory-efficient SDPA kernel accepts enable_gqa=True here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 8, 64, device=device, dtype=torch.float16)
    k = torch.randn(1, 2, 8, 64, device=device, dtype=torch.float16)
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                             enable_gqa=True)
        return True
    except RuntimeError:
        return False


def _no_gqa_in_sdpa(*args, **kwargs) -> bool:
    """transformers' use_gqa_in_sdpa for stock without enable_gqa: one function object, so that
    a compiled decode step's guard on it holds from one generate to the next."""
    return False


@contextlib.contextmanager
def stock_context(device, use_gqa: bool):
    """SDPA forced to the memory-efficient backend (CUDA); on CPU, default SDPA."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import transformers.integrations.sdpa_attention as hf_sdpa

    saved = hf_sdpa.use_gqa_in_sdpa
    if not use_gqa:
        hf_sdpa.use_gqa_in_sdpa = _no_gqa_in_sdpa  # repeat_kv, as with any mask
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            yield
    finally:
        hf_sdpa.use_gqa_in_sdpa = saved


def make_inputs(batch, length, vocab, left_pad, device, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    am = torch.ones(batch, length, dtype=torch.long)
    if left_pad:
        for b in range(batch):
            pad = (length * (b % 8)) // 8
            am[b, :pad] = 0
    ids = ids.masked_fill(am == 0, 0)
    return ids.to(device), am.to(device)


def generate_kwargs(args) -> Dict[str, Any]:
    """generate()'s arguments for --cache / --compile (transformers' own mechanism)."""
    kwargs: Dict[str, Any] = {}
    if args.cache == "static":
        kwargs["cache_implementation"] = "static"  # static-reused: run_pair passes its cache
    if args.compile == "off":
        kwargs["disable_compile"] = True
    elif args.compile == "all-devices":
        from transformers import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # transformers' flag for compiling on CPU
        kwargs["compile_config"] = config
    return kwargs


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's own counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def spread_pct(times: List[float]) -> Optional[float]:
    """(max - min) / median of repeated timings, in percent (None for fewer than two)."""
    if len(times) < 2:
        return None
    return 100.0 * (max(times) - min(times)) / statistics.median(times)


# Attention kernels by name: ours (namespace flash_sm75) and torch's memory-efficient backend
# (cutlass fmha kernels, "attention" in the ATen kernel names).
ATTENTION_KERNELS = re.compile(r"flash_sm75|fmha|attention", re.IGNORECASE)


def prefill_kernel_times(prefill) -> Dict[str, Any]:
    """One prefill under torch.profiler: the GPU time of all its kernels and of the attention
    kernels (ATTENTION_KERNELS), in ms, and the attention share (Amdahl: the most a faster
    attention can remove from this prefill's kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill()
        torch.cuda.synchronize()
    total = attn = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total += evt.device_time_total
            if ATTENTION_KERNELS.search(evt.name):
                attn += evt.device_time_total
    return {"prefill_gpu_ms": total / 1e3, "prefill_attention_gpu_ms": attn / 1e3,
            "prefill_attention_share": attn / total if total > 0 else None}


def run_pair(model, batch, length, args, device, hf, stock_gqa) -> List[Dict[str, Any]]:
    """Every implementation of args.impls on one (batch, prompt length), interleaved: each is
    warmed up (a prefill and a whole generate, which also give its attention counts and peak
    memory), then the timed repetitions alternate between them (ours, stock, stock, ours, ...), so
    that a drift of the GPU's clocks or of other load falls on both alike. Medians, with the
    spread (max - min over the median) and every raw time kept."""
    vocab = model.config.vocab_size
    ids, am = make_inputs(batch, length, vocab, args.left_pad, device, args.seed + length + batch)
    results = {impl: {"impl": impl, "batch": batch, "length": length} for impl in args.impls}

    def ctx(impl):
        model.set_attn_implementation("flash_attention_sm75" if impl == "ours" else "sdpa")
        return stock_context(device, stock_gqa) if impl == "stock" else contextlib.nullcontext()

    def prefill():
        return model(input_ids=ids, attention_mask=am, use_cache=False, logits_to_keep=1)

    gen_kwargs = generate_kwargs(args)
    # transformers 5.2x renamed generate()'s and the models' `past_key_values` to `cache` (the
    # old name deprecated); use the name the installed version's model takes.
    cache_kwarg = ("cache" if "cache" in inspect.signature(model.forward).parameters
                   else "past_key_values")
    caches: Dict[str, Any] = {}  # --cache static-reused: each implementation's one StaticCache

    def generate(impl):
        kwargs = dict(gen_kwargs)
        if args.cache == "static-reused":
            if impl not in caches:
                from transformers import StaticCache

                caches[impl] = StaticCache(config=model.config.get_text_config(decoder=True),
                                           max_cache_len=length + args.new_tokens)
            caches[impl].reset()  # zeroed in place: the compiled step's addresses stay
            kwargs[cache_kwarg] = caches[impl]
        return model.generate(input_ids=ids, attention_mask=am, max_new_tokens=args.new_tokens,
                              do_sample=False, use_cache=True, pad_token_id=0, **kwargs)

    def guarded(impl, fn, tidy=True):
        """fn() for impl; an exception (OOM, a backend refusing the shape) is recorded as the
        impl's error and the impl leaves the comparison. tidy: then collect garbage and return
        the allocator's cached blocks to the driver (after a warm-up or an error). Not between
        timed repetitions: each would then start by allocating its activations from the driver
        again (cudaMalloc, which synchronises), a cost of the harness that varies call to call."""
        res = results[impl]
        failed = False
        try:
            with torch.inference_mode(), ctx(impl):
                return fn(res)
        except Exception as e:  # noqa: BLE001 - recorded, the other impl goes on
            failed = True
            res["error"] = "OOM" if C.is_oom(e) else f"{type(e).__name__}: {e}"[:300]
            if device.type == "cuda" and not C.cuda_context_ok():
                raise
            return None
        finally:
            if tidy or failed:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    def warm_up(res):
        hf.reset_stats()
        reset_peak(device)
        timed(prefill, device)
        res["prefill_peak_gib"] = peak_gib(device)
        stats = hf.get_stats()
        res["prefill_attention"] = {"kernel": stats["kernel"], "fallback": stats["fallback"],
                                    "reasons": stats["reasons"]}
        graphs = graphs_compiled()
        for _ in range(2 if args.cache != "dynamic" else 1):  # compile, then CUDA-graph record
            hf.reset_stats()  # counts and peak: of the last warm-up generate
            reset_peak(device)
            _, out = timed(lambda: generate(res["impl"]), device)
        res["gen_graphs_compiled"] = graphs_compiled() - graphs
        res["gen_peak_gib"] = peak_gib(device)
        res["new_tokens"] = out.shape[1] - ids.shape[1]
        stats = hf.get_stats()
        res["generate_attention"] = {"kernel_prefill": stats["kernel_prefill"],
                                     "kernel_decode": stats["kernel_decode"],
                                     "fallback": stats["fallback"], "reasons": stats["reasons"]}
        res["prefill_times_s"], res["gen_times_s"] = [], []

    if args.cache != "dynamic":
        # transformers sizes a static cache max(prompt + new tokens, the largest earlier call's),
        # remembered on the model: forgotten here, so each cell's cache is its own whatever ran
        # before (ours skips the unfilled slots, SDPA does not). And dynamo forgets the earlier
        # cells' graphs: past its recompile limit a frame would silently run eager.
        if hasattr(model, "_previous_max_cache_length"):
            del model._previous_max_cache_length
        torch._dynamo.reset()
    for impl in args.impls:
        guarded(impl, warm_up)
    graphs = graphs_compiled()
    for key, fn, reps in (("prefill_times_s", lambda impl: prefill(), args.repeats),
                          ("gen_times_s", generate, args.gen_repeats)):
        for impl in args.impls:  # untimed: the allocator's blocks for this kind of call cached
            if "error" not in results[impl]:
                guarded(impl, lambda res: fn(res["impl"]), tidy=False)
        for r in range(max(1, reps)):
            order = args.impls if r % 2 == 0 else list(reversed(args.impls))
            for impl in order:
                if "error" not in results[impl]:
                    guarded(impl, lambda res: res[key].append(
                        timed(lambda: fn(res["impl"]), device)[0]), tidy=False)
    graphs = graphs_compiled() - graphs  # should be 0: the warm-up compiled everything
    if args.attention_share and device.type == "cuda":
        for impl in args.impls:
            if "error" not in results[impl]:
                guarded(impl, lambda res: res.update(prefill_kernel_times(prefill)), tidy=False)
    for res in results.values():
        res["graphs_compiled_timed"] = graphs
        if "error" in res:
            continue
        res["prefill_ms"] = statistics.median(res["prefill_times_s"]) * 1e3
        res["prefill_spread_pct"] = spread_pct(res["prefill_times_s"])
        t_gen = statistics.median(res["gen_times_s"])
        res["gen_s"] = t_gen
        res["gen_tok_s"] = batch * res["new_tokens"] / t_gen
        res["gen_spread_pct"] = spread_pct(res["gen_times_s"])
        t_dec = t_gen - res["prefill_ms"] / 1e3
        res["decode_tok_s"] = (batch * max(res["new_tokens"] - 1, 0) / t_dec if t_dec > 0
                               else None)
    return [results[impl] for impl in args.impls]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for a smoke test", file=sys.stderr)
        return 1
    from flash_attention_sm75.integrations import transformers as hf
    from devtools.model_configs import load_model

    if device.type == "cpu":
        hf.configure(allow_cpu_reference=True)  # smoke test: the op's CPU reference
    if args.decode_on_sdpa:
        hf.configure(decode_on_kernel=False)

    source = args.model or args.config
    model = load_model(source, dtype=torch.float16, device=device, seed=args.seed,
                       attn_implementation="flash_attention_sm75", num_hidden_layers=args.layers)
    model.generation_config.eos_token_id = None  # always generate exactly --new-tokens
    cfg = model.config
    stock_gqa = efficient_supports_gqa(device) if device.type == "cuda" else True
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mode = f"generate: {args.cache} cache, compile {args.compile}"

    print(f"model: {source} ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, head_dim "
          f"{head_dim}), fp16, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"stock = sdpa + SDPBackend.EFFICIENT_ATTENTION"
          f"{'' if stock_gqa else ' (GQA via repeat_kv: efficient kernel has no enable_gqa)'}; "
          f"ours = flash_attention_sm75 (decode on {'SDPA' if args.decode_on_sdpa else 'kernel'})"
          f"; new tokens {args.new_tokens}; left pad {args.left_pad}; {mode}")

    results: List[Dict[str, Any]] = []
    env = C.env_info(device.type)  # once (git, nvidia-smi): the JSON is rewritten per cell

    def write_out(complete):
        """The JSON (--out) of the cells measured so far; complete: every cell ran (written
        after each cell too, so that a run stopped by a time limit keeps what it measured)."""
        C.write_json(args.out, {
            "benchmark": "bench_e2e_hf",
            "args": vars(args),
            "complete": complete,
            "model": {"source": source, "model_type": cfg.model_type,
                      "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                      "kv_heads": cfg.num_key_value_heads, "head_dim": head_dim,
                      "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
            "stock": "sdpa+EFFICIENT_ATTENTION",
            "stock_gqa": "enable_gqa" if stock_gqa else "repeat_kv",
            "generation": {"cache": args.cache, "compile": args.compile},
            "env": env,
            "transformers": __import__("transformers").__version__,
            "results": results,
        })

    for batch in args.batches:
        for length in args.lengths:
            for r in run_pair(model, batch, length, args, device, hf, stock_gqa):
                results.append(r)
                impl = r["impl"]
                if "error" in r:
                    print(f"  B={batch} N={length} {impl}: {r['error']}")
                else:
                    print(f"  B={batch} N={length} {impl}: prefill {r['prefill_ms']:.2f} ms "
                          f"(spread {C.fmt(r['prefill_spread_pct'], '.1f')}%), generate "
                          f"{r['gen_tok_s']:.1f} tok/s (spread {C.fmt(r['gen_spread_pct'], '.1f')}"
                          f"%), peak {C.fmt(r['gen_peak_gib'])} GiB; attention prefill "
                          f"{r['prefill_attention']['kernel']} kernel / "
                          f"{r['prefill_attention']['fallback']} fallback"
                          + (f"; {r['gen_graphs_compiled']} graphs compiled in warm-up"
                             if r["gen_graphs_compiled"] else ""))
                if r.get("prefill_attention_share") is not None:
                    print(f"  B={batch} N={length} {impl}: prefill kernels "
                          f"{r['prefill_gpu_ms']:.2f} ms, attention "
                          f"{r['prefill_attention_gpu_ms']:.2f} ms "
                          f"({100 * r['prefill_attention_share']:.0f}%)")
                if r.get("graphs_compiled_timed"):
                    print(f"  B={batch} N={length}: WARNING {r['graphs_compiled_timed']} graphs "
                          f"compiled during the timed repetitions")
            if args.out:
                write_out(complete=False)

    def get(impl, batch, length, key):
        for r in results:
            if r["impl"] == impl and r["batch"] == batch and r["length"] == length:
                return r.get(key)
        return None

    rows = []
    for batch in args.batches:
        for length in args.lengths:
            po, ps = get("ours", batch, length, "prefill_ms"), get("stock", batch, length,
                                                                    "prefill_ms")
            go, gs = get("ours", batch, length, "gen_tok_s"), get("stock", batch, length,
                                                                   "gen_tok_s")
            do, ds = get("ours", batch, length, "decode_tok_s"), get("stock", batch, length,
                                                                      "decode_tok_s")
            rows.append([
                batch, length,
                C.fmt(po), C.fmt(ps), C.fmt(ps / po if po and ps else None, ".2f"),
                C.fmt(go, ".1f"), C.fmt(gs, ".1f"), C.fmt(go / gs if go and gs else None, ".2f"),
                C.fmt(get("ours", batch, length, "gen_spread_pct"), ".1f"),
                C.fmt(get("stock", batch, length, "gen_spread_pct"), ".1f"),
                C.fmt(do, ".1f"), C.fmt(ds, ".1f"),
                C.fmt(get("ours", batch, length, "prefill_peak_gib"), ".2f"),
                C.fmt(get("stock", batch, length, "prefill_peak_gib"), ".2f"),
                C.fmt(get("ours", batch, length, "gen_peak_gib"), ".2f"),
                C.fmt(get("stock", batch, length, "gen_peak_gib"), ".2f"),
            ])
    headers = ["B", "N", "prefill ms ours", "stock", "speedup", "gen tok/s ours", "stock",
               "speedup", "gen spread % ours", "stock", "decode tok/s ours", "stock",
               "prefill peak GiB ours", "stock", "gen peak GiB ours", "stock"]
    print()
    print(mode)
    print(C.format_table(headers, rows, left=()))

    if args.out:
        write_out(complete=True)
        print(f"wrote {args.out}")
    if args.png:
        panels = []
        for batch in args.batches:
            xs = list(args.lengths)
            panels.append({"title": f"prefill latency, batch {batch}", "x": xs, "logx2": True,
                           "logy": True, "xlabel": "prompt length", "ylabel": "ms",
                           "series": {"ours": [get("ours", batch, n, "prefill_ms") for n in xs],
                                      "efficient": [get("stock", batch, n, "prefill_ms")
                                                    for n in xs]}})
            panels.append({"title": f"generate {args.new_tokens} tokens, batch {batch}",
                           "x": xs, "logx2": True, "ymin0": True, "xlabel": "prompt length",
                           "ylabel": "tokens/s",
                           "series": {"ours": [get("ours", batch, n, "gen_tok_s") for n in xs],
                                      "efficient": [get("stock", batch, n, "gen_tok_s")
                                                    for n in xs]}})
            panels.append({"title": f"peak memory (generate), batch {batch}", "x": xs,
                           "logx2": True, "ymin0": True, "xlabel": "prompt length",
                           "ylabel": "GiB",
                           "series": {"ours": [get("ours", batch, n, "gen_peak_gib") for n in xs],
                                      "efficient": [get("stock", batch, n, "gen_peak_gib")
                                                    for n in xs]}})
        path = C.plot_panels(args.png, panels, ncols=3,
                             suptitle=f"transformers end to end: {source}, fp16; {mode}")
        if path:
            print(f"wrote {path}")
    ok = any("error" not in r and r["impl"] == "ours" for r in results) or "ours" not in args.impls
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
