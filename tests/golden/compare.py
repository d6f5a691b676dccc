"""Exact comparison of saved and loaded values, shared by the format tests."""

from __future__ import annotations

import collections
import dataclasses
import io
import struct

import numpy as np
import torch


def canonical_bytes(t: torch.Tensor) -> bytes:
    """The logical C-order bytes of a tensor (conj/neg resolved, bool as 0/1)."""
    t = t.detach().resolve_conj().resolve_neg().cpu()
    if t.dtype is torch.bool:
        t = t.to(torch.uint8)
    if not t.numel():
        return b""
    if t.dtype.itemsize == 16:  # complex128: no 16-byte int to reinterpret as
        t = torch.view_as_real(t)
    # reinterpret as an int of the same size (copy kernels exist for every int, not for every dtype)
    t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)  # fresh, so strides are 1
    return flat.view(torch.uint8).numpy().tobytes()


def special_parts(t: torch.Tensor):
    """What a sparse, nested or meta tensor holds, as ``(layout, what else it holds, [(dtype, shape,
    bytes) of each component])`` (docs/FORMAT.md §6.12: a COO tensor's indices and values as it holds
    them, and whether it is coalesced; a jagged tensor's cached lengths); None for a dense tensor,
    which canonical_bytes reads."""
    from tensorcanon.format import tensorkinds

    extra = None
    if t.is_nested and t.layout is torch.jagged:
        extra = tensorkinds.jagged_seqlens(t)
    t = t.detach()
    if t.is_meta:
        return ("meta", None, [])
    if t.is_nested:
        parts = list(t.unbind())
    elif t.layout is torch.sparse_coo:
        parts = [t._indices(), t._values()]
        extra = t.is_coalesced()
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    else:
        return None
    return (str(t.layout), extra, [(p.dtype, tuple(p.shape), canonical_bytes(p)) for p in parts])


def user_attrs(t: torch.Tensor) -> dict:
    """The attributes a program set on ``t`` (its ``__dict__``, less a jagged tensor's own state)."""
    from tensorcanon.format import tensorkinds

    own = tensorkinds.jagged_state() if t.is_nested and type(t) is not torch.Tensor else ()
    return {k: v for k, v in vars(t).items() if k not in own}


def tensor_content(t: torch.Tensor):
    """Everything a saved tensor's value is made of: its layout's parts (or its bytes) and the
    attributes set on it (their values compared by the caller)."""
    special = special_parts(t)
    return special if special is not None else canonical_bytes(t)


def view_key(v):
    """What makes two tensors "the same view of the same storage" (written once, loaded as one)."""
    if isinstance(v, np.ndarray):
        if not v.size:
            return ("id", id(v))
        return ("nd", v.__array_interface__["data"][0], v.shape, v.strides, v.dtype.str)
    if special_parts(v) is not None or user_attrs(v):  # (docs/FORMAT.md §6.12: one object per saved object)
        return ("id", id(v))
    if not v.numel():
        return ("id", id(v))
    return (v.untyped_storage().data_ptr(), str(v.device), v.storage_offset(), tuple(v.shape), v.stride(),
            v.dtype, type(v) is torch.nn.Parameter, v.requires_grad, v.is_conj(), v.is_neg())


def key_id(k):
    """An exact identity for a key: NaN keys by their bits, -0.0 apart from 0.0, types kept."""
    if isinstance(k, float):
        return ("float", struct.pack(">d", k))
    if isinstance(k, tuple):
        return ("tuple", tuple(key_id(x) for x in k))
    if isinstance(k, frozenset):
        return ("frozenset", tuple(sorted((key_id(x) for x in k), key=repr)))
    return (type(k).__name__, k)


def _bitgen(bg):
    """A bit generator's complete state as plain values: its state and its SeedSequence."""
    ss = getattr(bg, "seed_seq", None)
    seq = None if ss is None else (repr(ss.entropy), tuple(ss.spawn_key), ss.pool_size, ss.n_children_spawned)
    return (type(bg).__name__, repr(bg.state), seq)


