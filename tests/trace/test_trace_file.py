"""The trace file (docs/TRACE.md): every damage is a clear error naming the file and the record;
reading and comparing stream with bounded memory; first_divergence on synthetic traces."""

from __future__ import annotations

import math
import tracemalloc

import msgpack
import pytest
import xxhash

from tensorcanon import FormatError, TensorCanonError, first_divergence
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import layout
from tensorcanon.trace.compare import ENDS, EQUAL, INPUTS, PATHS
from tensorcanon.trace.layout import Record

D0, D1 = bytes(16), bytes(range(16))


def rec(step: int, name: str = "aten.mm.default", role: str = "out", digest: bytes = D0, sumsq: float = 1.0,
        kind: str = "op", phase: str = "forward", call: int = 0, dtype: str = "float32") -> Record:
    return Record(step, phase, kind, "layer", name, call, role, dtype, (2, 3), digest, sumsq, "")


def write(path, records, level: str = "ops", end: bool = True) -> None:
    with open(path, "wb") as fh:
        fh.write(layout.MAGIC)
        w = layout.Writer(fh)
        w.frame(msgpack.packb(layout.Header(level, "xxh3-128", 0, 1).payload()))
        for r in records:
            w.record(r)
        if end:
            w.end()


def read_all(path, strict: bool = True) -> list[Record]:
    with layout.Reader(path, strict=strict) as r:
        return list(r)


def test_records_come_back_as_written(tmp_path):
    records = [rec(0), rec(0, role="in.0", digest=D1), rec(1, kind="batch", phase="data", name="batch")]
    write(tmp_path / "t", records)
    assert read_all(tmp_path / "t") == records
    assert layout.verify(tmp_path / "t")[1] == 3


def test_every_truncation_is_a_clear_error_or_a_valid_prefix(tmp_path):
    records = [rec(s, call=c) for s in range(2) for c in range(3)]
    write(tmp_path / "t", records)
    data = (tmp_path / "t").read_bytes()
    cut = tmp_path / "cut"
    header_end = len(layout.MAGIC) + 4 + len(msgpack.packb(layout.Header("ops", "xxh3-128", 0, 1).payload())) + 8
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(FormatError) as e:
            read_all(cut)
        assert str(cut) in str(e.value)
        assert "record" in str(e.value) or "header" in str(e.value) or "magic" in str(e.value)
        try:
            prefix = read_all(cut, strict=False)
        except FormatError as e2:  # only a file cut inside its magic or header
            assert n < header_end, (n, e2)
        else:
            assert prefix == records[:len(prefix)]


def test_every_changed_byte_is_an_error_naming_the_record(tmp_path):
    records = [rec(s, call=c, digest=bytes([s, c] * 8)) for s in range(2) for c in range(2)]
    write(tmp_path / "t", records)
    data = bytearray((tmp_path / "t").read_bytes())
    bad = tmp_path / "bad"
    for i in range(len(data)):
        for flip in (0x01, 0x80):
            changed = bytearray(data)
            changed[i] ^= flip
            bad.write_bytes(bytes(changed))
            for strict in (True, False):
                try:
                    got = read_all(bad, strict=strict)
                except TensorCanonError as e:  # FormatError or IntegrityError, never a foreign exception
                    assert str(bad) in str(e)
                else:  # only a changed length can end a non-strict read early: never a changed record
                    assert not strict and got == records[:len(got)], i


def _forged(path, payload: list) -> None:
    """A trace whose one record has a valid check but ``payload`` as its content."""
    with open(path, "wb") as fh:
        fh.write(layout.MAGIC)
        w = layout.Writer(fh)
        w.frame(msgpack.packb(layout.Header("ops", "xxh3-128", 0, 1).payload()))
        w.frame(msgpack.packb(payload, use_bin_type=True))


@pytest.mark.parametrize(("change", "said"), [
    ({1: -1}, "step"), ({1: 2**63}, "step"), ({2: "sideways"}, "phase"),
    ({3: "weights"}, "kind"), ({6: -3}, "call index"), ({8: "float99"}, "dtype"), ({9: [2, -1]}, "shape"),
    ({9: [1] * 65}, "shape"), ({10: b"short"}, "digest"), ({11: -1.0}, "sum of squares"), ({11: "1"}, "sum"),
    ({5: 7}, "name"), ({12: "x" * 5000}, "note"),
])
def test_every_number_and_text_read_is_validated(tmp_path, change, said):
    payload = [layout.TAG_RECORD, 0, "forward", "op", "", "aten.mm.default", 0, "out", "float32", [2, 3], D0, 1.0, ""]
    for k, v in change.items():
        payload[k] = v
    _forged(tmp_path / "t", payload)
    with pytest.raises(FormatError, match=r"trace record 0: .*" + said) as e:
        read_all(tmp_path / "t")
    assert str(tmp_path / "t") in str(e.value)


