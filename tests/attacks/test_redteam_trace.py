"""Red-team attacks on trace files (docs/TRACE.md "The file", docs/SECURITY.md "Trace files").

Traces are written here by hand from the format's text (magic, framed msgpack payloads, chained
xxh3-64 checks), so an attacker's trace has valid checks. Each test asserts the documented
behaviour: a damaged or hostile trace is a tensorcanon error (exit 2 naming the file) or an honest
report, never a traceback, a hang, unbounded memory or a report that says two different runs are
the same.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import msgpack
import pytest
import xxhash

import tensorcanon
from tensorcanon.format.errors import TensorCanonError
from tensorcanon.trace.layout import text_digest

MAGIC = b"\x89TCTRC\r\n"
D16 = bytes(range(16))
D16B = bytes(range(1, 17))


def frames(*payloads: bytes) -> bytes:
    out = [MAGIC]
    seed = 0
    for p in payloads:
        check = xxhash.xxh3_64_intdigest(p, seed=seed)
        out.append(struct.pack("<I", len(p)) + p + struct.pack("<Q", check))
        seed = check
    return b"".join(out)


def header(level="steps", algorithm="xxh3-128", rank=0, world_size=1) -> bytes:
    return msgpack.packb([0, "tensorcanon-trace", 1, level, algorithm, rank, world_size])


def rec(step=0, phase="data", kind="batch", scope="", name="batch", call=0, role="batch",
        dtype="float32", shape=(2, 4), digest=D16, sumsq=1.0, note="") -> bytes:
    return msgpack.packb([1, step, phase, kind, scope, name, call, role, dtype, list(shape), digest,
                          sumsq, note])


def end(n: int) -> bytes:
    return msgpack.packb([2, n])


def trace(tmp_path, name, *payloads) -> str:
    path = tmp_path / name
    path.write_bytes(frames(*payloads))
    return str(path)


def cli(*argv, cwd=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "tensorcanon", *argv], capture_output=True,
                          cwd=cwd, timeout=timeout)


def assert_clean_error(proc, name=None):
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert "tensorcanon: error" in err or "CORRUPT" in proc.stdout.decode("utf-8", "replace"), err
    assert "please report" not in err.lower(), err  # the last-resort message: a failure not foreseen
    if name:
        assert name in err


def first_divergence_raises_tc(a, b, **kw):
    try:
        tensorcanon.first_divergence(a, b, **kw)
    except TensorCanonError:
        return
    except Exception as exc:  # noqa: BLE001 - the point is which class escapes
        pytest.fail(f"first_divergence raised a foreign {type(exc).__name__}: {exc}")
    pytest.fail("first_divergence accepted a hostile trace")


# -- values the format says a reader MUST check ---------------------------------------------------

HOSTILE_RECORDS = {
    "negative_sumsq": rec(sumsq=-4.0),
    "sumsq_as_text": rec(sumsq="1.0"),
    "step_is_bool": rec(step=True),
    "step_2_64_minus_1": rec(step=2**64 - 1),
    "call_negative": rec(call=-1),
    "shape_65_dims": rec(shape=[1] * 65),
    "shape_negative": rec(shape=[-1]),
    "shape_nested": rec(shape=[[2], [4]]),
    "digest_wrong_size": rec(digest=b"\x00" * 15),
    "digest_is_text": rec(digest="0" * 16),
    "unknown_phase": rec(phase="evil"),
    "unknown_dtype": rec(dtype="object"),
    "kind_of_another_level": rec(kind="op", phase="forward", name="aten.mm"),
    "note_over_4096": rec(note="x" * 5000),
    "non_utf8_string": msgpack.packb([1, 0, "data", "batch", "", b"\xff\xfe".decode("latin-1"), 0,
                                      "batch", "float32", [2, 4], D16, 1.0, ""]).replace(
        b"\xc3\xbf\xc3\xbe", b"\xa2\xff\xfe", 1),
    "record_of_14_items": msgpack.packb([1, 0, "data", "batch", "", "batch", 0, "batch", "float32",
                                         [2, 4], D16, 1.0, "", "extra"]),
    "record_is_a_map": msgpack.packb({"step": 0}),
    "deeply_nested_arrays": b"\x91" * 100_000 + b"\x00",
    "ext_type": msgpack.packb(msgpack.ExtType(1, b"x")),
    "trailing_bytes_in_payload": rec() + b"\x00",
    # a text record with its note's true digest (the library's own rule), but a shape or a sum of
    # squares a text cannot have
    "text_record_with_a_shape": rec(dtype="text", shape=(1,), digest=text_digest("alpha=1", "xxh3-128"),
                                    sumsq=0.0, note="alpha=1"),
    "text_record_with_a_sumsq": rec(dtype="text", shape=(), digest=text_digest("alpha=1", "xxh3-128"),
                                    sumsq=1.0, note="alpha=1"),
}


@pytest.mark.parametrize("which", sorted(HOSTILE_RECORDS))
def test_hostile_record_is_a_tensorcanon_error(tmp_path, which):
    bad = trace(tmp_path, "bad.trace", header(), HOSTILE_RECORDS[which], end(1))
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    first_divergence_raises_tc(good, bad)


HOSTILE_HEADERS = {
    "version_2": msgpack.packb([0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1]),
    "rank_out_of_range": header(rank=1, world_size=1),
    "world_size_zero": header(rank=0, world_size=0),
    "rank_negative": header(rank=-1, world_size=1),
    "unknown_algorithm": header(algorithm="md5"),
    "unknown_level": header(level="everything"),
    "header_of_8_items": msgpack.packb([0, "tensorcanon-trace", 1, "steps", "xxh3-128", 0, 1, 0]),
    "wrong_name": msgpack.packb([0, "tensorcanon-trace ", 1, "steps", "xxh3-128", 0, 1]),
}


@pytest.mark.parametrize("which", sorted(HOSTILE_HEADERS))
def test_hostile_header_is_a_tensorcanon_error(tmp_path, which):
    bad = trace(tmp_path, "bad.trace", HOSTILE_HEADERS[which], rec(), end(1))
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    first_divergence_raises_tc(good, bad)


def test_end_frame_count_that_lies_is_corrupt(tmp_path):
    bad = trace(tmp_path, "bad.trace", header(), rec(), end(2**64 - 1))
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    first_divergence_raises_tc(good, bad)
    proc = cli("verify", bad)
    assert proc.returncode == 1 and b"CORRUPT" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)


def test_frames_after_the_end_frame_are_refused(tmp_path):
    bad = trace(tmp_path, "bad.trace", header(), rec(), end(1), rec(step=1))
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    first_divergence_raises_tc(good, bad)


def test_second_header_frame_is_refused(tmp_path):
    bad = trace(tmp_path, "bad.trace", header(), header(level="ops"), rec(), end(1))
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    first_divergence_raises_tc(good, bad)


def test_a_text_record_whose_digest_is_not_its_notes_is_refused(tmp_path):
    """TRACE.md: a "text" record's digest is the digest of the note's UTF-8 bytes; an attacker who
    changes an op's arguments (the note) and keeps the digest must not get "same"."""
    # the real digest of a note, computed by the library's own digest (whatever it is), so the
    # good trace is valid and the bad one differs only by its note
    a = trace(tmp_path, "a.trace", header(level="ops"),
              rec(step=0, phase="forward", kind="op", scope="", name="aten.add.Tensor", role="args",
                  dtype="text", shape=(), digest=D16, sumsq=0.0, note="alpha=1"), end(1))
    b = trace(tmp_path, "b.trace", header(level="ops"),
              rec(step=0, phase="forward", kind="op", scope="", name="aten.add.Tensor", role="args",
                  dtype="text", shape=(), digest=D16, sumsq=0.0, note="alpha=2"), end(1))
    try:
        d = tensorcanon.first_divergence(a, b)
    except TensorCanonError:
        return  # refusing a text record whose digest does not match its note is fine
    assert not d.same, "two traces whose op arguments differ were reported the same"


