"""Red-team attacks, written from the docs alone (docs/TRACE.md, docs/SECURITY.md "Trace files",
README "Where two runs diverge", ``tensorcanon diverge --help``, ``tensorcanon verify --help``), on
what a trace reads besides its records: the capture files beside traces and the specs naming them,
``trace(..., resume_at=k)`` and the trace it continues, the environment and paths ``trace`` is given,
``diverge --tolerance``, the texts that reach the terminal or ``--html``, and ``verify`` on hostile
traces.

Every expectation is a documented one: a ``TensorCanonError`` subclass naming what and where (never
a foreign exception, a crash, a hang or unbounded memory), no file bytes quoted, a refused call that
changes no byte, and the exit codes of ``diverge`` (0 same, 1 differ, 2 error) and ``verify`` (0 ok,
1 damaged, 2 error). Each test is one attack (or one family, parametrized); all run in this process
(the command line's ``main`` is called directly), so none spawns an interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import fractions
import io
import json
import os
import re
import signal
import struct
import tracemalloc
import warnings

import msgpack
import numpy as np
import pytest
import torch
import xxhash

import tensorcanon
from tensorcanon import (
    FileAccessError,
    FormatError,
    IntegrityError,
    MissingFileError,
    TensorCanonError,
    UnsupportedAlgorithmError,
    UsageError,
)
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import capture, layout

MAGIC = b"\x89TCTRC\r\n"  # docs/TRACE.md "The file", item 1
DA, DB = bytes(16), bytes(range(16))
SPEC = "0|op||aten.mm.default|0"
RAW_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
HOSTILE_TEXT = "w\x1b[2K\rsame: 9 records compared, all equal\x9b31m\u202etxt.exe\u2066\x07\x00"


# --------------------------------------------------------------------------- writing traces by hand

def framed(*payloads: bytes) -> bytes:
    """Magic, then each payload framed: u32 length, payload, u64 xxh3-64 chained from the frame before."""
    parts, seed = [MAGIC], 0
    for payload in payloads:
        check = xxhash.xxh3_64_intdigest(payload, seed=seed)
        parts += [struct.pack("<I", len(payload)), payload, struct.pack("<Q", check)]
        seed = check
    return b"".join(parts)


def head(level="ops", algorithm="xxh3-128", rank=0, world_size=1) -> bytes:
    return msgpack.packb([0, "tensorcanon-trace", 1, level, algorithm, rank, world_size])


def record(step=0, phase="forward", kind="op", scope="", name="aten.mm.default", call=0, role="out",
           dtype="float32", shape=(2,), digest=DA, sumsq=1.0, note="") -> bytes:
    return msgpack.packb([1, step, phase, kind, scope, name, call, role, dtype, list(shape), digest, sumsq, note])


def batch_rec(step=0, name="batch", call=0, digest=DA) -> bytes:
    return record(step=step, phase="data", kind="batch", name=name, call=call, role="batch", digest=digest)


def ending(n: int) -> bytes:
    return msgpack.packb([2, n])


def write_trace(path, *payloads: bytes) -> str:
    with open(path, "wb") as fh:
        fh.write(framed(*payloads))
    return str(path)


def pair(tmp_path, a_rec=None, b_rec=None, level="ops"):
    """Two complete traces of one record each; by default they differ at op aten.mm.default, step 0."""
    a_rec = a_rec if a_rec is not None else record()
    b_rec = b_rec if b_rec is not None else record(digest=DB)
    return (write_trace(tmp_path / "a.trace", head(level), a_rec, ending(1)),
            write_trace(tmp_path / "b.trace", head(level), b_rec, ending(1)))


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli([str(a) for a in argv])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_foreseen(err: str) -> None:
    """The command line's last line of defence says "this is a bug in tensorcanon": an input that
    reaches it was not foreseen."""
    assert "bug in tensorcanon" not in err and "Traceback" not in err, err


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """A call that would block (opening a FIFO) fails the test instead of hanging it."""
    def expired(*_):
        raise AssertionError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def library_error_or_none(fn, *args, **kwargs):
    """Call ``fn``: a TensorCanonError is returned, success gives None, anything else fails the test."""
    try:
        fn(*args, **kwargs)
    except TensorCanonError as e:
        return e
    except Exception as e:  # noqa: BLE001 - which class escapes is the point
        pytest.fail(f"{fn.__name__} raised a foreign {type(e).__name__}: {e}")
    return None


# --------------------------------------------------------------------------- captures

def save_captures(a, b, tensors_a, tensors_b, texts_a=None, texts_b=None, spec=SPEC):
    tensorcanon.save({"spec": spec, "tensors": tensors_a, "texts": texts_a or {}}, capture.capture_path(a))
    tensorcanon.save({"spec": spec, "tensors": tensors_b, "texts": texts_b or {}}, capture.capture_path(b))


def evidence_of(a, b):
    d = tensorcanon.first_divergence(a, b)
    assert not d.same and d.first is not None
    return d, d.first.get("evidence")


def _valid_capture_bytes(tmp_path) -> bytes:
    p = tmp_path / "valid.safetensors"
    tensorcanon.save({"spec": SPEC, "tensors": {"out": torch.arange(64, dtype=torch.float32)}, "texts": {}}, p)
    return p.read_bytes()


def _make_capture(kind: str, target: str, tmp_path) -> None:
    """Put at ``target`` a capture that is not one (or not a regular file)."""
    os.unlink(target)
    good = _valid_capture_bytes(tmp_path)
    if kind == "directory":
        os.mkdir(target)
    elif kind == "symlink_loop":
        os.symlink(target, target)
    elif kind == "dangling_symlink":
        os.symlink(str(tmp_path / "nowhere" / "x.safetensors"), target)
    elif kind == "symlink_to_fifo":
        os.mkfifo(tmp_path / "fifo")
        os.symlink(str(tmp_path / "fifo"), target)
    elif kind == "symlink_to_directory":
        os.symlink(str(tmp_path), target)
    elif kind == "empty":
        open(target, "wb").close()
    elif kind == "seven_bytes":
        with open(target, "wb") as fh:
            fh.write(b"\x10\x00\x00\x00\x00\x00\x00")
    elif kind == "truncated":
        with open(target, "wb") as fh:
            fh.write(good[: len(good) - 100])
    elif kind == "data_bit_flipped":
        with open(target, "wb") as fh:
            fh.write(good[:-9] + bytes([good[-9] ^ 0x10]) + good[-8:])
    elif kind == "header_length_2_63":
        with open(target, "wb") as fh:
            fh.write(struct.pack("<Q", 2**63) + b"{}")
    elif kind == "trace_file":
        with open(target, "wb") as fh:
            fh.write(framed(head(), record(), ending(1)))
    elif kind == "npy_file":
        np.save(target + ".npy", np.zeros(4))
        os.rename(target + ".npy", target)
    else:  # pragma: no cover
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["directory", "symlink_loop", "dangling_symlink", "symlink_to_fifo",
                                  "symlink_to_directory", "empty", "seven_bytes", "truncated", "data_bit_flipped",
                                  "header_length_2_63", "trace_file", "npy_file"])
def test_a_capture_that_is_no_capture_file_is_a_note_and_the_comparison_stands(tmp_path, kind):
    """TRACE.md: a capture is opened only if it is a regular file, must start as a tensorcanon file and
    hold a capture; anything else is a `note` naming the file, and the traces' comparison stands (exit 1
    here), never an exit 2, a foreign exception or a read that blocks."""
    a, b = pair(tmp_path)
    save_captures(a, b, {"out": torch.zeros(2)}, {"out": torch.ones(2)})
    target = capture.capture_path(b)
    _make_capture(kind, target, tmp_path)
    with deadline():
        d, ev = evidence_of(a, b)
        code, out, err = run_cli("diverge", a, b)
    assert ev is not None and set(ev) == {"note"}, ev
    assert target in ev["note"] and "bug" not in ev["note"], ev
    assert code == 1 and "first divergence" in out, (code, out, err)
    assert_foreseen(err)


@dataclasses.dataclass
class Secretive:
    text: str


def test_a_capture_holding_a_registered_value_is_a_note(tmp_path):
    """A capture whose role holds a registered dataclass (in a tensor's place, or a text's) is not a
    capture: a note, never a foreign exception, with the type registered in the comparing process (the
    CLI, which registers nothing, is tried too)."""
    tensorcanon.register(Secretive)
    a, b = pair(tmp_path)
    save_captures(a, b, {"out": torch.zeros(2)}, {"out": Secretive("x")})
    _, ev = evidence_of(a, b)
    assert set(ev) == {"note"} and capture.capture_path(b) in ev["note"], ev
    code, _, err = run_cli("diverge", a, b)
    assert code == 1, err
    assert_foreseen(err)
    save_captures(a, b, {"out": torch.zeros(2)}, {"out": torch.ones(2)}, texts_b={"args": Secretive("y")})
    _, ev = evidence_of(a, b)
    assert set(ev) == {"note"}, ev


def test_a_capture_holding_a_registered_tensor_subclass_runs_none_of_its_code(tmp_path):
    """TRACE.md: a capture's roles name "one of torch's own tensors (never a subclass, whose code would
    run on the values)". A TwoTensor registered in the comparing process loads as itself: the comparison
    must refuse it (a note) rather than run its dispatch on the values."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Watched(TwoTensor):
        ran = 0

        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs=None):
            Watched.ran += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    tensorcanon.register(Watched)
    a, b = pair(tmp_path)
    w = Watched(torch.zeros(2), torch.ones(2))
    save_captures(a, b, {"out": torch.zeros(2)}, {"out": w})
    Watched.ran = 0
    _, ev = evidence_of(a, b)
    assert set(ev) == {"note"} and capture.capture_path(b) in ev["note"], ev
    assert Watched.ran == 0


