"""Every refusal that suggests a fix: the fix, applied exactly as the message says, saves the value
and loads it back (issue 30 item 5). One row per message of the tree, codec and registry paths
(the tensor messages are tests/test_errors.py's and TENSORKINDS'); each row names the message it
follows, applies its advice, and checks what comes back. Messages never contradict themselves:
no row's advice raises."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import enum
import io
import pathlib
import typing

import pytest
import torch

import tensorcanon
from tensorcanon.format import codecs, registry

# ------------------------------------------------------------------ the classes the rows save


@dataclasses.dataclass
class Config:
    lr: float


class Pair(typing.NamedTuple):
    a: int
    b: int


class Mode(enum.Enum):
    FAST = "fast"


class Node(dict):
    pass


class Steps(list):
    pass


class Opaque:
    def __init__(self, x):
        self.x = x


class Stateful:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class Zone(dt.tzinfo):
    def utcoffset(self, when):
        return dt.timedelta(hours=2)

    def dst(self, when):
        return dt.timedelta(0)

    def tzname(self, when):
        return "Custom/Zone"


class MyDate(dt.date):
    pass


class MyBuffer(io.BytesIO):
    pass


@pytest.fixture(autouse=True)
def clean_registrations():
    before = set(registry._BY_TYPE)
    yield
    for cls in set(registry._BY_TYPE) - before:
        registry.unregister(cls)
    codecs.register_namespace()
    codecs.register_bytes_io()


def _counter_with_attribute():
    c = collections.Counter("aab")
    c.note = "x"
    return c


def _buffer_with_attribute():
    b = io.BytesIO(b"abc")
    b.name = "losses"
    return b


def _closed_buffer():
    b = io.BytesIO(b"abc")
    data = b.getvalue()
    b.close()
    return b, data


def _sgd():
    model = torch.nn.Linear(2, 1)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _crowded():
    return {(2**61 - 1) * i: i for i in range(1, 70)}


# ------------------------------------------------------------------ the table

# id -> (make the refused value, the advice the message gives (regex), apply it: value -> what is
#        saved, check(original, loaded))
ROWS: dict[str, tuple] = {
    "register a dataclass": (
        lambda: Config(0.1), r"call tensorcanon\.register\(Config\) first",
        lambda v: (tensorcanon.register(Config), v)[1], lambda v, b: b == v and type(b) is Config),
    "register a NamedTuple": (
        lambda: Pair(1, 2), r"tensorcanon\.register\(Pair\)",
        lambda v: (tensorcanon.register(Pair), v)[1], lambda v, b: b == v and type(b) is Pair),
    "register an Enum": (
        lambda: Mode.FAST, r"tensorcanon\.register\(Mode\)",
        lambda v: (tensorcanon.register(Mode), v)[1], lambda v, b: b is Mode.FAST),
    "register an Enum used as a key": (
        lambda: {Mode.FAST: 1}, r"tensorcanon\.register\(Mode\)",
        lambda v: (tensorcanon.register(Mode), v)[1], lambda v, b: b == v),
    "register a dict subclass": (
        lambda: Node(a=1), r"tensorcanon\.register\(Node\)",
        lambda v: (tensorcanon.register(Node), v)[1], lambda v, b: b == v and type(b) is Node),
    "register a list subclass": (
        lambda: Steps([1, 2]), r"tensorcanon\.register\(Steps\)",
        lambda v: (tensorcanon.register(Steps), v)[1], lambda v, b: b == v and type(b) is Steps),
    "register another class with encode= and decode=": (
        lambda: Opaque(3), r"tensorcanon\.register\(Opaque\) first .*other classes pass encode= and decode=",
        lambda v: (tensorcanon.register(Opaque, encode=lambda o: o.x, decode=Opaque), v)[1],
        lambda v, b: type(b) is Opaque and b.x == 3),
    "a module: save its state_dict()": (
        lambda: torch.nn.Linear(2, 1), r"save its state_dict\(\) instead",
        lambda v: v.state_dict(),
        lambda v, b: torch.nn.Linear(2, 1).load_state_dict(b) is not None),
    "an optimizer: save its state_dict()": (
        _sgd, r"save its state_dict\(\) instead and call load_state_dict\(\)",
        lambda v: v.state_dict(), lambda v, b: b == v.state_dict()),
    "state_dict()/load_state_dict(): save obj.state_dict()": (
        Stateful, r"save obj\.state_dict\(\) instead",
        lambda v: v.state_dict(), lambda v, b: (Stateful().load_state_dict(b), True)[1] and b == {"count": 0}),
    "a function: save its name": (
        lambda: torch.relu, r"save the name or settings that select it \(e\.g\. a str\)",
        lambda v: v.__name__, lambda v, b: getattr(torch, b) is torch.relu),
    "paths: register_paths()": (
        lambda: pathlib.PurePosixPath("/data"), r"call tensorcanon\.codecs\.register_paths\(\)",
        lambda v: (codecs.register_paths(), v)[1], lambda v, b: b == v),
    "dates: register_datetime()": (
        lambda: dt.date(2024, 1, 2), r"call tensorcanon\.codecs\.register_datetime\(\)",
        lambda v: (codecs.register_datetime(), v)[1], lambda v, b: b == v),
    "namespaces, once unregistered: register_namespace()": (
        lambda: (registry.unregister(argparse.Namespace), argparse.Namespace(a=1))[1],
        r"call tensorcanon\.codecs\.register_namespace\(\)",
        lambda v: (codecs.register_namespace(), v)[1], lambda v, b: vars(b) == {"a": 1}),
    "a tzinfo that is not a timezone: convert to UTC, save the zone's name": (
        lambda: (codecs.register_datetime(), dt.datetime(2024, 1, 1, 12, tzinfo=Zone()))[1],
        r"value\.astimezone\(datetime\.timezone\.utc\)\) and save the zone's name as a str",
        lambda v: {"when": v.astimezone(dt.timezone.utc), "zone": v.tzname()},
        lambda v, b: b["when"] == v and b["zone"] == "Custom/Zone"),
    "a named timezone: use one without a name": (
        lambda: (codecs.register_datetime(),
                 dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1), "CET")))[1],
        r"use datetime\.timezone\(datetime\.timedelta\(seconds=3600\)\) without a name",
        lambda v: v.replace(tzinfo=dt.timezone(dt.timedelta(seconds=3600))), lambda v, b: b == v),
    "a date subclass: convert it to a plain date": (
        lambda: (codecs.register_datetime(), MyDate(2024, 5, 6))[1], r"convert it to a plain datetime\.date",
        lambda v: dt.date(v.year, v.month, v.day), lambda v, b: b == v and type(b) is dt.date),
    "a date subclass: or register it with encode= and decode=": (
        lambda: (codecs.register_datetime(), MyDate(2024, 5, 6))[1],
        r"register MyDate itself, with encode= and decode=",
        lambda v: (tensorcanon.register(MyDate, encode=lambda d: d.toordinal(), decode=MyDate.fromordinal), v)[1],
        lambda v, b: b == v and type(b) is MyDate),
    "a BytesIO subclass: save io.BytesIO(value.getvalue())": (
        lambda: MyBuffer(b"xy"), r"save io\.BytesIO\(value\.getvalue\(\)\)",
        lambda v: io.BytesIO(v.getvalue()), lambda v, b: b.getvalue() == b"xy"),
    "a BytesIO subclass: or register it with encode= and decode=": (
        lambda: MyBuffer(b"xy"), r"register MyBuffer itself, with encode= and decode=",
        lambda v: (tensorcanon.register(MyBuffer, encode=lambda x: x.getvalue(), decode=MyBuffer), v)[1],
        lambda v, b: type(b) is MyBuffer and b.getvalue() == b"xy"),
    "a closed BytesIO: save its bytes": (
        lambda: _closed_buffer()[0], r"save it before closing it, or save its bytes",
        lambda v: b"abc", lambda v, b: b == b"abc"),
    "a BytesIO with attributes: save them next to it": (
        _buffer_with_attribute, r"save the attributes next to it",
        lambda v: {"buffer": io.BytesIO(v.getvalue()), "name": v.name},
        lambda v, b: b["buffer"].getvalue() == b"abc" and b["name"] == "losses"),
    "a Counter with attributes: save them next to it": (
        _counter_with_attribute, r"save the attributes next to it",
        lambda v: {"counts": collections.Counter(v), "note": v.note},
        lambda v, b: b["counts"] == v and b["note"] == "x"),
    "a defaultdict of a lambda: save dict(value)": (
        lambda: collections.defaultdict(lambda: 0, a=1), r"save dict\(value\)",
        lambda v: dict(v), lambda v, b: b == {"a": 1}),
    "keys that share a hash: use str keys": (
        _crowded, r"use str keys, or save a list of \(key, value\) pairs",
        lambda v: {str(k): x for k, x in v.items()}, lambda v, b: {int(k): x for k, x in b.items()} == v),
    "keys that share a hash: or save a list of (key, value) pairs": (
        _crowded, r"use str keys, or save a list of \(key, value\) pairs",
        lambda v: list(v.items()), lambda v, b: dict(b) == v),
    "an object array: arr.tolist()": (
        lambda: __import__("numpy").array(["a", "b"], dtype=object), r"arr\.tolist\(\)",
        lambda v: v.tolist(), lambda v, b: b == ["a", "b"]),
    "an object array: or arr.astype(str)": (
        lambda: __import__("numpy").array(["a", "b"], dtype=object), r"arr\.astype\(str\)",
        lambda v: v.astype(str), lambda v, b: b.tolist() == ["a", "b"]),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_advice_of_each_refusal_works(row):
    make, advice, apply, check = ROWS[row]
    value = make()
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=advice):
        tensorcanon.dumps({"v": value})
    fixed = apply(value)  # the advice, exactly as the message gives it (it raises nothing)
    back = tensorcanon.loads(tensorcanon.dumps({"v": fixed}))["v"]
    assert check(value, back), (row, back)


# ------------------------------------------------------------------ registration and loading




def test_registering_again_says_replace_true_and_it_works():
    tensorcanon.register(Config)
    with pytest.raises(tensorcanon.UsageError, match="pass replace=True"):
        tensorcanon.register(Config, encode=lambda c: c.lr, decode=Config)
    tensorcanon.register(Config, encode=lambda c: c.lr, decode=Config, replace=True)  # the advice
    assert tensorcanon.loads(tensorcanon.dumps(Config(0.25))) == Config(0.25)


def test_a_plain_class_registered_without_a_codec_is_told_to_pass_one():
    with pytest.raises(tensorcanon.UsageError, match="pass encode= and decode= to register"):
        tensorcanon.register(Opaque)
    tensorcanon.register(Opaque, encode=lambda o: o.x, decode=Opaque)  # the advice
    assert tensorcanon.loads(tensorcanon.dumps(Opaque(5))).x == 5


@pytest.mark.parametrize("enable, value", [
    ("register_namespace", argparse.Namespace(a=1)), ("register_paths", pathlib.PurePosixPath("/d")),
])
def test_loading_an_unregistered_codec_names_the_call_and_it_works(enable, value):
    getattr(codecs, enable)()
    data = tensorcanon.dumps({"v": value})
    registry.unregister(type(value) if enable == "register_namespace" else pathlib.PurePath)
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=rf"call tensorcanon\.codecs\.{enable}\(\)"):
        tensorcanon.loads(data)
    getattr(codecs, enable)()  # the advice
    assert tensorcanon.loads(data)["v"] == value


def test_loading_an_unregistered_class_says_register_it_and_it_works():
    tensorcanon.register(Config)
    data = tensorcanon.dumps(Config(0.5))
    registry.unregister(Config)
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"call tensorcanon\.register\(<that class>\)"):
        tensorcanon.loads(data)
    tensorcanon.register(Config)  # the advice
    assert tensorcanon.loads(data) == Config(0.5)
