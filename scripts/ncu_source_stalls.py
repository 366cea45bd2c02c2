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


def opcode(sass: str) -> str:
    """'@!P2  LDG.E.128 R4, [R2]' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split(" ")[0].split(".")[0]


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
    reasons = [i for i, c in enumerate(header) if c.startswith("stall_") and "(Not Issued)" not in c]
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
        why = " ".join(f"{header[i]}={r[i]}" for i in reasons if n and number(r[i]) >= 0.1 * n)
        print(f"  {n:8.0f}  {r[isrc].strip()[:70]:70s} {why}", file=out)
    return {"total": total, "per_opcode": dict(per_op),
            "per_reason": {k: sum(v.values()) for k, v in per_reason.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="output of `ncu -i X --page source --csv --print-source sass`")
    ap.add_argument("--top", type=int, default=45, help="instructions to list (default 45)")
    a = ap.parse_args(argv)
    try:
        header, rows = read(a.csv)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    summarise(header, rows, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
