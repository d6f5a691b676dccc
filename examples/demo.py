"""Save a training checkpoint canonically, load it back, verify it, print its digest.

Run: python examples/demo.py
"""

import os
import sys
import tempfile

import torch
from safetensors import safe_open

import tensorcanon


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.safetensors")
        digest = tensorcanon.save(ckpt, path, metadata={"step": 5})
        print(f"saved   {path} ({os.path.getsize(path)} bytes)")
        print(f"digest  {digest}")
        print(f"verify  {tensorcanon.verify(path)}")
        loaded = tensorcanon.load(path)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        meta = tensorcanon.read_metadata(path)
        same = tensorcanon.fingerprint(loaded, metadata=meta) == digest == tensorcanon.fingerprint(ckpt, metadata=meta)
        print(f"reload  fingerprint of the loaded object {'matches' if same else 'DIFFERS'}")
        with safe_open(path, framework="pt") as f:
            print(f"safetensors reads {len(list(f.keys()))} tensors, e.g. {sorted(f.keys())[0]!r}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
