"""tensorcanon before/after: the public API's speed at two revisions, measured in one run.

Run from anywhere in the repository::

    python benchmarks/compare.py --base HEAD~1                 # base commit vs the working tree's src/
    python benchmarks/compare.py --base v0.1 --head main       # two commits
    python benchmarks/compare.py --base HEAD~1 --quick         # small sizes, 4 rounds: a smoke test
    python benchmarks/compare.py --base 7c8aba2                # the previous release (format 2) vs this tree
    python benchmarks/compare.py --base ../other-worktree      # a directory holding src/tensorcanon

Each side's ``src/`` is materialised in a temp dir: a revision by ``git archive REV src``
(read-only for the repository: no worktree registered, nothing for ``git worktree prune`` to
clean up if a run is killed), the working tree (``--head worktree``, the default) or a directory
given as ``--base``/``--head`` (another worktree, an unpacked release: anything holding
``src/tensorcanon``) by copying its ``src/`` once at the start, so that edits made while the run
goes on do not reach it half way. Every measurement runs in a fresh child process (this
script, ``--child``) started with ``PYTHONPATH=<that copy>/src``; the child refuses to run unless
``tensorcanon.__file__`` and every ``tensorcanon.*`` module it imported lie under that copy.
Children for base and head alternate in rounds, base-head then head-base, so that a slow stretch
of the machine falls on both alike.

Only the public API is used (save, load, load(mmap=True), open, verify, dumps, loads), so any two
revisions that have it can be compared; a workload whose call a side lacks (``open`` before it
existed, ``load(mmap=True)``) is left out of that side and shown as such.

The two sides may write different format versions (the previous release wrote version 2, this
tree writes 3): the comparison is of the operations, not of the files' bytes. Each child reports
the format version of the files it wrote (read from the file: the manifest's ``version``, by
json, base64 and msgpack alone) and a digest of what its loads returned that does not depend on
the format (every tensor's dtype, shape and bytes, the Python values' canonical text); the
parent requires those to be equal on both sides (both sides load the same values), and compares
the files' digests only where both wrote the same version (there a difference is a change of
the bytes a format version promises, and the report says so in bold). Inside a child, inputs are made first (seeded
``torch.Generator``s), then every API path is warmed up once on a tiny file (lazy imports,
first-call costs), then the workloads run in a fixed order, each timed alone (``perf_counter``,
after ``gc.collect()``); interpreter start-up, imports and input creation are never timed. The
figures are medians over rounds; head/base is the median of the per-round ratios (a slow stretch
slows both sides of a round; a ratio of two medians could take them from different stretches).
The children also check what they time (values loaded equal values saved, verify returns the
saved digest).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import mounts  # benchmarks/mounts.py, beside this file

MiB = 1 << 20
MARK = "@@tensorcanon-compare@@ "  # the child's result line

# (key, label): the workloads in the order a child runs them; the table lists them in this order.
WORKLOADS = [
    ("save", "save large"),
    ("load", "load large (eager, verified)"),
    ("mmap", "load large (mmap=True, verified) + read 1 element of each tensor"),
    ("lazy8", "open large + read 8 tensors"),
    ("lazyall", "open large + keys() + read every tensor"),
    ("verify", "verify large"),
    ("small_save", "save small tensors"),
    ("small_load", "load small tensors (eager, verified)"),
    ("dumps", "dumps nested Python values"),
    ("loads", "loads nested Python values"),
    ("lazy1k", "open a file of 1,000 tensors + read 1 by path"),
    ("config", "save a small config to a file object"),
]
SHORT = ("lazy8", "dumps", "loads", "lazy1k", "config")  # milliseconds: at least 5 runs in each child
SHORT_RUNS = 5  # (--short-runs: fewer for a smoke test of this script)
NEEDS = {"mmap": "load(mmap=True)", "lazy8": "open", "lazyall": "open", "lazy1k": "open", "verify": "verify"}
LAZY_READS = 8
# glibc raises its mmap threshold (up to 32 MiB) when a process frees a block it had mmapped, after
# which blocks of that size come from the heap, already faulted in. Whether a child's loads get fresh
# pages (a page fault per 4 KiB) or recycled ones then depends on what earlier workloads happened to
# free: at --quick sizes (128 KiB tensors) that alone made one revision's eager load 1.9x slower than
# the other's, and the same revision measured against itself 1.0x with the threshold pinned. Pinned
# at glibc's starting value (setting it turns the adjustment off), every tensor buffer of 128 KiB or
# more is fresh memory, as in a process's first load. --malloc-as-is leaves glibc's default.
MALLOC_MMAP_THRESHOLD = 128 * 1024


# ----------------------------------------------------------------- child: runs one side, once

def child_main(spec: dict) -> int:
    tree_src = os.path.realpath(spec["src"])
    import tensorcanon

    def under_tree(path: str | None) -> bool:
        return path is not None and os.path.realpath(path).startswith(tree_src + os.sep)

    if not under_tree(tensorcanon.__file__):
        print(f"tensorcanon imported from {tensorcanon.__file__}, not from {tree_src}", file=sys.stderr)
        return 3
    import hashlib
    import inspect

    import torch

    has = {"open": callable(getattr(tensorcanon, "open", None)),
           "verify": callable(getattr(tensorcanon, "verify", None)),
           "load(mmap=True)": "mmap" in inspect.signature(tensorcanon.load).parameters}
    missing = [key for key, _ in WORKLOADS if key in NEEDS and not has[NEEDS[key]]]

    large_n = spec["large_mib"] * MiB // 4 // spec["large_count"]
    g = torch.Generator().manual_seed(0)
    large = {f"t{i:03d}": torch.rand(large_n, generator=g) for i in range(spec["large_count"])}
    g = torch.Generator().manual_seed(1)
    small = {f"s{i:05d}": torch.rand(256, generator=g) for i in range(spec["small_count"])}  # 1 KiB each
    thousand = {f"layer{i:04d}": torch.full((1024,), float(i)) for i in range(1000)}  # 4 KiB each
    pyobj = python_values(spec["py_values"])
    config = small_config()
    names = list(large)
    picked = [names[i * len(names) // LAZY_READS] for i in range(LAZY_READS)]  # evenly spaced

    work = tempfile.mkdtemp(prefix=f"{spec['side']}-", dir=spec["dir"])
    P = lambda name: os.path.join(work, name)  # noqa: E731
    try:
        # Warm-up, untimed: every API path once on a tiny file (imports done on first use, caches).
        tiny = {"a": torch.ones(4), "b": {"c": torch.zeros(2, 2), "d": 1}}
        tensorcanon.save(tiny, P("tiny.st"))
        tensorcanon.load(P("tiny.st"))
        if has["load(mmap=True)"]:
            tensorcanon.load(P("tiny.st"), mmap=True)
        if has["open"]:
            with tensorcanon.open(P("tiny.st")) as f:
                for k in f.keys():
                    f[k]
        if has["verify"]:
            tensorcanon.verify(P("tiny.st"))
        tensorcanon.loads(tensorcanon.dumps(tiny))
        tensorcanon.save(thousand, P("thousand.st"))  # (untimed: what lazy1k opens)

        times: dict[str, float] = {}
        out: dict = {}

        def timed(key: str, fn, before=None):
            """``fn``'s median time over the child's runs of it; ``before`` (untimed) precedes each."""
            if key in missing:
                return
            runs = []
            for _ in range(max(spec["inner"], spec["short_runs"]) if key in SHORT else spec["inner"]):
                out[key] = None  # the previous run's result (a map, buffers) is gone before the next
                if before is not None:
                    before()
                gc.collect()
                t0 = time.perf_counter()
                result = fn()
                runs.append(time.perf_counter() - t0)
                out[key] = result
                del result
            times[key] = statistics.median(runs)

        def mmap_touch():
            d = tensorcanon.load(P("large.st"), mmap=True)
            total = 0.0
            for t in d.values():
                total += float(t.view(-1)[0])
            return d, total

        def lazy_some():
            with tensorcanon.open(P("large.st")) as f:
                return [f[f'$["{k}"]'] for k in picked]

        def lazy_all():
            with tensorcanon.open(P("large.st")) as f:
                return {k: f[k] for k in f.keys()}

        def lazy_one_of_1000():
            with tensorcanon.open(P("thousand.st")) as f:
                return f['$["layer0500"]']

        def save_config():
            with open(P("config.st"), "wb") as f:
                tensorcanon.save(config, f)

        content: dict[str, str] = {}
        timed("save", lambda: tensorcanon.save(large, P("large.st")), before=lambda: remove(P("large.st")))
        timed("load", lambda: tensorcanon.load(P("large.st")))
        check(all(torch.equal(out["load"][k], v) for k, v in large.items()) and len(out["load"]) == len(large),
              "eager load differs from what was saved")
        content["large"] = value_digest(out["load"])
        out["load"] = None
        timed("mmap", mmap_touch)
        if "mmap" not in missing:
            check(out["mmap"][1] == sum(float(v[0]) for v in large.values()), "mmap load: first elements differ")
            out["mmap"] = None
        timed("lazy8", lazy_some)
        if "lazy8" not in missing:
            check(all(torch.equal(t, large[k]) for t, k in zip(out["lazy8"], picked, strict=True)),
                  "lazy read differs")
        timed("lazyall", lazy_all)
        if "lazyall" not in missing:
            check(len(out["lazyall"]) == len(large)
                  and all(torch.equal(out["lazyall"][f'$["{k}"]'], v) for k, v in large.items()),
                  "lazy read of every tensor differs")
            out["lazyall"] = None
        timed("verify", lambda: tensorcanon.verify(P("large.st")))
        if "verify" not in missing:
            check(out["verify"] == out["save"], f"verify gave {out['verify']}, save {out['save']}")
        versions = {"large": file_version(P("large.st"))}
        os.unlink(P("large.st"))
        timed("small_save", lambda: tensorcanon.save(small, P("small.st")), before=lambda: remove(P("small.st")))
        timed("small_load", lambda: tensorcanon.load(P("small.st")))
        check(len(out["small_load"]) == len(small)
              and all(torch.equal(out["small_load"][k], v) for k, v in small.items()), "small load differs")
        content["small"] = value_digest(out["small_load"])
        versions["small"] = file_version(P("small.st"))
        out["small_load"] = None
        timed("dumps", lambda: tensorcanon.dumps(pyobj))
        blob = out["dumps"]
        timed("loads", lambda: tensorcanon.loads(blob))
        check(out["loads"] == pyobj, "loads(dumps(x)) != x")
        content["loads"] = value_digest(out["loads"])
        versions["dumps"] = file_version(blob)
        timed("lazy1k", lazy_one_of_1000)
        if "lazy1k" not in missing:
            check(torch.equal(out["lazy1k"], thousand["layer0500"]), "lazy read of 1 of 1,000 differs")
        timed("config", save_config)
        check(tensorcanon.load(P("config.st")) == config, "load(save(config)) != config")
        content["config"] = value_digest(tensorcanon.load(P("config.st")))
        versions["config"] = file_version(P("config.st"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    strays = sorted(name for name, m in list(sys.modules.items())
                    if (name == "tensorcanon" or name.startswith("tensorcanon."))
                    and getattr(m, "__file__", None) is not None and not under_tree(m.__file__))
    if strays:
        print(f"modules imported from outside {tree_src}: {strays}", file=sys.stderr)
        return 3
    result = {
        "times": times, "file": tensorcanon.__file__, "python": platform.python_version(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "missing": missing,
        "versions": versions, "content": content,
        "digests": {"large": out["save"], "small": out["small_save"],
                    "dumps": hashlib.sha256(blob).hexdigest()[:32]},
    }
    print(MARK + json.dumps(result), flush=True)
    return 0


def file_version(f: str | bytes) -> int | None:
    """The format version a tensorcanon file (a path, or its bytes) records, read by json, base64 and
    msgpack alone (no tensorcanon: the same reading for any revision's files); None if it has none."""
    import base64
    import struct

    import msgpack

    if isinstance(f, bytes):
        data = f[: 8 + struct.unpack("<Q", f[:8])[0]]
    else:
        with open(f, "rb") as fh:
            data = fh.read(8)
            data += fh.read(struct.unpack("<Q", data)[0])
    meta = json.loads(data[8:]).get("__metadata__", {})
    text = meta.get("tensorcanon.manifest")
    if text is None:
        return None
    m = msgpack.unpackb(base64.b64decode(text), strict_map_key=False)
    return m.get("version", 1) if isinstance(m, dict) else None


def value_digest(value) -> str:
    """A digest of what a load returned that does not depend on the format that held it: every
    tensor's dtype, shape and bytes, every other value's type and text, dict keys in sorted order."""
    import hashlib

    import torch
    import xxhash

    h = hashlib.sha256()

    def feed(v) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(xxhash.xxh3_128_digest(t.reshape(-1).view(torch.uint8).numpy().data) if t.numel() else b"")
        elif isinstance(v, dict):
            h.update(f"{type(v).__name__}{{{len(v)}".encode())
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"{type(v).__name__}[{len(v)}".encode())
            for x in v:
                feed(x)
        else:
            h.update(f"{type(v).__name__}:{v!r};".encode())

    feed(value)
    return h.hexdigest()[:32]


