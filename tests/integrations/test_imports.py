"""``import tensorcanon`` (and ``tensorcanon.integrations``) must not import any training framework."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def test_importing_tensorcanon_imports_no_framework():
    code = ("import sys, tensorcanon, tensorcanon.integrations\n"
            f"print(' '.join(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
