"""``diff`` of two files holds the tensors it compares, not the files (issue 32: two 320 MiB files
peaked at 929 MB). Measured in fresh processes by their peak resident memory: the growth while
diffing stays under one file's size, and does not grow when the files do (a correctness bound on
memory, not a timing)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import tensorcanon

MIB = 1 << 20
PROBE = """
import resource, sys
import numpy, torch, tensorcanon
from tensorcanon.tools import cli
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = cli.main(["diff", sys.argv[1], sys.argv[2]])
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(code, grown * 1024)  # (ru_maxrss is in KiB on Linux)
"""


def _pair(folder, tensors: int) -> tuple[str, str]:
    """Two files of ``tensors`` float64 tensors of 8 MiB each, one element apart."""
    rng = np.random.default_rng(tensors)
    state = {f"t{i:02d}": rng.standard_normal(MIB) for i in range(tensors)}
    a, b = str(folder / f"a{tensors}.safetensors"), str(folder / f"b{tensors}.safetensors")
    tensorcanon.save(state, a)
    state["t03"][5] += 1
    tensorcanon.save(state, b)
    return a, b


def _growth(a: str, b: str) -> int:
    proc = subprocess.run([sys.executable, "-c", PROBE, a, b], capture_output=True, text=True, timeout=300)
    code, grown = proc.stdout.split()[-2:]
    assert code == "1", proc.stdout + proc.stderr  # one difference found
    assert 'first at [5]' in proc.stdout
    return int(grown)


def test_diff_memory_is_bounded_by_the_tensors_not_the_files(tmp_path):
    small = _growth(*_pair(tmp_path, 8))    # 2 x 64 MiB
    large = _growth(*_pair(tmp_path, 16))   # 2 x 128 MiB
    assert small < 64 * MIB, small / MIB    # under one file's size (the two files: 128 MiB)
    assert large < small + 16 * MIB, (small / MIB, large / MIB)  # twice the files, not twice the memory
