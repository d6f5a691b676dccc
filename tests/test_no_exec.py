"""Loading never imports, looks up or calls anything named in a file (issue 6, part 5).

Hostile files name ``os.system``, ``subprocess.Popen``, ``builtins.eval`` and
names that look like registered types; pickles (torch.save output, a raw
pickle with a GLOBAL/REDUCE payload) must be refused with FormatError. During
every load we watch ``builtins.__import__``, ``importlib.import_module``,
``sys.modules`` and trap the callables an exploit would reach for.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch

import tensorcanon
from tensorcanon.format import errors, registry

HERE = os.path.dirname(os.path.abspath(__file__))

import hostile_lib as h


class Executed(BaseException):
    """Raised by a trap; a BaseException so no except-Exception in the loader hides it."""


@dataclasses.dataclass
class Config:
    lr: float


_calls: list = []


def _trap(name):
    def f(*a, **k):
        _calls.append(name)
        raise Executed(name)

    return f


@pytest.fixture
def watched(monkeypatch):
    """``run(fn, *args)``: call ``fn`` while recording imports; dangerous callables stay trapped.

    Imports are recorded only inside ``run`` (pytest's own machinery imports as
    it likes); ``sys.modules`` must not grow across any of the loads.
    """
    imports: list = []
    active = [False]
    real_import = builtins.__import__

    def spy_import(name, globals=None, locals=None, fromlist=(), level=0):
        if active[0]:
            imports.append((name, level))
        return real_import(name, globals, locals, fromlist, level)

    def spy_import_module(name, package=None):
        imports.append((name, "import_module"))
        raise Executed(f"import_module({name!r})")

    for mod, attr in [(os, "system"), (os, "popen"), (os, "execv"), (subprocess, "Popen"),
                      (builtins, "eval"), (builtins, "exec"), (pickle, "loads"), (pickle, "load"),
                      (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, attr, _trap(f"{mod.__name__}.{attr}"))
    monkeypatch.setattr(builtins, "__import__", spy_import)
    monkeypatch.setattr(importlib, "import_module", spy_import_module)
    _calls.clear()
    before = set(sys.modules)

    def run(fn, *args, **kwargs):
        active[0] = True
        try:
            return fn(*args, **kwargs)
        finally:
            active[0] = False

    yield run
    assert _calls == [], f"a trapped callable was called: {_calls}"
    assert set(sys.modules) == before, f"loading imported modules: {set(sys.modules) - before}"
    foreign = [(n, lvl) for n, lvl in imports if lvl == 0 and not n.startswith(("tensorcanon", "torch", "numpy"))]
    assert foreign == [], f"loading imported names: {foreign}"


def _with_root(root) -> bytes:
    return h.rerooted(tensorcanon.dumps({"t": torch.ones(2), "n": 1}), root)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _pickles() -> list[bytes]:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    return [
        buf.getvalue(),
        pickle.dumps(_Evil(), protocol=2),
        pickle.dumps(_Evil(), protocol=4),
        b"cos\nsystem\n(S'echo pwned'\ntR.",
        b"\x80\x02cbuiltins\neval\nq\x00X\x0b\x00\x00\x00print('hi')q\x01\x85q\x02Rq\x03.",
    ]


PICKLES = _pickles()  # made at import, before any trap is set

HOSTILE_ROOTS = [
    ["obj", "os.system", ["list", "echo pwned"]],
    ["obj", "subprocess.Popen", ["list", ["list", "sh", "-c", "echo pwned"]]],
    ["obj", "builtins.eval", "__import__('os').system('echo pwned')"],
    ["obj", "torch.load", "x"],
    ["obj", "test_no_exec.Config", ["dict", "lr", 0.1]],  # looks like a real type, is not registered
    ["obj", "Config", ["dict", "lr", 0.1]],
    ["os.system", "echo pwned"],
    ["__reduce__", ["obj", "os.system", "x"]],
    ["dict", "__class__", ["obj", "posix.system", "x"]],
]


@pytest.mark.parametrize("root", HOSTILE_ROOTS, ids=lambda r: str(r[1])[:30])
def test_named_callables_are_never_imported_or_called(watched, root):
    data = _with_root(root)
    with pytest.raises(errors.TensorCanonError) as info:
        watched(tensorcanon.loads, data)
    assert isinstance(info.value, (errors.FormatError, errors.UnsupportedTypeError))
    with pytest.raises((errors.FormatError, errors.UnsupportedTypeError)):
        watched(tensorcanon.load, h.Stream(data))
    try:  # verify checks structure only; it may accept an unregistered name, but runs nothing
        watched(tensorcanon.verify, data)
    except errors.TensorCanonError:
        pass
    assert watched(tensorcanon.read_metadata, data) is None


def test_unregistered_type_error_says_nothing_is_imported(watched):
    with pytest.raises(errors.UnsupportedTypeError, match="never imports names found in a file"):
        watched(tensorcanon.loads, _with_root(["obj", "os.system", ["list", "x"]]))


def test_only_the_registered_decoder_runs():
    """A registered name calls exactly the decoder registered for it, nothing named in the file."""
    calls = []
    tensorcanon.register(Config, name="test.Config", decode=lambda s: calls.append(s) or Config(**s),
                         encode=dataclasses.asdict)
    try:
        data = tensorcanon.dumps({"cfg": Config(0.5)})
        assert tensorcanon.loads(data) == {"cfg": Config(0.5)}
        assert calls == [{"lr": 0.5}]
        with pytest.raises(errors.UnsupportedTypeError):
            tensorcanon.loads(_with_root(["obj", "test.Config2", ["dict", "lr", 0.1]]))
        assert calls == [{"lr": 0.5}]
    finally:
        registry.unregister(Config)


def test_pickles_are_refused_with_format_error(watched):
    for data in PICKLES:
        for src in (data, h.Stream(data)):
            with pytest.raises(errors.FormatError, match="never unpickles"):
                watched(tensorcanon.load, src)
        with pytest.raises(errors.FormatError):
            watched(tensorcanon.verify, data)


def test_torch_save_file_on_disk_is_refused(tmp_path, watched):
    data = PICKLES[0]
    p = tmp_path / "model.pt"
    p.write_bytes(data)
    with pytest.raises(errors.FormatError, match="torch.save"):
        watched(tensorcanon.load, p)
