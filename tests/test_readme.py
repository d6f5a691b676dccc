"""The README's self-contained examples run as written."""

from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_blocks() -> list[str]:
    text = open(README, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _block_containing(marker: str) -> str:
    found = [b for b in _python_blocks() if marker in b]
    assert len(found) == 1, f"README should have exactly one python block containing {marker!r}"
    return found[0]


def test_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(_block_containing("model = torch.nn.Linear(4, 2)"), "README quickstart", "exec"), scope)
    assert scope["digest"].startswith("xxh3-128:")
    assert scope["tensorcanon"].loads(scope["data"]).keys() == {"weight", "bias"}


def test_register_example_runs():
    import dataclasses

    import tensorcanon

    scope: dict = {"dataclasses": dataclasses, "tensorcanon": tensorcanon}
    exec(compile(_block_containing("tensorcanon.register(RunConfig)"), "README register", "exec"), scope)
    try:
        cfg = scope["RunConfig"](lr=0.1, steps=3)
        assert tensorcanon.loads(tensorcanon.dumps(cfg)) == cfg
    finally:
        tensorcanon.unregister(scope["RunConfig"])


@pytest.mark.parametrize("command", ["demo", "tests"])
def test_readme_has_the_two_fresh_machine_commands(command):
    bash = re.findall(r"```bash\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)
    setup = [b.strip() for b in bash if "pip install" in b and "&&" in b]
    assert len(setup) == 2, setup
    want = "examples/demo.py" if command == "demo" else "pytest"
    assert any(want in b for b in setup)
    if command == "tests":
        ci = open(os.path.join(os.path.dirname(README), ".ci", "run"), encoding="utf-8").read()
        assert next(b for b in setup if "pytest" in b) in ci, ".ci/run must run the README's test command"
