"""Write the committed input files of the golden CLI tests (tests/cli/inputs/).

Run once (``python tests/cli/make_inputs.py``) and commit the result; the
tests read these files as they are, so a change in what tensorcanon writes
shows up as a test failure instead of silently changing the inputs.
Afterwards regenerate the expected outputs with
``TENSORCANON_UPDATE_GOLDEN=1 python -m pytest tests/test_cli_golden.py`` and review them.
"""

import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

import tensorcanon

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inputs")


def base_object():
    return {
        "model": {
            "fc.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 4,
            "fc.bias": torch.tensor([0.5, -0.25, 0.0, 1.0]),
        },
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True]),
        "step": 10,
        "name": "demo",
    }


def main() -> None:
    os.makedirs(HERE, exist_ok=True)

    def path(name: str) -> str:
        return os.path.join(HERE, name)

    base = base_object()
    tensorcanon.save(base, path("base.safetensors"), metadata={"epoch": 1})

    # The same content with one element changed.
    one = base_object()
    one["model"]["fc.weight"][2, 1] = 100.0
    tensorcanon.save(one, path("one_element.safetensors"), metadata={"epoch": 1})

    # Structural changes: a key removed, one added, a dtype, a shape and a value changed.
    changed = base_object()
    del changed["mask"]
    changed["extra"] = torch.zeros(2)
    changed["ids"] = changed["ids"].to(torch.int32)
    changed["model"]["fc.bias"] = torch.zeros(3)
    changed["step"] = 11
    tensorcanon.save(changed, path("changed.safetensors"), metadata={"epoch": 1})

    # One byte of tensor data flipped: the file parses but a tensor's digest fails.
    data = bytearray(open(path("base.safetensors"), "rb").read())
    data[-3] ^= 0xFF  # inside the last tensor in data order
    open(path("corrupt.safetensors"), "wb").write(bytes(data))

    # Cut short: the header promises more data than there is.
    open(path("truncated.safetensors"), "wb").write(bytes(data[: len(data) - 10]))

    # Not a tensor file at all.
    open(path("notes.txt"), "w").write("these are not tensors\n")

    # Plain safetensors, torch.save and numpy files with the model's tensors.
    flat = {"fc.weight": base["model"]["fc.weight"], "fc.bias": base["model"]["fc.bias"]}
    save_file(flat, path("plain.safetensors"))
    torch.save(flat, path("weights.pt"))
    np.savez(path("arrays.npz"), **{k: v.numpy() for k, v in flat.items()})

    # A lockfile that matches base.safetensors and plain.safetensors, and lists a missing file.
    from tensorcanon import lockfile

    entries = lockfile.make_lock([path("base.safetensors"), path("plain.safetensors")], path("good.lock"))
    lockfile.write_lock(entries, path("good.lock"))
    bad = [lockfile.LockEntry(e.path, e.digest, e.size) for e in entries]
    bad.append(lockfile.LockEntry("missing.safetensors", entries[0].digest, 1))
    bad.append(lockfile.LockEntry("corrupt.safetensors", entries[0].digest, entries[0].size))
    bad.append(lockfile.LockEntry("one_element.safetensors", entries[0].digest, entries[0].size))
    lockfile.write_lock(bad, path("bad.lock"))
    open(path("malformed.lock"), "w").write("tensorcanon-lock 1\nnot a digest line\n")
    print(f"wrote inputs to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
