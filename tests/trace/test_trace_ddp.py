"""Traces under torch.distributed (issue 37 item 3).

In process: an op's ``out=`` argument is an output, not an input; "uninitialized" follows the
storage (views, writes through views, partial writes); a traced tensor's storage stays resizable.

In fresh processes (tests/trace/ddp_scenarios.py, one launch: two runs of two gloo ranks, four
processes): identical DDP and FSDP2 runs give byte-identical traces at every level; a collective's
output is recorded once its work is complete (the reduced value, equal on both ranks), asynchronous
collectives included; a difference that enters through a collective gets its own verdict.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tensorcanon
from tensorcanon import first_divergence
from tensorcanon.tools.cli import main as cli
from tensorcanon.trace import layout
from tensorcanon.trace.compare import COLLECTIVE, INPUTS
from tensorcanon.trace.summary import summarize

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 420


def _records(path):
    with layout.Reader(path) as r:
        return list(r)


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# --------------------------------------------------------------------------- in process


def _out_argument_run(path, before: float) -> None:
    model, opt = _linear()
    buf = torch.full((2, 4), before)  # what the out= argument holds before the op: not an input of it
    with tensorcanon.trace(path, level="ops", model=model, optimizer=opt) as tr:
        x = torch.ones(2, 4)
        tr.step(x)
        y = model(x)
        torch.mul(y.detach(), 2, out=buf)
        tr.loss((y * buf).sum()).backward()
        opt.step()


def test_an_out_argument_is_an_output_not_an_input(tmp_path):
    _out_argument_run(tmp_path / "a", 0.0)
    _out_argument_run(tmp_path / "b", 7.0)  # another value in the buffer the op overwrites
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    mul = [r for r in _records(tmp_path / "a") if r.name == "aten.mul.out"]
    assert [r.role for r in mul] == ["in.0", "args", "out"]
    model, _ = _linear()
    expected = summarize(torch.mul(model(torch.ones(2, 4)).detach(), 2), "xxh3-128")
    assert mul[-1].digest == expected[2] and mul[-1].dtype == "float32"


def _overwrite_run(path, before: float) -> None:
    model, opt = _linear()
    bufs = [torch.full((4,), before) for _ in range(3)]   # made outside the step: whatever they hold
    with tensorcanon.trace(path, level="ops", model=model, optimizer=opt) as tr:
        x = torch.ones(4)
        tr.step(x)
        y = model(x)
        bufs[0].copy_(y.detach())     # copy_, zero_, fill_ write all of their self and read none of it
        bufs[1].zero_()
        bufs[2].fill_(3.0)
        bufs[0].add_(bufs[2])         # add_ reads its self: an input
        tr.loss((y * bufs[0]).sum()).backward()
        opt.step()


def test_an_op_that_overwrites_its_self_does_not_read_it(tmp_path):
    _overwrite_run(tmp_path / "a", 0.0)
    _overwrite_run(tmp_path / "b", 7.0)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    records = _records(tmp_path / "a")
    for name in ("aten.copy_.default", "aten.zero_.default", "aten.fill_.Scalar"):
        roles = [r.role for r in records if r.name == name]
        assert "in.0" not in roles and "out" in roles, (name, roles)
    assert [r.role for r in records if r.name == "aten.add_.Tensor" and r.phase == "forward"] == ["in.0", "in.1",
                                                                                                   "out"]


def _op_records(path, name):
    return [r for r in _records(path) if r.kind == "op" and r.name == name]


def test_uninitialized_follows_the_storage_not_the_tensor_object(tmp_path):
    model, opt = _linear()
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    with tensorcanon.trace(tmp_path / "t", level="ops", model=model, optimizer=opt) as tr:
        tr.step(torch.ones(1))
        whole = torch.empty(8)
        whole[:4].copy_(a)            # written through two views, the buffer itself never named
        whole[4:].copy_(b)
        whole.sum()                   # sum call 0: all 8 values written: its bytes
        half = torch.empty(8)
        half[:4].copy_(a)
        half.sum()                    # call 1: half of it holds whatever was in memory
        early = torch.empty(2, 4)
        seen = early.view(8)          # a view made before the write
        early.copy_(torch.ones(2, 4))
        seen.sum()                    # call 2: written through the other tensor
        mat = torch.empty(4, 3)
        mat.t().copy_(torch.ones(3, 4))   # a transposed (not contiguous) write covers it all
        mat.sum()                     # call 3
        raw = torch.ops.aten._unsafe_view(torch.empty(2, 4), [8])   # no view in its schema, same storage
        raw.sum()                     # call 4
        grown = torch.ones(2)
        grown.resize_(6)              # aten.resize_: 4 more values, whatever was in memory
        grown.sum()                   # call 5
        freed = torch.ones(2)
        freed.untyped_storage().resize_(0)    # as FSDP2 frees and allocates an unsharded parameter:
        freed.untyped_storage().resize_(8)    # no ATen op says so
        freed.sum()                   # call 6
        freed.copy_(torch.ones(2))
        freed.sum()                   # call 7: written
        tr.loss(model(torch.ones(4)).mean()).backward()
        opt.step()
    sums = [r for r in _op_records(tmp_path / "t", "aten.sum.default") if r.role == "in.0"]
    assert len(sums) == 8
    assert sums[0].dtype == "float32" and sums[0].digest == summarize(torch.cat([a, b]), "xxh3-128")[2]
    assert sums[1].dtype == "text" and sums[1].note == "uninitialized float32[8]"
    assert sums[2].dtype == "float32" and sums[2].digest == summarize(torch.ones(8), "xxh3-128")[2]
    assert sums[3].dtype == "float32" and sums[3].digest == summarize(torch.ones(4, 3), "xxh3-128")[2]
    assert sums[4].dtype == "text" and sums[4].note == "uninitialized float32[8]"
    assert sums[5].dtype == "text" and sums[5].note == "uninitialized float32[6]"
    assert sums[6].dtype == "text" and sums[6].note == "uninitialized float32[2]"
    assert sums[7].dtype == "float32" and sums[7].digest == summarize(torch.ones(2), "xxh3-128")[2]
    unsafe = [r for r in _op_records(tmp_path / "t", "aten._unsafe_view.default") if r.role == "out"]
    assert unsafe and unsafe[0].dtype == "text"


def test_a_traced_tensor_can_still_be_resized(tmp_path):
    """Hashing a tensor must not change it: reading its bytes through numpy marked its storage not
    resizable for good, and FSDP2 (which frees a parameter's memory with storage.resize_(0))
    failed at level ops."""
    model, opt = _linear()
    kept = []
    with tensorcanon.trace(tmp_path / "t", level="ops", model=model, optimizer=opt) as tr:
        x = torch.ones(4)
        tr.step(x)
        y = model(x) * 2
        kept.append(y)
        tr.loss(y.sum()).backward()
        opt.step()
    for t in (x, kept[0].detach(), model.weight.detach()):
        t.untyped_storage().resize_(0)


def test_a_collective_that_fails_at_close_leaves_torch_as_it_was(tmp_path):
    """A collective still pending when the trace closes is waited for; if that fails, the error is
    raised once the dispatch mode and the hooks are gone and torch's methods are back, and the
    trace is left a crashed run's (no end frame)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from tensorcanon.trace import ops

    class Failing:
        def wait(self):
            raise RuntimeError("the other rank is gone")

    resize = torch.UntypedStorage.resize_
    model, opt = _linear()
    with pytest.raises(RuntimeError, match="other rank is gone"):
        with tensorcanon.trace(tmp_path / "t", level="ops", model=model, optimizer=opt) as tr:
            tr.step(torch.ones(4))
            assert torch.UntypedStorage.resize_ is not resize   # grown storages are told to the recorder
            out = torch.zeros(2)
            tr._mode.pending.append(ops._Pending("forward", "", "c10d.allreduce_.default", 0, [("out.0.0", out)],
                                                 [out], Failing(), "c10d"))
    assert torch.UntypedStorage.resize_ is resize and not ops._ACTIVE
    assert _get_current_dispatch_mode() is None
    with layout.Reader(tmp_path / "t", strict=False) as r:
        list(r)
        assert not r.tail.complete


def _hand_trace(path, rank, world, out_digest, level="ops"):
    """A trace of one step: the batch, then a collective whose input matched and whose output is
    ``out_digest``'s."""
    import msgpack

    from tensorcanon.trace.layout import MAGIC, Header, Record, Writer

    def tensor(step, phase, kind, name, call, role, digest):
        return Record(step, phase, kind, "", name, call, role, "float32", (4,), digest, 1.0, "")

    with open(path, "wb") as fh:
        fh.write(MAGIC)
        w = Writer(fh)
        w.frame(msgpack.packb(Header(level, "xxh3-128", rank, world).payload()))
        w.record(tensor(0, "data", "batch", "batch", 0, "batch", bytes(16)))
        if level == "ops":
            w.record(tensor(0, "backward", "op", "c10d.allreduce_.default", 0, "in.0.0", bytes(15) + b"\1"))
            w.record(tensor(0, "backward", "op", "c10d.allreduce_.default", 0, "out.0.0", out_digest))
        else:
            w.record(tensor(0, "backward", "grad", "w", 0, "grad", out_digest))
        w.end()


def test_the_collective_verdict_names_the_other_ranks_traces(tmp_path):
    for rank in (0, 1):  # names as {rank} in trace()'s path makes them
        _hand_trace(tmp_path / f"a.{rank}.trace", rank, 2, bytes(16))
        _hand_trace(tmp_path / f"b.{rank}.trace", rank, 2, b"\7" * 16)
    r = first_divergence(tmp_path / "a.0.trace", tmp_path / "b.0.trace")
    assert r.verdict == COLLECTIVE and r.origin == "collective c10d.allreduce_.default"
    assert f"tensorcanon diverge {tmp_path / 'a.1.trace'} {tmp_path / 'b.1.trace'}" in r.explanation
    r = first_divergence(tmp_path / "a.1.trace", tmp_path / "b.1.trace")
    assert f"tensorcanon diverge {tmp_path / 'a.0.trace'} {tmp_path / 'b.0.trace'}" in r.explanation
    # one process alone: a collective's output is still where the difference entered; a gradient is not
    _hand_trace(tmp_path / "one-a", 0, 1, bytes(16))
    _hand_trace(tmp_path / "one-b", 0, 1, b"\7" * 16)
    r = first_divergence(tmp_path / "one-a", tmp_path / "one-b")
    assert r.verdict == COLLECTIVE and "world size 1" in r.explanation
    _hand_trace(tmp_path / "grad-a", 0, 1, bytes(16), level="modules")
    _hand_trace(tmp_path / "grad-b", 0, 1, b"\7" * 16, level="modules")
    assert first_divergence(tmp_path / "grad-a", tmp_path / "grad-b").verdict != COLLECTIVE
    _hand_trace(tmp_path / "grad-a", 0, 4, bytes(16), level="modules")
    _hand_trace(tmp_path / "grad-b", 0, 4, b"\7" * 16, level="modules")
    r = first_divergence(tmp_path / "grad-a", tmp_path / "grad-b")
    assert r.verdict == COLLECTIVE and "4 ranks" in r.origin and "rank 1 (and each rank up to 3)" in r.explanation


# --------------------------------------------------------------------------- in fresh processes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Two runs (a, b) of two ranks each, every job of ddp_scenarios.JOBS in every process."""
    from support import run_processes

    d = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TENSORCANON_TEST_STACKS_AFTER=str(TIMEOUT - 20))
    env.pop("PYTHONHASHSEED", None)  # each process draws its own hash seed: nothing may depend on it
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    runs = [([sys.executable, os.path.join(HERE, "ddp_scenarios.py"), run, str(rank), str(d), f"file://{d}/{run}.init"],
             env, str(d / f"{run}.rank{rank}.log")) for run in ("a", "b") for rank in (0, 1)]
    codes = run_processes(runs, TIMEOUT)
    for (_, _, log), code in zip(runs, codes, strict=True):
        if code != 0:
            with open(log, errors="replace") as f:
                tail = f.read()[-6000:]
            raise AssertionError(f"{log}: exit {code} (None: killed at the deadline)\n{tail}")
    return d


