"""tensorcanon.integrations.tracing with the real frameworks (one fresh process runs all three)."""

from __future__ import annotations

import os
import subprocess
import sys

from tensorcanon import first_divergence
from tensorcanon.trace import layout

HERE = os.path.dirname(os.path.abspath(__file__))


def _records(path) -> list:
    with layout.Reader(path) as r:
        return list(r)


def test_lightning_transformers_and_accelerate_runs_are_traced_in_a_fresh_process(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "trace_frameworks_run.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for framework, level in (("lightning", "modules"), ("transformers", "steps"), ("accelerate", "modules")):
        one, two = tmp_path / f"{framework}.1.trace", tmp_path / f"{framework}.2.trace"
        records = _records(one)
        assert layout.verify(one)[0].level == level
        assert sorted({r.step for r in records}) == [0, 1, 2], framework
        kinds = {r.kind for r in records}
        assert {"batch", "rng", "param"} <= kinds, (framework, kinds)
        if level == "modules":
            assert {"module", "grad"} <= kinds, (framework, kinds)
        if framework != "lightning":
            assert one.read_bytes() == two.read_bytes(), framework
            assert first_divergence(one, two).same
    # Lightning's second run changed step 1's batch: the first divergence is that batch
    r = first_divergence(tmp_path / "lightning.1.trace", tmp_path / "lightning.2.trace")
    assert r.first is not None and (r.first["step"], r.first["kind"]) == (1, "batch")
    assert r.verdict == "inputs already differ" and r.origin == "data"
    # the gradients recorded are those the optimizer used (Lightning steps through a closure)
    grads = [x for x in _records(tmp_path / "lightning.1.trace") if x.kind == "grad"]
    assert len(grads) == 3 * 4 and all(x.phase == "backward" for x in grads)
