"""Run every Python example of docs/DISTRIBUTED.md, in order and in one namespace, as one rank
of a torchrun job (test_docs_examples.py starts it).

    torchrun --nproc_per_node N docs_examples.py WORKDIR [SAVED_BY_OTHERS]

The examples run in WORKDIR (they save into ``ckpt/...`` there); ``build_model()`` is this
file's. With SAVED_BY_OTHERS (the WORKDIR of a run with another world size), the example that
starts with ``# Resume, with any world size`` then runs once more, in that directory: it resumes
what the other world size saved, and the model must hold exactly the saved tensors.

The examples' code runs under ``if __name__ == "__main__":`` here, as the process executor of
``async_save`` requires (DCP's spawn start method imports this file again in its child).
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "..", "..", "docs", "DISTRIBUTED.md")
RESUME = "# Resume, with any world size"


def examples(path: str = DOC) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return re.findall(r"^```python\n(.*?)^```", fh.read(), re.S | re.M)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def main(work: str, saved_by_others: str | None) -> None:
    rank = os.environ.get("RANK", "?")
    started = time.perf_counter()
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    blocks = examples()
    names: dict = {"__name__": "docs_examples", "build_model": build_model}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"docs/DISTRIBUTED.md, example {i}", "exec"), names)
        print(f"rank {rank}: example {i} of {len(blocks)} ran ({time.perf_counter() - started:.1f} s)", flush=True)
    if saved_by_others:
        _resume_from(saved_by_others, next(c for c in blocks if c.startswith(RESUME)), names)
        print(f"rank {rank}: resumed what another world size saved", flush=True)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    _stop_dcp_background_process()
    print(f"rank {rank}: all {len(blocks)} examples passed", flush=True)


def _stop_dcp_background_process() -> None:
    """Ask the process executor's child to stop, as DCP does when its object is collected at exit
    (this script leaves with os._exit, below, which collects nothing)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:  # torch < 2.7: no process executor
        return
    child = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if child is not None:
        child.__del__()


def _resume_from(folder: str, code: str, names: dict) -> None:
    import tensorcanon.dcp as tcd

    os.chdir(folder)
    exec(compile(code, "docs/DISTRIBUTED.md, the resume example (another world size's checkpoint)", "exec"), names)
    saved = tcd.load_unsharded("ckpt/step1000")
    assert names["state"]["rng"].value is None             # kept: no saved RNG state is this rank's
    for key, value in names["model"].state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(full, saved["model"][key]), key


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    # Every example passed and the group is destroyed: leave without interpreter finalization,
    # where gloo's threads can abort the process (see spawn.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
