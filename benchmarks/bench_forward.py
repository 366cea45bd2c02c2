#!/usr/bin/env python3
"""Forward-pass benchmark: our SM75 FlashAttention kernel vs torch SDPA backends.

Default sweep (FlashAttention-style): B=4, H=16, fp16, d in {64, 128},
N = Sq = Sk in {512, ..., 16384}, causal off/on. For every case it times, in the same process:
  ours       flash_attention_sm75.flash_attention_forward(q, k, v, causal=...)  (BHSD)
  efficient  torch SDPA memory-efficient backend (what Turing users get today)
  flash      torch SDPA flash backend (sm80+ only; '-' where unsupported)
  cudnn      torch SDPA cuDNN backend ('-' where unsupported)
  math       torch SDPA math backend (eager; skipped for N > --math-max-n)
and reports median ms, TFLOP/s (4*B*H*N^2*d, halved for causal), ours-vs-efficient speed ratio
(t_efficient / t_ours, > 1 means ours is faster), peak extra memory (max_memory_allocated minus
what was allocated before the call: output + workspace, inputs excluded), max |ours - backend|,
and ours as a % of the SM75-instruction ceiling measured by benchmarks/mma_peak.cu in the same run.

Timing: triton.testing.do_bench (median) when triton imports, else CUDA events; both flush L2
(256 MiB memset) before each timed call, so inputs come from HBM even for small N.

Outputs under --out-dir: <tag>.json (environment + all numbers), <tag>.png (TFLOP/s and memory
vs N), <tag>.txt (the printed tables). `--dry-run` runs tiny shapes on the CPU (our CPU reference
op and SDPA on CPU) to exercise the table/JSON/plot code without a GPU; `--device cpu` runs the
same tiny shapes (without --decode unless asked). Without CUDA and without one of these two the
script stops with an error (it does not fall back to the CPU).

Examples:
  python3 benchmarks/bench_forward.py --out-dir bench_out --decode
  python3 benchmarks/bench_forward.py --quick --out-dir /tmp/b
  python3 benchmarks/bench_forward.py --d 128 --n 4096 8192 --causal on
  python3 benchmarks/bench_forward.py --dry-run --out-dir /tmp/dry
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402

ALL_BACKENDS = ["ours", "efficient", "flash", "cudnn", "math"]
DECODE_BACKENDS = ["ours", "ours_op", "efficient", "flash", "cudnn", "math"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_sweep_args(p, ALL_BACKENDS, "512 ... 16384", "bench_forward")
    p.add_argument("--quick", action="store_true",
                   help="N in {1024, 4096}, shorter timing, quick mma_peak sweep")
    p.add_argument("--math-max-n", type=int, default=8192,
                   help="skip the math backend above this N (it materializes B*H*N*N scores)")
    p.add_argument("--decode", action="store_true",
                   help="also time decode-like shapes (q_len=1) to expose wrapper overhead")
    p.add_argument("--decode-sk", type=int, nargs="+", default=None,
                   help="key lengths for --decode (default 512 4096)")
    p.add_argument("--decode-batch", type=int, default=None, help="batch for --decode (default 4)")
    p.add_argument("--cache-dir", default=None,
                   help="where the mma_peak binary is built/cached (default <out-dir>/.cache)")
    p.add_argument("--mma-peak-tflops", type=float, default=None,
                   help="use this SM75 ceiling instead of running mma_peak")
    p.add_argument("--no-mma-peak", action="store_true", help="do not build/run mma_peak")
    C.add_device_args(p, "cpu uses the --dry-run sizes unless --n/--batch/--heads/--decode-sk/"
                         "--decode-batch are given",
                      "exercises table/JSON/plot without a GPU")
    a = p.parse_args(argv)

    if a.dry_run or a.device == "cpu":
        a.device = a.device or "cpu"
        C.use_dry_run_sizes(a)
        a.decode_sk = a.decode_sk or [64, 256]
        a.decode_batch = a.decode_batch or 1
    if a.dry_run:
        a.decode = True
    C.finish_sweep_args(p, a, ALL_BACKENDS, [512, 1024, 2048, 4096, 8192, 16384],
                        timing_full=(25, 100))
    a.decode_sk = a.decode_sk or [512, 4096]
    a.decode_batch = a.decode_batch or 4
    a.cache_dir = a.cache_dir or os.path.join(a.out_dir, ".cache")
    return a


class Runner(C.SweepRunner):
    case_name = staticmethod(C.kernel_name)

    def impl(self, name):
        """(callable(q, k, v, causal), context manager factory, note) for a backend, or
        (None, None, reason)."""
        if name == "ours":
            if not self.ours.available:
                return None, None, self.ours.error
            return self.ours.bhsd, contextlib.nullcontext, None
        if name == "ours_op":
            if self.ours.op_bhsd is None:
                return None, None, self.ours.error or "raw op unavailable"
            return self.ours.op_bhsd, contextlib.nullcontext, None
        if name in C.optional_backends():
            return self.optional_impl(name)
        return self.sdpa_impl(name)

    def measure(self, name, q, k, v, causal, flop, ref=None, loop_calls=0):
        """Run one backend on one case. Returns (record dict, output tensor or None)."""
        rec = {"backend": name, "ms": None, "tflops": None, "status": "ok"}
        impl = self.prepare(rec, name)
        if impl is None:
            return rec, None
        fn_impl, ctx_factory = impl

        def fn():
            return fn_impl(q, k, v, causal)
        out = None
        try:
            with ctx_factory():
                out = fn()
                self.sync()
                if ref is not None and out is not None:
                    rec["max_abs_diff_vs_ours"] = float((out.float() - ref.float()).abs().max())
                rec["peak_extra_bytes"] = C.peak_extra_memory(fn, self.a.device)
                t = C.bench(fn, self.a.device, self.a.warmup_ms, self.a.rep_ms,
                            use_triton=self.use_triton)
                if loop_calls:
                    rec["loop_ms_per_call"] = C.bench_launch_loop(fn, self.a.device,
                                                                   calls=loop_calls)
            rec.update(t)
            rec["tflops"] = C.tflops(flop, rec["ms"])
        except Exception as e:  # backend not supported for this shape/GPU, OOM, kernel error
            self.failed(rec, name, e)
            rec["ms"] = rec["tflops"] = None
            out = None
        return rec, out

    def new_case(self, d, causal, n):
        return {"flop": C.attention_flops(self.a.batch, C.heads_for(self.a, d), n, n, d, causal)}

    def make_inputs(self, case):
        a = self.a
        return make_inputs(a.batch, case["heads"], case["n"], case["n"], case["d"], a.device, a.seed)

    def run_case(self, case, inputs):
        q, k, v = inputs
        ref = None
        for name in self.a.backend_list:
            if name == "math" and case["n"] > self.a.math_max_n:
                case["backends"][name] = {"backend": name, "ms": None, "tflops": None,
                                          "status": f"skipped: N > --math-max-n "
                                                    f"{self.a.math_max_n}"}
                continue
            dropped = self.gate(name, (name,), q, k, v, case["causal"])
            if dropped:
                case["backends"][name] = {"backend": name, "ms": None, "tflops": None,
                                          "status": dropped}
                continue
            rec, out = self.measure(name, q, k, v, case["causal"], case["flop"],
                                    ref=None if name == "ours" else ref)
            if name == "ours":
                ref = out
            del out
            case["backends"][name] = rec

    def progress(self, case):
        return "TFLOP/s: " + "  ".join(f"{nm}={C.fmt_tf(r.get('tflops'))}"
                                       for nm, r in case["backends"].items())


def make_inputs(b, h, sq, sk, d, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    def mk(s):
        return torch.randn(b, h, s, d, generator=g, dtype=torch.float32).to(
            device=device, dtype=torch.float16)
    return mk(sq), mk(sk), mk(sk)


def run_decode(args, runner, log):
    rows = []
    for d in args.d:
        for sk in args.decode_sk:
            b, h = args.decode_batch, C.heads_for(args, d)
            case = {"kernel": C.kernel_name(d, False), "d": d, "causal": False, "sq": 1, "sk": sk,
                    "batch": b, "heads": h, "flop": C.attention_flops(b, h, 1, sk, d, False),
                    "backends": {}}
            q, k, v = make_inputs(b, h, 1, sk, d, args.device, args.seed)
            ref = None
            for name in DECODE_BACKENDS:
                base = "ours" if name == "ours_op" else name
                if base not in args.backend_list:
                    continue
                rec, out = runner.measure(name, q, k, v, False, case["flop"],
                                          ref=None if name == "ours" else ref,
                                          loop_calls=20 if args.device == "cpu" else 200)
                if name == "ours":
                    ref = out
                del out
                case["backends"][name] = rec
            del q, k, v, ref
            rows.append(case)
            log(f"[decode d={d} Sk={sk}] us: " + "  ".join(
                f"{nm}={C.fmt(None if r.get('ms') is None else r['ms'] * 1e3, '.1f')}"
                for nm, r in case["backends"].items()))
    return rows


def forward_tables(cases, backends, ceiling):
    # The optional backends' ratio columns (t_backend / t_ours, like ours/eff).
    extra = [b for b in ("ssiu", "mem_eff_sm75") if b in backends]
    perf_headers = ["kernel", "N", "ours ms"] + [f"{b} TF" for b in backends] + \
                   ["ours/eff"] + [f"ours/{b}" for b in extra] + ["%ceil", "maxdiff"]
    perf_rows, mem_rows = [], []
    mem_backends = [b for b in backends]
    mem_headers = ["kernel", "N"] + [f"{b} MiB" for b in mem_backends] + ["eff/ours mem"]
    for c in cases:
        bk = c["backends"]
        ours = bk.get("ours", {})
        r = C.ratio(c, "efficient", "ours")  # t_eff / t_ours
        pct = None if (ceiling is None or ours.get("tflops") is None) else \
            100.0 * ours["tflops"] / ceiling
        c["ratio_ours_vs_efficient"] = r
        rx = [C.ratio(c, b, "ours") for b in extra]  # t_backend / t_ours
        for b, rb in zip(extra, rx):
            c[f"ratio_ours_vs_{b}"] = rb
        c["pct_of_sm75_ceiling"] = pct
        diffs = [v.get("max_abs_diff_vs_ours") for n, v in bk.items()
                 if v.get("max_abs_diff_vs_ours") is not None]
        perf_rows.append([c["kernel"], c["n"], C.fmt(ours.get("ms"), ".3f")] +
                         [C.fmt_tf(bk.get(b, {}).get("tflops")) for b in backends] +
                         [C.fmt_ratio(r)] + [C.fmt_ratio(rb) for rb in rx] +
                         [C.fmt(pct, ".1f"),
                          C.fmt(max(diffs) if diffs else None, ".1e")])
        om = bk.get("ours", {}).get("peak_extra_bytes")
        em = bk.get("efficient", {}).get("peak_extra_bytes")
        mem_rows.append([c["kernel"], c["n"]] +
                        [C.fmt(C.mib(bk.get(b, {}).get("peak_extra_bytes")), ".1f")
                         for b in mem_backends] +
                        [C.fmt(None if not om or em is None else em / om, ".2f")])
    return (C.format_table(perf_headers, perf_rows), C.format_table(mem_headers, mem_rows))


def decode_table(rows):
    names = []
    for r in rows:
        for n in r["backends"]:
            if n not in names:
                names.append(n)
    headers = ["kernel", "Sk"] + [f"{n} gpu/loop us" for n in names] + ["eff/ours"]

    def us(x):
        return None if x is None else x * 1e3
    out = []
    for r in rows:
        bk = r["backends"]
        rt = C.ratio(r, "efficient", "ours")
        cells = []
        for n in names:
            g, lp = us(bk.get(n, {}).get("ms")), us(bk.get(n, {}).get("loop_ms_per_call"))
            cells.append("-" if g is None else f"{g:.1f}/{C.fmt(lp, '.1f')}")
        out.append([r["kernel"], r["sk"]] + cells +
                   [C.fmt_ratio(rt)])
    return C.format_table(headers, out)


def make_plot(path, cases, args, ceiling, env):
    panels_tf, panels_mem = [], []
    for d, causal, sel, xs in C.sweep_groups(cases, args):
        title = f"{C.kernel_name(d, causal)}  (B={args.batch}, H={C.heads_for(args, d)})"
        panels_tf.append({
            "title": title, "x": xs, "xlabel": "N (= Sq = Sk)", "ylabel": "TFLOP/s",
            "logx2": True, "ymin0": True,
            "series": {b: [c["backends"].get(b, {}).get("tflops") for c in sel]
                       for b in args.backend_list},
            "hline": (ceiling, f"mma.sync m16n8k8 ceiling {ceiling:.0f}") if ceiling else None,
        })
        panels_mem.append({
            "title": "peak extra memory: " + title, "x": xs, "xlabel": "N",
            "ylabel": "MiB (output + workspace)", "logx2": True, "logy": True,
            "series": {b: [C.mib(c["backends"].get(b, {}).get("peak_extra_bytes"))
                           for c in sel] for b in args.backend_list},
        })
    if not C.has_data(panels_mem):
        panels_mem = []  # CPU runs: no allocator statistics
    panels = panels_tf + panels_mem
    if not panels:
        return None
    return C.plot_panels(path, panels, ncols=max(1, len(panels_tf)),
                         suptitle=C.plot_title("forward", env))


def main(argv=None):
    args = parse_args(argv)
    with C.report(C.report_path(args)) as log:
        runner = Runner(args, log)
        env = C.env_info(args.device)
        C.log_header(log, args, env, runner)
        ceiling, mma = sm75_ceiling(args, log)
        cases = runner.sweep()
        perf_t, mem_t = forward_tables(cases, args.backend_list, ceiling)
        dec = run_decode(args, runner, log) if args.decode else []

        log("")
        log(f"== forward, fp16, B={args.batch}, H={C.heads_label(args)}; TF = TFLOP/s (4*B*H*N^2*d, /2 "
            f"causal); ours/eff = t_efficient / t_ours; %ceil = ours / SM75 mma ceiling "
            f"({C.fmt(ceiling, '.1f')} TFLOP/s); maxdiff = max |backend - ours| ==")
        log(perf_t)
        log("")
        log("== peak extra memory per call, MiB (max_memory_allocated - allocated before; "
            "output + workspace, inputs excluded) ==")
        log(mem_t)
        if dec:
            log("")
            log(f"== decode (q_len=1, B={args.decode_batch}, H={C.heads_label(args)}, not causal); gpu = "
                "median GPU time (L2 flushed); loop = per call over 200 back-to-back calls "
                "(host-overhead bound); eff/ours = gpu t_efficient / t_ours ==")
            log(decode_table(dec))
        C.log_problems(log, cases + dec)

        result = C.sweep_result("bench_forward", args, env, runner)
        result.update({
            "allow_fp16_bf16_reduction_math_sdp": (
                torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
                if hasattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed")
                else None),
            "sm75_ceiling": mma,
            "cases": cases,
            "decode": dec,
        })
        C.write_outputs(args, log, result, runner,
                        lambda path: make_plot(path, cases, args, ceiling, env))
    # Non-zero exit if our kernel never produced a number (so gpu_suite flags the step).
    return C.exit_status("bench_forward", runner, cases, "ours" in args.backend_list, "ms",
                         "our kernel")


def sm75_ceiling(args, log):
    """The SM75-instruction ceiling (mma_peak, run with the GPU idle before the attention runs),
    or the one given on the command line: (TFLOP/s or None, record for the JSON)."""
    mma = {"source": None, "peak_tflops": None}
    if args.mma_peak_tflops is not None:
        mma = {"source": "--mma-peak-tflops", "peak_tflops": args.mma_peak_tflops}
    elif not args.no_mma_peak:
        binary = C.build_mma_peak(args.cache_dir, log=log)
        mma["binary_built"] = binary is not None
        if binary and args.device == "cuda":
            res = C.run_mma_peak(binary, quick=args.quick, log=log)
            if res:
                mma.update(res)
                mma["source"] = "benchmarks/mma_peak.cu (this run)"
        elif binary:
            log("mma_peak: built; not run (no GPU in this mode)")
    ceiling = mma.get("peak_tflops")
    log(f"SM75-instruction ceiling: {C.fmt(ceiling, '.1f')} TFLOP/s ({mma.get('source')})")
    return ceiling, mma


if __name__ == "__main__":
    sys.exit(main())
