"""docs/DISTRIBUTED.md's examples, run the way users start jobs: torchrun, on 2, 1 and 3 ranks.

One torchrun launch per world size runs every example in order (docs_examples.py); the 1- and
3-rank launches also resume what the 2-rank launch saved (the "any world size" promise). One
more launch checks that async_save's process executor refuses, at once, a script whose code is
not under ``if __name__ == "__main__":`` (there DCP's spawned child would run the script again
and the save would hang). Each launch has a hard timeout; a hang kills its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tensorcanon.dcp import _compat

from helpers import FSDP2_ON_CPU, NO_FSDP2_ON_CPU

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(
    _compat.TORCH_VERSION < _compat.PROCESS_EXECUTOR_SINCE,
    reason=(NO_FSDP2_ON_CPU if not FSDP2_ON_CPU else "")
    + "; the examples also use async_save's process executor (torch >= 2.7)")


def torchrun(nproc: int, args: list[str], cwd: str, timeout: float = 150.0) -> str:
    """Run ``torchrun --standalone --nproc_per_node nproc ARGS``; return its output, failing on a
    non-zero exit or a hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONHASHSEED", None)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as spawn.py: loopback, whatever the hostname resolves to
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its workers and their children: this launch's session
        out, _ = proc.communicate()
        pytest.fail(f"torchrun with {nproc} ranks did not finish within {timeout} s (a hang):\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun with {nproc} ranks exited with {proc.returncode}:\n{out[-6000:]}")
    return out


def _examples(nproc: int, work: str, saved_by_others: str | None = None) -> str:
    args = [os.path.join(HERE, "docs_examples.py"), work] + ([saved_by_others] if saved_by_others else [])
    out = torchrun(nproc, args, cwd=os.path.dirname(work))
    from docs_examples import examples

    count = len(examples())
    for rank in range(nproc):
        assert f"rank {rank}: all {count} examples passed" in out, out[-6000:]
        if saved_by_others:
            assert f"rank {rank}: resumed what another world size saved" in out, out[-6000:]
    return out


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("docs") / "two")
    _examples(2, work)
    return work


def test_every_example_runs_on_2_ranks(saved_by_two):
    assert os.path.exists(os.path.join(saved_by_two, "ckpt", "step1000", "index.safetensors"))


@pytest.mark.parametrize("world", [1, 3])
def test_every_example_runs_and_resumes_what_2_ranks_saved(world, saved_by_two, tmp_path):
    _examples(world, str(tmp_path / f"w{world}"), saved_by_two)


def test_the_process_executor_refuses_an_unguarded_script_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "import tensorcanon\n"
        "import tensorcanon.dcp as tcd\n"
        "dist.init_process_group('gloo')\n"
        "try:\n"
        "    tcd.async_save({'w': torch.zeros(2)}, 'ckpt', executor='process')\n"
        "except tensorcanon.UsageError as e:\n"
        "    print(f'rank {dist.get_rank()} refused: {e}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    out = torchrun(2, [str(script)], cwd=str(tmp_path), timeout=90)
    for rank in range(2):
        assert f"rank {rank} refused: executor='process' cannot run from {script}, line 7" in out, out[-4000:]
    assert 'if __name__ == "__main__":' in out and "executor='thread'" in out
    assert not (tmp_path / "ckpt").exists()
