"""The must-hold scenarios of issue 31, each in fresh processes (tests/trace/scenarios.py).

Three interpreters do all of it: two started together (ranks 0 and 1 of a DDP run, then each its
own copy of the other runs, on 1 or 2 threads), then one that resumes a killed run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tensorcanon import first_divergence
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import layout
from tensorcanon.trace.compare import ENDS, EQUAL, INPUTS

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 300


def _start(jobs: list[dict]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED="0")
    return subprocess.Popen([sys.executable, os.path.join(HERE, "scenarios.py"), json.dumps(jobs)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait(*procs: subprocess.Popen) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out.decode(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    init = f"file://{d}/ddp-init"
    procs = []
    for who, threads in (("p", 1), ("q", 2)):
        jobs = [
            {"job": "ddp", "out": str(d / "ddp.{rank}.trace"), "rank": 0 if who == "p" else 1, "init": init,
             "steps": 2},
            {"job": "run", "out": str(d / f"same.{who}"), "level": "ops", "steps": 2},
            {"job": "run", "out": str(d / f"workers.{who}"), "level": "steps", "steps": 3, "workers": 2},
            {"job": "run", "out": str(d / f"workers-ops.{who}"), "level": "ops", "steps": 4, "workers": 2,
             "jitter": True},
            {"job": "run", "out": str(d / f"noisy-ops.{who}"), "level": "ops", "steps": 8, "noisy_step": 7},
            {"job": "run", "out": str(d / f"noisy-modules.{who}"), "level": "modules", "steps": 8,
             "noisy_step": 7, "capture": "7|module||layers.3.noise|0"},
            {"job": "reduce", "out": str(d / f"reduce.{who}"), "threads": threads,
             "capture": "0|op||aten.sum.default|1"},
        ]
        if who == "p":
            jobs.append({"job": "resume_first", "uninterrupted": str(d / "whole"), "prefix": str(d / "killed"),
                         "ckpt": str(d / "ckpt.safetensors"), "steps": 6, "kill_at": 3})
        procs.append(_start(jobs))
    _wait(*procs)
    for name in ("no-numpy", "no-optimizer", "all-restored"):
        shutil.copy(d / "killed", d / name)
    _wait(_start([{"job": "resume", "prefix": str(d / name), "ckpt": str(d / "ckpt.safetensors"), "steps": 6,
                   "kill_at": 3, "numpy": name != "no-numpy", "optimizer": name != "no-optimizer"}
                  for name in ("no-numpy", "no-optimizer", "all-restored")]))
    return d


def _bytes(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def test_identical_runs_give_byte_identical_traces_and_no_divergence_in_fresh_processes(runs, capsys):
    # workers-ops: a shuffled, seeded DataLoader of 2 workers at level ops, answering in another order
    # in each run (jitter); the main process rebuilds their batches in the order they answer, after
    # the optimizer step (not recorded)
    for name in ("same", "workers", "workers-ops"):
        a, b = runs / f"{name}.p", runs / f"{name}.q"
        assert _bytes(a) == _bytes(b), name
        result = first_divergence(a, b)
        assert result.same and result.matched > 100 and result.first is None
        assert cli(["diverge", str(a), str(b)]) == 0
        assert cli(["verify", str(a)]) == 0
    assert "same:" in capsys.readouterr().out
    assert any(r.kind == "op" and r.phase == "optimizer" for r in layout.Reader(runs / "workers-ops.p"))
    # the run's facts are kept apart, and they differ (pid)
    facts = [json.loads(_bytes(runs / f"same.{w}.run.json")) for w in "pq"]
    assert facts[0]["runs"][0]["pid"] != facts[1]["runs"][0]["pid"]


def test_an_unseeded_generator_in_layer_3_at_step_7_in_fresh_processes(runs, capsys):
    ops = first_divergence(runs / "noisy-ops.p", runs / "noisy-ops.q")
    f = ops.first
    assert not ops.same and f is not None
    assert (f["step"], f["phase"], f["kind"], f["scope"], f["name"], f["role"]) == (
        7, "forward", "op", "layers.3.noise", "aten.rand.generator", "out")
    assert ops.verdict == EQUAL and ops.later_differing > 0 and 7 in ops.later_steps
    # against a modules trace of the other run: the module, and what could not be compared
    mods = first_divergence(runs / "noisy-ops.p", runs / "noisy-modules.q")
    f = mods.first
    assert f is not None and (f["step"], f["kind"], f["name"], f["role"]) == (7, "module", "layers.3.noise", "out")
    assert mods.verdict == EQUAL and mods.level == "modules"
    assert any("op records" in n and "noisy-ops.p" in n for n in mods.not_compared)
    assert cli(["diverge", "--json", str(runs / "noisy-modules.p"), str(runs / "noisy-modules.q")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first"]["name"] == "layers.3.noise" and out["verdict"] == EQUAL and out["first"]["step"] == 7
    # the evidence: both runs saved that call's tensors (capture=), and diverge measures them
    ev = out["first"]["evidence"]
    assert ev["in.0"]["differ"] == 0 and ev["out"]["differ"] > 0
    assert 0 < ev["out"]["max_abs_diff"] <= 1e-3 and ev["out"]["max_ulp"] >= 1 and len(ev["out"]["first_index"]) == 3
    assert first_divergence(runs / "noisy-ops.p", runs / "noisy-ops.q").capture == \
        "7|op|layers.3.noise|aten.rand.generator|0"


def test_a_thread_count_that_changes_a_reduction_in_fresh_processes(runs):
    a, b = runs / "reduce.p", runs / "reduce.q"
    result = first_divergence(a, b)
    f = result.first
    assert f is not None and (f["kind"], f["name"], f["role"], f["phase"]) == ("op", "aten.sum.default", "out",
                                                                              "forward")
    assert result.verdict == EQUAL
    # everything before it matched, the matmul's output included
    with layout.Reader(a) as r:
        before = []
        for rec in r:
            if (rec.kind, rec.name, rec.call, rec.role) == ("op", "aten.sum.default", f["call"], "out"):
                break
            before.append(rec)
    assert result.matched == len(before)
    assert any(r.name == "aten.mm.default" and r.role == "out" for r in before)
    # the sum of the matmul's 64 x 64 elements, before it, matched: the sum of x (4 million) differs
    ev = f["evidence"]  # captured in both runs: the same 4 million inputs, a sum a few ULP apart
    assert ev["in.0"] == {"elements": 4_000_000, "differ": 0}
    assert ev["out"]["differ"] == 1 and 1 <= ev["out"]["max_ulp"] < 1000 and ev["out"]["first_index"] == []
    assert f["call"] == 1 and f["a"]["shape"] == [] and any(
        r.name == "aten.sum.default" and r.role == "in.0" and r.shape == (4_000_000,) for r in before)


def test_a_resume_that_forgets_numpy_or_the_optimizer_in_fresh_processes(runs):
    whole = runs / "whole"
    ok = first_divergence(whole, runs / "all-restored")
    assert ok.same, ok.lines()
    assert _bytes(whole) == _bytes(runs / "all-restored")
    r = first_divergence(whole, runs / "no-numpy")
    f = r.first
    assert f is not None and (f["step"], f["phase"], f["kind"]) == (3, "data", "batch")
    assert r.verdict == INPUTS and r.origin == "data"
    r = first_divergence(whole, runs / "no-optimizer")
    f = r.first
    assert f is not None and (f["step"], f["phase"], f["kind"]) == (3, "optimizer", "param")


def test_traces_of_different_lengths_in_fresh_processes(runs, tmp_path):
    r = first_divergence(runs / "whole", runs / "killed")
    assert not r.same and r.verdict == ENDS and r.first is not None and r.first["step"] == 3
    assert r.complete == (True, False) and any("incomplete" in n for n in r.notes)
    # a run killed in the middle of writing a record: its trace is compared as far as it goes
    cut = tmp_path / "cut"
    data = _bytes(runs / "whole")
    cut.write_bytes(data[: len(data) // 2 + 5])
    r = first_divergence(cut, runs / "whole")
    assert r.verdict == ENDS and r.matched > 0
    assert cli(["verify", str(cut)]) == 1


def test_two_ranks_under_ddp_each_write_their_own_trace_in_fresh_processes(runs):
    paths = [runs / f"ddp.{rank}.trace" for rank in (0, 1)]
    headers = [layout.verify(p)[0] for p in paths]
    assert [(h.rank, h.world_size) for h in headers] == [(0, 2), (1, 2)]
    r = first_divergence(*paths)
    f = r.first
    assert f is not None and f["kind"] == "batch" and f["step"] == 0 and r.verdict == INPUTS
    assert any("rank 0 of 2" in n for n in r.notes)
    # DDP averages the gradients: every parameter record of one rank equals the other's
    params = []
    for p in paths:
        with layout.Reader(p) as rd:
            params.append([(x.identity, x.digest) for x in rd if x.kind == "param"])
    assert params[0] == params[1] and len(params[0]) > 10
