"""Tensors that are more than one block of bytes: sparse, nested and meta tensors, and attributes
set on a tensor. docs/FORMAT.md §6.12 is the normative description.

Each is a node kind of the object tree (format/tree.py, :func:`tree.register_kind`) whose parts
are ordinary table tensors, named by their path below the tensor (``$["w"]["values"]``) and
hashed like every tensor:

===============  ===============================================================================
tag              node
===============  ===============================================================================
``sparse``       ``["sparse", layout, size, kind, requires_grad, component...]``: COO (``indices``,
                 ``values``; an uncoalesced one as it holds them, then ``false``), CSR/BSR
                 (``crow_indices``, ``col_indices``, ``values``), CSC/BSC (``ccol_indices``,
                 ``row_indices``, ``values``)
``nested``       ``["nested", "strided", dtype, requires_grad, component...]`` (one per element)
                 or ``["nested", "jagged", dtype, requires_grad, values, offsets]``, then
                 ``min_seqlen, max_seqlen`` (each nil or an int) when it caches either
``meta``         ``["meta", dtype, size, kind, requires_grad]``: no bytes at all
``tensor.attrs`` ``["tensor.attrs", tensor node, dict node]``: the tensor's ``__dict__``
===============  ===============================================================================

Every check a reader makes on the parts (index ranges, monotone offsets, counts) is made by
:func:`sparse_problem` and :func:`jagged_problem`, before torch builds anything, on the writer's
side as on the reader's: the writer refuses exactly what a reader rejects.

Tensors the format does not hold are refused here with advice that works (tests/test_tensorkinds.py
applies each piece of advice and round-trips the result).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import container, dtypes, optional, tensorbytes, tree
from .errors import FormatError
from .subclasses import implements_flatten

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = optional.numpy_module(globals())
    torch = optional.torch_module(globals())

# layout name -> (component names, compressed?)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "coo": ("indices", "values"),
    "csr": ("crow_indices", "col_indices", "values"),
    "csc": ("ccol_indices", "row_indices", "values"),
    "bsr": ("crow_indices", "col_indices", "values"),
    "bsc": ("ccol_indices", "row_indices", "values"),
}
KINDS = ("tensor", "parameter")
# The dtypes of a strided nested tensor: those torch builds one of (the same list from torch 2.4 to
# 2.13; float8, uint16-64 and complex32 raise "create_nt_buffer not implemented"). A closed list, so
# that verify, which builds nothing, refuses what load cannot build (docs/FORMAT.md §6.12.2).
STRIDED_NESTED_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                         "float64", "complex64", "complex128")
_MEMO = "_tensorkinds_memo"  # attribute of an Encoder / Decoder: composite nodes by id / by content


def _layout_name(layout: Any) -> str | None:
    name = str(layout).removeprefix("torch.sparse_")
    return name if name in LAYOUTS else None


def _torch_layout(name: str) -> Any:
    return getattr(torch, f"sparse_{name}")


def _memo(obj: Any) -> dict:
    memo = getattr(obj, _MEMO, None)
    if memo is None:
        memo = {}
        setattr(obj, _MEMO, memo)
    return memo


# --------------------------------------------------------------------------- the checks (one place)


# A part as the checks see it, from a tensor (load, the writer) or from its table row (verify, which
# builds nothing and needs no torch): (dtype name or None, shape, a plain tensor without requires_grad).
Part = tuple[str | None, tuple[int, ...], bool]
_PLAIN = "its components must be plain dense tensors (kind 'tensor') without requires_grad"
_BLOCKED = ("bsr", "bsc")


def part_of(t: Any) -> Part:
    """The :data:`Part` of a built tensor (or whatever a component decoded to)."""
    if type(t) is not torch.Tensor:
        return None, (), False
    row = dtypes.BY_TORCH.get(t.dtype)
    return (row.name if row is not None else None), tuple(t.shape), t.layout is torch.strided and not t.requires_grad


def row_part(row: Any) -> Part:
    """The :data:`Part` of a table row (manifest.TensorInfo): what :func:`part_of` gives for the value
    the row loads as (an nn.Parameter or a numpy array is no plain tensor)."""
    if row.kind != "tensor":
        return None, (), False
    return row.dtype.name, tuple(row.shape), not row.requires_grad


def _compressed_dims(layout: str, batch: int) -> tuple[int, int]:
    """(compressed dimension, plain dimension) of ``size`` for a compressed layout."""
    return (batch, batch + 1) if layout in ("csr", "bsr") else (batch + 1, batch)


def sparse_shape_problem(layout: str, size: Sequence[int], parts: Sequence[Part]) -> str | None:
    """What keeps parts of these dtypes and shapes from being a sparse tensor of ``layout`` and
    ``size`` (docs/FORMAT.md §6.12.1), or None: every rule that needs no index value."""
    if not all(plain for _, _, plain in parts):
        return _PLAIN
    if any(d < 0 for d in size):
        return "its size has a negative dimension"
    if layout == "coo":
        (idt, ishape, _), (_, vshape, _) = parts
        if idt != "int64" or len(ishape) != 2:
            return "COO indices must be a 2-d int64 tensor (sparse dims, nnz)"
        sparse_dim, nnz = ishape
        if not 0 <= sparse_dim <= len(size) or len(vshape) < 1 or vshape[0] != nnz \
                or tuple(vshape[1:]) != tuple(size[sparse_dim:]):
            return (f"COO indices of shape {ishape} and values of shape {vshape} do not fit the size "
                    f"{tuple(size)}")
        return None
    (cdt, cshape, _), (pdt, pshape, _), (_, vshape, _) = parts
    if cdt not in ("int32", "int64") or cdt != pdt:
        return "compressed and plain indices must both be int32 or both int64"
    batch, block = len(cshape) - 1, 2 if layout in _BLOCKED else 0
    if batch < 0 or len(pshape) != len(cshape) or cshape[:-1] != pshape[:-1] \
            or len(vshape) < batch + 1 + block or vshape[:batch] != cshape[:-1] or vshape[batch] != pshape[-1]:
        return (f"compressed indices of shape {cshape}, plain indices of shape {pshape} and values of shape "
                f"{vshape} do not fit together")
    dense = vshape[batch + 1 + block:]
    blocks = vshape[batch + 1 : batch + 1 + block] if block else (1, 1)
    if len(size) != batch + 2 + len(dense) or tuple(size[:batch]) != cshape[:-1] \
            or tuple(size[batch + 2:]) != dense or 0 in blocks \
            or size[batch] % blocks[0] or size[batch + 1] % blocks[1]:
        return f"its parts (values of shape {vshape}) do not fit the size {tuple(size)}"
    cdim, _ = _compressed_dims(layout, batch)
    if cshape[-1] != size[cdim] // blocks[cdim - batch] + 1:
        return (f"its compressed indices hold {cshape[-1]} entries per batch, not one more than the "
                f"{size[cdim] // blocks[cdim - batch]} compressed rows")
    if cdt == "int32" and max([pshape[-1], *size[batch : batch + 2]]) > 2**31 - 1:
        return "int32 indices cannot index this many elements; use int64"
    return None


def sparse_index_problem(layout: str, size: Sequence[int], indices: Sequence[Any],
                         blocks: Sequence[int] = (1, 1), coalesced: bool = True) -> str | None:
    """What keeps the index parts ``indices`` (numpy arrays: COO ``[indices]``, compressed
    ``[compressed, plain]``) of parts that pass :func:`sparse_shape_problem` from being a canonical
    sparse tensor of ``layout`` and ``size``, or None; ``blocks``: a BSR/BSC tensor's block shape;
    ``coalesced`` false: an uncoalesced COO tensor, whose indices may come in any order and repeat.
    Made by the writer, by load and by verify (on the index parts' bytes, without torch)."""
    if layout == "coo":
        (idx,) = indices
        sparse_dim, nnz = idx.shape
        if not nnz:
            return None
        for d in range(sparse_dim):
            if int(idx[d].min()) < 0 or int(idx[d].max()) >= size[d]:
                return f"a COO index of sparse dimension {d} is out of range [0, {size[d]})"
        if nnz > 1 and coalesced:  # the index columns strictly increase in lexicographic order
            a, b = idx[:, :-1], idx[:, 1:]
            less = np.zeros(nnz - 1, dtype=bool)
            equal = np.ones(nnz - 1, dtype=bool)
            for d in range(sparse_dim):
                less |= equal & (a[d] < b[d])
                equal &= a[d] == b[d]
            if not bool(less.all()):
                return "COO indices are not coalesced (sorted, each index once)"
        return None
    compressed, plain = indices
    batch = compressed.ndim - 1
    cdim, pdim = _compressed_dims(layout, batch)
    plain_size = size[pdim] // blocks[pdim - batch]
    nnz = plain.shape[-1]
    c = compressed.reshape(-1, compressed.shape[-1]).astype(np.int64)
    p = plain.reshape(len(c), nnz).astype(np.int64)  # (one row of each per batch element)
    if bool((c[:, 0] != 0).any()) or bool((c[:, -1] != nnz).any()):
        return f"compressed indices must start at 0 and end at the number of specified elements ({nnz})"
    steps = np.diff(c, axis=1)
    if bool((steps < 0).any()) or bool((steps > plain_size).any()):
        return f"compressed indices must not decrease, nor grow by more than {plain_size} at a step"
    if nnz:
        if int(p.min()) < 0 or int(p.max()) >= plain_size:
            return f"a plain index is out of range [0, {plain_size})"
        for row_steps, q in zip(steps, p, strict=True):
            same = np.repeat(np.arange(len(row_steps)), row_steps)  # the compressed row of each element
            if bool(((q[1:] <= q[:-1]) & (same[1:] == same[:-1])).any()):
                return "plain indices must strictly increase within each compressed row"
    return None


def sparse_blocks(layout: str, parts: Sequence[Part]) -> tuple[int, int]:
    """The block shape of a BSR/BSC tensor's parts (passing :func:`sparse_shape_problem`); (1, 1) else."""
    if layout not in _BLOCKED:
        return 1, 1
    batch = len(parts[0][1]) - 1
    vshape = parts[2][1]
    return vshape[batch + 1], vshape[batch + 2]


def size_problem(size: Sequence[Any], itemsize: int = 1) -> str | None:
    """What keeps ``size`` from being the size of a sparse or meta tensor (docs/FORMAT.md §6.12:
    non-negative ints below 2^63 whose non-zero ones, times ``itemsize``, stay below 2^63, §5.3),
    or None. The one check of it: the writer makes it on the tensor's shape, every reader on the
    ``size`` node."""
    if not all(type(d) is int and 0 <= d < 2**63 for d in size):
        return "has a size that is not non-negative ints below 2^63"
    return container.size_problem(size, itemsize)


def sparse_problem(layout: str, size: Sequence[int], parts: Sequence[Any], coalesced: bool = True) -> str | None:
    """What keeps ``parts`` (CPU or device tensors) from being a canonical sparse tensor of
    ``layout`` and ``size`` (docs/FORMAT.md §6.12.1), or None. Checked before torch builds one:
    :func:`sparse_shape_problem`, then :func:`sparse_index_problem` on the index parts."""
    described = [part_of(p) for p in parts]
    problem = sparse_shape_problem(layout, size, described)
    if problem is not None:
        return problem
    indices = [p.detach().cpu().numpy() for p in parts[:-1]]
    return sparse_index_problem(layout, size, indices, sparse_blocks(layout, described), coalesced)


def _build_sparse(layout: str, size: Sequence[int], parts: Sequence[Any], coalesced: bool = True) -> Any:
    """The sparse tensor of checked ``parts``; RuntimeError/ValueError/TypeError from torch's
    invariant check (``check_invariants=True``) if they are not valid."""
    if layout == "coo":
        indices, values = parts
        return torch.sparse_coo_tensor(indices, values, tuple(size), is_coalesced=coalesced, check_invariants=True)
    compressed, plain, values = parts
    return torch.sparse_compressed_tensor(compressed, plain, values, tuple(size), layout=_torch_layout(layout),
                                          check_invariants=True)


def jagged_shape_problem(values: Part, offsets: Part) -> str | None:
    """What keeps parts of these dtypes and shapes from being a jagged nested tensor's values and
    offsets (docs/FORMAT.md §6.12.2), or None: every rule that needs no offset value."""
    if not (values[2] and offsets[2]):
        return _PLAIN
    if offsets[0] != "int64" or len(offsets[1]) != 1 or offsets[1][0] < 2:
        return "jagged offsets must be a 1-d int64 tensor of at least 2 entries"
    if len(values[1]) < 1:
        return "jagged values must have at least one dimension"
    return None


def jagged_offsets_problem(offsets: Any, rows: int) -> str | None:
    """What keeps ``offsets`` (a numpy array passing :func:`jagged_shape_problem`) from being the
    offsets of ``rows`` value rows, or None. Made by the writer, load and verify (without torch)."""
    if int(offsets[0]) != 0 or int(offsets[-1]) != rows:
        return f"jagged offsets must start at 0 and end at the number of value rows ({rows})"
    if bool((offsets[1:] < offsets[:-1]).any()):
        return "jagged offsets must not decrease"
    return None


def jagged_problem(values: Any, offsets: Any) -> str | None:
    """What keeps ``values`` and ``offsets`` from being a canonical jagged nested tensor
    (docs/FORMAT.md §6.12.2), or None. Checked before torch builds one."""
    problem = jagged_shape_problem(part_of(values), part_of(offsets))
    if problem is not None:
        return problem
    return jagged_offsets_problem(offsets.detach().cpu().numpy(), values.shape[0])


SEQLENS = ("min_seqlen", "max_seqlen")  # the lengths a jagged nested tensor caches (its _metadata_cache keys)


def seqlens_problem(seqlens: Sequence[Any]) -> str | None:
    """What keeps ``seqlens`` (a jagged nested tensor's cached min_seqlen and max_seqlen, each None
    when not cached) from being written after its parts, or None (docs/FORMAT.md §6.12.2): each nil or
    an int in [0, 2^63), not both nil (a tensor that caches neither has no such arguments). The one
    check, for the writer and every reader."""
    if len(seqlens) != 2:
        return f"a jagged node holds its cached lengths as two values ({', '.join(SEQLENS)}), not {len(seqlens)}"
    for name, n in zip(SEQLENS, seqlens, strict=True):
        if n is not None and (type(n) is not int or not 0 <= n < 2**63):
            return f"its cached {name} must be nil or an int in [0, 2^63), not {tree.paths.show(n)}"
    if seqlens[0] is None and seqlens[1] is None:
        return "its cached lengths are both nil: a jagged tensor that caches neither is written without them"
    return None


def jagged_seqlens(v: Any) -> tuple[Any, Any]:
    """The min_seqlen and max_seqlen jagged nested tensor ``v`` caches (each None when it does not):
    ints, as torch gives them back (``t._min_seqlen``); whatever else its cache holds (a SymInt while
    compiling) is given as it is, for :func:`seqlens_problem` to refuse."""
    cache = getattr(v, "_metadata_cache", None) or {}
    out: list[Any] = []
    for key in SEQLENS:
        held = cache.get(key)
        if held is None:
            out.append(None)
            continue
        maybe = getattr(type(v), f"_maybe_{key}", None)  # (torch >= 2.5: the int of the tensor it stores)
        if maybe is not None:
            out.append(getattr(v, f"_maybe_{key}"))
        else:
            out.append(held if type(held) is int else _seqlen_of(held))
    return out[0], out[1]


def _seqlen_of(held: Any) -> Any:
    """The int a cached length tensor stands for (torch stores it as the shape of an empty tensor)."""
    from torch.nested._internal import nested_tensor as njt

    load = getattr(njt, "_load_val_from_tensor", None)
    return load(held) if load is not None else held


def _other_cache(v: Any) -> list:
    """What a jagged nested tensor caches besides its lengths (nothing, from torch 2.4 to 2.13)."""
    cache = getattr(v, "_metadata_cache", None) or {}
    return sorted(str(k) for k, x in cache.items() if k not in SEQLENS and x is not None)


_FROM_JAGGED_SEQLENS: list[bool] = []


def _from_jagged(values: Any, offsets: Any, seqlens: tuple[Any, Any]) -> Any:
    """``torch.nested.nested_tensor_from_jagged(values, offsets)`` caching ``seqlens`` (either None)."""
    if seqlens == (None, None):
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    if not _FROM_JAGGED_SEQLENS:
        import inspect

        params = inspect.signature(torch.nested.nested_tensor_from_jagged).parameters
        _FROM_JAGGED_SEQLENS.append("min_seqlen" in params and "max_seqlen" in params)
    if _FROM_JAGGED_SEQLENS[0]:
        return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=seqlens[0], max_seqlen=seqlens[1])
    value = torch.nested.nested_tensor_from_jagged(values, offsets)  # (a torch that caches the ints themselves)
    for key, n in zip(SEQLENS, seqlens, strict=True):
        if n is not None:
            value._metadata_cache[key] = n  # type: ignore[attr-defined]
    return value


