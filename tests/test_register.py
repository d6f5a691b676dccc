"""register(): an explicit allow-list of user types; the loader never imports."""

import dataclasses
import enum
import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest
import torch

import tensorcanon as tc


@dataclasses.dataclass
class Config:
    lr: float
    steps: int
    w: torch.Tensor = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    sizes: tuple
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        object.__setattr__(self, "derived", len(self.sizes))


class Point(NamedTuple):
    x: int
    y: float


class Color(enum.Enum):
    RED = 1
    GREEN = "g"


class Opaque:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __eq__(self, other):
        return type(other) is Opaque and (self.a, self.b) == (other.a, other.b)


@pytest.fixture
def registered():
    classes = [Config, Frozen, Point, Color]
    for c in classes:
        tc.register(c)
    tc.register(Opaque, name="test.Opaque", encode=lambda o: {"a": o.a, "b": o.b}, decode=lambda s: Opaque(**s))
    yield
    for c in classes + [Opaque]:
        tc.unregister(c)


def test_registered_types_round_trip(registered):
    w = torch.arange(3.0)
    obj = {"cfg": Config(1e-3, 10, w), "frozen": Frozen("n", (1, 2, 3)), "pt": Point(1, 2.5),
           "colors": [Color.RED, Color.GREEN], "opaque": Opaque([1, 2], {"k": b"v"}), "w": w}
    out = tc.loads(tc.dumps(obj))
    assert type(out["cfg"]) is Config and out["cfg"].lr == 1e-3 and out["cfg"].steps == 10
    assert out["cfg"].w is out["w"] and torch.equal(out["w"], w)  # aliasing through a registered type
    assert out["frozen"] == Frozen("n", (1, 2, 3)) and out["frozen"].derived == 3
    assert type(out["pt"]) is Point and out["pt"] == Point(1, 2.5)
    assert out["colors"] == [Color.RED, Color.GREEN] and out["colors"][0] is Color.RED
    assert out["opaque"] == Opaque([1, 2], {"k": b"v"})
    # the tensor inside the dataclass gets a readable name
    import tensorcanon.io.writer as writer
    assert [s.name for s in writer.plan({"cfg": Config(1.0, 1, w)}).tensors] == ["cfg.w"]


def test_register_rejects_what_it_cannot_codec():
    with pytest.raises(TypeError, match="encode"):
        tc.register(Opaque)
    with pytest.raises(TypeError):
        tc.register(Opaque, encode=lambda o: 1)
    with pytest.raises(TypeError):
        tc.register(42)


def test_unregistered_type_is_refused_on_save_and_on_load(registered):
    data = tc.dumps({"cfg": Config(0.1, 2)})
    tc.unregister(Config)
    with pytest.raises(tc.UnsupportedTypeError, match="register"):
        tc.dumps({"cfg": Config(0.1, 2)})
    with pytest.raises(tc.UnsupportedTypeError) as info:
        tc.loads(data)
    msg = str(info.value)
    assert "register" in msg and f"{Config.__module__}.Config" in msg and '$["cfg"]' in msg
    assert "never imports" in msg
    assert tc.verify(data)  # the file itself is intact
    tc.register(Config)
    assert tc.loads(data)["cfg"] == Config(0.1, 2)


def test_custom_encode_failure_names_the_path(registered):
    tc.register(Opaque, name="test.Opaque", encode=lambda o: 1 / 0, decode=lambda s: s, replace=True)
    with pytest.raises(tc.UnsupportedTypeError, match="test.Opaque") as info:
        tc.dumps({"x": [Opaque(1, 2)]})
    assert info.value.path == '$["x"][0]'


def test_loading_never_imports_the_module_named_in_the_file(tmp_path):
    """A child process writes a value of a registered type from a module the loading process never
    imported; loading it must fail without importing that module."""
    mod = tmp_path / "tc_secret_module_xyz.py"
    mod.write_text(textwrap.dedent("""
        import dataclasses, pathlib
        pathlib.Path(__file__).with_suffix(".imported").write_text("imported")
        @dataclasses.dataclass
        class Secret:
            v: int
    """))
    out = tmp_path / "secret.safetensors"
    writer = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
              "import tensorcanon as tc, tc_secret_module_xyz as m; "
              f"tc.register(m.Secret); tc.save({{'s': m.Secret(3)}}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=120)
    (tmp_path / "tc_secret_module_xyz.imported").unlink()
    assert b"tc_secret_module_xyz.Secret" in __import__("base64").b64decode(
        __import__("json").loads(out.read_bytes()[8:8 + int.from_bytes(out.read_bytes()[:8], "little")])
        ["__metadata__"]["tensorcanon.manifest"])

    sys.path.insert(0, str(tmp_path))  # importable, so an import would succeed if attempted
    try:
        before = set(sys.modules)
        with pytest.raises(tc.UnsupportedTypeError, match="register"):
            tc.load(out)
        assert "tc_secret_module_xyz" not in sys.modules
        assert not (tmp_path / "tc_secret_module_xyz.imported").exists()
        assert set(sys.modules) - before == set()
        assert tc.verify(out)  # verify checks structure without building (or importing) anything
        assert "tc_secret_module_xyz" not in sys.modules
    finally:
        sys.path.remove(str(tmp_path))


