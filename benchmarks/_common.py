"""Shared helpers for the benchmarks in this folder (timing, memory, environment, tables, JSON,
plots, the mma_peak ceiling). Import from a benchmark script with:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as C

Nothing here needs a GPU to import; every CUDA-only helper degrades to a CPU path or returns
None so the scripts can be exercised with `--dry-run` on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

# The headline of every benchmark is the plan a Turing GPU runs: launch decisions (the forward's
# tile choice, the decode kernel's key splits) made as on a T4 (csrc/kernels/launch_plan.h,
# DeviceProfile), whatever GPU executes them. FLASH_SM75_DEVICE_PROFILE=native in the
# environment plans for the GPU itself instead; env_info records which one ran.
os.environ.setdefault("FLASH_SM75_DEVICE_PROFILE", "t4")

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
MMA_PEAK_SRC = os.path.join(BENCH_DIR, "mma_peak.cu")
MMA_ARCH_FLAGS = ["-gencode", "arch=compute_75,code=[sm_75,compute_75]"]


def ensure_repo_on_path() -> None:
    """Make `import flash_attention_sm75` find the in-place build in the repo root."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)


# --------------------------------------------------------------------------------------------
# Our op
# --------------------------------------------------------------------------------------------

class Ours:
    """Handles to our forward op in BHSD layout.

    `bhsd(q, k, v, causal)` prefers the public `flash_attention_sm75.flash_attention_forward`
    (what users call); if the package does not export it yet, it falls back to the raw op
    `torch.ops.flash_attention_sm75.fwd` on the BSHD views. `op_bhsd` always calls the raw op,
    which lets the decode benchmark show the Python wrapper's overhead.
    """

    def __init__(self) -> None:
        self.error: Optional[str] = None
        self.entry: Optional[str] = None
        self.bhsd: Optional[Callable] = None
        self.op_bhsd: Optional[Callable] = None
        ensure_repo_on_path()
        try:
            import flash_attention_sm75 as pkg  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the build
            self.error = f"import flash_attention_sm75 failed: {type(e).__name__}: {e}"
            return
        op = None
        try:
            op = torch.ops.flash_attention_sm75.fwd
        except (AttributeError, RuntimeError):
            try:
                import flash_attention_sm75._C  # noqa: F401
                op = torch.ops.flash_attention_sm75.fwd
            except Exception as e:
                self.error = f"op flash_attention_sm75::fwd unavailable: {type(e).__name__}: {e}"
        if op is not None:
            def op_bhsd(q, k, v, causal=False, _op=op):
                out, _lse = _op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                is_causal=causal)
                return out.transpose(1, 2)
            self.op_bhsd = op_bhsd
        fn = getattr(pkg, "flash_attention_forward", None)
        if fn is None:
            try:
                from flash_attention_sm75 import interface as _iface  # type: ignore
                fn = getattr(_iface, "flash_attention_forward", None)
            except Exception:
                fn = None
        if fn is not None:
            def bhsd(q, k, v, causal=False, _fn=fn):
                out = _fn(q, k, v, causal=causal)
                return out[0] if isinstance(out, (tuple, list)) else out
            self.bhsd = bhsd
            self.entry = "flash_attention_sm75.flash_attention_forward"
        elif self.op_bhsd is not None:
            self.bhsd = self.op_bhsd
            self.entry = "torch.ops.flash_attention_sm75.fwd (flash_attention_forward not exported)"
        if self.bhsd is None and self.error is None:
            self.error = "neither flash_attention_forward nor the fwd op is available"

    @property
    def available(self) -> bool:
        return self.bhsd is not None


def kernel_name(d: int, causal: bool, direction: str = "fwd") -> str:
    """Benchmark case name = the kernel instantiation it exercises (csrc/kernels/instantiations):
    head dim d runs on its bucket's (head_dims.h), named with ``/d<d>`` when d is below it."""
    from flash_attention_sm75 import _rules
    bucket = _rules.head_dim_bucket(d) or d
    tail = "" if bucket == d else f"/d{d}"
    return f"flash_{direction}_hdim{bucket}_fp16{'_causal' if causal else ''}_sm75{tail}"


# --------------------------------------------------------------------------------------------
# torch SDPA baselines
# --------------------------------------------------------------------------------------------

def sdpa_backends() -> Dict[str, Any]:
    """name -> SDPBackend for the torch SDPA baselines (missing enum members are skipped)."""
    from torch.nn.attention import SDPBackend
    table = {
        "efficient": "EFFICIENT_ATTENTION",
        "flash": "FLASH_ATTENTION",
        "cudnn": "CUDNN_ATTENTION",
        "math": "MATH",
    }
    return {k: getattr(SDPBackend, v) for k, v in table.items() if hasattr(SDPBackend, v)}


def sdpa_context(backend) -> contextlib.AbstractContextManager:
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel([backend])