def test_a_text_record_with_its_notes_digest_is_read(tmp_path):
    """The rule above refuses only a lie: text records with their notes' digests compare, and
    different notes are a difference."""
    def op(note):
        return rec(step=0, phase="forward", kind="op", name="aten.add.Tensor", role="args", dtype="text",
                   shape=(), digest=text_digest(note, "xxh3-128"), sumsq=0.0, note=note)

    a = trace(tmp_path, "a.trace", header(level="ops"), op("alpha=1"), end(1))
    b = trace(tmp_path, "b.trace", header(level="ops"), op("alpha=2"), end(1))
    assert tensorcanon.first_divergence(a, a).same
    assert not tensorcanon.first_divergence(a, b).same


def test_frame_length_claim_over_the_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.trace"
    body = MAGIC + struct.pack("<I", 0xFFFFFFFF) + b"\x00" * 64
    path.write_bytes(body)
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    first_divergence_raises_tc(good, str(path))


def test_mismatched_algorithms_are_not_reported_the_same(tmp_path):
    a = trace(tmp_path, "a.trace", header(algorithm="xxh3-128"), rec(), end(1))
    b = trace(tmp_path, "b.trace", header(algorithm="sha256"), rec(digest=b"\x00" * 32), end(1))
    try:
        d = tensorcanon.first_divergence(a, b)
    except TensorCanonError:
        return
    assert not d.same


# -- tolerance: a report must not lie --------------------------------------------------------------

