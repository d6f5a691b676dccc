"""Every answer of ``first_divergence`` / ``diverge`` about "same or not" (docs/TRACE.md "Comparing").

- A tolerance never hides a difference: a sum of squares that is not finite (a NaN, an inf, squares
  that overflow float64) is compared by digest, on traces of real runs and on generated pairs of records.
- The tolerance argument is validated (a finite number >= 0).
- What each verdict names (origin, explanation, level-aware advice), what the report and the HTML
  grid show (the behaviours mutation testing found unchecked: /work/shared/MUTATION.md's
  trace/compare.py list), and the ULP distance of the evidence, across zero too.
(Names from a hostile trace reach the terminal and the page escaped: tests/attacks/test_trace_text_attacks.py.)
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import tensorcanon
from tensorcanon import UsageError, first_divergence
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import layout
from tensorcanon.trace.capture import compare_tensors
from tensorcanon.trace.compare import EQUAL, INPUTS, PATHS
from tensorcanon.trace.layout import Record
from tensorcanon.trace.summary import max_ulp, summarize

D0, D1 = bytes(16), bytes(range(16))


def rec(step: int = 0, name: str = "aten.mm.default", role: str = "out", digest: bytes = D0, sumsq: float = 1.0,
        kind: str = "op", phase: str = "forward", call: int = 0, dtype: str = "float32", scope: str = "layer",
        shape: tuple[int, ...] = (2, 3), note: str = "") -> Record:
    return Record(step, phase, kind, scope, name, call, role, dtype, shape, digest, sumsq, note)


def text(step: int = 0, name: str = "aten.add.Tensor", note: str = "1, T", **kw) -> Record:
    """An op's arguments that are not tensors: a text record, its digest that of its note."""
    return rec(step, name=name, role="args", dtype="text", shape=(), sumsq=0.0, note=note,
               digest=layout.text_digest(note, "xxh3-128"), **kw)


def write(path, records, level: str = "ops", end: bool = True) -> None:
    with open(path, "wb") as fh:
        fh.write(layout.MAGIC)
        w = layout.Writer(fh)
        w.frame(msgpack.packb(layout.Header(level, "xxh3-128", 0, 1).payload()))
        for r in records:
            w.record(r)
        if end:
            w.end()


def compare(tmp_path, a_records, b_records, level: str = "ops", **kw):
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    write(a, a_records, level)
    write(b, b_records, level)
    return first_divergence(a, b, **kw)


# --------------------------------------------------------------------------- a tolerance never hides a difference