# --------------------------------------------------------------------------- encode


def _kind(v: Any) -> str:
    return "parameter" if isinstance(v, torch.nn.Parameter) else "tensor"


def _dtype_name(enc: tree.Encoder, v: Any) -> str:
    row = dtypes.BY_TORCH.get(v.dtype)
    if row is None:
        raise enc.unsupported(tensorbytes.dtype_refusal(v.dtype))
    return row.name


def _parts(enc: tree.Encoder, names: Sequence[Any], parts: Sequence[Any], depth: int) -> list:
    out = []
    for name, part in zip(names, parts, strict=True):
        with enc.at(name):
            out.append(enc.encode(part, depth))
    return out


def coalesced(v: Any) -> bool:
    """Whether sparse tensor ``v`` is written as coalesced (§6.12.1): every layout but an uncoalesced
    COO tensor (``is_coalesced()`` false), which is written as it holds its indices and values."""
    return v.layout is not torch.sparse_coo or bool(v.is_coalesced())


def sparse_parts(v: Any) -> list:
    """The parts a sparse tensor is written as (§6.12.1), in order: a COO tensor's indices and
    values as it holds them (an uncoalesced one's in its order, repeated indices included)."""
    t = v.detach()
    if t.layout is torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    else:
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    return [p.detach() for p in parts]