SMALL_CONFIG_VALUES = 60


def small_config() -> dict:
    """A run's config (model and training settings, ~60 values), as training scripts save it."""
    return {
        "model": {"type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
                  "dropout": 0.1, "layer_norm_epsilon": 1e-5, "architectures": ["GPT2LMHeadModel"],
                  "id2label": {i: f"label_{i}" for i in range(10)}},
        "training": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 2000,
                     "max_steps": 100000, "batch_size": 32, "grad_accum": 4, "seed": 1234, "bf16": False,
                     "scheduler": "cosine", "eval_every": 500, "save_every": 1000, "report_to": ["tensorboard"]},
        "git_sha": "990e5c5", "world_size": 8,
    }


def remove(path: str) -> None:
    """Every timed save writes a new file, as the first save of a run does (not over the last one)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def python_values(count: int) -> dict:
    """A nested dict of ``count`` small Python values (groups of 10: ints, floats, strings, bools,
    None, a list of two ints), the kind a checkpoint's config or trainer state holds."""
    return {
        f"group{i:04d}": {
            "id": i, "lr": 1e-3 / (i + 1), "name": f"layer.{i}.weight", "on": i % 3 == 0, "none": None,
            "step": i * 1000 - 7, "decay": i / 7, "tag": "x" * (i % 17), "dims": [i, 2 * i + 1],
        }
        for i in range(count // 10)
    }


# ----------------------------------------------------------------- parent

def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout.strip()


def materialise(repo: str, rev: str, into: str) -> None:
    """``rev``'s src/ under ``into`` (``git archive``, unpacked here: no tar binary, no worktree)."""
    data = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev, "src"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+/3.11.4+: refuse links and paths out of ``into``
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)  # our own repository's archive