def _jobs():
    sys.path.insert(0, HERE)
    try:
        import ddp_scenarios
    finally:
        sys.path.remove(HERE)
    return [name for name, _, _ in ddp_scenarios.JOBS], ddp_scenarios.FSDP2


def _trace(d, run, job, rank):
    return d / f"{run}.{job}.rank{rank}.trace"


def test_identical_ddp_runs_give_byte_identical_traces_at_every_level_in_fresh_processes(ranks):
    jobs, _ = _jobs()
    for job in jobs:
        for rank in (0, 1):
            a, b = _trace(ranks, "a", job, rank), _trace(ranks, "b", job, rank)
            assert a.read_bytes() == b.read_bytes(), (job, rank, first_divergence(a, b).lines())
            assert layout.verify(a)[0].world_size == 2
    ops = _records(_trace(ranks, "a", "ddp-ops", 0))
    # DDP's reducer writes its buckets with aten.mul.out: the bucket is not an input of it
    assert any(r.name == "aten.mul.out" and r.role == "out" for r in ops)
    assert not any(r.name == "aten.mul.out" and r.role.startswith("in.2") for r in ops)


def _collective_outputs(path):
    spaces = ("c10d", "_c10d_functional", "c10d_functional")
    return [r for r in _records(path) if r.kind == "op" and r.name.split(".")[0] in spaces and r.role.startswith("out")]


