"""tensorcanon.testing assertions and the tensor_snapshot pytest plugin."""

import random

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.testing import assert_deterministic, assert_identical

pytest_plugins = ["pytester"]


# ---------------------------------------------------------------- assert_identical


def test_assert_identical_passes_and_fails_with_the_diff():
    assert_identical({"w": torch.ones(3)}, {"w": torch.ones(3)})
    b = torch.ones(3)
    b[1] = 2
    with pytest.raises(AssertionError) as info:
        assert_identical({"w": torch.ones(3), "s": 1}, {"w": b, "s": 2}, msg="after one step")
    assert str(info.value).splitlines() == [
        "after one step: expected (A) and actual (B) differ:",
        '$["s"]: value 1 -> 2',
        '$["w"]: 1 of 3 elements differ; max abs diff 1, max rel diff 0.5; first at [1]: 1.0 -> 2.0',
        "2 differences (bit-exact)",
    ]


def test_assert_identical_with_tolerance_and_files(tmp_path):
    assert_identical(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), atol=1e-6)
    with pytest.raises(AssertionError, match="1 of 1 elements differ"):
        assert_identical(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]))
    tensorcanon.save({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    assert_identical(tmp_path / "a.safetensors", {"w": torch.ones(2)})


# ---------------------------------------------------------------- assert_deterministic


def test_assert_deterministic_passes_for_a_seeded_function_and_returns_the_digest():
    def step(n):
        layer = torch.nn.Linear(4, 2)
        return {"out": layer(torch.randn(n, 4)), "np": np.random.rand(2), "py": random.random()}

    digest = assert_deterministic(step, 3, runs=3, seed=1)
    assert digest.startswith("xxh3-128:")
    assert assert_deterministic(step, 3, seed=1) == digest
    assert assert_deterministic(step, 3, seed=2) != digest


def test_assert_deterministic_names_what_changed():
    calls = []

    def leaky():
        calls.append(1)
        w = torch.zeros(4)
        w[2] = len(calls)  # state carried between calls
        return {"w": w}

    with pytest.raises(AssertionError) as info:
        assert_deterministic(leaky, runs=3, seed=0)
    text = str(info.value)
    assert text.startswith("test_assert_deterministic_names_what_changed.<locals>.leaky is not deterministic: "
                           "with seed=0, run 1 and run 2 of 3 returned different outputs")
    assert '$["w"]: 1 of 4 elements differ; max abs diff 1, max rel diff 0.5; first at [2]: 1.0 -> 2.0' in text


def test_assert_deterministic_snapshots_outputs_mutated_in_place():
    state = torch.zeros(2)

    def mutate():
        state.add_(1)
        return state  # the same tensor each time: run 1's value must not change afterwards

    with pytest.raises(AssertionError, match=r"first at \[0\]: 1.0 -> 2.0"):
        assert_deterministic(mutate)


def test_assert_deterministic_restores_the_callers_generators():
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    assert_deterministic(lambda: torch.rand(2), seed=0)
    assert (torch.rand(1), random.random(), np.random.rand()) == expected
    with pytest.raises(ValueError):
        assert_deterministic(lambda: 1, runs=1)


def test_assert_deterministic_uses_seed_everything_when_available(monkeypatch):
    seen = []
    monkeypatch.setattr(tensorcanon, "seed_everything", lambda seed: seen.append(seed), raising=False)
    assert_deterministic(lambda: 1, runs=2, seed=9)
    assert seen == [9, 9]


# ---------------------------------------------------------------- pytest plugin

TEST_FILE = """
import torch

def test_model(tensor_snapshot):
    tensor_snapshot({"w": torch.arange(6.0).reshape(2, 3) * SCALE, "step": 3})
    tensor_snapshot(torch.ones(2), name="bias")
"""


def test_snapshot_missing_fails_with_instructions(pytester):
    pytester.makepyfile(test_snap=TEST_FILE.replace("SCALE", "1"))
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*tensor snapshot __snapshots__/test_snap/test_model.safetensors does not exist yet. "
        "Run pytest with --tensorcanon-update to create it*",
    ])


