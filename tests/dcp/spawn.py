"""Real tier: run scenarios in separate processes joined by a gloo process group.

``launch(world, batch, folder)`` starts ``world`` Python processes (this file run
as a script), each one rank of a gloo group on 127.0.0.1 and a free port. Each
runs every scenario of ``batch`` in order and writes its results as JSON to
``folder/<batch>.rank<r>.json``: per scenario, the returned value or the error raised
(class and message). Starting a process costs seconds here, so one launch runs
many scenarios. Every launch has a timeout: a hang fails the test, and the
processes are killed (by their pids).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, batch: str, folder: str, timeout: float = 150.0, backend: str = "gloo") -> list[dict]:
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               TENSORCANON_TEST_BACKEND=backend,
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    env.pop("PYTHONHASHSEED", None)  # each process draws its own hash seed: nothing may depend on it
    procs = []
    for rank in range(world):
        log = open(os.path.join(folder, f"{batch}.rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, __file__, batch, folder],
                                       env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    try:
        for p, _ in procs:
            left = max(0.1, deadline - time.monotonic())
            try:
                p.wait(left)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{batch}: ranks did not finish within {timeout} s (a hang); logs in {folder}") from None
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    results = []
    for rank, (p, _) in enumerate(procs):
        path = os.path.join(folder, f"{batch}.rank{rank}.json")
        if p.returncode != 0 or not os.path.exists(path):
            with open(os.path.join(folder, f"{batch}.rank{rank}.log")) as fh:
                tail = fh.read()[-3000:]
            raise AssertionError(f"{batch}: rank {rank} exited with {p.returncode}:\n{tail}")
        with open(path) as fh:
            results.append(json.load(fh))
    return results


# ---------------------------------------------------------------------------- worker side


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e),
            "classes": [c.__name__ for c in type(e).__mro__]}


def main(batch: str, folder: str) -> None:
    import torch.distributed as dist

    import scenarios

    backend = os.environ.get("TENSORCANON_TEST_BACKEND", "gloo")
    if "nccl" in backend:
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    out: dict = {"_seconds": {}}
    try:
        for name, fn in scenarios.BATCHES[batch]:
            started = time.perf_counter()
            try:
                out[name] = fn(rank, dist.get_world_size(), folder)
            except Exception as e:  # noqa: BLE001 - recorded for the test to judge
                out[name] = _error(e)
                out[name]["traceback"] = traceback.format_exc()[-2000:]
            dist.barrier()
            out["_seconds"][name] = round(time.perf_counter() - started, 2)
    finally:
        path = os.path.join(folder, f"{batch}.rank{rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(out, fh)
        os.replace(path + ".tmp", path)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
