"""A rank file that another process truncates while a reader has it mapped.

Rank files are read from a memory map (sharded/files.py). Before each chunk or per-rank value
is read, the map is checked: a file cut short since it was opened is a FormatError naming it,
where reading the lost pages would kill the process with SIGBUS. A file cut short *while* a
chunk's pages are being read still raises SIGBUS (documented there and in docs/SECURITY.md);
the last test pins that, as a known limitation.

The readers run in a subprocess, so a SIGBUS fails the test (return code -7) instead of killing
pytest. The truncation is made deterministic by wrapping a RankFile method, not by a race.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon.dcp as tcd

from helpers import Shard, distribute_tensor
from threaded import run_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the check asks Linux (MADV_POPULATE_READ) whether a map lost pages")

FULL = torch.arange(2 * 256 * 256, dtype=torch.float32).reshape(512, 256)  # 256 KiB per rank: many pages


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("shrink") / "ckpt")

    def save(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        tcd.save({"big": distribute_tensor(FULL, mesh, [Shard(0)]), "col": distribute_tensor(FULL, mesh, [Shard(1)]),
                  "rng": tcd.PerRank(torch.full((70_000,), rank, dtype=torch.uint8))}, folder)

    run_ranks(2, save)
    return folder


# Runs each reader on a fresh copy of the checkpoint, with RankFile.<hook> wrapped so that the
# rank file is cut to a quarter of its size right after that method runs; prints, per reader,
# the class and message of what it raised (or "ok").
_SCRIPT = textwrap.dedent("""
    import json, os, resource, shutil, sys
    import torch
    import tensorcanon.dcp as tcd
    from tensorcanon.sharded import files

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGBUS leaves no core file
    pristine, work, hook, names = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    readers = {
        "verify": lambda d: tcd.verify(d),
        "load_unsharded": lambda d: tcd.load_unsharded(d),
        "per_rank_value": lambda d: tcd.load_unsharded(d, rank=1),
        "consolidate": lambda d: tcd.consolidate(d, os.path.join(work, "out.safetensors")),
        "dcp_load": lambda d: tcd.load({"big": torch.zeros(512, 256), "col": torch.zeros(512, 256)}, d),
    }
    cut = set()

    def truncate(path):
        if path not in cut:
            cut.add(path)
            os.truncate(path, os.path.getsize(path) // 4)

    if hook == "open":
        plain = files.RankFile.open.__func__
        files.RankFile.open = classmethod(lambda cls, path, *a, **k: (lambda f: (truncate(path), f)[1])(
            plain(cls, path, *a, **k)))
    else:
        plain_raw = files.RankFile.raw
        files.RankFile.raw = lambda self, info: (lambda v: (truncate(self.path), v)[1])(plain_raw(self, info))
    results = {}
    for name in names:
        folder = os.path.join(work, name)
        shutil.copytree(pristine, folder)
        cut.clear()
        try:
            readers[name](folder)
            results[name] = ["ok", ""]
        except Exception as e:
            results[name] = [type(e).__name__, str(e)]
        print(json.dumps({name: results[name]}), flush=True)
""")


def _run(checkpoint: str, tmp_path, hook: str, names: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, checkpoint, str(tmp_path), hook, json.dumps(names)],
                          capture_output=True, text=True, timeout=120)


def _results(proc: subprocess.CompletedProcess) -> dict:
    found: dict = {}
    for line in proc.stdout.splitlines():
        found.update(json.loads(line))
    return found


READERS = ["verify", "load_unsharded", "per_rank_value", "consolidate", "dcp_load"]


def test_a_rank_file_cut_short_after_it_was_opened_is_a_format_error(checkpoint, tmp_path):
    proc = _run(checkpoint, tmp_path, "open", READERS)
    assert proc.returncode == 0, (
        f"the readers died with {signal.Signals(-proc.returncode).name if proc.returncode < 0 else proc.returncode}"
        f" after {sorted(_results(proc))}: {proc.stderr[-2000:]}")
    results = _results(proc)
    for name in READERS:
        kind, message = results[name]
        assert kind == "FormatError" or (name == "dcp_load" and kind == "CheckpointError"), (name, kind, message)
        # (dcp_load opens each rank file first to bound the index's sizes by them, in DCP's metadata
        # step: the file cut then is found truncated when the read step opens it again)
        assert "is shorter than its header says: it changed while being read" in message or (
            name == "dcp_load" and "the file is truncated" in message), (name, message)
        assert "rank-0000" in message and ".safetensors" in message, (name, message)  # names the rank file
    assert not os.path.exists(tmp_path / "out.safetensors")  # consolidate removed its output


def test_a_rank_file_untouched_reads_as_before(checkpoint, tmp_path):
    folder = str(tmp_path / "copy")
    shutil.copytree(checkpoint, folder)
    state = tcd.load_unsharded(folder, rank=1)
    assert torch.equal(state["big"], FULL) and torch.equal(state["col"], FULL)
    assert int(state["rng"][0]) == 1


def test_a_rank_file_cut_short_while_a_chunk_is_read_kills_the_reader_as_documented(checkpoint, tmp_path):
    """The limit docs/SECURITY.md states: a rank file truncated while a chunk's pages are read from the
    map raises SIGBUS, as for every memory-mapped reader (positional reads would avoid it, at 6-28% of
    verify's and load's time). If this starts passing another way, update SECURITY.md with it."""
    import signal

    proc = _run(checkpoint, tmp_path, "raw", ["verify"])
    assert proc.returncode == -signal.SIGBUS, f"return code {proc.returncode}"
