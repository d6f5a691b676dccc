"""Built-in codecs (docs/FORMAT.md §6.9): off by default (io.BytesIO and argparse.Namespace: always on),
exact when on, strict when loading."""

from __future__ import annotations

import argparse
import datetime as dt
import io
import os
import pathlib
import pickle
import re
import subprocess
import sys

import pytest

import tensorcanon
from tensorcanon.format import codecs, registry

import hostile_lib as h

_CLASSES = [pathlib.PurePath, dt.date, dt.time, dt.datetime, dt.timedelta]  # (argparse.Namespace: on by default)


@pytest.fixture
def off():
    """The codecs disabled for one test, as in a fresh process; restored afterwards."""
    was_on = registry.by_name(codecs.PATH) is not None
    for cls in _CLASSES:
        registry.unregister(cls)
    yield
    if was_on:
        codecs.register_all()


@pytest.fixture
def on(off):
    codecs.register_all()
    yield


UTC530 = dt.timezone(dt.timedelta(hours=5, minutes=30))
VALUES = [
    pathlib.PurePosixPath("/data/run 1/ckpt.pt"), pathlib.PurePosixPath("rel/x"), pathlib.PurePosixPath("//net/x"),
    pathlib.PurePosixPath(), pathlib.PureWindowsPath("C:/Users/x"), pathlib.PureWindowsPath("//server/share/d"),
    pathlib.Path("/tmp/a"), pathlib.Path("a/b"),
    dt.date(2024, 2, 29), dt.date(1, 1, 1), dt.date(9999, 12, 31),
    dt.time(), dt.time(23, 59, 59, 999999, tzinfo=UTC530, fold=1), dt.time(1, tzinfo=dt.timezone.utc),
    dt.datetime(2024, 1, 2, 3, 4, 5, 6), dt.datetime(2024, 11, 3, 1, 30, fold=1),
    dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc),
    dt.datetime(2000, 6, 1, tzinfo=dt.timezone(-dt.timedelta(hours=23, minutes=59, seconds=59, microseconds=1))),
    dt.timedelta(), dt.timedelta(days=-1, microseconds=5), dt.timedelta(days=999999999, hours=23),
    argparse.Namespace(lr=0.1, data=pathlib.PurePosixPath("/d"), layers=[1, 2], **{"odd-name": None}),
]


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (dt.time, dt.datetime)):
        return (a == b and a.fold == b.fold and a.utcoffset() == b.utcoffset()
                and (a.tzinfo is None) == (b.tzinfo is None))
    return a == b


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:50] for v in VALUES])
def test_values_round_trip_exactly(on, value):
    back = tensorcanon.loads(tensorcanon.dumps({"v": value}))["v"]
    assert _same(value, back), (value, back)


@pytest.mark.parametrize("value", [pathlib.Path("/x"), dt.date(2020, 1, 1), dt.timedelta(1)])
def test_off_by_default_and_the_error_says_how_to_enable(off, value):
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"tensorcanon\.codecs\.register_\w+\(\)") as info:
        tensorcanon.dumps({"hparams": {"v": value}})
    assert info.value.path == '$["hparams"]["v"]'
    assert "register_builtin_codecs()" in str(info.value)


def test_loading_needs_the_codec_and_says_which(off):
    codecs.register_paths()
    data = tensorcanon.dumps({"p": pathlib.PurePosixPath("/x")})
    registry.unregister(pathlib.PurePath)
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"register_paths\(\)") as info:
        tensorcanon.loads(data)
    assert info.value.path == '$["p"]'


def test_enabling_twice_is_fine_and_a_users_own_registration_is_kept(off):
    codecs.register_all()
    tensorcanon.register_builtin_codecs()
    for cls in _CLASSES:
        registry.unregister(cls)
    tensorcanon.register(dt.timedelta, name="mine.td", encode=lambda v: v.days, decode=lambda d: dt.timedelta(d))
    try:
        with pytest.raises(tensorcanon.UsageError, match="built-in codec 'datetime.timedelta'"):
            codecs.register_datetime()
    finally:
        registry.unregister(dt.timedelta)