def is_jagged(v: Any) -> bool:
    """Whether ``v`` is a jagged nested tensor (a subclass of torch.Tensor that §6.12.2 holds)."""
    # (the type first: some subclasses, ShardedTensor, raise on any attribute access)
    return type(v).__name__ == "NestedTensor" and bool(getattr(v, "is_nested", False))


def attributes(v: Any) -> dict:
    """The attributes a program set on tensor ``v`` (§6.12.4): its ``__dict__``, less a jagged nested
    tensor's own state; none for other subclasses (a registered one saves what it flattens to)."""
    if type(v) in (torch.Tensor, torch.nn.Parameter):
        return v.__dict__
    if is_jagged(v):
        own = jagged_state()
        return {k: a for k, a in v.__dict__.items() if k not in own}
    return {}


def _seqlens_text(v: Any) -> str:
    seqlens = jagged_seqlens(v)
    held = [f"{name} {n}" for name, n in zip(SEQLENS, seqlens, strict=True) if n is not None]
    return f" ({', '.join(held)})" if held else ""


def parts(v: Any) -> tuple[str, list[tuple[Any, Any]]] | None:
    """``(what v is, [(path step, part), ...])`` for a tensor the plain ``tensor`` node does not hold as
    it is, its parts as a writer writes them; None for a plain dense tensor. For tools (diff) that
    compare such tensors part by part; a subclass that flattens gives its inner tensors."""
    cls = type(v)
    if cls not in (torch.Tensor, torch.nn.Parameter) and not is_jagged(v):
        if callable(getattr(cls, "__tensor_flatten__", None)):
            names, _ = v.__tensor_flatten__()
            return cls.__qualname__, [(n, getattr(v, n)) for n in names]
        return cls.__qualname__, []
    if v.is_quantized:
        return "quantized", []
    if v.is_meta:
        return "meta", []
    if v.is_nested:
        t = v.detach()
        cached = _seqlens_text(v) if t.layout is torch.jagged else ""
        return (f"nested {str(t.layout).removeprefix('torch.')}{cached}",
                list(enumerate(p.detach() for p in t.unbind())))
    layout = _layout_name(v.layout)
    if layout is not None:
        return (f"sparse {layout}{'' if coalesced(v) else ' (uncoalesced)'}",
                list(zip(LAYOUTS[layout], sparse_parts(v), strict=True)))
    return None


