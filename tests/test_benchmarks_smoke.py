"""The benchmark harness runs end to end (a smoke test: it checks structure, never timings)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_benchmark_run_writes_every_section(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--runs", "1",
         "--out", str(out), "--dir", str(tmp_path), "--disk-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for section in ("## Machine", "## Targets", "## Why these targets", "Large:", "Small:", "GPT-2-small-shaped",
                    "Fingerprint only", "Lazy open", "Verify:", "torch.save", "safetensors save_file", "raw write",
                    "load(mmap=True) (verified) + read every page", "torch.load(mmap=True) + read every page",
                    "collector paused", "safe_open + get_tensor", "save large to a file object on disk",
                    "Large saves: 16 MiB in 128 tensors (1 processes of their own", "Memory-mapped loads:",
                    "Peak extra RSS while saving a 32 MiB checkpoint", "### GPU (",
                    "Distributed checkpoints: 1 rank (gloo) x 8 MiB", "load: tensorcanon.dcp (every chunk verified)"):
        assert section in text, section
    assert "| save large, vs raw write | ≤ 1.1× |" in text
    assert "| lazy open + read 1 of 1000 by path (verified), vs safe_open + get_tensor | ≤ 3× |" in text
    assert "| lazy open + read 1 of 1000: bytes verified | only that tensor's 4096 |" in text
    for ratio in ("save, vs DCP default", "load (verified), vs DCP default", "async_save blocking, vs DCP default"):
        assert f"| DCP {ratio} |" in text, ratio
    assert [p.name for p in tmp_path.iterdir()] == ["RESULTS.md"], "the harness must clean up its files"


def test_rounds_rotate_and_ratios_pair_rounds(monkeypatch):
    """Each round starts one operation later, and a ratio is the median of per-round ratios."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # run.py puts benchmarks/ on it; undone after
    spec = importlib.util.spec_from_file_location("tc_bench_run", os.path.join(ROOT, "benchmarks", "run.py"))
    bench_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_run)
    # the order of the rounds is checked here, not the full collection before each operation (0.1 s
    # or more in a process that holds torch and the test suite): this test's twelve skip it
    monkeypatch.setattr(bench_run.gc, "collect", lambda generation=2: 0)
    calls = []
    ops = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    timings = bench_run.interleaved_medians(ops, 4)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert all(len(ts) == 4 for ts in timings.rounds.values())
    # ratios pair the rounds: a round twice as slow for both cancels out
    fake = bench_run.Timings({"x": [1.0, 2.0, 10.0], "y": [2.0, 4.0, 8.0]}, {"x": [1.0] * 3, "y": [2.0] * 3},
                             {"x": 0, "y": 1})
    assert fake["x"] == 2.0 and fake["y"] == 4.0  # medians
    assert fake.ratio("x", "y") == 0.5  # per round: 0.5, 0.5, 1.25
    assert fake.ratio("y", "x") == 2.0
    # processes' rounds pool into one set: the ratio is over all of them
    other = bench_run.Timings({"x": [3.0], "y": [1.0]}, {"x": [3.0], "y": [1.0]}, {"x": 1, "y": 0})
    pooled = bench_run.Timings.pooled([fake.to_json(), other.to_json(), other.to_json()])
    assert pooled.rounds["x"] == [1.0, 2.0, 10.0, 3.0, 3.0] and pooled.disturbed == {"x": 2, "y": 1}
    assert pooled.ratio("x", "y") == 1.25  # per round: 0.5, 0.5, 1.25, 3, 3


def test_python_objects_benchmark_runs_and_reports_every_workload(tmp_path):
    out = tmp_path / "python_objects.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "python_objects.py"), "--quick", "--runs", "1",
         "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for workload in ("log history", "token ids", "vocabulary"):
        for op in ("tensorcanon.dumps", "tensorcanon.save(file object)", "tensorcanon.loads",
                   "torch.save(BytesIO)", "torch.load(weights_only=True)", "pickle.dumps", "pickle.loads"):
            assert f"| {workload} (" in text and f"| {op} |" in text, (workload, op)
    assert "| log history (1,000 entries) | size ≤ 1.2× torch.save's |" in text
    assert "| vocabulary (5,000 entries) | tensorcanon.loads ≤ 1.0× torch.load(weights_only=True) |" in text
    assert [p.name for p in tmp_path.iterdir()] == ["python_objects.md"], "the benchmark must clean up its files"


def _compare(tmp_path, *args):
    out = tmp_path / "compare.md"
    files = tmp_path / "files"
    files.mkdir()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), *args, "--runs", "1", "--inner", "1",
         "--short-runs", "2", "--large-mib", "2", "--small-count", "40", "--dir", str(files), "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(files.iterdir()) == [], "compare.py must clean up its files"
    text = out.read_text()
    assert "Each child times each workload 1 times (lazy8, dumps, loads, lazy1k, config: 2)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| workload")]
    labels = [line.split(" | ")[0].removeprefix("| ") for line in rows if not line.startswith("| ---")]
    return text, labels


def test_compare_runs_across_format_versions_comparing_operations_not_bytes(tmp_path):
    """issue 41, item 4: the previous release (0.3.0, 7c8aba2) writes format version 2, this tree 3;
    compare.py times the same operations on both, checks that both loaded equal values, and compares
    bytes only within one format version."""
    text, labels = _compare(tmp_path, "--base", "7c8aba2")
    assert "Both sides loaded equal values (config, large, loads, small" in text
    assert ("Written in different format versions (large: version 2 in base, 3 in head, small: version 2 in "
            "base, 3 in head, dumps: version 2 in base, 3 in head)") in text
    assert "**" not in text  # nothing in bold: no disagreement
    assert "open a file of 1,000 tensors + read 1 by path" in labels
    assert "save a small config to a file object" in labels
    assert len(labels) == 12 and "—" not in text  # every workload timed on both sides


def test_compare_takes_a_directory_as_a_side_and_compares_bytes_within_a_version(tmp_path):
    """A worktree (any directory holding src/tensorcanon) as the base: here this checkout against
    itself, so both sides write format version 3, and their files must be byte-identical."""
    text, _ = _compare(tmp_path, "--base", ROOT)
    assert f"base the directory {ROOT}" in text
    assert "Written in the same format version on both sides (large, small, dumps: version 3): byte-identical" in text
    assert "Both sides loaded equal values" in text and "**" not in text
