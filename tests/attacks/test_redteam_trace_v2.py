"""Red team: trace format version 2 (``state_every=k``), attacked from docs/TRACE.md only.

Hostile traces are real small traces (a tiny model, 4-6 steps) re-framed per "The file".
"""

from __future__ import annotations

import struct
import warnings

import msgpack
import pytest
import torch
import xxhash

import tensorcanon
from tensorcanon.format.errors import TensorCanonError

MAGIC = b"\x89TCTRC\r\n"


def _train(path, *, k=1, steps=6, lr=0.1, flip_state_at=None, resume_at=None, start=0):
    tensorcanon.seed_everything(0, deterministic=False)  # (its switch is process-wide: later tests must not see it)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(1))  # one size: same data
    with tensorcanon.trace(str(path), level="steps", model=model, optimizer=opt, state_every=k,
                           resume_at=resume_at) as tr:
        for s in range(start, steps):
            tr.step(data[s])
            loss = tr.loss(model(data[s]).square().mean())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return path


def _frames(path):
    data = path.read_bytes()
    assert data[:8] == MAGIC
    out, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append(msgpack.unpackb(data[pos + 4:pos + 4 + n], raw=False, strict_map_key=False))
        pos += 4 + n + 8
    return out


def _write(path, frames):
    buf, seed = bytearray(MAGIC), 0
    for f in frames:
        p = msgpack.packb(f, use_bin_type=True)
        seed = xxhash.xxh3_64_intdigest(p, seed=seed)
        buf += struct.pack("<I", len(p)) + p + struct.pack("<Q", seed)
    path.write_bytes(bytes(buf))
    return path


def _refused(bad, good, *what):
    """first_divergence on a hostile trace: tensorcanon's own error naming the file (and ``what``)."""
    with pytest.raises(TensorCanonError) as ei:
        tensorcanon.first_divergence(str(bad), str(good))
    msg = str(ei.value)
    assert bad.name in msg, msg
    for fragment in what:
        assert fragment in msg, msg
    return msg


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("v2")
    return {
        "k2": _train(d / "k2.trace", k=2),
        "k3": _train(d / "k3.trace", k=3),
        "k1": _train(d / "k1.trace", k=1),
        "dir": d,
    }


def test_writer_v2_header_and_optim_steps(base):
    fr = _frames(base["k2"])
    assert fr[0][:3] == [0, "tensorcanon-trace", 2] and len(fr[0]) == 8 and fr[0][7] == 2
    steps = {r[1] for r in fr[1:] if r[0] == 1 and r[3] == "optim"}
    assert steps == {1, 3, 5}
    fr1 = _frames(base["k1"])
    assert fr1[0][2] == 1 and len(fr1[0]) == 7


def test_state_every_argument_refused():
    # k of 0, negative, a float, a bool, a string, huge: a UsageError before any file is made
    for k in (0, -1, 2.0, True, "2", 2**31 + 1, 2**63):
        with pytest.raises(TensorCanonError):
            with tensorcanon.trace("/nonexistent-dir-xyz/a.trace", state_every=k):
                pass


# The hostile traces that must be refused: each a real trace (base[source]) whose frames one
# mutation edits, written as a file of that name, refused by first_divergence with tensorcanon's own
# error naming the file (and the fragments given).


def _k(value):
    """The v2 header's k (its 8th item) set to ``value``."""
    def mutate(fr):
        fr[0][7] = value
    return mutate


def _header_item_appended(fr):
    fr[0].append(2)


def _k_dropped(fr):
    del fr[0][7]


def _version_3(fr):
    fr[0][2] = 3


def _relabelled_v2_k2(fr):
    # a version-1 trace (optim every step) relabelled version 2 with k=2: optim at step 0 refused
    fr[0] = fr[0][:2] + [2] + fr[0][3:] + [2]


