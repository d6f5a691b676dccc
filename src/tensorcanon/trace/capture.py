"""Evidence for a divergence: the actual tensors of one op or module call, saved in both runs.

``diverge`` names the first differing record; rerunning both runs with that record's call as
``capture`` (``tensorcanon.trace(..., capture=SPEC)`` or ``TENSORCANON_TRACE_CAPTURE=SPEC``) saves
the call's inputs, outputs and (ops) arguments that are not tensors to ``TRACE.capture.safetensors``
(a tensorcanon file). With both captures beside the traces, ``diverge`` reports per tensor how many
elements differ, the largest absolute difference, the largest distance in units in the last place
(ULP) and the first differing index, and the arguments of both.

A SPEC is ``step|kind|scope|name|call``, e.g. ``7|op|layers.3.noise|aten.rand.generator|0``; in
``scope`` and ``name`` a ``|`` is written ``\\|`` and a backslash ``\\\\`` (:func:`format_spec`,
:func:`parse`: one rule, round-tripped by the tests). ``step`` and ``call`` are decimal integers in
[0, 2^63), at most 19 digits, checked before they are converted.

A capture file beside a trace is input like any file (docs/SECURITY.md): it is opened through the
regular-file guard (io/regular.py), must hold exactly what :func:`save` writes (anything else is
reported as a note that names the file, never quoting its bytes), and is compared without
allocating anything its bytes do not hold: a meta tensor's claimed shape is compared, never
materialized; sparse and nested tensors are compared part by part, never densified; dense ones
in chunks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..format import optional
from ..format.errors import TensorCanonError, UsageError
from . import values as _values
from .layout import MAX_TEXT
from .summary import max_ulp as ulp_distance

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())

ENV = "TENSORCANON_TRACE_CAPTURE"
SUFFIX = ".capture.safetensors"
KINDS = ("op", "module")
MAX_INDEX_DIGITS = 19
"""``step`` and ``call`` of a spec: at most this many decimal digits (2^63 has 19), checked
before ``int()`` converts them."""
MAX_SPEC = 4 * MAX_TEXT + 64
"""The longest spec accepted, in characters (a scope and a name of MAX_TEXT characters, every
one escaped)."""
MAX_ROLES = 2 * _values.MAX_LEAVES + 1
"""Roles one capture may hold: a call's inputs and outputs (MAX_LEAVES each) and its arguments."""
MAX_ROLE = MAX_TEXT
CHUNK = 1 << 20
"""Elements compared at a time: the comparison's memory beyond the two tensors is a few chunks."""


# --------------------------------------------------------------------------- the spec


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|")


def format_spec(step: int, kind: str, scope: str, name: str, call: int) -> str:
    """The SPEC of one call: ``step|kind|scope|name|call``, ``|`` and ``\\`` in scope and name
    escaped with a backslash. :func:`parse` reads it back."""
    return f"{step}|{kind}|{_escape(scope)}|{_escape(name)}|{call}"


def spec_of(record: dict[str, Any]) -> str:
    """The capture SPEC of a record's call (its identity without phase and role)."""
    return format_spec(record["step"], record["kind"], record["scope"], record["name"], record["call"])


def _split(spec: str) -> list[str] | None:
    """The fields of ``spec`` split at unescaped ``|``, unescaped; None for a backslash that does
    not escape ``|`` or ``\\``."""
    fields, cur, i, n = [], [], 0, len(spec)
    while i < n:
        c = spec[i]
        if c == "\\":
            if i + 1 >= n or spec[i + 1] not in "\\|":
                return None
            cur.append(spec[i + 1])
            i += 2
            continue
        if c == "|":
            fields.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    fields.append("".join(cur))
    return fields


def _index(text: str) -> int | None:
    """A spec's step or call: ASCII digits, at most MAX_INDEX_DIGITS of them, below 2^63."""
    if not (text and text.isascii() and text.isdigit() and len(text) <= MAX_INDEX_DIGITS):
        return None
    v = int(text)
    return v if v < 1 << 63 else None


