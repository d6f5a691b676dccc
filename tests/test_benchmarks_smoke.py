"""The benchmark harness runs end to end (a smoke test: it checks structure, never timings)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_benchmark_run_writes_every_section(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--runs", "1",
         "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for section in ("## Machine", "## Targets", "## Why these targets", "Large:", "Small:", "GPT-2-small-shaped",
                    "Fingerprint only", "Lazy open", "Verify:", "torch.save", "safetensors save_file", "raw write",
                    "load(mmap=True) (verified) + read every page", "torch.load(mmap=True) + read every page",
                    "collector paused", "safe_open + get_tensor"):
        assert section in text, section
    assert "| save large, vs raw write | ≤ 1.1× |" in text
    assert "| lazy open + read 1 of 1000 by path (verified), vs safe_open + get_tensor | ≤ 3× |" in text
    assert [p.name for p in tmp_path.iterdir()] == ["RESULTS.md"], "the harness must clean up its files"
