#!/usr/bin/env python3
"""Check that every kernel instantiation fits the Turing (sm_75) limits, without a GPU.

Compiles each csrc/kernels/instantiations/*.cu for sm_75 with ``ptxas -v``, parses the resource
usage of every kernel and prints a table (kernel, registers, spill stores/loads, stack frame,
static shared memory). Fails (exit 1) when any kernel or device function spills to local
memory, uses more than 255 registers, or declares more than 64 KiB of static shared memory, when
a file does not compile, or when the generated instantiations are stale
(``csrc/kernels/generate_kernels.py --check``).

Dynamic shared memory is not visible to ptxas; its budget is enforced at compile time by the
``static_assert(kSmemSize <= kSm75MaxSmemPerBlock)`` in csrc/kernels/*kernel_traits.h, which this
compile also runs. With ``--json`` each kernel also gets the threads and dynamic shared memory
per CTA it is launched with, read from the traits by scripts/launch_shapes.cu (a host program
built with the same nvcc), so that the JSON holds everything an occupancy calculation needs
(benchmarks/t4_model.py: CTAs per Turing SM).

    python scripts/check_sm75.py                  # all instantiations
    python scripts/check_sm75.py --json out.json  # also write the table as JSON
    python scripts/check_sm75.py csrc/kernels/instantiations/flash_fwd_hdim128_fp16_sm75.cu
    python scripts/check_sm75.py --proxy sm_90    # also what an H100 / H200 JIT-compiles

``--proxy ARCH`` also compiles the same compute_75 PTX for ARCH, as the driver does when a GPU
newer than Turing runs the build (the H100 / H200 stand-in of the benchmarks), and adds its
registers and spills as columns: informational, never a failure. The stand-in runs that code,
not the sm_75 code, so its register allocation (and where it spills: a spill outside the key
loop costs nothing) can differ from a T4's.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTANTIATIONS = ROOT / "csrc" / "kernels" / "instantiations"
LAUNCH_SHAPES = ROOT / "scripts" / "launch_shapes.cu"
GENERATOR = ROOT / "csrc" / "kernels" / "generate_kernels.py"

SM75_MAX_REGISTERS = 255
SM75_MAX_SMEM_PER_BLOCK = 64 * 1024
NVCC_FLAGS = [
    "-gencode", "arch=compute_75,code=sm_75",
    "-Xptxas", "-v",
    "-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-std=c++17",
]

RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
RE_PROPS = re.compile(r"Function properties for (\S+)")
RE_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
RE_USED = re.compile(r"Used (\d+) registers")
RE_SMEM = re.compile(r"(\d+) bytes smem")
RE_CMEM0 = re.compile(r"(\d+) bytes cmem\[0\]")
RE_BARRIERS = re.compile(r"used (\d+) barriers")
RE_CUMSTACK = re.compile(r"(\d+) bytes cumulative stack size")


@dataclass
class Function:
    file: str
    mangled: str
    name: str = ""
    entry: bool = False          # a __global__ kernel (else a non-inlined device function)
    registers: int | None = None
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    cumulative_stack: int = 0    # stack frame including the callees'
    static_smem: int = 0
    cmem0: int = 0
    barriers: int = 0
    threads: int | None = None       # per CTA at launch (--json; scripts/launch_shapes.cu)
    dynamic_smem: int | None = None  # bytes per CTA at launch (--json)
    proxy: dict | None = None        # --proxy: {arch, registers, spill_stores, spill_loads}
    problems: list[str] = field(default_factory=list)


def find_nvcc(explicit: str | None) -> str:
    candidates = [explicit] if explicit else []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("check_sm75: nvcc not found (use --nvcc, CUDA_HOME or PATH)")


def demangle(names: list[str], nvcc: str) -> dict[str, str]:
    """Mangled -> readable names via cu++filt (CUDA) or c++filt; identity if neither exists."""
    if not names:
        return {}
    tools = [os.path.join(os.path.dirname(nvcc), "cu++filt"), shutil.which("cu++filt"),
             shutil.which("c++filt")]
    for tool in tools:
        if not tool or not os.path.isfile(tool):
            continue
        try:
            out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True,
                                 text=True, check=True, timeout=60).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            continue
        if len(out) == len(names):
            return dict(zip(names, out))
    return {n: n for n in names}


def short_name(demangled: str) -> str:
    """flash_sm75::flash_fwd_kernel<flash_sm75::Traits<...>, true>(flash_sm75::Params) ->
    flash_fwd_kernel<Traits<...>, true>"""
    s = demangled.replace("flash_sm75::", "")
    # Drop the parameter list: the last top-level "(...)".
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return s[:i].removeprefix("void ")
    return s.removeprefix("void ")


def parse_ptxas(text: str, file: str) -> list[Function]:
    """Parse `ptxas -v` output (possibly several arches; only sm_75 is compiled here)."""
    funcs: dict[str, Function] = {}
    current_entry: str | None = None   # the function a "Used N registers" line belongs to
    current_props: str | None = None   # the function a "bytes stack frame" line belongs to

    def get(name: str) -> Function:
        if name not in funcs:
            funcs[name] = Function(file=file, mangled=name)
        return funcs[name]

    for line in text.splitlines():
        m = RE_ENTRY.search(line)
        if m:
            current_entry = m.group(1)
            get(current_entry).entry = True
            continue
        if "Compiling function" in line or "Function properties for" in line:
            m = RE_PROPS.search(line)
            if m:
                current_props = m.group(1)
                get(current_props)
            continue
        m = RE_STACK.search(line)
        if m and current_props:
            f = get(current_props)
            f.stack_frame, f.spill_stores, f.spill_loads = map(int, m.groups())
            continue
        m = RE_USED.search(line)
        if m:
            # "Used N registers, ..." closes the block of the entry function being compiled
            # (non-inlined device functions only get a "Function properties" block).
            if current_entry is None:
                continue
            target = current_entry
            f = get(target)
            f.registers = int(m.group(1))
            sm = RE_SMEM.search(line)
            f.static_smem = int(sm.group(1)) if sm else 0
            cm = RE_CMEM0.search(line)
            f.cmem0 = int(cm.group(1)) if cm else 0
            bm = RE_BARRIERS.search(line)
            f.barriers = int(bm.group(1)) if bm else 0
            cs = RE_CUMSTACK.search(line)
            f.cumulative_stack = int(cs.group(1)) if cs else f.stack_frame
    return list(funcs.values())


def check(f: Function) -> None:
    if f.spill_stores > 0 or f.spill_loads > 0:
        f.problems.append(f"spills ({f.spill_stores} B stores, {f.spill_loads} B loads)")
    if f.registers is not None and f.registers > SM75_MAX_REGISTERS:
        f.problems.append(f"{f.registers} registers > {SM75_MAX_REGISTERS}")
    if f.static_smem > SM75_MAX_SMEM_PER_BLOCK:
        f.problems.append(f"{f.static_smem} B static smem > {SM75_MAX_SMEM_PER_BLOCK}")
    if f.entry and f.registers is None:
        f.problems.append("no register count in the ptxas output")


def compile_one(nvcc: str, src: Path, workdir: Path, extra: list[str],
                arch: str = "sm_75") -> tuple[Path, int, str, float]:
    out = workdir / (src.stem + f".{arch}.cubin")
    flags = [f if f != "arch=compute_75,code=sm_75" else f"arch=compute_75,code={arch}"
             for f in NVCC_FLAGS]
    cmd = [nvcc, "-cubin", *flags, *extra, "-I", str(ROOT / "csrc"), str(src), "-o", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return src, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def launch_shapes(nvcc: str, workdir: Path) -> tuple[list[dict], str]:
    """([{pattern, threads, dynamic_smem}], error): scripts/launch_shapes.cu built and run."""
    exe = workdir / "launch_shapes"
    cmd = [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-gencode",
           "arch=compute_75,code=sm_75", "-I", str(ROOT / "csrc"), str(LAUNCH_SHAPES), "-o",
           str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return [], f"{rel(LAUNCH_SHAPES)} did not compile: {(proc.stdout + proc.stderr)[-2000:]}"
    proc = subprocess.run([str(exe)], capture_output=True, text=True)
    if proc.returncode != 0:
        return [], f"{rel(LAUNCH_SHAPES)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout), ""


def attach_launch_shapes(funcs: list[Function], shapes: list[dict]) -> list[str]:
    """Sets threads / dynamic_smem of every kernel a pattern matches; returns the unmatched."""
    unmatched = []
    for f in funcs:
        if not f.entry:
            continue
        hits = [s for s in shapes if re.search(s["pattern"], f.name)]
        if len(hits) == 1:
            f.threads, f.dynamic_smem = hits[0]["threads"], hits[0]["dynamic_smem"]
        else:
            unmatched.append(f"{f.name} ({len(hits)} patterns match)")
    return unmatched


def git_commit() -> dict:
    def git(*args):
        proc = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
        return proc.stdout.strip() if proc.returncode == 0 else None
    status = git("status", "--porcelain", "--", "csrc")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "csrc_dirty": None if status is None else bool(status)}


def run_generate_check() -> tuple[bool, str]:
    if not GENERATOR.exists():
        return False, f"{GENERATOR.relative_to(ROOT)} not found"
    proc = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def print_table(funcs: list[Function], proxy: str | None = None) -> None:
    headers = ["file", "kernel", "regs", "spill st", "spill ld", "stack", "smem", "status"]
    if proxy:
        headers[7:7] = [f"{proxy} regs", f"{proxy} spill st/ld"]
    rows = []
    for f in funcs:
        row = [
            Path(f.file).name,
            f.name + ("" if f.entry else "  [device fn]"),
            "-" if f.registers is None else str(f.registers),
            str(f.spill_stores), str(f.spill_loads), str(f.stack_frame), str(f.static_smem),
            "OK" if not f.problems else "FAIL: " + "; ".join(f.problems),
        ]
        if proxy:
            p = f.proxy or {}
            row[7:7] = [str(p.get("registers", "-")),
                        f"{p['spill_stores']}/{p['spill_loads']}" if p else "-"]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    right = {2, 3, 4, 5, 6} | ({7, 8} if proxy else set())

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    print(fmt(headers))
    print(fmt(["-" * w for w in widths]))
    for r in rows:
        print(fmt(r))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Limits: spills must be 0, registers <= 255, static smem <= 64 KiB per block.")
    parser.add_argument("files", nargs="*", type=Path,
                        help="translation units to check (default: csrc/kernels/instantiations/*.cu)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--nvcc", help="nvcc to use (default: $CUDA_HOME/bin/nvcc, PATH, "
                                       "/usr/local/cuda/bin/nvcc)")
    parser.add_argument("-j", "--jobs", type=int, default=max(1, min(os.cpu_count() or 1, 8)),
                        help="parallel nvcc processes (default: number of CPUs, at most 8)")
    parser.add_argument("--nvcc-flag", action="append", default=[], metavar="FLAG",
                        help="extra nvcc flag (repeatable), e.g. --nvcc-flag=-DFOO")
    parser.add_argument("--skip-generate-check", action="store_true",
                        help="do not run generate_kernels.py --check")
    parser.add_argument("--show-ptxas", action="store_true", help="print the raw ptxas output")
    parser.add_argument("--proxy", metavar="ARCH",
                        help="also compile the compute_75 PTX for ARCH (e.g. sm_90, what the "
                             "H100 / H200 stand-in JIT-compiles) and report its registers and "
                             "spills (informational)")
    args = parser.parse_args()

    failures: list[str] = []
    gen_ok, gen_msg = (True, "skipped")
    if not args.skip_generate_check:
        gen_ok, gen_msg = run_generate_check()
        print(f"generate_kernels.py --check: {'OK' if gen_ok else 'FAILED'}"
              + (f"\n  {gen_msg}" if gen_msg and not gen_ok else ""))
        if not gen_ok:
            failures.append(f"generate_kernels.py --check: {gen_msg}")

    files = [p.resolve() for p in args.files] or sorted(INSTANTIATIONS.glob("*.cu"))
    if not files:
        failures.append(f"no .cu files found in {rel(INSTANTIATIONS)}")
    missing = [p for p in files if not p.is_file()]
    for p in missing:
        failures.append(f"{p}: no such file")
    files = [p for p in files if p.is_file()]

    nvcc = find_nvcc(args.nvcc)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    version = (re.findall(r"release [^\n]*", version) or ["unknown"])[-1]
    print(f"nvcc: {nvcc} ({version}); flags: {' '.join(NVCC_FLAGS + args.nvcc_flag)}")
    print(f"compiling {len(files)} translation unit(s) with {args.jobs} job(s)...", flush=True)

    funcs: list[Function] = []
    compile_log: dict[str, dict] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="check_sm75_") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futs = [pool.submit(compile_one, nvcc, src, Path(tmp), args.nvcc_flag)
                    for src in files]
            proxy_futs = [pool.submit(compile_one, nvcc, src, Path(tmp), args.nvcc_flag,
                                      args.proxy) for src in files] if args.proxy else []
            results = [f.result() for f in futs]
            proxy_results = [f.result() for f in proxy_futs]
    proxy_stats: dict[tuple[str, str], dict] = {}
    for src, rc, output, _ in proxy_results:
        if rc != 0:
            print(f"{rel(src)}: the {args.proxy} compile failed (exit {rc}); not reported")
            continue
        for f in parse_ptxas(output, rel(src)):
            if f.entry:
                proxy_stats[(f.file, f.mangled)] = {
                    "arch": args.proxy, "registers": f.registers,
                    "spill_stores": f.spill_stores, "spill_loads": f.spill_loads}
    for src, rc, output, seconds in results:
        compile_log[rel(src)] = {"returncode": rc, "seconds": round(seconds, 2)}
        if args.show_ptxas:
            print(f"==== {rel(src)}\n{output}")
        if rc != 0:
            failures.append(f"{rel(src)}: nvcc failed (exit {rc})")
            print(f"\n{rel(src)}: nvcc failed (exit {rc}):\n{output[-4000:]}", file=sys.stderr)
            continue
        for line in output.splitlines():
            if "warning" in line.lower() and not args.show_ptxas:
                print(f"{Path(src).name}: {line.strip()}")
        parsed = parse_ptxas(output, rel(src))
        if not any(f.entry for f in parsed):
            failures.append(f"{rel(src)}: no kernel found in the ptxas output")
        funcs.extend(parsed)

    names = demangle([f.mangled for f in funcs], nvcc)
    for f in funcs:
        f.name = short_name(names.get(f.mangled, f.mangled))
        f.proxy = proxy_stats.get((f.file, f.mangled))
        check(f)
        for p in f.problems:
            failures.append(f"{Path(f.file).name}: {f.name}: {p}")
    funcs.sort(key=lambda f: (f.file, not f.entry, f.name))

    # Launch shapes (threads, dynamic shared memory) for the JSON: a modelling aid, so a gap
    # here is reported in the JSON and printed, not counted as a failure of the sm_75 check.
    shapes_info: dict = {}
    if args.json:
        with tempfile.TemporaryDirectory(prefix="check_sm75_shapes_") as tmp:
            shapes, error = launch_shapes(nvcc, Path(tmp))
        unmatched = attach_launch_shapes(funcs, shapes) if shapes else []
        shapes_info = {"ok": not error and not unmatched, "error": error,
                       "unmatched": unmatched}
        for line in ([error] if error else []) + [f"no launch shape: {u}" for u in unmatched]:
            print(f"warning: {line}")

    print()
    print_table(funcs, args.proxy)
    if args.proxy:
        spilled = [f for f in funcs if f.proxy and (f.proxy["spill_stores"] or f.proxy["spill_loads"])]
        print(f"\n{args.proxy} (informational): {len(spilled)} kernel(s) spill there")
    elapsed = time.monotonic() - t_start
    n_kernels = sum(f.entry for f in funcs)
    print(f"\n{n_kernels} kernel(s) in {len(files)} file(s), {elapsed:.1f} s")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "arch": "sm_75",
            "nvcc": nvcc,
            "nvcc_version": version,
            "nvcc_flags": NVCC_FLAGS + args.nvcc_flag,
            "git": git_commit(),
            "limits": {"max_registers": SM75_MAX_REGISTERS, "max_spill_bytes": 0,
                       "max_static_smem_bytes": SM75_MAX_SMEM_PER_BLOCK},
            "generate_kernels_check": {"ok": gen_ok, "message": gen_msg},
            "compile": compile_log,
            "launch_shapes": shapes_info,
            "kernels": [asdict(f) for f in funcs],
            "failures": failures,
            "ok": not failures,
        }, indent=2) + "\n")
        print(f"wrote {args.json}")

    if failures:
        print(f"\ncheck_sm75: FAILED ({len(failures)} problem(s)):", file=sys.stderr)
        for f in failures:
            print(f"  - {f}", file=sys.stderr)
        return 1
    print("check_sm75: OK (no spills, registers <= 255, static smem <= 64 KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
