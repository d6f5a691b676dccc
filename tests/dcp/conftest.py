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


def pytest_configure(config):
    import logging

    # DCP logs every step (and every expected failure, with tracebacks) on its own logger
    logging.getLogger("dcp_logger").setLevel(logging.CRITICAL)
    logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.CRITICAL)