@pytest.mark.parametrize("which", ["role_int_key", "role_5000_chars", "roles_20002", "tensors_none", "texts_bytes",
                                   "spec_other_call", "spec_bad_escape", "spec_100000_digits", "extra_key",
                                   "tensor_is_parameter", "rng_state", "spec_bytes", "nested_dict_role"])
def test_a_capture_holding_values_it_may_not_is_a_note(tmp_path, which):
    """Capture contents beyond those the existing attacks tried: keys that are not texts, a role over 4,096
    characters, too many roles, a spec that is not one or names another call, a Parameter (a subclass),
    an RNG state, a role that is a dict. A note, or (for a spec of another call, a Parameter) evidence;
    never a foreign exception, and the comparison stands."""
    a, b = pair(tmp_path)
    save_captures(a, b, {"out": torch.zeros(2)}, {"out": torch.ones(2)})
    spec, tensors, texts = SPEC, {"out": torch.ones(2)}, {}
    if which == "role_int_key":
        tensors = {1: torch.ones(2)}
    elif which == "role_5000_chars":
        tensors = {"r" * 5000: torch.ones(2)}
    elif which == "roles_20002":
        texts = {f"t{i}": "x" for i in range(20_002)}
    elif which == "tensors_none":
        tensors = None
    elif which == "texts_bytes":
        texts = {"args": b"alpha=1"}
    elif which == "spec_other_call":
        spec = "5|op||aten.add.Tensor|3"
    elif which == "spec_bad_escape":
        spec = "0|op||aten\\mm|0"
    elif which == "spec_100000_digits":
        spec = "1" * 100_000 + "|op||aten.mm.default|0"
    elif which == "extra_key":
        pass
    elif which == "tensor_is_parameter":
        tensors = {"out": torch.nn.Parameter(torch.ones(2))}
    elif which == "rng_state":
        tensors = {"out": tensorcanon.RngState.capture()}
    elif which == "spec_bytes":
        spec = SPEC.encode()
    elif which == "nested_dict_role":
        tensors = {"out": {"deeper": torch.ones(2)}}
    value = {"spec": spec, "tensors": tensors, "texts": texts}
    if which == "extra_key":
        value["run"] = torch.zeros(1)
    tensorcanon.save(value, capture.capture_path(b))
    d = library_error_or_none(tensorcanon.first_divergence, a, b)
    assert d is None
    d, ev = evidence_of(a, b)
    if which in ("spec_other_call", "tensor_is_parameter"):
        assert ev is None or "note" in ev or "out" in ev, ev
    else:
        assert ev is not None and set(ev) == {"note"}, ev
    code, _, err = run_cli("diverge", a, b)
    assert code == 1, (code, err)
    assert_foreseen(err)


def test_a_sparse_capture_claiming_a_huge_shape_is_never_densified(tmp_path):
    """Sparse tensors are compared part by part, never densified: a COO tensor of shape 2^31 x 2^31
    (2^62 elements) and a CSR one of 2^40 columns, each with two values, cost a few bytes to save and
    must cost a few bytes to compare."""
    a, b = pair(tmp_path)
    i = torch.tensor([[0, 2**31 - 1], [5, 2**31 - 2]])
    coo_a = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), (2**31, 2**31)).coalesce()
    coo_b = torch.sparse_coo_tensor(i, torch.tensor([1.0, 3.0]), (2**31, 2**31)).coalesce()
    csr_a = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 2**40 - 1]), torch.tensor([1.0, 2.0]),
                                    (2, 2**40))
    csr_b = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 2**40 - 1]), torch.tensor([1.0, 4.0]),
                                    (2, 2**40))
    save_captures(a, b, {"coo": coo_a, "csr": csr_a}, {"coo": coo_b, "csr": csr_b})
    assert os.path.getsize(capture.capture_path(a)) < 4096
    tracemalloc.start()
    try:
        _, ev = evidence_of(a, b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ev["coo"]["values"]["differ"] == 1 and ev["coo"]["indices"]["differ"] == 0, ev
    assert ev["csr"]["values"]["differ"] == 1 and ev["csr"]["col_indices"]["differ"] == 0, ev
    assert peak < 16 << 20, f"comparing two tiny sparse captures peaked at {peak >> 20} MiB"


def _mismatched_pairs():
    nested2 = torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)])
    nested3 = torch.nested.nested_tensor([torch.zeros(2), torch.ones(3), torch.ones(1)])
    jagged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.ones(1, 3)], layout=torch.jagged)
    coo2 = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (4,)).coalesce()
    coo3 = torch.sparse_coo_tensor(torch.tensor([[0, 1, 3]]), torch.tensor([1.0, 2.0, 3.0]), (4,)).coalesce()
    coo2d = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.tensor([1.0, 2.0]), (4, 4)).coalesce()
    eye = torch.eye(3)
    return {
        "dtype": (torch.zeros(3), torch.zeros(3, dtype=torch.float64)),
        "shape": (torch.zeros(3), torch.zeros(4)),
        "rank": (torch.zeros(4), torch.zeros(2, 2)),
        "meta_dense": (torch.empty(3, device="meta"), torch.zeros(3)),
        "meta_shapes": (torch.empty(3, device="meta"), torch.empty(2**40, device="meta")),
        "nested_count": (nested2, nested3),
        "nested_layouts": (nested2, jagged),
        "nested_dense": (nested2, torch.zeros(5)),
        "coo_nnz": (coo2, coo3),
        "coo_dims": (coo2, coo2d),
        "csr_csc": (eye.to_sparse_csr(), eye.to_sparse_csc()),
        "bsr": (eye.to_sparse_bsr((1, 1)), (2 * eye).to_sparse_bsr((1, 1))),
        "empty": (torch.zeros(0, 3), torch.zeros(3, 0)),
        "scalar": (torch.tensor(1.0), torch.tensor(2.0)),
        "bool": (torch.tensor([True, False]), torch.tensor([True, True])),
        "complex_real": (torch.zeros(2, dtype=torch.complex64), torch.zeros(2)),
        "complex_nan": (torch.tensor([complex(float("nan"), 1)]), torch.tensor([complex(1, 1)])),
        "float8_nan": (torch.tensor([float("nan")]).to(torch.float8_e5m2), torch.tensor([1.0]).to(torch.float8_e5m2)),
        "int_float": (torch.tensor([1, 2]), torch.tensor([1.0, 2.0])),
    }


