"""tensorcanon.Store against the issue's targets (issue 39, "Must hold"; docs/STORE.md; RESULTS.md).

Workload 1, frozen base + trainable head or adapters: a small GPT-2 (transformers, random init, no
download) with LoRA adapters (peft, if installed) and a plain torch model with a frozen trunk and a
trainable head; AdamW on the trainable parameters. After the first checkpoint, every save should
store at most 1.05x the bytes of the tensors that changed (trainable parameters + optimizer state)
and take at most 1.2x a plain tensorcanon.save of only those: measured for Store.save, and for
Store.save_async (the time until it returns, the training loop's wait; and until its tag is listed).

Workload 2, full AdamW training of a 4-layer d=256 transformer, checkpoints 100 steps apart, fp32
and pure bf16 state: stored bytes per later checkpoint against raw (targets 0.75 fp32, 0.55 bf16)
and against byte-grouped zstd of the same state (target 0.95); every tag loads bit-exact.

Throughput: save with compression (MB/s of logical bytes), load (GB/s), and a save of changed
tensors without compression against tensorcanon.save.

Times are medians (wall, and CPU of all threads beside them) of repetitions; where several loads
are compared, their repetitions alternate (a round loads each once), so a burst of other work on a
shared machine slows each alike instead of deciding which one's best-of wins. Workload 2 reports
the load of its first tag (every blob whole) and of its last (the longest delta chains: depth
saves - 1, at most CHAIN).

    python benchmarks/store_bench.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch

import tensorcanon as tc
from tensorcanon.store import compress, store as store_module


def dir_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(folder, f))
    return total


def stored(root: str) -> int:
    return sum(dir_bytes(os.path.join(root, d)) for d in ("blobs", "packs", "tags"))


def tensors_of(obj):
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(obj)
    return out


CPU: dict = {}  # the median CPU time (all threads) of the runs of each function timed, by name


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def timed(fn, *args, repeat=1, name=None):
    """The median wall time of ``repeat`` runs of ``fn(*args)``, and its last result; the median
    CPU time goes to ``CPU[name]``."""
    walls, cpus = [], []
    out = None
    for _ in range(repeat):
        out = None  # (the previous result freed before the next run)
        start, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    if name:
        CPU[name] = median(cpus)
    return median(walls), out


def interleaved(fns: dict, rounds: int) -> dict:
    """``{name: (median wall s, median CPU s)}`` of ``rounds`` rounds, each calling every function
    once, in turn (the order reversed every other round)."""
    walls: dict = {k: [] for k in fns}
    cpus: dict = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            start, cpu = time.perf_counter(), time.process_time()
            fns[k]()
            walls[k].append(time.perf_counter() - start)
            cpus[k].append(time.process_time() - cpu)
    return {k: (median(walls[k]), median(cpus[k])) for k in fns}


# ------------------------------------------------------------------ workload 1: frozen base + trainable part

def gpt2_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128)
    model = get_peft_model(GPT2LMHeadModel(cfg), LoraConfig(r=8, target_modules=["c_attn", "c_proj"]))

    def batch():
        ids = torch.randint(0, cfg.vocab_size, (4, 64))
        return lambda m: m(input_ids=ids, labels=ids).loss

    return "transformers GPT-2 (4x256) + peft LoRA r=8", model, batch


def plain_head():
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(6)])
    for p in trunk.parameters():
        p.requires_grad_(False)
    model = torch.nn.Sequential(trunk, torch.nn.Linear(1024, 10))

    def batch():
        x, y = torch.randn(32, 1024), torch.randint(0, 10, (32,))
        return lambda m: torch.nn.functional.cross_entropy(m(x), y)

    return "plain torch: frozen 6x1024 MLP trunk + trainable head", model, batch


def workload_frozen(make, saves, steps) -> dict:
    # Two identical models trained in lockstep: one saved into the store, its twin's changed
    # tensors with tc.save, each save the first thing after its own model's training steps (a
    # save timed right after a step pays for caches the step evicted; the one after it would not)
    # A third twin is saved with save_async into a store of its own: the time until it returns (what
    # the training loop waits for) and until its future is done (waited for before anything else runs).
    name, model, batch = make()
    _, twin, _ = make()
    _, third, _ = make()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (model, twin, third)]
    root = tempfile.mkdtemp(prefix="store-bench-")
    changed_file = os.path.join(root, "changed.safetensors")
    store = tc.Store(os.path.join(root, "s"))
    background = tc.Store(os.path.join(root, "b"))
    rows = []

    def train(m, opt):
        for _ in range(steps):
            loss = batch()(m)
            loss.backward()
            opt.step()
            opt.zero_grad()

    try:
        for k in range(saves):
            train(model, opts[0])
            state = {"model": model.state_dict(), "optimizer": opts[0].state_dict()}
            before = stored(os.path.join(root, "s")) if k else 0
            t_store, _ = timed(store.save, f"step-{k}", state, name="store")
            train(twin, opts[1])
            changed = {"trainable": {n: p.detach() for n, p in twin.named_parameters() if p.requires_grad},
                       "optimizer": opts[1].state_dict()}
            t_plain, _ = timed(tc.save, changed, changed_file, name="plain")
            after = stored(os.path.join(root, "s"))
            changed_bytes = sum(t.numel() * t.element_size() for t in tensors_of(changed))
            # the floor of a store's save: the same state saved again, nothing new to write
            # (the plan of every tensor, the cache's lookups, the record written durably)
            t_same, _ = timed(store.save, f"step-{k}-again", state)
            train(third, opts[2])
            state3 = {"model": third.state_dict(), "optimizer": opts[2].state_dict()}
            start = time.perf_counter()
            pending = background.save_async(f"step-{k}", state3)
            t_returned = time.perf_counter() - start
            pending.result()
            t_done = time.perf_counter() - start
            rows.append({"save": k, "stored_bytes": after - before, "changed_bytes": changed_bytes,
                         "store_save_s": t_store, "plain_save_of_changed_s": t_plain,
                         "store_save_unchanged_s": t_same,
                         "save_async_returned_s": t_returned, "save_async_done_s": t_done,
                         "store_save_cpu_s": CPU["store"], "plain_save_of_changed_cpu_s": CPU["plain"],
                         "logical_bytes": len(tc.dumps(state))})
            assert tc.fingerprint(store.load(f"step-{k}")) == tc.fingerprint(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    later = rows[1:]
    return {"workload": name, "rows": rows,
            "stored_over_changed": max(r["stored_bytes"] / r["changed_bytes"] for r in later),
            "time_over_plain": statistics.median(r["store_save_s"] / r["plain_save_of_changed_s"] for r in later),
            "time_over_plain_max": max(r["store_save_s"] / r["plain_save_of_changed_s"] for r in later),
            "unchanged_over_plain": statistics.median(r["store_save_unchanged_s"] / r["plain_save_of_changed_s"]
                                                      for r in later),
            "async_returned_over_plain": statistics.median(r["save_async_returned_s"] / r["plain_save_of_changed_s"]
                                                           for r in later),
            "async_returned_over_plain_max": max(r["save_async_returned_s"] / r["plain_save_of_changed_s"]
                                                 for r in later),
            "async_done_over_plain": statistics.median(r["save_async_done_s"] / r["plain_save_of_changed_s"]
                                                       for r in later),
            "cpu_over_plain": statistics.median(r["store_save_cpu_s"] / r["plain_save_of_changed_cpu_s"]
                                                for r in later),
            "trainable_fraction": later[-1]["changed_bytes"] / later[-1]["logical_bytes"]}


# ------------------------------------------------------------------ workload 2: full AdamW training

def transformer(dtype):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.TransformerEncoder(layer, 4),
                                torch.nn.Linear(256, 4096)).to(dtype)
    return model


def grouped_size(state) -> int:
    """Byte-grouped zstd of every tensor of ``state`` (ZipNN's idea; the same zstd level as the store)."""
    z = compress.zstd()
    total = 0
    for t in tensors_of(state):
        data = compress.as_u8(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        k = t.element_size()
        if len(data) < compress.MIN_COMPRESS:
            total += len(data)
            continue
        planes, _ = compress._grouped(z, data, k, False)
        total += min(len(data), sum(n for _, n in planes))
    return total


def workload_training(dtype, saves, every) -> dict:
    model = transformer(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    root = tempfile.mkdtemp(prefix="store-bench-")
    store = tc.Store(os.path.join(root, "s"))
    rows, states = [], []
    try:
        for k in range(saves):
            for _ in range(every):
                ids = torch.randint(0, 4096, (8, 32), generator=g)
                out = model(ids)
                loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, 4096), ids.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            raw = sum(t.numel() * t.element_size() for t in tensors_of(state))
            before = stored(os.path.join(root, "s"))
            t_save, digest = timed(store.save, f"step-{(k + 1) * every}", state)
            rows.append({"step": (k + 1) * every, "raw_bytes": raw,
                         "stored_bytes": stored(os.path.join(root, "s"))
                         - before, "grouped_zstd_bytes": grouped_size(state), "save_s": t_save,
                         "logical_bytes": len(tc.dumps(state))})
            states.append((f"step-{(k + 1) * every}", digest))
        fresh = tc.Store(os.path.join(root, "s"))
        exact = all(tc.fingerprint(fresh.load(tag)) == digest for tag, digest in states)
        loads = interleaved({"first": lambda: tc.Store(os.path.join(root, "s")).load(states[0][0]),
                             "last": lambda: tc.Store(os.path.join(root, "s")).load(states[-1][0])}, 5)
        stats = fresh.stats()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    later = rows[1:]
    raw = sum(r["raw_bytes"] for r in later)
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "codecs": stats["codecs"],
            "stored_over_raw": sum(r["stored_bytes"] for r in later) / raw,
            "grouped_over_raw": sum(r["grouped_zstd_bytes"] for r in later) / raw,
            "stored_over_grouped": sum(r["stored_bytes"] for r in later) / sum(r["grouped_zstd_bytes"] for r in later),
            "save_mb_s": sum(r["logical_bytes"] for r in later) / sum(r["save_s"] for r in later) / 1e6,
            "load_gb_s": rows[-1]["logical_bytes"] / loads["last"][0] / 1e9,
            "load_cpu_s": loads["last"][1], "load_depth": min(saves - 1, store_module.CHAIN),
            "load_first_gb_s": rows[0]["logical_bytes"] / loads["first"][0] / 1e9,
            "load_first_cpu_s": loads["first"][1],
            "every_load_bit_exact": exact}


# ------------------------------------------------------------------ throughput

def throughput(mib: int) -> dict:
    g = torch.Generator().manual_seed(2)
    n = mib * (1 << 20) // 4 // 64
    a = {f"w{i}": torch.randn(n, generator=g) for i in range(64)}
    b = {k: v + 1e-4 * torch.randn(n, generator=g) for k, v in a.items()}
    c = {k: v + 1e-4 * torch.randn(n, generator=g) for k, v in b.items()}
    root = tempfile.mkdtemp(prefix="store-bench-")
    out: dict = {"logical_mib": mib}
    try:
        t_plain, _ = timed(tc.save, c, os.path.join(root, "plain.safetensors"), repeat=3, name="plain")
        store = tc.Store(os.path.join(root, "s"))
        store.save("a", a)
        t_b, _ = timed(store.save, "b", b)  # delta against a: the compressed path
        real = compress.zstd
        compress.zstd = lambda: None  # no compression: every blob raw
        try:
            raw = tc.Store(os.path.join(root, "raw"))
            t_new, _ = timed(raw.save, "c", c, name="raw_new")  # a new store: its creation included
            # a store that exists, a save of changed tensors, against tc.save of the same tensors:
            # rounds of new content, the two alternating (each writes 256 MiB that the disk flushes
            # while the next runs), the median of each; each tc.save to a new name, as the store
            # writes new files (replacing a file of 256 MiB frees its blocks inside the save)
            plain_s, raw_s, plain_cpu, raw_cpu = [], [], [], []
            for r in range(5):
                d = {k: v + (r + 1) * 1e-4 for k, v in c.items()}
                plain_s.append(timed(tc.save, d, os.path.join(root, f"plain-{r}.safetensors"), name="p")[0])
                raw_s.append(timed(raw.save, f"d{r}", d, name="r")[0])
                plain_cpu.append(CPU["p"])
                raw_cpu.append(CPU["r"])
                del d
            t_c, t_plain_c = statistics.median(raw_s), statistics.median(plain_s)
            CPU["raw"], CPU["plain_c"] = statistics.median(raw_cpu), statistics.median(plain_cpu)
        finally:
            compress.zstd = real
        loads = interleaved({"compressed": lambda: tc.Store(os.path.join(root, "s")).load("b"),
                             "raw": lambda: tc.Store(os.path.join(root, "raw")).load("c"),
                             "tc": lambda: tc.load(os.path.join(root, "plain.safetensors"))}, 5)
        (t_load, cpu_load), (t_raw_store_load, _), (t_raw_load, _) = loads["compressed"], loads["raw"], loads["tc"]
        size = mib * (1 << 20)
        out.update({"save_compressed_mb_s": size / t_b / 1e6, "load_compressed_gb_s": size / t_load / 1e9,
                    "load_compressed_cpu_s": cpu_load,
                    "save_uncompressed_over_tc_save": t_plain_c / t_c,
                    "save_uncompressed_over_tc_save_cpu": CPU["plain_c"] / CPU["raw"],
                    "save_uncompressed_new_store_over_tc_save": t_plain / t_new,
                    "load_raw_blobs_gb_s": size / t_raw_store_load / 1e9, "tc_load_gb_s": size / t_raw_load / 1e9,
                    "tc_save_mb_s": size / t_plain / 1e6})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer saves and steps (a smoke run)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(2)
    saves, every, steps, mib = (3, 5, 2, 16) if args.quick else (6, 100, 20, 256)
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                                f"torch {torch.__version__}", "chain": store_module.CHAIN, "zstd_level": compress.LEVEL}
    frozen = []
    try:
        frozen.append(workload_frozen(gpt2_lora, saves, steps))
    except ImportError as e:
        results["peft"] = f"not installed ({e}); the plain torch model only"
    frozen.append(workload_frozen(plain_head, saves, steps))
    results["frozen_base"] = frozen
    results["training"] = [workload_training(d, saves, every) for d in (torch.float32, torch.bfloat16)]
    results["throughput"] = throughput(mib)
    for w in frozen:
        print(f"{w['workload']}: stored/changed {w['stored_over_changed']:.3f} (target <= 1.05), "
              f"save time / tc.save of changed {w['time_over_plain']:.2f} (median of the later saves, "
              f"max {w['time_over_plain_max']:.2f}; target <= 1.2; CPU {w['cpu_over_plain']:.2f}); "
              f"the floor, a save with nothing new / tc.save of changed {w['unchanged_over_plain']:.2f}; "
              f"save_async returns in {w['async_returned_over_plain']:.2f}x (max "
              f"{w['async_returned_over_plain_max']:.2f}), done in {w['async_done_over_plain']:.2f}x")
    for w in results["training"]:
        print(f"AdamW {w['dtype']}: stored/raw {w['stored_over_raw']:.3f}, "
              f"grouped zstd/raw {w['grouped_over_raw']:.3f}, "
              f"stored/grouped {w['stored_over_grouped']:.3f} (target <= 0.95); save {w['save_mb_s']:.0f} MB/s, "
              f"load of the last tag (chains of {w['load_depth']} deltas) {w['load_gb_s']:.2f} GB/s (CPU "
              f"{w['load_cpu_s']:.3f} s), of the first {w['load_first_gb_s']:.2f} GB/s "
              f"(CPU {w['load_first_cpu_s']:.3f} s); "
              f"bit-exact {w['every_load_bit_exact']}; codecs {w['codecs']}")
    t = results["throughput"]
    print(f"throughput ({t['logical_mib']} MiB fp32): save compressed {t['save_compressed_mb_s']:.0f} MB/s (>= 300), "
          f"load compressed {t['load_compressed_gb_s']:.2f} GB/s (CPU {t['load_compressed_cpu_s']:.2f} s), "
          f"load raw blobs {t['load_raw_blobs_gb_s']:.2f} GB/s "
          f"(>= 1; tc.load {t['tc_load_gb_s']:.2f}), uncompressed save speed / tc.save "
          f"{t['save_uncompressed_over_tc_save']:.2f} (>= 0.9; CPU {t['save_uncompressed_over_tc_save_cpu']:.2f}; "
          f"into a new store {t['save_uncompressed_new_store_over_tc_save']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
