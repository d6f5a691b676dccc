"""Real tier: run scenarios in separate processes joined by a gloo process group.

``launch(world, batch, folder)`` starts ``world`` Python processes (this file run
as a script), each one rank of a gloo group on 127.0.0.1 and a free port. Each
runs every scenario of ``batch`` in order and writes its results as JSON to
``folder/<batch>.rank<r>.json``: per scenario, the returned value or the error raised
(class and message). Starting a process costs seconds here, so one launch runs
many scenarios. Every launch has a timeout: a hang fails the test, and the
processes are killed (by their pids). Before that, each process prints the stack of
every thread into its log (faulthandler), and the failure shows the logs' tails, so a
hang on a machine we cannot log into still says where it stopped.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback

from support import free_port, run_processes

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(world: int, batch: str, folder: str, timeout: float = 150.0, backend: str = "gloo") -> list[dict]:
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               TENSORCANON_TEST_BACKEND=backend, TENSORCANON_TEST_STACKS_AFTER=str(max(5.0, timeout - 20.0)),
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")  # (tests/dcp and tests: the helper modules pytest's pythonpath gives the tests)
    env.pop("PYTHONHASHSEED", None)  # each process draws its own hash seed: nothing may depend on it
    if os.path.exists("/sys/class/net/lo"):
        # gloo otherwise picks its interface by resolving the machine's hostname, which on some
        # machines names an address other than the loopback one MASTER_ADDR uses
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    runs = [([sys.executable, __file__, batch, folder], dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
             os.path.join(folder, f"{batch}.rank{rank}.log")) for rank in range(world)]
    codes = run_processes(runs, timeout)
    if None in codes:
        tails = "\n".join(f"--- rank {rank} log (end):\n{_tail(folder, batch, rank)}" for rank in range(world))
        raise AssertionError(f"{batch}: ranks did not finish within {timeout} s (a hang); logs in {folder}\n{tails}")
    results = []
    for rank, code in enumerate(codes):
        path = os.path.join(folder, f"{batch}.rank{rank}.json")
        if code != 0 or not os.path.exists(path):
            raise AssertionError(f"{batch}: rank {rank} exited with {code}:\n{_tail(folder, batch, rank)}")
        with open(path) as fh:
            results.append(json.load(fh))
    return results


def _tail(folder: str, batch: str, rank: int, size: int = 4000) -> str:
    with open(os.path.join(folder, f"{batch}.rank{rank}.log"), errors="replace") as fh:
        return fh.read()[-size:]


# ---------------------------------------------------------------------------- worker side


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e),
            "classes": [c.__name__ for c in type(e).__mro__]}


def main(batch: str, folder: str) -> None:
    import torch.distributed as dist

    import scenarios

    # a hang prints every thread's stack into the log before the launcher kills the process
    faulthandler.dump_traceback_later(float(os.environ.get("TENSORCANON_TEST_STACKS_AFTER", "130")), exit=False)

    backend = os.environ.get("TENSORCANON_TEST_BACKEND", "gloo")
    if "nccl" in backend:
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    print(f"rank {os.environ['RANK']}: joining the {backend} group", flush=True)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    print(f"rank {rank}: joined", flush=True)
    out: dict = {"_seconds": {}}
    try:
        for name, fn in scenarios.BATCHES[batch]:
            started = time.perf_counter()
            print(f"rank {rank}: {name}", flush=True)
            try:
                out[name] = fn(rank, dist.get_world_size(), folder)
            except Exception as e:  # noqa: BLE001 - recorded for the test to judge
                out[name] = _error(e)
                out[name]["traceback"] = traceback.format_exc()[-2000:]
            dist.barrier()
            print(f"rank {rank}: {name} done", flush=True)
            out["_seconds"][name] = round(time.perf_counter() - started, 2)
    finally:
        path = os.path.join(folder, f"{batch}.rank{rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(out, fh)
        os.replace(path + ".tmp", path)
        _leave(rank)


def _leave(rank: int) -> None:
    """Exit, the results written, without tearing the process group down: with gloo on torch 2.4
    (the floors job) a rank hung there, holding the interpreter (even a new thread could not
    start), after every rank had finished. Teardown is not what these tests check."""
    print(f"rank {rank}: results written; exiting", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Results are written and the group destroyed: leave without interpreter finalization, where
    # gloo's C++ threads can still abort the process ("terminate called without an active
    # exception", seen once here after every scenario had passed; pytorch/pytorch#179291
    # describes the cause). An error in main() still exits non-zero, above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
