"""``import tensorcanon`` (and ``tensorcanon.integrations``) must not import any training framework, and an
integration imported without its framework says which extra installs it."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def test_importing_tensorcanon_imports_no_framework():
    code = ("import sys, tensorcanon, tensorcanon.integrations\n"
            f"print(' '.join(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_an_integration_without_its_framework_names_the_extra_to_install():
    # One interpreter for the three: each framework is made unimportable (None in sys.modules).
    code = (
        "import sys\n"
        "for module in ('lightning', 'accelerate', 'transformers'):\n"
        "    sys.modules[module] = None\n"
        "    try:\n"
        "        __import__(f'tensorcanon.integrations.{module}')\n"
        "    except ImportError as e:\n"
        "        print(type(e).__name__, e.name, '|', e)\n"
        "    else:\n"
        "        print('imported', module)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    for line, module in zip(lines, ("lightning", "accelerate", "transformers"), strict=True):
        kind, name, message = line.split(" ", 2)
        assert kind == "ModuleNotFoundError" and name.startswith(module), line
        assert f'needs the {module} package' in message, line
        assert f"pip install {module} (the [{module}] extra" in message, line
