"""Random state as canonical values: generator objects and :class:`RngState`.

Importing this module registers six node kinds with
:func:`tensorcanon.format.tree.register_kind` (``tensorcanon/__init__.py`` imports it,
so the tags exist wherever the package is used), so that generator objects found
anywhere in a saved tree are written as explicit values (bytes with a fixed layout,
ints, floats) and never pickled:

=================  ============================================================
tag                value
=================  ============================================================
``rng.torch``      ``torch.Generator`` (cpu, cuda, mps, xpu)
``rng.bitgen``     a numpy BitGenerator (PCG64, PCG64DXSM, MT19937, Philox, SFC64)
``rng.numpy``      ``numpy.random.Generator`` (wraps an ``rng.bitgen`` node)
``rng.legacy``     ``numpy.random.RandomState`` (wraps an ``rng.bitgen`` node)
``rng.random``     ``random.Random``
``rng.state``      :class:`RngState`, the process-wide random state
=================  ============================================================

docs/FORMAT.md, "Random state values", is the normative layout; docs/RNG.md is
the user guide.
"""

from __future__ import annotations

import functools
import math
import random
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..format import devices, optional, paths, tree
from ..format.errors import DeviceUnavailableError, TensorCanonError
from ..io import placement

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())  # imported on first use: checking a file needs no torch
    np = optional.numpy_module(globals())  # (numpy: when a file's random state is checked or built)

__all__ = ["RngState", "RngRestoreError", "RngRestoreWarning"]


class RngRestoreError(TensorCanonError, RuntimeError):
    """A part of a saved random state cannot be restored on this machine."""


class RngRestoreWarning(UserWarning):
    """A part of a saved random state was not restored (``strict=False``)."""


# --------------------------------------------------------------------------- layouts

TORCH_STATE_SIZES = {"cpu": 5056, "cuda": 16, "xpu": 16, "mps": 36}
"""Byte length of ``torch.Generator.get_state()`` per device type."""

MT_WORDS = 624
MAX_POOL_SIZE = 1024  # of a SeedSequence (numpy allows more; a file's bound on the work it asks for)
# The 32-bit words numpy makes of a SeedSequence's entropy and spawn key together (an int of b bits is
# max(1, ceil(b / 32)) words): numpy converts an int to words in time quadratic in its size, so a file
# holding a 1.6-million-bit entropy int took 18 s to load. Entropy from secrets.randbits(128) is 4 words.
MAX_SEED_WORDS = 4096
U128 = 2**128 - 1
U64 = 2**64 - 1
U32 = 2**32 - 1


class _Field:
    """One bit-generator state field: where it sits in the state dict and its rule."""

    def __init__(self, key: tuple[str, ...], kind: str, n: int = 0, lo: int = 0, hi: int = 0) -> None:
        self.key, self.kind, self.n, self.lo, self.hi = key, kind, n, lo, hi

    def get(self, state: dict) -> Any:
        v: Any = state
        for k in self.key:
            v = v[k]
        if self.kind == "int":
            return int(v)
        dtype = "<u4" if self.kind == "u32[]" else "<u8"
        return np.ascontiguousarray(v, dtype=dtype).tobytes()

    def check(self, value: Any) -> str | None:
        if self.kind == "int":
            if type(value) is not int or not self.lo <= value <= self.hi:
                return f"an int in [{self.lo}, {self.hi}]"
            return None
        size = self.n * (4 if self.kind == "u32[]" else 8)
        if type(value) is not bytes or len(value) != size:
            return f"bytes of length {size} ({self.n} little-endian {self.kind[:-2]})"
        return None

    def to_state(self, value: Any) -> Any:
        if self.kind == "int":
            return value
        return np.frombuffer(value, dtype="<u4" if self.kind == "u32[]" else "<u8").astype(
            np.uint32 if self.kind == "u32[]" else np.uint64)

    @property
    def name(self) -> str:
        return ".".join(self.key)


def _int(*key: str, lo: int = 0, hi: int = U32) -> _Field:
    return _Field(key, "int", lo=lo, hi=hi)


_FLAG = dict(lo=0, hi=1)
_PCG = [_int("state", "state", hi=U128), _int("state", "inc", hi=U128),
        _int("has_uint32", **_FLAG), _int("uinteger")]

