"""Harness for the sharded checkpoint tests.

Fast tier: every rank of a process group is a thread of this process, through
torch's threaded in-process process group
(``torch.testing._internal.distributed.multi_threaded_pg``). It is a private
torch API: if a torch release moves it, these tests fail (they never skip), and
threaded.py is the one place to update. DCP, DTensor and
FSDP2 run on it unchanged; a 4-rank save takes a few hundredths of a second.

Real tier (test_spawned.py): separate processes on gloo, see spawn.py.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh checkpoint directory path (not created: saving creates it)."""
    return str(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank checkpoint of ``states.sharded_state``, saved once per test module that asks for
    it (a module may define its own: test_bytes_items.py saves byte items)."""
    import tensorcanon.dcp as tcd

    from states import sharded_state
    from threaded import run_ranks

    folder = str(tmp_path_factory.mktemp("saved") / "ckpt")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), folder))
    return folder


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the ``saved`` checkpoint, for a test that damages it."""
    import shutil

    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved, folder)
    return folder