def test_a_collective_is_recorded_when_its_work_is_complete_in_fresh_processes(ranks):
    jobs, fsdp2 = _jobs()
    for job in ("ddp-ops", "ddp-ops-view", "collectives"):
        outs = [_collective_outputs(_trace(ranks, "a", job, rank)) for rank in (0, 1)]
        # each rank fed its own batch: what they reduce or gather ends equal on both (a reduce-scatter
        # leaves each its own part, a reduce its result on rank 0 alone); recorded before gloo
        # finished, each rank's own values showed
        same = [[(r.identity, r.digest) for r in o if "reduce_scatter" not in r.name and "reduce_." not in r.name]
                for o in outs]
        assert same[0] == same[1] and len(same[0]) >= 2, job
        ins = {(r.step, r.name, r.call): r.digest for r in _records(_trace(ranks, "a", job, 0))
               if r.name == "c10d.allreduce_.default" and r.role == "in.0.0"}
        reduced = [r for r in outs[0] if r.name == "c10d.allreduce_.default"]
        assert reduced and any(ins[(r.step, r.name, r.call)] != r.digest for r in reduced), job
    names = {r.name for r in _collective_outputs(_trace(ranks, "a", "collectives", 1))}
    assert {"c10d.allreduce_.default", "c10d.allgather_.default", "c10d.broadcast_.default"} <= names
    assert any(n.split(".")[0].endswith("c10d_functional") and ".all_reduce." in n for n in names)
    if fsdp2:
        assert {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"} <= names
    # c10d.reduce_ (its Work alone returned): rank 0's reduced tensor is an output of it, and the sum
    # reading it afterwards reads the reduced values, not what was hashed before the reduce
    zero = _records(_trace(ranks, "a", "collectives", 0))
    reduced = [r for r in zero if r.name == "c10d.reduce_.default" and r.role == "out.arg.0.0"]
    before = [r for r in zero if r.name == "c10d.reduce_.default" and r.role == "in.0.0"]
    after = [r for r in zero if r.name == "aten.sum.default" and r.role == "in.0" and r.shape == (2048,)]
    assert len(reduced) == len(before) == len(after) == 2
    expected = summarize(torch.arange(2048.0) * 2 + 1, "xxh3-128")[2]
    assert all(r.digest == expected for r in reduced + after) and before[0].digest != expected
    # rank 1's broadcast buffer came from torch.empty: its value before the op is not its bytes
    told = [r for r in _records(_trace(ranks, "a", "collectives", 1))
            if r.name == "c10d.broadcast_.default" and r.role == "in.0.0"]
    assert told and all(r.note == "uninitialized float32[3]" for r in told)
    # step 1 of DDP rebuilds its buckets (torch.empty, written through views by aten.mul.out): the
    # all-reduce's input is the bucket's bytes, not "uninitialized"
    bucket = [r for r in _records(_trace(ranks, "a", "ddp-ops", 0))
              if r.step == 1 and r.name == "c10d.allreduce_.default" and r.role == "in.0.0"]
    assert bucket and all(r.dtype == "float32" for r in bucket)


def test_a_difference_from_another_rank_is_said_to_come_through_a_collective_in_fresh_processes(ranks, capsys):
    # rank 1 alone was fed another batch at step 1: rank 0's trace differs first where the gradients
    # came back from the all-reduce
    r = first_divergence(_trace(ranks, "a", "ddp-ops", 0), _trace(ranks, "b", "ddp-ops-other", 0))
    f = r.first
    assert f is not None and (f["step"], f["phase"], f["kind"], f["name"]) == (1, "backward", "op",
                                                                                "c10d.allreduce_.default")
    assert f["role"].startswith("out") and r.verdict == COLLECTIVE and "c10d.allreduce_" in r.origin
    rank1 = [str(_trace(ranks, run, job, 1)) for run, job in (("a", "ddp-ops"), ("b", "ddp-ops-other"))]
    assert f"tensorcanon diverge {rank1[0]} {rank1[1]}" in r.explanation
    assert "not deterministic here" not in r.explanation
    # at level modules: the first gradient the optimizer used
    r = first_divergence(_trace(ranks, "a", "ddp-modules", 0), _trace(ranks, "b", "ddp-modules-other", 0))
    f = r.first
    assert f is not None and (f["step"], f["kind"]) == (1, "grad") and r.verdict == COLLECTIVE
    assert "all-reduce" in r.origin and "rank1" in r.explanation
    assert "not deterministic here" not in r.explanation
    # at level steps (the ops trace compared on the kinds both recorded): the parameters after the step
    r = first_divergence(_trace(ranks, "a", "ddp-steps", 0), _trace(ranks, "b", "ddp-ops-other", 0))
    f = r.first
    assert f is not None and (f["step"], f["kind"]) == (1, "param") and r.verdict == COLLECTIVE
    # rank 1's own traces: its batch
    r = first_divergence(_trace(ranks, "a", "ddp-modules", 1), _trace(ranks, "b", "ddp-modules-other", 1))
    assert r.verdict == INPUTS and r.first is not None and (r.first["step"], r.first["kind"]) == (1, "batch")
    assert cli(["diverge", str(_trace(ranks, "a", "ddp-modules", 0)),
                str(_trace(ranks, "b", "ddp-modules-other", 0))]) == 1
    out = capsys.readouterr().out
    assert f"verdict: {COLLECTIVE}" in out and "tensorcanon diverge" in out


def test_fsdp2_traces_in_fresh_processes(ranks):
    _, fsdp2 = _jobs()
    if not fsdp2:
        pytest.skip("FSDP2 (fully_shard) runs only on CUDA before torch 2.6 (it creates CUDA streams); "
                    "this test runs it on the CPU")
    # byte-identical runs: in test_identical_ddp_runs_...; the sharded parameters are recorded by
    # their local shard (a DTensor's bytes), not as a note
    steps = _records(_trace(ranks, "a", "fsdp-steps", 0))
    params = [r for r in steps if r.kind in ("param", "optim")]
    assert params and all(r.dtype != "text" for r in params)
    r = first_divergence(_trace(ranks, "a", "fsdp-ops", 0), _trace(ranks, "b", "fsdp-ops-other", 0))
    f = r.first
    assert f is not None and f["step"] == 1 and f["name"].startswith("c10d.") and r.verdict == COLLECTIVE