def sdpa_bhsd(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def triton_available() -> bool:
    try:
        import triton.testing  # noqa: F401
        return True
    except Exception:
        return False


def triton_usable() -> bool:
    """triton imports AND do_bench works on this GPU (probe once with a tiny kernel)."""
    if not (triton_available() and torch.cuda.is_available()):
        return False
    try:
        import triton.testing
        x = torch.zeros(1024, device="cuda")
        triton.testing.do_bench(lambda: x.add_(1), warmup=1, rep=2)
        return True
    except Exception as e:
        print(f"triton.testing.do_bench unusable ({type(e).__name__}: {e}); using CUDA events")
        return False


_L2_FLUSH: Optional[torch.Tensor] = None


def _l2_flush_buffer(device) -> torch.Tensor:
    global _L2_FLUSH
    if _L2_FLUSH is None or _L2_FLUSH.device != torch.device(device):
        _L2_FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
    return _L2_FLUSH


def bench_cuda_events(fn: Callable, warmup_ms: float = 25, rep_ms: float = 100,
                      min_reps: int = 5, max_reps: int = 1000) -> Dict[str, Any]:
    """Median of per-call CUDA-event times, L2 flushed (256 MiB memset) before every call,
    the same protocol as triton.testing.do_bench (used when triton is missing)."""
    flush = _l2_flush_buffer(torch.cuda.current_device())
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        flush.zero_()
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 3, 1e-3)
    n_warm = max(1, int(warmup_ms / est))
    n_rep = min(max_reps, max(min_reps, int(rep_ms / est)))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for i in range(n_rep):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return _summary(times, "cuda_events_l2flush")


def bench_triton(fn: Callable, warmup_ms: float = 25, rep_ms: float = 100) -> Dict[str, Any]:
    import triton.testing
    med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                            quantiles=[0.5, 0.2, 0.8])
    return {"ms": float(med), "p20_ms": float(p20), "p80_ms": float(p80), "n": None,
            "method": "triton.testing.do_bench(median, l2 flush)"}


def bench_cpu(fn: Callable, reps: int = 5) -> Dict[str, Any]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return _summary(sorted(times), "cpu_perf_counter")


def _summary(sorted_times: List[float], method: str) -> Dict[str, Any]:
    def q(p):
        idx = min(len(sorted_times) - 1, max(0, int(round(p * (len(sorted_times) - 1)))))
        return float(sorted_times[idx])
    return {"ms": float(statistics.median(sorted_times)), "p20_ms": q(0.2), "p80_ms": q(0.8),
            "n": len(sorted_times), "method": method}


def bench(fn: Callable, device: str, warmup_ms: float = 25, rep_ms: float = 100,
          use_triton: Optional[bool] = None, cpu_reps: int = 5) -> Dict[str, Any]:
    """Median time of fn() in ms (plus p20/p80). GPU: triton do_bench when importable, else CUDA
    events; both flush L2 before each call, so every case reads its inputs from HBM."""
    if device != "cuda":
        return bench_cpu(fn, cpu_reps)
    if use_triton is None:
        use_triton = triton_available()
    if use_triton:
        return bench_triton(fn, warmup_ms, rep_ms)
    return bench_cuda_events(fn, warmup_ms, rep_ms)


def host_ms_per_call(fn: Callable, device: str, calls: int = 30, trials: int = 3) -> float:
    """Host (CPU) time of one call of fn in ms: the median over `trials` of the mean
    ``time.perf_counter`` time of `calls` back-to-back calls, without a synchronisation between
    them (the kernels queue; `calls` is far below the launch queue's depth, so no call waits
    for the GPU). A call whose host time reaches its GPU time is bound by the host: its
    measured time is then the host's, whatever the kernels do (benchmarks/NOTES.md, session
    25: a forward + backward at N = 1024 was)."""
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ts = []
    for _ in range(trials):
        sync()
        total = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        ts.append(total / calls * 1e3)
    sync()
    return float(statistics.median(ts))


def bench_launch_loop(fn: Callable, device: str, calls: int = 200, trials: int = 5) -> float:
    """Per-call ms of `calls` back-to-back calls (no sync, no flush): bounded below by the GPU time
    and by the host-side cost of one call, so it exposes Python/dispatch overhead on tiny shapes."""
    fn()
    if device != "cuda":
        ts = []
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            ts.append((time.perf_counter() - t0) * 1e3 / calls)
        return float(statistics.median(ts))
    torch.cuda.synchronize()
    ts = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / calls)
    return float(statistics.median(ts))


def peak_extra_memory(fn: Callable, device: str) -> Optional[int]:
    """Bytes allocated at peak during fn() above what was allocated before it (inputs excluded,
    the output and any workspace included). None on CPU."""
    if device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def is_oom(e: BaseException) -> bool:
    oom_t = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_t is not None and isinstance(e, oom_t)) or "out of memory" in str(e).lower()


