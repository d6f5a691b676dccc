"""Evidence for a divergence: the actual tensors of one op or module call, saved in both runs.

``diverge`` names the first differing record; rerunning both runs with that record's call as
``capture`` (``tensorcanon.trace(..., capture=SPEC)`` or ``TENSORCANON_TRACE_CAPTURE=SPEC``) saves
the call's inputs, outputs and (ops) arguments that are not tensors to ``TRACE.capture.safetensors``
(a tensorcanon file). With both captures beside the traces, ``diverge`` reports per tensor how many
elements differ, the largest absolute difference, the largest distance in units in the last place
(ULP) and the first differing index, and the arguments of both.

A SPEC is ``step|kind|scope|name|call``, e.g. ``7|op|layers.3.noise|aten.rand.generator|0``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..format import optional
from ..format.errors import UsageError
from .summary import max_ulp

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())

ENV = "TENSORCANON_TRACE_CAPTURE"
SUFFIX = ".capture.safetensors"


def spec_of(record: dict[str, Any]) -> str:
    """The capture SPEC of a record's call (its identity without phase and role)."""
    return f"{record['step']}|{record['kind']}|{record['scope']}|{record['name']}|{record['call']}"


def parse(spec: str) -> tuple[int, str, str, str, int]:
    parts = spec.split("|")
    if len(parts) != 5 or not parts[0].isdigit() or not parts[4].isdigit() or parts[1] not in ("op", "module"):
        raise UsageError(f"capture {spec!r} is not step|kind|scope|name|call with kind op or module "
                         "(e.g. 7|op|layers.3.noise|aten.rand.generator|0; `tensorcanon diverge` prints it)")
    return int(parts[0]), parts[1], parts[2], parts[3], int(parts[4])


def capture_path(trace_path: str) -> str:
    return trace_path + SUFFIX


def save(trace_path: str, spec: str, tensors: dict[str, Any], texts: dict[str, str]) -> None:
    from .. import api

    api.save({"spec": spec, "tensors": tensors, "texts": texts}, capture_path(trace_path))


def compare_tensors(a: Any, b: Any) -> dict[str, Any]:
    """How two captured tensors differ: elements, max abs difference, max ULP distance, first index."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"differs": f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"}
    x, y = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if x.dtype.is_floating_point and x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        xb, yb = x.view(ints).numpy().reshape(-1), y.view(ints).numpy().reshape(-1)
        diff = xb != yb
        n = int(diff.sum())
        out: dict[str, Any] = {"elements": x.numel(), "differ": n}
        if n:
            xf, yf = x.double().numpy().reshape(-1), y.double().numpy().reshape(-1)
            with np.errstate(invalid="ignore"):
                out["max_abs_diff"] = float(np.nanmax(np.abs(xf[diff] - yf[diff]))) if n else 0.0
            out["max_ulp"] = max_ulp(xf[diff], yf[diff], str(x.dtype).removeprefix("torch."))  # (summary.py)
            first = int(np.argmax(diff))
            out["first_index"] = [int(i) for i in np.unravel_index(first, tuple(x.shape))] if x.dim() else []
            out["first_values"] = [float(xf[first]), float(yf[first])]
        return out
    equal = torch.eq(x, y) if x.dtype != torch.bool else ~(x ^ y)
    n = int((~equal).sum())
    out = {"elements": x.numel(), "differ": n}
    if n:
        flat = (~equal).reshape(-1).nonzero()[0, 0].item()
        out["first_index"] = [int(i) for i in np.unravel_index(int(flat), tuple(x.shape))] if x.dim() else []
    return out


def evidence(a_trace: str, b_trace: str, first: dict[str, Any]) -> dict[str, Any] | None:
    """What the captures beside both traces say about the record ``first``, or None when there are
    none of that call."""
    pa, pb = capture_path(a_trace), capture_path(b_trace)
    if not (os.path.exists(pa) and os.path.exists(pb)):
        return None
    from .. import api

    ca, cb = api.load(pa), api.load(pb)
    want = spec_of(first)
    if ca.get("spec") != want or cb.get("spec") != want:
        return {"note": f"the captures beside the traces are of {ca.get('spec')!r} and {cb.get('spec')!r}, "
                        f"not of {want!r}"}
    out: dict[str, Any] = {}
    for role in sorted(set(ca["tensors"]) | set(cb["tensors"])):
        if role in ca["tensors"] and role in cb["tensors"]:
            out[role] = compare_tensors(ca["tensors"][role], cb["tensors"][role])
        else:
            out[role] = {"differs": "captured in one run only"}
    for role in sorted(set(ca["texts"]) | set(cb["texts"])):
        out[role] = {"A": ca["texts"].get(role), "B": cb["texts"].get(role)}
    return out