MISMATCHED = ["bool", "bsr", "complex_nan", "complex_real", "coo_dims", "coo_nnz", "csr_csc", "dtype", "empty",
              "float8_nan", "int_float", "meta_dense", "meta_shapes", "nested_count", "nested_dense", "nested_layouts",
              "rank", "scalar", "shape"]


def test_the_mismatched_pairs_are_those_listed():
    assert sorted(_mismatched_pairs()) == MISMATCHED


@pytest.mark.parametrize("which", MISMATCHED)
def test_captures_of_mismatched_kinds_are_compared_without_an_exception(tmp_path, which):
    """The two runs' captures of one role can differ in every way a tensor can (dtype, shape, layout,
    component count, nnz): the evidence says so; never a foreign exception, and the report prints."""
    ta, tb = _mismatched_pairs()[which]
    a, b = pair(tmp_path)
    save_captures(a, b, {"x": ta}, {"x": tb})
    d, ev = evidence_of(a, b)
    assert "x" in ev and ev["x"], ev
    assert all(isinstance(line, str) for line in d.lines())
    json.dumps(d.to_json(), allow_nan=False)  # the JSON document is standard JSON (no NaN/Infinity)
    code, _, err = run_cli("diverge", "--json", a, b)
    assert code == 1, (code, err)
    assert_foreseen(err)


def test_nan_and_inf_in_captures_give_standard_json(tmp_path):
    """diverge --json is "machine-readable JSON": a NaN against a number (max_ulp inf, a NaN among
    first_values) must not make the command fail or print NaN/Infinity, which JSON does not have."""
    a, b = pair(tmp_path)
    half = torch.float16
    save_captures(a, b, {"f": torch.tensor([float("nan"), 1.0]), "g": torch.tensor([float("inf")], dtype=half)},
                  {"f": torch.tensor([1.0, float("-inf")]), "g": torch.tensor([1.0], dtype=half)})
    code, out, err = run_cli("diverge", "--json", a, b)
    assert code == 1, (code, out, err)
    assert_foreseen(err)

    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")

    doc = json.loads(out, parse_constant=refuse)
    assert doc["first"]["evidence"]["f"]["differ"] == 2


def test_texts_and_roles_from_captures_reach_no_terminal_raw(tmp_path):
    """Roles (the keys of a capture's "tensors" and "texts") and argument texts come from files: the
    report must print them escaped like every other text from a file, and the page must escape them too."""
    a, b = pair(tmp_path)
    save_captures(a, b, {HOSTILE_TEXT: torch.zeros(2), "<script>x</script>": torch.zeros(1)},
                  {HOSTILE_TEXT: torch.ones(2), "<script>x</script>": torch.ones(1)},
                  texts_a={HOSTILE_TEXT: HOSTILE_TEXT}, texts_b={HOSTILE_TEXT: HOSTILE_TEXT + "!"})
    code, out, err = run_cli("diverge", a, b)
    assert code == 1, (code, out, err)
    assert "evidence" in out
    assert not RAW_CONTROLS.search(out), repr(out)
    assert not any(line.startswith("same:") for line in out.splitlines())
    page = tmp_path / "page.html"
    code, _, err = run_cli("diverge", "--html", page, a, b)
    assert code == 1, err
    html = page.read_text(encoding="utf-8")
    assert not RAW_CONTROLS.search(html)
    assert "<script>x</script>" not in html


def test_a_capture_path_named_with_controls_is_escaped_in_the_note(tmp_path):
    """The note names the capture file: a trace named with ESC and U+202E gives a capture path with
    them, which the report prints escaped."""
    evil = tmp_path / "b\x1b[2K\u202e.trace"
    a, _ = pair(tmp_path)
    b = write_trace(evil, head(), record(digest=DB), ending(1))
    with open(capture.capture_path(b), "wb") as fh:
        fh.write(b"not a tensorcanon file at all")
    tensorcanon.save({"spec": SPEC, "tensors": {"out": torch.zeros(2)}, "texts": {}}, capture.capture_path(a))
    code, out, err = run_cli("diverge", a, b)
    assert code == 1, (code, out, err)
    assert not RAW_CONTROLS.search(out), repr(out)
    assert "not a tensorcanon file" in out or "note" in out


# --------------------------------------------------------------------------- specs

@pytest.mark.parametrize("spec", ["+1|op||x|0", "1 |op||x|0", "1_0|op||x|0", "|op||x|0", "0|op||x|", "0x1|op||x|0",
                                  "\uff11|op||x|0", "1e3|op||x|0", "-0|op||x|0", "0|op||x|0|", "0|op||x\\|0",
                                  "0|op||x|0\n", "0|op||x|1" + "\u0663", "|", "||||", "\\", "0|op|\\|x|0"])
def test_a_spec_number_or_field_of_another_form_is_a_usage_error(tmp_path, spec, monkeypatch):
    """A spec's step and call are ASCII decimal numbers; `|` and `\\` are escaped; 5 fields. int() accepts
    "+1", " 1", "1_0", fullwidth and Arabic-Indic digits: none is an ASCII decimal number."""
    with pytest.raises(UsageError, match="capture"):
        tensorcanon.trace(tmp_path / "t.trace", capture=spec)
    monkeypatch.setenv(capture.ENV, spec)
    with pytest.raises(UsageError, match=re.escape(capture.ENV)):
        tensorcanon.trace(tmp_path / "t.trace")


def test_the_longest_spec_of_a_record_is_accepted_and_one_more_character_refused(tmp_path):
    """A record's scope and name are at most 4,096 characters; written as a spec with every character a
    `|` (escaped to two) and the largest numbers, it must be within the 16,448-character bound."""
    spec = capture.format_spec(2**63 - 1, "module", "|" * 4096, "\\" * 4096, 2**63 - 1)
    assert len(spec) <= 16_448
    assert capture.parse(spec) == (2**63 - 1, "module", "|" * 4096, "\\" * 4096, 2**63 - 1)
    with tensorcanon.trace(tmp_path / "t.trace", capture=spec):
        pass
    with pytest.raises(UsageError):
        tensorcanon.trace(tmp_path / "t.trace", capture="0|op||" + "x" * 16_449 + "|0")


