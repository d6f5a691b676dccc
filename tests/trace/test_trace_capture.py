"""Capture specs round-trip through their escaping; captures compare what they hold; the call
indices a real recorder writes pass ``verify``'s rule (docs/TRACE.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tensorcanon
from tensorcanon import UsageError
from tensorcanon.trace import capture, layout

texts = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(["", "|", "\\", "\\|", "|\\", "a|b\\c"])


@settings(max_examples=500, deadline=None)
@given(step=st.integers(0, 2**63 - 1), kind=st.sampled_from(capture.KINDS), scope=texts, name=texts,
       call=st.integers(0, 2**63 - 1))
def test_a_spec_round_trips(step, kind, scope, name, call):
    spec = capture.format_spec(step, kind, scope, name, call)
    assert capture.parse(spec) == (step, kind, scope, name, call)
    assert capture.spec_of({"step": step, "kind": kind, "scope": scope, "name": name, "call": call}) == spec


def test_spec_escaping_is_the_documented_one():
    assert capture.format_spec(7, "module", "", "noise|x", 0) == "7|module||noise\\|x|0"
    assert capture.format_spec(7, "op", "a\\b", "aten.mm.default", 1) == "7|op|a\\\\b|aten.mm.default|1"
    assert capture.parse("7|op|layers.3.noise|aten.rand.generator|0") == (7, "op", "layers.3.noise",
                                                                           "aten.rand.generator", 0)
    for bad in ("7|op|a\\x|n|0", "7|op|a|n|0\\", "-1|op||n|0", "7|weights||n|0", "7|op||n", " 7|op||n|0"):
        with pytest.raises(UsageError):
            capture.parse(bad)


def test_dense_comparison_in_chunks_counts_every_difference(monkeypatch):
    monkeypatch.setattr(capture, "CHUNK", 7)  # many chunks, a last one cut short
    a = torch.arange(100, dtype=torch.float32).reshape(4, 25)
    b = a.clone()
    b[0, 3], b[2, 24], b[3, 0] = 3.5, -1.0, float("nan")
    got = capture.compare_tensors(a, b)
    assert got["elements"] == 100 and got["differ"] == 3
    assert got["first_index"] == [0, 3] and got["first_values"] == [3.0, 3.5]
    assert got["max_abs_diff"] == 75.0  # 74 - (-1); the NaN's distance is not a number
    assert capture.compare_tensors(a, a.clone()) == {"elements": 100, "differ": 0}
    ints = capture.compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3]))
    assert ints == {"elements": 3, "differ": 1, "first_index": [1], "first_values": [2, 5]}


def test_the_call_indices_a_recorder_writes_verify(tmp_path):
    """Several leaves in a batch, two losses in one phase, one optimizer stepped twice in a step (its
    parameters recorded twice): each record a call of its own, 0, 1, 2, ... per name."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    path = tmp_path / "run.trace"
    with tensorcanon.trace(path, level="modules", model=model, optimizer=opt) as tr:
        for _ in range(2):
            tr.step({"x": torch.ones(3), "y": [torch.zeros(1), torch.ones(2)]})
            for _ in range(2):
                tr.loss(model(torch.ones(3)).sum()).backward()
                opt.step()
                opt.zero_grad()
    calls = [(r.kind, r.name, r.call) for r in layout.Reader(path) if r.step == 1]
    assert ("batch", "batch", 2) in calls and ("param", "weight", 1) in calls and ("grad", "weight", 1) in calls
    assert [c for c in calls if c[0] == "loss"] == [("loss", "loss", 0)] * 2  # phases forward, optimizer
    assert layout.verify(path)[1] > 0