def test_snapshot_update_then_match_then_mismatch(pytester):
    pytester.makepyfile(test_snap=TEST_FILE.replace("SCALE", "1"))
    result = pytester.runpytest("--tensorcanon-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*tensorcanon: wrote 2 tensor snapshot(s)*",
                                 "*__snapshots__/test_snap/test_model.safetensors"])
    folder = pytester.path / "__snapshots__" / "test_snap"
    assert sorted(p.name for p in folder.iterdir()) == ["test_model.bias.safetensors", "test_model.safetensors"]
    stored = tensorcanon.load(folder / "test_model.safetensors")
    assert stored["step"] == 3 and torch.equal(stored["w"], torch.arange(6.0).reshape(2, 3))

    pytester.runpytest().assert_outcomes(passed=1)  # unchanged: passes, writes nothing
    before = (folder / "test_model.safetensors").stat().st_mtime_ns

    pytester.makepyfile(test_snap=TEST_FILE.replace("SCALE", "2"))
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    lines = result.stdout.lines
    start = lines.index("value does not match tensor snapshot __snapshots__/test_snap/test_model.safetensors "
                        "(A: snapshot, B: this run):")
    assert lines[start + 1:start + 4] == [
        '$["w"]: 5 of 6 elements differ; max abs diff 5, max rel diff 0.5; first at [0, 1]: 1.0 -> 2.0',
        "1 difference (bit-exact)",
        "If the new value is right, run pytest with --tensorcanon-update and commit the snapshot.",
    ]
    assert (folder / "test_model.safetensors").stat().st_mtime_ns == before
    pytester.runpytest("--tensorcanon-update").assert_outcomes(passed=1)
    pytester.runpytest().assert_outcomes(passed=1)
    assert torch.equal(tensorcanon.load(folder / "test_model.safetensors")["w"], torch.arange(6.0).reshape(2, 3) * 2)


def test_snapshot_tolerance_and_parametrized_names(pytester):
    pytester.makepyfile(test_tol="""
import pytest, torch

@pytest.mark.parametrize("x", [1.0, 2.0])
def test_close(tensor_snapshot, x):
    tensor_snapshot(torch.tensor([x]) + OFFSET, atol=1e-3)
""".replace("OFFSET", "0.0"))
    pytester.runpytest("--tensorcanon-update").assert_outcomes(passed=2)
    names = sorted(p.name for p in (pytester.path / "__snapshots__" / "test_tol").iterdir())
    assert names == ["test_close[1.0].safetensors", "test_close[2.0].safetensors"]
    pytester.makepyfile(test_tol=pytester.path.joinpath("test_tol.py").read_text().replace("+ 0.0", "+ 1e-4"))
    pytester.runpytest().assert_outcomes(passed=2)
    pytester.makepyfile(test_tol=pytester.path.joinpath("test_tol.py").read_text().replace("+ 1e-4", "+ 1e-2"))
    pytester.runpytest().assert_outcomes(failed=2)


def test_plugin_option_is_listed_in_help(pytester):
    pytester.runpytest("--help").stdout.fnmatch_lines(["*--tensorcanon-update*"])


def test_the_plugin_loads_without_importing_torch(tmp_path):
    # Installed as a pytest11 entry point, the plugin loads in every pytest run of the
    # environment; it must not make unrelated test suites pay for importing torch.
    import subprocess
    import sys

    (tmp_path / "test_other.py").write_text(
        "import sys\n\n"
        "def test_nothing_imported(pytestconfig):\n"
        "    assert pytestconfig.pluginmanager.has_plugin('tensorcanon')\n"
        "    assert 'torch' not in sys.modules and 'tensorcanon' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
