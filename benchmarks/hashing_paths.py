"""The hashing paths of issue 41 (item 3), each against what verifies nothing, in one run.

Run from the repository root::

    python benchmarks/hashing_paths.py                 # 256 MiB, 9 rounds: prints the markdown
    python benchmarks/hashing_paths.py --out FILE      # also writes it to FILE
    python benchmarks/hashing_paths.py --quick         # 16 MiB, 3 rounds: a smoke test
    python benchmarks/hashing_paths.py --lazy-only     # tensorcanon.open alone, and its stages

Every byte tensorcanon writes or reads is hashed (xxh3-128); safetensors and torch.load hash
nothing. These rows ask what that costs on this machine:

- a large save to a file object, against safetensors ``save_file`` (and a raw write);
- an eager verified load, against a raw read into fresh buffers (one per tensor);
- ``load(mmap=True)`` + reading every page, against ``torch.load(mmap=True)`` + every page;
- ``tensorcanon.open`` + one tensor of 1,000, against ``safe_open`` + ``get_tensor``.

The small Python-heavy objects (configs, logs, label maps) are in benchmarks/python_objects.py.
Operations are timed in rounds (run.py's ``interleaved_medians``: every operation once per round,
each round starting one later); a time is the median over rounds, a ratio the median of per-round
ratios, so a slow stretch of a shared machine, which slows every operation of its rounds, cancels
out of it. The load average is printed beside each table: on a loaded machine a path that uses
the second core (tensorcanon hashes on a second thread) gets less of it than on a quiet one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile

import torch

import tensorcanon

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as bench_run  # noqa: E402 - benchmarks/run.py, beside this file: workloads and rounds

MiB = 1 << 20

# (what, tensorcanon's operation, the one it is measured against, target: at most this ratio)
TARGETS = [
    ("large save (file object) / safetensors save_file", "tensorcanon save (file object)",
     "safetensors save_file", 1.0),
    ("eager verified load / raw read into fresh buffers", "tensorcanon load (verify=True)",
     "raw read (fresh buffers)", 1.10),
    ("load(mmap=True) + every page / torch.load(mmap=True) + every page",
     "tensorcanon load(mmap=True) (verified) + read every page", "torch.load(mmap=True) + read every page", 1.0),
    ("lazy open + 1 tensor of 1000 / safe_open + get_tensor", "tensorcanon.open + read 1 by path (verified)",
     "safetensors safe_open + get_tensor 1", 1.0),
]


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "unknown"


def large_ops(tmp: str, obj: dict) -> dict:
    """The saves and eager loads. The raw read reads tensorcanon's own file (its data section, tensor
    by tensor): the same bytes of the same file as the loads, so where the file's pages happen to
    lie in memory (which moved the cost of one 256 MiB file against another by up to 45% here) is
    the same for both."""
    from safetensors.torch import save_file

    from tensorcanon.io import reader

    flat = {k: v.contiguous() for k, v in obj.items()}
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in flat.values()]
    P = lambda name: os.path.join(tmp, name)  # noqa: E731

    def raw_write():
        with open(P("raw.bin"), "wb") as f:
            for v in views:
                f.write(v)

    tensorcanon.save(obj, P("tc.st"))
    with reader.open_file(P("tc.st")) as cf:
        spans = [(cf.data_start + r.begin, r.end - r.begin) for r in sorted(cf.rows, key=lambda r: r.begin)]

    def raw_read():
        with open(P("tc.st"), "rb", buffering=0) as f:
            out = []
            for at, n in spans:
                b = torch.empty(n, dtype=torch.uint8)
                f.seek(at)
                f.readinto(memoryview(b.numpy()))
                out.append(b)
        return out

    def tc_save():
        with open(P("tc.file"), "wb") as f:
            tensorcanon.save(obj, f)

    return {
        "raw write": raw_write,
        "tensorcanon save (file object)": tc_save,
        "safetensors save_file": lambda: save_file(flat, P("st.st")),
        "raw read (fresh buffers)": raw_read,
        "tensorcanon load (verify=True)": lambda: tensorcanon.load(P("tc.st")),
        "tensorcanon load (verify=False)": lambda: tensorcanon.load(P("tc.st"), verify=False),
    }


def mmap_ops(tmp: str, obj: dict) -> tuple[dict, object]:
    """The memory-mapped loads, and what to run (untimed) before each: both files written again.

    Reading a mapped file's pages costs what faulting them in costs, which depends on where the
    file's pages lie in memory: here a torch.save file and a tensorcanon file of the same tensors
    differed by 28%, and a copy of either was slower than both (by 45%). Each run of each operation
    maps freshly written files, so that both sides draw their pages alike, round after round.
    """
    P = lambda name: os.path.join(tmp, name)  # noqa: E731

    def write_both():
        tensorcanon.save(obj, P("mm.st"))
        torch.save(obj, P("mm.pt"))

    def every_page(load):
        def op():
            d = load()
            bench_run.read_every_page(d)
            return d
        return op

    return {
        "tensorcanon load(mmap=True) (verified) + read every page": every_page(
            lambda: tensorcanon.load(P("mm.st"), mmap=True)),
        "torch.load(mmap=True) + read every page": every_page(
            lambda: torch.load(P("mm.pt"), mmap=True, weights_only=True)),
    }, write_both


def lazy_ops(tmp: str, count: int) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    obj = {f"layer{i:04d}": torch.full((1024,), float(i)) for i in range(count)}  # 4 KiB each
    p, q = os.path.join(tmp, "lazy.st"), os.path.join(tmp, "lazy_st.st")
    tensorcanon.save(obj, p)
    save_file(obj, q)
    name = f"layer{count // 2:04d}"

    def one_by_path():
        with tensorcanon.open(p) as f:
            return f[f'$["{name}"]']

    def one_by_name():
        with tensorcanon.open(p) as f:
            return f[name]

    def st_one():
        with safe_open(q, "pt") as f:
            return f.get_tensor(name)

    return {"tensorcanon.open + read 1 by path (verified)": one_by_path,
            "tensorcanon.open + read 1 by name (verified)": one_by_name,
            "safetensors safe_open + get_tensor 1": st_one}


def lazy_stages(tmp: str, count: int, runs: int) -> list[str]:
    """Where ``tensorcanon.open`` + reading one tensor of ``count`` spends its time, stage by stage,
    each run after a collection as the timed operations are (the stages of LazyFile, called one
    by one through the io modules; works on earlier trees too, which map through torch)."""
    import gc
    import time

    from tensorcanon.format import container
    from tensorcanon.io import lazyindex, reader, source

    obj = {f"layer{i:04d}": torch.full((1024,), float(i)) for i in range(count)}
    p = os.path.join(tmp, "stages.st")
    tensorcanon.save(obj, p)
    limits = tensorcanon.Limits()
    key = f'$["layer{count // 2:04d}"]'
    mapper = getattr(source, "map_plain", source.map_file)
    times: dict[str, list[float]] = {}
    for _ in range(runs):
        gc.collect()
        marks = [time.perf_counter()]
        src = mapper(p)
        marks.append(time.perf_counter())
        prefix, raw = container.read_raw(src.read, src.size, limits)
        marks.append(time.perf_counter())
        lazyindex._metadata(raw)  # __metadata__ and the manifest's base64
        marks.append(time.perf_counter())
        src.seek(0)
        q = lazyindex.QuickIndex(src, limits)  # all of it again, warm now: + digest and outline
        marks.append(time.perf_counter())
        i = q.index_of(key)
        marks.append(time.perf_counter())
        info = q.info(i)
        marks.append(time.perf_counter())
        reader.RowReader(src, limits, q.data_start, q.algorithm).read_row(info)
        marks.append(time.perf_counter())
        src.release()
        del q, src
        marks.append(time.perf_counter())
        for name, a, b in zip(_STAGES, marks[:-1], marks[1:], strict=True):
            times.setdefault(name, []).append(b - a)
    lines = [f"### Lazy open, stage by stage ({count} tensors, {runs} runs, a collection before each)", "",
             "| stage | median |", "| --- | --- |"]
    lines += [f"| {name} | {bench_run.fmt_t(statistics.median(ts))} |" for name, ts in times.items()]
    return lines + [""]


_STAGES = ["map the file", "read the header", "__metadata__ and the manifest's base64",
           "the quick index again (warm; + digest, outline)", "the path to a table index",
           "its row and header entry", "read, hash and copy its bytes", "release the map"]


def table(title: str, t: bench_run.Timings, before: str, after: str) -> list[str]:
    lines = [f"### {title}", "", f"Load average (1, 5, 15 min) before: {before}; after: {after}.", "",
             "| operation | median | fastest – slowest | CPU time (median) | rounds disturbed |",
             "| --- | --- | --- | --- | --- |"]
    for op, ts in t.rounds.items():
        lines.append(f"| {op} | {bench_run.fmt_t(t[op])} | {bench_run.fmt_t(min(ts))} – "
                     f"{bench_run.fmt_t(max(ts))} | {bench_run.fmt_t(statistics.median(t.cpu[op]))} | "
                     f"{t.disturbed[op]}/{len(ts)} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 MiB, 3 rounds (lazy: 11): a smoke test")
    ap.add_argument("--runs", type=int, default=None, help="rounds of the large operations (default 9, quick 3)")
    ap.add_argument("--lazy-runs", type=int, default=None, help="rounds of the lazy opens (default 41, quick 11)")
    ap.add_argument("--large-mib", type=int, default=None, help="the large state's size (default 256, quick 16)")
    ap.add_argument("--dir", default=None, help="where the files go (default /dev/shm if it exists)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--lazy-only", action="store_true",
                    help="only the lazy opens (and their stages): a quick A/B of tensorcanon.open")
    ap.add_argument("--malloc-as-is", action="store_true",
                    help="leave glibc's adjustable mmap threshold (default: pinned at 128 KiB, so that every "
                         "load, and the raw read, fills fresh pages: compare.py's MALLOC_MMAP_THRESHOLD)")
    args = ap.parse_args(argv)
    if not args.malloc_as_is and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc raises its threshold after freeing a mapped block; loads would then get recycled,
        # already-faulted pages or fresh ones depending on what ran before. Set before the process
        # starts: this script again, with the setting.
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else
                                                                                sys.argv[1:])],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    runs = args.runs or (3 if args.quick else 9)
    lazy_runs = args.lazy_runs or (11 if args.quick else 41)
    mib = args.large_mib or (16 if args.quick else 256)
    parent = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    tmp = tempfile.mkdtemp(prefix="tc-hashing-", dir=parent)
    md = [f"## Hashing paths (benchmarks/hashing_paths.py{' --quick' if args.quick else ''})", ""]
    results: dict[str, tuple[float, float]] = {}
    try:
        large = mapped = bench_run.Timings({}, {}, {})
        if not args.lazy_only:
            obj = bench_run.large_tensors(mib)
            before = load_average()
            large = bench_run.interleaved_medians(large_ops(tmp, obj), runs)
            md += table(f"{mib} MiB in 128 float32 tensors, {runs} rounds", large, before, load_average())
            before = load_average()
            ops, write_both = mmap_ops(tmp, obj)
            mapped = bench_run.interleaved_medians(ops, runs, before=write_both)
            md += table(f"Memory-mapped loads: {mib} MiB in 128 float32 tensors, both files written again "
                        f"before each run, {runs} rounds", mapped, before, load_average())
            del obj
        before = load_average()
        lazy = bench_run.interleaved_medians(lazy_ops(tmp, 1000), lazy_runs)
        md += table(f"Lazy open: 1 tensor of 1,000 (4 KiB each), {lazy_runs} rounds", lazy, before, load_average())
        md += lazy_stages(tmp, 1000, lazy_runs)
        for what, a, b, _ in TARGETS:
            if args.lazy_only and a not in lazy.rounds:
                continue
            t = large if a in large.rounds else mapped if a in mapped.rounds else lazy
            results[what] = (t.ratio(a, b),
                             statistics.median(x / y for x, y in zip(t.cpu[a], t.cpu[b], strict=True)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md[1:1] = ["", f"{now}; Python {platform.python_version()}, torch {torch.__version__}, tensorcanon "
               f"{tensorcanon.__version__} ({os.path.dirname(tensorcanon.__file__)}); {bench_run.machine()['CPU']}; "
               f"files in {tmp.rsplit(os.sep, 1)[0]}; glibc's mmap threshold: "
               f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'adjustable')}. A ratio is the median of per-round "
               "ratios; CPU time is this process's, all threads."]
    md += ["### Targets (issue 41, item 3)", "",
           "| what | target | measured: wall (CPU) | verdict (wall) |", "| --- | --- | --- | --- |"]
    for what, _, _, target in TARGETS:
        if what not in results:
            continue
        r, c = results[what]
        md.append(f"| {what} | ≤ {target:.2f}× | {r:.2f}× ({c:.2f}×) | {'met' if r <= target else '**not met**'} |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
