"""Helpers and fixtures for the framework integration tests, imported by each test module of
this folder. (No conftest.py here: other tests import tests/conftest.py as ``conftest``, and a
second conftest module of that name would shadow it. The ``no_unpickling`` fixture is in
tests/conftest.py, for the sharded tests too.)"""

from __future__ import annotations

import json
import os
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

# Nothing in these tests may reach the Hugging Face Hub (set before transformers or accelerate load).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def restore_determinism_settings(keep_determinism_settings):
    """Autouse in every module that imports it: the runs here seed and switch determinism on
    (seed_everything, resumed settings), so the process-wide switches are put back after each
    test (keep_determinism_settings is in tests/conftest.py)."""
    yield


def run_script(script: str, *args: str, timeout: int = 300) -> None:
    """Run a helper script of this folder in a fresh interpreter (fixed hash seed, tests/ on its
    path for support.py); fail with its output."""
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=HERE)
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} exited {proc.returncode}:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def first_and_resume(script: str, out: Path) -> tuple[dict, dict]:
    """Run ``script first OUT``, then ``script resume OUT`` in a fresh interpreter; the results
    each wrote (``first.json``, ``resume.json``)."""
    run_script(script, "first", str(out))
    run_script(script, "resume", str(out))
    return json.loads((out / "first.json").read_text()), json.loads((out / "resume.json").read_text())


def first_and_resume_ranks(script: str, out: Path, ranks: tuple = (0, 1)) -> tuple[dict, dict]:
    """:func:`first_and_resume` for a script that launches several ranks, each writing its own
    results: ``({rank: first-rank<r>.json}, {rank: resume-rank<r>.json})``."""
    run_script(script, "first", str(out))
    run_script(script, "resume", str(out))
    read = lambda name: json.loads((out / name).read_text())  # noqa: E731
    return {r: read(f"first-rank{r}.json") for r in ranks}, {r: read(f"resume-rank{r}.json") for r in ranks}


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
    except Exception:  # noqa: BLE001 - not a pickle: genops stops at the first byte that is no opcode
        return False
    return False