class Shift(nn.Module):
    """``x * scale + shift``, elementwise (buffers, not parameters): its output is what the run changes."""

    def __init__(self, scale: float, shift: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale, dtype=dtype))
        self.register_buffer("shift", torch.tensor(shift, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def _run(path, batch: torch.Tensor, scale: float, shift: float) -> None:
    """A real traced run at level modules: two steps of a tiny model (tanh, then Shift)."""
    tensorcanon.seed_everything(0, deterministic=False)
    model = nn.Sequential(nn.Tanh(), Shift(scale, shift, batch.dtype)) if batch.dtype == torch.float32 \
        else nn.Sequential(nn.Identity(), Shift(scale, shift, batch.dtype))
    with tensorcanon.trace(path, level="modules", model=model) as tr:
        for _ in range(2):
            tr.step(batch)
            tr.loss(model(batch).sum())


@pytest.mark.filterwarnings("ignore::tensorcanon.training.determinism.DeterminismWarning")
def test_a_tolerance_never_hides_a_difference_in_real_runs(tmp_path, capsys):
    """Two runs whose module output differs by 5.0 per element, one NaN in both at one place; and
    two float64 runs whose outputs' sums of squares overflow to inf: `diverge --tolerance 0.01`
    says they differ (exit 1), at the module's output; a trace against itself is still the same."""
    nan_batch = torch.ones(3, 4)
    nan_batch[1, 2] = math.nan
    big = torch.full((3, 4), 1e200, dtype=torch.float64)
    for batch, (a_run, b_run) in ((nan_batch, ((1.0, 0.0), (1.0, 5.0))), (big, ((1.0, 0.0), (1.5, 0.0)))):
        a, b = tmp_path / "a.trace", tmp_path / "b.trace"
        _run(a, batch, *a_run)
        _run(b, batch, *b_run)
        out = tensorcanon.first_divergence(a, b, tolerance=0.01)
        assert not out.same and out.first is not None
        assert (out.first["step"], out.first["kind"], out.first["name"], out.first["role"]) == (0, "module", "1", "out")
        assert out.verdict == EQUAL and out.origin == "module 1"
        assert out.first["a"]["digest"] != out.first["b"]["digest"]
        assert not (math.isfinite(out.first["a"]["norm"]) and math.isfinite(out.first["b"]["norm"]))
        assert out.later_differing > 0 and out.later_steps == [0, 1]  # the model's output, the loss, step 1
        assert cli(["diverge", "--tolerance", "0.01", str(a), str(b)]) == 1
        assert capsys.readouterr().out.startswith("first divergence: step 0, phase forward, module 1")
        assert cli(["diverge", "--tolerance", "0.01", str(a), str(a)]) == 0  # equal digests: same, NaN or not
        assert capsys.readouterr().out.startswith("same:")


_SPECIAL = [math.nan, math.inf, -math.inf, 1e200, -1e200, 1e-310, 0.0, -0.0, 1.0, -1.0]
_values = st.lists(st.one_of(st.sampled_from(_SPECIAL), st.floats(-1e6, 1e6, allow_nan=False)),
                   min_size=6, max_size=6)


@st.composite
def _pairs(draw):
    """(dtype, A's values, B's values): B equal to A, A nudged (relative 1e-9 to 1e-1 on some
    elements), or A with some elements replaced (a NaN moved, an inf added, 5.0 added...)."""
    dtype = draw(st.sampled_from(["float32", "float64"]))
    a = draw(_values)
    how = draw(st.sampled_from(["same", "nudged", "replaced"]))
    b = list(a)
    if how == "nudged":
        factor = 1 + draw(st.sampled_from([1e-9, 1e-6, 1e-3, 1e-1]))
        for i in draw(st.sets(st.integers(0, 5), min_size=1)):
            b[i] = a[i] * factor
    elif how == "replaced":
        for i in draw(st.sets(st.integers(0, 5), min_size=1)):
            b[i] = draw(st.one_of(st.sampled_from(_SPECIAL), st.just(a[i] + 5.0)))
    return dtype, a, b


def _record_of(values: list[float], dtype: str) -> Record:
    with np.errstate(over="ignore"):  # 1e200 is inf in float32
        t = torch.from_numpy(np.array(values, dtype=dtype).reshape(2, 3))
    name, shape, digest, sumsq, note = summarize(t, "xxh3-128")
    return rec(dtype=name, shape=shape, digest=digest, sumsq=sumsq, note=note)


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pair=_pairs(), tolerance=st.sampled_from([0.0, 1e-12, 1e-6, 0.01, 0.5, 1.0]))
def test_same_under_a_tolerance_means_equal_digests_or_finite_norms_within_it(tmp_path, pair, tolerance):
    """Generated pairs of records (finite, NaN, inf, squares that overflow float64) from real
    tensors: same under a tolerance => equal digests, or both sums of squares finite and their
    norms within it; equal digests => same; finite norms well within it => same."""
    dtype, va, vb = pair
    ra, rb = _record_of(va, dtype), _record_of(vb, dtype)
    out = compare(tmp_path, [ra], [rb], tolerance=tolerance)
    finite = math.isfinite(ra.sumsq) and math.isfinite(rb.sumsq)
    if finite:
        na, nb = math.sqrt(ra.sumsq), math.sqrt(rb.sumsq)
        rel = abs(na - nb) / max(na, nb) if max(na, nb) else 0.0
    if out.same:
        assert ra.digest == rb.digest or (finite and rel <= tolerance), (ra, rb)
    if ra.digest == rb.digest:
        assert out.same
    elif finite and 0 < rel and rel * (1 + 1e-9) < tolerance:
        assert out.same
    elif not finite:
        assert not out.same and out.first is not None and out.first["distance"] == math.inf


def test_a_nan_where_the_other_has_a_number_or_elsewhere_differs_under_any_tolerance(tmp_path):
    base = [1.0, 2.0, math.nan, 4.0, 5.0, 6.0]
    for other in ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 2.0, 3.0, math.nan, 5.0, 6.0],
                  [1.0, 2.0, math.nan, 4.0, 5.0, 6.000001], [1.0, 2.0, math.inf, 4.0, 5.0, 6.0]):
        out = compare(tmp_path, [_record_of(base, "float32")], [_record_of(other, "float32")], tolerance=1.0)
        assert not out.same and out.first is not None and out.first["distance"] == math.inf, other
    same = compare(tmp_path, [_record_of(base, "float32")], [_record_of(list(base), "float32")], tolerance=0.0)
    assert same.same and same.matched == 1


