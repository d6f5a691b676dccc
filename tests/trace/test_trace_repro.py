"""``tensorcanon repro --trace LEVEL -- CMD``: the runs are traced and the first divergence reported."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import random

import numpy
import torch
import tensorcanon

random.seed(0)
numpy.random.seed(0)  # the trace records every random state at each step's start: seed them all
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
noise = torch.Generator()
noise.seed()  # unseeded: another draw in each run
with tensorcanon.trace("unused.trace", level="steps", model=model, optimizer=opt) as tr:
    for step in range(3):
        batch = torch.ones(2, 4) + (torch.rand(2, 4, generator=noise) if step == 1 else 0)
        tr.step(batch)
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
tensorcanon.save(model.state_dict(), "model.safetensors")
"""


def test_repro_with_traces_names_the_first_divergence_in_fresh_processes(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "tensorcanon", "repro", "--json", "--trace", "steps",
                           "--out", "model.safetensors", "--", sys.executable, "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["identical"] is False
    (trace,) = doc["traces"]
    assert trace["run"] == 2 and trace["same"] is False
    first = trace["first"]
    assert (first["step"], first["phase"], first["kind"]) == (1, "data", "batch")
    assert trace["verdict"] == "inputs already differ" and trace["origin"] == "data"
    assert trace["matched"] > 0 and not (tmp_path / "unused.trace").exists()  # the runs' traces went aside