def cuda_context_ok() -> bool:
    """False after a sticky CUDA error (e.g. illegal address): nothing more can run."""
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def bwd_problem(batch: int, heads: int, n: int, d: int, causal: bool, device: str = "cuda"):
    """One backward problem for the kernel-tuning script (scripts/tune_bwd.py): fp16 BSHD
    (batch, n, heads, d) q, k, v, dout from a CPU generator seeded with n + causal,
    softmax_scale = d**-0.5, the library's forward op's (out, lse) and its backward op's
    (dq, dk, dv) as ``ref`` (bottom-right causal, deterministic). Returns a dict with those keys
    plus ``scale``. Imports flash_attention_sm75 (its ops)."""
    ensure_repo_on_path()
    import flash_attention_sm75  # noqa: F401  (registers torch.ops.flash_attention_sm75)
    g = torch.Generator(device="cpu").manual_seed(n + causal)
    q, k, v, dout = (torch.randn(batch, n, heads, d, generator=g).to(device, torch.float16)
                     for _ in range(4))
    scale = d ** -0.5
    out, lse = torch.ops.flash_attention_sm75.fwd(q, k, v, scale, causal, True)
    ref = torch.ops.flash_attention_sm75.bwd(dout, q, k, v, out, lse, scale, causal, True, None,
                                             None, True)
    return dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, scale=scale, ref=ref)


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs as FlashAttention's benchmarks count them: 4*b*h*sq*sk*d (two GEMMs),
    halved for causal (the exact visible fraction for sq == sk is (n+1)/(2n))."""
    f = 4.0 * b * h * sq * sk * d
    return f / 2 if causal else f


def tflops(flop: float, ms: Optional[float]) -> Optional[float]:
    if ms is None or ms <= 0:
        return None
    return flop / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

def _run(cmd: Sequence[str], timeout: float = 20, cwd: Optional[str] = None) -> Optional[str]:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except Exception:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


NVSMI_FIELDS = ["name", "driver_version", "pci.bus_id", "clocks.sm", "clocks.max.sm",
                "clocks.mem", "clocks.max.mem", "clocks.applications.graphics", "power.draw",
                "power.limit", "temperature.gpu", "persistence_mode"]


def nvidia_smi_query() -> Optional[List[Dict[str, str]]]:
    """One dict per GPU from nvidia-smi --query-gpu; drops fields this driver does not know."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    fields = list(NVSMI_FIELDS)
    for _ in range(2):
        out = _run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
        if out is not None:
            rows = []
            for line in out.splitlines():
                vals = [v.strip() for v in line.split(",")]
                if len(vals) == len(fields):
                    rows.append(dict(zip(fields, vals)))
            return rows
        fields = ["name", "driver_version", "clocks.sm", "clocks.max.sm"]
    return None


def git_info() -> Dict[str, Any]:
    """Commit of the checkout and where it came from. FA_SM75_COMMIT, when set, wins: the GPU
    machine gets a copy of the working tree whose .git (if any) is stale, so `git rev-parse HEAD`
    there names an old commit."""
    env_commit = os.environ.get("FA_SM75_COMMIT")
    commit = env_commit or _run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    info = {"commit": commit, "dirty": (bool(status) if status is not None else None),
            "commit_source": ("$FA_SM75_COMMIT" if env_commit
                              else "git rev-parse HEAD" if commit else None)}
    if env_commit:
        info["fa_sm75_commit_env"] = env_commit
    return info


def package_version() -> Optional[str]:
    """flash_attention_sm75.__version__, or None when the package does not import."""
    try:
        import flash_attention_sm75
        return getattr(flash_attention_sm75, "__version__", None)
    except Exception:
        return None


def env_info(device: str) -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": (torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
        "device": device,
        "git": git_info(),
        "plan_profile": os.environ.get("FLASH_SM75_DEVICE_PROFILE") or "native",
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    nvcc = find_nvcc()
    info["nvcc"] = nvcc
    if nvcc:
        v = _run([nvcc, "--version"])
        m = re.search(r"release ([0-9.]+)", v or "")
        info["nvcc_version"] = m.group(1) if m else None
    if device == "cuda" and torch.cuda.is_available():
        idx = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        info["gpu"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "total_memory_gib": round(p.total_memory / 2**30, 2),
            "l2_cache_mib": (round(getattr(p, "L2_cache_size", 0) / 2**20, 1)
                             if getattr(p, "L2_cache_size", None) else None),
        }
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    else:
        info["gpu"] = None
    info["nvidia_smi"] = nvidia_smi_query()
    return info


# --------------------------------------------------------------------------------------------
# mma_peak (SM75-instruction ceiling)
# --------------------------------------------------------------------------------------------

