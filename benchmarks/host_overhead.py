"""Python host time per forward call of our wrappers vs torch's SDPA, on tiny CPU tensors.

Measures the Python + dispatcher time that also precedes every GPU launch. The C++ CPU
reference kernel of the op costs ~180 us even at (B=1, H=1, seqlen 1, d=64) (two dozen ATen
ops) and varies by tens of us between runs, which hides differences of a few us; so by default
the op's CPU kernel is replaced, in this process only, by a Python stub that just allocates the
two outputs, zero-filled (~6 us, the same for every case). Differences between rows are then
host overhead. ``--real-op`` keeps the C++ kernel. Runs anywhere:

    python3 benchmarks/host_overhead.py                  # table, best of --repeats runs
    python3 benchmarks/host_overhead.py --profile NAME   # cProfile of one case (e.g. flash_attn_func)
    python3 benchmarks/host_overhead.py --fwd-bwd        # forward + backward steps (grad)
    python3 benchmarks/host_overhead.py --hf             # the transformers integration, per stage
    python3 benchmarks/host_overhead.py --hf --profile padded-decode   # cProfile of one HF call
    python3 benchmarks/host_overhead.py --cuda-step --causal   # GPU: fwd + bwd steps, wall / host ms
    python3 benchmarks/host_overhead.py --cuda-step --profile flash_attention_forward  # profiler

The SDPA wrapper falls back to torch for CPU tensors. Its kernel path is measured as
``sdpa (kernel path)`` by letting the wrapper take CPU tensors (``sdpa._KERNEL_DEVICE_TYPE`` set to
"cpu" and the compute-capability query patched out for that case only, so the number misses the
cost of ``torch.cuda.get_device_capability``).

``--hf`` measures the transformers integration (``integrations/transformers.py``) instead: a tiny
random Qwen2 model (Qwen2-0.5B's attention shapes: 14 heads, 2 KV heads, head_dim 64; see
``--hf-model``) runs ``generate()`` with a spy attention function, which captures the exact
arguments transformers passes to layer 0 at the prefill and at a decode step (DynamicCache), for
three mask forms: no padding (transformers passes ``None``), a left-padded batch (the boolean
``(B, 1, q_len, kv_len)`` mask of the mask builder registered for our names) and the eager
builder's additive float mask. Each captured call is then timed through our attention function
(with ``configure(allow_cpu_reference=True)``, so that CPU fp16 tensors take the kernel path)
and through transformers' ``sdpa_attention_forward``, with both computes replaced by the same
kind of stub at their Python names (``torch.ops.flash_attention_sm75.fwd``, which
``_ops.call_fwd`` looks up per call, and ``torch.nn.functional.scaled_dot_product_attention``):
both columns are Python time, without the C++ (the op's checks and launch, SDPA's backend
choice and launch) that each side adds on a GPU. Our call is split into its stages. "first
layer" is a call whose mask (and ``position_ids``) no earlier layer of the forward has seen (the
caches and the remembered decisions are cleared before each call); "other layers" repeats the
call on the same objects, as layers 1..L-1 do (the decision taken once, then looked up);
"forward of L layers" adds them up as one forward does (``--hf-layers``, in us), against L stock
calls. "host reads" counts the calls that read tensor values on the host
(``.item()``, ``.tolist()``, ``bool()``, ...; a device synchronisation each on a GPU) in one
call of ours.

These calls repeat in a tight loop, with the interpreter's and the CPU's caches warm. A second
table times whole forwards of a model with ``--hf-layers`` layers of tiny width, ours against
stock (prefill and decode steps), the attention calls timed inside them (where the rest of each
layer runs between two calls, as on a GPU host: about 3x the loop's time for both sides), with
the host reads of one forward, transformers' own included.
By default the capture and the timing run under ``torch.inference_mode()`` as
``benchmarks/bench_e2e_hf.py`` does (``--hf-grad-mode no_grad`` for ``generate()``'s own mode).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import os
import pstats
import statistics
import sys
import time
import warnings
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flash_attention_sm75 as fa  # noqa: E402
from devtools.host_reads import HostReadCounter  # noqa: E402
from flash_attention_sm75 import sdpa as _sdpa  # noqa: E402


@contextlib.contextmanager
def _sdpa_kernel_path_on_cpu():
    """Let the SDPA wrapper's kernel path take CPU tensors (for timing only): its device rule
    reads "cpu" and the CUDA compute-capability query answers (7, 5) (the real query's cost,
    GPU-only, is not in the number)."""
    with mock.patch.object(_sdpa, "_KERNEL_DEVICE_TYPE", "cpu"), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (7, 5)):
        yield


def _stub_cpu_kernel(q, k, v, softmax_scale=None, is_causal=False, causal_bottom_right=True,
                     leftpad_k=None, seqused_k=None, *rest, **kwargs):
    # Zeros, not empty memory: in a whole model the next layers compute on the output, and
    # garbage (denormals, NaN) would change their CPU time.
    b, s, h, _ = q.shape
    return torch.zeros_like(q), q.new_zeros((b, h, s), dtype=torch.float32)


_STUB_LIBRARIES = []  # a Library's registrations live as long as the object


def _install_cpu_stub(op_name: str, fn) -> None:
    lib = torch.library.Library("flash_attention_sm75", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        lib.impl(op_name, fn, "CPU")
    _STUB_LIBRARIES.append(lib)


def install_stub() -> None:
    _install_cpu_stub("fwd", _stub_cpu_kernel)


def _stub_cpu_bwd(dout, q, k, v, *rest, **kwargs):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def install_bwd_stub() -> None:
    _install_cpu_stub("bwd", _stub_cpu_bwd)


def fwd_bwd_cases():
    """name -> one forward + ``torch.autograd.grad`` step (inputs require grad), B=1 H=1 S=1
    d=64 fp16 CPU tensors. "op fwd (registered autograd kernel)" is the raw op through the
    formula ``torch.library.register_autograd`` registers (what every door ran before the
    eager autograd functions, ``_ops._eager_function``); the doors take those functions."""
    bhsd = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    bshd = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(1, 1, 1, 64, dtype=torch.float16)
    op = torch.ops.flash_attention_sm75.fwd

    def step(f, inputs):
        return lambda: torch.autograd.grad(f(*inputs), inputs, dout)

    return {
        "op fwd (registered autograd kernel)": step(lambda q, k, v: op(q, k, v, None, True, True)[0],
                                                    bshd),
        "flash_attn_func": step(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True), bshd),
        "flash_attention_forward": step(
            lambda q, k, v: fa.flash_attention_forward(q, k, v, causal=True), bhsd),
        "sdpa (kernel path)": step(
            lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, is_causal=True), bhsd),
    }


def _below_autograd(op, q, k, v):
    # The floor for the wrappers: the op without its (Python) autograd kernel.
    with torch._C._AutoDispatchBelowAutograd():
        return op(q, k, v, None, False, True)


def cases(requires_grad: bool):
    bhsd = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=requires_grad)
            for _ in range(3)]
    bshd = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=requires_grad)
            for _ in range(3)]
    q, k, v = bshd
    qh, kh, vh = bhsd
    op = torch.ops.flash_attention_sm75.fwd
    return {
        "op fwd (raw)": lambda: op(q, k, v, None, False, True),
        "op fwd.default": lambda: op.default(q, k, v, None, False, True),
        "op fwd below autograd": lambda: _below_autograd(op, q, k, v),
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v),
        "flash_attention_forward": lambda: fa.flash_attention_forward(qh, kh, vh),
        "sdpa (CPU fallback)": lambda: fa.scaled_dot_product_attention(qh, kh, vh),
        "torch F.sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh),
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_per_call(fn, n: int, repeats: int, clock: str = "wall", warmup: int = 200) -> float:
    now = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = now()
        for _ in range(n):
            fn()
        best = min(best, (now() - t0) / n * 1e6)
    return best  # the least disturbed run (2-core machine, other processes)


def profile(fn, n: int) -> None:
    """cProfile of n calls after 200 warm-up calls, the 25 functions with the most own time."""
    for _ in range(200):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def kernel_path_sdpa(requires_grad: bool):
    qh, kh, vh = [torch.randn(1, 1, 1, 64, dtype=torch.float16, requires_grad=requires_grad)
                  for _ in range(3)]
    return lambda: fa.scaled_dot_product_attention(qh, kh, vh)


# ---------------------------------------------------------------------------------------------
# The transformers integration (--hf)
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _op_stubbed_at_its_python_name():
    """``torch.ops.flash_attention_sm75.fwd`` (looked up by ``_ops.call_fwd`` at every call)
    replaced by :func:`_stub_cpu_kernel` itself, as ``F.scaled_dot_product_attention`` is for
    stock: neither side then pays a dispatcher call into a Python kernel, which on a GPU is C++
    on both sides (the op's checks and launch; SDPA's backend choice and launch)."""
    namespace = torch.ops.flash_attention_sm75
    namespace.fwd  # resolved (and cached on the namespace) before it is replaced
    with mock.patch.object(namespace, "fwd", _stub_cpu_kernel):
        yield


def _sdpa_stub(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return query.new_zeros(query.shape[:-1] + (value.shape[-1],))  # as _stub_cpu_kernel


def hf_capture(args, grad_ctx):
    """{(form, phase): (module, q, k, v, mask, args, kwargs)} of layer 0, as transformers passes
    them in generate(); phase "prefill" or "decode" (the second decode step)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    from devtools.model_configs import build_random_model, make_config
    from flash_attention_sm75.integrations import transformers as hf

    captured = {}
    current = {}

    def spy(module, query, key, value, attention_mask, *a, **kw):
        if module.layer_idx == 0:
            phase = "prefill" if query.shape[2] > 1 else "decode"
            captured[(current["form"], phase)] = (module, query, key, value, attention_mask, a,
                                                  dict(kw))
        return hf.flash_attention_sm75_forward(module, query, key, value, attention_mask, *a,
                                               **kw)

    ours_mask = ALL_MASK_ATTENTION_FUNCTIONS[hf.ATTENTION_NAME_PLAIN]
    AttentionInterface.register("hostprobe", spy)
    AttentionMaskInterface.register("hostprobe", ours_mask)
    AttentionInterface.register("hostprobe_eager", spy)
    AttentionMaskInterface.register("hostprobe_eager", eager_mask)
    cfg = make_config(args.hf_model, num_hidden_layers=2, vocab_size=512)
    model = build_random_model(cfg, dtype=torch.float16, attn_implementation="hostprobe")
    s, b = args.hf_prompt, args.hf_batch
    g = torch.Generator().manual_seed(0)
    forms = {"none": (1, "hostprobe", False), "padded": (b, "hostprobe", True),
             "eager-float": (b, "hostprobe_eager", True)}
    for form, (batch, impl, pad) in forms.items():
        ids = torch.randint(1, 512, (batch, s), generator=g)
        am = torch.ones(batch, s, dtype=torch.long)
        if pad:
            for i in range(batch):
                am[i, :(s * i) // (2 * batch)] = 0  # row 0 full, later rows padded more
        model.set_attn_implementation(impl)
        current["form"] = form
        with grad_ctx():
            model.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    return captured, model, transformers.__version__


def hf_stages(call):
    """name -> zero-argument function for each stage of our attention function on one call."""
    from flash_attention_sm75.integrations import transformers as hf

    module, q, k, v, mask, a, kw = call
    fwd = hf.flash_attention_sm75_forward
    bound = hf._bind_sdpa_args(a, kw)
    softcap = hf._softcap_kwarg(kw)
    info, reason = hf._plan(module, q, k, mask, bound["is_causal"], kw.get("sliding_window"),
                            True)
    assert reason is None, reason
    clear = hf._clear_classification_cache

    def first_layer():
        clear()
        return fwd(module, q, k, v, mask, *a, **kw)

    def plan_first():
        clear()
        return hf._plan(module, q, k, mask, bound["is_causal"], kw.get("sliding_window"), True)

    qb = q.transpose(1, 2)
    kb = k.transpose(1, 2)
    vb = v.transpose(1, 2)
    return {
        "ours, first layer": first_layer,
        "ours, other layers": lambda: fwd(module, q, k, v, mask, *a, **kw),
        "  argument binding": lambda: (hf._bind_sdpa_args(a, kw), hf._softcap_kwarg(kw)),
        # None for these calls (not packed): the test whether they are
        "  packed-sequence check": lambda: hf._packed_attention(
            hf._stock_sdpa_forward(), module, q, k, v, mask, bound, kw, softcap),
        "  allow-list + rules": lambda: hf._unsupported_reason(module, q, k, v, mask, bound, kw,
                                                               softcap),
        # what layers 1..L-1 pay instead of the three stages around it: the key of the
        # remembered decision and its lookup (hf._decision_key)
        "  remembered decision: key + lookup": lambda: hf._DECISIONS.get(hf._decision_key(
            module, q, k, v, mask, a, kw, True)),
        "  plan, first layer": plan_first,
        "  plan, other layers": lambda: hf._plan(module, q, k, mask, bound["is_causal"],
                                                 kw.get("sliding_window"), True),
        "  kernel call wrapper": lambda: hf._run_kernel(q, k, v, bound["scaling"], info, softcap),
        "  (op stub alone)": lambda: _stub_cpu_kernel(qb, kb, vb, None, info.causal, True,
                                                      info.leftpad_k, info.seqused_k),
        "  (cache clear)": clear,
    }


def hf_host_reads(call) -> list:
    from flash_attention_sm75.integrations import transformers as hf

    module, q, k, v, mask, a, kw = call
    hf._clear_classification_cache()
    with HostReadCounter() as first:
        hf.flash_attention_sm75_forward(module, q, k, v, mask, *a, **kw)
    with HostReadCounter() as other:
        hf.flash_attention_sm75_forward(module, q, k, v, mask, *a, **kw)
    return [len(first.names), len(other.names)]


def _linear_stub(input, weight, bias=None):
    return input.new_zeros(input.shape[:-1] + (weight.shape[0],))


def hf_model_forwards(args, grad_ctx, clock: str):
    """Whole forwards of a model with --hf-layers layers and tiny widths (TINY_CONFIGS' qwen2:
    hidden 128, 2 heads, 1 KV head, head_dim 64), ours ("sm75_attention") against stock
    ("sdpa"), both attention computes stubbed, and ``F.linear`` too (fp16 matrix products on a
    CPU take ~300 us each even at these widths and would drown the difference; what is left is
    the host work of a forward, as on a GPU when the run is host-bound): a B=1 prefill without
    padding (``use_cache=False``, as bench_e2e_hf times it) and a decode step (DynamicCache, one
    new token; cropped back after each call) for B=1 and a left-padded batch. Returns
    {case: {column: value}}: ms per forward, the difference per layer in us, and the host reads
    of one forward (ours / stock), which include transformers' own."""
    from transformers import AttentionInterface
    from devtools.model_configs import build_random_model

    layers, s, b = args.hf_layers, args.hf_prompt, args.hf_batch
    models = {impl: build_random_model("qwen2", dtype=torch.float16, seed=0,
                                       num_hidden_layers=layers, attn_implementation=impl)
              for impl in ("sdpa", "sm75_attention")}
    g = torch.Generator().manual_seed(1)
    rows = {}

    def patches():
        return (mock.patch.object(F, "scaled_dot_product_attention", _sdpa_stub),
                mock.patch.object(F, "linear", _linear_stub), _op_stubbed_at_its_python_name())

    # The attention calls themselves, timed inside the forwards (one more pass each).
    inside = {}

    def timing(impl, fn):
        def timed(*a, **kw):
            t0 = CLOCKS[clock]()
            try:
                return fn(*a, **kw)
            finally:
                inside[impl].append(CLOCKS[clock]() - t0)
        return timed

    for case, batch, pad, decode in (("prefill, B=1, no padding", 1, False, False),
                                     ("decode step, B=1", 1, False, True),
                                     (f"decode step, B={b} left-padded", b, True, True)):
        ids = torch.randint(1, 128, (batch, s), generator=g)
        am = torch.ones(batch, s, dtype=torch.long)
        if pad:
            for i in range(batch):
                am[i, :(s * i) // (2 * batch)] = 0
        fns, reads = {}, {}
        with grad_ctx(), contextlib.ExitStack() as stack:
            for patch in patches():
                stack.enter_context(patch)
            for impl, model in models.items():
                if decode:
                    out = model(input_ids=ids, attention_mask=am, use_cache=True)
                    cache = out["cache"] if "cache" in out else out.past_key_values  # < 5.24
                    step = dict(input_ids=ids[:, -1:], attention_mask=torch.cat(
                        [am, am.new_ones(batch, 1)], dim=1), use_cache=True)

                    # transformers 5.24 renamed past_key_values to cache
                    name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                            else "past_key_values")
                    step[name] = cache

                    def fn(model=model, step=step, cache=cache):
                        model(**step)
                        cache.crop(-1)  # back to the prompt: every call is the same step
                else:
                    def fn(model=model, ids=ids, am=am):
                        model(input_ids=ids, attention_mask=am, use_cache=False)
                fn()
                with HostReadCounter() as counter:
                    fn()
                fns[impl], reads[impl] = fn, len(counter.names)
            # Interleaved (stock, ours, stock, ...), each the best of its runs: a drift of the
            # machine's speed falls on both alike.
            best = {impl: float("inf") for impl in fns}
            for _ in range(args.repeats):
                for impl, fn in fns.items():
                    best[impl] = min(best[impl], time_per_call(fn, max(1, args.n // 50), 1,
                                                               clock, warmup=1) / 1e3)
            for impl, fn in fns.items():
                inside[impl] = []
                mapping = AttentionInterface._global_mapping
                with mock.patch.dict(mapping, {impl: timing(impl, mapping[impl])}):
                    for _ in range(max(1, args.n // 50)):
                        fn()
        rows[case] = {"stock ms": best["sdpa"], "ours ms": best["sm75_attention"],
                      "ours - stock per layer (us)":
                          (best["sm75_attention"] - best["sdpa"]) * 1e3 / layers,
                      "attention call stock (us)": statistics.median(inside["sdpa"]) * 1e6,
                      "attention call ours (us)":
                          statistics.median(inside["sm75_attention"]) * 1e6,
                      "host reads ours / stock": f"{reads['sm75_attention']} / {reads['sdpa']}"}
    return rows


def hf_main(args) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from flash_attention_sm75.integrations import transformers as hf

    grad_ctx = torch.inference_mode if args.hf_grad_mode == "inference" else torch.no_grad
    hf.configure(allow_cpu_reference=True)
    captured, model, tf_version = hf_capture(args, grad_ctx)
    names = [f"{form}-{phase}" for form, phase in captured]

    if args.profile:
        form, phase = args.profile.rsplit("-", 1)
        module, q, k, v, mask, a, kw = captured[(form, phase)]
        with grad_ctx(), _op_stubbed_at_its_python_name():
            profile(lambda: hf.flash_attention_sm75_forward(module, q, k, v, mask, *a, **kw),
                    args.n)
        return

    clock = args.clock or "cpu"
    print(f"torch {torch.__version__}, transformers {tf_version}, {args.hf_model} attention "
          f"shapes, B={args.hf_batch} (1 without padding), prompt {args.hf_prompt}, "
          f"{args.hf_grad_mode} mode; us per call ({clock} clock), best of {args.repeats} x "
          f"{args.n} calls; op and F.sdpa stubbed")
    cols = []
    table = {}
    with grad_ctx(), _op_stubbed_at_its_python_name():
        for (form, phase), call in captured.items():
            module, q, k, v, mask, a, kw = call
            mshape = "None" if mask is None else f"{str(mask.dtype)[6:]} {list(mask.shape)}"
            cols.append(f"{form} {phase}: q {list(q.shape)}, k {list(k.shape)}, mask {mshape}")
            col = {}
            with mock.patch.object(F, "scaled_dot_product_attention", _sdpa_stub):
                col["stock sdpa_attention_forward"] = time_per_call(
                    lambda: sdpa_attention_forward(module, q, k, v, mask, *a, **kw),
                    args.n, args.repeats, clock)
            for name, fn in hf_stages(call).items():
                col[name] = time_per_call(fn, args.n, args.repeats, clock)
            n_layers = args.hf_layers
            col[f"ours, forward of {n_layers} layers"] = (col["ours, first layer"] + (n_layers - 1)
                                                         * col["ours, other layers"])
            col[f"stock, forward of {n_layers} layers"] = (n_layers
                                                          * col["stock sdpa_attention_forward"])
            first, other = hf_host_reads(call)
            col["host reads, first layer / other layers"] = f"{first} / {other}"
            table[f"{form}-{phase}"] = col
    for c in cols:
        print("  " + c)
    print("| stage | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in next(iter(table.values())):
        cells = [table[n][row] for n in names]
        cells = [c if isinstance(c, str) else f"{c:.1f}" for c in cells]
        print(f"| {row} | " + " | ".join(cells) + " |")

    forwards = hf_model_forwards(args, grad_ctx, clock)
    print(f"\nWhole forwards, {args.hf_layers} layers of tiny width (qwen2 TINY_CONFIGS), "
          f"best of {args.repeats} x {max(1, args.n // 50)} ({clock} clock); op, F.sdpa and "
          f"F.linear stubbed; attention calls timed inside the forwards (median)")
    heads = list(next(iter(forwards.values())))
    print("| forward | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for case, cols in forwards.items():
        cells = [c if isinstance(c, str) else f"{c:.2f}" if "ms" in h else f"{c:.1f}"
                 for h, c in cols.items()]
        print(f"| {case} | " + " | ".join(cells) + " |")


def cuda_step_cases(shape, causal: bool):
    """name -> one forward + ``torch.autograd.grad`` step on the GPU at (B, H, N, d) = shape,
    fp16: our three doors and torch's SDPA with only the mem-efficient backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, n, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*s):
        return torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)

    bhsd = [rand(b, h, n, d).requires_grad_() for _ in range(3)]
    bshd = [rand(b, n, h, d).requires_grad_() for _ in range(3)]
    dout_bhsd, dout_bshd = rand(b, h, n, d), rand(b, n, h, d)

    def step(f, inputs, dout):
        return lambda: torch.autograd.grad(f(*inputs), inputs, dout)

    def mem_efficient(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {
        "flash_attn_func": step(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal),
                                bshd, dout_bshd),
        "flash_attention_forward": step(
            lambda q, k, v: fa.flash_attention_forward(q, k, v, causal=causal), bhsd, dout_bhsd),
        "sdpa wrapper": step(
            lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, is_causal=causal), bhsd,
            dout_bhsd),
        "torch mem-efficient": step(mem_efficient, bhsd, dout_bhsd),
    }


def cuda_step_main(args) -> int:
    """--cuda-step: wall and host milliseconds per forward + backward step, back to back (the
    host's share is the Python, autograd, checks and launches that run before each step's
    kernels; a step whose host time reaches its wall time is bound by the host), best of
    --repeats runs of --n steps; with --profile NAME, torch.profiler's table of 20 steps of that
    case by CPU self time (what the host time is made of)."""
    if not torch.cuda.is_available():
        print("host_overhead.py --cuda-step needs a CUDA device", file=sys.stderr)
        return 2
    shape = tuple(args.cuda_shape)
    fns = cuda_step_cases(shape, args.causal)
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        fn = fns[args.profile]
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return 0
    b, h, n, d = shape
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, ms per forward + backward "
          f"step, best of {args.repeats} x {args.n} steps back to back, B={b} H={h} N={n} d={d} "
          f"fp16, {'causal' if args.causal else 'non-causal'}")
    print("| case | wall ms | host ms |")
    print("|---|---|---|")
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        wall = host = float("inf")
        for _ in range(args.repeats):
            spent = 0.0
            t0 = time.perf_counter()
            for _ in range(args.n):
                h0 = time.perf_counter()
                fn()
                spent += time.perf_counter() - h0
            torch.cuda.synchronize()
            wall = min(wall, (time.perf_counter() - t0) / args.n)
            host = min(host, spent / args.n)
        print(f"| {name} | {wall * 1e3:.3f} | {host * 1e3:.3f} |")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=None, help="calls per timed run (2000; --cuda-step: 100)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", default=None, help="cProfile this case (name from the table)")
    p.add_argument("--grad", action="store_true", help="with --profile: inputs require grad")
    p.add_argument("--real-op", action="store_true", help="keep the C++ CPU kernel (no stub)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default=None,
                   help="wall: time.perf_counter (the default of the wrapper table); cpu: "
                        "time.thread_time, this thread's CPU time, which other processes on a "
                        "busy machine disturb less (the default of --hf; the op is stubbed, "
                        "so the call is all CPU)")
    p.add_argument("--fwd-bwd", action="store_true",
                   help="time forward + backward steps instead (fwd and bwd ops stubbed; "
                        "see fwd_bwd_cases)")
    p.add_argument("--cuda-step", action="store_true",
                   help="time forward + backward steps on the GPU instead, with the real kernels, "
                        "against SDPA mem-efficient (see cuda_step_main; --n defaults to 100)")
    p.add_argument("--cuda-shape", type=int, nargs=4, default=(4, 16, 1024, 64),
                   metavar=("B", "H", "N", "D"), help="--cuda-step: the inputs' shape")
    p.add_argument("--causal", action="store_true", help="--cuda-step: causal attention")
    p.add_argument("--hf", action="store_true",
                   help="time the transformers integration's stages instead (see the docstring)")
    p.add_argument("--hf-model", default="qwen2-0.5b",
                   help="devtools.model_configs name whose attention shapes --hf uses (2 layers, "
                        "vocabulary 512)")
    p.add_argument("--hf-batch", type=int, default=4, help="--hf: batch of the padded forms")
    p.add_argument("--hf-prompt", type=int, default=32, help="--hf: prompt length")
    p.add_argument("--hf-layers", type=int, default=24,
                   help="--hf: layers of the forward whose total is reported (first layer + "
                        "the others; Qwen2-0.5B has 24)")
    p.add_argument("--hf-grad-mode", choices=("inference", "no_grad"), default="inference",
                   help="--hf: torch.inference_mode() (as bench_e2e_hf) or torch.no_grad() "
                        "(generate()'s own)")
    args = p.parse_args()
    if args.cuda_step:
        args.n = args.n or 100
        sys.exit(cuda_step_main(args))
    args.n = args.n or 2000
    torch.set_num_threads(1)
    if not args.real_op:
        install_stub()
    if args.hf:
        hf_main(args)
        return
    if args.fwd_bwd:
        if not args.real_op:
            install_bwd_stub()
        clock = args.clock or "wall"
        print(f"torch {torch.__version__}, us per forward + backward step ({clock} clock), best "
              f"of {args.repeats} x {args.n} steps, B=1 H=1 S=1 d=64 fp16 CPU, causal, "
              f"{'C++ CPU kernels' if args.real_op else 'stub CPU kernels'}")
        print("| case | fwd + bwd |")
        print("|---|---|")
        with _sdpa_kernel_path_on_cpu():
            fns = fwd_bwd_cases()
            if args.profile:
                profile(fns[args.profile], args.n)
                return
            for name, fn in fns.items():
                print(f"| {name} | {time_per_call(fn, args.n, args.repeats, clock):.1f} |")
        return

    if args.profile:
        fns = cases(args.grad)
        fns["sdpa (kernel path)"] = kernel_path_sdpa(args.grad)
        fn = fns[args.profile]
        with _sdpa_kernel_path_on_cpu() if "kernel" in args.profile else contextlib.nullcontext():
            profile(fn, args.n)
        return

    clock = args.clock or "wall"
    kernel = "C++ CPU kernel" if args.real_op else "stub CPU kernel"
    print(f"torch {torch.__version__}, us per call ({clock} clock), best of {args.repeats} x "
          f"{args.n} calls, B=1 H=1 S=1 d=64 fp16 CPU, {kernel}")
    print(f"| case | no grad | no_grad() block | requires_grad |")
    print(f"|---|---|---|---|")
    rows = {}
    for rg in (False, True):
        for name, fn in cases(rg).items():
            rows.setdefault(name, []).append(time_per_call(fn, args.n, args.repeats, clock))
            if not rg:
                with torch.no_grad():
                    rows[name].append(time_per_call(fn, args.n, args.repeats, clock))
        with _sdpa_kernel_path_on_cpu():
            name, fn = "sdpa (kernel path)", kernel_path_sdpa(rg)
            rows.setdefault(name, []).append(time_per_call(fn, args.n, args.repeats, clock))
            if not rg:
                with torch.no_grad():
                    rows[name].append(time_per_call(fn, args.n, args.repeats, clock))
    for name, (a, b, c) in rows.items():
        print(f"| {name} | {a:.1f} | {b:.1f} | {c:.1f} |")


if __name__ == "__main__":
    main()
