"""register() keeps values (issue 30 item 3): dataclasses rebuilt without __init__/__post_init__,
InitVar refused at register, subclasses saved as themselves or refused, dict/list subclasses in one call."""

from __future__ import annotations

import collections
import dataclasses

import pytest

import tensorcanon as tc


@dataclasses.dataclass
class RunConfig:
    name: str
    world_size: int
    run_name: str = ""

    def __post_init__(self):
        self.run_name = f"{self.run_name or self.name}-ws{self.world_size}"


@dataclasses.dataclass(frozen=True)
class FrozenCounted:
    items: tuple
    calls: list = dataclasses.field(default_factory=list, compare=False)

    def __post_init__(self):
        self.calls.append("post_init")


@dataclasses.dataclass(slots=True)
class Slotted:
    a: int
    b: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class WithInitVar:
    base: int
    scale: dataclasses.InitVar[int] = 2
    value: int = dataclasses.field(init=False, default=0)

    def __post_init__(self, scale):
        self.value = self.base * scale


@dataclasses.dataclass
class Cached:
    x: int

    def __post_init__(self):
        self._cache = {"x2": self.x * 2}  # an attribute that is not a field


@dataclasses.dataclass
class Base:
    a: int


@dataclasses.dataclass
class SameFields(Base):
    def describe(self) -> str:
        return str(self.a)


class ConfigNode(dict):
    """Like yacs's CfgNode: a dict subclass whose constructor takes the items and sets attributes."""

    def __init__(self, init=None):
        super().__init__(init or {})
        self.__dict__["_frozen"] = False

    def freeze(self):
        self.__dict__["_frozen"] = True


class Milestones(list):
    pass


class Ordered(collections.OrderedDict):
    pass


class NeedsTwoArgs(dict):
    def __init__(self, items, extra):
        super().__init__(items)
        self.extra = extra


@pytest.fixture
def reg():
    done = []

    def register(cls, **kw):
        tc.register(cls, **kw)
        done.append(cls)

    yield register
    for cls in done:
        tc.unregister(cls)


def test_post_init_is_not_run_again_on_load(reg):
    reg(RunConfig)
    cfg = RunConfig("exp", 8)
    assert cfg.run_name == "exp-ws8"
    back = tc.loads(tc.dumps(cfg))
    assert type(back) is RunConfig and back.run_name == "exp-ws8" and back == cfg
    assert tc.dumps(back) == tc.dumps(cfg)


def test_frozen_and_slotted_dataclasses_are_rebuilt_from_their_fields(reg):
    reg(FrozenCounted)
    reg(Slotted)
    value = FrozenCounted((1, 2))
    back = tc.loads(tc.dumps({"f": value, "s": Slotted(3, [4])}))
    assert back["f"].calls == ["post_init"]  # saved once, not run again
    assert back["f"] == value and back["s"] == Slotted(3, [4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        back["f"].items = ()


def test_a_dataclass_with_an_initvar_is_refused_at_register():
    with pytest.raises(tc.UsageError, match=r"InitVar fields \(scale\).*make them ordinary fields"):
        tc.register(WithInitVar)
    with pytest.raises(tc.UnsupportedTypeError, match="register"):
        tc.dumps(WithInitVar(3))  # nothing was registered: never written, so never unreadable


def test_the_initvar_remedy_works(reg):
    """The advice, applied: the InitVar made an ordinary field."""
    @dataclasses.dataclass
    class WithField:
        base: int
        scale: int = 2
        value: int = dataclasses.field(init=False, default=0)

        def __post_init__(self):
            self.value = self.base * self.scale

    reg(WithField)
    assert tc.loads(tc.dumps(WithField(3))) == WithField(3)
    # ... or a codec of its own
    reg(WithInitVar, encode=lambda v: [v.base, v.value // v.base if v.base else 2],
        decode=lambda s: WithInitVar(s[0], s[1]))
    back = tc.loads(tc.dumps(WithInitVar(3, 5)))
    assert back.value == 15


def test_attributes_that_are_not_fields_are_refused_and_the_remedy_works(reg):
    reg(Cached)
    with pytest.raises(tc.UnsupportedTypeError, match=r"not fields \('_cache'\).*dataclasses.field\(init=False\)"):
        tc.dumps({"c": Cached(2)})

    @dataclasses.dataclass
    class CachedField:
        x: int
        _cache: dict = dataclasses.field(init=False, default_factory=dict)

        def __post_init__(self):
            self._cache = {"x2": self.x * 2}

    reg(CachedField)
    back = tc.loads(tc.dumps(CachedField(2)))
    assert back._cache == {"x2": 4}


def test_a_subclass_is_refused_naming_both_classes_unless_registered_itself(reg):
    reg(Base)
    with pytest.raises(tc.UnsupportedTypeError, match=r"SameFields is a subclass of the registered .*Base.*"
                                                      r"register\(SameFields\)"):
        tc.dumps({"x": SameFields(1)})
    reg(SameFields)  # the advice, applied
    back = tc.loads(tc.dumps({"x": SameFields(1), "b": Base(2)}))
    assert type(back["x"]) is SameFields and type(back["b"]) is Base


def test_dict_and_list_subclasses_register_in_one_call(reg):
    reg(ConfigNode)
    reg(Milestones)
    reg(Ordered)
    node = ConfigNode({"model": ConfigNode({"depth": 50}), "lr": 0.1})
    value = {"cfg": node, "m": Milestones([30, 60]), "o": Ordered([("b", 1), ("a", 2)])}
    back = tc.loads(tc.dumps(value))
    assert type(back["cfg"]) is ConfigNode and type(back["cfg"]["model"]) is ConfigNode
    assert back["cfg"] == node and back["m"] == [30, 60] and type(back["m"]) is Milestones
    assert type(back["o"]) is Ordered and list(back["o"]) == ["b", "a"]
    assert tc.dumps(back) == tc.dumps(value)


def test_a_dict_subclass_its_constructor_cannot_rebuild_is_refused(reg):
    reg(ConfigNode)
    frozen = ConfigNode({"a": 1})
    frozen.freeze()
    with pytest.raises(tc.UnsupportedTypeError, match=r"ConfigNode\(items\) does not give it back"):
        tc.dumps(frozen)
    reg(NeedsTwoArgs)
    with pytest.raises(tc.UnsupportedTypeError, match=r"NeedsTwoArgs\(items\) raised"):
        tc.dumps(NeedsTwoArgs({"a": 1}, 2))
    # the advice, applied: a codec of its own
    tc.unregister(NeedsTwoArgs)
    reg(NeedsTwoArgs, encode=lambda v: [dict(v), v.extra], decode=lambda s: NeedsTwoArgs(s[0], s[1]))
    back = tc.loads(tc.dumps(NeedsTwoArgs({"a": 1}, 2)))
    assert back == {"a": 1} and back.extra == 2


def test_the_unregistered_dict_subclass_message_names_a_call_that_works(reg):
    with pytest.raises(tc.UnsupportedTypeError, match=r"tensorcanon.register\(ConfigNode\)"):
        tc.dumps(ConfigNode({"a": 1}))
    reg(ConfigNode)
    assert tc.loads(tc.dumps(ConfigNode({"a": 1}))) == {"a": 1}
