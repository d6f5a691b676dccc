"""Real training checkpoints round-trip exactly and resume bit-identically.

After a few training steps, {model, optimizer, scheduler, scaler} state_dicts
go through tensorcanon and through torch.save/torch.load(weights_only=True);
both must give back the same structure, types (int keys included) and bits.
Loading the tensorcanon copy into fresh objects and training on must give the
same parameters as training on without a checkpoint.
"""

import io

import pytest
import torch

import tensorcanon as tc

from compare import assert_same

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def batches(n, start=0):
    g = torch.Generator().manual_seed(1234)
    data = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(start + n)]
    return data[start:]


def build(opt_name):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, sched, scaler


def train(model, opt, sched, scaler, data):
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def checkpoint(model, opt, sched, scaler):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(), "step": 3}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_checkpoint_matches_torch_save_round_trip(opt_name):
    parts = build(opt_name)
    train(*parts, batches(3))
    ckpt = checkpoint(*parts)
    assert parts[3].is_enabled() and any(isinstance(k, int) for k in ckpt["optimizer"]["state"])

    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    via_torch = torch.load(buf, weights_only=True)
    via_tc = tc.loads(tc.dumps(ckpt))

    assert_same(via_torch, via_tc)  # structure, types (int keys, OrderedDict, _metadata), bits
    assert_same(ckpt, via_tc)
    assert list(via_tc["optimizer"]["state"]) == list(via_torch["optimizer"]["state"])
    assert list(via_tc["model"]) == list(ckpt["model"])  # OrderedDict order kept


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_resuming_from_tensorcanon_is_bit_identical(tmp_path, opt_name):
    # reference: 5 steps without interruption
    ref = build(opt_name)
    train(*ref, batches(5))

    # interrupted: 3 steps, save, load into fresh objects, 2 more steps
    first = build(opt_name)
    train(*first, batches(3))
    path = tmp_path / "ckpt.safetensors"
    digest = tc.save(checkpoint(*first), path)
    assert tc.verify(path) == digest
    loaded = tc.load(path)

    model, opt, sched, scaler = build(opt_name)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["scheduler"])
    scaler.load_state_dict(loaded["scaler"])
    train(model, opt, sched, scaler, batches(2, start=3))

    assert_same(checkpoint(*ref), checkpoint(model, opt, sched, scaler))
    # same content, same bytes
    assert tc.dumps(checkpoint(*ref)) == tc.dumps(checkpoint(model, opt, sched, scaler))