def test_a_spec_holding_characters_the_filesystem_encoding_cannot_write(tmp_path, monkeypatch):
    """$TENSORCANON_TRACE_CAPTURE of bytes that are not UTF-8 reaches Python as lone surrogates: a run
    with it must not fail at its end (saving, printing), whatever the spec matches."""
    monkeypatch.setenv(capture.ENV, "0|module||\udcff\udcfe|0")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    e = library_error_or_none(_short_run, tmp_path / "s.trace", model, opt)
    assert e is None or isinstance(e, UsageError)


def _short_run(path, model, opt, steps=1, **kw):
    with tensorcanon.trace(path, level="modules", model=model, optimizer=opt, **kw) as tr:
        for _ in range(steps):
            tr.step(torch.ones(2))
            tr.loss(model(torch.ones(2)).sum()).backward()
            opt.step()
            opt.zero_grad()


# --------------------------------------------------------------------------- resume

def _recorded(path, steps=3, level="steps"):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensorcanon.trace(path, level=level, model=model, optimizer=opt) as tr:
        for _ in range(steps):
            tr.step(torch.ones(2))
            tr.loss(model(torch.ones(2)).sum()).backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def _snapshot(folder) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if os.path.islink(p):
            out[name] = ("link", os.readlink(p))
        elif os.path.isfile(p):
            with open(p, "rb") as fh:
                out[name] = fh.read()
        else:
            out[name] = ("other", os.lstat(p).st_mode)
    return out


@pytest.mark.parametrize("resume_at", [np.bool_(True), np.bool_(False), torch.tensor(True), np.uint64(2**63),
                                       np.int8(-1), fractions.Fraction(1), decimal.Decimal(1), np.float64(1.0), "1",
                                       b"1", 1 + 0j, [1]],
                         ids=["np_true", "np_false", "torch_bool", "np_uint64_2**63", "np_int8_minus_1", "fraction",
                              "decimal", "np_float64", "text", "bytes", "complex", "list"])
def test_a_resume_at_of_another_type_changes_no_byte(tmp_path, resume_at):
    """resume_at is an int or a numpy integer, never a bool, in [0, 2^62]: numpy's bool is not an
    integer, a bool tensor is a bool, a Fraction, a Decimal, a numpy float are not whole numbers the docs accept. Every
    refusal is a UsageError naming resume_at and changes no byte of the folder."""
    path = tmp_path / "run.trace"
    model, opt = _recorded(path)
    before = _snapshot(tmp_path)
    with pytest.raises(UsageError, match="resume_at"):
        with tensorcanon.trace(path, level="steps", model=model, optimizer=opt, resume_at=resume_at) as tr:
            tr.step(torch.ones(2))
    assert _snapshot(tmp_path) == before


def test_a_numpy_integer_resume_at_is_accepted(tmp_path):
    path = tmp_path / "run.trace"
    model, opt = _recorded(path)
    with tensorcanon.trace(path, level="steps", model=model, optimizer=opt, resume_at=np.int64(2)) as tr:
        tr.step(torch.ones(2))
    assert max(r.step for r in layout.Reader(path)) == 2
    layout.verify(path)


def _not_a_trace(kind: str, path, tmp_path) -> None:
    if kind == "empty":
        open(path, "wb").close()
    elif kind == "magic_only":
        path.write_bytes(MAGIC)
    elif kind == "secret_text":
        path.write_bytes(b"root:x:0:0:TOPSECRET-hunter2:/root:/bin/bash\n" * 4)
    elif kind == "tensorcanon_file":
        tensorcanon.save({"w": torch.zeros(3)}, path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_loop":
        os.symlink(path, path)
    elif kind == "dangling_symlink":
        os.symlink(tmp_path / "gone" / "x.trace", path)
    elif kind == "symlink_to_fifo":
        os.mkfifo(tmp_path / "f")
        os.symlink(tmp_path / "f", path)
    elif kind == "header_of_9_items":
        path.write_bytes(framed(msgpack.packb([0, "tensorcanon-trace", 1, "steps", "xxh3-128", 0, 1, 0, 0])))
    elif kind == "frame_length_4_GiB":
        path.write_bytes(MAGIC + struct.pack("<I", 2**32 - 1) + b"\x00" * 64)
    elif kind == "missing":
        pass
    else:  # pragma: no cover
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["empty", "magic_only", "secret_text", "tensorcanon_file", "directory", "fifo",
                                  "symlink_loop", "dangling_symlink", "symlink_to_fifo", "header_of_9_items",
                                  "frame_length_4_GiB", "missing"])
def test_resuming_what_is_not_a_trace_is_refused_by_name_and_changes_nothing(tmp_path, kind):
    """resume_at=k continues "the trace of a stopped run": a path that holds no trace (a text file, a
    tensorcanon file, a FIFO, a link loop, nothing) is a library error naming the path, raised before
    any byte is written, without blocking and without quoting the file's bytes."""
    path = tmp_path / "run.trace"
    _not_a_trace(kind, path, tmp_path)
    before = _snapshot(tmp_path)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadline():
        e = library_error_or_none(_short_run, path, model, opt, resume_at=1)
    if kind == "magic_only":  # a crashed run's trace that stopped before its header: a fresh trace is fine too
        if e is None:
            return
    assert e is not None, f"resuming a {kind} was accepted"
    assert _snapshot(tmp_path) == before
    text = str(e)
    assert "run.trace" in text or str(tmp_path) in text, text
    for leak in ("TOPSECRET", "hunter2", "root:x"):
        assert leak not in text


def test_resuming_a_trace_cut_inside_a_frame_gives_a_trace_that_verifies(tmp_path):
    """A run killed in the middle of writing a frame leaves a partial frame: the crashed trace's complete
    frames are its records. Resumed after its last step, the partial frame must not stay in the middle of
    the file (the result would be a trace its own reader refuses)."""
    path = tmp_path / "run.trace"
    model, opt = _recorded(path, steps=2)
    data = path.read_bytes()
    records = [r for r in layout.Reader(path)]
    path.write_bytes(data[: len(data) - 30])  # inside the end frame or the last record
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tensorcanon.trace(path, level="steps", model=model, optimizer=opt, resume_at=2) as tr:
            tr.step(torch.ones(2))
    assert layout.verify(path)[1] >= len(records) - 1
    assert max(r.step for r in layout.Reader(path)) == 2


def test_resuming_keeps_no_record_that_verify_refuses(tmp_path):
    """Every record kept is "read and checked"; verify also checks the call-index rule. A trace whose
    kept records lie about their call indices is refused before any byte changes, or, if continued, the
    result still verifies: a resume never writes a trace the library's own verify calls CORRUPT."""
    path = tmp_path / "run.trace"
    write_trace(path, head("steps"), batch_rec(0, call=0), batch_rec(0, call=0), batch_rec(1, call=0))
    before = _snapshot(tmp_path)
    e = library_error_or_none(_short_run_steps, path, resume_at=1)
    if e is not None:
        assert _snapshot(tmp_path) == before
        assert "call" in str(e)
    else:
        layout.verify(path)


def _short_run_steps(path, **kw):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tensorcanon.trace(path, level="steps", model=model, optimizer=opt, **kw) as tr:
            tr.step(torch.ones(2))
            opt.step()