# Fixed allow-list: the name in a file is looked up here and nowhere else. Name -> state fields;
# the class is numpy.random's of that name (BIT_GENERATORS, made when numpy is loaded).
_FIELDS: dict[str, list[_Field]] = {
    "PCG64": _PCG,
    "PCG64DXSM": _PCG,
    "MT19937": [_Field(("state", "key"), "u32[]", MT_WORDS), _int("state", "pos", hi=MT_WORDS)],
    "Philox": [
        _Field(("state", "counter"), "u64[]", 4), _Field(("state", "key"), "u64[]", 2),
        _Field(("buffer",), "u64[]", 4), _int("buffer_pos", hi=4),
        _int("has_uint32", **_FLAG), _int("uinteger")],
    "SFC64": [_Field(("state", "state"), "u64[]", 4), _int("has_uint32", **_FLAG), _int("uinteger")],
}

if TYPE_CHECKING:
    BIT_GENERATORS: dict[str, tuple[type, list[_Field]]]
    """Bit generator name -> (its numpy class, its state fields)."""


def __getattr__(name: str) -> Any:
    if name == "BIT_GENERATORS":  # (imports numpy)
        value = {n: (getattr(np.random, n), fields) for n, fields in _FIELDS.items()}
        return globals().setdefault(name, value)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _bit_generator_classes() -> frozenset[type]:
    """numpy.random's classes of the bit generators _FIELDS names (imports numpy)."""
    return frozenset(getattr(np.random, name) for name in _FIELDS)


def bitgen_fields(state: dict) -> tuple[str, tuple]:
    """``bit_generator.state`` dict → (name, tuple of explicit field values)."""
    name = state.get("bit_generator")
    if name not in _FIELDS:
        raise ValueError(f"bit generator {name!r} is not one of {sorted(_FIELDS)}")
    return name, tuple(f.get(state) for f in _FIELDS[name])


def check_bitgen_fields(name: Any, fields: tuple | list) -> str | None:
    """None when ``fields`` are a valid state for bit generator ``name``, else what is wrong."""
    if type(name) is not str or name not in _FIELDS:
        return f"bit generator {paths.show(name)} is not one of {sorted(_FIELDS)}"
    layout = _FIELDS[name]
    if len(fields) != len(layout):
        return f"{name} state takes {len(layout)} fields, found {len(fields)}"
    for f, v in zip(layout, fields, strict=True):
        rule = f.check(v)
        if rule is not None:
            return f"{name} field {f.name} must be {rule}"
    return None


def bitgen_state(name: str, fields: tuple | list) -> dict:
    """(name, validated fields) → a ``bit_generator.state`` dict."""
    out: dict = {"bit_generator": name}
    for f, v in zip(_FIELDS[name], fields, strict=True):
        d = out
        for k in f.key[:-1]:
            d = d.setdefault(k, {})
        d[f.key[-1]] = f.to_state(v)
    return out