def copy_worktree(repo: str, into: str) -> None:
    shutil.copytree(os.path.join(repo, "src"), os.path.join(into, "src"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))


class ChildFailed(Exception):
    pass


def run_child(side: str, src: str, spec: dict, files_dir: str, pin_malloc: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONHASHSEED"] = "0"
    if pin_malloc:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    spec = {**spec, "side": side, "src": src, "dir": files_dir}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          env=env, cwd=files_dir, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise ChildFailed(f"{side} child failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def fmt(x: float) -> str:
    """``x`` to 3 significant digits, without an exponent."""
    if x <= 0 or not math.isfinite(x):
        return f"{x:g}"
    r = float(f"{x:.3g}")
    return f"{r:.{max(0, 2 - math.floor(math.log10(r)))}f}"


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def is_tree(side: str) -> bool:
    """Whether ``--base``/``--head`` names a directory holding ``src/tensorcanon`` (a worktree, an
    unpacked release) rather than a revision."""
    return os.path.isdir(os.path.join(side, "src", "tensorcanon"))


def describe(repo: str, side: str) -> str:
    if side == "worktree":
        return describe_head(repo, side)
    if is_tree(side):
        where = os.path.abspath(side)
        try:
            on = git(where, "rev-parse", "--short", "HEAD")
            changed = [ln for ln in git(where, "status", "--porcelain", "--", "src").splitlines() if ln.strip()]
            state = f"on {on}" + (f", {len(changed)} path(s) in src/ changed from it" if changed else "")
        except (subprocess.CalledProcessError, OSError):
            state = "not a git checkout"
        return f"the directory {where} ({state}; its src/ copied at start)"
    return f"{git(repo, 'rev-parse', '--short', side + '^{commit}')} ({side})"


def materialise_side(repo: str, side: str, into: str) -> None:
    """``side``'s src/ under ``into``: the working tree's or a directory's copied, a revision's archived."""
    if side == "worktree":
        copy_worktree(repo, into)
    elif is_tree(side):
        copy_worktree(os.path.abspath(side), into)
    else:
        materialise(repo, side, into)


def describe_head(repo: str, head: str) -> str:
    if head != "worktree":
        return f"{git(repo, 'rev-parse', '--short', head + '^{commit}')} ({head})"
    changed = [ln for ln in git(repo, "status", "--porcelain", "--", "src").splitlines() if ln.strip()]
    dirty = f", {len(changed)} path(s) in src/ changed from it" if changed else ", src/ as committed"
    return f"working tree (on {git(repo, 'rev-parse', '--short', 'HEAD')}{dirty}; copied at start)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the revision to compare against (e.g. HEAD~1, a tag, a sha), or a directory "
                    "holding src/tensorcanon (another worktree, an unpacked release)")
    ap.add_argument("--head", default="worktree",
                    help="a revision, a directory (as --base), or 'worktree' (default): the working tree's src/")
    ap.add_argument("--runs", type=int, default=None,
                    help="rounds (default 5, --quick 4; an even number puts each side first equally often); "
                         "each runs both sides once")
    ap.add_argument("--dir", default=None,
                    help="where the files go (a temp dir made under it; default /dev/shm if it exists, else "
                         "the system temp dir)")
    ap.add_argument("--quick", action="store_true", help="small sizes (16 MiB, 2,000 small tensors), 4 rounds")
    ap.add_argument("--out", default=None, help="also write the results (markdown) here")
    ap.add_argument("--large-mib", type=int, default=None, help="large checkpoint size (default 256, quick 16)")
    ap.add_argument("--small-count", type=int, default=None, help="1 KiB tensors (default 20000, quick 2000)")
    ap.add_argument("--inner", type=int, default=None,
                    help="runs of each workload inside each child, their median kept (default 3; "
                         "the millisecond ones at least --short-runs)")
    ap.add_argument("--short-runs", type=int, default=SHORT_RUNS,
                    help=f"the least runs of each millisecond workload ({', '.join(SHORT)}) inside each child "
                         f"(default {SHORT_RUNS}; fewer only for a smoke test of this script)")
    ap.add_argument("--malloc-as-is", action="store_true",
                    help="leave glibc's adjustable mmap threshold (default: pinned at 128 KiB in the children, "
                         "so that loads get fresh pages whatever earlier workloads freed; see MALLOC_MMAP_THRESHOLD)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child_main(json.loads(args.child))
    if not args.base:
        ap.error("--base is required")

    runs = args.runs or (4 if args.quick else 5)
    spec = {
        "large_mib": args.large_mib or (16 if args.quick else 256), "large_count": 128,
        "small_count": args.small_count or (2000 if args.quick else 20000), "py_values": 5000,
        "inner": args.inner or 3, "short_runs": args.short_runs,
    }
    repo = git(os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--show-toplevel")
    base_desc, head_desc = describe(repo, args.base), describe(repo, args.head)
    parent = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())

    # SIGTERM (a killed CI job, `timeout`) unwinds like Ctrl-C, so the finally below removes the temp dirs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trees = tempfile.mkdtemp(prefix="tc-compare-src-")
    files_dir = None
    try:
        materialise_side(repo, args.base, os.path.join(trees, "base"))
        materialise_side(repo, args.head, os.path.join(trees, "head"))
        srcs = {side: os.path.join(trees, side, "src") for side in ("base", "head")}
        for side, src in srcs.items():
            if not os.path.isfile(os.path.join(src, "tensorcanon", "__init__.py")):
                raise SystemExit(f"{side}: no src/tensorcanon/__init__.py in that revision")
        files_dir = tempfile.mkdtemp(prefix="tc-compare-", dir=parent)

        load_before = load_average()
        started = time.perf_counter()
        results: dict[str, list[dict]] = {"base": [], "head": []}
        for i in range(runs):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            took = {}
            for side in order:
                t0 = time.perf_counter()
                try:
                    results[side].append(run_child(side, srcs[side], spec, files_dir, not args.malloc_as_is))
                except ChildFailed as e:
                    print(f"round {i + 1}: {e}", file=sys.stderr)
                    return 1
                took[side] = time.perf_counter() - t0
            print(f"round {i + 1}/{runs} ({' then '.join(order)}): "
                  + ", ".join(f"{s} child {took[s]:.1f} s" for s in order), file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - started
        load_after = load_average()
        fs = mounts.filesystem_of(files_dir)
        dir_text = f"{files_dir} ({fs})" if fs != os.path.realpath(files_dir) else files_dir
    finally:
        shutil.rmtree(trees, ignore_errors=True)
        if files_dir:
            shutil.rmtree(files_dir, ignore_errors=True)

    first = results["head"][0]
    if args.malloc_as_is:
        malloc_note = "left adjustable (--malloc-as-is)"
    elif "MALLOC_MMAP_THRESHOLD_" in os.environ:
        malloc_note = f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}, from the environment"
    else:
        malloc_note = (f"pinned at {MALLOC_MMAP_THRESHOLD // 1024} KiB (MALLOC_MMAP_THRESHOLD_: every load gets "
                       "fresh pages)")
    outputs, consistent = outputs_text(results)
    missing = {side: set(results[side][0].get("missing", [])) for side in results}
    rows = []
    for key, label in WORKLOADS:
        lacking = [side for side in ("base", "head") if key in missing[side]]
        if lacking:
            rows.append(f"| {label} | — | — | — | not in {' and '.join(lacking)} "
                        f"(no {NEEDS[key]} there) | 0 |")
            continue
        b = [r["times"][key] for r in results["base"]]
        h = [r["times"][key] for r in results["head"]]
        ratios = [y / x for x, y in zip(b, h, strict=True)]
        rows.append(f"| {label} | {fmt(statistics.median(b))} | {fmt(statistics.median(h))} | "
                    f"{fmt(statistics.median(ratios))} | {fmt(min(ratios))} – {fmt(max(ratios))} | {len(ratios)} |")
    n_large, n_small = spec["large_count"], spec["small_count"]
    md = [
        f"## tensorcanon before/after: base {base_desc} vs head {head_desc}",
        "",
        f"{datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}; Python {first['python']}, "
        f"torch {first['torch']} ({first['threads']} threads); {cpu_model()}, {os.cpu_count()} cores; "
        f"files in {dir_text}; {runs} rounds, one fresh process per side per round (order flipped each "
        f"round), {elapsed:.0f} s in all; load average (1, 5, 15 min) before: {load_before}, after: "
        f"{load_after} ({os.cpu_count()} cores; the run's own children make about 1 of it, the rest is other "
        "processes).",
        "",
        f"Large: {spec['large_mib']} MiB in {n_large} float32 tensors; small: {n_small:,} tensors of 1 KiB; "
        f"Python values: a dict of {spec['py_values'] // 10:,} dicts of 10 values ({spec['py_values']:,} values). "
        f"Each child times each workload {spec['inner']} times"
        + (f" ({', '.join(SHORT)}: {spec['short_runs']})" if spec["inner"] < spec["short_runs"] else "")
        + " and reports the median; the table gives seconds, medians over rounds of those, and head/base, "
        "the median of the per-round ratios (below 1: head is faster). "
        + (f"glibc's mmap threshold: {malloc_note}. " if malloc_note else "")
        + f"Lazy reads of 1 of 1,000: tensors of 4 KiB; the config: {SMALL_CONFIG_VALUES} values.",
        "",
        outputs,
        "",
        "| workload | base (s) | head (s) | head/base | per-round ratios | rounds |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    text = "\n".join(md)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if consistent else 2


def outputs_text(results: dict[str, list[dict]]) -> tuple[str, bool]:
    """What the two sides' operations gave, compared as operations (not files): ``(the report's
    paragraph, whether they agree)``. They agree when every child of both sides loaded the same values
    (format-independent digests) and, for each output both sides wrote in the same format version,
    wrote the same bytes; outputs in different versions are expected to differ."""
    children = [r for side in ("base", "head") for r in results[side]]
    version = {side: {k: v for k, v in results[side][0].get("versions", {}).items()} for side in results}
    lines, ok = [], True
    content_keys = sorted(set.intersection(*(set(r.get("content", {})) for r in children)))
    unequal = [k for k in content_keys if len({r["content"][k] for r in children}) != 1]
    if not content_keys:
        lines.append("The children reported no loaded values to compare (a side too old to report them).")
    elif unequal:
        ok = False
        lines.append(f"**The sides loaded different values** ({', '.join(unequal)}): the two revisions do not do "
                     "the same operations, and their times do not compare.")
    else:
        lines.append(f"Both sides loaded equal values ({', '.join(content_keys)}: every tensor's dtype, shape and "
                     "bytes and every Python value, digested the same way on both sides).")
    same_version = [k for k in results["head"][0]["digests"]
                    if version["base"].get(k) is not None and version["base"].get(k) == version["head"].get(k)]
    identical = [k for k in same_version if len({r["digests"][k] for r in children}) == 1]
    changed = [k for k in same_version if k not in identical]
    other = {k: (version["base"].get(k), version["head"].get(k)) for k in results["head"][0]["digests"]
             if k not in same_version}
    if identical:
        lines.append(f"Written in the same format version on both sides ({', '.join(identical)}: version "
                     f"{version['head'][identical[0]]}): byte-identical files.")
    if changed:
        ok = False
        lines.append(f"**Written in the same format version on both sides but not byte-identical** "
                     f"({', '.join(changed)}): a change of the bytes that format version promises.")
    if other:
        text = ", ".join(f"{k}: version {b} in base, {h} in head" for k, (b, h) in other.items())
        lines.append(f"Written in different format versions ({text}): their bytes differ by design and are not "
                     "compared; the operations are.")
    return " ".join(lines), ok


if __name__ == "__main__":
    sys.exit(main())
