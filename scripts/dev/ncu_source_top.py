"""The hottest source lines of an Nsight Compute source-page CSV (`ncu -i REPORT --page source --csv`).

Kernel development: prints the rows with the most warp-stall samples (the column whose name contains
"Warp Stall Sampling (All" -- or, failing that, the first column with "Sampl" in its name), with their
share of all samples and the row's source or SASS text. Without such a column it prints the header, so the
format of another Nsight Compute version can be read and the script adjusted.

  python scripts/dev/ncu_source_top.py REPORT_SOURCE.csv [--top 40]
"""

import argparse
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv_path")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    with open(args.csv_path, newline="", errors="replace") as f:
        rows = [r for r in csv.reader(f) if r]
    header_at = next((i for i, r in enumerate(rows) if any("Sampl" in c for c in r)), None)
    if header_at is None:
        print("no sampling column found; the first rows are:")
        for r in rows[:5]:
            print(" | ".join(r)[:300])
        return 1
    header, body = rows[header_at], rows[header_at + 1:]
    col = next((i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c), None)
    if col is None:
        col = next(i for i, c in enumerate(header) if "Sampl" in c)
    text_cols = [i for i, c in enumerate(header) if c.strip().lower() in ("source", "sass", "address", "# address")]
    total = sum(number(r[col]) for r in body if len(r) > col) or 1.0
    body.sort(key=lambda r: -number(r[col]) if len(r) > col else 0.0)
    print(f"column: {header[col]!r}; {int(total)} samples in {len(body)} rows")
    for r in body[: args.top]:
        text = "  ".join(r[i] for i in text_cols if i < len(r)) or " | ".join(r[:3])
        print(f"{number(r[col]):10.0f} {100 * number(r[col]) / total:5.1f}%  {text[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