def _pair(tmp_path, sa, sb, da=D16, db=D16B):
    a = trace(tmp_path, "a.trace", header(), rec(kind="loss", name="loss", role="loss", shape=(),
                                                 phase="forward", digest=da, sumsq=sa), end(1))
    b = trace(tmp_path, "b.trace", header(), rec(kind="loss", name="loss", role="loss", shape=(),
                                                 phase="forward", digest=db, sumsq=sb), end(1))
    return a, b


@pytest.mark.parametrize("sa,sb", [(1.0, float("nan")), (float("nan"), 1.0),
                                   (float("inf"), 1.0)])
def test_tolerance_does_not_call_a_nan_or_inf_norm_equal(tmp_path, sa, sb):
    """A loss of NaN (or inf) in one run and a finite one in the other: any tolerance must report
    the difference (NaN compares False to everything, so |a-b|/max > R is False for NaN)."""
    a, b = _pair(tmp_path, sa, sb)
    try:
        d = tensorcanon.first_divergence(a, b, tolerance=0.5)
    except TensorCanonError:
        return
    assert not d.same, "a NaN/inf norm against a finite one passed the tolerance"


def test_tolerance_with_zero_norms_and_different_digests_does_not_crash(tmp_path):
    a, b = _pair(tmp_path, 0.0, 0.0)  # e.g. +0.0 against -0.0: digests differ, norms are both 0
    try:
        tensorcanon.first_divergence(a, b, tolerance=0.1)
    except TensorCanonError:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("tol", [float("nan"), -1.0, float("inf")])
def test_a_meaningless_tolerance_is_refused_or_honest(tmp_path, tol):
    a, b = _pair(tmp_path, 1.0, 4.0)  # norms 1 and 2: relative difference 0.5
    try:
        d = tensorcanon.first_divergence(a, b, tolerance=tol)
    except (TensorCanonError, ValueError, TypeError):
        return
    if tol != float("inf"):
        assert not d.same, f"tolerance={tol} made two different records the same"


def test_cli_refuses_tolerance_nan(tmp_path):
    a, b = _pair(tmp_path, 1.0, 4.0)
    proc = cli("diverge", "--tolerance", "nan", a, b)
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout, proc.stderr)
    assert b"Traceback" not in proc.stderr


# -- the CLI on hostile traces ---------------------------------------------------------------------