def find_nvcc() -> Optional[str]:
    exe = shutil.which("nvcc")
    if exe:
        return exe
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:
        CUDA_HOME = None
    for root in filter(None, [os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"]):
        cand = os.path.join(root, "bin", "nvcc")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def build_mma_peak(cache_dir: str, log: Callable[[str], None] = print) -> Optional[str]:
    """Compile benchmarks/mma_peak.cu for sm_75 (+compute_75 PTX) into cache_dir; reuse the
    binary when it is newer than the source. Returns the binary path or None."""
    os.makedirs(cache_dir, exist_ok=True)
    binary = os.path.join(cache_dir, "mma_peak")
    if (os.path.isfile(binary) and os.path.getmtime(binary) >= os.path.getmtime(MMA_PEAK_SRC)):
        return binary
    nvcc = find_nvcc()
    if nvcc is None:
        log("mma_peak: nvcc not found; SM75 ceiling unavailable")
        return None
    cmd = [nvcc, "-O3", *MMA_ARCH_FLAGS, "-o", binary, MMA_PEAK_SRC]
    log("mma_peak: " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except Exception as e:
        log(f"mma_peak: build failed: {e}")
        return None
    if r.returncode != 0:
        log(f"mma_peak: build failed (rc={r.returncode}):\n{r.stdout}{r.stderr}")
        return None
    return binary


def run_mma_peak(binary: str, quick: bool = False, log: Callable[[str], None] = print,
                 timeout: float = 240) -> Optional[Dict[str, Any]]:
    """Run the mma_peak binary; returns its MMA_PEAK_JSON dict plus the raw output, or None."""
    dev = os.environ.get("CUDA_VISIBLE_DEVICES")
    cmd = [binary] + (["--quick"] if quick else [])
    if torch.cuda.is_available():
        cmd += ["--device", str(torch.cuda.current_device())]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except Exception as e:
        log(f"mma_peak: run failed: {e}")
        return None
    text = (r.stdout or "") + (r.stderr or "")
    for line in text.splitlines():
        log("  " + line)
    if r.returncode != 0:
        log(f"mma_peak: exited with {r.returncode} (CUDA_VISIBLE_DEVICES={dev})")
        return None
    for line in reversed(text.splitlines()):
        if line.startswith("MMA_PEAK_JSON "):
            try:
                res = json.loads(line[len("MMA_PEAK_JSON "):])
            except json.JSONDecodeError:
                break
            res["raw_output"] = r.stdout
            return res
    log("mma_peak: no MMA_PEAK_JSON line in output")
    return None


# --------------------------------------------------------------------------------------------
# Output: tables, JSON, plots
# --------------------------------------------------------------------------------------------

def fmt(x: Any, spec: str = ".2f", missing: str = "-") -> str:
    if x is None:
        return missing
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return missing if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
                 left: Iterable[int] = (0,)) -> str:
    """Plain-text table, columns aligned; columns whose index is in `left` are left-aligned,
    the rest right-aligned. Cells are str()-ed (None -> '-')."""
    left = set(left)
    srows = [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in srows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(cells):
        return "  ".join(c.ljust(widths[i]) if i in left else c.rjust(widths[i])
                         for i, c in enumerate(cells)).rstrip()
    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in srows]
    return "\n".join(out)


def _json_default(o):
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _finite(o: Any) -> Any:
    """NaN/inf -> None so the file is strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(obj), f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


# Fixed colours/markers so the same backend looks the same in every plot.
SERIES_STYLE = {
    "ours": dict(color="tab:red", marker="o", linewidth=2.2),
    "ours_op": dict(color="tab:pink", marker="o", linestyle=":"),
    "efficient": dict(color="tab:blue", marker="s"),
    "flash": dict(color="tab:green", marker="^"),
    "cudnn": dict(color="tab:purple", marker="v"),
    "math": dict(color="tab:gray", marker="x"),
    "mem_eff_sm75": dict(color="tab:cyan", marker="s", linestyle="--"),
}


def plot_panels(path: str, panels: List[Dict[str, Any]], ncols: int, suptitle: str = "",
                panel_size=(5.0, 3.8)) -> Optional[str]:
    """Grid of line plots. Each panel: {"title", "x" (list), "series": {name: [y or None]},
    "xlabel", "ylabel", "logx2" (bool, log2 x axis), "logy" (bool), "ymin0" (bool, y from 0),
    "hline": (y, label)|None}.
    Missing points (None) are skipped. Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"plot skipped: matplotlib unavailable ({e})")
        return None
    n = max(1, len(panels))
    ncols = max(1, min(ncols, n))
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows),
                             squeeze=False)
    for i, p in enumerate(panels):
        ax = axes[i // ncols][i % ncols]
        xs = p["x"]
        for name, ys in p["series"].items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None and not
                   (isinstance(y, float) and math.isnan(y))]
            if not pts:
                continue
            style = dict(SERIES_STYLE.get(name, {}))
            style.setdefault("marker", ".")
            ax.plot([a for a, _ in pts], [b for _, b in pts], label=name, markersize=4, **style)
        if p.get("hline"):
            y, label = p["hline"]
            if y is not None:
                ax.axhline(y, color="black", linestyle="--", linewidth=1, label=label)
        if p.get("logx2"):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs], fontsize=7)
        if p.get("logy"):
            ax.set_yscale("log")
        elif p.get("ymin0"):
            ax.set_ylim(bottom=0)
        ax.set_title(p.get("title", ""), fontsize=9)
        ax.set_xlabel(p.get("xlabel", ""), fontsize=8)
        ax.set_ylabel(p.get("ylabel", ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for j in range(n, nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@contextlib.contextmanager
def report(path: str):
    """A log function for the block: each line goes to stdout and to the text report at `path`
    (written as the run goes, so a killed run keeps what it printed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    logger = logging.getLogger("benchmarks.report")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handlers = [logging.StreamHandler(sys.stdout), logging.FileHandler(path, mode="w")]
    for h in handlers:
        h.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(h)
    try:
        yield logger.info
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()


# ---------------------------------------------------------------------------------------------
# Command line shared by the sweep benchmarks (bench_forward.py, bench_backward.py)


# Heads of the models each head dim comes from when --heads is not given: Phi-2 (d = 80, 32
# heads), Phi-3-mini (96, 32), Gemma-2-2B (256, 8); 16 for the rest.
MODEL_HEADS = {80: 32, 96: 32, 256: 8}


def default_head_dims() -> List[int]:
    """64 and 128, then the model head dims of MODEL_HEADS that the kernels take."""
    from flash_attention_sm75 import _rules
    return [64, 128] + [d for d in MODEL_HEADS if d in _rules.HEAD_DIMS]


def heads_for(a, d: int) -> int:
    """Heads of a case at head dim d: --heads, else the model's (MODEL_HEADS), else 16."""
    return a.heads if getattr(a, "heads_given", True) else MODEL_HEADS.get(d, a.heads)


def heads_label(a) -> str:
    """The heads of a sweep for a table header: one number, or per head dim."""
    hs = {d: heads_for(a, d) for d in a.d}
    if len(set(hs.values())) == 1:
        return str(next(iter(hs.values())))
    return " ".join(f"{h} (d={d})" for d, h in hs.items())


def add_sweep_args(p, backends, n_default_help, tag):
    """Options every sweep benchmark has: shapes, causal, backends, output, timing."""
    ensure_repo_on_path()
    from devtools.cli import positive_int

    p.add_argument("--d", type=int, nargs="+", default=None,
                   help="head dims (default 64 128 and the model dims 80 96 256)")
    p.add_argument("--n", type=positive_int, nargs="+", default=None,
                   help=f"sequence lengths, Sq = Sk (default {n_default_help})")
    p.add_argument("--causal", choices=["off", "on", "both"], default="both")
    p.add_argument("--batch", type=positive_int, default=None, help="batch size (default 4)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="heads (default: 16; 32 at d = 80 and 96, 8 at d = 256, as the models)")
    import _memeff_sm75
    import _peer

    # The peer and the baseline only when asked: a sticky CUDA error in their kernels would end
    # the whole sweep.
    p.add_argument("--backends", default=",".join(backends),
                   help=f"comma list from {list(backends) + list(optional_backends())} (default: "
                        f"{','.join(backends)}; {_peer.NAME}: the SM75 peer "
                        f"ssiu/flash-attention-turing from the build scripts/build_peer.py "
                        f"makes, benchmarks/_peer.py; {_memeff_sm75.NAME}: torch's mem-efficient "
                        f"kernels as a T4 runs them (Sm75 instantiations, compute_75 PTX) from "
                        f"the build scripts/build_memeff_sm75.py makes, benchmarks/_memeff_sm75.py, "
                        f"checked against SDPA before it is timed)")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--tag", default=tag, help="output file name stem")
    p.add_argument("--warmup-ms", type=float, default=None)
    p.add_argument("--rep-ms", type=float, default=None)
    p.add_argument("--no-triton", action="store_true", help="time with CUDA events, not do_bench")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def finish_sweep_args(p, a, backends, n_full, timing_full, timing_quick=(10, 40)):
    """Fill the defaults left unset (after a script's own --dry-run defaults) and validate.

    Without ``--device`` the device is CUDA; without CUDA that is an error (``p.error``, exit
    status 2) unless the script set ``a.device`` already (``--dry-run``, ``--device cpu``).

    ``timing_*`` are (warmup_ms, rep_ms); ``--quick`` uses N = 1024, 4096 and ``timing_quick``.
    """
    import torch

    if a.device is None:
        # No silent switch to the CPU: the full sweep there runs for hours and gets OOM-killed.
        if not torch.cuda.is_available():
            p.error("CUDA is not available (torch.cuda.is_available() is False); this benchmark "
                    "times GPU kernels. Use --dry-run (tiny shapes on the CPU, exercises every "
                    "code path) or --device cpu (the same tiny default shapes, numbers are "
                    "meaningless)")
        a.device = "cuda"
    a.d = a.d or default_head_dims()
    a.n = a.n or ([1024, 4096] if a.quick else list(n_full))
    a.batch = a.batch or 4
    a.heads_given = a.heads is not None
    a.heads = a.heads or 16
    warmup, rep = timing_quick if a.quick else timing_full
    a.warmup_ms = a.warmup_ms if a.warmup_ms is not None else warmup
    a.rep_ms = a.rep_ms if a.rep_ms is not None else rep
    a.causal_list = {"off": [False], "on": [True], "both": [False, True]}[a.causal]
    a.backend_list = [b.strip() for b in a.backends.split(",") if b.strip()]
    allowed = list(backends) + list(optional_backends())
    bad = [b for b in a.backend_list if b not in allowed]
    if bad:
        p.error(f"unknown backends {bad}; choose from {allowed}")
    from flash_attention_sm75 import _rules
    for dd in a.d:
        if dd not in _rules.HEAD_DIMS:
            p.error(f"our kernel supports d a multiple of 8 from 8 to {_rules.MAX_HEAD_DIM}, got {dd}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False (use --dry-run)")


def optional_backends():
    """The backends a sweep runs only when --backends names them: name -> loader module
    (benchmarks/_peer.py, benchmarks/_memeff_sm75.py)."""
    import _memeff_sm75
    import _peer

    return {_peer.NAME: _peer, _memeff_sm75.NAME: _memeff_sm75}


# Backends checked against torch SDPA on each case's inputs before they are timed; one that
# disagrees or raises is dropped from the rest of the run (SweepRunner.gate).
GATED_BACKENDS = ("mem_eff_sm75",)


DRY_RUN_SIZES = {"d": [64, 128], "n": [64, 128, 256], "batch": 1, "heads": 2}


def add_device_args(p, cpu_help, dry_run_help):
    """--device and --dry-run; the help ends with what the script does in each."""
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default cuda; without CUDA the script stops unless --device cpu or "
                        "--dry-run is given. " + cpu_help)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: " + dry_run_help)


def use_dry_run_sizes(a):
    """The tiny CPU sizes (DRY_RUN_SIZES) for the options the command line left unset."""
    for name, value in DRY_RUN_SIZES.items():
        if getattr(a, name) is None:
            setattr(a, name, list(value) if isinstance(value, list) else value)


# ---------------------------------------------------------------------------------------------
# Runner, tables and outputs shared by the sweep benchmarks


def fmt_tf(x):
    """TFLOP/s cell: one decimal from 10 up, three significant digits below."""
    return fmt(x, ".1f" if (x is None or x >= 10) else ".3g")


def fmt_ratio(r):
    return fmt(r, ".2f") + ("x" if r is not None else "")


def mib(x):
    return None if x is None else x / 2**20


def ratio(case, num, den, key="ms"):
    """case's t_num / t_den for the timing `key` of two backends, or None."""
    tn = case["backends"].get(num, {}).get(key)
    td = case["backends"].get(den, {}).get(key)
    return None if not tn or not td else tn / td


class SweepRunner:
    """Runs the backends of a sweep benchmark: our op, the torch SDPA backends, the timing method
    and what a backend that raises leaves behind (OOM, an error, a broken CUDA context).

    A script subclasses it with `impl(...)` (-> (fn(q, k, v, causal), context-manager factory,
    note) or (None, None, reason)), `new_case(d, causal, n)` (the case's own fields),
    `make_inputs(case)`, `run_case(case, inputs)` and `progress(case)` (its log line)."""

    def __init__(self, args, log):
        self.t_start = time.time()
        self.a = args
        self.log = log
        self.ours = Ours()
        self.sdpa = sdpa_backends()
        self.stand_in: Dict[str, Any] = {}  # backend name -> SDPBackend run in its place
        self.dropped: Dict[str, str] = {}  # gated backend -> why it left the run
        self.context_broken = False
        self.use_triton = (not args.no_triton) and args.device == "cuda" and triton_usable()

    @property
    def timing_method(self) -> str:
        if self.a.device != "cuda":
            return "cpu"
        return "triton.testing.do_bench" if self.use_triton else "cuda_events"

    def sdpa_impl(self, name):
        """impl() of a torch SDPA backend (or of the backend standing in for it)."""
        if name in self.stand_in:
            be = self.stand_in[name]
            return sdpa_bhsd, (lambda be=be: sdpa_context(be)), \
                f"dry-run stand-in: SDPBackend.{be.name} (no {name} kernel on CPU)"
        if name not in self.sdpa:
            return None, None, f"SDPBackend for {name} not in this torch"
        be = self.sdpa[name]
        return sdpa_bhsd, (lambda be=be: sdpa_context(be)), None

    def optional_impl(self, name, autograd=False):
        """impl() of an optional backend (optional_backends(): the SM75 peer, benchmarks/_peer.py,
        or torch's mem-efficient kernels as a T4 runs them, benchmarks/_memeff_sm75.py): its
        forward, or (``autograd``) its forward and backward behind torch.autograd."""
        module = optional_backends()[name]
        backend = module.load()
        if not backend.available:
            return None, None, backend.error
        if self.a.device != "cuda":
            return None, None, f"the {module.KIND} runs on CUDA only"
        fn = backend.autograd_bhsd() if autograd else backend.bhsd
        return fn, contextlib.nullcontext, backend.impl_note()

    def gate(self, name, impl_args, q, k, v, causal, do=None):
        """None when backend `name` may be timed on these inputs, else its record's status.

        A backend of GATED_BACKENDS is first compared with torch SDPA on the same inputs
        (_memeff_sm75.check_against_sdpa: the output, and with `do` the input gradients); if it
        disagrees or raises it is dropped, with the reason logged, for the rest of the run, so a
        broken baseline never produces numbers. A backend that is unavailable is left to
        prepare(), which records why."""
        if name not in GATED_BACKENDS:
            return None
        if name in self.dropped:
            return f"dropped: {self.dropped[name]}"
        if self.context_broken:
            return None  # prepare() records the skip
        fn, ctx_factory, _ = self.impl(*impl_args)
        if fn is None:
            return None
        import _memeff_sm75

        with ctx_factory():
            problem = _memeff_sm75.check_against_sdpa(fn, q, k, v, causal, do)
        self.sync()
        if problem is None:
            return None
        reason = f"disagrees with torch SDPA on the first check ({problem})"
        if self.a.device == "cuda" and not cuda_context_ok():
            self.context_broken = True
            reason += "; CUDA context broken"
        self.dropped[name] = reason
        self.log(f"  !! {name} dropped from the run: {reason}")
        return f"dropped: {reason}"

    def sync(self):
        if self.a.device == "cuda":
            torch.cuda.synchronize()

    def prepare(self, rec, *impl_args):
        """(fn, context-manager factory) from impl(*impl_args), or None with rec["status"]
        saying why the backend does not run."""
        fn, ctx_factory, note = self.impl(*impl_args)
        if fn is None:
            rec["status"] = f"unavailable: {note}"
            return None
        if note:
            rec["note"] = note
        if self.context_broken:
            rec["status"] = "skipped: CUDA context broken by an earlier error"
            return None
        return fn, ctx_factory

    def failed(self, rec, name, e, where=""):
        """From an except block: the exception in rec["status"] ("oom: ..." or "error: ...");
        after a sticky CUDA error the rest of the run is skipped, else the cache is emptied."""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        msg = f"{type(e).__name__}{where}: {first}"
        rec["status"] = ("oom: " if is_oom(e) else "error: ") + msg[:300]
        if self.a.device == "cuda":
            if not cuda_context_ok():
                self.context_broken = True
                self.log(f"  !! CUDA context broken after {name}: {msg}")
                self.log(traceback.format_exc())
            else:
                torch.cuda.empty_cache()

    def sweep(self):
        """Every (d, causal, N) case of the command line: inputs made, run_case, a log line."""
        cases = []
        a = self.a
        for d in a.d:
            for causal in a.causal_list:
                for n in a.n:
                    case = {"kernel": self.case_name(d, causal), "d": d, "causal": causal,
                            "n": n, "batch": a.batch, "heads": heads_for(a, d),
                            **self.new_case(d, causal, n), "backends": {}}
                    t0 = time.time()
                    try:
                        inputs = self.make_inputs(case)
                    except Exception as e:
                        case["error"] = f"input allocation failed: {type(e).__name__}: {e}"
                        self.log(f"[{case['kernel']} N={n}] {case['error']}")
                        cases.append(case)
                        continue
                    self.run_case(case, inputs)
                    del inputs
                    if a.device == "cuda":
                        torch.cuda.empty_cache()
                    case["wall_s"] = round(time.time() - t0, 2)
                    self.log(f"[{case['kernel']} N={n}] {self.progress(case)}  "
                             f"({case['wall_s']} s)")
                    cases.append(case)
        return cases


def log_header(log, args, env, runner, ours_note="", notes=()):
    """The report's opening lines: environment and commit, our entry point (+ ours_note), the
    script's `notes`, the timing method, the nvidia-smi state."""
    git = env["git"]
    log(f"device={args.device} gpu={(env.get('gpu') or {}).get('name')} torch={env['torch']} "
        f"cuda={env['torch_cuda']} triton={env['triton']} commit={git.get('commit')} "
        f"({git.get('commit_source')})")
    log(f"ours: {runner.ours.entry or 'UNAVAILABLE: ' + str(runner.ours.error)}{ours_note}")
    peer = peer_info(args)
    if peer is not None:
        log("peer ssiu: " + (f"UNAVAILABLE: {peer['error']}" if peer["error"] else
                             f"{peer.get('repo')} commit {peer.get('commit')} (cutlass "
                             f"{peer.get('cutlass_commit')}, built with torch {peer.get('torch')}, "
                             f"{peer.get('arch_list')})"))
    base = baseline_info(args)
    if base is not None:
        import _memeff_sm75

        log(f"baseline {_memeff_sm75.NAME}: " + _memeff_sm75.load().describe())
    for line in notes:
        log(line)
    if args.device == "cuda":
        log(f"timing: {'triton.testing.do_bench' if runner.use_triton else 'CUDA events'} median, "
            f"warmup {args.warmup_ms} ms, rep {args.rep_ms} ms, L2 flushed before each call")
    else:
        log("timing: CPU perf_counter median (dry run: numbers are meaningless)")
        for name, be in runner.stand_in.items():
            log(f"dry run: SDPBackend.{be.name} stands in for '{name}' (no CPU kernel)")
    for g in env.get("nvidia_smi") or []:
        log("nvidia-smi: " + ", ".join(f"{k}={v}" for k, v in g.items()))


def log_problems(log, cases):
    """The backends that did not run (their cells show '-') and the cases without inputs; the
    math backend's deliberate skips above --math-max-n are left out."""
    problems = sorted({f"{n}: {r['status']}" for c in cases for n, r in c["backends"].items()
                       if r.get("status", "ok") != "ok"
                       and not r["status"].startswith("skipped: N >")})
    problems += [f"{c['kernel']} N={c['n']}: {c['error']}" for c in cases if c.get("error")]
    if problems:
        log("")
        log("== backends that did not run (shown as '-') ==")
        for p in problems[:40]:
            log("  " + p)


def sweep_groups(cases, args):
    """(d, causal, cases of that pair sorted by N, their Ns) for each plot panel, in the
    command line's order; pairs without cases are left out."""
    for d in args.d:
        for causal in args.causal_list:
            sel = sorted([c for c in cases if c["d"] == d and c["causal"] == causal],
                         key=lambda c: c["n"])
            if sel:
                yield d, causal, sel, [c["n"] for c in sel]


def has_data(panels):
    """Whether any panel has a point to draw (CPU runs have no allocator statistics)."""
    return any(y is not None for p in panels for ys in p["series"].values() for y in ys)


def plot_title(what, env, *extra):
    """Plot title: what ran on which GPU, torch version, commit, then `extra` fields."""
    gpu = (env.get("gpu") or {}).get("name") or env.get("device")
    fields = [f"torch {env['torch']}", f"commit {(env['git'].get('commit') or '?')[:10]}", *extra]
    return f"flash_attention_sm75 {what} vs torch SDPA on {gpu}  ({', '.join(fields)})"


def sweep_result(benchmark, args, env, runner):
    """The JSON record's common head: arguments, environment, versions, commit, our entry."""
    return {
        "benchmark": benchmark,
        "args": dict(vars(args)),
        "env": env,
        "gpu_name": (env.get("gpu") or {}).get("name"),
        "versions": {"torch": env["torch"], "cuda": env["torch_cuda"], "cudnn": env["cudnn"],
                     "triton": env["triton"], "python": env["python"],
                     "flash_attention_sm75": package_version()},
        "commit": env["git"].get("commit"),
        "ours_entry": runner.ours.entry,
        "ours_error": runner.ours.error,
        "peer": peer_info(args),
        "mem_eff_sm75": baseline_info(args, runner),
        "timing_method": runner.timing_method,
    }


def peer_info(args):
    """What the peer backend ran (its build's PEER_INFO.json: repo, commit, cutlass commit,
    torch), or None when the run did not ask for it."""
    import _peer

    if _peer.NAME not in getattr(args, "backend_list", ()):
        return None
    peer = _peer.load()
    return dict(peer.info, error=peer.error)


def baseline_info(args, runner=None):
    """What the mem_eff_sm75 baseline ran (its build's BASELINE_INFO.json: torch, cutlass
    commit, kernels per head dim) and, with the runner, whether the check against SDPA dropped
    it; None when the run did not ask for it."""
    import _memeff_sm75

    if _memeff_sm75.NAME not in getattr(args, "backend_list", ()):
        return None
    base = _memeff_sm75.load()
    info = dict(base.info, error=base.error)
    if runner is not None:
        info["dropped"] = runner.dropped.get(_memeff_sm75.NAME)
    return info


def report_path(args) -> str:
    return os.path.join(args.out_dir, f"{args.tag}.txt")


def write_outputs(args, log, result, runner, make_plot):
    """<tag>.json (result + the nvidia-smi state after the run, the broken-context flag, the wall
    time), <tag>.png from make_plot(path) unless --no-plot, and the "wrote ..." line."""
    result["env"]["nvidia_smi_after"] = nvidia_smi_query() if args.device == "cuda" else None
    result["cuda_context_broken"] = runner.context_broken
    result["wall_s"] = round(time.time() - runner.t_start, 1)
    json_path = os.path.join(args.out_dir, f"{args.tag}.json")
    write_json(json_path, result)
    png = None if args.no_plot else make_plot(os.path.join(args.out_dir, f"{args.tag}.png"))
    log("")
    log(f"wrote {json_path}" + (f", {png}" if png else "") + f", {report_path(args)}  "
        f"({result['wall_s']} s)")


def exit_status(script, runner, cases, wanted, key, what):
    """1 when our op was asked for (`wanted`) and never produced a `key` timing (so gpu_suite
    flags the step), 2 when a CUDA error broke the context, else 0."""
    if wanted and cases and not any(c["backends"].get("ours", {}).get(key) is not None
                                    for c in cases):
        print(f"{script}: {what} produced no timing", file=sys.stderr)
        return 1
    return 2 if runner.context_broken else 0


# ------------------------------------------------------------ one-table benchmark scripts
def speedup(ours, other):
    """``other / ours`` (how many times faster ours is), None if either time is missing."""
    return None if ours is None or other is None else other / ours


def fmt_speedup(ours, other) -> str:
    return fmt(speedup(ours, other), ".2f") + "x"


def sdpa_fwd_bwd(backend, q, k, v, do, warmup_ms, rep_ms, backward=True, **sdpa_kwargs):
    """Milliseconds of torch SDPA's forward and (with ``backward``) backward on ``backend`` for
    BHSD ``q, k, v`` (``do``: the output gradient), timed as :func:`bench` times; ``(None,
    None)`` where torch raises (out of memory, no kernel: printed)."""
    fwd = bwd = None
    F = torch.nn.functional
    try:
        with sdpa_context(backend):
            fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs), "cuda",
                        warmup_ms, rep_ms)["ms"]
            if backward:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                o = F.scaled_dot_product_attention(qg, kg, vg, **sdpa_kwargs)
                bwd = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True),
                            "cuda", warmup_ms, rep_ms)["ms"]
                del o, qg, kg, vg
    except RuntimeError as e:
        print(f"SDPA ({backend}) failed: {str(e)[:200]}")
    return fwd, bwd