def _problem(spec: Any) -> tuple[str, tuple[int, str, str, str, int] | None]:
    if type(spec) is not str:
        return f"a {type(spec).__name__}, not a text", None
    if len(spec) > MAX_SPEC:
        return f"{len(spec)} characters long, more than the {MAX_SPEC} a spec may have", None
    parts = _split(spec)
    if parts is None:
        return "a backslash that escapes neither | nor \\ (write a | in a name as \\| and a backslash as \\\\)", None
    if len(parts) != 5:
        return f"{len(parts)} fields, not 5 (a | inside a module or op name is written \\|)", None
    step, call = _index(parts[0]), _index(parts[4])
    if step is None or call is None:
        return (f"its step and call must be whole numbers in [0, 2^63), of at most {MAX_INDEX_DIGITS} "
                "digits"), None
    if parts[1] not in KINDS:
        return "its kind must be op or module", None
    if len(parts[2]) > MAX_TEXT or len(parts[3]) > MAX_TEXT:
        return f"its scope and name must be at most {MAX_TEXT} characters", None
    return "", (step, parts[1], parts[2], parts[3], call)


def parse(spec: str) -> tuple[int, str, str, str, int]:
    """``(step, kind, scope, name, call)`` of a SPEC, or :class:`UsageError` saying what is wrong."""
    why, got = _problem(spec)
    if got is None:
        shown = repr(spec[:200]) + ("..." if len(spec) > 200 else "") if type(spec) is str else type(spec).__name__
        raise UsageError(f"capture {shown} is not step|kind|scope|name|call with kind op or module: {why} "
                         "(e.g. 7|op|layers.3.noise|aten.rand.generator|0; `tensorcanon diverge` prints it)")
    return got


def capture_path(trace_path: str) -> str:
    return trace_path + SUFFIX


# --------------------------------------------------------------------------- recording


def _not_captured(value: Any, why: str) -> str:
    return f"not captured: {type(value).__name__} {str(getattr(value, 'dtype', '')).removeprefix('torch.')}" \
           f"{list(getattr(value, 'shape', []))}: {why}"[:MAX_TEXT]


def kept(value: Any) -> Any:
    """What a capture keeps of tensor ``value``: a CPU copy (an in-place op may change it the next
    moment) of every kind the format holds (dense, sparse, nested), a meta tensor as itself (it
    has no values to copy), and for anything else a text saying what it was and why it was not
    kept (a tensor subclass, a quantized tensor, a dtype the format lacks): a capture never
    stops the run it records."""
    from ..format import dtypes

    if type(value) not in (torch.Tensor, torch.nn.Parameter) and not getattr(value, "is_nested", False):
        return _not_captured(value, f"a tensor subclass ({type(value).__module__}.{type(value).__qualname__})")
    try:
        if value.is_quantized:
            return _not_captured(value, "a quantized tensor")
        if value.dtype not in dtypes.BY_TORCH:
            return _not_captured(value, "a dtype the format does not hold")
        if value.is_meta:
            return value.detach()
        return value.detach().to("cpu", copy=True)
    except Exception as e:  # noqa: BLE001 (a kind torch cannot copy: say so in the capture, go on)
        return _not_captured(value, f"{type(e).__name__}: {str(e)[:200]}")


def save(trace_path: str, spec: str, tensors: dict[str, Any], texts: dict[str, str]) -> None:
    """Write a capture (``{"spec", "tensors", "texts"}``) beside the trace. A tensor the format
    refuses after all is saved as a text saying why, so the capture is still written."""
    from .. import api

    path = capture_path(trace_path)
    spec = format_spec(*parse(spec))
    try:
        api.save({"spec": spec, "tensors": tensors, "texts": texts}, path)
    except TensorCanonError as e:
        if not tensors or isinstance(e, OSError):  # (a file that cannot be written: say so)
            raise
        why = f"the capture could not hold it: {str(e)[:300]}"
        api.save({"spec": spec, "tensors": {},
                  "texts": {**{r: _not_captured(t, why) for r, t in tensors.items()}, **texts}}, path)


# --------------------------------------------------------------------------- reading