def test_resuming_with_a_damaged_kept_frame_changes_nothing_and_a_damaged_cut_frame_is_fine(tmp_path):
    """Every record kept (steps before k) is checked: a flipped byte there refuses the resume and leaves
    every file as it was; a flipped byte in a record of step k is cut off with it, or refused alike."""
    path = tmp_path / "run.trace"
    payloads = [head("steps"), batch_rec(0), batch_rec(1), batch_rec(2)]
    good = framed(*payloads)
    first_record = len(MAGIC) + 4 + len(payloads[0]) + 8 + 4 + 5  # a byte inside step 0's record
    path.write_bytes(good[:first_record] + bytes([good[first_record] ^ 1]) + good[first_record + 1:])
    before = _snapshot(tmp_path)
    e = library_error_or_none(_short_run_steps, path, resume_at=2)
    assert isinstance(e, (FormatError, IntegrityError)), e
    assert _snapshot(tmp_path) == before
    last = len(good) - 12
    path.write_bytes(good[:last] + bytes([good[last] ^ 1]) + good[last + 1:])  # inside step 2's record
    before = _snapshot(tmp_path)
    e = library_error_or_none(_short_run_steps, path, resume_at=2)
    if e is None:  # cut off with step 2
        layout.verify(path)
    else:  # or refused: a damaged frame's step cannot be known
        assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("theirs", [dict(algorithm="sha256"), dict(level="ops"), dict(rank=0, world_size=2)],
                         ids=["sha256", "ops", "world_2"])
def test_a_refused_resume_changes_neither_the_trace_nor_its_run_facts_nor_its_capture(tmp_path, theirs):
    """"any failure is an error and leaves the file as it was": the run's facts (PATH.run.json) and a
    capture beside it are files of the trace too; the refusal changes none of them."""
    path = tmp_path / "run.trace"
    digest = bytes(32) if theirs.get("algorithm") == "sha256" else DA
    write_trace(path, head(**{"level": "steps", **theirs}),
                record(phase="data", kind="batch", name="batch", role="batch", digest=digest),
                record(step=1, phase="data", kind="batch", name="batch", role="batch", digest=digest))
    (tmp_path / "run.trace.run.json").write_text('[{"pid": 1}]')
    tensorcanon.save({"spec": SPEC, "tensors": {}, "texts": {}}, capture.capture_path(str(path)))
    before = _snapshot(tmp_path)
    e = library_error_or_none(_short_run_steps, path, resume_at=1, capture="1|module||x|0")
    assert isinstance(e, UsageError), e
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("content", [b"[" * 200_000 + b"]" * 200_000, b"{\"a\": 1}", b"\xff\xfe not utf-8",
                                     b"not json", b"[1, 2", b"null", b"\"text\"", b"[NaN, Infinity]",
                                     b"[" + b"1" * 5000 + b"]"],
                         ids=["nested_200000", "object", "not_utf8", "not_json", "cut", "null", "a_text",
                              "nan", "int_5000_digits"])
def test_a_hostile_run_facts_file_does_not_break_a_resume(tmp_path, content):
    """A resumed run adds its facts to the list PATH.run.json holds, read if it is a regular file of at
    most 16 MiB, "else the list starts again": whatever the file holds (deep nesting, an object, bytes
    that are not UTF-8, a 5,000-digit number), the run goes on or fails with a library error, and the
    facts written after it hold a list of runs."""
    path = tmp_path / "run.trace"
    _recorded(path, steps=2)
    facts = tmp_path / "run.trace.run.json"
    facts.write_bytes(content)
    e = library_error_or_none(_short_run_steps, path, resume_at=1)
    if e is None:
        assert isinstance(json.loads(facts.read_text())["runs"], list)


def test_resuming_a_trace_of_many_large_records_holds_none_of_them(tmp_path):
    """"The trace is read as a stream": 2,000 records of four 4,096-character texts each (~33 MB), one
    per step before k, must be checked without holding them (a traced peak of a few MiB)."""
    path = tmp_path / "run.trace"
    long = "n" * 4096
    seed = 0
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        for payload in [head("steps")] + [
                record(step=s, phase="data", kind="batch", scope=long, name=long, role=long, note=long)
                for s in range(2000)]:
            check = xxhash.xxh3_64_intdigest(payload, seed=seed)
            fh.write(struct.pack("<I", len(payload)) + payload + struct.pack("<Q", check))
            seed = check
    assert path.stat().st_size > 30_000_000
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tensorcanon.trace(path, level="steps", model=model, optimizer=opt, resume_at=2000) as tr:
                tr.step(torch.ones(2))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"resuming a {path.stat().st_size >> 20} MiB trace peaked at {peak >> 20} MiB"


# --------------------------------------------------------------------------- environment and paths

@pytest.mark.parametrize("env", [{"RANK": " 1"}, {"RANK": "1 "}, {"RANK": "+1"}, {"RANK": "0x1"},
                                 {"RANK": "00000000001"}, {"RANK": "9999999999"}, {"WORLD_SIZE": "0"},
                                 {"WORLD_SIZE": "2147483649"}, {"RANK": "2", "WORLD_SIZE": "2"},
                                 {"RANK": "1"}, {"RANK": "1\n"}, {"WORLD_SIZE": "\uff12"}],
                         ids=["rank_space_1", "rank_1_space", "rank_plus", "rank_hex", "rank_11_digits",
                              "rank_over_world", "world_0", "world_2**31+1", "rank_2_of_2",
                              "rank_1_no_world", "rank_newline", "world_fullwidth"])
