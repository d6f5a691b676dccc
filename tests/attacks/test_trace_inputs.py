"""Red-team attacks on what a trace reads besides the trace file (issue 37, item 4): the captures
beside traces, capture specs, ``resume_at`` and the trace it continues, the environment and the
paths ``tensorcanon.trace`` is given, and the call indices ``verify`` checks (docs/TRACE.md,
docs/SECURITY.md "Trace files").

Each test is one attack, written from the docs; each failed before the fix (a foreign exception, a
crash of the documented procedure, a trace cut before the refusal, an allocation of a claimed
size, a file's bytes in a message, a lie that verified).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
import xxhash

import tensorcanon
from tensorcanon import FormatError, MissingFileError, UsageError
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import capture, layout

MAGIC = b"\x89TCTRC\r\n"
D16, D16B = bytes(range(16)), bytes(range(1, 17))


def frames(*payloads: bytes) -> bytes:
    out, seed = [MAGIC], 0
    for p in payloads:
        check = xxhash.xxh3_64_intdigest(p, seed=seed)
        out.append(struct.pack("<I", len(p)) + p + struct.pack("<Q", check))
        seed = check
    return b"".join(out)


def header(level="ops", rank=0, world_size=1) -> bytes:
    return msgpack.packb([0, "tensorcanon-trace", 1, level, "xxh3-128", rank, world_size])


def rec(step=0, phase="forward", kind="op", scope="", name="aten.mm.default", call=0, role="out",
        dtype="float32", shape=(2, 4), digest=D16, sumsq=1.0, note="") -> bytes:
    return msgpack.packb([1, step, phase, kind, scope, name, call, role, dtype, list(shape), digest, sumsq, note])


def end(n: int) -> bytes:
    return msgpack.packb([2, n])


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- captures

def two_traces(tmp_path, name="aten.mm.default", scope=""):
    """Two traces whose first divergence is the output of op ``name`` at step 0, call 0."""
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    a.write_bytes(frames(header(), rec(name=name, scope=scope), end(1)))
    b.write_bytes(frames(header(), rec(name=name, scope=scope, digest=D16B), end(1)))
    return str(a), str(b)


def put_captures(a, b, ta, tb, texts=None, spec="0|op||aten.mm.default|0"):
    for path, tensors in ((a, ta), (b, tb)):
        tensorcanon.save({"spec": spec, "tensors": tensors, "texts": texts or {}}, capture.capture_path(path))


def evidence(a, b):
    d = tensorcanon.first_divergence(a, b)  # a foreign exception here fails the test
    assert not d.same and d.first is not None
    return d, d.first.get("evidence")


class SparseMM(torch.nn.Module):
    """An ordinary model: a graph convolution, ``torch.sparse.mm`` of a fixed adjacency."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        i = torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 3, 3]])
        self.adj = torch.sparse_coo_tensor(i, torch.tensor([1.0, 1.0, 1.0, 1.0, weight]), (4, 4)).coalesce()

    def forward(self, x):
        return torch.sparse.mm(self.adj, self.lin(x))


