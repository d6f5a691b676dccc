"""The first divergence between two traces (``tensorcanon.first_divergence``, ``tensorcanon diverge``).

Both traces are read as streams, record by record, in lockstep: memory stays bounded whatever
their length. Records are compared by identity (step, phase, kind, scope, name, call, role) and
content (dtype, shape, digest; with a tolerance, the relative difference of the L2 norms of float
records). Traces of different levels are compared on the kinds both recorded. After the first
divergence the walk goes on, to count what differs later; where the two runs recorded different
things, it skips to the next step of both.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..format.errors import UsageError
from ..format.text import printable
from . import capture, layout
from .layout import Record

EQUAL = "inputs equal, output differs"
INPUTS = "inputs already differ"
PATHS = "the runs recorded different things"
ENDS = "one trace ends first"
COLLECTIVE = "it came through a collective, from another rank"

_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                     "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz"})
GRID_STEPS = 400
GRID_COLUMNS = 200

_COLUMN = {"batch": "data", "rng": "random state", "loss": "loss", "param": "parameters",
           "optim": "optimizer state", "grad": "gradients"}


def column(r: Record) -> str:
    """The grid column of a record: its module (an op's module), or what it is."""
    if r.kind == "module":
        return r.name or "(model)"
    if r.kind == "op":
        return r.scope or ("(backward ops)" if r.phase == "backward" else "(outside modules)")
    return _COLUMN[r.kind]


def distance(a: Record, b: Record) -> float:
    """0 for equal records (equal dtype, shape and digest); else the relative difference of their
    L2 norms, |‖a‖ − ‖b‖| / max(‖a‖, ‖b‖), and a tiny positive number where the norms are equal but
    the bits are not. inf where no norm can tell how far apart they are: another dtype or shape, a
    record that is not a float, or a sum of squares that is not finite in either (a NaN, an inf, or
    squares that overflowed float64): those records are compared by digest alone, and theirs differ.
    So a tolerance (a finite number) never passes a record whose digest differs unless both sums of
    squares are finite and within it."""
    if a.digest == b.digest and a.dtype == b.dtype and a.shape == b.shape:
        return 0.0
    if a.dtype != b.dtype or a.shape != b.shape or a.dtype not in _FLOATS:
        return math.inf
    return _norm_distance(a.sumsq, b.sumsq)


def _norm_distance(sa: float, sb: float) -> float:
    """The distance of two float records whose digests differ, from their sums of squares ``sa``,
    ``sb`` (docs/TRACE.md "Comparing": a non-finite one is no measure, the records differ)."""
    if not (math.isfinite(sa) and math.isfinite(sb)):
        return math.inf
    na, nb = math.sqrt(sa), math.sqrt(sb)
    top = max(na, nb)
    rel = abs(na - nb) / top if top else 0.0
    return max(rel, 1e-300)


def _tolerance(tolerance: Any) -> float | None:
    """``first_divergence``'s ``tolerance`` as a float: None, or a finite real number >= 0 (an int
    too large for a float, a bool, a text, inf or NaN is a UsageError)."""
    if tolerance is None:
        return None
    why = "a finite number >= 0"
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
        raise UsageError(f"tolerance must be {why} (the largest relative difference of L2 norms), "
                         f"not {type(tolerance).__name__} {_short(tolerance)}")
    try:
        value = float(tolerance)
    except (OverflowError, ValueError, TypeError):
        value = math.inf
    if not (value >= 0 and math.isfinite(value)):
        raise UsageError(f"tolerance must be {why} (the largest relative difference of L2 norms; 1 already "
                         f"passes every pair of finite norms), not {_short(tolerance)}")
    return value


def _short(v: Any) -> str:
    """An argument for a message, never long (an int of 400 digits) and never failing."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v).bit_length() > 64:
        return f"an int of {len(str(abs(v))) if abs(v).bit_length() < 10_000 else 'many'} digits"
    try:
        text = repr(v)
    except Exception:  # noqa: BLE001 - a user's object whose repr fails
        text = f"<{type(v).__name__}>"
    return printable(text[:80] + ("..." if len(text) > 80 else ""))


def _content(r: Record) -> dict[str, Any]:
    d: dict[str, Any] = {"dtype": r.dtype, "shape": list(r.shape), "digest": r.digest.hex(),
                         "norm": math.sqrt(r.sumsq)}
    if r.note:
        d["note"] = r.note
    return d


def identity(r: Record) -> dict[str, Any]:
    return {"step": r.step, "phase": r.phase, "kind": r.kind, "scope": r.scope, "name": r.name,
            "call": r.call, "role": r.role}


@dataclass
class Divergence:
    """What :func:`first_divergence` found. ``same`` is True when every compared record matched
    and both traces hold the same records; else ``first`` is the first record that differs (its
    identity, and its content in ``a`` and ``b``), ``verdict`` one of "inputs equal, output
    differs", "inputs already differ", "the runs recorded different things", "one trace ends
    first", ``origin`` what the difference is traced back to, ``explanation`` a sentence for people."""

    a: str
    b: str
    same: bool = True
    level: str = "steps"
    tolerance: float | None = None
    compared: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)
    matched: int = 0
    last_matched: dict[str, Any] | None = None
    first: dict[str, Any] | None = None
    verdict: str = ""
    origin: str = ""
    explanation: str = ""
    later_differing: int = 0
    later_steps: list[int] = field(default_factory=list)
    skipped: int = 0
    records: tuple[int, int] = (0, 0)
    complete: tuple[bool, bool] = (True, True)
    notes: list[str] = field(default_factory=list)
    capture: str = ""
    grid: dict[tuple[int, str], float] = field(default_factory=dict, repr=False)
    grid_records: dict[tuple[int, str], dict[str, Any]] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("grid", "grid_records")}
        out["records"], out["complete"] = list(self.records), list(self.complete)
        return _finite(out)

    def lines(self) -> list[str]:
        """The report for people: one line each, every control or format character of a name, note or
        path (read from the traces, the captures or given as a path) escaped (format/text.printable),
        so that a trace cannot move the cursor, erase a line or print a line of its own."""
        lines = []
        if self.same:
            lines.append(f"same: {self.matched} records compared, all equal "
                         f"({'bitwise' if self.tolerance is None else f'within relative {self.tolerance}'})")
        else:
            f = self.first
            assert f is not None
            what = f"{f['scope']}/{f['name']}" if f.get("scope") else f.get("name", "")
            lines.append(f"first divergence: step {f['step']}, phase {f['phase']}, {f['kind']} {what}, "
                         f"call {f['call']}, role {f['role']}")
            lines.append(f"verdict: {self.verdict} ({self.origin})")
            lines.append(f"  {self.explanation}")
            for side in ("a", "b"):
                c = f.get(side)
                if c is not None:
                    note = f" {c['note']!r}" if "note" in c else ""
                    lines.append(f"  {side.upper()}: {c['dtype']}{c['shape']} digest {c['digest'][:16]}... "
                                 f"norm {c['norm']}{note}")
            if "evidence" in f:
                for k, v in f["evidence"].items():
                    lines.append(f"  evidence: {k}: {v}")
            elif self.capture:
                lines.append(f"  to see the tensors: rerun both runs with {capture.ENV}={_shell(self.capture)} (or "
                             "tensorcanon.trace(..., capture=...)), then diverge again")
            before = (f"everything before it matched: {self.matched} records"
                      + (f", up to {_where(self.last_matched)}" if self.last_matched else ""))
            lines.append(before)
            if self.later_differing:
                steps = ", ".join(map(str, self.later_steps[:10])) + (" ..." if len(self.later_steps) > 10 else "")
                lines.append(f"after it: {self.later_differing} more records differ, in steps {steps}")
            if self.skipped:
                lines.append(f"not aligned: {self.skipped} records where the runs recorded different things "
                             "(skipped to the next step of both)")
        lines.append(f"compared: {', '.join(self.compared)} (level {self.level})")
        if self.not_compared:
            lines.append(f"not compared: {'; '.join(self.not_compared)}")
        lines.extend(f"note: {n}" for n in self.notes)
        return [printable(line) for line in lines]  # names, notes and paths come from files: escaped


