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
from tensorcanon.training.determinism import DeterminismWarning

pytestmark = pytest.mark.usefixtures("keep_determinism_settings")  # tests/conftest.py


SCRIPT = """
import json, os, random, subprocess, sys, warnings, numpy as np, torch, tensorcanon
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    r = tensorcanon.seed_everything(1234)
    draws = [random.random(), float(np.random.rand()), torch.rand(2).tolist()]
    tensorcanon.seed_everything(1234)  # a second call: the hash-seed warning is not repeated
child = subprocess.run([sys.executable, "-c", "import tensorcanon; "
                        "print(tensorcanon.DeterminismSettings.capture().pythonhashseed)"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({
    "ret": r, "warnings": [str(x.message) for x in w],
    "det": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark],
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "hashseed": os.environ.get("PYTHONHASHSEED"),
    "draws": draws, "randomized": sys.flags.hash_randomization,
    "captured": tensorcanon.DeterminismSettings.capture().pythonhashseed, "child": child,
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
    # Warned once for two calls; the settings record what is true here (hashes randomized, whatever
    # the variable now says) and in a child started afterwards (which inherits the variable).
    assert len(a["warnings"]) == 1 and "PYTHONHASHSEED only takes effect at start-up" in a["warnings"][0]
    assert a["randomized"] == 1 and a["captured"] is None and a["child"] == "1234"
    b = _run({"PYTHONHASHSEED": "5", "CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert b["warnings"] == [] and b["hashseed"] == "5" and b["cublas"] == ":16:8"  # left as set
    assert b["captured"] == "5" and b["child"] == "5"
    assert a["draws"] == b["draws"]


def test_the_hash_seed_recorded_is_the_one_this_interpreter_uses(monkeypatch):
    from tensorcanon.training import determinism

    monkeypatch.setattr(determinism, "_STARTUP_HASHSEED", "0")  # set after start-up: does not apply
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert DeterminismSettings.capture().pythonhashseed == ("0" if not sys.flags.hash_randomization else None)
    for started_with in ("7", "random", None):
        monkeypatch.setattr(determinism, "_STARTUP_HASHSEED", started_with)
        expected = "0" if not sys.flags.hash_randomization else started_with
        assert DeterminismSettings.capture().pythonhashseed == expected


def test_the_hash_seed_text_is_written_and_read_as_it_is():
    """docs/FORMAT.md §6.7.2: PYTHONHASHSEED=random and PYTHONHASHSEED= are recorded as "random" and ""
    (capture: the test above), written as those texts, not nil, and given back as the file holds them."""
    import hostile_lib as h

    s = DeterminismSettings.capture()
    values = [None, "", "random", "0", "42"]
    settings = [dataclasses.replace(s, pythonhashseed=v) for v in values]
    data = tensorcanon.dumps(settings)
    nodes = h.manifest_of(data)[0]["root"][1:]
    written = [state[state.index("pythonhashseed") + 1] for _, _, state in nodes]
    assert written == values
    assert [x.pythonhashseed for x in tensorcanon.loads(data)] == values
    assert len({tensorcanon.fingerprint(x) for x in settings}) == len(values)  # five contents


def test_seed_everything_in_process(monkeypatch):
    from tensorcanon.training import determinism

    os.environ.pop("PYTHONHASHSEED", None)
    monkeypatch.setattr(determinism, "_hashes_randomized", lambda: True)  # as when started without it
    monkeypatch.setattr(determinism, "_hashseed_warned", False)
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


@pytest.mark.parametrize("saved, now, differs", [
    (None, "0", False), ("random", "7", False), ("", None, False),   # the saved run's hashes were random
    ("0", None, True), ("1", "2", True), ("0", "random", True),     # a fixed order that is not repeated
    ("3", "3", False),
])
def test_compare_reports_the_hash_seed_only_when_the_saved_run_had_a_fixed_one(saved, now, differs):
    s = DeterminismSettings.capture()
    a, b = dataclasses.replace(s, pythonhashseed=saved), dataclasses.replace(s, pythonhashseed=now)
    assert [d.field for d in a.compare(b)] == (["pythonhashseed"] if differs else [])


def test_settings_round_trip_and_validation():
    s = DeterminismSettings.capture()
    data = tensorcanon.dumps({"settings": s})
    loaded = tensorcanon.loads(data)["settings"]
    assert loaded == s and type(loaded) is DeterminismSettings
    # What a reader rejects can be neither built nor saved (one check: determinism.settings_problem;
    # the reader's side is tests/test_conformance.py::test_determinism_settings_reader_rejects_bad_fields)
    for change in ({"num_threads": "2"}, {"gpu_names": ("a",), "gpu_sm_counts": ()},
                   {"float32_matmul_precision": "ieee"}, {"cudnn_version": True}):
        field = sorted(change)[-1]
        with pytest.raises(tensorcanon.UsageError, match=field):
            dataclasses.replace(s, **change)
        bad = dataclasses.replace(s)
        for k, v in change.items():
            object.__setattr__(bad, k, v)  # (a frozen dataclass can still be changed this way)
        with pytest.raises(tensorcanon.UnsupportedTypeError, match=field):
            tensorcanon.dumps(bad)


def test_apply_restores_switches():
    s = DeterminismSettings.capture()
    torch.use_deterministic_algorithms(not s.deterministic_algorithms)
    torch.set_float32_matmul_precision("medium" if s.float32_matmul_precision != "medium" else "high")
    assert {d.field for d in s.compare()} >= {"deterministic_algorithms", "float32_matmul_precision"}
    assert s.apply() == []
