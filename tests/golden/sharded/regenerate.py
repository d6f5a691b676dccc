"""Rewrite the sharded checkpoint golden vector: ONLY for a deliberate layout change.

``two_ranks/`` is the checkpoint ``tests/dcp/test_golden_sharded.py`` expects,
byte for byte, from saving :func:`state` with 2 ranks: the worked example of
docs/FORMAT.md §14. Changing any byte of it is a change of the on-disk layout
(bump ``tensorcanon.sharded.layout.LAYOUT_VERSION`` and update docs/FORMAT.md)
or of the file format (tests/golden/regenerate.py). Then::

    python tests/golden/sharded/regenerate.py --layout-change
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "dcp"))


def state(world: int, rank: int) -> dict:
    """A 3x2 float32 tensor sharded by rows over 2 ranks, a step counter, a per-rank value."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tensorcanon.dcp import PerRank

    from helpers import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.arange(6, dtype=torch.float32).reshape(3, 2), mesh, [Shard(0)]),
            "step": 1, "rng": PerRank(rank)}


def write(folder: str) -> str:
    import tensorcanon.dcp as tcd

    from threaded import run_ranks

    return run_ranks(2, lambda r: tcd.save(state(2, r), folder))[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout-change", action="store_true", required=True,
                    help="confirm that the layout changed on purpose")
    ap.parse_args(argv)
    target = HERE / "two_ranks"
    shutil.rmtree(target, ignore_errors=True)
    print(write(str(target)))
    for p in sorted(target.iterdir()):
        print(p.name, p.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
