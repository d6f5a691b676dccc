"""What tracing costs, without changing what it proves (issue 41): the fused digest and sum of
squares give the specified values; a tensor is hashed again whenever it may have changed; the
optimizer state recorded every k steps (``state_every``, trace format version 2)."""

from __future__ import annotations

import os
import threading

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

import tensorcanon
from tensorcanon import UsageError
from tensorcanon.format import digest
from tensorcanon.trace import layout, recorder as recorder_module
from tensorcanon.trace.summary import CHUNK, PARALLEL_FROM, summarize
from tensorcanon.trace.values import args_have_text, args_text, leaves, op_leaves

# ---------------------------------------------------------------- the record content


def _reference(t: torch.Tensor) -> tuple[bytes, float]:
    """docs/TRACE.md item 4, written out: the digest of the dtype, shape and canonical bytes, and
    the float64 sum of squares in chunks of 65,536 values, each by numpy's pairwise sum, in order."""
    name = str(t.dtype).removeprefix("torch.")
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    if t.dtype is torch.bool:
        raw = bytes(b != 0 for b in raw)
    d = xxhash.xxh3_128(f"{name}[{','.join(map(str, t.shape))}]".encode() + raw).digest()
    if t.dtype in (torch.bfloat16, torch.float8_e5m2):
        values = flat.to(torch.float32).numpy()
    elif t.is_complex():
        values = torch.view_as_real(flat).reshape(-1).numpy()
    else:
        values = flat.numpy()
    total = 0.0
    with np.errstate(over="ignore"):
        for i in range(0, values.size, CHUNK):
            c = values[i:i + CHUNK].astype(np.float64)
            total += float(np.add.reduce(c * c))
    return d, total


@pytest.mark.parametrize("n", [0, 1, 9, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, PARALLEL_FROM + 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e5m2])
def test_the_fused_pass_gives_the_specified_digest_and_sum_of_squares(n, dtype):
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g, dtype=torch.float64) * 300
    t = torch.complex(base, -base / 3).to(dtype) if dtype.is_complex else base.to(dtype)
    for v in (t, t[::3], t.reshape(-1, 1).expand(-1, 2) if n else t):
        name, shape, d, sumsq, note = summarize(v, "xxh3-128")
        want = _reference(v)
        assert (d, sumsq) == want  # bitwise: the sum's float64 bits, the trace's bytes
        assert (name, shape, note) == (str(dtype).removeprefix("torch."), tuple(v.shape), "")


def test_squares_past_float64_are_inf_without_a_warning():
    t = torch.tensor([1e300, 1.0], dtype=torch.float64)
    with np.errstate(over="raise"):
        assert summarize(t, "xxh3-128")[3] == float("inf")


# ---------------------------------------------------------------- hashed again when changed