def _shell(text: str) -> str:
    """``text`` quoted for a POSIX shell, always in quotes (a spec holds ``|``): names from a trace
    with a quote in them cannot end the quoting of a line the reader pastes into a shell."""
    import shlex

    quoted = shlex.quote(text)
    return quoted if quoted.startswith("'") else f"'{quoted}'"


def _finite(v: Any) -> Any:
    """``v`` with every float that JSON cannot hold (inf, nan) as its text."""
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _where(d: dict[str, Any] | None) -> str:
    if not d:
        return ""
    what = f"{d['scope']}/{d['name']}" if d["scope"] else d["name"]
    return f"step {d['step']} {d['phase']} {d['kind']} {what} call {d['call']} {d['role']}"


def _verdict(r: Record, before_in_group: bool, levels: str, every: int = 1) -> tuple[str, str, str]:
    """(verdict, origin, explanation) for the first record that differs, ``r``; every record before
    it matched (``before_in_group``: some of the same op's or module's call among them)."""
    if r.kind == "batch":
        return INPUTS, "data", (f"the batch of step {r.step} differs ({r.role}) while every record before it "
                                "matched: the data order or the data itself differs (a sampler or a data "
                                "random state not restored on resume, augmentation drawing from an unseeded "
                                "or unrestored generator, workers seeded differently)")
    if r.kind == "rng":
        return INPUTS, "random state", (f"the {r.name} random state at the start of step {r.step} differs while "
                                        "everything before it matched: a random state not restored (on resume) "
                                        "or seeded differently")
    if r.kind in ("op", "module") and r.role.startswith("in"):
        return INPUTS, "an input not recorded before (a parameter, a buffer, state from outside the step)", (
            f"an input of {r.kind} {r.name} differs although every record before it matched: it was made "
            "outside what the trace recorded, e.g. parameters or buffers loaded or changed between steps")
    if r.kind in ("op", "module") and r.role == "args":
        return INPUTS, "the op's arguments that are not tensors", (
            f"{r.name} was called with other arguments (not tensors): {r.note!r} in A")
    if r.kind == "op":
        return EQUAL, f"op {r.name}", (
            f"{r.name} gave other bits from equal inputs"
            f"{' (it has no tensor inputs: a random draw?)' if not before_in_group else ''}: it is not "
            "deterministic here (a nondeterministic kernel, another thread count, library or machine, or a "
            "random generator the trace does not record)")
    if r.kind == "module":
        return EQUAL, f"module {r.name or '(model)'}", (
            f"module {r.name or '(model)'} gave another output from equal inputs (its parameters matched after "
            "the previous optimizer step): something inside it is not deterministic here" + _finer(levels, "the op"))
    if r.kind == "loss":
        return EQUAL, "the forward pass", ("the loss differs while the batch, the random state and the "
                                           "parameters matched: the forward pass is not deterministic here"
                                           + _finer(levels, "where"))
    if r.kind == "grad":
        return EQUAL, "the backward pass", ("a gradient differs while the forward pass matched: the backward "
                                            "pass is not deterministic here" + _finer(levels, "the op"))
    what = "parameters" if r.kind == "param" else "optimizer state"
    return EQUAL, f"the optimizer step ({what})", (
        f"the {what} after the optimizer step of step {r.step} differ ({r.name} {r.role}) while everything "
        "recorded before matched: the optimizer's own state before the step differs (not restored on "
        "resume?) or its update is not deterministic"
        + (" (or the backward pass: gradients are recorded from level modules on"
           f"{_finer(levels, 'which')})" if levels == "steps" else "") + _window(r, every))


