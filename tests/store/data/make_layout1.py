"""Writes tests/store/data/layout1: a store of layout 1 (loose blobs only, marker ``layout 1``), as
tensorcanon wrote it before packs (run once with that version: PYTHONPATH=<its src> python
make_layout1.py OUT). tests/store/test_packs.py rebuilds the same objects with :func:`states`."""

import sys

import torch


def states():
    g = torch.Generator().manual_seed(39)
    w = torch.randn(64, 64, generator=g)
    out = {}
    for i in range(3):
        w = w + 1e-4 * torch.randn(64, 64, generator=g)
        out[f"step-{i}"] = {"w": w.clone(), "b": torch.zeros(64), "step": i, "ids": torch.arange(10)}
    return out


if __name__ == "__main__":
    import tensorcanon as tc

    store = tc.Store(sys.argv[1])
    for tag, state in states().items():
        store.save(tag, state)