def test_a_header_or_length_that_is_not_one(tmp_path):
    p = tmp_path / "t"
    p.write_bytes(b"not a trace at all")
    with pytest.raises(FormatError, match="not a tensorcanon trace"):
        read_all(p)
    with open(p, "wb") as fh:
        fh.write(layout.MAGIC)
        w = layout.Writer(fh)
        w.frame(msgpack.packb([layout.TAG_HEADER, layout.FORMAT, 99, "ops", "xxh3-128", 0, 1]))
    with pytest.raises(FormatError, match="version 99"):
        read_all(p)
    with open(p, "wb") as fh:  # a length past the limit is refused before anything is read
        fh.write(layout.MAGIC + (layout.MAX_PAYLOAD + 1).to_bytes(4, "little"))
    with pytest.raises(FormatError, match="length"):
        read_all(p)
    p.write_bytes(layout.MAGIC)
    payload = msgpack.packb([0, "tensorcanon-trace", 1, "ops", "xxh3-128", 3, 2])   # (Header.payload() refuses it)
    p.write_bytes(layout.MAGIC + len(payload).to_bytes(4, "little") + payload
                  + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little"))
    with pytest.raises(FormatError, match="rank 3"):
        read_all(p)


def test_the_command_line_on_damaged_traces(tmp_path, capsys):
    write(tmp_path / "t", [rec(0), rec(1)])
    data = bytearray((tmp_path / "t").read_bytes())
    data[-20] ^= 1
    (tmp_path / "bad").write_bytes(bytes(data))
    assert cli(["verify", str(tmp_path / "t")]) == 0
    assert cli(["verify", str(tmp_path / "bad")]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "trace record 1" in out and str(tmp_path / "bad") in out
    assert cli(["diverge", str(tmp_path / "t"), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "trace record 1" in err and "Traceback" not in err
    assert cli(["diverge", str(tmp_path / "t"), str(tmp_path / "missing")]) == 2


def test_reading_and_comparing_take_bounded_memory(tmp_path):
    """Peak memory while comparing two traces does not grow with their length (50 000 records,
    against 2 000): nothing is kept per record. (A benchmark compares traces of millions.)"""
    peaks = []
    for n in (2_000, 50_000):
        a, b = tmp_path / f"a{n}", tmp_path / f"b{n}"
        records = (rec(i // 1000, call=i % 1000, digest=D0 if i < n - 1 else D1) for i in range(n))
        write(a, records)
        write(b, (rec(i // 1000, call=i % 1000) for i in range(n)))
        tracemalloc.start()
        try:
            r = first_divergence(a, b, grid=True)
            assert layout.verify(a)[1] == n
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert not r.same and r.matched == n - 1
    assert peaks[1] < peaks[0] + 256 * 1024, peaks


def test_tolerance_compares_floats_by_their_norms(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, [rec(0, sumsq=4.0), rec(1, sumsq=4.0), rec(2, sumsq=4.0, kind="batch", phase="data", dtype="int64")])
    write(b, [rec(0, sumsq=4.0 * (1 + 1e-6), digest=D1), rec(1, sumsq=9.0, digest=D1),
              rec(2, sumsq=4.0, kind="batch", phase="data", dtype="int64", digest=D1)])
    exact = first_divergence(a, b)
    assert exact.first is not None and exact.first["step"] == 0
    loose = first_divergence(a, b, tolerance=1e-3)
    assert loose.first is not None and loose.first["step"] == 1 and math.isclose(loose.first["distance"], 1 / 3)
    assert loose.later_differing == 1  # the int64 batch differs whatever the tolerance
    assert cli(["diverge", "--tolerance", "0.5", str(a), str(b)]) == 1
    assert cli(["diverge", "--tolerance", "-1", str(a), str(b)]) == 2


def test_verdicts_and_continuation_past_different_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, [rec(0, role="in.0"), rec(0), rec(1, name="aten.add.Tensor"), rec(1, name="aten.relu.default"),
              rec(2), rec(3, digest=D1)])
    write(b, [rec(0, role="in.0"), rec(0), rec(1, name="aten.sub.Tensor"), rec(2), rec(3)])
    r = first_divergence(a, b)
    assert r.verdict == PATHS and r.first is not None and r.first["step"] == 1 and r.matched == 2
    assert r.skipped == 2 and r.later_differing == 1 and r.later_steps == [1, 3]
    write(b, [rec(0, role="in.0"), rec(0, digest=D1)])
    r = first_divergence(a, b)
    assert (r.verdict, r.first and r.first["role"]) == (EQUAL, "out") and any("more records" in n for n in r.notes)
    write(b, [rec(0, role="in.0", digest=D1)])
    assert first_divergence(a, b).verdict == INPUTS
    write(b, [rec(0, role="in.0"), rec(0)], end=False)
    r = first_divergence(a, b)
    assert r.verdict == ENDS and r.complete == (True, False) and r.matched == 2
