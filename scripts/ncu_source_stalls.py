"""Summarise ncu's per-instruction warp-stall samples of one kernel (development tool).

Collect on the GPU machine, then summarise (here or there; only the CSV is needed):

    ncu --kernel-name regex:flash_bwd_dkdv_kernel --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o dkdv -f python my_backward.py
    ncu -i dkdv.ncu-rep --page source --csv --print-source sass > dkdv_src.csv
    python scripts/ncu_source_stalls.py dkdv_src.csv [--top 45]

Prints the CSV's columns, the stall samples per SASS opcode, per stall reason the opcodes that
collect them (reasons with >= 2% of all samples), and the instructions with the most samples
with the reasons that make up >= 10% of each. Whole-kernel stall counters say how long warps
wait, these say at which instruction (benchmarks/NOTES.md has a worked example).

Two more views (the source page has the columns they read when ncu collected SourceCounters):

    python scripts/ncu_source_stalls.py dkdv_src.csv --hot-loop [--min-fraction 0.9]
    python scripts/ncu_source_stalls.py dkdv_src.csv --wavefronts

--hot-loop lists, in program order, the instructions executed at least --min-fraction times as
often as the most executed block of them (the main loop's body), with their samples: how far an
`LDSM` or `LDS` is issued before the instruction that waits on it is read off there.
--wavefronts sums shared-memory wavefronts per opcode against ncu's ideal count (an excess is a
bank conflict).
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str, modifiers: bool = False) -> str:
    """'@!P2  LDG.E.128 R4, [R2]' -> 'LDG' ('LDG.E.128' with modifiers)."""
    op = re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split(" ")[0]
    return op if modifiers else op.split(".")[0]


def stall_columns(header) -> list:
    """Indices of the stall-reason columns (the "(Not Issued)" ones are a subset of the same
    samples, not another reason)."""
    return [i for i, c in enumerate(header) if c.startswith("stall_") and "(Not Issued)" not in c]


def main_reasons(header, row, reasons, samples: float) -> str:
    """The reasons that make up >= 10% of an instruction's samples, as 'stall_x=N ...'."""
    return " ".join(f"{header[i]}={row[i]}" for i in reasons
                    if samples and number(row[i]) >= 0.1 * samples)


def read(path: str):
    """(header, rows) of ncu's source-page CSV; raises ValueError if it has no SASS columns."""
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if "Source" in row and ALL_SAMPLES in row:
            return row, [r for r in rows[i + 1:] if len(r) == len(row)]
    raise ValueError(f"{path}: no header with 'Source' and '{ALL_SAMPLES}' columns; was it written "
                     "by `ncu -i X --page source --csv --print-source sass`?")


def summarise(header, rows, top: int = 45, out=sys.stdout) -> dict:
    isrc, iall = header.index("Source"), header.index(ALL_SAMPLES)
    reasons = stall_columns(header)
    per_op = collections.Counter()
    per_reason = collections.defaultdict(collections.Counter)
    for r in rows:
        op = opcode(r[isrc])
        per_op[op] += number(r[iall])
        for i in reasons:
            per_reason[header[i]][op] += number(r[i])
    total = sum(per_op.values()) or 1.0
    print("columns:", ", ".join(header), file=out)
    print(f"stall samples: {total:.0f}", file=out)
    for op, v in per_op.most_common(25):
        print(f"  {op:12s} {v:10.0f} {100 * v / total:5.1f}%", file=out)
    for reason, ctr in sorted(per_reason.items(), key=lambda kv: -sum(kv[1].values())):
        s = sum(ctr.values())
        if s / total >= 0.02:
            ops = ", ".join(f"{op} {100 * v / total:.1f}" for op, v in ctr.most_common(6))
            print(f"{reason}: {100 * s / total:.1f}% ({ops})", file=out)
    print(f"top {top} instructions (samples, SASS, reasons >= 10% of the instruction's samples):",
          file=out)
    for r in sorted(rows, key=lambda r: -number(r[iall]))[:top]:
        n = number(r[iall])
        why = main_reasons(header, r, reasons, n)
        print(f"  {n:8.0f}  {r[isrc].strip()[:70]:70s} {why}", file=out)
    return {"total": total, "per_opcode": dict(per_op),
            "per_reason": {k: sum(v.values()) for k, v in per_reason.items()}}