def check_seed_seq(value: Any) -> str | None:
    """None when ``value`` is a valid seed-sequence tuple ``(entropy, spawn_key, pool_size,
    n_children_spawned)`` (docs/FORMAT.md §6.7), else what is wrong. The ranges are numpy's own,
    so every valid tuple rebuilds a ``SeedSequence``."""
    if type(value) is not tuple or len(value) != 4:
        return "a seed sequence must be nil or a 4-tuple (entropy, spawn_key, pool_size, n_children_spawned)"
    entropy, spawn_key, pool_size, n_children = value
    ints = entropy if type(entropy) is tuple else (entropy,)
    if not ints or not all(type(e) is int and e >= 0 for e in ints):
        return "seed sequence entropy must be a non-negative int or a non-empty tuple of them"
    if type(spawn_key) is not tuple or not all(type(k) is int and 0 <= k for k in spawn_key):
        return "seed sequence spawn_key must be a tuple of non-negative ints"
    if type(pool_size) is not int or not 4 <= pool_size <= MAX_POOL_SIZE:
        return f"seed sequence pool_size must be an int in [4, {MAX_POOL_SIZE}]"
    if type(n_children) is not int or not 0 <= n_children <= U32:
        return "seed sequence n_children_spawned must be an int in [0, 2**32-1] (numpy holds it in 32 bits)"
    words = 0
    for n in (*ints, *spawn_key):  # bit_length is O(1): no conversion of a huge int happens here
        words += max(1, -(-n.bit_length() // 32))
        if words > MAX_SEED_WORDS:
            return (f"seed sequence entropy and spawn_key hold more than {MAX_SEED_WORDS} 32-bit words "
                    "(docs/FORMAT.md §6.7): numpy's conversion of them takes time quadratic in their size")
    return None


def nil_seed_seq_problem(name: Any, seed_seq: Any, global_state: bool) -> str | None:
    """docs/FORMAT.md §6.7, the one rule of when an ``rng.bitgen`` has a nil seed sequence: inside
    ``rng.state`` always, whatever the bit generator (numpy's global generator is restored into the
    process's own, so its seed sequence is not part of the state: a program may have installed a
    PCG64 there with ``numpy.random.set_bit_generator``); elsewhere only for a legacy-seeded MT19937."""
    if global_state:
        return None if seed_seq is None else "'rng.state' numpy bit generator must have a nil seed sequence"
    if seed_seq is None and name != "MT19937":
        return (f"a {name} bit generator needs a seed sequence (only MT19937 may have nil, or any bit "
                "generator inside 'rng.state')")
    return None


def check_gauss(has_gauss: Any, gauss: Any) -> str | None:
    """None for a valid ``rng.legacy`` cache (``has_gauss`` 0 or 1, ``gauss`` a float that is +0.0
    when ``has_gauss`` is 0, as numpy leaves it when it uses the value), else what is wrong."""
    if type(has_gauss) is not int or has_gauss not in (0, 1) or type(gauss) is not float:
        return "'rng.legacy' takes has_gauss (0 or 1) and gauss (a float)"
    if has_gauss == 0 and (gauss != 0.0 or math.copysign(1.0, gauss) < 0):
        return "'rng.legacy' with has_gauss 0 must have gauss 0.0"
    return None


def _mt_bytes(words: Sequence[int]) -> bytes:
    return np.asarray(words, dtype="<u4").tobytes()


def _check_random_state(version: Any, key: Any, pos: Any, gauss: Any) -> str | None:
    if version != 3 or type(version) is not int:
        return f"random.Random state version must be 3, found {paths.show(version)}"
    if type(key) is not bytes or len(key) != MT_WORDS * 4:
        return f"random.Random key must be {MT_WORDS * 4} bytes ({MT_WORDS} little-endian uint32)"
    if type(pos) is not int or not 0 <= pos <= MT_WORDS:
        return f"random.Random position must be an int in [0, {MT_WORDS}]"
    if gauss is not None and type(gauss) is not float:
        return "random.Random gauss_next must be nil or a float"
    return None


def _random_state_from(version: int, key: bytes, pos: int, gauss: float | None) -> tuple:
    words = np.frombuffer(key, dtype="<u4").tolist()
    return (version, tuple(words) + (pos,), gauss)


_MT_LEFT_NEXT = 625  # after the first twist, torch's MT19937 keeps left + next == 625


def check_cpu_state(state: Any) -> str | None:
    """None when ``state`` is a torch CPU generator state ``get_state()`` can return, else why not.

    The 5056 bytes are torch's ``CPUGeneratorImplState`` (docs/FORMAT.md §6.7.1, all
    little-endian): u64 initial seed; i32 ``left``; i32 ``seeded``; u64 ``next``; 624
    u64 Mersenne Twister words; f64 ``normal_x``, ``normal_y``, ``normal_rho``; i32
    ``normal_is_valid``; 4 zero bytes; f32 ``next_float_normal_sample``; u8 its valid
    flag; 3 zero bytes. torch itself checks only ``left`` and ``next`` ranges, and a
    state whose ``left + next`` is not 625 makes it read past its word array; this
    accepts exactly the states torch writes.
    """
    if type(state) is not bytes or len(state) != TORCH_STATE_SIZES["cpu"]:
        return f"a cpu generator state must be {TORCH_STATE_SIZES['cpu']} bytes"
    left, seeded, nxt = struct.unpack_from("<iiQ", state, 8)
    if seeded != 1:
        return "a cpu generator state must have seeded = 1"
    if not ((left, nxt) == (1, 0) or (1 <= nxt <= MT_WORDS and left + nxt == _MT_LEFT_NEXT)):
        return (f"a cpu generator state has left={left}, next={nxt}: it must be left=1, next=0 (just "
                f"seeded) or 1 <= next <= {MT_WORDS} with left + next = {_MT_LEFT_NEXT}")
    words = np.frombuffer(state, dtype="<u8", count=MT_WORDS, offset=24)
    if int(words.max()) > U32:
        return "a cpu generator state holds a Mersenne Twister word of more than 32 bits"
    normal_x, normal_y, normal_rho, normal_valid = struct.unpack_from("<QQQi", state, 5016)
    float_sample, float_valid = struct.unpack_from("<IB", state, 5048)
    if normal_x or normal_rho or state[5044:5048] != bytes(4) or state[5053:] != bytes(3):
        return "a cpu generator state has non-zero unused fields or padding"
    if normal_valid not in (0, 1) or (normal_valid == 0 and normal_y):
        return "a cpu generator state's cached double normal must be flagged 0 (with value 0.0) or 1"
    if float_valid not in (0, 1) or (float_valid == 0 and float_sample):
        return "a cpu generator state's cached float normal must be flagged 0 (with value 0.0) or 1"
    return None


def check_philox_state(kind: str, state: Any) -> str | None:
    """None for a valid cuda/xpu state (u64 seed, i64 Philox offset, a multiple of 4), else why."""
    if type(state) is not bytes or len(state) != TORCH_STATE_SIZES[kind]:
        return f"a {kind} generator state must be {TORCH_STATE_SIZES[kind]} bytes"
    (offset,) = struct.unpack_from("<q", state, 8)
    if offset % 4:
        return f"a {kind} generator state's Philox offset must be a multiple of 4"
    return None


def check_torch_state(kind: str, state: Any) -> str | None:
    """None when ``state`` is a valid ``get_state()`` of a ``kind`` generator, else why not."""
    if kind == "cpu":
        return check_cpu_state(state)
    if kind in ("cuda", "xpu"):
        return check_philox_state(kind, state)
    if type(state) is not bytes or len(state) != TORCH_STATE_SIZES[kind]:  # mps: any 36 bytes
        return f"a {kind} generator state must be {TORCH_STATE_SIZES[kind]} bytes"
    return None


def _check_torch_state(device: Any, state: Any) -> str | None:
    """docs/FORMAT.md §6.7: the device is ``cpu`` (no index), ``cuda:N`` or ``xpu:N`` (an index),
    ``mps`` or ``mps:0`` (torch's one MPS generator), as torch prints a generator's device."""
    parsed = devices.parse(device)
    if parsed is None or not (parsed == ("cpu", None) or parsed[0] in ("cuda", "xpu") and parsed[1] is not None
                              or parsed[0] == "mps" and parsed[1] in (None, 0)):
        return (f"device {paths.show(device)} of a torch.Generator is not canonical: it must be cpu, cuda:<index>, "
                "xpu:<index>, mps or mps:0")
    return check_torch_state(parsed[0], state)


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --------------------------------------------------------------------------- encoders


def _enc_seed_seq(enc: tree.Encoder, bg: Any, depth: int) -> Any:
    # numpy >= 1.25 exposes the seed sequence as ``seed_seq``; numpy 1.24 holds the same object
    # as ``_seed_seq`` only. Reading just the public name would save a SeedSequence-seeded
    # MT19937 as legacy-seeded (other bytes) and refuse the other bit generators on 1.24.
    ss = bg.seed_seq if hasattr(bg, "seed_seq") else getattr(bg, "_seed_seq", None)
    if type(ss) is not np.random.SeedSequence:
        if ss is None and nil_seed_seq_problem(type(bg).__name__, None, global_state=False) is None:
            return None  # legacy-seeded MT19937 (RandomState(seed)): nothing to spawn from
        raise enc.unsupported(f"a bit generator whose seed sequence is a {type(ss).__qualname__} "
                              "cannot be saved (only numpy.random.SeedSequence)")
    entropy: int | tuple[int, ...]
    if isinstance(ss.entropy, (int, np.integer)):  # a SeedSequence keeps the entropy it was given
        entropy = int(ss.entropy)
    else:
        assert ss.entropy is not None  # a SeedSequence draws entropy when it is given none
        entropy = tuple(int(e) for e in ss.entropy)
    value = (entropy, tuple(int(k) for k in ss.spawn_key), int(ss.pool_size), int(ss.n_children_spawned))
    problem = check_seed_seq(value)
    if problem is not None:
        raise enc.unsupported(f"{type(bg).__name__} cannot be saved: {problem}")
    return enc.encode(value, depth)


def _enc_bitgen(enc: tree.Encoder, bg: Any, depth: int) -> list:
    name, fields = bitgen_fields(bg.state)
    problem = check_bitgen_fields(name, fields)
    if problem is not None:  # a state set by hand (bg.state = ...) that numpy took as it was
        raise enc.unsupported(f"{name} cannot be saved: {problem}")
    return ["rng.bitgen", name, _enc_seed_seq(enc, bg, depth), *(enc.encode(f, depth) for f in fields)]


def _enc_generator(enc: tree.Encoder, g: np.random.Generator, depth: int) -> list:
    bg = g.bit_generator
    if type(bg) not in _bit_generator_classes():
        raise enc.unsupported(f"numpy Generator with bit generator {type(bg).__qualname__} is not supported "
                              f"(supported: {sorted(_FIELDS)})")
    return ["rng.numpy", enc.encode(bg, depth)]  # encode() checks the bit generator's depth


def _enc_randomstate(enc: tree.Encoder, rs: np.random.RandomState, depth: int) -> list:
    st = rs.get_state(legacy=False)
    bg = rs._bit_generator
    if type(bg) not in _bit_generator_classes():
        raise enc.unsupported(f"RandomState with bit generator {type(bg).__qualname__} is not supported")
    has_gauss, gauss = int(st["has_gauss"]), float(st["gauss"])
    problem = check_gauss(has_gauss, gauss)
    if problem is not None:  # a state set by hand (set_state) that numpy took as it was
        raise enc.unsupported(f"RandomState cannot be saved: {problem}")
    return ["rng.legacy", has_gauss, gauss, enc.encode(bg, depth)]


def _enc_random(enc: tree.Encoder, r: random.Random, depth: int) -> list:
    version, internal, gauss = r.getstate()
    key = _mt_bytes(internal[:MT_WORDS])
    problem = _check_random_state(version, key, internal[MT_WORDS], gauss)
    if problem is not None:  # setstate() takes any gauss_next
        raise enc.unsupported(f"random.Random cannot be saved: {problem}")
    return ["rng.random", version, key, internal[MT_WORDS], gauss]


def _enc_torch(enc: tree.Encoder, g: torch.Generator, depth: int) -> list:
    device = str(g.device)
    if g.device.type in ("cuda", "xpu") and g.device.index is None:
        device = f"{g.device.type}:{getattr(torch, g.device.type).current_device()}"
    state = bytes(g.get_state().numpy().tobytes())
    problem = _check_torch_state(device, state)
    if problem is not None:
        raise enc.unsupported(f"torch.Generator cannot be saved: {problem}")
    return ["rng.torch", device, state]


def _rngstate_problem(s: RngState) -> str | None:
    """What keeps ``s`` from being saved and loaded back equal, or None: each part must have the
    shape :meth:`RngState.capture` gives and pass the checks the reader makes (``_dec_rngstate``)."""
    py, npy = s.python, s.numpy
    if not (type(py) is tuple and len(py) == 3 and type(py[1]) is tuple and len(py[1]) == MT_WORDS + 1
            and all(type(w) is int and 0 <= w <= U32 for w in py[1][:MT_WORDS])):
        return "python must be random.getstate(): (3, a tuple of 624 uint32 words and a position, gauss_next)"
    if not (type(npy) is tuple and len(npy) == 4 and type(npy[1]) is tuple):
        return "numpy must be (bit generator name, tuple of its state fields, has_gauss, gauss)"
    if type(s.cuda) is not tuple or type(s.xpu) is not tuple:
        return "cuda and xpu must be tuples of generator states"
    if len(s.cuda) > _MAX_DEVICES or len(s.xpu) > _MAX_DEVICES:
        return f"at most {_MAX_DEVICES} cuda and {_MAX_DEVICES} xpu states"
    version, key, pos, gauss = s._python_fields()
    return (_check_random_state(version, key, pos, gauss) or check_bitgen_fields(npy[0], npy[1])
            or check_gauss(npy[2], npy[3]) or check_torch_state("cpu", s.torch_cpu)
            or next((p for kind, states in (("cuda", s.cuda), ("xpu", s.xpu)) for st in states
                     if (p := check_torch_state(kind, st)) is not None), None)
            or (None if s.mps is None else check_torch_state("mps", s.mps)))


def _enc_rngstate(enc: tree.Encoder, s: RngState, depth: int) -> list:
    enc.check_depth(depth + 1)  # its parts are at ``depth``, numpy's bit generator one deeper
    problem = _rngstate_problem(s)
    if problem is not None:
        raise enc.unsupported(f"RngState cannot be saved: {problem}")
    version, key, pos, gauss = s._python_fields()
    np_name, np_fields, has_gauss, gauss_np = s.numpy
    return [
        "rng.state",
        ["rng.random", version, key, pos, gauss],
        ["rng.legacy", has_gauss, gauss_np,  # a nil seed sequence, whatever the name: nil_seed_seq_problem
         ["rng.bitgen", np_name, None, *(enc.encode(f, depth) for f in np_fields)]],
        s.torch_cpu,
        ["list", *s.cuda],
        s.mps,
        ["list", *s.xpu],
    ]


# --------------------------------------------------------------------------- decoders


def _nested_bitgen(dec: tree.Decoder, node: Any, depth: int) -> np.random.BitGenerator | None:
    """Decode the ``rng.bitgen`` node that sits at ``depth`` inside an ``rng.numpy`` or ``rng.legacy``
    node, at the path step ``bit_generator``."""
    if type(node) not in tree.ARRAYS or not node or node[0] != "rng.bitgen":
        raise dec.error("expected a 'rng.bitgen' node")
    with dec.at("bit_generator"):
        dec.check_depth(depth)
        return _dec_bitgen(dec, node, depth + 1)


def _decode_args(dec: tree.Decoder, node: Sequence[Any], depth: int, start: int) -> list:
    out = []
    for i in range(start, len(node)):
        with dec.at(i - 1):
            out.append(dec.decode(node[i], depth))
    return out


def _dec_seed_seq(dec: tree.Decoder, node: Any, depth: int) -> tuple | None:
    if node is None:
        return None
    v = dec.decode(node, depth)
    problem = check_seed_seq(v)
    if problem is not None:
        raise dec.error(problem)
    return v


def _dec_bitgen(dec: tree.Decoder, node: Sequence[Any], depth: int) -> np.random.BitGenerator | None:
    if len(node) < 3:
        raise dec.error("'rng.bitgen' takes a name, a seed sequence and the state fields")
    name = node[1]
    seed_seq = _dec_seed_seq(dec, node[2], depth)
    fields = _decode_args(dec, node, depth, 3)
    problem = check_bitgen_fields(name, fields)
    if problem is not None:
        raise dec.error(problem)
    problem = nil_seed_seq_problem(name, seed_seq, global_state=False)
    if problem is not None:
        raise dec.error(problem)
    if not dec.build_objects:
        return None
    cls = getattr(np.random, name)
    if seed_seq is None:
        # Only a legacy-seeded MT19937 (RandomState(seed), np.random.seed) has no seed sequence.
        bg = cls()
        bg._legacy_seeding(0)
    else:
        entropy, spawn_key, pool_size, n_children = seed_seq
        try:
            bg = cls(np.random.SeedSequence(list(entropy) if type(entropy) is tuple else entropy,
                                            spawn_key=spawn_key, pool_size=pool_size,
                                            n_children_spawned=n_children))
        except (ValueError, TypeError, OverflowError) as e:  # not expected: check_seed_seq uses numpy's ranges
            raise dec.error(f"numpy rejected the seed sequence: {e}") from None
    try:
        bg.state = bitgen_state(name, fields)
    except (ValueError, TypeError, OverflowError) as e:
        raise dec.error(f"numpy rejected the {name} state: {e}") from None
    return bg


def _dec_numpy(dec: tree.Decoder, node: Sequence[Any], depth: int) -> np.random.Generator | None:
    if len(node) != 2:
        raise dec.error("'rng.numpy' takes 1 value")
    bg = _nested_bitgen(dec, node[1], depth)
    return None if bg is None else np.random.Generator(bg)


def _check_gauss(dec: tree.Decoder, has_gauss: Any, gauss: Any) -> None:
    problem = check_gauss(has_gauss, gauss)
    if problem is not None:
        raise dec.error(problem)


def _dec_legacy(dec: tree.Decoder, node: Sequence[Any], depth: int) -> np.random.RandomState | None:
    if len(node) != 4:
        raise dec.error(f"'rng.legacy' takes 3 values, found {len(node) - 1}")
    _, has_gauss, gauss, bg_node = node
    _check_gauss(dec, has_gauss, gauss)
    bg = _nested_bitgen(dec, bg_node, depth)
    if bg is None:
        return None
    rs = np.random.RandomState(bg)
    st = rs.get_state(legacy=False)
    st["has_gauss"], st["gauss"] = has_gauss, gauss
    rs.set_state(st)
    return rs


def _dec_random(dec: tree.Decoder, node: Sequence[Any], depth: int) -> random.Random | None:
    if len(node) != 5:
        raise dec.error(f"'rng.random' takes 4 values, found {len(node) - 1}")
    problem = _check_random_state(*node[1:])
    if problem is not None:
        raise dec.error(problem)
    if not dec.build_objects:
        return None
    r = random.Random()
    r.setstate(_random_state_from(*node[1:]))
    return r


def _dec_torch(dec: tree.Decoder, node: Sequence[Any], depth: int) -> torch.Generator | None:
    if len(node) != 3:
        raise dec.error(f"'rng.torch' takes 2 values, found {len(node) - 1}")
    _, device, state = node
    problem = _check_torch_state(device, state)
    if problem is not None:
        raise dec.error(problem)
    if not dec.build_objects:
        return None
    dev = torch.device(device)
    if not placement.device_exists(dev):
        where = dec.path()
        raise DeviceUnavailableError(
            f"a torch.Generator at {where} was saved on {device}, which this machine does not have; "
            "a generator's stream depends on its device type, so it is not moved",
            path=where, device=device)
    g = torch.Generator(device=dev)
    try:
        g.set_state(_u8(state))
    except RuntimeError as e:
        raise dec.error(f"torch rejected the {device} generator state: {e}") from None
    return g


_MAX_DEVICES = 4096


def _bytes_list(dec: tree.Decoder, node: Any, kind: str, what: str) -> tuple:
    if type(node) not in tree.ARRAYS or not node or node[0] != "list":
        raise dec.error(f"{what} must be a 'list' node")
    items = node[1:]
    if len(items) > _MAX_DEVICES:
        raise dec.error(f"{what} must hold at most {_MAX_DEVICES} states")
    for item in items:
        problem = check_torch_state(kind, item)
        if problem is not None:
            raise dec.error(f"{what}: {problem}")
    return tuple(items)


def _dec_rngstate(dec: tree.Decoder, node: Sequence[Any], depth: int) -> RngState:
    if len(node) != 7:
        raise dec.error(f"'rng.state' takes 6 values, found {len(node) - 1}")
    dec.check_depth(depth + 1)  # its parts are at ``depth``, numpy's bit generator one deeper
    _, py, leg, cpu, cuda, mps, xpu = node
    if type(py) not in tree.ARRAYS or len(py) != 5 or py[0] != "rng.random":
        raise dec.error("'rng.state' python part must be an 'rng.random' node")
    problem = _check_random_state(*py[1:])
    if problem is not None:
        raise dec.error(problem)
    if type(leg) not in tree.ARRAYS or len(leg) != 4 or leg[0] != "rng.legacy":
        raise dec.error("'rng.state' numpy part must be an 'rng.legacy' node")
    _check_gauss(dec, leg[1], leg[2])
    bg = leg[3]
    if type(bg) not in tree.ARRAYS or len(bg) < 3 or bg[0] != "rng.bitgen":
        raise dec.error("'rng.state' numpy part must hold an 'rng.bitgen' node")
    problem = nil_seed_seq_problem(bg[1], bg[2], global_state=True)
    if problem is not None:
        raise dec.error(problem)
    fields = [dec.decode(f, depth) for f in bg[3:]]
    problem = check_bitgen_fields(bg[1], fields)
    if problem is not None:
        raise dec.error(problem)
    problem = check_torch_state("cpu", cpu)
    if problem is not None:
        raise dec.error(f"'rng.state' torch CPU state: {problem}")
    cuda_t = _bytes_list(dec, cuda, "cuda", "'rng.state' CUDA states")
    problem = None if mps is None else check_torch_state("mps", mps)
    if problem is not None:
        raise dec.error(f"'rng.state' MPS state must be nil or valid: {problem}")
    xpu_t = _bytes_list(dec, xpu, "xpu", "'rng.state' XPU states")
    return RngState(
        python=_random_state_from(*py[1:]),
        numpy=(bg[1], tuple(fields), leg[1], leg[2]),
        torch_cpu=cpu, cuda=cuda_t, mps=mps, xpu=xpu_t,
    )


# --------------------------------------------------------------------------- RngState


@dataclass(frozen=True)
class RngState:
    """The process-wide random state: Python, numpy, torch CPU and every accelerator.

    A plain value: two captures with no draw in between are equal, and it saves
    canonically (tag ``rng.state``; no pickle), so its digest is stable.

    Fields: ``python`` is ``random.getstate()``; ``numpy`` is the global
    RandomState as ``(bit generator name, state fields, has_gauss, gauss)``;
    ``torch_cpu`` the 5056 state bytes of torch's CPU generator; ``cuda`` and
    ``xpu`` one 16-byte state per device (index order); ``mps`` 36 bytes or None.

    Example::

        ckpt = {"model": model.state_dict(), "rng": tensorcanon.RngState.capture()}
        tensorcanon.save(ckpt, "ckpt.safetensors")
        ...
        tensorcanon.load("ckpt.safetensors")["rng"].restore()
    """

    python: tuple
    numpy: tuple
    torch_cpu: bytes
    cuda: tuple = ()
    mps: bytes | None = None
    xpu: tuple = ()

    @classmethod
    def capture(cls) -> RngState:
        """Take the current state of every global generator in this process.

        CUDA generators are included when ``torch.cuda.is_available()``
        (this initializes CUDA), MPS and XPU when present.
        """
        st = np.random.get_state(legacy=False)
        name, fields = bitgen_fields(st)
        cuda: tuple = ()
        if torch.cuda.is_available():
            cuda = tuple(bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all())
        mps = None
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            mps = bytes(torch.mps.get_rng_state().numpy().tobytes())
        xpu: tuple = ()
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            xpu = tuple(bytes(s.numpy().tobytes()) for s in torch.xpu.get_rng_state_all())
        return cls(
            python=random.getstate(),
            numpy=(name, fields, int(st["has_gauss"]), float(st["gauss"])),
            torch_cpu=bytes(torch.get_rng_state().numpy().tobytes()),
            cuda=cuda, mps=mps, xpu=xpu,
        )

    def __repr__(self) -> str:
        return (f"RngState(python=MT19937, numpy={self.numpy[0]}, torch_cpu={len(self.torch_cpu)} bytes, "
                f"cuda={len(self.cuda)} device(s), mps={'yes' if self.mps is not None else 'no'}, "
                f"xpu={len(self.xpu)} device(s))")

    def _python_fields(self) -> tuple:
        version, internal, gauss = self.python
        return version, _mt_bytes(internal[:MT_WORDS]), internal[MT_WORDS], gauss

    def _problems(self) -> list[str]:
        """What cannot be restored on this machine (checked before anything changes)."""
        out = []
        cur_np = np.random.get_state(legacy=False)["bit_generator"]
        if self.numpy[0] != cur_np:
            out.append(f"numpy's global generator uses {cur_np}, the state holds {self.numpy[0]} "
                       "(see numpy.random.set_bit_generator)")
        for kind, states in (("cuda", self.cuda), ("xpu", self.xpu)):
            if not states:
                continue
            mod = getattr(torch, kind, None)
            have = mod.device_count() if mod is not None and mod.is_available() else 0
            if have < len(states):
                out.append(f"the state holds {len(states)} {kind} generator(s), this machine has {have}")
        if self.mps is not None and not (getattr(torch.backends, "mps", None) is not None
                                          and torch.backends.mps.is_available()):
            out.append("the state holds an MPS generator, this machine has no MPS device")
        return out

    def restore(self, *, strict: bool = True) -> None:
        """Put every generator back to the captured state.

        With ``strict=True`` (the default), raises :class:`RngRestoreError`
        before changing anything when a part cannot be restored (e.g. the state
        holds 8 CUDA generators and this machine has 1). With ``strict=False``
        it restores what it can and warns (:class:`RngRestoreWarning`) about
        the rest. Devices this machine has beyond those in the state keep their
        current state (a warning says so).

        Example::

            state = tensorcanon.RngState.capture()
            a = torch.rand(3)
            state.restore()
            assert torch.equal(torch.rand(3), a)
        """
        problems = self._problems()
        if problems and strict:
            raise RngRestoreError(
                "cannot restore the random state: " + "; ".join(problems)
                + ". Resume on a matching machine, or call restore(strict=False) to restore the rest")
        for p in problems:
            warnings.warn(f"random state not fully restored: {p}", RngRestoreWarning, stacklevel=2)
        random.setstate(self.python)
        name, fields, has_gauss, gauss = self.numpy
        if name == np.random.get_state(legacy=False)["bit_generator"]:
            st = bitgen_state(name, fields)
            st["has_gauss"], st["gauss"] = has_gauss, gauss
            np.random.set_state(st)
        torch.set_rng_state(_u8(self.torch_cpu))
        for kind, states in (("cuda", self.cuda), ("xpu", self.xpu)):
            mod = getattr(torch, kind, None)
            have = mod.device_count() if mod is not None and mod.is_available() else 0
            for i, s in enumerate(states[:have]):
                assert mod is not None  # have > 0
                mod.set_rng_state(_u8(s), i)
            if have > len(states) and (states or kind == "cuda"):
                warnings.warn(
                    f"{kind} devices {len(states)}..{have - 1} are not in the saved random state and "
                    "keep their current generator state", RngRestoreWarning, stacklevel=2)
        if self.mps is not None and not any("MPS" in p for p in problems):
            torch.mps.set_rng_state(_u8(self.mps))


# --------------------------------------------------------------------------- the node kinds

# Registered when this module is imported (tensorcanon/__init__.py imports it). numpy's and torch's
# classes are named, not imported: they get their encoders when numpy (torch) is loaded.
tree.register_kind("rng.torch", _dec_torch, {tree.LazyType("torch", "Generator"): _enc_torch})
tree.register_kind("rng.bitgen", _dec_bitgen,
                   {tree.LazyType("numpy", f"random.{name}"): _enc_bitgen for name in _FIELDS})
tree.register_kind("rng.numpy", _dec_numpy, {tree.LazyType("numpy", "random.Generator"): _enc_generator})
tree.register_kind("rng.legacy", _dec_legacy, {tree.LazyType("numpy", "random.RandomState"): _enc_randomstate})
tree.register_kind("rng.random", _dec_random, {random.Random: _enc_random})
tree.register_kind("rng.state", _dec_rngstate, {RngState: _enc_rngstate})