@pytest.mark.parametrize("bad", [10**400, -(10**400), -1, -1e-300, math.nan, math.inf, -math.inf, True, False,
                                 "0.1", None.__class__, [0.1], complex(0.1, 0)], ids=lambda v: type(v).__name__)
def test_the_tolerance_is_a_finite_number_at_least_0(tmp_path, bad):
    a = tmp_path / "a.trace"
    write(a, [rec()])
    with pytest.raises(UsageError, match="tolerance must be a finite number >= 0"):
        first_divergence(a, a, tolerance=bad)


def test_a_tolerance_of_any_real_type_is_used_as_a_float(tmp_path):
    from fractions import Fraction

    for ok in (0, 1, 10**10, 0.5, np.float32(0.5), np.float64(0.5), Fraction(1, 2)):
        out = compare(tmp_path, [rec(sumsq=4.0)], [rec(sumsq=4.0 * 1.1, digest=D1)], tolerance=ok)
        assert type(out.tolerance) is float and out.tolerance == float(ok)
        assert out.same == (float(ok) >= 0.05)


def test_squares_past_float64_sum_to_inf_without_a_warning():
    """The recorder's sum of squares of float64 (and complex128) values beyond ~1.3e154 is inf, as
    the format says, and numpy's "overflow encountered" warning is not raised for it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (torch.full((3,), 1e200, dtype=torch.float64), torch.tensor([1e200 + 1j], dtype=torch.complex128)):
            assert summarize(t, "xxh3-128")[3] == math.inf


# --------------------------------------------------------------------------- verdicts (MUTATION.md)


def test_a_module_whose_output_differs_from_equal_inputs_is_named_as_the_origin(tmp_path):
    for name, origin in (("blocks.0", "module blocks.0"), ("", "module (model)")):
        a = [rec(kind="module", scope="", name=name, role="in.0"), rec(kind="module", scope="", name=name)]
        b = [a[0], a[1]._replace(digest=D1)]
        out = compare(tmp_path, a, b, level="modules")
        assert (out.verdict, out.origin) == (EQUAL, origin)


@pytest.mark.parametrize(("level", "advice"), [("modules", "; trace at level ops to name the op"), ("ops", "")])
def test_a_gradient_that_differs_names_the_backward_pass_with_advice_for_its_level(tmp_path, level, advice):
    a = [rec(kind="loss", phase="forward", scope="", name="loss", role="value"),
         rec(kind="grad", phase="backward", scope="", name="w", role="grad")]
    out = compare(tmp_path, a, [a[0], a[1]._replace(digest=D1)], level=level)
    assert out.origin == "the backward pass"
    assert out.explanation == "a gradient differs while the forward pass matched: the backward pass is not " \
                              "deterministic here" + advice


@pytest.mark.parametrize(("kind", "what"), [("param", "parameters"), ("optim", "optimizer state")])
def test_parameters_or_optimizer_state_that_differ_name_the_optimizer_step(tmp_path, kind, what):
    a = [rec(kind="loss", scope="", name="loss", role="value"),
         rec(kind=kind, phase="optimizer", scope="", name="w", role="value")]
    for level in ("steps", "modules", "ops"):
        out = compare(tmp_path, a, [a[0], a[1]._replace(digest=D1)], level=level)
        assert (out.verdict, out.origin) == (EQUAL, f"the optimizer step ({what})")
        # at level steps no gradient is recorded: the backward pass is a suspect too, and finer levels tell
        said = "(or the backward pass: gradients are recorded from level modules on; trace at level modules or ops"
        assert (said in out.explanation) == (level == "steps"), out.explanation


@pytest.mark.parametrize(("level", "advice"), [("steps", "; trace at level modules or ops to name where"),
                                               ("modules", "; trace at level ops to name where"), ("ops", "")])
def test_a_loss_that_differs_advises_only_the_levels_finer_than_the_one_compared(tmp_path, level, advice):
    """At level modules a loss divergence advised "trace at level modules or ops" (issue 38)."""
    a = [rec(kind="batch", phase="data", scope="", name="batch", role="value", dtype="int64"),
         rec(kind="loss", scope="", name="loss", role="value", shape=())]
    out = compare(tmp_path, a, [a[0], a[1]._replace(digest=D1)], level=level)
    assert out.origin == "the forward pass"
    assert out.explanation.endswith("the forward pass is not deterministic here" + advice)


def test_a_module_at_level_ops_gets_no_advice_to_trace_finer(tmp_path):
    a = [rec(kind="module", scope="", name="m", role="in.0"), rec(kind="module", scope="", name="m")]
    out = compare(tmp_path, a, [a[0], a[1]._replace(digest=D1)], level="ops")
    assert "trace at level" not in out.explanation
    out = compare(tmp_path, a, [a[0], a[1]._replace(digest=D1)], level="modules")
    assert out.explanation.endswith("; trace at level ops to name the op")


def test_a_modules_trace_against_an_ops_trace_ignores_the_op_records(tmp_path):
    """Both directions: the ops trace's op records (some differing) are not compared."""
    mods = [rec(kind="module", scope="", name="m", role="in.0"), rec(kind="module", scope="", name="m")]
    ops = [mods[0], rec(name="aten.mm.default", role="in.0"), rec(name="aten.mm.default", digest=D1), mods[1]]
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    write(a, mods, "modules")
    write(b, ops, "ops")
    for x, y in ((a, b), (b, a)):
        out = first_divergence(x, y)
        assert out.same and out.level == "modules" and out.matched == 2, out.lines()
        assert out.compared == ["batch", "rng", "loss", "param", "optim", "module", "grad"]
        assert out.not_compared == [f"the op records of {b} (level ops; the other trace is level modules)"]


