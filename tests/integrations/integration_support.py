"""Helpers for the framework integration tests (imported by the test modules of this folder)."""

from __future__ import annotations

import os
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_script(script: str, *args: str, timeout: int = 300) -> None:
    """Run a helper script of this folder in a fresh interpreter (fixed hash seed); fail with its output."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=HERE)
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def is_pickle_or_zip(data: bytes) -> bool:
    """True when ``data`` is a zip (torch.save's format: starts with ``PK``) or begins with a
    well-formed pickle stream of protocol 2 or later (a PROTO opcode, then opcodes up to STOP;
    read with pickletools, nothing is executed)."""
    if data[:2] == b"PK":
        return True
    if len(data) < 2 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        return False
    try:
        for op, _, _ in pickletools.genops(data):
            if op.name == "STOP":
                return True
    except Exception:  # not a pickle: genops stops at the first byte that is no opcode
        return False
    return False
