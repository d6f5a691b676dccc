"""seed_everything and DeterminismSettings."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import DeterminismSettings, seed_everything
from tensorcanon.determinism import DeterminismWarning

pytestmark = pytest.mark.usefixtures("keep_determinism_settings")  # tests/conftest.py


SCRIPT = """
import json, os, random, warnings, numpy as np, torch, tensorcanon
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    r = tensorcanon.seed_everything(1234)
print(json.dumps({
    "ret": r, "warnings": [str(x.message) for x in w],
    "det": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark],
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "hashseed": os.environ.get("PYTHONHASHSEED"),
    "draws": [random.random(), float(np.random.rand()), torch.rand(2).tolist()],
}))
"""


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def test_seed_everything_recipe_in_fresh_processes():
    a = _run({})
    assert a["ret"] == 1234 and a["det"] is True and a["warn_only"] is False
    assert a["cudnn"] == [True, False]
    assert a["cublas"] == ":4096:8" and a["hashseed"] == "1234"
    assert any("PYTHONHASHSEED only takes effect when an interpreter starts" in m for m in a["warnings"])
    b = _run({"PYTHONHASHSEED": "5", "CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert b["warnings"] == [] and b["hashseed"] == "5" and b["cublas"] == ":16:8"  # left as set
    assert a["draws"] == b["draws"]


def test_seed_everything_in_process():
    os.environ.pop("PYTHONHASHSEED", None)
    with pytest.warns(DeterminismWarning, match="PYTHONHASHSEED"):
        seed_everything(7, warn_only=True)
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    first = (random.random(), np.random.rand(), torch.rand(2).tolist())
    seed_everything(7, deterministic=False)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == first
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(ValueError):
            seed_everything(bad)


def test_compare_reports_each_difference():
    s = DeterminismSettings.capture()
    assert s.compare(s) == [] and s.compare() == []
    other = dataclasses.replace(s, deterministic_algorithms=not s.deterministic_algorithms,
                                num_threads=s.num_threads + 1, gpu_names=("NVIDIA H100",),
                                gpu_sm_counts=(132,))
    diffs = s.compare(other)
    assert [d.field for d in diffs] == ["deterministic_algorithms", "num_threads", "gpu_names", "gpu_sm_counts"]
    assert diffs[1].saved == s.num_threads and diffs[1].current == s.num_threads + 1
    assert "SM count" in str(diffs[3]) and str(diffs[1]).startswith("num_threads: saved")


def test_settings_round_trip_and_validation():
    s = DeterminismSettings.capture()
    data = tensorcanon.dumps({"settings": s})
    loaded = tensorcanon.loads(data)["settings"]
    assert loaded == s and type(loaded) is DeterminismSettings
    bad = dataclasses.replace(s, num_threads="2")
    with pytest.raises(tensorcanon.FormatError, match="num_threads"):
        tensorcanon.loads(tensorcanon.dumps(bad))
    bad = dataclasses.replace(s, gpu_names=("a",), gpu_sm_counts=())
    with pytest.raises(tensorcanon.FormatError, match="gpu_sm_counts"):
        tensorcanon.loads(tensorcanon.dumps(bad))


def test_apply_restores_switches():
    s = DeterminismSettings.capture()
    torch.use_deterministic_algorithms(not s.deterministic_algorithms)
    torch.set_float32_matmul_precision("medium" if s.float32_matmul_precision != "medium" else "high")
    assert {d.field for d in s.compare()} >= {"deterministic_algorithms", "float32_matmul_precision"}
    assert s.apply() == []