def _open_capture(path: str) -> tuple[Any, str]:
    """The capture at ``path`` loaded, or ``(None, why)``: read through the regular-file guard,
    the bytes checked to start like a tensorcanon file before the reader sees them (so no message
    quotes the bytes of some other file), then checked to be what :func:`save` writes."""
    from .. import api
    from ..io.regular import open_fd

    try:
        fd = open_fd(path, "read", "a capture (a tensorcanon file)")
    except TensorCanonError as e:
        return None, f"cannot be read ({type(e).__name__}: it is not a regular file that can be opened)" \
            if not isinstance(e, FileNotFoundError) else "is missing"
    with open(fd, "rb", closefd=True) as fh:
        try:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(9)
            n = int.from_bytes(head[:8], "little") if len(head) == 9 else -1
            if not (2 <= n <= size - 8) or head[8:9] != b"{":
                return None, "is not a tensorcanon file (it does not start with a safetensors header)"
            fh.seek(0)
            obj = api.load(fh, map_location="cpu")
        except TensorCanonError as e:
            return None, f"is not a capture tensorcanon can read ({type(e).__name__}: {str(e)[:300]})"
        except OSError as e:
            return None, f"cannot be read ({e.strerror or type(e).__name__})"
    why = _capture_problem(obj)
    return (None, why) if why else (obj, "")


def _plain_tensor(v: Any) -> bool:
    """A tensor of a kind :func:`kept` keeps: torch's own (dense, sparse, nested, meta), never a
    subclass (whose code would run on the capture's values)."""
    return type(v) in (torch.Tensor, torch.nn.Parameter) or (
        isinstance(v, torch.Tensor) and getattr(v, "is_nested", False))


def _capture_problem(obj: Any) -> str:
    """Why a loaded object is not what :func:`save` writes, or ``""``."""
    if type(obj) is not dict or set(obj) != {"spec", "tensors", "texts"}:
        what = "a dict of other keys" if type(obj) is dict else f"a {type(obj).__name__}"
        return f"holds {what}, not the {{'spec', 'tensors', 'texts'}} of a capture"
    why, _ = _problem(obj["spec"])
    if why:
        return f"holds a spec that is not one ({why})"
    for key, label in (("tensors", "a tensor"), ("texts", "a text")):
        d = obj[key]
        if type(d) is not dict:
            return f"holds a {type(d).__name__} as its {key!r}, not a dict of roles"
        if len(d) > MAX_ROLES:
            return f"holds {len(d)} {key}, more than the {MAX_ROLES} of one call"
        for role, v in d.items():
            if type(role) is not str or len(role) > MAX_ROLE:
                return f"holds a role in {key!r} that is not a text of at most {MAX_ROLE} characters"
            if not (_plain_tensor(v) if key == "tensors" else type(v) is str):
                return f"holds a {type(v).__module__}.{type(v).__name__} as {key} role {role[:80]!r}, not {label}"
    return ""


