"""The store's codecs alone (src/tensorcanon/store/compress.py) on store_bench.py's training workloads.

The full AdamW training of store_bench.py (a 4-layer d=256 transformer, fp32 and pure bf16 state,
checkpoints EVERY steps apart) is run once and its checkpoints kept in memory; then every tensor of
every later checkpoint is encoded as the store would encode it (against the same tensor of the
previous checkpoint: a chain of at most SAVES - 1 links) and decoded back through its whole chain,
each link hashed as a reader hashes it. Printed: stored bytes / raw and / byte-grouped zstd of the
same state (every plane at level 1, and at level 3), per kind of tensor, and the CPU time of
encoding and of decoding (MB/s of logical bytes per CPU second: the machine is shared, wall time
says little). With --ab OTHER_SRC, the same measurement runs in fresh processes alternately with
this tree's src and OTHER_SRC (e.g. /work/main/src), ROUNDS rounds each, on the same states.

    python benchmarks/store_codecs.py [--quick] [--ab /work/main/src] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def kind(name: str) -> str:
    for k in ("exp_avg_sq", "exp_avg", "step"):
        if name.endswith(k):
            return k
    return "param"


def states(dtype_name: str, saves: int, every: int, cache: str | None) -> list[dict[str, tuple[int, np.ndarray]]]:
    """The training checkpoints: per checkpoint, name -> (element size, flat bytes)."""
    if cache and os.path.exists(cache):
        with np.load(cache) as z:
            out: list[dict] = [{} for _ in range(saves)]
            for key in z.files:
                k, size, name = key.split("|", 2)
                out[int(k)][name] = (int(size), z[key])
            return out
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import store_bench

    torch.set_num_threads(1)  # (the states are what matters, not the speed: one thread wastes none spinning)
    model = store_bench.transformer(getattr(torch, dtype_name))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(saves):
        for _ in range(every):
            ids = torch.randint(0, 4096, (8, 32), generator=g)
            loss = torch.nn.functional.cross_entropy(model(ids).float().reshape(-1, 4096), ids.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        state: dict[str, tuple[int, np.ndarray]] = {}
        for name, t in model.state_dict().items():
            state[f"model/{name}"] = (t.element_size(), t.detach().reshape(-1).view(torch.uint8).numpy().copy())
        for i, s in opt.state_dict()["state"].items():
            for k, t in s.items():
                state[f"opt/{i}/{k}"] = (t.element_size(), t.detach().reshape(-1).view(torch.uint8).numpy().copy())
        out.append(state)
    if cache:
        np.savez(cache, **{f"{i}|{k}|{name}": a for i, st in enumerate(out) for name, (k, a) in st.items()})
    return out


def grouped_bytes(z, a: np.ndarray, k: int, level: int) -> int:
    """Byte-grouped zstd (ZipNN's idea): every plane one frame at ``level``, or stored where that is smaller."""
    if len(a) < 512:
        return len(a)
    c = z.ZstdCompressor(level=level)
    planes = [np.ascontiguousarray(p) for p in a.reshape(-1, k).T] if k > 1 else [a]
    return min(len(a), sum(min(len(p), len(c.compress(p))) for p in planes))


def measure(path: str) -> dict:
    """The codecs of the tensorcanon on sys.path, on the states saved in ``path``."""
    from tensorcanon.format import digest
    from tensorcanon.store import compress, layout

    z = compress.zstd()
    result: dict = {"compress": compress.__file__}
    with np.load(path) as f:
        meta = json.loads(bytes(f["meta"]).decode())
    for dtype_name in meta["dtypes"]:
        cps = states(dtype_name, meta["saves"], meta["every"], meta["cache"][dtype_name])
        sizes: collections.Counter = collections.Counter()
        per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        codecs: collections.Counter = collections.Counter()
        enc_cpu = dec_cpu = 0.0
        logical = decoded_bytes = 0
        blobs: dict[str, list[bytes]] = collections.defaultdict(list)   # name -> its chain, blob by blob
        for ci, state in enumerate(cps):
            for name, (k, a) in state.items():
                base = None
                if ci > 0 and name in cps[ci - 1] and len(cps[ci - 1][name][1]) == len(a):
                    base = cps[ci - 1][name][1]
                c0 = time.process_time()
                enc = compress.encode(a, k, base, pool=False)
                is_delta = enc.codec not in (layout.RAW, layout.ZSTD, layout.GROUPED)
                prefix = b"uint8[%d]" % len(a) if k == 1 else {2: b"int16", 4: b"int32", 8: b"int64"}[k] + \
                    b"[%d]" % (len(a) // k)
                head = layout.header_bytes(enc.codec, len(blobs[name]) if is_delta else 0, prefix, len(a),
                                           b"\0" * 16 if is_delta else None, enc.planes)
                blob = b"".join([head, *(bytes(memoryview(p).cast("B")) for p in enc.pieces)])
                enc_cpu += time.process_time() - c0
                if not is_delta:
                    blobs[name] = []
                blobs[name].append(blob)
                if ci == 0:
                    continue
                logical += len(a)
                sizes["stored"] += len(blob)
                sizes["raw"] += len(a)
                per[kind(name)]["stored"] += len(blob)
                per[kind(name)]["raw"] += len(a)
                codecs[layout.CODECS[enc.codec]] += 1
                for level in (1, 3):
                    g = grouped_bytes(z, a, k, level)
                    sizes[f"grouped{level}"] += g
                    per[kind(name)][f"grouped{level}"] += g
                # decode the chain as a reader does: every link decoded into a new buffer and hashed
                c0 = time.process_time()
                out = None
                for blob in blobs[name]:
                    h = layout.parse_header(blob[: layout.HEAD], len(blob), "b")
                    prev = out
                    out = np.empty(h.size, np.uint8)
                    compress.decode_into(h, blob, out.data, (lambda p=prev: p), "b", pool=False)
                    hasher = digest.constructor("xxh3-128")(h.prefix)
                    hasher.update(out)
                    hasher.digest()
                    decoded_bytes += h.size
                dec_cpu += time.process_time() - c0
                assert out is not None and out.tobytes() == a.tobytes(), name
        result[dtype_name] = {
            "stored_over_raw": sizes["stored"] / sizes["raw"],
            "grouped1_over_raw": sizes["grouped1"] / sizes["raw"],
            "grouped3_over_raw": sizes["grouped3"] / sizes["raw"],
            "stored_over_grouped1": sizes["stored"] / sizes["grouped1"],
            "stored_over_grouped3": sizes["stored"] / sizes["grouped3"],
            "per_kind": {k: {"stored_over_raw": v["stored"] / v["raw"], "grouped1_over_raw": v["grouped1"] / v["raw"]}
                         for k, v in sorted(per.items())},
            "codecs": dict(codecs),
            "encode_mb_per_cpu_s": logical / enc_cpu / 1e6,
            "decode_chain_mb_per_cpu_s": logical / dec_cpu / 1e6,
            "decode_blob_mb_per_cpu_s": decoded_bytes / dec_cpu / 1e6,
        }
    return result


def store_speed(mib: int, repeat: int = 3) -> dict:
    """store_bench.py's throughput workload through tensorcanon.Store: 64 fp32 tensors drifting by
    1e-4, tag ``a`` whole, tag ``b`` a delta against it; the save of ``b`` and loads of ``b`` by fresh
    Store objects. Best of ``repeat`` (wall), with the CPU time of that process."""
    import shutil

    import torch

    import tensorcanon as tc

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(2)
    n = mib * (1 << 20) // 4 // 64
    a = {f"w{i}": torch.randn(n, generator=g) for i in range(64)}
    b = {k: v + 1e-4 * torch.randn(n, generator=g) for k, v in a.items()}
    size = mib * (1 << 20)
    out: dict = {"mib": mib}
    saves, loads = [], []
    for _ in range(repeat):
        root = tempfile.mkdtemp(prefix="store-codecs-")
        try:
            store = tc.Store(os.path.join(root, "s"))
            store.save("a", a)
            w, c = time.perf_counter(), time.process_time()
            store.save("b", b)
            saves.append((time.perf_counter() - w, time.process_time() - c))
            for _ in range(2):
                w, c = time.perf_counter(), time.process_time()
                back = tc.Store(os.path.join(root, "s")).load("b")
                loads.append((time.perf_counter() - w, time.process_time() - c))
            assert all(torch.equal(back[k], b[k]) for k in b)
            out["codecs"] = tc.Store(os.path.join(root, "s")).stats()["codecs"]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    s, lo = min(saves), min(loads)
    out.update({"save_mb_s": size / s[0] / 1e6, "save_cpu_s": s[1], "load_gb_s": size / lo[0] / 1e9,
                "load_cpu_s": lo[1], "save_s": s[0], "load_s": lo[0]})
    return out


def show(r: dict) -> None:
    print(f"  {r['compress']}")
    for d, v in r.items():
        if not isinstance(v, dict):
            continue
        kinds = ", ".join(f"{k} {x['stored_over_raw']:.3f}" for k, x in v["per_kind"].items() if k != "step")
        print(f"  {d}: stored/raw {v['stored_over_raw']:.4f} (grouped zstd L1 {v['grouped1_over_raw']:.4f}, L3 "
              f"{v['grouped3_over_raw']:.4f}); stored/grouped L1 {v['stored_over_grouped1']:.4f}, L3 "
              f"{v['stored_over_grouped3']:.4f}; {kinds}; codecs {v['codecs']}; encode "
              f"{v['encode_mb_per_cpu_s']:.0f} MB/cpu-s, decode (chains) {v['decode_chain_mb_per_cpu_s']:.0f} MB/cpu-s "
              f"({v['decode_blob_mb_per_cpu_s']:.0f} per blob)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="3 checkpoints 5 steps apart (a smoke run)")
    parser.add_argument("--ab", metavar="OTHER_SRC", help="also measure the tensorcanon under OTHER_SRC, alternately")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", metavar="DIR", help="keep (and reuse) the training states here")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--store", type=int, metavar="MIB", default=0,
                        help="instead: the save and load speed of a MIB-MiB delta tag through tensorcanon.Store")
    parser.add_argument("--measure", metavar="META", help=argparse.SUPPRESS)  # (a child of --ab)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(store_speed(args.store) if args.store else measure(args.measure)))
        return
    saves, every = (3, 5) if args.quick else (6, 100)
    folder = args.cache or tempfile.mkdtemp(prefix="store-codecs-")
    os.makedirs(folder, exist_ok=True)
    meta = os.path.join(folder, "meta.npz")
    if not args.store:
        cache = {d: os.path.join(folder, f"{d}-{saves}x{every}.npz") for d in ("float32", "bfloat16")}
        for d in cache:
            states(d, saves, every, cache[d])  # (trained once, here)
        np.savez(meta, meta=np.frombuffer(json.dumps({"dtypes": list(cache), "saves": saves, "every": every,
                                                      "cache": cache}).encode(), np.uint8))
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    trees = [("this tree", here)] + ([("other", args.ab)] if args.ab else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds if args.ab else 1):
        for name, src in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=src)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", meta,
                                  "--store", str(args.store)], env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(res)
            print(f"round {r + 1}, {name}:")
            if args.store:
                print(f"  {res['mib']} MiB delta tag ({res['codecs']}): save {res['save_mb_s']:.0f} MB/s "
                      f"(wall {res['save_s'] * 1e3:.0f} ms, CPU {res['save_cpu_s'] * 1e3:.0f} ms); load "
                      f"{res['load_gb_s']:.2f} GB/s (wall {res['load_s'] * 1e3:.0f} ms, CPU "
                      f"{res['load_cpu_s'] * 1e3:.0f} ms)", flush=True)
            else:
                show(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