def _enc_sparse(enc: tree.Encoder, v: Any, depth: int) -> list:
    layout = _layout_name(v.layout)
    assert layout is not None
    t = v.detach()
    parts = sparse_parts(v)
    size = list(t.shape)
    flag = coalesced(v)
    problem = size_problem(size)
    if problem is not None:
        raise enc.unsupported(f"this {v.layout} tensor {problem}")
    problem = sparse_problem(layout, size, parts, flag)
    if problem is None and layout != "coo":
        try:
            _build_sparse(layout, size, parts)
        except (RuntimeError, ValueError, TypeError) as e:
            problem = f"torch's invariant check refuses it: {e}"
    if problem is not None:
        raise enc.unsupported(f"this {v.layout} tensor cannot be saved: {problem}")
    with enc.at("size"):
        size_node = enc.encode(torch.Size(size), depth)
    return ["sparse", layout, size_node, _kind(v), bool(v.requires_grad),
            *_parts(enc, LAYOUTS[layout], parts, depth), *(() if flag else (False,))]


def _enc_meta(enc: tree.Encoder, v: Any, depth: int) -> list:
    name = _dtype_name(enc, v)
    problem = size_problem(list(v.shape), dtypes.BY_NAME[name].itemsize)  # (the reader's check: _size)
    if problem is not None:
        raise enc.unsupported(f"this meta tensor {problem}")
    with enc.at("size"):
        size_node = enc.encode(torch.Size(v.shape), depth)
    return ["meta", name, size_node, _kind(v), bool(v.requires_grad)]