EXECUTED = "Instructions Executed"
WAVEFRONTS = "L1 Wavefronts Shared"
WAVEFRONTS_IDEAL = "L1 Wavefronts Shared Ideal"


def column(header, name: str) -> int:
    """Index of column `name`; ValueError naming it (and the section that collects it) if absent."""
    if name not in header:
        raise ValueError(f"the CSV has no '{name}' column (collect with --section SourceCounters)")
    return header.index(name)


def hot_loop(header, rows, min_fraction: float = 0.9, out=sys.stdout) -> list:
    """The instructions executed at least min_fraction x the count that the most executed block
    reached (the mode among counts >= half the maximum: a loop's body shares one count, its
    exits and branches reach the maximum), in program order, with samples and the reasons that
    make up >= 10% of each. Returns [(row index, executions, samples, SASS)]."""
    isrc, iall, iexe = header.index("Source"), header.index(ALL_SAMPLES), column(header, EXECUTED)
    reasons = stall_columns(header)
    counts = [number(r[iexe]) for r in rows]
    top = max(counts, default=0.0)
    if top <= 0:
        raise ValueError("no instruction was executed (empty profile?)")
    body = collections.Counter(c for c in counts if c >= top / 2).most_common(1)[0][0]
    listed = []
    print(f"instructions executed >= {min_fraction:g} x {body:.0f} times, in program order "
          "(row, executions, samples, SASS, reasons >= 10%):", file=out)
    for k, r in enumerate(rows):
        if counts[k] < min_fraction * body:
            continue
        n = number(r[iall])
        why = main_reasons(header, r, reasons, n)
        print(f"  {k:5d} {counts[k]:10.0f} {n:7.0f}  {r[isrc].strip()[:60]:60s} {why}", file=out)
        listed.append((k, counts[k], n, r[isrc].strip()))
    return listed


def wavefronts(header, rows, out=sys.stdout) -> dict:
    """Shared-memory wavefronts per SASS opcode (with its modifiers: LDSM.16.M88.4) against
    ncu's ideal; returns {opcode: (wavefronts, ideal)}."""
    isrc, iw, ii = header.index("Source"), column(header, WAVEFRONTS), column(header, WAVEFRONTS_IDEAL)
    per = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        w = number(r[iw])
        if w:
            op = opcode(r[isrc], modifiers=True)
            per[op][0] += w
            per[op][1] += number(r[ii])
    total = sum(v[0] for v in per.values()) or 1.0
    print(f"shared-memory wavefronts: {total:.4g} (opcode, wavefronts, share, ideal, excess):",
          file=out)
    for op, (w, ideal) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"  {op:22s} {w:12.4g} {100 * w / total:5.1f}% {ideal:12.4g} {w - ideal:10.4g}",
              file=out)
    return {op: (w, ideal) for op, (w, ideal) in per.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="output of `ncu -i X --page source --csv --print-source sass`")
    ap.add_argument("--top", type=int, default=45, help="instructions to list (default 45)")
    ap.add_argument("--hot-loop", action="store_true",
                    help="list the most executed instructions in program order instead")
    ap.add_argument("--min-fraction", type=float, default=0.9,
                    help="--hot-loop: execution count relative to the hottest block (default 0.9)")
    ap.add_argument("--wavefronts", action="store_true",
                    help="shared-memory wavefronts per opcode against the ideal instead")
    a = ap.parse_args(argv)
    try:
        header, rows = read(a.csv)
        if a.hot_loop:
            hot_loop(header, rows, a.min_fraction)
        elif a.wavefronts:
            wavefronts(header, rows)
        else:
            summarise(header, rows, a.top)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