def test_cli_exit_2_without_traceback_on_every_hostile_trace(tmp_path):
    """One process per command is slow: run every hostile trace through `diverge` and `verify` from
    one script (the CLI's main in-process, with SystemExit caught)."""
    paths = []
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    for i, (name, payload) in enumerate(sorted(HOSTILE_RECORDS.items())):
        paths.append((name, trace(tmp_path, f"r{i}.trace", header(), payload, end(1))))
    for i, (name, payload) in enumerate(sorted(HOSTILE_HEADERS.items())):
        paths.append((name, trace(tmp_path, f"h{i}.trace", payload, rec(), end(1))))
    script = textwrap.dedent("""
        import io, sys, contextlib, json
        from tensorcanon.tools.cli import main
        good, cases = sys.argv[1], json.loads(sys.argv[2])
        bad = []
        for name, path in cases:
            for argv in (["diverge", good, path], ["verify", path]):
                err = io.StringIO()
                out = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                        code = main(argv)
                except SystemExit as e:
                    code = e.code
                except BaseException as e:
                    code = f"raised {type(e).__name__}: {e}"
                expected = 2 if argv[0] == "diverge" else (1, 2)
                ok = code == expected if argv[0] == "diverge" else code in expected
                if not ok or "Traceback" in err.getvalue() or "report" in err.getvalue().lower():
                    bad.append((name, argv[0], code, err.getvalue()[-300:]))
        print(json.dumps(bad))
    """)
    import json
    proc = subprocess.run([sys.executable, "-c", script, good, json.dumps(paths)], capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert not bad, "\n".join(map(str, bad))


def test_diverge_on_a_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "a.trace"
    os.mkfifo(fifo)
    good = trace(tmp_path, "good.trace", header(), rec(), end(1))
    try:
        proc = cli("diverge", good, str(fifo), timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("diverge on a FIFO hung")
    assert_clean_error(proc)


def test_diverge_pipe_closed_is_quiet(tmp_path):
    a = trace(tmp_path, "a.trace", header(), *[rec(step=s) for s in range(50)], end(50))
    b = trace(tmp_path, "b.trace", header(), *[rec(step=s, digest=D16B) for s in range(50)], end(50))
    proc = subprocess.run(f"{sys.executable} -m tensorcanon diverge {a} {b} | head -1", shell=True,
                          capture_output=True, timeout=60)
    assert b"Traceback" not in proc.stderr and b"Broken pipe" not in proc.stderr, proc.stderr


# -- many records: bounded memory ------------------------------------------------------------------

def _many(path, n, flip_last=False):
    seed = 0
    with open(path, "wb") as f:
        f.write(MAGIC)
        recs = [header()]
        for i in range(n):
            step, k = divmod(i, 1000)
            d = D16B if (flip_last and i == n - 1) else D16
            recs.append(rec(step=step, name=f"p{k}", kind="param", phase="optimizer", role="value",
                            digest=d))
            if len(recs) >= 10000:
                for p in recs:
                    c = xxhash.xxh3_64_intdigest(p, seed=seed)
                    f.write(struct.pack("<I", len(p)) + p + struct.pack("<Q", c))
                    seed = c
                recs = []
        recs.append(end(n))
        for p in recs:
            c = xxhash.xxh3_64_intdigest(p, seed=seed)
            f.write(struct.pack("<I", len(p)) + p + struct.pack("<Q", c))
            seed = c


def test_many_records_stream_in_bounded_memory(tmp_path):
    """200,000 records a trace (~16 MB each; a million took a minute under load and proved no more).
    Measured growth while streaming: 0 MiB. Holding both files' bytes grew it by 22 MiB, one trace's
    records as a list by 111 MiB: either fails the 8 MiB bound."""
    n = 200_000
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    _many(a, n)
    _many(b, n, flip_last=True)
    script = textwrap.dedent("""
        import resource, sys, tensorcanon
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        d = tensorcanon.first_divergence(sys.argv[1], sys.argv[2])
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        print(d.same, grew)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(a), str(b)], capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same, grew_kib = proc.stdout.decode().split()[-2:]
    assert same == "False"
    assert os.path.getsize(a) > 15 * 1024 * 1024  # the bound below means something
    # streaming must hold neither trace: allow 8 MiB of growth
    assert int(grew_kib) < 8 * 1024, f"memory grew by {int(grew_kib) // 1024} MiB"


# -- more ways to make the report say "same" -----------------------------------------------------

def test_tolerance_still_compares_dtype_and_shape(tmp_path):
    """TRACE.md: records are compared by dtype, shape and digest; --tolerance replaces only the
    digest comparison of float records by their norms."""
    a = trace(tmp_path, "a.trace", header(), rec(dtype="float32", shape=(2, 4), sumsq=4.0), end(1))
    b = trace(tmp_path, "b.trace", header(), rec(dtype="float64", shape=(8,), digest=D16B, sumsq=4.0),
              end(1))
    d = tensorcanon.first_divergence(a, b, tolerance=0.1)
    assert not d.same, "records of different dtype and shape passed the tolerance"


def test_tolerance_never_applies_to_integer_records(tmp_path):
    a = trace(tmp_path, "a.trace", header(), rec(dtype="int64", sumsq=4.0), end(1))
    b = trace(tmp_path, "b.trace", header(), rec(dtype="int64", digest=D16B, sumsq=4.0), end(1))
    assert not tensorcanon.first_divergence(a, b, tolerance=0.5).same


def test_a_trace_without_its_end_frame_is_not_the_same_as_a_complete_one(tmp_path):
    a = trace(tmp_path, "a.trace", header(), rec(), rec(step=1), end(2))
    b = trace(tmp_path, "b.trace", header(), rec())
    d = tensorcanon.first_divergence(a, b)
    assert not d.same


def test_an_empty_trace_is_not_the_same_as_a_full_one(tmp_path):
    a = trace(tmp_path, "a.trace", header(), rec(), rec(step=1), end(2))
    b = trace(tmp_path, "b.trace", header(), end(0))
    assert not tensorcanon.first_divergence(a, b).same


def test_a_header_level_cannot_hide_records_that_differ(tmp_path):
    """Both traces hold module records and they differ; A's header claims level "steps", so the
    kinds compared are those of "steps" and the module records are dropped: the report says the
    runs are the same. A reader must refuse a record of a kind its level does not record."""
    m = dict(phase="forward", kind="module", scope="0", name="Linear", role="out")
    a = trace(tmp_path, "a.trace", header(level="steps"), rec(), rec(**m), end(2))
    b = trace(tmp_path, "b.trace", header(level="modules"), rec(), rec(**m, digest=D16B), end(2))
    try:
        d = tensorcanon.first_divergence(a, b)
    except TensorCanonError:
        return
    assert not d.same, "records that differ were hidden by a header's level"


def test_traces_of_different_algorithms_with_equal_bytes_are_not_same(tmp_path):
    """A sha256 trace and an xxh3-128 trace cannot hold equal digests of the same bytes."""
    a = trace(tmp_path, "a.trace", header(algorithm="sha256"), rec(digest=b"\1" * 32), end(1))
    b = trace(tmp_path, "b.trace", header(algorithm="sha256"), rec(digest=b"\1" * 16 + b"\2" * 16), end(1))
    assert not tensorcanon.first_divergence(a, b).same
