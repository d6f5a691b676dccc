"""Run every Python example of docs/DISTRIBUTED.md, in order and in one namespace, as one rank
of a torchrun job (test_docs_examples.py starts it).

    torchrun --nproc_per_node N docs_examples.py WORKDIR [SAVED_BY_OTHERS]

The examples run in WORKDIR (they save into ``ckpt/...`` there); ``build_model()`` is this
file's. The page's Python blocks are read by tests/docs_blocks.py, which every page's examples
share (tests/test_docs_examples.py): blocks marked ``doctest: skip`` are left out, a ``doctest:
setup`` comment runs before its block, and tracebacks point at the lines of the page.

With SAVED_BY_OTHERS (the WORKDIR of a run with another world size), the example that starts
with ``# Resume, with any world size`` then runs once more, in that directory: it resumes what
the other world size saved, and the model must hold exactly the saved tensors.

The examples' code runs under ``if __name__ == "__main__":`` here, as the process executor of
``async_save`` requires (DCP's spawn start method imports this file again in its child).
"""

from __future__ import annotations

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: docs_blocks (torchrun starts this file by path)
import docs_blocks

PAGE = "docs/DISTRIBUTED.md"
DOC = os.path.join(docs_blocks.ROOT, PAGE)
RESUME = "# Resume, with any world size"


def blocks() -> list[docs_blocks.Block]:
    """The page's Python blocks that run, in order."""
    return [b for b in docs_blocks.parse(PAGE).blocks if b.lang in docs_blocks.PYTHON and not b.skip_reason]


def examples() -> list[str]:
    return [b.code for b in blocks()]


def _run(block: docs_blocks.Block, names: dict) -> None:
    setup = block.mark("setup")
    if setup:
        exec(compile("\n" * (setup.body_line - 1) + setup.body, DOC, "exec"), names)
    exec(compile("\n" * (block.code_line - 1) + block.code, DOC, "exec"), names)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def main(work: str, saved_by_others: str | None) -> None:
    rank = os.environ.get("RANK", "?")
    started = time.perf_counter()
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    todo = blocks()
    names: dict = {"__name__": "docs_examples", "build_model": build_model}
    for i, block in enumerate(todo, 1):
        _run(block, names)
        print(f"rank {rank}: example {i} of {len(todo)} ({block.where}) ran ({time.perf_counter() - started:.1f} s)",
              flush=True)
    if saved_by_others:
        _resume_from(saved_by_others, next(b for b in todo if b.code.startswith(RESUME)), names)
        print(f"rank {rank}: resumed what another world size saved", flush=True)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    _stop_dcp_background_process()
    print(f"rank {rank}: all {len(todo)} examples passed", flush=True)


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


def _resume_from(folder: str, block: docs_blocks.Block, names: dict) -> None:
    """Run the resume example once more, in the folder another world size saved into."""
    import tensorcanon.dcp as tcd

    os.chdir(folder)
    _run(block, names)
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