def _enc_nested(enc: tree.Encoder, v: Any, depth: int) -> list:
    if isinstance(v, torch.nn.Parameter):
        raise enc.unsupported("a nested tensor wrapped in nn.Parameter cannot be saved: save p.detach() (the "
                              "nested tensor) and wrap it again after loading")
    name = _dtype_name(enc, v)
    t = v.detach()
    if t.layout is torch.strided:
        parts = [p.detach() for p in t.unbind()]
        return ["nested", "strided", name, bool(v.requires_grad), *_parts(enc, range(len(parts)), parts, depth)]
    if t.layout is not torch.jagged:
        raise enc.unsupported(f"nested tensors of layout {t.layout} are not supported; save list(t.unbind())")
    if getattr(v, "_ragged_idx", 1) != 1 or getattr(t, "_ragged_idx", 1) != 1:
        raise enc.unsupported("a jagged nested tensor whose ragged dimension is not dimension 1 (a transposed "
                              "one) cannot be saved: save list(t.unbind()) and rebuild it after loading")
    if getattr(v, "_lengths", None) is not None or t._lengths is not None:
        raise enc.unsupported("a non-contiguous jagged nested tensor (one with lengths, such as a "
                              "torch.nested.narrow) cannot be saved: save "
                              "torch.nested.nested_tensor(list(t.unbind()), layout=torch.jagged)")
    other = _other_cache(v)
    if other:
        raise enc.unsupported(f"this jagged nested tensor caches {', '.join(other)}, which the format does not hold "
                              f"(only {' and '.join(SEQLENS)}): save "
                              "torch.nested.nested_tensor_from_jagged(t.values(), t.offsets()) instead")
    seqlens = jagged_seqlens(v)
    if seqlens != (None, None):
        problem = seqlens_problem(seqlens)
        if problem is not None:
            raise enc.unsupported(f"this jagged nested tensor cannot be saved: {problem}")
    values, offsets = t.values().detach(), t.offsets().detach()
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != values.shape[0]:  # a view of part of the values: save only that part
        values, offsets = values[first:last], offsets - first
    problem = jagged_problem(values, offsets)
    if problem is not None:
        raise enc.unsupported(f"this jagged nested tensor cannot be saved: {problem}")
    return ["nested", "jagged", name, bool(v.requires_grad),
            *_parts(enc, ("values", "offsets"), (values, offsets), depth),
            *(seqlens if seqlens != (None, None) else ())]


def _enc_attrs(enc: tree.Encoder, v: Any, inner: list, attrs: dict, depth: int) -> list:
    odd = next((k for k in attrs if type(k) is not str), None)
    if odd is not None:
        raise enc.unsupported(f"the tensor's __dict__ holds the key {tree.paths.show(odd)}, not an attribute "
                              "name (a str); remove it before saving")
    return ["tensor.attrs", inner, enc.encode(dict(attrs), depth)]


def _refusal(v: Any) -> str:
    """Why ``v``, a tensor of a kind no node holds, is refused, with advice that works."""
    cls = type(v)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if issubclass(cls, (torch.nn.parameter.UninitializedParameter, torch.nn.parameter.UninitializedBuffer)):
        return (f"{name} holds no data yet (a lazy module's parameter or buffer before its first forward "
                "pass): run one forward pass with a sample input (or call "
                "module.initialize_parameters(sample_input)) before saving")
    if cls not in (torch.Tensor, torch.nn.Parameter):
        if "FakeTensor" in cls.__name__ or cls.__name__ in ("ShardedTensor", "DTensor"):
            return tensorbytes.unsaveable(v) or f"tensor subclass {name} is not supported"
        if implements_flatten(cls):
            return (f"tensor subclass {name} is not registered: it implements __tensor_flatten__/"
                    f"__tensor_unflatten__, so call tensorcanon.register({cls.__qualname__}) before saving and "
                    "loading (tensorcanon never imports a class named in a file)")
        dispatch = getattr(cls.__torch_dispatch__, "__func__", None)
        if dispatch is getattr(torch.Tensor.__torch_dispatch__, "__func__", None):
            return (f"tensor subclass {name} is not supported: save t.as_subclass(torch.Tensor) (its data as a "
                    f"plain tensor), or register {cls.__qualname__} with encode= and decode=")
        return (f"tensor subclass {name} is not supported: it overrides __torch_dispatch__ without "
                f"__tensor_flatten__; register {cls.__qualname__} with encode= and decode= that give its data "
                "as plain tensors")
    if v.is_quantized:
        return ("torch.ao quantized tensors are not supported (torch deprecates them): save t.dequantize() with "
                "t.q_scale() and t.q_zero_point() (per channel: t.q_per_channel_scales(), "
                "t.q_per_channel_zero_points(), t.q_per_channel_axis()) and t.dtype, and quantize again after "
                "loading (torch.quantize_per_tensor / torch.quantize_per_channel give back the same int_repr())")
    if v.is_meta:
        return (f"meta tensors of layout {v.layout} are not supported: save "
                "torch.empty(t.shape, dtype=t.dtype, device='meta') (a strided meta tensor)")
    return tensorbytes.unsaveable(v) or f"a tensor of layout {v.layout} is not supported"


def encode_special(enc: tree.Encoder, v: Any, depth: int) -> list:
    """tree's hook for every tensor the plain ``tensor`` node does not hold as it is: a tensor of
    another layout, a nested or meta tensor, one with attributes set on it, an unregistered tensor
    subclass. The node, or raises ``enc.unsupported`` with advice that works."""
    memo = _memo(enc)
    seen = memo.get(id(v))
    if seen is not None:
        return seen[1]
    attrs = attributes(v)
    if type(v) in (torch.Tensor, torch.nn.Parameter) and not v.is_quantized:
        if v.is_meta and v.layout is torch.strided:
            inner = _enc_meta(enc, v, depth)
        elif getattr(v, "is_nested", False):
            inner = _enc_nested(enc, v, depth)
        elif _layout_name(v.layout) is not None and not v.is_meta:
            inner = _enc_sparse(enc, v, depth)
        elif v.layout is torch.strided and not v.is_meta and attrs:
            return _enc_attrs(enc, v, enc.plain_tensor(v, merge=False), attrs, depth)
        else:
            raise enc.unsupported(_refusal(v))
    elif is_jagged(v):
        inner = _enc_nested(enc, v, depth)
    else:
        raise enc.unsupported(_refusal(v))
    node = _enc_attrs(enc, v, inner, attrs, depth) if attrs else inner
    memo[id(v)] = (v, node)  # (v kept alive: its id() stays its own until the encoder is done)
    return node


