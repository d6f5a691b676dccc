"""The recorder in-process: hashing off the training thread gives the same bytes, usage errors,
rank paths, resuming a trace."""

from __future__ import annotations

import pytest
import torch

import tensorcanon
from tensorcanon import UsageError
from tensorcanon.trace import layout
from tensorcanon.trace.recorder import rank_path


def _train(path, level="ops", steps=2, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(steps, 64, 256, generator=torch.Generator().manual_seed(1))
    with tensorcanon.trace(path, level=level, model=model, optimizer=opt, **kw) as tr:
        for batch in data:
            tr.step(batch)
            tr.loss(model(batch).square().mean()).backward()
            opt.step()
            opt.zero_grad()


def test_hashing_off_the_training_thread_writes_the_same_bytes(tmp_path):
    _train(tmp_path / "inline")
    _train(tmp_path / "thread", off_thread=True)
    data = (tmp_path / "inline").read_bytes()
    assert data == (tmp_path / "thread").read_bytes()
    big = [r for r in layout.Reader(tmp_path / "inline") if r.dtype == "float32" and 4 * _n(r.shape) >= 64 << 10]
    assert len(big) > 10  # the worker did hash tensors


def _n(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="level"):
        tensorcanon.trace(tmp_path / "t", level="layers")
    with pytest.raises(UsageError, match="model="):
        tensorcanon.trace(tmp_path / "t", level="modules")
    with pytest.raises(UsageError, match="step|kind"):
        tensorcanon.trace(tmp_path / "t", capture="7|weights||x|0")
    with pytest.raises(UsageError, match="no trace"):
        with tensorcanon.trace(tmp_path / "missing", resume_at=3):
            pass
    tr = tensorcanon.trace(tmp_path / "t")
    with pytest.raises(UsageError, match="outside"):
        tr.step(torch.zeros(1))


def test_rank_paths():
    assert rank_path("run.trace", 0, 1) == "run.trace"
    assert rank_path("run.trace", 1, 2) == "run.rank1.trace"
    assert rank_path("run.{rank}.trace", 3, 4) == "run.3.trace"


def test_resume_at_cuts_the_later_steps_and_continues_the_chain(tmp_path):
    _train(tmp_path / "whole", level="steps", steps=4)
    _train(tmp_path / "part", level="steps", steps=4)
    with layout.Reader(tmp_path / "part") as r:
        before = [x for x in r if x.step < 2]
    # a run that resumes at step 2 from what the first two steps left (here: recomputed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(1))
    for batch in data[:2]:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with tensorcanon.trace(tmp_path / "part", level="steps", model=model, optimizer=opt, resume_at=2) as tr:
        for batch in data[2:]:
            tr.step(batch)
            tr.loss(model(batch).square().mean()).backward()
            opt.step()
            opt.zero_grad()
    records = list(layout.Reader(tmp_path / "part"))
    assert records[:len(before)] == before and {x.step for x in records} == {0, 1, 2, 3}
    assert tensorcanon.first_divergence(tmp_path / "whole", tmp_path / "part").same


def _loader_run(path):
    """Level ops, a shuffled, seeded DataLoader of two forked workers, iterated as a training loop
    does: the main process rebuilds the workers' batches in the order they answer, between an
    optimizer step and the next ``step()`` (not recorded: docs/TRACE.md). The second epoch's
    workers are forked inside a step, while ops are recorded and the trace's buffer holds records:
    they run torch ops (collate) and must record nothing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=2,
                                         multiprocessing_context="fork", generator=torch.Generator().manual_seed(0))
    with tensorcanon.trace(path, level="ops", model=model, optimizer=opt) as tr:
        it = iter(loader)
        for k in range(2 * len(loader)):
            batch = next(it)
            tr.step(batch)
            loss = tr.loss(model(batch).square().mean())
            if k == len(loader) - 1:
                it = iter(loader)  # the next epoch's workers, forked inside the step
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_forked_dataloader_workers_record_nothing(tmp_path):
    _loader_run(tmp_path / "a")
    _loader_run(tmp_path / "b")
    assert layout.verify(tmp_path / "a")[1] > 0
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    ops = {r.name for r in layout.Reader(tmp_path / "a") if r.kind == "op"}
    assert "aten.stack.default" not in ops  # the collate's stack ran in a worker, unrecorded


def _resumed(path, restore_optimizer: bool):
    """Two steps traced, then a 'new process' resuming at step 2 with the parameters restored and
    the optimizer state restored or not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    with tensorcanon.trace(path, model=model, optimizer=opt) as tr:
        for batch in data[:2]:
            tr.step(batch)
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    model2 = torch.nn.Linear(8, 2)
    model2.load_state_dict(saved[0])
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    if restore_optimizer:
        opt2.load_state_dict(saved[1])
    with tensorcanon.trace(path, model=model2, optimizer=opt2, resume_at=2) as tr:
        tr.step(data[2])
        model2(data[2]).square().mean().backward()
        opt2.step()


def test_resuming_checks_the_state_against_the_trace(tmp_path, recwarn):
    from tensorcanon.trace.recorder import ResumeWarning

    _resumed(tmp_path / "ok", restore_optimizer=True)
    assert not [w for w in recwarn if issubclass(w.category, ResumeWarning)]
    with pytest.warns(ResumeWarning, match=r"resumed at step 2.*optimizer state weight exp_avg is missing"):
        _resumed(tmp_path / "lost", restore_optimizer=False)


class _Twice(torch.nn.Module):
    """Uses one tensor, changes it in place, uses it again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        a.mul(2)
        a.add_(1)    # the same object, its version counter bumped
        return a.mul(2)


def test_a_tensor_met_again_is_hashed_again_once_changed_in_place(tmp_path):
    model = _Twice()
    x = torch.arange(4096, dtype=torch.float32) / 4096
    with tensorcanon.trace(tmp_path / "t", level="ops", model=model) as tr:
        tr.step(x)
        model(x)
    muls = [r for r in layout.Reader(tmp_path / "t") if r.name == "aten.mul.Tensor" and r.role == "in.0"]
    assert len(muls) == 2 and muls[0].digest != muls[1].digest  # exp(x), then exp(x) + 1
    exp_out = next(r for r in layout.Reader(tmp_path / "t") if r.name == "aten.exp.default" and r.role == "out")
    assert muls[0].digest == exp_out.digest and muls[0].sumsq == exp_out.sumsq
    from tensorcanon.trace.summary import summarize

    assert muls[1].digest == summarize((x.exp() + 1), "xxh3-128")[2]