def sparse_run(path, weight, capture_spec=None):
    torch.manual_seed(0)
    model = SparseMM(weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensorcanon.trace(path, level="ops", model=model, optimizer=opt, capture=capture_spec) as tr:
        tr.step(torch.ones(4, 4))
        tr.loss(model(torch.ones(4, 4)).sum()).backward()
        opt.step()


def test_the_documented_capture_procedure_on_a_model_with_torch_sparse_mm(tmp_path):
    """TRACE.md "The evidence": diverge names the call, both runs rerun with its spec, diverge again.
    With a sparse input it crashed (`unsupported memory format option Contiguous`, exit 2)."""
    a, b = str(tmp_path / "a.trace"), str(tmp_path / "b.trace")
    sparse_run(a, 0.5)
    sparse_run(b, 0.25)
    spec = tensorcanon.first_divergence(a, b).capture
    assert "sparse" in spec
    sparse_run(a, 0.5, spec)
    sparse_run(b, 0.25, spec)
    d, ev = evidence(a, b)
    sparse_roles = [r for r, v in ev.items() if v.get("layout") == "sparse_coo"]
    assert sparse_roles, ev
    values = ev[sparse_roles[0]]["values"]
    assert values["differ"] == 1 and values["first_values"] == [0.5, 0.25]
    assert ev[sparse_roles[0]]["indices"]["differ"] == 0
    assert ev["out"]["differ"] > 0
    code, out, err = run_cli("diverge", a, b)
    assert code == 1 and "evidence" in out, (code, out, err)


def test_captures_of_every_tensor_kind_are_compared(tmp_path):
    a, b = two_traces(tmp_path)
    nested_a = torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)])
    nested_b = torch.nested.nested_tensor([torch.zeros(2), torch.tensor([1.0, 7.0, 1.0])])
    jagged_a = torch.nested.nested_tensor([torch.zeros(2, 3), torch.ones(1, 3)], layout=torch.jagged)
    jagged_b = torch.nested.nested_tensor([torch.zeros(2, 3), torch.full((1, 3), 2.0)], layout=torch.jagged)
    csr = torch.eye(3).to_sparse_csr()
    ta = {"meta": torch.empty(3, 5, device="meta"), "nested": nested_a, "jagged": jagged_a, "csr": csr,
          "bf16": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "f8": torch.zeros(4).to(torch.float8_e4m3fn),
          "c64": torch.tensor([1 + 1j], dtype=torch.complex64), "u64": torch.tensor([1, 2], dtype=torch.uint64),
          "deep": torch.zeros([1] * 40), "kind": torch.zeros(3, 3)}
    tb = {"meta": torch.empty(3, 5, device="meta"), "nested": nested_b, "jagged": jagged_b, "csr": csr * 2,
          "bf16": torch.tensor([1.0, 2.5], dtype=torch.bfloat16), "f8": torch.ones(4).to(torch.float8_e4m3fn),
          "c64": torch.tensor([1 + 2j], dtype=torch.complex64), "u64": torch.tensor([1, 3], dtype=torch.uint64),
          "deep": torch.ones([1] * 40), "kind": torch.eye(3).to_sparse()}
    put_captures(a, b, ta, tb)
    _, ev = evidence(a, b)
    assert ev["meta"]["layout"] == "meta" and ev["meta"]["elements"] == 15
    assert ev["nested"]["differ"] == 1 and ev["nested"]["first_component"] == 1
    assert ev["jagged"]["values"]["differ"] == 3 and ev["jagged"]["offsets"]["differ"] == 0
    assert ev["csr"]["values"]["differ"] == 3 and ev["csr"]["col_indices"]["differ"] == 0
    assert ev["bf16"]["differ"] == 1 and ev["bf16"]["max_abs_diff"] == 0.5 and ev["bf16"]["max_ulp"] >= 1
    assert ev["f8"]["differ"] == 4 and ev["f8"]["max_abs_diff"] == 1.0
    assert ev["c64"]["differ"] == 1 and ev["c64"]["max_abs_diff"] == 1.0
    assert ev["u64"]["differ"] == 1 and ev["u64"]["first_values"] == [2, 3] and ev["u64"]["first_index"] == [1]
    assert ev["deep"]["differ"] == 1 and ev["deep"]["first_index"] == [0] * 40
    assert "differs" in ev["kind"]


