"""Python-heavy objects: tensorcanon against torch.save / torch.load and pickle (issue 30, item 7).

Run from the repository root::

    python benchmarks/python_objects.py                  # prints the markdown section
    python benchmarks/python_objects.py --out FILE       # also writes it to FILE
    python benchmarks/python_objects.py --quick          # small sizes, 3 rounds: a smoke test

Three workloads of the kind real training code hands to ``torch.save``, built
deterministically:

- a transformers ``Trainer`` ``log_history``: 10,000 dicts of str to float/int
  (training entries, and every 10th an evaluation entry with other keys);
- a million token ids in lists (1,000 lists of 1,000 ints below 50,257);
- a 50,000-entry vocabulary (str -> int, GPT-2-like BPE strings, some not ASCII).

For each: ``tensorcanon.dumps``, ``tensorcanon.save`` to a file object (a file
opened for writing, no fsync), ``tensorcanon.loads``, against ``torch.save`` to a
BytesIO, ``torch.save`` to a file object, ``torch.load`` of its bytes
(``weights_only=True``: these objects are all built-in types, which it accepts)
and ``pickle.dumps`` / ``pickle.loads`` (the default protocol). Every operation
is timed in rounds (each round runs every operation of the workload once,
starting one later each time: run.py's ``interleaved_medians``); a time is the
median over rounds, a ratio the median of the per-round ratios (wall time, and
separately this process's CPU time, which other processes on a shared machine
disturb less). Sizes are the bytes each writes.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import pickle
import platform
import random
import statistics
import sys
import tempfile

import torch

import tensorcanon

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as bench_run  # noqa: E402 - benchmarks/run.py, beside this file: the timing rounds

TARGET_TIME = 1.2   # dumps and save to a file object, vs torch.save to a BytesIO
TARGET_SIZE = 1.2   # bytes written, vs torch.save
TARGET_LOAD = 1.0   # loads, vs torch.load


# ----------------------------------------------------------------- workloads

def log_history(entries: int) -> list[dict]:
    """A transformers Trainer's ``state.log_history``: a training entry per logging step, and an
    evaluation entry every 10th (other keys, as the Trainer writes them)."""
    r = random.Random(0)
    out: list[dict] = []
    for i in range(entries):
        step = (i + 1) * 10
        epoch = round(step / 5000, 4)
        if i % 10 == 9:
            out.append({"eval_loss": r.uniform(0.5, 3.0), "eval_runtime": r.uniform(10, 60),
                        "eval_samples_per_second": r.uniform(100, 900), "eval_steps_per_second": r.uniform(10, 90),
                        "epoch": epoch, "step": step})
        else:
            out.append({"loss": round(r.uniform(0.5, 3.0), 4), "grad_norm": r.uniform(0.1, 5.0),
                        "learning_rate": 5e-5 * (1 - i / entries), "epoch": epoch, "step": step})
    return out


def token_ids(lists: int, length: int) -> list[list[int]]:
    """``lists`` sequences of ``length`` token ids of a 50,257-token vocabulary."""
    r = random.Random(1)
    return [[r.randrange(50257) for _ in range(length)] for _ in range(lists)]


def vocabulary(size: int) -> dict[str, int]:
    """A BPE-like vocabulary: ``size`` distinct strs (a fifth start with GPT-2's 'Ġ', not ASCII),
    numbered in a shuffled order, as a tokenizer's ``get_vocab()`` gives them."""
    r = random.Random(2)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < size:
        w = "".join(r.choice(letters) for _ in range(r.randint(2, 9)))
        words.add(("\u0120" + w) if r.random() < 0.2 else w)
    ordered = sorted(words)
    r.shuffle(ordered)
    return {w: i for i, w in enumerate(ordered)}


def workloads(quick: bool) -> dict:
    if quick:
        return {"log history (1,000 entries)": log_history(1000),
                "token ids (100 lists of 1,000)": token_ids(100, 1000),
                "vocabulary (5,000 entries)": vocabulary(5000)}
    return {"log history (10,000 entries)": log_history(10_000),
            "token ids (1,000 lists of 1,000)": token_ids(1000, 1000),
            "vocabulary (50,000 entries)": vocabulary(50_000)}


# ----------------------------------------------------------------- operations

def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def operations(obj, tmp: str) -> tuple[dict, dict]:
    """The timed operations on ``obj`` and the bytes each format writes."""
    tc, th, pk = tensorcanon.dumps(obj), torch_bytes(obj), pickle.dumps(obj)
    path = os.path.join(tmp, "out.bin")

    def tc_save_file():
        with open(path, "wb") as f:
            tensorcanon.save(obj, f)

    def torch_save_file():
        with open(path, "wb") as f:
            torch.save(obj, f)

    ops = {
        "tensorcanon.dumps": lambda: tensorcanon.dumps(obj),
        "tensorcanon.save(file object)": tc_save_file,
        "torch.save(BytesIO)": lambda: torch_bytes(obj),
        "torch.save(file object)": torch_save_file,
        "pickle.dumps": lambda: pickle.dumps(obj),
        "tensorcanon.loads": lambda: tensorcanon.loads(tc),
        "torch.load(weights_only=True)": lambda: torch.load(io.BytesIO(th), weights_only=True),
        "pickle.loads": lambda: pickle.loads(pk),
    }
    return ops, {"tensorcanon": len(tc), "torch.save": len(th), "pickle": len(pk)}


def check_round_trips(obj) -> None:
    """Every format gives the object back (a benchmark of a wrong answer measures nothing)."""
    assert tensorcanon.loads(tensorcanon.dumps(obj)) == obj
    assert torch.load(io.BytesIO(torch_bytes(obj)), weights_only=True) == obj
    assert pickle.loads(pickle.dumps(obj)) == obj


def cpu_ratio(t: bench_run.Timings, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(t.cpu[a], t.cpu[b], strict=True))


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "**not met**"


def report(results: list[tuple[str, bench_run.Timings, dict]], runs: int, quick: bool) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    lines = [
        "## Python-heavy objects (benchmarks/python_objects.py)" + (" [quick]" if quick else ""),
        "",
        f"{now}; Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), tensorcanon {tensorcanon.__version__}; {os.cpu_count()} CPUs; "
        f"{runs} rounds; load average at the end {load}. The machine may be shared with other work: a time "
        "is the median over rounds, a ratio the median of per-round ratios (wall, and this process's CPU "
        "time, which other processes disturb less). torch.load runs with weights_only=True, which accepts "
        "every object here (built-in types only).",
        "",
        "| workload | operation | median ms | vs torch.save(BytesIO), wall | CPU |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, t, _ in results:
        for op in t:
            if op.endswith("loads") or op.startswith("torch.load"):
                base = "torch.load(weights_only=True)"
            else:
                base = "torch.save(BytesIO)"
            lines.append(f"| {name} | {op} | {fmt_ms(t[op])} | {t.ratio(op, base):.2f}× "
                         f"{'(vs torch.load)' if base.startswith('torch.load') else ''} | "
                         f"{cpu_ratio(t, op, base):.2f}× |")
    lines += ["", "| workload | tensorcanon bytes | torch.save bytes | pickle bytes | tensorcanon / torch.save |",
              "| --- | --- | --- | --- | --- |"]
    for name, _, sizes in results:
        lines.append(f"| {name} | {sizes['tensorcanon']:,} | {sizes['torch.save']:,} | {sizes['pickle']:,} | "
                     f"{sizes['tensorcanon'] / sizes['torch.save']:.2f}× |")
    lines += ["", "### Targets (issue 30, item 7)", "",
              "| workload | target | measured (wall; CPU) | verdict (wall) |", "| --- | --- | --- | --- |"]
    for name, t, sizes in results:
        for op, base, target in (("tensorcanon.dumps", "torch.save(BytesIO)", TARGET_TIME),
                                 ("tensorcanon.save(file object)", "torch.save(BytesIO)", TARGET_TIME),
                                 ("tensorcanon.loads", "torch.load(weights_only=True)", TARGET_LOAD)):
            r = t.ratio(op, base)
            lines.append(f"| {name} | {op} ≤ {target}× {base} | {r:.2f}×; {cpu_ratio(t, op, base):.2f}× | "
                         f"{verdict(r, target)} |")
        size = sizes["tensorcanon"] / sizes["torch.save"]
        lines.append(f"| {name} | size ≤ {TARGET_SIZE}× torch.save's | {size:.2f}× | {verdict(size, TARGET_SIZE)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 rounds: a smoke test")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 9, quick 3)")
    ap.add_argument("--dir", default=None, help="where save to a file object writes (default: /dev/shm if it "
                    "exists, else the system temp dir)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    runs = args.runs or (3 if args.quick else 9)
    base_dir = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    results = []
    with tempfile.TemporaryDirectory(prefix="tc-pyobj-", dir=base_dir) as tmp:
        for name, obj in workloads(args.quick).items():
            check_round_trips(obj)
            ops, sizes = operations(obj, tmp)
            results.append((name, bench_run.interleaved_medians(ops, runs), sizes))
            print(f"{name}: done", file=sys.stderr)
    text = report(results, runs, args.quick)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