def test_subclasses_of_paths_load_as_the_standard_class(on):
    class MyPath(type(pathlib.Path())):
        pass

    back = tensorcanon.loads(tensorcanon.dumps(MyPath("/a")))
    assert type(back) is type(pathlib.Path()) and back == pathlib.Path("/a")


def test_refused_values(on):
    import zoneinfo

    try:
        zone = zoneinfo.ZoneInfo("UTC")
    except zoneinfo.ZoneInfoNotFoundError:  # no tz database on this machine
        zone = None

    class Stamp(dt.datetime):  # like pandas.Timestamp, which adds nanoseconds
        pass

    cases = [
        (dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1), "CET")), "named time zone"),
        (Stamp(2024, 1, 1), "subclass of datetime.datetime"),
    ]
    if zone is not None:
        cases.append((dt.datetime(2024, 1, 1, tzinfo=zone), "only fixed offsets"))
    for value, match in cases:
        with pytest.raises(tensorcanon.UnsupportedTypeError, match=match):
            tensorcanon.dumps({"v": value})


def _with_state(name, state_node) -> bytes:
    data = tensorcanon.dumps({"v": None})
    m, header, body = h.manifest_of(data)
    m["root"] = ["dict", "v", ["obj", name, state_node]]
    return h.rebuild(data, h.repack(m), header, body)


@pytest.mark.parametrize("name, state", [
    (codecs.PATH, ["list", "PurePosixPath", "a//b"]),
    (codecs.PATH, ["list", "PurePosixPath", "a/"]),
    (codecs.PATH, ["list", "PurePosixPath", ""]),
    (codecs.PATH, ["list", "PureWindowsPath", "c:/a"]),
    (codecs.PATH, ["list", "Path", "a"]),
    (codecs.PATH, ["list", "PurePosixPath", "a\x00b"]),
    (codecs.DATE, ["list", 2023, 2, 29]),
    (codecs.DATE, ["list", 2023, 2]),
    (codecs.DATE, ["list", 2023, True, 1]),
    (codecs.TIME, ["list", 24, 0, 0, 0, None, 0]),
    (codecs.TIME, ["list", 1, 0, 0, 0, None, 2]),
    (codecs.DATETIME, ["list", 2024, 1, 1, 0, 0, 0, 0, 86_400_000_000, 0]),
    (codecs.DATETIME, ["list", 2024, 1, 1, 0, 0, 0, 0, 1.5, 0]),
    (codecs.TIMEDELTA, ["list", 0, 90_000, 0]),
    (codecs.TIMEDELTA, ["list", 0, -1, 0]),
    (codecs.TIMEDELTA, ["list", 0, 0, 1_000_000]),
    (codecs.NAMESPACE, ["list", 1]),
])
def test_non_canonical_states_are_rejected(on, name, state):
    with pytest.raises(tensorcanon.FormatError, match="could not rebuild"):
        tensorcanon.loads(_with_state(name, state))


def test_a_concrete_path_of_the_other_system_fails_clearly(on):
    other = "WindowsPath" if os.name == "posix" else "PosixPath"
    with pytest.raises(tensorcanon.FormatError, match=f"a {other} cannot be created on this system"):
        tensorcanon.loads(_with_state(codecs.PATH, ["list", other, "a"]))