def test_an_environment_rank_or_world_size_out_of_rule_is_a_usage_error_naming_it(tmp_path, monkeypatch, env):
    """$RANK and $WORLD_SIZE are ASCII digits, at most 10; a world size in [1, 2^31], a rank in
    [0, world size): anything else a UsageError naming the variable, before any file is written."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = _snapshot(tmp_path)
    with pytest.raises(UsageError, match=r"\$(RANK|WORLD_SIZE)|rank|world"):
        with tensorcanon.trace(tmp_path / "t.trace"):
            pass
    assert _snapshot(tmp_path) == before


def test_environment_numbers_with_leading_zeros_are_the_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0000000001")
    monkeypatch.setenv("WORLD_SIZE", "02")
    with tensorcanon.trace(tmp_path / "t.trace") as tr:
        tr.step(torch.ones(1))
    got = layout.Reader(str(tmp_path / "t.rank1.trace")).header
    assert (got.rank, got.world_size) == (1, 2)


@pytest.mark.parametrize("level", ["OPS", "ops ", "", "op", "modules\x00", "\u043eps", "x" * 10_000])
def test_a_level_from_the_environment_that_is_none_is_a_usage_error(tmp_path, monkeypatch, level):
    """TENSORCANON_TRACE_LEVEL replaces the level the script gives: a value that is not a level is a
    UsageError naming the variable (or, empty, the level the script gives)."""
    if "\x00" in level:
        level = level.replace("\x00", "\x01")  # (an environment value cannot hold NUL)
    monkeypatch.setenv("TENSORCANON_TRACE_LEVEL", level)
    e = library_error_or_none(lambda: tensorcanon.trace(tmp_path / "t.trace", level="steps").__enter__())
    if level == "":
        assert e is None or isinstance(e, UsageError)
    else:
        assert isinstance(e, UsageError) and "TENSORCANON_TRACE_LEVEL" in str(e), e


@pytest.mark.parametrize("where", ["symlink_to_directory", "symlink_loop", "dangling_into_missing_folder",
                                   "symlink_to_fifo", "nul_in_path", "empty_path", "file_descriptor", "bytes_path",
                                   "parent_is_a_file", "name_too_long"])
def test_a_trace_path_that_cannot_be_a_trace_is_a_library_error(tmp_path, where):
    """A trace path that is a directory (through a link too), a FIFO (through a link: opening it would
    block), in a missing folder (through a dangling link too), or not a path at all (NUL, empty, an int
    that open() would take as a file descriptor): a UsageError or MissingFileError naming the path,
    checked before any file is written."""
    path: object = tmp_path / "run.trace"
    if where == "symlink_to_directory":
        os.symlink(tmp_path, path)
    elif where == "symlink_loop":
        os.symlink(path, path)
    elif where == "dangling_into_missing_folder":
        os.symlink(tmp_path / "no" / "such" / "x.trace", path)
    elif where == "symlink_to_fifo":
        os.mkfifo(tmp_path / "fifo")
        os.symlink(tmp_path / "fifo", path)
    elif where == "nul_in_path":
        path = str(tmp_path / "run\x00.trace")
    elif where == "empty_path":
        path = ""
    elif where == "file_descriptor":
        path = os.open(os.devnull, os.O_WRONLY)
    elif where == "bytes_path":
        path = os.fsencode(str(tmp_path / "run.trace"))
    elif where == "parent_is_a_file":
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "run.trace"
    elif where == "name_too_long":
        path = tmp_path / ("x" * 300 + ".trace")
    before = _snapshot(tmp_path)
    try:
        with deadline():
            e = library_error_or_none(_short_run, path, torch.nn.Linear(2, 2),
                                      torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    finally:
        if where == "file_descriptor":
            os.close(path)  # type: ignore[arg-type]
    if where == "bytes_path" and e is None:  # a bytes path may be taken as the path it encodes
        assert (tmp_path / "run.trace").exists()
        return
    assert isinstance(e, (UsageError, MissingFileError, FileAccessError)), e
    assert "trace path" in str(e) or str(tmp_path)[:40] in str(e), e
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("template", ["run{.trace", "run{x}.trace", "run{0}.trace", "run{rank.__class__}.trace",
                                      "run}{rank}.trace", "run{rank}{rank}.trace", "run{{rank}}.trace"])
def test_braces_in_a_trace_path_are_text_except_rank(tmp_path, template):
    """TRACE.md: `{rank}` in the path is replaced. Other braces are text: a path holding "{", "{x}" or
    "{rank.__class__}" is a file name, never a format string (KeyError, IndexError, an attribute walk)."""
    path = tmp_path / template
    e = library_error_or_none(lambda: _traced_rank(path))
    assert e is None, e
    expected = template.replace("{rank}", "1")
    if "{rank}" not in template:
        expected = expected[: -len(".trace")] + ".rank1.trace"
    assert (tmp_path / expected).exists(), sorted(os.listdir(tmp_path))


def _traced_rank(path):
    with tensorcanon.trace(path, rank=1, world_size=2) as tr:
        tr.step(torch.ones(1))


@pytest.mark.parametrize("which", ["run_json_directory", "run_json_fifo", "capture_directory", "capture_fifo"])
def test_a_run_facts_or_capture_path_that_is_not_a_file_is_refused_before_anything_is_written(tmp_path, which):
    """SECURITY.md: the trace, PATH.run.json and the capture are checked "before any of them is written"."""
    path = tmp_path / "run.trace"
    target = tmp_path / ("run.trace.run.json" if which.startswith("run_json") else
                         os.path.basename(capture.capture_path(str(path))))
    if which.endswith("directory"):
        target.mkdir()
    else:
        os.mkfifo(target)
    before = _snapshot(tmp_path)
    model = torch.nn.Linear(2, 2)
    with deadline():
        e = library_error_or_none(_short_run, path, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  capture="0|module||x|0")
    assert isinstance(e, UsageError) and str(target) in str(e), e
    assert _snapshot(tmp_path) == before


def test_a_run_facts_file_that_is_a_symlink_is_replaced_not_written_through(tmp_path):
    """PATH.run.json is written atomically (a temporary file renamed over it): a link planted there to
    another file must not make the run write into that file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "run.trace"
    os.symlink(victim, tmp_path / "run.trace.run.json")
    model = torch.nn.Linear(2, 2)
    _short_run(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert victim.read_text() == "precious"


# --------------------------------------------------------------------------- --tolerance

@pytest.mark.parametrize("tol", [decimal.Decimal("NaN"), decimal.Decimal("sNaN"), decimal.Decimal("1e400"),
                                 decimal.Decimal("-1"), complex(0.1, 0), "0.1", [0.1], object(), np.float64("nan"),
                                 np.float32("inf"), fractions.Fraction(10**400, 3), torch.tensor(float("nan")),
                                 -(10**400), np.array([0.1, 0.2])],
                         ids=["decimal_nan", "decimal_snan", "decimal_1e400", "decimal_minus_1", "complex", "text",
                              "list", "object", "np_nan", "np_inf", "fraction_huge", "torch_nan", "minus_10**400",
                              "np_array"])
def test_a_tolerance_that_is_not_a_finite_number_is_a_usage_error(tmp_path, tol):
    """tolerance is a finite number >= 0, else a UsageError: a Decimal NaN (whose comparison raises
    InvalidOperation), a signalling NaN, a complex, a text, a huge Fraction (OverflowError in float())."""
    a, b = pair(tmp_path)
    with pytest.raises(UsageError, match="tolerance"):
        tensorcanon.first_divergence(a, b, tolerance=tol)


@pytest.mark.parametrize("tol", [0, -0.0, 5e-324, 1.7976931348623157e308, fractions.Fraction(1, 3),
                                 np.float16(0.5), np.int64(1), 10**300])
def test_a_finite_tolerance_of_any_number_type_is_accepted(tmp_path, tol):
    a, b = pair(tmp_path, record(sumsq=1.0), record(sumsq=4.0, digest=DB))  # norms 1 and 2: 0.5 apart
    d = tensorcanon.first_divergence(a, b, tolerance=tol)
    assert d.same == (float(tol) >= 0.5)


@pytest.mark.parametrize("arg,code", [("nan", 2), ("NaN", 2), ("inf", 2), ("-inf", 2), ("1e400", 2), ("-1", 2),
                                      ("", 2), ("abc", 2), ("0x1p-3", 2), ("-0", 1), ("0", 1), ("1e-400", 1),
                                      ("1_000", 0), ("\u0661", 0), (" 0.7 ", 0)])
def test_the_command_lines_tolerance(tmp_path, arg, code):
    """--tolerance R: a finite number >= 0 (what Python's float() reads), else exit 2 with an error, never
    the "bug in tensorcanon" line."""
    a, b = pair(tmp_path, record(sumsq=1.0), record(sumsq=4.0, digest=DB))
    got, out, err = run_cli("diverge", f"--tolerance={arg}", a, b)
    assert got == code, (got, out, err)
    assert_foreseen(err)


@pytest.mark.parametrize("sa,sb", [(1e308, 1.7976931348623157e308), (5e-324, 0.0), (0.0, 5e-324),
                                   (1.7976931348623157e308, 1.7976931348623157e308), (1e-320, 1e-320)])
def test_extreme_finite_sums_of_squares_under_a_tolerance(tmp_path, sa, sb):
    """Sums of squares at the ends of float64 (the norms' quotient must not overflow or divide by zero):
    with different digests, a tolerance of 0 never says same; a tolerance of 1 (any relative difference
    is at most 1) always does; the JSON stays standard."""
    a, b = pair(tmp_path, record(sumsq=sa), record(sumsq=sb, digest=DB))
    for tol, same in ((0.0, False), (1.0, True)):
        d = tensorcanon.first_divergence(a, b, tolerance=tol)
        assert d.same is same, (sa, sb, tol)
        json.dumps(d.to_json(), allow_nan=False)
    code, out, err = run_cli("diverge", "--json", "--tolerance", "0", a, b)
    assert code == 1, (code, out, err)
    assert_foreseen(err)


@pytest.mark.parametrize("sa,sb", [(float("nan"), float("nan")), (float("inf"), float("inf")), (float("nan"), 1.0),
                                   (float("inf"), float("nan"))])
def test_non_finite_sums_of_squares_give_an_honest_report_in_every_output(tmp_path, sa, sb):
    """Non-finite sums of squares: compared by digest (different: exit 1) under a tolerance; the text
    report, --json (standard JSON) and --html must all come out, never the "bug" line."""
    a, b = pair(tmp_path, record(sumsq=sa), record(sumsq=sb, digest=DB))
    page = tmp_path / "p.html"
    for argv in (["diverge", "--tolerance", "0.5", a, b], ["diverge", "--json", a, b],
                 ["diverge", "--json", "--tolerance", "0.5", a, b], ["diverge", "--html", page, a, b],
                 ["diverge", "--html", page, "--tolerance", "0.5", a, b]):
        code, out, err = run_cli(*argv)
        assert code == 1, (argv, code, out, err)
        assert_foreseen(err)
        if "--json" in argv:
            json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    # equal digests: the same record, whatever its sum of squares
    a, b = pair(tmp_path, record(sumsq=sa), record(sumsq=sa))
    code, out, err = run_cli("diverge", "--json", "--tolerance", "0.5", a, b)
    assert code == 0, (code, out, err)
    json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


# --------------------------------------------------------------------------- names reaching a terminal

def test_verifys_report_of_a_hostile_trace_escapes_its_texts(tmp_path):
    """verify names the record it refuses: a lying call index of a batch whose name holds ESC, CR and
    U+202E, and a header whose level is such a text, must reach the terminal escaped."""
    lying = write_trace(tmp_path / "lie.trace", head("steps"), batch_rec(0, name=HOSTILE_TEXT, call=0),
                        batch_rec(0, name=HOSTILE_TEXT, call=0), ending(2))
    bad_level = write_trace(tmp_path / "lvl.trace", head(HOSTILE_TEXT), ending(0))
    bad_phase = write_trace(tmp_path / "ph.trace", head(), record(phase=HOSTILE_TEXT), ending(1))
    for path in (lying, bad_level, bad_phase):
        code, out, err = run_cli("verify", path)
        assert code in (1, 2), (code, out, err)
        assert_foreseen(err)
        assert not RAW_CONTROLS.search(out + err), repr(out + err)
        code, out, err = run_cli("diverge", path, path)
        assert code == 2 or code == 0, (code, out, err)
        assert not RAW_CONTROLS.search(out + err), repr(out + err)


def test_diverge_error_messages_escape_the_paths_given(tmp_path):
    """A trace path named with controls, missing or damaged: the error line escapes it."""
    evil = str(tmp_path / "x\x1b[2K\rsame: 1 records compared\u202e.trace")
    a, _ = pair(tmp_path)
    code, out, err = run_cli("diverge", a, evil)
    assert code == 2 and not RAW_CONTROLS.search(out + err), repr(err)
    with open(evil, "wb") as fh:
        fh.write(MAGIC + b"\x05\x00\x00\x00abc")
    code, out, err = run_cli("diverge", evil, a)
    assert code in (1, 2) and not RAW_CONTROLS.search(out + err), repr(out + err)


# --------------------------------------------------------------------------- verify on hostile traces

HOSTILE_VERIFY = {
    "magic_only": (MAGIC, (1, 2)),
    "header_only_no_end": (framed(head()), (0, 1)),
    "header_and_end": (framed(head(), ending(0)), (0,)),
    "end_minus_1": (framed(head(), msgpack.packb([2, -1])), (1,)),
    "end_2_64": (framed(head(), msgpack.packb([2, 2**64 - 1])), (1,)),
    "end_no_count": (framed(head(), msgpack.packb([2])), (1,)),
    "end_three_items": (framed(head(), msgpack.packb([2, 0, 0])), (1,)),
    "end_count_text": (framed(head(), msgpack.packb([2, "0"])), (1,)),
    "end_count_bool": (framed(head(), msgpack.packb([2, False])), (1,)),
    "end_count_float": (framed(head(), msgpack.packb([2, 0.0])), (1,)),
    "frame_tag_3": (framed(head(), msgpack.packb([3, 0])), (1,)),
    "empty_frame": (framed(head(), b""), (1,)),
    "trailing_bytes": (framed(head(), ending(0)) + b"\x00", (1,)),
    "two_ends": (framed(head(), ending(0), ending(0)), (1,)),
    "header_rank_bool": (framed(msgpack.packb([0, "tensorcanon-trace", 1, "ops", "xxh3-128", False, True]),
                                 ending(0)), (1,)),
    "header_world_0": (framed(head(world_size=0, rank=0), ending(0)), (1,)),
    "header_world_2_63": (framed(head(world_size=2**63, rank=0), ending(0)), (1,)),
    "header_version_2": (framed(msgpack.packb([0, "tensorcanon-trace", 2, "ops", "xxh3-128", 0, 1]), ending(0)),
                         (1,)),
    "record_tag_true": (framed(head(), msgpack.packb([True, *msgpack.unpackb(record())[1:]]), ending(1)), (1,)),
    "header_tag_false": (framed(msgpack.packb([False, "tensorcanon-trace", 1, "ops", "xxh3-128", 0, 1]), ending(0)),
                         (1,)),
    "header_version_true": (framed(msgpack.packb([0, "tensorcanon-trace", True, "ops", "xxh3-128", 0, 1]),
                                   ending(0)), (1,)),
    "header_algorithm_md5": (framed(head(algorithm="md5"), ending(0)), (1,)),
    "sha256_digest_of_16": (framed(head(algorithm="sha256"), record(), ending(1)), (1,)),
    "call_is_bool": (framed(head(), record(call=True), ending(1)), (1,)),
    "shape_has_bool": (framed(head(), record(shape=(True, 2)), ending(1)), (1,)),
    "sumsq_is_int": (framed(head(), record(sumsq=1), ending(1)), (1,)),
    "sumsq_is_bool": (framed(head(), record(sumsq=True), ending(1)), (1,)),
    "step_2_63": (framed(head(), record(step=2**63), ending(1)), (1,)),
    "note_is_bytes": (framed(head(), record(note=b"x"), ending(1)), (1,)),
    "steps_go_back_with_a_repeated_call": (framed(head("steps"), batch_rec(0), batch_rec(1), batch_rec(0),
                                                  ending(3)), (1,)),
    "grad_call_gap": (framed(head("modules"), record(phase="backward", kind="grad", name="w", role="grad", call=0),
                             record(phase="backward", kind="grad", name="w", role="grad", call=2), ending(2)), (1,)),
    "loss_in_two_phases_then_call_1": (framed(head("steps"), record(kind="loss", name="loss", role="loss", call=1),
                                              ending(1)), (1,)),
}


@pytest.mark.parametrize("which", sorted(HOSTILE_VERIFY))
def test_verify_on_a_hostile_trace_exits_as_documented(tmp_path, which):
    """verify: 0 OK, 1 damaged (CORRUPT naming the record), 2 error; never a traceback or the "bug" line.
    Values the format says are integers are not bools or floats; a step that goes back to repeat a call
    index is a lie the call-index rule refuses."""
    data, codes = HOSTILE_VERIFY[which]
    path = tmp_path / "h.trace"
    path.write_bytes(data)
    code, out, err = run_cli("verify", path)
    assert code in codes, (which, code, out, err)
    assert_foreseen(err)
    code, out, err = run_cli("verify", "--json", path)
    assert code in codes, (which, code, out, err)
    json.loads(out)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink_loop", "missing", "empty", "symlink_to_fifo"])
def test_verify_and_diverge_of_a_trace_path_that_is_no_file(tmp_path, kind):
    """A trace argument that is a directory, a FIFO (also through a link: it would block), a link loop,
    missing or empty: exit 2 (an error) without blocking or the "bug" line; for verify an empty file may
    also be a damaged one (1)."""
    path = tmp_path / "t.trace"
    _not_a_trace({"directory": "directory", "fifo": "fifo", "symlink_loop": "symlink_loop", "missing": "missing",
                  "empty": "empty", "symlink_to_fifo": "symlink_to_fifo"}[kind], path, tmp_path)
    good = write_trace(tmp_path / "good.trace", head(), record(), ending(1))
    with deadline():
        code, out, err = run_cli("verify", path)
        assert code in ((1, 2) if kind == "empty" else (2,)), (code, out, err)
        assert_foreseen(err)
        code, out, err = run_cli("diverge", good, path)
        assert code == 2, (code, out, err)
        assert_foreseen(err)


def test_verify_expect_on_a_trace_is_an_error_not_a_bug(tmp_path):
    """verify --expect DIGEST requires a file digest; a trace has none (its records are checked by
    their chain): asking is an error of use (exit 2), never the "bug in tensorcanon" line, and never OK."""
    good = write_trace(tmp_path / "good.trace", head(), record(), ending(1))
    for digest in ("xxh3-128:" + "0" * 32, "sha256:" + "0" * 64):
        code, out, err = run_cli("verify", "--expect", digest, good)
        assert code == 2, (code, out, err)
        assert_foreseen(err)
        assert "trace" in err


def test_the_call_index_check_memory_does_not_grow_with_steps(tmp_path):
    """verify keeps one counter per name of the current step: 40 steps of 2,000 names each must peak
    near what one such step does, not 40 times it."""
    def build(path, steps):
        seed = 0
        with open(path, "wb") as fh:
            fh.write(MAGIC)
            for payload in [head("steps")] + [batch_rec(s, name=f"{s}-{j}-" + "k" * 200)
                                              for s in range(steps) for j in range(2000)] + [ending(steps * 2000)]:
                check = xxhash.xxh3_64_intdigest(payload, seed=seed)
                fh.write(struct.pack("<I", len(payload)) + payload + struct.pack("<Q", check))
                seed = check

    peaks = []
    for steps in (1, 40):
        path = tmp_path / f"s{steps}.trace"
        build(path, steps)
        tracemalloc.start()
        try:
            layout.verify(path)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] < 2 * peaks[0] + (1 << 20), peaks


