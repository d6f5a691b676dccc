"""benchmarks/dcp_bench.py runs end to end (structure only, never timings)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dcp_benchmark_runs_and_reports_every_figure(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "dcp_bench.py"), "--mib", "8", "--runs", "1",
         "--dir", str(tmp_path), "--timeout", "240"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for row in ("save: DCP default", "save: tensorcanon.dcp", "load: DCP default", "load: tensorcanon.dcp",
                "async_save blocking: DCP default", "async_save blocking: tensorcanon.dcp",
                "| save, vs DCP default |", "| load (verified), vs DCP default |",
                "| async_save blocking, vs DCP default |", "logical digest: xxh3-128:"):
        assert row in proc.stdout, row
    assert list(tmp_path.iterdir()) == [], "the benchmark must remove its files"