def test_states_are_what_the_spec_says(on):
    """docs/FORMAT.md §6.9: the exact nodes each codec writes."""
    from tensorcanon.io import writer

    cases = [
        (pathlib.PurePosixPath("/a/b"), ["obj", "pathlib.PurePath", ["list", "PurePosixPath", "/a/b"]]),
        (pathlib.PureWindowsPath("c:/a"), ["obj", "pathlib.PurePath", ["list", "PureWindowsPath", "c:\\a"]]),
        (dt.date(2024, 2, 29), ["obj", "datetime.date", ["list", 2024, 2, 29]]),
        (dt.time(1, 2, 3, 4, tzinfo=UTC530, fold=1), ["obj", "datetime.time", ["list", 1, 2, 3, 4, 19_800_000_000, 1]]),
        (dt.datetime(2024, 1, 2, 3, 4, 5, 6), ["obj", "datetime.datetime", ["list", 2024, 1, 2, 3, 4, 5, 6, None, 0]]),
        (dt.timedelta(days=-1, microseconds=5), ["obj", "datetime.timedelta", ["list", -1, 0, 5]]),
        (argparse.Namespace(b=1, a=2), ["obj", "argparse.Namespace", ["dict", "a", 2, "b", 1]]),
    ]
    for value, node in cases:
        assert writer.plan(value).root == node


# ------------------------------------------------------------------ io.BytesIO (always on)


@pytest.fixture
def bytes_io_restored():
    """For a test that unregisters the io.BytesIO codec: on again afterwards, as in a fresh process."""
    yield
    if registry.by_name(codecs.BYTES_IO) is None:
        codecs.register_bytes_io()


def test_bytes_io_is_on_without_any_call_and_round_trips(off, monkeypatch):
    """On in every process from import (the ``off`` fixture turns the opt-in codecs off), and
    saved and loaded without pickle: its bytes, back as a new io.BytesIO at position 0."""
    assert registry.by_type(io.BytesIO).name == codecs.BYTES_IO == "io.BytesIO"
    payload = bytes(range(256)) * 3
    moved = io.BytesIO(payload)
    moved.seek(100)
    data = tensorcanon.dumps({"x": moved, "empty": io.BytesIO(), "list": [io.BytesIO(b"\x80\x04.")]})
    assert moved.tell() == 100 and moved.getvalue() == payload  # saving neither moves nor changes it

    def refuse(*a, **k):
        raise AssertionError("pickle called while loading")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    back = tensorcanon.loads(data)
    for value, content in [(back["x"], payload), (back["empty"], b""), (back["list"][0], b"\x80\x04.")]:
        assert type(value) is io.BytesIO and value.tell() == 0 and value.getvalue() == content
    assert tensorcanon.verify(data) == tensorcanon.fingerprint({"x": io.BytesIO(payload), "empty": io.BytesIO(),
                                                                "list": [io.BytesIO(b"\x80\x04.")]})


def test_bytes_io_content_is_the_whole_buffer_whatever_the_position_or_source():
    """docs/FORMAT.md §6.9.4: getvalue(), so the position, and whether the buffer was built from
    bytes, a bytearray or a memoryview or written into, do not change the file."""
    from tensorcanon.io import writer

    expected = tensorcanon.dumps(io.BytesIO(b"abcdef"))
    written = io.BytesIO()
    written.write(b"abcdef")                       # position 6, at the end
    at_end = io.BytesIO(b"abcdef")
    at_end.read()
    exported = io.BytesIO(b"abcdef")
    view = exported.getbuffer()                    # an exported buffer does not change getvalue()
    for buf in (written, at_end, io.BytesIO(bytearray(b"abcdef")), io.BytesIO(memoryview(b"xabcdefx")[1:7]),
                exported):
        assert tensorcanon.dumps(buf) == expected
    view.release()
    assert writer.plan(io.BytesIO(b"ab")).root == ["obj", "io.BytesIO", b"ab"]   # the state is a bin
    assert writer.plan({"b": b"ab"}).root != writer.plan({"b": io.BytesIO(b"ab")}).root  # not a bytes leaf


def test_bytes_io_values_that_hold_more_than_bytes_are_refused_naming_the_path():
    class Named(io.BytesIO):
        pass

    closed = io.BytesIO(b"x")
    closed.close()
    tagged = io.BytesIO(b"x")
    tagged.name = "losses.pt"
    for value, words in [(Named(b"x"), "is a subclass of io.BytesIO"), (closed, "is closed"),
                         (tagged, "attributes set on it ('name')")]:
        with pytest.raises(tensorcanon.UnsupportedTypeError, match=re.escape(words)) as info:
            tensorcanon.dumps({"train": {"losses": value}})
        assert info.value.path == '$["train"]["losses"]'


