"""What the scaling benchmarks share (bench/keys.py, bench/controlplane.py): a command line of sizes and a
baseline, the machine's load around each size, the rows of their tables, and where the results go.

Each size records the 1-minute load average at its start and end; above NOISY_LOAD at the start (two cores,
the benchmark alone should not pass it) its figures are marked noisy, and no aim is judged on them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

NOISY_LOAD = 1.0


def arguments(parser: argparse.ArgumentParser, unit: str, sizes: tuple[int, ...], quick: str, seconds: str) -> None:
    """The options every curve takes: SIZES of UNIT by default, QUICK and SECONDS saying what those mean."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--sizes", help=f"comma-separated numbers of {unit} [{','.join(map(str, sizes))}]")
    parser.add_argument("--seconds", type=float, help=seconds)
    parser.add_argument("--baseline", metavar="CHECKOUT", help="another checkout, measured beside this one")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--chart", help="write the SVG chart here")


def sizes_of(args: argparse.Namespace, sizes: tuple[int, ...], quick: tuple[int, ...]) -> list[int]:
    return [int(s) for s in args.sizes.split(",")] if args.sizes else list(quick if args.quick else sizes)


def under_load(size: int, figures) -> dict:
    """FIGURES() for SIZE, with the load average before and after, and whether it was too busy to judge."""
    before = os.getloadavg()[0]
    out = {"size": size, "load_before": before, **figures()}
    out["load_after"] = os.getloadavg()[0]
    out["noisy"] = before > NOISY_LOAD
    return out


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def header(results: list[dict], unit: str) -> str:
    return ("| | " + " | ".join(f"{r['size']:,} {unit}" for r in results) + " |\n|---|"
            + "---:|" * len(results) + "\n")


def row(label: str, values) -> str:
    return f"| {label} | " + " | ".join(values) + " |\n"


def load_row(results: list[dict]) -> str:
    return row("load average, start / end", (f"{r['load_before']:.1f} / {r['load_after']:.1f}"
                                             + (" (noisy)" if r["noisy"] else "") for r in results))


def finish(args: argparse.Namespace, sizes: list[int], seconds: float, results: list[dict], report: str,
           chart) -> None:
    """Print the machine and REPORT; write the results (--out) and CHART(RESULTS), an SVG (--chart)."""
    print(f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
          + (f"; baseline: {args.baseline}" if args.baseline else ""))
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"sizes": sizes, "seconds": seconds, "baseline": args.baseline, "results": results}, f,
                      indent=1)
    if args.chart:
        with open(args.chart, "w") as f:
            f.write(chart(results))