def test_only_a_trace_without_its_end_frame_gets_an_incomplete_note(tmp_path):
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    write(a, [rec(), rec(1)])
    write(b, [rec(), rec(1)])
    out = first_divergence(a, b)
    assert out.same and out.notes == [] and out.complete == (True, True)
    with open(b, "ab") as fh:  # a crashed run: its end frame is missing, and half a frame follows
        pass
    write(b, [rec(), rec(1)], end=False)
    with open(b, "ab") as fh:
        fh.write(b"\x05\x00")
    out = first_divergence(a, b)
    assert [n for n in out.notes if "incomplete" in n] == [n for n in out.notes if n.startswith(f"{b} is incomplete")]
    assert len(out.notes) == 1 and out.complete == (True, False)


_HINT = "(it has no tensor inputs: a random draw?)"


def test_the_random_draw_hint_appears_only_when_no_record_of_the_call_matched_before(tmp_path):
    rand = [rec(name="aten.rand.default", role="out")]
    out = compare(tmp_path, rand, [rand[0]._replace(digest=D1)])
    assert out.verdict == EQUAL and _HINT in out.explanation
    # a second call of the op (its first call matched) is the first record of its own call: hinted
    two = [rec(name="aten.rand.default", call=0), rec(name="aten.rand.default", call=1)]
    out = compare(tmp_path, two, [two[0], two[1]._replace(digest=D1)])
    assert out.first is not None and out.first["call"] == 1 and _HINT in out.explanation
    # an input record of the same call matched first: not a random draw
    mm = [rec(role="in.0"), rec(role="out")]
    out = compare(tmp_path, mm, [mm[0], mm[1]._replace(digest=D1)])
    assert out.verdict == EQUAL and out.origin == "op aten.mm.default" and _HINT not in out.explanation