def _optim_copied_to_step_0(fr):
    # v2 k=2: an optim record at step 0 (allowed: 1, 3, 5): a copy of step 1's, inserted after
    # step 0's last record (the footer's record count kept right)
    optim1 = [r for r in fr[1:] if r[0] == 1 and r[3] == "optim" and r[1] == 1][0]
    i = max(j for j, r in enumerate(fr) if r[0] == 1 and r[1] == 0)
    ins = list(optim1)
    ins[1] = 0
    fr.insert(i + 1, ins)
    if fr[-1][0] == 2:
        fr[-1][1] += 1


HOSTILE = [
    *(pytest.param("k2", _k(k), "badk.trace", (), id=f"v2 header k{name}") for k, name in (
        (0, "=0"), (-2, "=-2"), (1, "=1"), (2**31 + 1, "=2**31+1"), (2**63 - 1, "=2**63-1"), (2.0, "=2.0, a float"),
        ("2", " a str"), (True, "=True, a bool"), (None, "=None"), ([2], " a list"))),
    # 2**63 does not fit msgpack int64 signed: uint64
    pytest.param("k2", _k(2**63), "hugek.trace", (), id="v2 header k=2**63, a uint64"),
    pytest.param("k1", _header_item_appended, "v1eight.trace", (), id="v1 header with an eighth item"),
    pytest.param("k2", _k_dropped, "v2seven.trace", (), id="v2 header of seven items"),
    pytest.param("k2", _header_item_appended, "v2nine.trace", (), id="v2 header of nine items"),
    pytest.param("k2", _version_3, "v3.trace", (), id="version 3"),
    pytest.param("k1", _relabelled_v2_k2, "relabel.trace", (), id="v1 trace relabelled v2 with k=2"),
    pytest.param("k2", _optim_copied_to_step_0, "optim_bad_step.trace", ("record", "step 0"),
                 id="v2 k=2 optim record at step 0"),
]


@pytest.mark.parametrize(("source", "mutate", "name", "what"), HOSTILE)
def test_hostile_trace_refused_naming_the_file(base, tmp_path, source, mutate, name, what):
    fr = _frames(base[source])
    mutate(fr)
    bad = _write(tmp_path / name, fr)
    _refused(bad, base[source], *what)


def test_optim_records_missing_at_required_step(base, tmp_path):
    # drop all optim records of step 3: a window of the state unseen; must not be "same"
    fr = _frames(base["k2"])
    kept = [r for r in fr if not (r[0] == 1 and r[3] == "optim" and r[1] == 3)]
    if kept[-1][0] == 2:
        kept[-1][1] = len(kept) - 2
    bad = _write(tmp_path / "optim_missing.trace", kept)
    try:
        d = tensorcanon.first_divergence(str(bad), str(base["k2"]))
    except TensorCanonError as e:
        assert bad.name in str(e)
    else:
        assert not d.same


def test_different_k_same_run_is_same(base):
    d = tensorcanon.first_divergence(str(base["k2"]), str(base["k3"]))
    assert d.same, d.lines()
    assert any("6" in n or "lcm" in n.lower() or "every" in n for n in d.notes), d.notes


def _flip_state_train(path, *, k, flip_at, steps=6):
    """Adam run whose exp_avg_sq is perturbed right after step flip_at's optimizer step."""
    tensorcanon.seed_everything(0, deterministic=False)  # (its switch is process-wide: later tests must not see it)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    data = torch.randn(steps, 2, 3, generator=torch.Generator().manual_seed(1))
    with tensorcanon.trace(str(path), level="steps", model=model, optimizer=opt, state_every=k) as tr:
        for s in range(steps):
            tr.step(data[s])
            loss = tr.loss(model(data[s]).square().mean())
            loss.backward()
            opt.step()
            if s == flip_at:
                for st in opt.state.values():
                    st["exp_avg_sq"].mul_(4.0)
            opt.zero_grad()
    return path