def _window(r: Record, every: int) -> str:
    """Where the optimizer state is recorded every ``every`` > 1 steps (the steps both traces
    recorded it): the window of steps in which it may first have differed, unseen, for a record
    of the parameters (``param``) or of the optimizer state (``optim``) of step ``r.step``."""
    if every <= 1 or r.kind not in ("param", "optim"):
        return ""
    last = ((r.step + 1) // every) * every - 1  # the last step at or before r.step whose state is recorded
    if last >= r.step:
        last -= every  # (this step's state is recorded after its parameters: not compared yet)
    since = f"after step {last}" if last >= 0 else "never before (it is first recorded after step " \
        f"{every - 1})"
    window = f"steps {last + 1} to {r.step}" if r.step > last + 1 else f"step {r.step}"
    if r.kind == "optim":
        return (f"; the optimizer state is compared every {every} steps, last {since}, and the parameters after "
                f"every step matched: the state first differed in the window of {window}, without changing the "
                "parameters before this record")
    return (f"; the optimizer state is compared every {every} steps, last {since}: it may have differed since, "
            f"unseen, in the window of {window}")


def _finer(level: str, what: str) -> str:
    """The advice to trace at a finer level than ``level`` (the level the traces were compared at)
    to name ``what``: the levels finer than it, none at level ops (there is none finer)."""
    finer = layout.LEVELS[layout.LEVELS.index(level) + 1:]
    if not finer:
        return ""
    return f"; trace at level {' or '.join(finer)} to name {what}"


_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
"""The namespaces of torch.distributed's ops (as trace/ops.py records them)."""


def collective_verdict(res: Divergence, ha: layout.Header, hb: layout.Header) -> tuple[str, str, str] | None:
    """(verdict, origin, explanation) when the first difference of ``res`` entered this rank through a
    collective, else None: the output of a collective op (level ops) whose inputs on this rank
    matched; or, in traces of one rank of several, a gradient (level modules) or the parameters or
    optimizer state after an optimizer step (level steps) while the step's batch, random state and
    forward pass matched: under DDP or FSDP the gradients are reduced across the ranks first."""
    f = res.first
    if f is None or "a" not in f or "b" not in f or res.verdict == PATHS:
        return None
    kind, name, role = f.get("kind"), f.get("name", ""), f.get("role", "")
    world = max(ha.world_size, hb.world_size)
    others = _other_ranks(res.a, res.b, ha, hb)
    if kind == "op" and name.split(".")[0] in _COLLECTIVES and role.startswith("out"):
        return COLLECTIVE, f"collective {name}", (
            f"every record before it matched, this rank's inputs of {name} among them, and its output "
            f"differs: the difference came from another rank through {name} (another batch or another state "
            f"there, or a step that differs on that rank); {others}")
    if world <= 1 or kind not in ("grad", "param", "optim") or min(ha.world_size, hb.world_size) <= 1:
        return None
    if kind == "grad":
        what, then = "a gradient differs while this rank's forward pass matched", "this rank's backward pass differs"
    else:
        what = (f"the {'parameters' if kind == 'param' else 'optimizer state'} after the optimizer step of step "
                f"{f['step']} differ ({name} {role}) while this rank's batch, random state and loss matched")
        then = "this rank's backward pass or optimizer step differs (or its optimizer state was not restored)"
    origin = f"the gradients' collective across the {world} ranks (DDP's all-reduce, FSDP's reduce-scatter)"
    return COLLECTIVE, origin, (
        f"{what}: with {world} ranks the gradients are reduced across them (DDP's all-reduce, FSDP's "
        f"reduce-scatter) before the optimizer uses them, so the difference most likely came from another "
        f"rank; {others}; if the other ranks' traces match up to this step, {then} on its own: trace at level "
        "ops to name the op or the collective")


def _other_ranks(a: str, b: str, ha: layout.Header, hb: layout.Header) -> str:
    """What to run next: ``tensorcanon diverge`` on the traces of another rank of the same runs
    (their names guessed from the recorder's: ``run.rank0.trace`` -> ``run.rank1.trace``). Only for
    two traces of one rank of one world size: for any other pair, rewriting each path by its own rank
    named a trace of the pair again (A rank 0, B rank 1: ``b.rank1.trace`` is B) or ranks one run never
    had (``a.rank2.trace`` of a world of 2)."""
    world = max(ha.world_size, hb.world_size)
    if ha.world_size != hb.world_size:
        return (f"but A is rank {ha.rank} of {ha.world_size} and B rank {hb.rank} of {hb.world_size}: runs of "
                "different world sizes split their data and reduce their gradients differently, so no rank's "
                "traces of the two are expected to match; compare the traces of one rank of two runs of the "
                "same world size")
    if ha.rank != hb.rank:
        return (f"but these are the traces of different ranks (A rank {ha.rank}, B rank {hb.rank} of {world}), "
                "each fed its own batch: compare the traces of one rank of the two runs (run A's and run B's "
                f"traces of rank {ha.rank}, then those of each other rank)")
    if world <= 1:
        return ("compare the other ranks' traces (these say world size 1: each rank writes a trace of its own "
                "when told its rank, by rank= and world_size= or $RANK and $WORLD_SIZE)")
    other = next(r for r in range(world) if r != ha.rank)
    pa, pb = _rank_sibling(a, ha.rank, other), _rank_sibling(b, hb.rank, other)
    more = f" (and each rank up to {world - 1})" if world > 2 else ""
    if pa is None or pb is None:
        return (f"compare the other ranks' traces: `tensorcanon diverge` on the two runs' traces of rank "
                f"{other}{more}")
    return f"compare the other ranks' traces: tensorcanon diverge {shlex.quote(pa)} {shlex.quote(pb)}{more}"


def _rank_sibling(path: str, rank: int, other: int) -> str | None:
    """``path`` with its rank number replaced by ``other``: in ``rank<N>`` (the recorder's names),
    else the last number of the file name that is the rank; None when it has none."""
    folder, base = os.path.split(path)
    marked = list(re.finditer(rf"rank{rank}(?!\d)", base))
    found = marked or [m for m in re.finditer(r"\d+", base) if m.group() == str(rank)]
    if not found:
        return None
    m = found[-1]
    swapped = base[:m.start()] + m.group().replace(str(rank), str(other)) + base[m.end():]
    return os.path.join(folder, swapped)


def _filtered(records: Iterator[Record], kinds: frozenset[str] | None, every: int = 1) -> Iterator[Record]:
    """The records of ``kinds`` (all: None), and of the optimizer state only those of the steps s
    with (s + 1) % ``every`` == 0 (the steps the other trace records it at)."""
    if kinds is None and every == 1:
        yield from records
        return
    for r in records:
        if (kinds is None or r.kind in kinds) and (every == 1 or r.kind != "optim" or (r.step + 1) % every == 0):
            yield r


def first_divergence(a: str | os.PathLike[str], b: str | os.PathLike[str], *, tolerance: float | None = None,
                     grid: bool = False) -> Divergence:
    """The first record where traces ``a`` and ``b`` differ, what matched before it and the verdict
    (:class:`Divergence`). ``tolerance``: compare float records by the relative difference of their
    L2 norms (a record differs when it exceeds ``tolerance``) instead of bitwise. A trace that stops
    without its end frame (a crashed run) is compared as far as it goes; a damaged trace raises
    :class:`~tensorcanon.FormatError` or :class:`~tensorcanon.IntegrityError` naming the file and
    the record. ``grid``: also keep, per (step, grid column), the largest distance (for
    ``diverge --html``; at most GRID_STEPS x GRID_COLUMNS cells)."""
    tolerance = _tolerance(tolerance)
    pa, pb = layout.trace_path(a), layout.trace_path(b)
    with layout.Reader(pa, strict=False) as ra, layout.Reader(pb, strict=False) as rb:
        ha, hb = ra.header, rb.header
        result = Divergence(pa, pb, tolerance=tolerance)
        if ha.algorithm != hb.algorithm and tolerance is None:
            raise UsageError(f"{pa} has {ha.algorithm} digests and {pb} {hb.algorithm}: their digests cannot be "
                             "compared bitwise; compare with a tolerance, or trace both with one algorithm")
        level = min(ha.level, hb.level, key=layout.LEVELS.index)
        result.level = level
        kinds = layout.kinds_of(level)
        result.compared = sorted(kinds, key=list(layout.KIND_LEVEL).index)
        for h, p in ((ha, pa), (hb, pb)):
            extra = layout.kinds_of(h.level) - kinds
            if extra:
                result.not_compared.append(f"the {', '.join(sorted(extra))} records of {p} (level {h.level}; "
                                           f"the other trace is level {level})")
        if (ha.rank, ha.world_size) != (hb.rank, hb.world_size):
            result.notes.append(f"A is rank {ha.rank} of {ha.world_size}, B rank {hb.rank} of {hb.world_size}")
        ka, kb = ha.state_every, hb.state_every
        every = ka * kb // math.gcd(ka, kb)
        if ka != kb:
            result.notes.append(f"the optimizer state is recorded every {ka} step{'s' if ka > 1 else ''} in A and "
                                f"every {kb} step{'s' if kb > 1 else ''} in B: it is compared where both recorded "
                                f"it, after steps {every - 1}, {2 * every - 1}, {3 * every - 1}, ...")
        _walk(result, _filtered(iter(ra), None if ha.level == level else kinds, kb if kb != ka else 1),
              _filtered(iter(rb), None if hb.level == level else kinds, ka if kb != ka else 1), tolerance, grid,
              every)
        through = collective_verdict(result, ha, hb)
        if through is not None:
            result.verdict, result.origin, result.explanation = through
        f = result.first
        if f is not None and f.get("kind") in ("op", "module") and "a" in f and "b" in f:
            result.capture = capture.spec_of(f)
            found = capture.evidence(pa, pb, f)
            if found is not None:
                f["evidence"] = found
        result.records = (ra.tail.records, rb.tail.records)
        result.complete = (ra.tail.complete, rb.tail.complete)
        for tail, p in ((ra.tail, pa), (rb.tail, pb)):
            if not tail.complete and tail.stopped:
                result.notes.append(f"{p} is incomplete after {tail.records} records: {tail.stopped}")
    return result


def _walk(res: Divergence, ia: Iterator[Record], ib: Iterator[Record], tolerance: float | None,
          grid: bool, every: int = 1) -> None:
    group: tuple[Any, ...] | None = None
    in_group = False
    later_steps: set[int] = set()
    x, y = next(ia, None), next(ib, None)
    while x is not None and y is not None:
        if x.identity != y.identity:
            if res.same:
                res.same = False
                res.first = {**identity(x), "a": _content(x), "b_record": identity(y), "b": _content(y)}
                res.verdict, res.origin = PATHS, "control flow"
                res.explanation = (f"A recorded {x.where()} where B recorded {y.where()}: the runs took different "
                                   "paths (another branch, another number of ops or modules, another batch size)")
            step = min(x.step, y.step)
            if grid:
                _cell(res, x, math.inf)
            while x is not None and x.step <= step:
                res.skipped += 1
                x = next(ia, None)
            while y is not None and y.step <= step:
                y = next(ib, None)
            later_steps.add(step)
            continue
        d = 0.0 if (x.digest == y.digest and x.dtype == y.dtype and x.shape == y.shape) else distance(x, y)
        differs = d > 0.0 if tolerance is None else d > tolerance
        if grid:
            _cell(res, x, d)
        key = x[:6]
        if key != group:
            group, in_group = key, False
        if differs:
            if res.same:
                res.same = False
                res.first = {**identity(x), "a": _content(x), "b": _content(y), "distance": d}
                res.verdict, res.origin, res.explanation = _verdict(x, in_group, res.level, every)
                if grid:
                    res.grid_records[(x.step, column(x))] = res.first
            else:
                res.later_differing += 1
                if len(later_steps) < 100_000:
                    later_steps.add(x.step)
        elif res.same:
            res.matched += 1
            res.last_matched = identity(x)
        in_group = True
        x, y = next(ia, None), next(ib, None)
    if x is not None or y is not None:
        longer, rest, label = ("A", x, ia) if x is not None else ("B", y, ib)
        assert rest is not None
        n = 1 + sum(1 for _ in label)
        if res.same:
            res.same = False
            res.first = {**identity(rest), ("a" if longer == "A" else "b"): _content(rest)}
            res.verdict, res.origin = ENDS, f"{'B' if longer == 'A' else 'A'} stopped"
            res.explanation = (f"{'B' if longer == 'A' else 'A'} has no more records where {longer} goes on with "
                               f"{n} more, from {rest.where()}: that run stopped (crashed, was killed, or ran fewer "
                               "steps); everything both recorded matched")
        else:
            res.notes.append(f"{longer} has {n} more records than the other")
    res.later_steps = sorted(later_steps)


def _cell(res: Divergence, r: Record, d: float) -> None:
    key = (r.step, column(r))
    old = res.grid.get(key)
    if old is None:
        if r.step >= GRID_STEPS or len(res.grid) >= GRID_STEPS * GRID_COLUMNS:
            return
        res.grid[key] = d
    elif d > old:
        res.grid[key] = d
