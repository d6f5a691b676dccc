"""Loading many non-tensor values through DCP's own DefaultLoadPlanner (issue 29).

    python benchmarks/dcp_values_bench.py [--counts 2000 8000 16000] [--runs 3]

One process, no process group: a checkpoint holding one tensor and ``n`` ints is loaded with
``dcp.load(state, storage_reader=tensorcanon.dcp.Reader(dir), planner=DefaultLoadPlanner())``
and with ``tensorcanon.dcp.load``. Prints the median of ``--runs`` runs of each, and how each
grows from one count to the next (linear work: the ratio of the counts; quadratic: its square).
Part of the time is DCP's own planning, the same for any storage reader.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
import warnings


def _median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[2000, 8000, 16000])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # DCP's "no process group" notice
    import torch
    import torch.distributed.checkpoint as dcp

    import tensorcanon.dcp as tcd

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.counts:
            folder = f"{tmp}/ckpt{n}"
            tcd.save({"w": torch.ones(4), "vals": {f"k{i}": i for i in range(n)}}, folder)

            def target(n: int = n) -> dict:
                return {"w": torch.empty(4), "vals": {f"k{i}": None for i in range(n)}}

            def default(folder: str = folder) -> None:
                dcp.load(target(), storage_reader=tcd.Reader(folder), planner=dcp.DefaultLoadPlanner())

            def ours(folder: str = folder) -> None:
                tcd.load(target(), folder)

            rows.append((n, _median_seconds(default, args.runs), _median_seconds(ours, args.runs)))
    print("| values | dcp.load + Reader + DefaultLoadPlanner | tensorcanon.dcp.load |")
    print("| ---: | ---: | ---: |")
    for n, a, b in rows:
        print(f"| {n:,} | {a:.3f} s | {b:.3f} s |")
    for (n0, a0, b0), (n1, a1, b1) in itertools.pairwise(rows):
        print(f"{n0:,} -> {n1:,} values ({n1 / n0:.1f}x): DefaultLoadPlanner {a1 / a0:.1f}x, "
              f"tensorcanon.dcp.load {b1 / b0:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
