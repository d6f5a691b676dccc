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


# Packed lists (issue 37 item 5): diff of a file holding one long packed list peaked at 422x its
# size (a Difference per differing int). Now: each line is one difference, two `ints` nodes are
# compared by their bytes and two `records` nodes row by row, without a Python object per item.
# Bound: SECURITY.md's ~105x of a manifest (for both files, measured against one), by tracemalloc
# in this process (a memory bound, not a timing).
MANIFEST_BOUND = 105


def _cli_diff(a, b) -> int:
    import contextlib
    import io

    from tensorcanon.tools import cli

    with contextlib.redirect_stdout(io.StringIO()):
        return cli.main(["diff", str(a), str(b)])


def _peak_of_cli_diff(a, b) -> tuple[int, int]:
    import tracemalloc

    tracemalloc.start()
    try:
        code = _cli_diff(a, b)
        return code, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_diff_of_packed_lists_stays_within_the_manifest_bound(tmp_path):
    import random

    rng = random.Random(5)
    ids = [rng.randrange(256) for _ in range(300_000)]  # one byte each: the densest ints node
    one = list(ids)
    one[1000] = (one[1000] + 1) % 256
    log = [{"s": i % 100} for i in range(30_000)]  # one-key records: the densest records node
    cases = {
        "ints, every item differs": ({"ids": ids}, {"ids": [(x + 1) % 256 for x in ids]}),
        "ints, one item differs": ({"ids": ids}, {"ids": one}),
        "ints, identical": ({"ids": ids}, {"ids": list(ids)}),
        "records, every row differs": ({"log": log}, {"log": [{"s": r["s"] + 1} for r in log]}),
    }
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensorcanon.save({"ids": ids[:100], "log": log[:10]}, pa)
    tensorcanon.save({"ids": one[:100], "log": log[1:11]}, pb)
    _cli_diff(pa, pb)  # (once before: what the first diff imports and caches is not the files' cost)
    for name, (a, b) in cases.items():
        tensorcanon.save(a, pa)
        tensorcanon.save(b, pb)
        code, peak = _peak_of_cli_diff(pa, pb)
        assert code == (0 if name.endswith("identical") else 1), name
        size = max(pa.stat().st_size, pb.stat().st_size)
        assert peak < MANIFEST_BOUND * size, f"{name}: {peak / size:.0f}x the file's {size} bytes"