class _Writes(torch.nn.Module):
    """Reads tensors, changes them in every way the recorder must see, reads them again."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 4096))
        self.register_buffer("b", torch.linspace(0, 1, 4096))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w                      # w read
        with torch.no_grad():
            self.b.add_(1)                  # in place under no_grad: the counter is bumped
        y = y + self.b
        self.w.data.mul_(0.5)               # through .data: w's counter is not bumped
        y = y * self.w
        other = torch.empty(0).set_(self.b.untyped_storage(), 0, self.b.shape, self.b.stride())
        other.mul_(3)                       # through another tensor on b's memory: b's counter is not bumped
        y = y + self.b
        z = x.exp()
        z.add_(1)                           # an output written in place, then read
        z.mul_(2)
        u = x * 3
        grid = u.view(64, 64)               # the same bytes as u, another shape: its squares known
        t = grid * 2
        u.add_(1)                           # written through u: grid's bytes changed
        t = t + grid
        other = torch.empty(0).set_(u.untyped_storage(), 0, (64, 64), (64, 1))
        other.mul_(5)                       # written through another tensor on u's memory
        t = t + grid
        return y.sum() + (z * x).sum() + t.sum()


def _run(path, no_reuse: bool, monkeypatch, optimizer: bool = True):
    torch.manual_seed(0)
    model = _Writes()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(2, 4096, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        if no_reuse:  # every tensor hashed each time it is met
            m.setattr(recorder_module.Recorder, "_summary",
                      lambda self, t, reuse, written=False: summarize(t, self.algorithm))
        with tensorcanon.trace(path, level="ops", model=model, optimizer=opt) as tr:
            for batch in data:
                tr.step(batch)
                tr.loss(model(batch)).backward()
                opt.step()
                opt.zero_grad()


def test_a_tensor_changed_in_any_way_torch_sees_is_hashed_again(tmp_path, monkeypatch):
    # what each record holds is what hashing every tensor every time gives: a write through .data
    # or through another tensor on the same memory (counters not bumped), in place under no_grad,
    # an op's output written in place and read again, the optimizer's in-place updates and the
    # records after its step
    _run(tmp_path / "reuse", False, monkeypatch)
    _run(tmp_path / "every", True, monkeypatch)
    assert (tmp_path / "reuse").read_bytes() == (tmp_path / "every").read_bytes()
    records = list(layout.Reader(tmp_path / "reuse"))
    muls = [r for r in records if r.step == 0 and r.name == "aten.mul.Tensor" and r.role == "in.1"]
    assert len({r.digest for r in muls[:2]}) == 2  # w before and after its .data write


def test_reuse_hashes_fewer_bytes(tmp_path, monkeypatch):
    counted = {"bytes": 0}
    real = digest.constructor

    class Counting:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            counted["bytes"] += memoryview(data).nbytes
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(digest, "constructor", lambda algorithm: lambda prefix: Counting(real(algorithm)(prefix)))
    _run(tmp_path / "reuse", False, monkeypatch)
    reused = counted["bytes"]
    counted["bytes"] = 0
    _run(tmp_path / "every", True, monkeypatch)
    assert reused < counted["bytes"] * 0.8


# ---------------------------------------------------------------- walking an op's arguments


_arg = st.recursive(
    st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.none(), st.booleans(), st.text(max_size=3),
              st.just(torch.zeros(2)), st.just(torch.float32)),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=2), inner,
                                                                                          max_size=2),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(_arg, max_size=4).map(tuple), st.dictionaries(st.sampled_from(["out", "alpha"]), _arg, max_size=2))
def test_op_leaves_and_args_have_text_agree_with_the_general_walk(args, kwargs):
    want: list = []
    leaves(list(args) + ([kwargs] if kwargs else []), "", want)
    got: list = []
    op_leaves(args, kwargs, got)
    assert [(p, id(v)) for p, v in got] == [(p, id(v)) for p, v in want]
    if not args_have_text(args, kwargs):
        assert not args_text(list(args) + ([kwargs] if kwargs else [])).strip("[T, ]")


# ---------------------------------------------------------------- the optimizer state every k steps


def _train(path, steps: int = 6, nudge_at: int | None = None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(steps, 3, 8, generator=torch.Generator().manual_seed(1))
    with tensorcanon.trace(path, model=model, optimizer=opt, **kw) as tr:
        for s, batch in enumerate(data):
            tr.step(batch)
            tr.loss(model(batch).square().mean()).backward()
            opt.step()
            opt.zero_grad()
            if s == nudge_at:  # the state changes after its records: the parameters show it next step
                opt.state[model.weight]["exp_avg"].mul_(1.5)


def test_state_every_k_records_the_optimizer_state_after_every_kth_step(tmp_path):
    _train(tmp_path / "every1")
    _train(tmp_path / "every3", state_every=3)
    one, three = list(layout.Reader(tmp_path / "every1")), list(layout.Reader(tmp_path / "every3"))
    assert sorted({r.step for r in three if r.kind == "optim"}) == [2, 5]
    assert [r for r in one if r.kind != "optim" or r.step in (2, 5)] == three  # nothing else changes
    h, n = layout.verify(tmp_path / "every3")
    assert h.state_every == 3 and n == len(three)
    assert layout.verify(tmp_path / "every1")[0].state_every == 1
    res = tensorcanon.first_divergence(tmp_path / "every1", tmp_path / "every3")
    assert res.same and any("every 1 step in A and every 3 steps in B" in n for n in res.notes)


def test_a_default_trace_is_version_1_byte_for_byte(tmp_path):
    _train(tmp_path / "t", steps=1)
    data = (tmp_path / "t").read_bytes()
    n = int.from_bytes(data[8:12], "little")
    assert msgpack.unpackb(data[12:12 + n]) == [0, "tensorcanon-trace", 1, "steps", "xxh3-128", 0, 1]
    _train(tmp_path / "k", steps=1, state_every=2)
    data = (tmp_path / "k").read_bytes()
    n = int.from_bytes(data[8:12], "little")
    assert msgpack.unpackb(data[12:12 + n]) == [0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1, 2]
    assert layout.verify(tmp_path / "k")[0].version == 2 and layout.verify(tmp_path / "t")[0].version == 1


def test_inspect_names_the_version_of_a_trace(tmp_path, capsys):
    from tensorcanon.tools.cli import main as cli

    _train(tmp_path / "k", steps=1, state_every=2)
    cli(["inspect", str(tmp_path / "k")])
    assert "tensorcanon trace of a training run, version 2" in capsys.readouterr().out


def test_diverge_names_the_window_where_the_state_was_not_compared(tmp_path):
    _train(tmp_path / "a", state_every=4)
    _train(tmp_path / "b", state_every=4, nudge_at=1)
    res = tensorcanon.first_divergence(tmp_path / "a", tmp_path / "b")
    assert (res.first["step"], res.first["kind"]) == (2, "param")
    assert "compared every 4 steps, last never before" in res.explanation
    assert "window of steps 0 to 2" in res.explanation
    _train(tmp_path / "c", state_every=1)
    _train(tmp_path / "d", state_every=1, nudge_at=1)
    res = tensorcanon.first_divergence(tmp_path / "c", tmp_path / "d")
    assert (res.first["step"], res.first["kind"]) == (2, "param") and "window" not in res.explanation


def test_state_every_is_checked(tmp_path):
    for bad in (0, -1, True, 2.0, "3", 2**31 + 1):
        with pytest.raises(UsageError, match="state_every"):
            tensorcanon.trace(tmp_path / "t", state_every=bad)
    _train(tmp_path / "t", steps=2, state_every=2)
    with pytest.raises(UsageError, match="state_every"):
        _train(tmp_path / "t", steps=2, state_every=3, resume_at=1)


def _framed(*payloads: bytes) -> bytes:
    out, check = bytearray(layout.MAGIC), 0
    for p in payloads:
        check = xxhash.xxh3_64_intdigest(p, seed=check)
        out += len(p).to_bytes(4, "little") + p + check.to_bytes(8, "little")
    return bytes(out)


def _optim(step: int) -> bytes:
    return msgpack.packb([1, step, "optimizer", "optim", "", "w", 0, "exp_avg", "float32", [2], bytes(16), 1.0, ""])


@pytest.mark.parametrize("header, records, why", [
    ([0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1, 1], [], "state_every 1"),
    ([0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1, 2**31 + 1], [], "state_every"),
    ([0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1, True], [], "state_every"),
    ([0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1], [], "header of 7 items"),
    ([0, "tensorcanon-trace", 1, "steps", "xxh3-128", 0, 1, 2], [], "header of 8 items"),
    ([0, "tensorcanon-trace", 3, "steps", "xxh3-128", 0, 1, 2], [], "version 3"),
    ([0, "tensorcanon-trace", 2, "steps", "xxh3-128", 0, 1, 3], [_optim(2), _optim(3)], "record of step 3"),
])
def test_a_version_2_header_and_its_records_are_checked(tmp_path, header, records, why):
    path = tmp_path / "t"
    path.write_bytes(_framed(msgpack.packb(header), *records, msgpack.packb([2, len(records)])))
    with pytest.raises(tensorcanon.TensorCanonError, match=why):
        layout.verify(path)


# ---------------------------------------------------------------- two threads after an optimizer step


class _Mixed(torch.nn.Module):
    """Parameters of several dtypes and sizes (one past a chunk, one a single value), and a
    module that returns a tuple: what the records after an optimizer step can hold."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 2048)
        self.b = torch.nn.Linear(2048, 40)
        self.wide = torch.nn.Parameter(torch.linspace(-2, 2, CHUNK + 3, dtype=torch.float64))
        self.one = torch.nn.Parameter(torch.tensor([0.5]))
        self.bf = torch.nn.Parameter(torch.linspace(-1, 1, 300).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        return y.sum() + self.wide.square().sum() + self.one.sum() + self.bf.float().square().sum()


def _mixed_trace(path, level: str) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    opts = [torch.optim.AdamW([p for n, p in model.named_parameters() if n != "bf"], lr=1e-2),
            torch.optim.SGD([model.bf], lr=0.1, momentum=0.9)]
    data = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    with tensorcanon.trace(path, level=level, model=model, optimizer=opts) as tr:
        for batch in data:
            tr.step(batch)
            tr.loss(model(batch)).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()


@pytest.mark.parametrize("level", ["steps", "modules"])
def test_the_records_after_an_optimizer_step_hashed_on_two_threads_are_the_same_bytes(tmp_path, monkeypatch, level):
    from tensorcanon.trace import summary

    threads: set[int] = set()
    real, real_put_all = summary.summarize, recorder_module.Recorder._put_all
    main, helped, batch = threading.get_ident(), threading.Event(), [False]

    def counting(t, algorithm):
        threads.add(threading.get_ident())
        if threading.get_ident() != main:
            helped.set()
        elif batch[0]:
            helped.wait(5)  # (the helper's turn, which a loaded machine may give it late)
        return real(t, algorithm)

    def put_all(self, records):
        batch[0] = True
        try:
            real_put_all(self, records)
        finally:
            batch[0] = False

    with monkeypatch.context() as m:  # every batch after an optimizer step on two threads
        m.setattr(summary, "MANY_FROM", 0)
        m.setattr(recorder_module, "summarize", counting)
        m.setattr(summary, "summarize", counting)
        m.setattr(recorder_module.Recorder, "_put_all", put_all)
        _mixed_trace(tmp_path / "two", level)
    with monkeypatch.context() as m:  # no helper thread: everything on the training thread
        m.setattr(summary, "_helper", lambda: None)
        _mixed_trace(tmp_path / "one", level)
    assert (tmp_path / "two").read_bytes() == (tmp_path / "one").read_bytes()
    if (os.cpu_count() or 1) > 1:
        assert len(threads) == 2  # (the helper did hash some of them)


def test_contents_on_two_threads_computes_every_item_once_in_order(monkeypatch):
    from tensorcanon.trace import summary

    monkeypatch.setattr(summary, "_cores", lambda: 2)  # a helper thread even on one core
    done: list[int] = []

    def work(x):
        done.append(x)
        np.add.reduce(np.arange(2000, dtype=np.float64))  # (releases the GIL: the helper gets its turn)
        return x * x

    for n in (2, 3, 17, 400):
        done.clear()
        sizes = [(x * 7919) % 3 * summary.SHARED_FROM for x in range(n)]  # (shared, or this thread's alone)
        assert summary.contents(work, list(range(n)), sizes) == [x * x for x in range(n)]
        assert sorted(done) == list(range(n))  # each item exactly once: none skipped, none twice


def test_an_error_on_either_thread_is_raised_after_both_are_done(monkeypatch):
    from tensorcanon.trace import summary

    monkeypatch.setattr(summary, "_cores", lambda: 2)

    running, lock = [0], threading.Lock()

    def work(x):
        with lock:
            running[0] += 1
        try:
            np.add.reduce(np.arange(20000, dtype=np.float64))  # (the helper's turn)
            if x in (3, 50, 97):  # (two large tensors, one small)
                raise UsageError(f"item {x}")
            return x
        finally:
            with lock:
                running[0] -= 1

    for _ in range(5):
        with pytest.raises(UsageError, match="item"):
            summary.contents(work, list(range(100)), [summary.SHARED_FROM * (x % 2) for x in range(100)])
        assert running[0] == 0  # neither thread still reads a tensor once the error is raised
