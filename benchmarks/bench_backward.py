#!/usr/bin/env python3
"""Backward-pass benchmark: our SM75 FlashAttention backward vs torch SDPA backends.

Default sweep: B=4, H=16, fp16, d in {64, 128}, N = Sq = Sk in {1024, 2048, 4096, 8192,
16384}, causal off/on (--quick: N in {1024, 4096}). For every case, in one process and on
the same tensors:

  ours         flash_attention_sm75.flash_attention_forward(q, k, v, causal=...) (BHSD) and its
               autograd backward (torch.ops.flash_attention_sm75.bwd), dQ mode of --dq-mode
  ours_atomic  the same with FLASH_SM75_BWD_DQ=atomic (only with --dq-mode both)
  efficient    torch SDPA memory-efficient backend (what Turing users get today): the baseline
  flash        torch SDPA flash backend (sm80+ only; '-' where it does not run)
  cudnn        torch SDPA cuDNN backend ('-' where it does not run)

Two timings per backend, each a median (triton.testing.do_bench, L2 flushed before every call;
CUDA events when triton is missing):
  bwd      backward alone: the forward runs once with requires_grad inputs, then
           torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True) is timed
  fwd+bwd  out = forward(q, k, v); torch.autograd.grad(out, (q, k, v), grad_out)
TFLOP/s: the forward counts 4*B*H*N^2*d (halved for causal); backward = 2.5x that, fwd+bwd =
3.5x. Ratios are t_efficient / t_ours (> 1: ours faster). The speed-bar rows, the target this
backward was built to clear (d=128 N=4096 non-causal, d=64 N=4096 causal: ours >= 1.3x the
memory-efficient backward), are flagged.
Also: peak extra memory of one fwd+bwd (max_memory_allocated minus what was allocated before:
out, saved tensors, workspace, the three gradients; inputs and grad_out excluded) and
max |grad_backend - grad_ours| over dq, dk, dv (a sanity check, not the accuracy test).

Outputs under --out-dir: <tag>.txt (printed tables), <tag>.json (environment incl. GPU name,
versions, commit from $FA_SM75_COMMIT or `git rev-parse HEAD`, dQ mode, all numbers), <tag>.png.
`--dry-run` (= `--device cpu`) runs tiny shapes on the CPU (our float32 CPU backward and SDPA
on CPU; SDPA has no memory-efficient CPU kernel, so its math backend stands in for `efficient`,
and peak memory is replaced by the bytes of the returned gradients) to exercise every code path
without a GPU: the numbers are meaningless. Without CUDA and without `--dry-run` / `--device cpu`
the script stops with an error (it does not fall back to the CPU).

Examples:
  python3 benchmarks/bench_backward.py --out-dir bench_out                # full (estimated 1-2 min on an H200)
  python3 benchmarks/bench_backward.py --quick --out-dir /tmp/bb          # N in {1024, 4096}
  python3 benchmarks/bench_backward.py --quick --dq-mode both --out-dir /tmp/bb
  python3 benchmarks/bench_backward.py --d 128 --n 4096 --causal off --backends ours,efficient
  python3 benchmarks/bench_backward.py --dry-run --out-dir /tmp/dry
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402

ALL_BACKENDS = ["ours", "efficient", "flash", "cudnn"]
DQ_ENV = "FLASH_SM75_BWD_DQ"
# The speed bar this backward was built to clear: ours >= 1.3x SDPA mem-efficient's backward.
BAR_THRESHOLD = 1.3
BAR_CASES = [(128, False), (64, True)]  # (d, causal); N = --bar-n (4096)

# Plot styles for the series this benchmark adds (the shared ones live in _common.SERIES_STYLE).
for _name, _style in {
        "ours_atomic": dict(color="tab:orange", marker="D", linestyle="--"),
        "ours bwd": dict(color="tab:red", marker="o", linewidth=2.2),
        "ours fwd+bwd": dict(color="tab:red", marker="o", linestyle="--"),
        "ours_atomic bwd": dict(color="tab:orange", marker="D"),
        "ours_atomic fwd+bwd": dict(color="tab:orange", marker="D", linestyle="--")}.items():
    C.SERIES_STYLE.setdefault(_name, _style)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_sweep_args(p, ALL_BACKENDS, "1024 ... 16384", "bench_backward")
    p.add_argument("--dq-mode", choices=["separate", "atomic", "both"], default=None,
                   help=f"our dQ kernel: sets ${DQ_ENV} for our calls (default: the current "
                        f"${DQ_ENV}, i.e. 'separate' unless it says 'atomic'); 'both' times "
                        "separate as 'ours' and atomic as 'ours_atomic'")
    p.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                   help="bhsd: contiguous (B,H,N,d) inputs (as bench_forward.py); bshd: (B,N,H,d) "
                        "storage seen through BHSD views (how models hold q/k/v). Same tensors "
                        "for every backend")
    p.add_argument("--quick", action="store_true", help="N in {1024, 4096}, shorter timing")
    p.add_argument("--bar-n", type=int, default=None,
                   help="N of the speed-bar rows (default 4096; dry run: its middle N)")
    C.add_device_args(p, "cpu implies --dry-run (its sizes unless --n/--batch/--heads are given)",
                      "exercises every code path without a GPU")
    a = p.parse_args(argv)

    if a.dry_run and a.device == "cuda":
        p.error("--dry-run runs on the CPU; drop --device cuda")
    if a.device == "cpu":
        a.dry_run = True
    if a.dry_run:
        a.device = "cpu"
        C.use_dry_run_sizes(a)
        a.bar_n = a.bar_n or sorted(a.n)[len(a.n) // 2]
        if a.dq_mode is None:
            a.dq_mode = "both"  # exercise the two-mode path too
    C.finish_sweep_args(p, a, ALL_BACKENDS, [1024, 2048, 4096, 8192, 16384],
                        timing_full=(20, 60))
    a.bar_n = a.bar_n or 4096
    # Our variants: (series name, dQ mode).
    env_mode = "atomic" if os.environ.get(DQ_ENV) == "atomic" else "separate"
    a.dq_requested = a.dq_mode
    if a.dq_mode is None:
        a.dq_mode = env_mode
    if "ours" not in a.backend_list:
        a.ours_variants = []
    elif a.dq_mode == "both":
        a.ours_variants = [("ours", "separate"), ("ours_atomic", "atomic")]
    else:
        a.ours_variants = [("ours", a.dq_mode)]
    a.series = [n for n, _ in a.ours_variants] + [b for b in a.backend_list if b != "ours"]
    return a


def case_name(d, causal):
    """Benchmark case name = the backward kernel instantiation (csrc/kernels/instantiations)."""
    return C.kernel_name(d, causal, "bwd")


@contextlib.contextmanager
def dq_env(mode):
    """Set $FLASH_SM75_BWD_DQ for the calls inside the block (the C++ reads it on every call)."""
    prev = os.environ.get(DQ_ENV)
    os.environ[DQ_ENV] = mode
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(DQ_ENV, None)
        else:
            os.environ[DQ_ENV] = prev


def deterministic_backward_on():
    from flash_attention_sm75 import is_deterministic_backward

    return bool(is_deterministic_backward())


class Runner(C.SweepRunner):
    case_name = staticmethod(case_name)

    def __init__(self, args, log):
        super().__init__(args, log)
        if args.device == "cpu" and "math" in self.sdpa:
            # SDPA's memory-efficient backend has no CPU kernel: let math stand in, so the
            # ratio / bar / plot code runs in the dry run.
            self.stand_in["efficient"] = self.sdpa["math"]

    def impl(self, name, dq_mode=None):
        """(fn(q, k, v, causal) -> out, context-manager factory, note) or (None, None, reason)."""
        if dq_mode is not None:
            if not self.ours.available:
                return None, None, self.ours.error
            return self.ours.bhsd, (lambda m=dq_mode: dq_env(m)), None
        if name in C.optional_backends():
            return self.optional_impl(name, autograd=True)
        return self.sdpa_impl(name)

    def peak_memory(self, fn):
        """(bytes, method): C.peak_extra_memory on CUDA; on CPU the bytes of the tensors fn
        returns (a placeholder so the dry run exercises the memory table and plot)."""
        if self.a.device == "cuda":
            return C.peak_extra_memory(fn, self.a.device), "max_memory_allocated - allocated"
        res = fn()
        nbytes = sum(t.numel() * t.element_size() for t in res if torch.is_tensor(t))
        return int(nbytes), "dry run: bytes of the returned gradients (not a measurement)"

    def time(self, fn):
        return C.bench(fn, self.a.device, self.a.warmup_ms, self.a.rep_ms,
                       use_triton=self.use_triton, cpu_reps=2)

    def measure(self, name, q, k, v, do, causal, flop_fwd, dq_mode=None, ref=None):
        """One backend on one case. Returns (record, grads of the first fwd+bwd or None)."""
        rec = {"backend": name, "status": "ok", "bwd_ms": None, "fwdbwd_ms": None,
               "bwd_tflops": None, "fwdbwd_tflops": None}
        if dq_mode is not None:
            rec["dq_mode"] = dq_mode
        impl = self.prepare(rec, name, dq_mode)
        if impl is None:
            return rec, None
        fn_impl, ctx_factory = impl
        inputs = (q, k, v)

        def fwd_bwd():
            out = fn_impl(q, k, v, causal)
            return torch.autograd.grad(out, inputs, do)

        grads = None
        stage = "fwd+bwd"
        try:
            with ctx_factory():
                if dq_mode is not None:
                    rec["dq_env_during_run"] = os.environ.get(DQ_ENV)
                    rec["deterministic_backward"] = deterministic_backward_on()
                fwd_bwd()  # warm-up (PTX JIT, library handles, allocator)
                self.sync()
                holder = []
                rec["fwdbwd_peak_extra_bytes"], rec["peak_method"] = self.peak_memory(
                    lambda: holder.append(fwd_bwd()) or holder[-1])
                grads = holder[0]
                del holder
                if ref is not None:
                    rec["max_abs_diff_vs_ours"] = {
                        g: float((a.float() - b.float()).abs().max())
                        for g, a, b in zip(("dq", "dk", "dv"), grads, ref)}
                t = self.time(fwd_bwd)
                rec["fwdbwd_ms"] = t["ms"]
                if self.a.device == "cuda":  # on the CPU every step is host time
                    rec["fwdbwd_host_ms"] = C.host_ms_per_call(fwd_bwd, self.a.device)
                rec["fwdbwd_p20_ms"], rec["fwdbwd_p80_ms"] = t["p20_ms"], t["p80_ms"]
                rec["timing_method"] = t["method"]

                stage = "bwd"
                out = fn_impl(q, k, v, causal)  # forward once; its graph is kept
                self.sync()

                def bwd():
                    return torch.autograd.grad(out, inputs, do, retain_graph=True)
                bwd()
                self.sync()
                rec["bwd_peak_extra_bytes"], _ = self.peak_memory(bwd)
                t = self.time(bwd)
                del out
                rec["bwd_ms"] = t["ms"]
                rec["bwd_p20_ms"], rec["bwd_p80_ms"] = t["p20_ms"], t["p80_ms"]
            rec["bwd_tflops"] = C.tflops(2.5 * flop_fwd, rec["bwd_ms"])
            rec["fwdbwd_tflops"] = C.tflops(3.5 * flop_fwd, rec["fwdbwd_ms"])
            if rec["fwdbwd_ms"] is not None and rec["bwd_ms"] is not None:
                rec["fwd_derived_ms"] = rec["fwdbwd_ms"] - rec["bwd_ms"]
        except Exception as e:  # backend refuses the shape/GPU, OOM, kernel error
            # A partial result (fwd+bwd timed, bwd failed) is kept; TFLOP/s for what ran.
            rec["fwdbwd_tflops"] = C.tflops(3.5 * flop_fwd, rec["fwdbwd_ms"])
            self.failed(rec, name, e, where=f" in {stage}")
        return rec, grads

    def new_case(self, d, causal, n):
        flop = C.attention_flops(self.a.batch, C.heads_for(self.a, d), n, n, d, causal)
        return {"layout": self.a.layout, "flop_fwd": flop, "flop_bwd": 2.5 * flop,
                "flop_fwdbwd": 3.5 * flop}

    def make_inputs(self, case):
        return make_inputs(self.a, case["n"], case["d"])

    def run_case(self, case, inputs):
        q, k, v, do = inputs
        causal, flop = case["causal"], case["flop_fwd"]
        ref = None
        for name, mode in self.a.ours_variants:
            rec, grads = self.measure(name, q, k, v, do, causal, flop, dq_mode=mode, ref=ref)
            if ref is None:
                ref = grads
            del grads
            case["backends"][name] = rec
        for name in self.a.backend_list:
            if name == "ours":
                continue
            dropped = self.gate(name, (name,), q, k, v, causal, do)
            if dropped:
                case["backends"][name] = {"backend": name, "status": dropped, "bwd_ms": None,
                                          "fwdbwd_ms": None, "bwd_tflops": None,
                                          "fwdbwd_tflops": None}
                continue
            rec, grads = self.measure(name, q, k, v, do, causal, flop, ref=ref)
            del grads
            case["backends"][name] = rec

    def progress(self, case):
        return "TFLOP/s bwd/fwd+bwd: " + "  ".join(
            f"{nm}={C.fmt_tf(r.get('bwd_tflops'))}/{C.fmt_tf(r.get('fwdbwd_tflops'))}"
            for nm, r in case["backends"].items())


def make_inputs(args, n, d):
    """q, k, v (requires_grad) and grad_out, BHSD-shaped; bshd layout = BSHD storage viewed BHSD."""
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    b, h = args.batch, C.heads_for(args, d)

    def mk(grad):
        shape = (b, n, h, d) if args.layout == "bshd" else (b, h, n, d)
        t = torch.randn(shape, generator=g, device=args.device, dtype=torch.float16)
        if args.layout == "bshd":
            t = t.transpose(1, 2)
        return t.requires_grad_(grad)
    return mk(True), mk(True), mk(True), mk(False)


def is_bar_case(c, args):
    return c["n"] == args.bar_n and (c["d"], c["causal"]) in BAR_CASES


def annotate(cases, args):
    """Ratios (t_efficient / t_ours_variant) and the bar verdict, stored in each case."""
    for c in cases:
        c["ratios_vs_efficient"] = {
            name: {"bwd": C.ratio(c, "efficient", name, key="bwd_ms"),
                   "fwdbwd": C.ratio(c, "efficient", name, key="fwdbwd_ms")}
            for name, _ in args.ours_variants}
        if is_bar_case(c, args):
            r = c["ratios_vs_efficient"].get("ours", {}).get("bwd")
            c["bar"] = {"threshold": BAR_THRESHOLD, "ratio_bwd": r,
                        "pass": None if r is None else bool(r >= BAR_THRESHOLD)}


def bar_cell(c):
    b = c.get("bar")
    if b is None:
        return ""
    if b["pass"] is None:
        return "<- BAR ?"
    return f"<- BAR {'PASS' if b['pass'] else 'FAIL'}"


def max_diff(c):
    vals = [max(r["max_abs_diff_vs_ours"].values()) for r in c["backends"].values()
            if r.get("max_abs_diff_vs_ours")]
    return max(vals) if vals else None


def tables(cases, args):
    variants = [n for n, _ in args.ours_variants]
    has_eff = "efficient" in args.series
    # The optional backends' ratio columns: t_backend / t_ours_variant, like eff/ours.
    extra = [b for b in ("ssiu", "mem_eff_sm75") if b in args.series]
    out = {}
    for key, label in (("bwd", "bwd"), ("fwdbwd", "fwd+bwd")):
        headers = ["kernel", "N"] + [f"{v} ms" for v in variants] + \
                  (["efficient ms"] if has_eff else []) + [f"{s} TF" for s in args.series] + \
                  ([f"eff/{v}" for v in variants] if has_eff else []) + \
                  [f"{b}/{v}" for b in extra for v in variants]
        if key == "bwd":
            headers += ["bar", "maxdiff"]
        else:  # the host's share: a step whose host time reaches its time is host-bound
            headers += [f"{v} host ms" for v in variants] + \
                       (["efficient host ms"] if has_eff else [])
        rows = []
        for c in cases:
            bk = c["backends"]
            row = [c["kernel"], c["n"]]
            row += [C.fmt(bk.get(v, {}).get(f"{key}_ms"), ".3f") for v in variants]
            if has_eff:
                row.append(C.fmt(bk.get("efficient", {}).get(f"{key}_ms"), ".3f"))
            row += [C.fmt_tf(bk.get(s, {}).get(f"{key}_tflops")) for s in args.series]
            if has_eff:
                row += [C.fmt_ratio(c["ratios_vs_efficient"][v][key]) for v in variants]
            row += [C.fmt_ratio(C.ratio(c, b, v, f"{key}_ms")) for b in extra for v in variants]
            if key == "bwd":
                row += [bar_cell(c), C.fmt(max_diff(c), ".1e")]
            else:
                row += [C.fmt(bk.get(v, {}).get("fwdbwd_host_ms"), ".3f") for v in variants]
                if has_eff:
                    row.append(C.fmt(bk.get("efficient", {}).get("fwdbwd_host_ms"), ".3f"))
            rows.append(row)
        out[key] = C.format_table(headers, rows, left=(0, len(headers) - 2) if key == "bwd"
                                  else (0,))
    headers = ["kernel", "N"] + [f"{s} MiB" for s in args.series] + \
              ([f"eff/{v} mem" for v in variants] if has_eff else [])
    rows = []
    for c in cases:
        bk = c["backends"]
        row = [c["kernel"], c["n"]] + [C.fmt(C.mib(bk.get(s, {}).get("fwdbwd_peak_extra_bytes")),
                                             ".1f") for s in args.series]
        if has_eff:
            em = bk.get("efficient", {}).get("fwdbwd_peak_extra_bytes")
            for v in variants:
                om = bk.get(v, {}).get("fwdbwd_peak_extra_bytes")
                row.append(C.fmt(None if not om or em is None else em / om, ".2f"))
        rows.append(row)
    out["mem"] = C.format_table(headers, rows)
    return out


def bar_summary(cases, args):
    """One line per speed-bar row, and a short verdict for the last log line."""
    lines, short = [], []
    for d, causal in BAR_CASES:
        tag = f"d={d} N={args.bar_n} {'causal' if causal else 'non-causal'}"
        stag = f"d{d} N{args.bar_n}{'c' if causal else ''}"
        sel = [c for c in cases if c["d"] == d and c["causal"] == causal and c["n"] == args.bar_n]
        if not sel:
            lines.append(f"  {tag}: not in this sweep")
            short.append(f"{stag} n/a")
            continue
        c = sel[0]
        b = c.get("bar") or {}
        r = b.get("ratio_bwd")
        rf = c["ratios_vs_efficient"].get("ours", {}).get("fwdbwd")
        verdict = "?" if b.get("pass") is None else ("PASS" if b["pass"] else "FAIL")
        extra = ""
        if "ours_atomic" in c["ratios_vs_efficient"]:
            extra = f"; atomic dQ bwd {C.fmt_ratio(c['ratios_vs_efficient']['ours_atomic']['bwd'])}"
        lines.append(f"  {tag}: bwd eff/ours {C.fmt_ratio(r)} (need >= {BAR_THRESHOLD}x) "
                     f"{verdict}; fwd+bwd {C.fmt_ratio(rf)}{extra}")
        short.append(f"{stag} {C.fmt_ratio(r)} {verdict}")
    return lines, short


def make_plot(path, cases, args, env):
    rows = {"bwd": [], "fwdbwd": [], "ratio": [], "mem": []}
    variants = [n for n, _ in args.ours_variants]
    for d, causal, sel, xs in C.sweep_groups(cases, args):
        short = f"d={d} {'causal' if causal else 'non-causal'}"
        for key, label, mult in (("bwd", "backward", 2.5), ("fwdbwd", "fwd+bwd", 3.5)):
            rows[key].append({
                "title": f"{label} TFLOP/s: {case_name(d, causal)}", "x": xs,
                "xlabel": f"N (= Sq = Sk), B={args.batch}, H={C.heads_for(args, d)}",
                "ylabel": f"TFLOP/s ({mult} x fwd FLOPs)", "logx2": True, "ymin0": True,
                "series": {s: [c["backends"].get(s, {}).get(f"{key}_tflops") for c in sel]
                           for s in args.series}})
        series = {}
        for v in variants:
            series[f"{v} bwd"] = [c["ratios_vs_efficient"][v]["bwd"] for c in sel]
            series[f"{v} fwd+bwd"] = [c["ratios_vs_efficient"][v]["fwdbwd"] for c in sel]
        bar_panel = (d, causal) in BAR_CASES and args.bar_n in xs
        rows["ratio"].append({
            "title": f"t_efficient / t_ours, {short}"
                     + (f" (bar row at N={args.bar_n})" if bar_panel else ""),
            "x": xs, "xlabel": "N", "ylabel": "speed-up over SDPA mem-efficient",
            "logx2": True, "ymin0": True, "series": series,
            "hline": ((BAR_THRESHOLD, f"speed bar {BAR_THRESHOLD}x (bwd)") if bar_panel
                      else (1.0, "parity"))})
        rows["mem"].append({
            "title": f"peak extra memory of fwd+bwd, {short}", "x": xs,
            "xlabel": "N", "ylabel": "MiB", "logx2": True, "logy": True,
            "series": {s: [C.mib(c["backends"].get(s, {}).get("fwdbwd_peak_extra_bytes"))
                           for c in sel] for s in args.series}})
    panels = []
    for key in ("bwd", "fwdbwd", "ratio", "mem"):
        if C.has_data(rows[key]):
            panels += rows[key]
    if not panels:
        return None
    sup = C.plot_title("backward", env, f"dQ {args.dq_mode}", f"layout {args.layout}")
    if args.device == "cpu":
        sup += "  DRY RUN (CPU): numbers meaningless"
    return C.plot_panels(path, panels, ncols=max(1, len(rows["bwd"])), suptitle=sup)


def main(argv=None):
    args = parse_args(argv)
    with C.report(C.report_path(args)) as log:
        runner = Runner(args, log)
        env = C.env_info(args.device)
        dq_info = {"requested": args.dq_requested, "mode": args.dq_mode,
                   "variants": dict(args.ours_variants),
                   f"{DQ_ENV}_at_start": os.environ.get(DQ_ENV),
                   "deterministic_backward": deterministic_backward_on()}
        notes = []
        if dq_info["deterministic_backward"] and any(m == "atomic" for _, m in args.ours_variants):
            notes.append("WARNING: deterministic backward is on: the atomic dQ mode is ignored "
                         "(separate runs)")
        C.log_header(log, args, env, runner, notes=notes, ours_note=(
            f"; dQ mode {args.dq_mode} (${DQ_ENV}={os.environ.get(DQ_ENV)!r} at start, "
            f"--dq-mode {args.dq_requested}); variants: "
            + ", ".join(f"{n}={m}" for n, m in args.ours_variants)))

        cases = runner.sweep()
        annotate(cases, args)
        tabs = tables(cases, args)
        bar_lines, bar_short = bar_summary(cases, args)

        hdr = (f"fp16, B={args.batch}, H={C.heads_label(args)}, layout {args.layout}, dQ {args.dq_mode}; "
               f"TF = TFLOP/s")
        log("")
        log(f"== backward alone ({hdr} with 2.5 x 4*B*H*N^2*d, /2 causal; grad of a kept forward "
            f"graph, retain_graph=True); eff/X = t_efficient / t_X; bar = speed-bar row (ours >= "
            f"{BAR_THRESHOLD}x efficient); maxdiff = max |grad - grad_ours| ==")
        log(tabs["bwd"])
        log("")
        log(f"== forward + backward ({hdr} with 3.5 x 4*B*H*N^2*d, /2 causal); eff/X = "
            f"t_efficient / t_X; host ms = host time of one step, back to back, not synchronised "
            f"(a step whose host ms reaches its ms is bound by the host) ==")
        log(tabs["fwdbwd"])
        log("")
        mem_what = ("max_memory_allocated - allocated before: out, saved tensors, workspace, "
                    "gradients; inputs and grad_out excluded" if args.device == "cuda"
                    else "DRY RUN: bytes of the returned gradients, not a measurement")
        log(f"== peak extra memory of one fwd+bwd, MiB ({mem_what}) ==")
        log(tabs["mem"])
        C.log_problems(log, cases)
        log("")
        log(f"== speed bar: ours (dQ {dict(args.ours_variants).get('ours', '-')}) backward >= "
            f"{BAR_THRESHOLD}x SDPA memory-efficient backward ==")
        for line in bar_lines:
            log(line)

        result = C.sweep_result("bench_backward", args, env, runner)
        result.update({
            "dq": dq_info,
            "flop_convention": "fwd = 4*B*H*N^2*d (/2 causal); bwd = 2.5 x fwd; "
                               "fwd+bwd = 3.5 x fwd",
            "ratio_convention": "t_efficient / t_ours (> 1: ours faster)",
            "bar": {"threshold": BAR_THRESHOLD, "n": args.bar_n,
                    "cases": [{"d": d, "causal": cz} for d, cz in BAR_CASES],
                    "summary": bar_lines},
            "dry_run": args.dry_run,
            "cases": cases,
        })
        C.write_outputs(args, log, result, runner, lambda path: make_plot(path, cases, args, env))
        log("bar (bwd eff/ours >= 1.3x): " + "; ".join(bar_short))
    return C.exit_status("bench_backward", runner, cases, bool(args.ours_variants), "bwd_ms",
                         "our backward")


if __name__ == "__main__":
    sys.exit(main())
