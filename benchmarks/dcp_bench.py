"""tensorcanon.dcp against DCP's default FileSystemWriter/Reader, side by side in one run.

Run from the repository root::

    python benchmarks/dcp_bench.py                  # 2 ranks x 256 MiB on /dev/shm, 5 runs
    python benchmarks/dcp_bench.py --mib 16 --runs 1  # a smoke test

``--world`` processes (gloo on 127.0.0.1) each hold ``--mib`` MiB of DTensor
shards (float32 tensors sharded on dimension 0, FSDP's layout, plus a few
tensors sharded on dimension 1, and a step counter and a config dict). Each
figure is the median of ``--runs`` runs, taken in rounds (every operation once,
then again) so that noise falls on all of them alike; a run is timed from a
barrier before the operation to a barrier after it, so it is the slowest rank's
time. Operations:

- save: DCP's default (``FileSystemWriter``: torch.save per rank, a pickled
  ``.metadata``) and ``tensorcanon.dcp.save`` (canonical rank files, the index,
  and the logical digest, which hashes every split tensor once more in C order);
- load into a fresh state of the same sharding: DCP's default (``FileSystemReader``,
  no verification) and ``tensorcanon.dcp.load`` (every chunk hashed against its digest);
- async_save with the thread executor: the time until it returns (the training
  loop's pause); the upload is then awaited, untimed.

Targets (issue 14): save ≤ 1.1× DCP's, load ≤ 1.1× DCP's, async blocking ≤ DCP's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ worker


def _state(mib: int, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tensorcanon.dcp._compat import DTensor, Shard  # wherever this torch keeps them

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    count = max(1, mib // 8)                        # 8 MiB per rank per tensor
    model = {}
    for i in range(count):
        dim = 1 if i % 8 == 7 else 0                # one tensor in eight sharded on dimension 1
        local = torch.rand(8 * MiB // 4 // 512, 512, generator=g)
        shape = (local.shape[0] * world, 512) if dim == 0 else (local.shape[0], 512 * world)
        model[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                                         shape=torch.Size(shape),
                                                         stride=torch.empty(shape, device="meta").stride())
    return {"model": model, "step": 1000, "config": {"lr": 3e-4, "name": "bench"}}


def _fresh_like(state):
    import torch

    from tensorcanon.dcp._compat import DTensor

    model = {k: DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements,
                                   shape=v.shape, stride=v.stride()) for k, v in state["model"].items()}
    return {"model": model, "step": 0, "config": {"lr": 0.0, "name": ""}}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import tensorcanon.dcp as tcd

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = _state(args.mib, world)
    # async_save runs DCP's collectives from a background thread: give them their own group, so
    # they never interleave with this thread's barriers on the default group (DCP's advice).
    async_group = dist.new_group(backend="gloo")
    base = args.folder
    d_default, d_tc = os.path.join(base, "default"), os.path.join(base, "tensorcanon")

    def clean(folder):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    digest = None

    def tc_save():
        nonlocal digest
        digest = tcd.save(state, d_tc)

    ops = {
        "save: DCP default (FileSystemWriter)": (lambda: clean(d_default),
                                                 lambda: dcp.save(state, storage_writer=FileSystemWriter(d_default))),
        "save: tensorcanon.dcp (incl. logical digest)": (lambda: clean(d_tc), tc_save),
    }
    loads = {
        "load: DCP default (FileSystemReader, no verification)":
            lambda target: dcp.load(target, storage_reader=FileSystemReader(d_default)),
        "load: tensorcanon.dcp (every chunk verified)": lambda target: tcd.load(target, d_tc),
    }
    times: dict[str, list[float]] = {k: [] for k in [*ops, *loads, "async_save blocking: DCP default",
                                                        "async_save blocking: tensorcanon.dcp"]}
    for _ in range(args.runs):
        for name, (setup, fn) in ops.items():
            setup()
            times[name].append(timed(fn))
        for name, fn in loads.items():
            target = _fresh_like(state)
            times[name].append(timed(lambda f=fn, t=target: f(t)))
        for name, run in [("async_save blocking: DCP default",
                           lambda: dcp.async_save(state, storage_writer=FileSystemWriter(d_default + "-async"),
                                                  process_group=async_group)),
                          ("async_save blocking: tensorcanon.dcp",
                           lambda: tcd.async_save(state, d_tc + "-async", process_group=async_group))]:
            clean(d_default + "-async")
            clean(d_tc + "-async")
            holder = []
            times[name].append(timed(lambda run=run, holder=holder: holder.append(run())))
            holder[0].result()
            dist.barrier()
    assert tcd.verify(d_tc) == digest if rank == 0 else True
    if rank == 0:
        with open(os.path.join(base, "result.json"), "w") as fh:
            json.dump({"times": times, "digest": digest, "world": world, "mib": args.mib}, fh)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ parent


def _fmt(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


TARGETS = (  # (ratio, tensorcanon's operation, DCP's, target, limit)
    ("save, vs DCP default", "save: tensorcanon.dcp (incl. logical digest)",
     "save: DCP default (FileSystemWriter)", "≤ 1.1×", 1.1),
    ("load (verified), vs DCP default", "load: tensorcanon.dcp (every chunk verified)",
     "load: DCP default (FileSystemReader, no verification)", "≤ 1.1×", 1.1),
    ("async_save blocking, vs DCP default", "async_save blocking: tensorcanon.dcp",
     "async_save blocking: DCP default", "≤ 1×", 1.0),
)


def run(world: int = 2, mib: int = 256, runs: int = 5, folder_in: str | None = None,
        timeout: float = 1800.0) -> dict:
    """Run the benchmark in ``world`` fresh processes; ``{"times": {operation: [s, ...]}, "digest": ...,
    "seconds": wall time}`` (benchmarks/run.py calls this too, for RESULTS.md)."""
    folder = tempfile.mkdtemp(prefix="tensorcanon-dcp-bench-", dir=folder_in)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    started = time.time()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--folder", folder,
                               "--mib", str(mib), "--runs", str(runs)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
    try:
        for p in procs:
            p.wait(max(1.0, timeout - (time.time() - started)))
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a DCP benchmark worker failed (exit codes {[p.returncode for p in procs]})")
        with open(os.path.join(folder, "result.json")) as fh:
            result = json.load(fh)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
    result["seconds"] = time.time() - started
    return result


def ratios(result: dict) -> list[tuple[str, float, str, bool]]:
    """``(what, measured ratio of medians, target, met)`` for each target."""
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    return [(name, med[tc] / med[dcp], target, med[tc] <= limit * med[dcp])
            for name, tc, dcp, target, limit in TARGETS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256, help="MiB of tensor data per rank (default 256)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    try:
        result = run(args.world, args.mib, args.runs, args.dir, args.timeout)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"# tensorcanon.dcp vs DCP default: {args.world} ranks x {args.mib} MiB, "
          f"{args.runs} runs, files in {args.dir or 'a temp dir'} ({result['seconds']:.0f} s)\n")
    print("| operation | median | fastest – slowest |")
    print("| --- | --- | --- |")
    for k, v in result["times"].items():
        print(f"| {k} | {_fmt(statistics.median(v))} | {_fmt(min(v))} – {_fmt(max(v))} |")
    print("\n| ratio | measured | target |")
    print("| --- | --- | --- |")
    for name, ratio, target, _ in ratios(result):
        print(f"| {name} | {ratio:.2f}× | {target} |")
    print(f"\nlogical digest: {result['digest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