# --------------------------------------------------------------------------- --html OUT

@pytest.mark.parametrize("out_kind", ["directory", "fifo", "symlink_to_b", "hard_link_to_a", "missing_folder",
                                      "symlink_loop", "dangling_symlink"])
def test_an_html_out_that_cannot_be_the_page_is_exit_2_and_destroys_nothing(tmp_path, out_kind):
    """--html OUT is written atomically; OUT that is A or B (a symlink, a hard link) is refused before
    anything is read; a missing folder is an error naming it. A directory, a FIFO, a link loop: exit 2,
    never the "bug" line, and both traces intact."""
    a, b = pair(tmp_path)
    saved = _snapshot(tmp_path)
    out = tmp_path / "page.html"
    if out_kind == "directory":
        out.mkdir()
    elif out_kind == "fifo":
        os.mkfifo(out)
    elif out_kind == "symlink_to_b":
        os.symlink(b, out)
    elif out_kind == "hard_link_to_a":
        os.link(a, out)
    elif out_kind == "missing_folder":
        out = tmp_path / "nope" / "page.html"
    elif out_kind == "symlink_loop":
        os.symlink(out, out)
    elif out_kind == "dangling_symlink":
        os.symlink(tmp_path / "gone" / "page.html", out)
    with deadline():
        code, stdout, err = run_cli("diverge", "--html", out, a, b)
    if out_kind in ("fifo", "symlink_loop", "dangling_symlink") and code == 1:
        assert os.path.isfile(out) and not os.path.islink(out)  # the page renamed over what was there
    else:
        assert code == 2, (code, stdout, err)
        assert_foreseen(err)
    now = _snapshot(tmp_path)
    assert now["a.trace"] == saved["a.trace"] and now["b.trace"] == saved["b.trace"]