_JAGGED_STATE: list[frozenset] = []


def jagged_state() -> frozenset:
    """The names a jagged nested tensor keeps in its ``__dict__`` itself (values, offsets, caches):
    not attributes a program set, so not saved as such."""
    if not _JAGGED_STATE:
        t = torch.nested.nested_tensor_from_jagged(torch.zeros(2, 1, requires_grad=True), torch.tensor([0, 1, 2]))
        t.unbind()
        t.values()  # (with requires_grad, this caches the sizes in PyCapsules: _sym_sizes_capsule...)
        names = set(t.__dict__)
        _JAGGED_STATE.append(frozenset(names | _TORCH_STATE))
    return _JAGGED_STATE[0]


# What torch keeps in a jagged nested tensor's __dict__ itself, whether a sample shows it or not: its
# parts and caches, and the sizes and strides a wrapper subclass caches in PyCapsules (torch's
# Tensor._clear_non_serializable_cached_data removes these four before pickling one).
_TORCH_STATE = frozenset({"_values", "_offsets", "_lengths", "_ragged_idx", "_metadata_cache", "_size", "_strides",
                          "_sym_sizes_capsule", "_sym_sizes_capsule_len", "_sym_strides_capsule",
                          "_sym_strides_capsule_len"})


# --------------------------------------------------------------------------- decode


def _frozen(node: Any) -> Any:
    return tuple(_frozen(x) for x in node) if type(node) in tree.ARRAYS else node


def _size(dec: tree.Decoder, node: Any, depth: int, itemsize: int = 1) -> tuple[int, ...]:
    if tree.tag_of(node) != "size":
        raise dec.error("the size of a sparse or meta tensor must be a 'size' node of non-negative ints")
    problem = size_problem(node[1:], itemsize)
    if problem is not None:
        raise dec.error(f"a sparse or meta tensor {problem}")
    with dec.at("size"):
        dec.decode(node, depth)
    return tuple(node[1:])


def _flags(dec: tree.Decoder, kind: Any, requires_grad: Any) -> None:
    if kind not in KINDS or type(kind) is not str:
        raise dec.error(f"the kind must be one of {KINDS}, not {tree.paths.show(kind)}")
    if type(requires_grad) is not bool:
        raise dec.error("requires_grad must be a bool")


def _components(dec: tree.Decoder, names: Sequence[Any], nodes: Sequence[Any], depth: int) -> list:
    out = []
    for name, node in zip(names, nodes, strict=True):
        if tree.tag_of(node) != "tensor":
            raise dec.error(f"the component {tree.paths.show(name)} must be a 'tensor' node")
        with dec.at(name):
            if dec.visit is not None:  # (the parts are values of the tree's walk: tree.nodes, inspect)
                dec.visit(dec.current_path(), node)
            out.append(dec.decode(node, depth))
    return out


def _finish(value: Any, kind: str, requires_grad: bool) -> Any:
    if kind == "parameter":
        return torch.nn.Parameter(value, requires_grad=requires_grad)
    return value.requires_grad_(requires_grad) if requires_grad else value


@dataclass(frozen=True)
class Deferred:
    """A check on the values of a node's parts that verify, which builds nothing, makes on their
    verified bytes (:func:`run_deferred`): the rule load makes on the built parts."""

    where: str                      # the node's path, e.g. $["w"]
    what: str                       # what the node is, for the message ("a coo sparse tensor")
    indices: tuple[int, ...]        # the table rows whose values the rule reads
    rule: Callable[[list], str | None]  # numpy arrays of those rows, in order -> problem or None


def kept_rows(checks: Sequence[Deferred]) -> dict[int, bytearray]:
    """An empty buffer for each table row whose values ``checks`` read: a verifier appends the
    row's bytes as it hashes them, then runs the checks on them once every digest matched
    (:func:`run_deferred`, ``data_of=kept.__getitem__``). Every verifier (a file, a sharded
    checkpoint) keeps them so."""
    return {i: bytearray() for check in checks for i in check.indices}


def run_deferred(checks: Sequence[Deferred], rows: Sequence[Any], data_of: Callable[[int], Any]) -> None:
    """Run the deferred value checks of a verified file: ``data_of(i)`` gives table row ``i``'s
    verified bytes (a buffer). Raises the FormatError load would raise, naming the node's path."""
    for check in checks:
        arrays = [np.frombuffer(data_of(i), dtype=rows[i].dtype.numpy).reshape(rows[i].shape)
                  if rows[i].end > rows[i].begin else np.zeros(rows[i].shape, rows[i].dtype.numpy)
                  for i in check.indices]
        problem = check.rule(arrays)
        if problem is not None:
            raise FormatError(f"manifest: {check.what}: {problem} at {check.where}")


def _row_parts(dec: tree.Decoder, nodes: Sequence[Any]) -> list[Part] | None:
    """The parts' :data:`Part` from the table (verify), or None when the decoder has no table."""
    if dec.rows is None:
        return None
    return [row_part(dec.rows[n[1]]) for n in nodes]


def _grad_ok(dec: tree.Decoder, name: str | None, requires_grad: bool) -> None:
    """Torch lets only floating-point and complex tensors require gradients (by the dtype table)."""
    row = dtypes.BY_NAME.get(name) if name is not None else None
    if requires_grad and not (row is not None and row.differentiable):
        raise dec.error(f"requires_grad is true for a tensor of dtype {name}, which torch does not allow "
                        "(docs/FORMAT.md §4.5)")