def add_table_bench_args(ap, d, n, tag):
    """The arguments every one-table benchmark (bench_window.py, bench_scoremod.py) takes."""
    ap.add_argument("--d", type=int, nargs="+", default=d)
    ap.add_argument("--n", type=int, nargs="+", default=n)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--tag", default=tag)
    ap.add_argument("--warmup-ms", type=float, default=10)
    ap.add_argument("--rep-ms", type=float, default=40)


def table_problems(args):
    """The problems of a one-table benchmark: ``(d, n, generator, q, k, v, do)`` for every
    head dim and length of ``args``, BSHD fp16 CUDA tensors of (batch, n, heads, d), seeded per
    problem (the generator continues for what the benchmark draws next)."""
    for d in args.d:
        for n in args.n:
            g = torch.Generator().manual_seed(n + d)
            q, k, v, do = (torch.randn(args.batch, n, args.heads, d, generator=g)
                           .to("cuda", torch.float16) for _ in range(4))
            yield d, n, g, q, k, v, do


def fwd_bwd_times(fn, q, k, v, dout, bench, backward=True, extra=()):
    """``(forward ms, backward ms or None)`` of ``fn(q, k, v, *extra)`` timed by ``bench``; the
    backward is ``torch.autograd.grad`` of one recorded forward (with ``dout``), retained between
    runs, with respect to q, k, v and the ``extra`` tensors (e.g. a bias whose gradient is
    wanted)."""
    fwd = bench(lambda: fn(q, k, v, *extra))
    if not backward:
        return fwd, None
    leaves = [t.detach().requires_grad_() for t in (q, k, v, *extra)]
    o = fn(*leaves)
    return fwd, bench(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))


def table_bench_setup(script):
    """The GPU check, the op and torch's efficient backend of a one-table benchmark: ``(fwd op,
    bwd op, efficient backend, env_info)``, or None (message printed) without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU")
        return None
    ensure_repo_on_path()
    import flash_attention_sm75  # noqa: F401  (registers torch.ops.flash_attention_sm75)
    ops = torch.ops.flash_attention_sm75
    return ops.fwd, ops.bwd, sdpa_backends()["efficient"], env_info("cuda")


def write_table_bench(args, env, script, head, headers, rows, records, left=(0,)):
    """<out-dir>/<tag>.txt (the GPU, torch, commit and the table) and .json; prints the text."""
    table = format_table(headers, rows, left=left)
    gpu = (env.get("gpu") or {}).get("name")
    text = (f"gpu={gpu} torch={env['torch']} commit={env['git'].get('commit')} ({script})"
            f"\n\n== {head} ==\n{table}\n")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, args.tag + ".txt"), "w") as f:
        f.write(text)
    write_json(os.path.join(args.out_dir, args.tag + ".json"), dict(env=env, results=records))
    print(text)