# ------------------------------------------------------------- arguments of trace() and first_divergence()

@pytest.mark.parametrize("kwargs", [dict(capture=7), dict(capture=b"0|op||x|0"), dict(capture=["0|op||x|0"]),
                                    dict(level=None), dict(level=3), dict(level="OPS"), dict(level=b"ops"),
                                    dict(algorithm="md5"), dict(algorithm=None), dict(algorithm=b"xxh3-128"),
                                    dict(rank=torch.tensor(True), world_size=2), dict(rank=np.bool_(False)),
                                    dict(world_size=torch.tensor(True)), dict(rank=0, world_size=np.float32(2))],
                         ids=["capture_int", "capture_bytes", "capture_list", "level_none", "level_int", "level_upper",
                              "level_bytes", "algorithm_md5", "algorithm_none", "algorithm_bytes", "rank_torch_bool",
                              "rank_np_bool", "world_torch_bool", "world_np_float"])
def test_a_trace_argument_of_another_type_is_a_usage_error(tmp_path, kwargs):
    """trace()'s arguments: a capture spec is a text, a level one of three names, an algorithm one of the
    format's, a rank and world size whole numbers (an int or a numpy integer, never a bool: a torch bool
    tensor and numpy's bool are bools). Each refusal is a UsageError before any file is written."""
    before = _snapshot(tmp_path)
    e = library_error_or_none(lambda: tensorcanon.trace(tmp_path / "t.trace", **kwargs).__enter__())
    assert isinstance(e, UnsupportedAlgorithmError if "algorithm" in kwargs else UsageError), e
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("which", ["fd_int", "bool", "none", "bytes_of_a_path", "list"])
def test_first_divergence_of_what_is_not_a_trace_path(tmp_path, which):
    """first_divergence(a, b) takes paths: an int (which open() would take as a file descriptor: 0 is
    stdin), a bool, None, a list are not; a library error naming the argument, never a read of stdin."""
    a, b = pair(tmp_path)
    bad = {"fd_int": 0, "bool": True, "none": None, "bytes_of_a_path": os.fsencode(b), "list": [b]}[which]
    with deadline():
        e = library_error_or_none(tensorcanon.first_divergence, a, bad)
    if which == "bytes_of_a_path" and e is None:  # the path it encodes
        return
    assert isinstance(e, (UsageError, FileAccessError)), e


def test_resuming_at_the_largest_step_gives_a_trace_that_verifies(tmp_path):
    """resume_at may be 2^62: the steps after it (2^62, ...) are below the format's 2^63; the resumed trace
    verifies and diverge reads it."""
    path = tmp_path / "run.trace"
    model, opt = _recorded(path, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tensorcanon.trace(path, level="steps", model=model, optimizer=opt, resume_at=2**62) as tr:
            for _ in range(2):
                tr.step(torch.ones(2))
                opt.step()
    assert max(r.step for r in layout.Reader(path)) == 2**62 + 1
    layout.verify(path)
    code, _, err = run_cli("diverge", path, path)
    assert code == 0, err