def test_a_tiny_capture_with_a_huge_meta_tensor_allocates_nothing(tmp_path):
    """A capture of ~350 bytes holds a float32 meta tensor of 2^60 elements: comparing it must not
    ask the allocator for its size (it asked for 4 EiB)."""
    a, b = two_traces(tmp_path)
    huge = torch.empty(2**29, 2**31, device="meta")
    put_captures(a, b, {"out": huge}, {"out": huge})
    assert os.path.getsize(capture.capture_path(a)) < 1000
    tracemalloc.start()
    try:
        _, ev = evidence(a, b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ev["out"] == {"layout": "meta", "elements": 2**60,
                         "note": "meta tensors hold no values: their dtype and shape are equal"}
    assert peak < 16 << 20


@pytest.mark.parametrize("which", ["numpy_array", "list_of_tensors", "tensors_a_list", "texts_a_tensor",
                                   "no_spec", "spec_an_int", "plain_safetensors", "a_tensor"])
def test_a_capture_that_is_not_one_is_a_note_never_a_foreign_exception(tmp_path, which):
    a, b = two_traces(tmp_path)
    put_captures(a, b, {"out": torch.zeros(2)}, {"out": torch.ones(2)})
    spec = "0|op||aten.mm.default|0"
    bad = {"numpy_array": {"spec": spec, "tensors": {"out": np.zeros(2)}, "texts": {}},
           "list_of_tensors": {"spec": spec, "tensors": {"out": [torch.zeros(2)]}, "texts": {}},
           "tensors_a_list": {"spec": spec, "tensors": [torch.zeros(2)], "texts": {}},
           "texts_a_tensor": {"spec": spec, "tensors": {}, "texts": {"args": torch.zeros(1)}},
           "no_spec": {"tensors": {}, "texts": {}},
           "spec_an_int": {"spec": 7, "tensors": {}, "texts": {}},
           "a_tensor": torch.zeros(3)}.get(which)
    target = capture.capture_path(b)
    if which == "plain_safetensors":
        from safetensors.torch import save_file

        save_file({"out": torch.ones(2)}, target)
    else:
        tensorcanon.save(bad, target)
    _, ev = evidence(a, b)
    assert set(ev) == {"note"} and target in ev["note"], ev


def test_a_capture_that_links_to_a_secret_is_not_quoted(tmp_path):
    """A capture path that is a symlink to another file (/etc/passwd, a key): reading it must say
    what it is not, never show its bytes (the reader said "header declares 3475222254926655346
    bytes": the first 8 bytes of /etc/passwd as a number)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0:TOPSECRET-password-1234:/root:/bin/bash\n")
    a, b = two_traces(tmp_path)
    put_captures(a, b, {"out": torch.zeros(2)}, {"out": torch.ones(2)})
    os.unlink(capture.capture_path(b))
    os.symlink(secret, capture.capture_path(b))
    d, ev = evidence(a, b)
    shown = json.dumps(d.to_json()) + "\n".join(d.lines())
    as_number = str(int.from_bytes(secret.read_bytes()[:8], "little"))
    for leak in ("TOPSECRET", "root:x", as_number, secret.read_bytes()[:8].hex()):
        assert leak not in shown, leak
    assert set(ev) == {"note"} and "not a tensorcanon file" in ev["note"]


def test_a_capture_that_is_a_fifo_is_a_note(tmp_path):
    a, b = two_traces(tmp_path)
    put_captures(a, b, {"out": torch.zeros(2)}, {"out": torch.ones(2)})
    os.unlink(capture.capture_path(b))
    os.mkfifo(capture.capture_path(b))
    _, ev = evidence(a, b)
    assert set(ev) == {"note"} and "regular file" in ev["note"]


class MetaOp(torch.nn.Module):
    """A module that runs an op on a meta tensor (shape arithmetic), and one that quantizes."""

    def forward(self, x):
        torch.empty(2, 3, device="meta").mul(2)
        q = torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)
        return q.dequantize() * 2


@pytest.mark.parametrize("spec,role", [("0|op||aten.mul.Tensor|0", "out"),
                                       ("0|op||aten.quantize_per_tensor.default|0", "out")])
def test_capturing_a_call_on_a_meta_or_quantized_tensor_does_not_stop_the_run(tmp_path, spec, role):
    """Capturing copied every tensor to the CPU (a meta tensor cannot be: the run crashed) and
    saved it (a quantized tensor is refused: the run crashed at its next step)."""
    model = MetaOp()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    path = str(tmp_path / "m.trace")
    with tensorcanon.trace(path, level="ops", model=model, optimizer=opt, capture=spec) as tr:
        for _ in range(2):
            tr.step(torch.ones(4))
            tr.loss(model(torch.ones(4)).sum())
            opt.step()
    saved = tensorcanon.load(capture.capture_path(path))
    assert saved["spec"] == spec
    if "mul" in spec:
        assert saved["tensors"][role].is_meta and saved["tensors"][role].shape == (2, 3)
    else:
        assert saved["texts"][role].startswith("not captured:") and "quantized" in saved["texts"][role]


def test_a_module_whose_name_holds_a_bar_gets_a_spec_trace_accepts(tmp_path):
    """A module named `noise|x` (nn.Module.add_module allows it): diverge printed a spec of 6
    fields that trace() refused."""
    def run(path, bump, spec=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("noise|x", torch.nn.Linear(2, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tensorcanon.trace(path, level="modules", model=model, optimizer=opt, capture=spec) as tr:
            tr.step(torch.ones(2))
            if bump:
                with torch.no_grad():
                    model[0].bias.add_(1)
            tr.loss(model(torch.ones(2)).sum()).backward()
            opt.step()

    a, b = str(tmp_path / "a.trace"), str(tmp_path / "b.trace")
    run(a, False)
    run(b, True)
    spec = tensorcanon.first_divergence(a, b).capture
    assert spec == "0|module||noise\\|x|0"
    run(a, False, spec)
    run(b, True, spec)
    _, ev = evidence(a, b)
    assert ev["out"]["differ"] == 2 and ev["in.0"]["differ"] == 0


@pytest.mark.parametrize("spec", ["1" * 100_000 + "|op||aten.mm.default|0", "0|op||aten.mm.default|" + "9" * 5000,
                                  "²|op||aten.mm.default|0", "0|op||aten.mm.default|9223372036854775808",
                                  "0|op||a\\b|0", "0|op||a|b|0", "0|op||" + "x" * 20_000 + "|0"],
                         ids=["step_100000_digits", "call_5000_digits", "superscript", "call_2**63",
                              "bad_escape", "six_fields", "name_20000"])
def test_a_spec_whose_numbers_or_fields_lie_is_a_usage_error(tmp_path, spec, monkeypatch):
    """A 100,000-digit step raised ValueError (Python's int-digits limit); a superscript digit
    passed isdigit() and then int() failed."""
    with pytest.raises(UsageError, match="capture"):
        tensorcanon.trace(tmp_path / "t", capture=spec)
    monkeypatch.setenv(capture.ENV, spec)
    with pytest.raises(UsageError, match=capture.ENV):
        tensorcanon.trace(tmp_path / "t")


# --------------------------------------------------------------------------- resume

def recorded(path, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensorcanon.trace(path, level="steps", model=model, optimizer=opt) as tr:
        for _ in range(steps):
            tr.step(torch.ones(3))
            tr.loss(model(torch.ones(3)).sum()).backward()
            opt.step()
            opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("resume_at", [-1, 1.5, 10**30, "x", True, -(10**5000), 2**62 + 1],
                         ids=["minus_1", "1.5", "10**30", "x", "True", "minus_10**5000", "2**62+1"])
def test_a_resume_at_that_is_not_a_step_changes_no_byte(tmp_path, resume_at):
    path = tmp_path / "run.trace"
    model, opt = recorded(path)
    before, facts = path.read_bytes(), (tmp_path / "run.trace.run.json").read_bytes()
    with pytest.raises(UsageError, match="resume_at"):
        with tensorcanon.trace(path, model=model, optimizer=opt, resume_at=resume_at) as tr:
            tr.step(torch.ones(3))
    assert path.read_bytes() == before
    assert (tmp_path / "run.trace.run.json").read_bytes() == facts
    layout.verify(path)


@pytest.mark.parametrize("theirs,ours", [((1, 2, "steps"), (0, 1, "steps")), ((0, 2, "steps"), (0, 1, "steps")),
                                         ((0, 1, "modules"), (0, 1, "steps"))])
def test_a_trace_of_another_rank_world_size_or_level_is_not_continued(tmp_path, theirs, ours):
    rank, world, level = theirs
    path = tmp_path / "run.trace"
    step0 = rec(phase="data", kind="batch", name="batch", role="batch")
    path.write_bytes(frames(header(level, rank, world), step0, rec(step=1, phase="data", kind="batch",
                                                                     name="batch", role="batch")))
    before = path.read_bytes()
    with pytest.raises(UsageError, match="cannot continue"):
        with tensorcanon.trace(path, level=ours[2], rank=ours[0], world_size=ours[1], resume_at=1):
            pass
    assert path.read_bytes() == before


def hostile_resume_trace(path, records, name_length=4000):
    """A trace whose step 0 holds ``records`` parameter records, each of another long name."""
    seed = 0
    with open(path, "wb") as f:
        f.write(MAGIC)
        for p in [header("steps")] + [rec(phase="optimizer", kind="param", name=f"{i:08d}" + "w" * name_length,
                                          role="value") for i in range(records)]:
            check = xxhash.xxh3_64_intdigest(p, seed=seed)
            f.write(struct.pack("<I", len(p)) + p + struct.pack("<Q", check))
            seed = check


def test_resuming_a_hostile_trace_streams_it(tmp_path, recwarn):
    """SECURITY.md: resume streams the trace. 5,000 parameter records of 4,000-character names at
    step 0 (20 MiB): resuming at step 1 held every one (+415 MB for a 74 MiB trace); the traced
    peak must stay a small bound whatever the trace holds."""
    path = tmp_path / "run.trace"
    hostile_resume_trace(path, 5000)
    assert path.stat().st_size > 20_000_000
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracemalloc.start()
    try:
        with tensorcanon.trace(path, model=model, optimizer=opt, resume_at=1) as tr:
            tr.step(torch.ones(3))  # the resume check: reads the step-0 records again, one at a time
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"resuming a 20 MiB trace peaked at {peak >> 20} MiB"
    layout.verify(path)


@pytest.mark.parametrize("var,value", [("RANK", "x"), ("WORLD_SIZE", "two"), ("RANK", "1" * 5000),
                                       ("WORLD_SIZE", "٣"), ("RANK", "-1")],
                         ids=["rank_x", "world_two", "rank_5000_digits", "world_arabic_digit", "rank_minus_1"])
def test_an_environment_value_that_is_not_a_number_names_the_variable(tmp_path, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(UsageError, match=f"\\${var}"):
        tensorcanon.trace(tmp_path / "t")


@pytest.mark.parametrize("arg,value", [("rank", "0"), ("rank", 0.0), ("world_size", True), ("world_size", 2**40)])
def test_a_rank_or_world_size_argument_that_is_not_one_is_a_usage_error(tmp_path, arg, value):
    with pytest.raises(UsageError):
        tensorcanon.trace(tmp_path / "t", **{arg: value})


def test_a_trace_path_that_is_a_directory_or_in_a_missing_folder(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="directory") as e:
        with tensorcanon.trace(tmp_path):
            pass
    assert str(tmp_path) in str(e.value)
    missing = tmp_path / "no" / "such" / "run.trace"
    with pytest.raises(MissingFileError, match="does not exist") as e:
        with tensorcanon.trace(missing):
            pass
    assert str(tmp_path / "no" / "such") in str(e.value)
    monkeypatch.setenv("TENSORCANON_TRACE", str(tmp_path))
    with pytest.raises(UsageError, match="directory"):
        with tensorcanon.trace("elsewhere.trace"):
            pass
    fifo = tmp_path / "fifo.trace"
    os.mkfifo(fifo)
    monkeypatch.delenv("TENSORCANON_TRACE")
    with pytest.raises(UsageError, match="not a regular file"):  # opening it for writing would block
        with tensorcanon.trace(fifo):
            pass
    with pytest.raises(UsageError, match="directory"):
        with tensorcanon.trace(tmp_path, resume_at=0):
            pass


# --------------------------------------------------------------------------- call indices

def batch(call, step=0, name="batch"):
    return rec(step=step, phase="data", kind="batch", name=name, call=call, role=f"batch.{call}")


@pytest.mark.parametrize("records", [
    [batch(0), batch(0)],                      # two records claim one call
    [batch(1)],                                 # the first record of its name in the step claims call 1
    [batch(0), batch(2)],                       # a call skipped
    [batch(0, step=0), batch(1, step=1)],       # a new step starts again at 0
    [rec(phase="optimizer", kind="param", name="w", call=7, role="value")],
], ids=["duplicate", "starts_at_1", "gap", "not_restarted", "param_7"])
def test_records_with_lying_call_indices_do_not_verify(tmp_path, records):
    path = tmp_path / "lie.trace"
    path.write_bytes(frames(header("steps"), *records, end(len(records))))
    with pytest.raises(FormatError, match="call index"):
        layout.verify(path)
    code, out, _ = run_cli("verify", str(path))
    assert code == 1 and "CORRUPT" in out


# --------------------------------------------------------------------------- what a run hands the recorder

def _deep(n):
    v = torch.ones(1)
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize("batch", [{"k" * 5000: torch.ones(2)}, _deep(2000), {"n": 10**5000, 10**5000: torch.ones(1)}],
                         ids=["key_of_5000_characters", "nested_2000_deep", "int_of_5000_digits"])
def test_a_batch_the_reader_would_refuse_is_written_so_it_reads(tmp_path, batch):
    """The writer wrote a role of 5,006 characters that its own reader refused (the whole trace
    "damaged"); a batch nested 2,000 deep raised RecursionError and an int of 5,000 digits
    ValueError in the middle of the run."""
    path = tmp_path / "run.trace"
    with tensorcanon.trace(path) as tr:
        tr.step(batch)
    assert layout.verify(path)[1] > 0
    names = [r.role for r in layout.Reader(path) if r.kind == "batch"]
    assert names and all(len(n) <= layout.MAX_TEXT for n in names)