def test_state_differs_at_unrecorded_step_reported_as_window(base, tmp_path):
    # k=3: state recorded after steps 2 and 5. Perturbed after step 0 (after recording? it is
    # not recorded at step 0 at all): the parameters of step 1 differ; the report must name
    # a window, never "same".
    a = _flip_state_train(tmp_path / "a.trace", k=3, flip_at=-1)
    b = _flip_state_train(tmp_path / "b.trace", k=3, flip_at=0)
    d = tensorcanon.first_divergence(str(a), str(b))
    assert not d.same
    text = "\n".join(d.lines())
    assert d.first is not None
    assert "window" in text, text


def test_different_k_window_named_by_common_steps(tmp_path):
    # k=2 vs k=3: common optim steps every 6 -> step 5. State perturbed after step 3 (recorded
    # only in the k=2 trace; the other side has no record): compared at lcm only.
    a = _flip_state_train(tmp_path / "a.trace", k=2, flip_at=-1)
    b = _flip_state_train(tmp_path / "b.trace", k=3, flip_at=3)
    d = tensorcanon.first_divergence(str(a), str(b))
    assert not d.same
    text = "\n".join(d.lines())
    assert "window" in text, text


def _resume_refused(p, *, k_new):
    before = p.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TensorCanonError) as ei:
            _train(p, k=k_new, steps=6, resume_at=4, start=4)
    assert p.name in str(ei.value) and "state_every" in str(ei.value), str(ei.value)
    assert p.read_bytes() == before  # nothing changed


@pytest.mark.parametrize(("k", "k_new", "name"), [
    pytest.param(2, 3, "r.trace", id="k=2 trace resumed with k=3"),
    pytest.param(1, 2, "r1.trace", id="v1 trace resumed with k=2"),
    pytest.param(2, 1, "r2.trace", id="v2 trace resumed with k=1"),
])
def test_resume_with_other_k_refused(tmp_path, k, k_new, name):
    # a resumed run continues its trace with the k it was started with: another k is refused
    p = tmp_path / name
    _train(p, k=k, steps=4)
    _resume_refused(p, k_new=k_new)