def _dec_sparse(dec: tree.Decoder, node: Sequence[Any], depth: int) -> Any:
    if len(node) < 2 or node[1] not in LAYOUTS or type(node[1]) is not str:
        raise dec.error(f"'sparse' needs a layout, one of {sorted(LAYOUTS)}")
    layout = node[1]
    names = LAYOUTS[layout]
    count = 5 + len(names)  # (an uncoalesced COO node: one more, false)
    if len(node) != count and not (layout == "coo" and len(node) == count + 1):
        raise dec.error(f"a {layout} 'sparse' node takes {4 + len(names)} values"
                        f"{' (or one more, false)' if layout == 'coo' else ''}, found {len(node) - 1}")
    flag = len(node) == count
    if not flag and node[-1] is not False:
        raise dec.error("the last value of an uncoalesced COO 'sparse' node must be false (a coalesced one has none), "
                        f"not {tree.paths.show(node[-1])}")
    size = _size(dec, node[2], depth)
    _flags(dec, node[3], node[4])
    nodes = node[5:count]
    parts = _components(dec, names, nodes, depth)
    what = f"a {layout} sparse tensor" if flag else "an uncoalesced coo sparse tensor"
    if not dec.build_objects:
        described = _row_parts(dec, nodes)
        if described is not None:
            problem = sparse_shape_problem(layout, size, described)
            if problem is not None:
                raise dec.error(f"{what}: {problem}")
            _grad_ok(dec, described[-1][0], node[4])
            blocks = sparse_blocks(layout, described)
            dec.deferred.append(Deferred(
                dec.path(), what, tuple(n[1] for n in nodes[:-1]),
                lambda arrays: sparse_index_problem(layout, size, arrays, blocks, flag)))
        return None
    key = (_frozen(node), getattr(dec, _ATTRS, None))
    memo = _memo(dec)
    if key in memo:
        return memo[key]
    described = [part_of(p) for p in parts]  # (in verify's order: the shapes, the grad, the indices)
    problem = sparse_shape_problem(layout, size, described)
    if problem is not None:
        raise dec.error(f"{what}: {problem}")
    _grad_ok(dec, described[-1][0], node[4])
    problem = sparse_index_problem(layout, size, [p.detach().cpu().numpy() for p in parts[:-1]],
                                   sparse_blocks(layout, described), flag)
    if problem is not None:
        raise dec.error(f"{what}: {problem}")
    try:
        value = _build_sparse(layout, size, parts, flag)
    except (RuntimeError, ValueError, TypeError) as e:
        raise dec.error(f"{what}: torch's invariant check refuses it: {e}") from None
    value = memo[key] = _finish(value, node[3], node[4])
    return value


def _dec_meta(dec: tree.Decoder, node: Sequence[Any], depth: int) -> Any:
    if len(node) != 5:
        raise dec.error(f"'meta' takes 4 values, found {len(node) - 1}")
    name = node[1]
    row = dtypes.BY_NAME.get(name) if type(name) is str else None
    if row is None:
        raise dec.error(f"unknown dtype {tree.paths.show(name)} (docs/FORMAT.md §4.1)")
    size = _size(dec, node[2], depth, row.itemsize)
    _flags(dec, node[3], node[4])
    if not dec.build_objects:
        _grad_ok(dec, name, node[4])
        return None
    if row.torch is None:
        raise dec.error(f"the file holds a meta tensor of dtype {name}, which this torch ({torch.__version__}) "
                        "lacks; load it with a newer torch")
    _grad_ok(dec, name, node[4])
    try:
        value = torch.empty(size, dtype=row.torch, device="meta")
    except RuntimeError as e:
        raise dec.error(f"torch cannot make this meta tensor: {e}") from None
    return _finish(value, node[3], node[4])


def _nested_dtype(dec: tree.Decoder, layout: str, name: str) -> None:
    if layout == "strided" and name not in STRIDED_NESTED_DTYPES:
        raise dec.error(f"a strided nested tensor of dtype {name}, which torch cannot build (its strided "
                        f"nested tensors hold {', '.join(STRIDED_NESTED_DTYPES)}; docs/FORMAT.md §6.12.2)")


def _nested_described(dec: tree.Decoder, layout: str, name: str, requires_grad: bool,
                      described: list[Part], nodes: Sequence[Any]) -> None:
    """Verify's checks of a nested node, on its parts' table rows: those load makes on the built
    parts, the offsets' values deferred (:class:`Deferred`)."""
    if any(d[0] != name for d in (described[:1] if layout == "jagged" else described)):
        raise dec.error(f"a nested tensor of dtype {name} holds components of another dtype")
    _grad_ok(dec, name, requires_grad)
    if layout == "jagged":
        problem = jagged_shape_problem(*described)
        if problem is not None:
            raise dec.error(f"a jagged nested tensor: {problem}")
        rows = described[0][1][0]
        dec.deferred.append(Deferred(dec.path(), "a jagged nested tensor", (nodes[1][1],),
                                     lambda arrays: jagged_offsets_problem(arrays[0], rows)))
    elif not all(d[2] for d in described) or len({len(d[1]) for d in described}) > 1:
        raise dec.error("the components of a strided nested tensor must be plain tensors of one "
                        "number of dimensions")