def assert_same(a, b, path="$", aliases=None):
    """Assert ``b`` equals ``a`` exactly: types, float bits, dtypes, shapes, devices, key order of
    OrderedDicts and their ``_metadata``. With ``aliases`` (a dict), also check that values that were
    one object in ``a`` are one object in ``b`` and distinct ones stay distinct."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if aliases is not None and isinstance(a, (torch.Tensor, np.ndarray)):
        key = view_key(a)
        seen = aliases.setdefault(key, b)
        assert seen is b, f"{path}: an aliased tensor came back as two objects"
        rev = aliases.setdefault(("rev", id(b)), key)
        assert rev == key, f"{path}: two distinct tensors came back as one object"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and (a.is_nested or tuple(a.shape) == tuple(b.shape)), path
        assert a.device == b.device and a.requires_grad == b.requires_grad, path
        assert a.layout == b.layout and a.is_nested == b.is_nested, f"{path}: layout differs"
        assert tensor_content(a) == tensor_content(b), f"{path}: tensor bytes differ"
        attrs_a, attrs_b = user_attrs(a), user_attrs(b)
        assert sorted(attrs_a) == sorted(attrs_b), f"{path}: attributes differ"
        for k in attrs_a:
            assert_same(attrs_a[k], attrs_b[k], f"{path}.{k}", aliases)
    elif isinstance(a, np.ndarray):
        assert a.dtype.newbyteorder("=") == b.dtype and a.shape == b.shape, path
        assert np.ascontiguousarray(a).astype(b.dtype).tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, complex):
        assert struct.pack(">dd", a.real, a.imag) == struct.pack(">dd", b.real, b.imag), path
    elif isinstance(a, tuple) and hasattr(a, "_fields"):  # a NamedTuple (PackedSequence): field by field
        for f in a._fields:
            assert_same(getattr(a, f), getattr(b, f), f"{path}.{f}", aliases)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]", aliases)
    elif isinstance(a, collections.deque):
        assert a.maxlen == b.maxlen, f"{path}: maxlen {a.maxlen} != {b.maxlen}"
        assert_same(list(a), list(b), path, aliases)
    elif isinstance(a, dict):
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, f"{path}: default_factory differs"
        if isinstance(a, collections.OrderedDict):
            assert list(a) == list(b), f"{path}: OrderedDict order differs"
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: _metadata"
        by_id = {key_id(k): k for k in b}
        assert sorted(map(key_id, a), key=repr) == sorted(by_id, key=repr), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[by_id[key_id(k)]], f"{path}[{k!r}]", aliases)
    elif isinstance(a, torch.Generator):
        assert a.device == b.device and torch.equal(a.get_state(), b.get_state()), path
    elif isinstance(a, np.random.Generator):
        assert_same(_bitgen(a.bit_generator), _bitgen(b.bit_generator), path)
    elif isinstance(a, np.random.RandomState):
        sa, sb = a.get_state(legacy=False), b.get_state(legacy=False)
        assert (sa["has_gauss"], sa["gauss"]) == (sb["has_gauss"], sb["gauss"]), path
        assert_same(_bitgen(a._bit_generator), _bitgen(b._bit_generator), path)
    elif isinstance(a, np.random.BitGenerator):
        assert_same(_bitgen(a), _bitgen(b), path)
    elif type(a).__name__ == "Random" and hasattr(a, "getstate"):
        assert a.getstate() == b.getstate(), path
    elif isinstance(a, io.BytesIO):  # its content (docs/FORMAT.md §6.9.4); it loads at position 0
        assert a.getvalue() == b.getvalue(), f"{path}: the buffers' bytes differ"
        assert b.tell() == 0, f"{path}: loaded at position {b.tell()}"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}", aliases)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
