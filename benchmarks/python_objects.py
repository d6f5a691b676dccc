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
import gc
import io
import os
import pickle
import platform
import random
import statistics
import sys
import tempfile
import time

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


def config() -> dict:
    """A run's config, as training scripts save it beside the weights: a transformers-style model
    config (with ``id2label`` and ``label2id`` of 10 classes) and the training arguments, ~120
    values in nested dicts and lists."""
    labels = [f"label_{i}" for i in range(10)]
    model = {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"], "vocab_size": 50257,
             "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
             "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "summary_type": "cls_index",
             "summary_use_proj": True, "scale_attn_weights": True, "use_cache": True, "bos_token_id": 50256,
             "eos_token_id": 50256, "torch_dtype": "float32", "transformers_version": "4.57.0",
             "id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)},
             "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}}
    training = {"output_dir": "runs/gpt2-cls", "learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999,
                "adam_epsilon": 1e-8, "weight_decay": 0.01, "num_train_epochs": 3.0, "max_steps": -1,
                "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "warmup_steps": 500, "logging_steps": 50,
                "save_steps": 500, "save_total_limit": 3, "seed": 42, "data_seed": None, "bf16": False,
                "fp16": False, "per_device_train_batch_size": 16, "per_device_eval_batch_size": 32,
                "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "eval_strategy": "steps",
                "report_to": ["tensorboard"], "dataloader_num_workers": 4, "remove_unused_columns": True,
                "label_names": ["labels"], "optim": "adamw_torch", "group_by_length": False}
    return {"model": model, "training": training, "git_sha": "990e5c5", "world_size": 8}


def label_map(classes: int) -> dict[int, str]:
    """An image classifier's ``id2label``: ``classes`` class ids to names (ImageNet-like)."""
    r = random.Random(3)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return {i: "".join(r.choice(letters) for _ in range(r.randint(4, 14))) + f", n{i:08d}" for i in range(classes)}


def small_workloads() -> dict:
    """Small Python-heavy objects (issue 41): where a save's fixed cost per call weighs most."""
    return {"config (~120 values)": config(),
            "log history (100 entries)": log_history(100),
            "label map (1,000 classes, int -> str)": label_map(1000)}


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


def batched(fn, k: int):
    """``fn`` called ``k`` times: one timing of a small object's operation is a few microseconds,
    too short for a clock read and a collection before it (run.py's rounds) to leave it alone."""
    def run():
        for _ in range(k):
            fn()
    return run


def calls_per_timing(ops: dict, seconds: float = 0.02) -> int:
    """How many calls of the slowest save of ``ops`` take about ``seconds`` (each run once first)."""
    slowest = 0.0
    for name, fn in ops.items():
        if "save" not in name and "dumps" not in name:
            continue
        fn()
        t0 = time.perf_counter()
        fn()
        slowest = max(slowest, time.perf_counter() - t0)
    return max(1, min(1000, int(seconds / max(slowest, 1e-6))))


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


SMALL_TARGET = 1.0  # issue 41: a small object's save, vs torch.save's (median over the workloads)
SMALL_PAIRS = (("tensorcanon.save(file object)", "torch.save(file object)"),
               ("tensorcanon.dumps", "torch.save(BytesIO)"),
               ("tensorcanon.loads", "torch.load(weights_only=True)"))


def small_report(results: list[tuple[str, bench_run.Timings, dict, int]], runs: int) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    lines = ["### Small Python-heavy objects (issue 41): a save's fixed cost", "",
             f"{runs} rounds; each timing is a batch of calls (the column says how many), reported per call; "
             f"load average at the end {load}.", "",
             "| workload | calls per timing | operation | median µs per call | vs | ratio, wall | ratio, CPU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    per_pair: dict[str, list[float]] = {a: [] for a, _ in SMALL_PAIRS}
    for name, t, _, k in results:
        for a, b in SMALL_PAIRS:
            r = t.ratio(a, b)
            per_pair[a].append(r)
            lines.append(f"| {name} | {k} | {a} | {t[a] / k * 1e6:.1f} | {b}: {t[b] / k * 1e6:.1f} µs | "
                         f"{r:.2f}× | {cpu_ratio(t, a, b):.2f}× |")
    lines += ["", "| target (issue 41) | measured: median over the workloads (wall) | per workload | verdict |",
              "| --- | --- | --- | --- |"]
    a, b = SMALL_PAIRS[0]
    m = statistics.median(per_pair[a])
    lines.append(f"| {a} ≤ {SMALL_TARGET}× {b} | {m:.2f}× | {', '.join(f'{r:.2f}×' for r in per_pair[a])} | "
                 f"{verdict(m, SMALL_TARGET)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="small sizes, 3 rounds, the imports' objects left out of the collections before each "
                    "timing (gc.freeze): a smoke test, not a measurement")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 9, quick 3)")
    ap.add_argument("--dir", default=None, help="where save to a file object writes (default: /dev/shm if it "
                    "exists, else the system temp dir)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--small-only", action="store_true", help="only the small objects of issue 41")
    args = ap.parse_args(argv)
    if args.quick:  # a smoke test: the collection before each timing skips the imports' objects (~80 ms a time)
        gc.freeze()
    runs = args.runs or (3 if args.quick else 9)
    base_dir = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    results, small = [], []
    with tempfile.TemporaryDirectory(prefix="tc-pyobj-", dir=base_dir) as tmp:
        for name, obj in ({} if args.small_only else workloads(args.quick)).items():
            check_round_trips(obj)
            ops, sizes = operations(obj, tmp)
            results.append((name, bench_run.interleaved_medians(ops, runs), sizes))
            print(f"{name}: done", file=sys.stderr)
        for name, obj in small_workloads().items():
            check_round_trips(obj)
            ops, sizes = operations(obj, tmp)
            k = 3 if args.quick else calls_per_timing(ops)
            small.append((name, bench_run.interleaved_medians({op: batched(fn, k) for op, fn in ops.items()},
                                                              runs), sizes, k))
            print(f"{name}: done", file=sys.stderr)
    text = (report(results, runs, args.quick) + "\n" if results else "") + small_report(small, runs)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