@pytest.mark.parametrize("state", ["text", ["list", 1], None, 0, ["list"], ["obj", "io.BytesIO", b"x"]])
def test_a_bytes_io_state_that_is_not_a_bin_is_rejected(state):
    with pytest.raises(tensorcanon.FormatError, match=r"could not rebuild 'io.BytesIO' at \$\[\"v\"\]"):
        tensorcanon.loads(_with_state(codecs.BYTES_IO, state))


def test_without_the_bytes_io_codec_files_say_how_to_turn_it_back_on(bytes_io_restored):
    data = tensorcanon.dumps({"b": io.BytesIO(b"x")})
    tensorcanon.unregister(io.BytesIO)
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"register_bytes_io\(\)") as info:
        tensorcanon.loads(data)
    assert info.value.path == '$["b"]'
    with pytest.raises(tensorcanon.UnsupportedTypeError):
        tensorcanon.dumps({"b": io.BytesIO(b"x")})
    assert tensorcanon.verify(data)               # a verifying reader builds no object: still verifies
    tensorcanon.register_builtin_codecs()         # all built-in codecs, this one included
    assert tensorcanon.loads(data)["b"].getvalue() == b"x"
    codecs.register_bytes_io()                    # again: nothing to do


def test_a_users_own_bytes_io_registration_is_kept(bytes_io_restored):
    tensorcanon.register(io.BytesIO, name="mine.Buffer", encode=lambda b: b.getvalue().hex(),
                         decode=lambda s: io.BytesIO(bytes.fromhex(s)), replace=True)
    assert writer_root(io.BytesIO(b"\x01")) == ["obj", "mine.Buffer", "01"]
    with pytest.raises(tensorcanon.UsageError, match="built-in codec 'io.BytesIO'"):
        codecs.register_bytes_io()
    tensorcanon.unregister(io.BytesIO)


def writer_root(value):
    from tensorcanon.io import writer

    return writer.plan(value).root


def test_namespaces_are_saved_by_default_in_a_fresh_process():
    """issue 30: ``'args': args`` (torchvision's reference scripts) saves with no call; the values
    still go through the allow-list, and the bytes are those of the opt-in codec (golden builtin_codecs)."""
    code = (
        "import argparse, tensorcanon\n"
        "ns = argparse.Namespace(lr=0.1, epochs=3, model='resnet18', milestones=[30, 60])\n"
        "data = tensorcanon.dumps({'args': ns})\n"
        "back = tensorcanon.loads(data)['args']\n"
        "assert type(back) is argparse.Namespace and vars(back) == vars(ns)\n"
        "try:\n"
        "    tensorcanon.dumps(argparse.Namespace(f=print))\n"
        "except tensorcanon.UnsupportedTypeError as e:\n"
        "    assert e.path == '$[\"f\"]' and 'function' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('a function inside a namespace was saved')\n"
        "print(data.hex())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    data = bytes.fromhex(out.stdout.strip())
    codecs.register_namespace()
    expected = tensorcanon.dumps({"args": argparse.Namespace(lr=0.1, epochs=3, model="resnet18", milestones=[30, 60])})
    assert data == expected


def test_the_namespace_advice_works_after_unregistering_it():
    registry.unregister(argparse.Namespace)
    try:
        with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"tensorcanon\.codecs\.register_namespace\(\)"):
            tensorcanon.dumps({"args": argparse.Namespace(a=1)})
        codecs.register_namespace()  # the advice, applied
        assert vars(tensorcanon.loads(tensorcanon.dumps({"args": argparse.Namespace(a=1)}))["args"]) == {"a": 1}
    finally:
        codecs.register_namespace()
