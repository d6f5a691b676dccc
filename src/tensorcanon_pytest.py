"""pytest plugin: snapshot tests for tensors (``tensor_snapshot`` fixture).

Expected values are canonical tensorcanon files stored next to the tests::

    tests/__snapshots__/<test file name>/<test name>.safetensors

A test compares a value with its snapshot; ``pytest --tensorcanon-update``
writes the snapshots that are missing or differ (and leaves equal ones
untouched, so the diff to review is exactly what changed). A missing snapshot
fails with the command that creates it. The plugin is registered through the
``pytest11`` entry point, so installing tensorcanon is enough. It is a top-level
module, not part of the tensorcanon package, so that pytest can load it in any
environment without importing tensorcanon and torch; they are imported only
when a test uses the fixture.

Example::

    def test_forward(tensor_snapshot):
        torch.manual_seed(0)
        out = model(torch.ones(2, 4))
        tensor_snapshot(out)                          # test_forward.safetensors
        tensor_snapshot(model.state_dict(), name="weights", atol=1e-6)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

UPDATE_OPTION = "--tensorcanon-update"
SUFFIX = ".safetensors"
_written_key = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tensorcanon", "tensor snapshots (tensorcanon)")
    group.addoption(
        UPDATE_OPTION, action="store_true", default=False,
        help="write tensor snapshots that are missing or differ, instead of failing",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_written_key] = []


def _safe(name: str) -> str:
    return re.sub(r"[^\w.\-\[\]=,+]", "_", name)


class TensorSnapshot:
    """Compares values with the snapshots of one test; call it or use :meth:`assert_match`."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        node = request.node
        test_file = Path(str(node.path))
        self.folder = test_file.parent / "__snapshots__" / test_file.stem
        qualified = node.nodeid.split("::", 1)[1] if "::" in node.nodeid else node.name
        self.base = _safe(qualified.replace("::", "."))
        self.update = bool(request.config.getoption(UPDATE_OPTION))
        self._config = request.config
        self._calls = 0

    def path(self, name: str | None = None) -> Path:
        """Where the snapshot named ``name`` (or the next unnamed one) is stored."""
        if name is not None:
            return self.folder / f"{self.base}.{_safe(name)}{SUFFIX}"
        n = self._calls
        return self.folder / (f"{self.base}{SUFFIX}" if n == 0 else f"{self.base}.{n}{SUFFIX}")

    def __call__(self, value: Any, *, name: str | None = None, atol: float = 0.0, rtol: float = 0.0) -> None:
        self.assert_match(value, name=name, atol=atol, rtol=rtol)

    def assert_match(self, value: Any, *, name: str | None = None, atol: float = 0.0, rtol: float = 0.0) -> None:
        """Require ``value`` to equal its stored snapshot (bit-exact unless a tolerance is given)."""
        import tensorcanon
        from tensorcanon import diff

        target = self.path(name)
        if name is None:
            self._calls += 1
        shown = _display(target, self._config)
        if not target.exists():
            if self.update:
                self._write(value, target)
                return
            pytest.fail(
                f"tensor snapshot {shown} does not exist yet. Run pytest with {UPDATE_OPTION} to "
                "create it from this run's value, then review and commit it.", pytrace=False,
            )
        if not atol and not rtol:
            try:
                if tensorcanon.verify(target) == tensorcanon.fingerprint(value):
                    return
            except tensorcanon.IntegrityError:
                pass  # a damaged snapshot: the diff below reports the load error
        expected = tensorcanon.load(target, map_location="cpu")
        result = diff(expected, value, atol=atol, rtol=rtol)
        if not result and (atol or rtol):
            return
        if self.update:
            self._write(value, target)
            return
        detail = str(result) if result else "the digests differ (the value would be saved differently)"
        pytest.fail(
            f"value does not match tensor snapshot {shown} (A: snapshot, B: this run):\n{detail}\n"
            f"If the new value is right, run pytest with {UPDATE_OPTION} and commit the snapshot.",
            pytrace=False,
        )

    def _write(self, value: Any, target: Path) -> None:
        import tensorcanon

        target.parent.mkdir(parents=True, exist_ok=True)
        tensorcanon.save(value, target)
        self._config.stash[_written_key].append(_display(target, self._config))


def _display(path: Path, config: pytest.Config) -> str:
    try:
        return str(path.relative_to(config.rootpath))
    except ValueError:
        return str(path)


@pytest.fixture
def tensor_snapshot(request: pytest.FixtureRequest) -> TensorSnapshot:
    """Compare tensors (or any saveable object) with a snapshot file stored beside the test."""
    return TensorSnapshot(request)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int | pytest.ExitCode,
                            config: pytest.Config) -> None:
    written = config.stash.get(_written_key, [])
    if written:
        terminalreporter.write_sep("-", f"tensorcanon: wrote {len(written)} tensor snapshot(s)")
        for path in written:
            terminalreporter.write_line(f"  {path}")