def _shown(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"... ({len(text)} characters)"


def evidence(a_trace: str, b_trace: str, first: dict[str, Any]) -> dict[str, Any] | None:
    """What the captures beside both traces say about the record ``first``, or None when there are
    none of that call. A capture that cannot be read, or is not one, is a note naming it (the
    traces' comparison stands without it)."""
    pa, pb = capture_path(a_trace), capture_path(b_trace)
    if not (os.path.lexists(pa) and os.path.lexists(pb)):
        return None
    (ca, why_a), (cb, why_b) = _open_capture(pa), _open_capture(pb)
    if ca is None or cb is None:
        return {"note": "; ".join(f"the capture {p} {w}" for p, w in ((pa, why_a), (pb, why_b)) if w)}
    want = spec_of(first)
    if ca["spec"] != want or cb["spec"] != want:
        return {"note": f"the captures beside the traces are of {ca['spec'][:300]!r} and {cb['spec'][:300]!r}, "
                        f"not of {want[:300]!r}"}
    out: dict[str, Any] = {}
    ta, tb, xa, xb = ca["tensors"], cb["tensors"], ca["texts"], cb["texts"]
    for role in sorted(set(ta) | set(tb) | set(xa) | set(xb)):
        if role in ta and role in tb:
            out[role] = compare_tensors(ta[role], tb[role])
        elif role in xa and role in xb:
            out[role] = {"A": _shown(xa[role]), "B": _shown(xb[role])}
        elif (role in ta or role in xa) and (role in tb or role in xb):
            out[role] = {"differs": f"a {'tensor' if role in ta else 'text'} in A, a "
                                    f"{'tensor' if role in tb else 'text'} in B",
                         **{s: _shown(x[role]) for s, x in (("A", xa), ("B", xb)) if role in x}}
        else:
            out[role] = {"differs": "captured in one run only"}
    return out


# --------------------------------------------------------------------------- comparing


def _kind(t: Any) -> str:
    if t.is_meta:
        return "meta"
    if getattr(t, "is_nested", False):
        return "nested jagged" if t.layout == torch.jagged else "nested strided"
    if t.layout != torch.strided:
        return str(t.layout).removeprefix("torch.")
    return "strided"


def compare_tensors(a: Any, b: Any) -> dict[str, Any]:
    """How two captured tensors differ: for dense tensors the elements, how many differ (by their
    bits), the largest absolute difference, the largest ULP distance (float16, bfloat16, float32,
    float64) and the first differing index and values; sparse and nested tensors part by part;
    meta tensors by dtype and shape (they hold no values)."""
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        return {"differs": f"a {ka} tensor in A, a {kb} tensor in B"}
    if a.dtype != b.dtype:
        return {"differs": f"{_dt(a)} vs {_dt(b)}"}
    if ka == "nested strided":
        return _nested_strided(a, b)
    if ka == "nested jagged":
        if a.dim() != b.dim():
            return {"differs": f"{_dt(a)} of {a.dim()} dimensions vs {b.dim()}"}
        return {"layout": "jagged", "values": compare_tensors(a.values(), b.values()),
                "offsets": compare_tensors(a.offsets(), b.offsets())}
    if a.shape != b.shape:
        return {"differs": f"{_dt(a)}{list(a.shape)} vs {_dt(b)}{list(b.shape)}"}
    if ka == "meta":
        return {"layout": "meta", "elements": _numel(a.shape),
                "note": "meta tensors hold no values: their dtype and shape are equal"}
    if ka != "strided":
        return _sparse(ka, a, b)
    return _dense(a, b)


def _dt(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_SPARSE_PARTS = {"sparse_coo": ("indices", "values"), "sparse_csr": ("crow_indices", "col_indices", "values"),
                 "sparse_csc": ("ccol_indices", "row_indices", "values"),
                 "sparse_bsr": ("crow_indices", "col_indices", "values"),
                 "sparse_bsc": ("ccol_indices", "row_indices", "values")}


def _part(t: Any, name: str) -> Any:
    if t.layout == torch.sparse_coo:  # as stored, coalesced or not
        return t._indices() if name == "indices" else t._values()
    return getattr(t, name)()


def _sparse(kind: str, a: Any, b: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": kind}
    for name in _SPARSE_PARTS.get(kind, ()):
        pa, pb = _part(a, name), _part(b, name)
        out[name] = compare_tensors(pa, pb)
    if len(out) == 1:
        out["differs"] = f"a {kind} tensor, which tensorcanon cannot take apart to compare"
    return out


def _nested_strided(a: Any, b: Any) -> dict[str, Any]:
    xs, ys = a.unbind(), b.unbind()
    if len(xs) != len(ys):
        return {"differs": f"a nested tensor of {len(xs)} components in A, {len(ys)} in B"}
    out: dict[str, Any] = {"layout": "nested strided", "components": len(xs), "differ": 0}
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        c = compare_tensors(x, y)
        if c.get("differ", 0) or "differs" in c:
            out["differ"] += 1
            if "first_component" not in out:
                out["first_component"], out["first"] = i, c
    return out


_ULP = ("float16", "bfloat16", "float32", "float64")


def _as_float64(raw: np.ndarray, name: str, dtype: Any) -> np.ndarray | None:
    """The values of ``raw`` (the little-endian bytes of elements of ``name``, one row each) as
    float64 (complex: their absolute values are not taken here; complex128 for those), or None
    where no exact conversion is at hand."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if name == "bfloat16":
        return (flat.view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
    if name in ("float16", "float32", "float64"):
        return flat.view({"float16": "<f2", "float32": "<f4", "float64": "<f8"}[name]).astype(np.float64)
    if name in ("complex64", "complex128"):
        return flat.view("<c8" if name == "complex64" else "<c16").astype(np.complex128)
    if name.startswith("float8") or name == "complex32":
        try:
            t = torch.from_numpy(flat.copy()).view(dtype)
            t = t.to(torch.complex64) if name == "complex32" else t.to(torch.float64)
            return t.numpy().astype(np.complex128 if name == "complex32" else np.float64)
        except Exception:  # noqa: BLE001 (a conversion this torch lacks: no difference in values)
            return None
    return None


def _scalar(v: Any) -> Any:
    if isinstance(v, (complex, np.complexfloating)):
        return str(complex(v))
    return v.item() if hasattr(v, "item") else v


def _index_of(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for d in reversed(shape):
        flat, r = divmod(flat, d)
        out.append(r)
    return out[::-1]


def _dense(a: Any, b: Any) -> dict[str, Any]:
    from ..format.dtypes import BY_TORCH
    from ..format.tensorbytes import host_bytes

    row = BY_TORCH[a.dtype]
    name, size = row.name, row.itemsize
    n = a.numel()
    ba = np.frombuffer(host_bytes(a.detach(), "tensor"), dtype=np.uint8)
    bb = np.frombuffer(host_bytes(b.detach(), "tensor"), dtype=np.uint8)
    if ba.size != n * size or bb.size != ba.size:  # sub-byte types: their bytes, one element each
        n, size, name = ba.size, 1, "bytes"
    out: dict[str, Any] = {"elements": a.numel(), "differ": 0}
    differ, first, max_abs, max_ulp = 0, -1, None, None
    first_values: list[Any] = []
    for start in range(0, n, CHUNK):
        k = min(CHUNK, n - start)
        ra = ba[start * size:(start + k) * size].reshape(k, size)
        rb = bb[start * size:(start + k) * size].reshape(k, size)
        diff = (ra != rb).any(axis=1)
        m = int(diff.sum())
        if not m:
            continue
        differ += m
        fa, fb = ra[diff], rb[diff]
        va, vb = _as_float64(fa, name, a.dtype), _as_float64(fb, name, a.dtype)
        if va is not None and vb is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(va - vb)
            d = d[~np.isnan(d)]
            if d.size:
                max_abs = max(float(d.max()), max_abs or 0.0)
        if name in _ULP and va is not None and vb is not None:  # (ULPs of the larger magnitude: summary.max_ulp)
            u = ulp_distance(va, vb, name)
            max_ulp = u if max_ulp is None else max(max_ulp, u)
        if first < 0:
            j = int(np.argmax(diff))
            first = start + j
            first_values = [_value(ra[j:j + 1], name, a.dtype, row), _value(rb[j:j + 1], name, a.dtype, row)]
    out["differ"] = differ
    if differ:
        if max_abs is not None or name in _ULP:
            out["max_abs_diff"] = max_abs if max_abs is not None else float("nan")
        if max_ulp is not None:
            out["max_ulp"] = max_ulp
        out["first_index"] = _index_of(first, tuple(a.shape)) if name != "bytes" else [first]
        out["first_values"] = first_values
    return out


def _value(raw: np.ndarray, name: str, dtype: Any, row: Any) -> Any:
    """One element's value (from its bytes), for people and JSON."""
    f = _as_float64(raw, name, dtype)
    if f is not None:
        return _scalar(f[0])
    if name != "bytes" and row.has_numpy:
        return _scalar(np.ascontiguousarray(raw).reshape(-1).view(row.numpy)[0])
    return "0x" + bytes(np.ascontiguousarray(raw).reshape(-1)).hex()