def test_the_first_records_notes_are_their_argument_texts_and_absent_without_one(tmp_path):
    out = compare(tmp_path, [text(note="1, T")], [text(note="2, T")])
    assert out.verdict == INPUTS and out.first is not None
    assert out.first["a"]["note"] == "1, T" and out.first["b"]["note"] == "2, T"
    out = compare(tmp_path, [rec()], [rec(digest=D1)])
    assert out.first is not None and "note" not in out.first["a"] and "note" not in out.first["b"]


# --------------------------------------------------------------------------- the HTML grid's cells (MUTATION.md)


def test_an_op_records_grid_column_is_its_module_or_where_it_ran(tmp_path):
    records = [rec(scope="blocks.1"), rec(scope="", name="aten.add.Tensor"),
               rec(scope="", name="aten.mul.Tensor", phase="backward")]
    out = compare(tmp_path, records, records[:2] + [records[2]._replace(digest=D1, sumsq=4.0)], grid=True)
    assert out.grid == {(0, "blocks.1"): 0.0, (0, "(outside modules)"): 0.0, (0, "(backward ops)"): 0.5}


def test_a_step_where_the_runs_recorded_different_things_is_an_inf_cell(tmp_path):
    a = [rec(0), rec(1, name="aten.add.Tensor"), rec(2)]
    b = [rec(0), rec(1, name="aten.sub.Tensor"), rec(2)]
    out = compare(tmp_path, a, b, grid=True)
    assert out.verdict == PATHS and out.grid == {(0, "layer"): 0.0, (1, "layer"): math.inf, (2, "layer"): 0.0}


def test_the_grid_holds_the_first_400_steps(tmp_path):
    records = [rec(s) for s in (0, 398, 399, 400, 401)]
    out = compare(tmp_path, records, [r._replace(digest=D1) for r in records], grid=True)
    assert sorted(out.grid) == [(0, "layer"), (398, "layer"), (399, "layer")]
    assert out.later_steps == [398, 399, 400, 401]


# --------------------------------------------------------------------------- the report's lines (MUTATION.md)


def test_the_reports_lines(tmp_path):
    a = [rec(0, role="in.0"), rec(0)] + [rec(s) for s in range(1, 13)]
    b = [a[0], a[1]._replace(digest=D1)] + [r._replace(digest=D1) for r in a[2:]]
    lines = compare(tmp_path, a, b).lines()
    assert lines[0] == "first divergence: step 0, phase forward, op layer/aten.mm.default, call 0, role out"
    assert "everything before it matched: 1 records, up to step 0 forward op layer/aten.mm.default call 0 in.0" \
        in lines
    assert "after it: 12 more records differ, in steps 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ..." in lines
    assert not any(line.startswith("not compared:") for line in lines)
    # no scope: the name alone; ten later steps: no "..."
    a = [rec(0, scope="")] + [rec(s, scope="") for s in range(1, 11)]
    lines = compare(tmp_path, a, [r._replace(digest=D1) for r in a]).lines()
    assert lines[0] == "first divergence: step 0, phase forward, op aten.mm.default, call 0, role out"
    assert "everything before it matched: 0 records" in lines
    assert "after it: 10 more records differ, in steps 1, 2, 3, 4, 5, 6, 7, 8, 9, 10" in lines
    # a trace of another level: "not compared:" names what was not
    x, y = tmp_path / "x.trace", tmp_path / "y.trace"
    write(x, [rec(kind="module", scope="", name="m")], "modules")
    write(y, [rec(kind="module", scope="", name="m"), rec()], "ops")
    lines = first_divergence(x, y).lines()
    assert f"not compared: the op records of {y} (level ops; the other trace is level modules)" in lines


# --------------------------------------------------------------------------- ULP distance (the evidence)


