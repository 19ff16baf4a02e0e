"""Where a kernel's warps wait, by SASS instruction: a reading of Nsight Compute's source page (issue 8).

Input: the CSV that `ncu --section SourceCounters --section WarpStateStats --page source --print-source sass --csv`
prints for the kernels `runs/profile/ncu_step.py` runs (one table per kernel). Per kernel: the PC samples by stall
reason, by instruction kind (the opcode's first word: HGMMA, MUFU, SYNCS for the mbarrier waits, BAR, ...), and
the instructions with the most samples, each with its two largest stall reasons; then the same for the hot loop
alone (instructions executed between half and twice as often as the most executed wgmma (HGMMA): the compute
warps' steady loop, without the waits of a warp-specialized kernel's loader and other workers). Stall reasons count all samples
(ncu's "(Not Issued)" subsets are left out). Text to --out.

    python3 runs/profile/ncu_sass_stalls.py ncu_src.csv --out runs/profile/ncu_waits_<commit>.txt

(A gzipped CSV, as the raw reports are kept in runs/profile, is read as well.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def tables(path: str) -> dict[str, list[dict[str, str]]]:
    """Rows of each kernel's table, keyed by kernel name (the CSV's 'Kernel Name' lines start each table)."""
    out: dict[str, list[dict[str, str]]] = {}
    name, header = None, None
    with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                name, header = row[1], None
                out[name] = []
            elif name and header is None and row and row[0] == "Address":
                header = row
            elif name and header and len(row) == len(header):
                out[name].append(dict(zip(header, row)))
    return out


def summary(name: str, rows: list[dict[str, str]], top: int, first: int | None = None) -> list[str]:
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(int(r["# Samples"] or 0) for r in rows)
    by_reason = collections.Counter()
    by_kind = collections.Counter()
    for r in rows:
        kind = r["Source"].split()[0] if r["Source"].split() else "?"
        if kind.startswith("@"):  # predicated: the opcode is the next word
            kind = r["Source"].split()[1]
        by_kind[kind.split(".")[0]] += int(r["# Samples"] or 0)
        for k in stalls:
            by_reason[k] += int(r[k] or 0)
    lines = [f"\n=== {name}: {total:,} samples, {len(rows):,} SASS instructions",
             "by stall reason: " + ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in by_reason.most_common() if v)]
    lines.append("by instruction kind: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_kind.most_common(14)))
    lines.append(f"top {top} instructions (offset from the kernel's first, samples, share, warp executions, "
                 f"top two stall reasons):")
    base = int(rows[0]["Address"], 16) if first is None else first
    for r in sorted(rows, key=lambda r: -int(r["# Samples"] or 0))[:top]:
        n = int(r["# Samples"] or 0)
        reasons = sorted(((int(r[k] or 0), k[6:]) for k in stalls), reverse=True)[:2]
        lines.append(f"  {int(r['Address'], 16) - base:06x} {n:7,} {n / total:6.1%} {int(r['Instructions Executed'] or 0):>10,}"
                     f"  {r['Source'].strip()[:60]:<60} {', '.join(f'{k} {v}' for v, k in reasons if v)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lines = [f"# {args.csv}: Nsight Compute source page (PC sampling), condensed by runs/profile/ncu_sass_stalls.py"]
    for name, rows in tables(args.csv).items():
        lines += summary(name, rows, args.top)
        loop = max(int(r["Instructions Executed"] or 0) for r in rows if "HGMMA" in r["Source"])
        hot = [r for r in rows if loop / 2 <= int(r["Instructions Executed"] or 0) <= 2 * loop]
        lines += summary(f"{name}, hot loop (executed {loop // 2:,} to {2 * loop:,} times)", hot, args.top,
                         int(rows[0]["Address"], 16))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