def test_resume_same_k_continues(tmp_path):
    # the same run, its trace cut after step 3 and resumed (state kept in-process): same as whole
    whole = _train(tmp_path / "whole.trace", k=2, steps=6)
    p = tmp_path / "res.trace"
    _train(p, k=2, steps=4)
    tensorcanon.seed_everything(0, deterministic=False)  # (its switch is process-wide: later tests must not see it)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    data = torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(1))

    def one(s, tr=None):
        if tr is not None:
            tr.step(data[s])
        loss = model(data[s]).square().mean()
        (tr.loss(loss) if tr is not None else loss).backward()
        opt.step()
        opt.zero_grad()

    for s in range(4):
        one(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tensorcanon.trace(str(p), level="steps", model=model, optimizer=opt, state_every=2,
                               resume_at=4) as tr:
            for s in range(4, 6):
                one(s, tr)
    assert p.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("cmd", ["verify", "inspect"])
def test_cli_on_bad_k_header(base, tmp_path, capsys, cmd):
    from tensorcanon.tools.cli import main

    fr = _frames(base["k2"])
    fr[0][7] = 2**63
    bad = _write(tmp_path / "cli_badk.trace", fr)
    capsys.readouterr()
    rc = main([cmd, str(bad)])
    out = capsys.readouterr()
    assert rc in (1, 2), (rc, out)
    assert "cli_badk.trace" in out.out + out.err and "Traceback" not in out.err


def test_verify_cli_on_bad_optim_step(base, tmp_path, capsys):
    from tensorcanon.tools.cli import main

    fr = _frames(base["k2"])
    _optim_copied_to_step_0(fr)
    bad = _write(tmp_path / "verify_bad.trace", fr)
    capsys.readouterr()
    rc = main(["verify", str(bad)])
    out = capsys.readouterr()
    assert rc == 1, (rc, out)
    assert "CORRUPT" in out.out + out.err


def _lr0_train(path, *, k, flip_at, steps=6):
    """lr=0: the parameters never change, so only the optimizer state records can differ."""
    tensorcanon.seed_everything(0, deterministic=False)  # (its switch is process-wide: later tests must not see it)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    data = torch.randn(steps, 2, 3, generator=torch.Generator().manual_seed(1))
    with tensorcanon.trace(str(path), level="steps", model=model, optimizer=opt, state_every=k) as tr:
        for s in range(steps):
            tr.step(data[s])
            tr.loss(model(data[s]).square().mean()).backward()
            opt.step()
            if s == flip_at:
                for st in opt.state.values():
                    st["exp_avg"].add_(1.0)
            opt.zero_grad()
    return path


def test_state_only_differs_window_named(tmp_path):
    # state differs from step 0 (unrecorded for k=3), parameters never differ: the first
    # divergence is the optim record of step 2, with the window in which it first differed.
    a = _lr0_train(tmp_path / "a.trace", k=3, flip_at=-1)
    b = _lr0_train(tmp_path / "b.trace", k=3, flip_at=0)
    d = tensorcanon.first_divergence(str(a), str(b))
    assert not d.same
    assert d.first["kind"] == "optim" and d.first["step"] == 2, d.first
    text = "\n".join(d.lines())
    assert "window" in text and "0 to 2" in text, text


def test_state_only_differs_different_k(tmp_path):
    # k=2 vs k=3, state differs from step 3 on: only step 5 is common; the report is the optim
    # record of step 5 (never "same"), its window after the last common step (none before 5).
    a = _lr0_train(tmp_path / "a.trace", k=2, flip_at=-1)
    b = _lr0_train(tmp_path / "b.trace", k=3, flip_at=3)
    d = tensorcanon.first_divergence(str(a), str(b))
    assert not d.same
    assert d.first["kind"] == "optim" and d.first["step"] == 5, d.first
    assert "window" in "\n".join(d.lines())


def test_edited_optim_digest_named(base, tmp_path):
    # a hand-edited digest of the optim record of step 3 (k=2): reported there, window 2 to 3
    fr = _frames(base["k2"])
    for r in fr:
        if r[0] == 1 and r[3] == "optim" and r[1] == 3:
            r[10] = bytes(16)
            break
    bad = _write(tmp_path / "edited.trace", fr)
    d = tensorcanon.first_divergence(str(base["k2"]), str(bad))
    assert not d.same and d.first["kind"] == "optim" and d.first["step"] == 3, d.first
    assert "2 to 3" in "\n".join(d.lines())


def test_v1_against_v2_compares_common_steps(base, tmp_path):
    # k=1 (version 1) against k=2: the optim records of steps 1, 3, 5 are compared; an edit of
    # the version-1 trace's optim record at step 3 is found there, one at step 2 is not compared
    # (a note says what is): never an error, never a false "same" at a common step
    d = tensorcanon.first_divergence(str(base["k1"]), str(base["k2"]))
    assert d.same and d.notes, (d.lines(), d.notes)
    for step, same in ((2, True), (3, False)):
        fr = _frames(base["k1"])
        for r in fr:
            if r[0] == 1 and r[3] == "optim" and r[1] == step:
                r[10] = bytes(16)
                break
        ed = _write(tmp_path / f"k1_edit{step}.trace", fr)
        d = tensorcanon.first_divergence(str(ed), str(base["k2"]))
        assert d.same is same, d.lines()
        if not same:
            assert d.first["kind"] == "optim" and d.first["step"] == 3


def test_crashed_v2_trace(base, tmp_path):
    # a v2 trace cut inside a frame (a crashed run): compared as far as it goes
    data = base["k2"].read_bytes()
    cut = tmp_path / "cut.trace"
    cut.write_bytes(data[: len(data) * 2 // 3])
    d = tensorcanon.first_divergence(str(base["k2"]), str(cut))
    assert not d.complete[1]
    assert d.verdict and "ends first" in "\n".join(d.lines())