def test_ulp_distance_across_zero_is_counted_in_the_larger_values_last_place():
    """-0.002 and 0.002 in float32 were 1 980 114 142 ULP apart (every float between them, half of
    all float32 numbers crowding near zero); now 0.004 in units of 0.002's last place."""
    x, y = torch.tensor([-0.002, 1.0]), torch.tensor([0.002, 1.0])
    ev = compare_tensors(x, y)
    gap = float(np.spacing(np.float32(0.002)))
    assert ev["max_ulp"] == math.ceil(0.004000000189989805 / gap) and ev["max_ulp"] < 2 * 0.002 / gap + 1
    assert compare_tensors(torch.tensor([-0.0]), torch.tensor([0.0]))["max_ulp"] == 0  # equal values
    tiny = torch.tensor([1e-45])  # the smallest float32 subnormal, against -itself: 2 apart
    assert compare_tensors(tiny, -tiny)["max_ulp"] == 2


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(dtype=st.sampled_from([np.float16, np.float32, np.float64]), data=st.data())
def test_ulp_distance_is_the_count_of_floats_between_two_values_of_one_binade(dtype, data):
    """Independent of the definition's arithmetic: for two values of one sign and one binade, the
    distance is the difference of their bit patterns; adjacent floats are 1 apart anywhere; the
    distance is symmetric."""
    bits = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}[dtype]
    width = np.dtype(dtype).itemsize * 8
    mant = {np.float16: 10, np.float32: 23, np.float64: 52}[dtype]
    exponent = data.draw(st.integers(1, (1 << (width - 1 - mant)) - 2))  # a normal binade
    sign = data.draw(st.integers(0, 1))
    m1, m2 = (data.draw(st.integers(0, (1 << mant) - 1)) for _ in range(2))
    raw = np.array([(sign << (width - 1)) | (exponent << mant) | m for m in (m1, m2)], dtype=bits)
    v = raw.view(dtype).astype(np.float64)
    name = np.dtype(dtype).name
    assert max_ulp(v[:1], v[1:], name) == abs(m1 - m2) == max_ulp(v[1:], v[:1], name)
    x = raw[:1].view(dtype)
    nxt = np.nextafter(x, np.array([np.inf], dtype=dtype)).astype(np.float64)
    if math.isfinite(nxt[0]):
        assert max_ulp(x.astype(np.float64), nxt, name) == 1


def test_ulp_distance_of_values_that_are_not_finite():
    a = np.array([1.0, math.nan])
    assert max_ulp(a, np.array([1.0, 2.0]), "float32") == math.inf  # a NaN against a number
    assert max_ulp(np.array([math.nan]), np.array([math.nan]), "float32") == 0
    assert max_ulp(np.array([math.inf]), np.array([-math.inf]), "float64") == math.inf
    assert max_ulp(np.array([1.7e308]), np.array([-1.7e308]), "float64") < 2 ** 54  # no overflow


# --------------------------------------------------------------------------- docs/TRACE.md's first example

_TRAIN = """
import sys

import torch
import tensorcanon


def train(path, seed):
    seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(1))
    with tensorcanon.trace(path, level="modules", model=model, optimizer=opt) as tr:
        for batch in data:
            tr.step(batch)
            loss = tr.loss(model(batch).square().mean())
            loss.backward()
            opt.step()
            opt.zero_grad()


train(f"torch{sys.argv[1]}.trace", torch.manual_seed)
train(f"all{sys.argv[1]}.trace", tensorcanon.seed_everything)
"""


def test_the_first_example_seeds_everything_because_torch_alone_differs_in_fresh_processes(tmp_path):
    """docs/TRACE.md's claim: two runs of its first example in two processes are the same with
    seed_everything; seeding torch alone, they differ at step 0's numpy random state."""
    import os
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(_TRAIN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    for run in (1, 2):
        proc = subprocess.run([sys.executable, "train.py", str(run)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert first_divergence(tmp_path / "all1.trace", tmp_path / "all2.trace").same
    out = first_divergence(tmp_path / "torch1.trace", tmp_path / "torch2.trace")
    assert out.first is not None and out.matched > 0
    assert (out.first["step"], out.first["kind"], out.first["name"], out.verdict) == (0, "rng", "numpy", INPUTS)