def test_registering_again_needs_replace(registered):
    tc.register(Config)  # the same class, name and default codec again: allowed, nothing changes
    with pytest.raises(tc.UsageError, match="already registered.*replace=True"):
        tc.register(Opaque, name="test.Opaque", encode=lambda o: 1, decode=lambda s: Opaque(s, s))
    class Other(NamedTuple):
        a: int

    with pytest.raises(tc.UsageError, match="name 'test.Opaque' is already registered for Opaque"):
        tc.register(Other, name="test.Opaque")
    assert tc.loads(tc.dumps(Opaque(1, 2))) == Opaque(1, 2)  # the refused call changed nothing
    tc.register(Opaque, name="test.Opaque", encode=lambda o: [o.a], decode=lambda s: Opaque(s[0], 0),
                replace=True)
    assert tc.loads(tc.dumps(Opaque(1, 2))) == Opaque(1, 0)


class Base:
    def __init__(self, v):
        self.v = v


class Child(Base):
    pass


class GrandChild(Child):
    pass


def test_subclasses_use_the_nearest_registered_base():
    tc.register(Base, name="test.Base", encode=lambda o: ["base", o.v], decode=lambda s: Base(s[1]))
    try:
        out = tc.loads(tc.dumps({"c": GrandChild(3)}))
        assert type(out["c"]) is Base and out["c"].v == 3  # what Base's decode builds
        tc.register(Child, name="test.Child", encode=lambda o: ["child", o.v], decode=lambda s: Child(s[1]))
        out = tc.loads(tc.dumps({"c": GrandChild(3), "b": Base(1)}))
        assert type(out["c"]) is Child and type(out["b"]) is Base  # most specific registration wins
    finally:
        tc.unregister(Base)
        tc.unregister(Child)
    with pytest.raises(tc.UnsupportedTypeError, match="GrandChild"):
        tc.dumps(GrandChild(1))


def test_pathlib_paths_are_covered_by_registering_the_base():
    import pathlib

    tc.register(pathlib.PurePath, name="test.PurePath", encode=str, decode=pathlib.PurePosixPath)
    try:
        out = tc.loads(tc.dumps({"p": pathlib.Path("/a/b"), "q": pathlib.PurePosixPath("c")}))
        assert out == {"p": pathlib.PurePosixPath("/a/b"), "q": pathlib.PurePosixPath("c")}
    finally:
        tc.unregister(pathlib.PurePath)


@dataclasses.dataclass
class MoreConfig(Config):
    extra: int = 0


@dataclasses.dataclass
class SameConfig(Config):
    def describe(self):
        return f"{self.lr}"


def test_a_subclass_that_adds_fields_must_be_registered_itself(registered):
    with pytest.raises(tc.UnsupportedTypeError, match="MoreConfig adds fields.*register\\(MoreConfig\\)"):
        tc.dumps({"c": MoreConfig(0.1, 1, None, 5)})
    # no field lost, but it would load as Config: refused too, naming both classes (issue 30)
    with pytest.raises(tc.UnsupportedTypeError, match="SameConfig is a subclass of the registered .*Config"):
        tc.dumps(SameConfig(0.1, 1))
    tc.register(SameConfig)
    try:
        back = tc.loads(tc.dumps(SameConfig(0.1, 1)))
        assert type(back) is SameConfig and back == SameConfig(0.1, 1)
    finally:
        tc.unregister(SameConfig)


class Complexish(complex):
    pass


@pytest.mark.parametrize("cls, written_as", [
    (complex, "the tag 'complex'"), (dict, "the tag 'dict'"), (torch.Generator, "the tag 'rng.torch'"),
    (torch.Tensor, "the tag 'tensor'"), (int, "a leaf"), (type(None), "a leaf"),
])
def test_a_class_the_format_writes_itself_cannot_be_registered(cls, written_as):
    """Its own kind would win, and the registration would be silently ignored: refused, naming the kind."""
    with pytest.raises(tc.UsageError, match=f"saved by the format itself, as {written_as}"):
        tc.register(cls, encode=lambda v: 0, decode=lambda s: s)
    assert tc.loads(tc.dumps({"v": cls(3) if cls in (complex, int) else None})) is not None


def test_a_subclass_of_a_class_the_format_writes_can_be_registered():
    tc.register(Complexish, name="test.Complexish", encode=lambda v: [v.real, v.imag],
                decode=lambda s: Complexish(*s))
    try:
        back = tc.loads(tc.dumps({"z": Complexish(1, 2)}))["z"]
        assert type(back) is Complexish and back == 1 + 2j
    finally:
        tc.unregister(Complexish)