def _dec_nested(dec: tree.Decoder, node: Sequence[Any], depth: int) -> Any:
    if len(node) < 4 or node[1] not in ("strided", "jagged") or type(node[1]) is not str:
        raise dec.error("'nested' needs a layout, 'strided' or 'jagged'")
    layout, name, requires_grad = node[1], node[2], node[3]
    row = dtypes.BY_NAME.get(name) if type(name) is str else None
    if row is None:
        raise dec.error(f"unknown dtype {tree.paths.show(name)} (docs/FORMAT.md §4.1)")
    _flags(dec, "tensor", requires_grad)
    _nested_dtype(dec, layout, name)
    seqlens: tuple[Any, Any] = (None, None)
    nodes = node[4:]
    if layout == "jagged":
        if len(node) not in (6, 8):
            raise dec.error(f"a jagged 'nested' node takes 5 values (7 with its cached lengths), found {len(node) - 1}")
        nodes = node[4:6]
        if len(node) == 8:
            seqlens = (node[6], node[7])
            problem = seqlens_problem(seqlens)
            if problem is not None:
                raise dec.error(f"a jagged nested tensor: {problem}")
        parts = _components(dec, ("values", "offsets"), nodes, depth)
    else:
        parts = _components(dec, range(len(node) - 4), nodes, depth)
    if not dec.build_objects:
        described = _row_parts(dec, nodes)
        if described is not None:
            _nested_described(dec, layout, name, requires_grad, described, nodes)
        return None
    key = (_frozen(node), getattr(dec, _ATTRS, None))
    memo = _memo(dec)
    if key in memo:
        return memo[key]
    if row.torch is None or any(part_of(p)[0] != name for p in (parts[:1] if layout == "jagged" else parts)):
        raise dec.error(f"a nested tensor of dtype {name} holds components of another dtype")
    _grad_ok(dec, name, requires_grad)
    if layout == "jagged":
        problem = jagged_problem(*parts)
        if problem is not None:
            raise dec.error(f"a jagged nested tensor: {problem}")
    elif any(type(p) is not torch.Tensor or p.requires_grad for p in parts) or len({p.dim() for p in parts}) > 1:
        raise dec.error("the components of a strided nested tensor must be plain tensors of one "
                        "number of dimensions")
    try:
        if layout == "jagged":
            value = _from_jagged(parts[0], parts[1], seqlens)
        else:
            value = torch.nested.nested_tensor(parts, dtype=row.torch,
                                               device=parts[0].device if parts else None)
    except (RuntimeError, ValueError, TypeError) as e:
        raise dec.error(f"torch refuses the {layout} nested tensor: {e}") from None
    value = memo[key] = _finish(value, "tensor", requires_grad)
    return value


_INNER = ("tensor", "sparse", "nested", "meta")
_ATTRS = "_tensorkinds_attrs"  # attribute of a Decoder: the attributes node around the node being decoded


def _dec_attrs(dec: tree.Decoder, node: Sequence[Any], depth: int) -> Any:
    if len(node) != 3:
        raise dec.error(f"'tensor.attrs' takes 2 values, found {len(node) - 1}")
    inner, attrs_node = node[1], node[2]
    tag = tree.tag_of(inner)
    if tag not in _INNER:
        raise dec.error(f"'tensor.attrs' holds a tensor node ({', '.join(_INNER)}), not {tree.paths.show(tag)}")
    if tag == "tensor" and (len(inner) != 2 or type(inner[1]) is not int or not 0 <= inner[1] < len(dec.used)
                            or dec.used[inner[1]]):
        raise dec.error("'tensor.attrs' must hold the first use of its tensor (later uses are plain 'tensor' "
                        "nodes)")
    if tree.tag_of(attrs_node) != "dict" or len(attrs_node) < 3:
        raise dec.error("the attributes of a tensor must be a non-empty 'dict' node")
    # One object per node (§6.12): a sparse or nested node decodes to the object of an earlier equal
    # node with equal attributes, never to one with other attributes (or none), so the key of its
    # object is the node and its attributes (_dec_sparse, _dec_nested read them here).
    keyed = dec.build_objects and tag in ("sparse", "nested")
    seen = False
    if keyed:
        around = _frozen(attrs_node)
        seen = (_frozen(inner), around) in _memo(dec)
        setattr(dec, _ATTRS, around)
    try:
        value = dec.decode(inner, depth)
    finally:
        if keyed:
            setattr(dec, _ATTRS, None)
    attrs = dec.decode(attrs_node, depth)
    if not all(type(k) is str for k in attrs_node[1::2]):
        raise dec.error("the attribute names of a tensor must be str")
    if not dec.build_objects:
        return None
    if not seen:  # (an object met again has them already: the first occurrence's values are kept)
        value.__dict__.update(attrs)
    return value


TAGS = ("sparse", "nested", "meta")


def row_of(node: Sequence[Any], table: Sequence[Any]) -> dict:
    """What ``inspect`` shows for a checked ``sparse``, ``nested`` or ``meta`` node (without torch): its
    type, and its dtype and shape as the value (its parts, which hold the bytes, are rows of their
    own); ``table`` gives the parts' rows (their ``dtype.name``)."""
    tag = node[0]
    if tag == "sparse":
        values = node[4 + len(LAYOUTS[node[1]])]  # (an uncoalesced COO node ends with false)
        return {"type": f"sparse_{node[1]} {node[3]}{'' if values is node[-1] else ' (uncoalesced)'}",
                "value": f"{table[values[1]].dtype.name}{list(node[2][1:])}"}
    if tag == "meta":
        return {"type": f"meta {node[3]}", "value": f"{node[1]}{list(node[2][1:])}, no data"}
    return {"type": f"nested {node[1]} tensor",
            "value": f"{node[2]}, {len(node) - 4} elements" if node[1] == "strided" else node[2]}


# --------------------------------------------------------------------------- registration

tree.register_kind("sparse", _dec_sparse)
tree.register_kind("nested", _dec_nested)
tree.register_kind("meta", _dec_meta)
tree.register_kind("tensor.attrs", _dec_attrs)
tree.set_tensor_hook(encode_special)
