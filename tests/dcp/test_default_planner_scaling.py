"""``dcp.load`` through tensorcanon.dcp.Reader with DCP's own DefaultLoadPlanner is linear in the
number of non-tensor values (issue 29: 16,000 values took 13 s where tensorcanon.dcp.load took
0.2 s). DCP asks for each value by its own path; the Reader found each by scanning its dict, and
decoded each with decoders sized by the whole tensor table.

Measured by counting work, not time: the tree nodes the Reader decodes (``Decoder.decode`` calls)
for 2,000 and for 8,000 values. Linear work grows 4 times; the quadratic scan grew 16 times.
Wall-clock figures are in benchmarks/ (never in a test).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorcanon.dcp as tcd
from tensorcanon.format import tree


def _decodes(tmp_path, n: int, monkeypatch: pytest.MonkeyPatch) -> int:
    folder = str(tmp_path / f"ckpt{n}")
    tcd.save({"w": torch.arange(4.0), "vals": {f"k{i}": i for i in range(n)}}, folder)
    target = {"w": torch.empty(4), "vals": {f"k{i}": None for i in range(n)}}
    calls = [0]
    original = tree.Decoder.decode

    def counted(self, node, depth=0):
        calls[0] += 1
        return original(self, node, depth)

    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group" notice
        m.setattr(tree.Decoder, "decode", counted)
        dcp.load(target, storage_reader=tcd.Reader(folder), planner=dcp.DefaultLoadPlanner())
    assert target["vals"]["k0"] == 0 and target["vals"][f"k{n - 1}"] == n - 1
    assert torch.equal(target["w"], torch.arange(4.0))
    return calls[0]


def test_default_planner_values_take_linear_work(tmp_path, monkeypatch):
    small, large = _decodes(tmp_path, 2_000, monkeypatch), _decodes(tmp_path, 8_000, monkeypatch)
    assert large < 6 * small, (small, large)  # 4x the values: linear 4x, quadratic 16x
