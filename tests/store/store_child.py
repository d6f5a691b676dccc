"""Processes for tests/store/test_store_processes.py: ``writer ROOT NAME N`` saves tags, ``collector ROOT
STOPFILE`` runs gc until STOPFILE exists, ``killer ROOT TRIALS`` forks savers (save, and save_async) and SIGKILLs
each at a random moment, then exits with a save_async under way. Run as scripts (python store_child.py ...)."""

import os
import random
import signal
import sys
import time
import zlib

import torch

import tensorcanon as tc

torch.set_num_threads(1)


def base():
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(1234))


def state(name, i):
    """Tag ``{name}-{i}``'s object: a frozen base all share, a tensor of its own, and the scratch tensor of
    the previous step (which that step saved under a scratch tag and deleted: garbage the gc may be removing)."""
    g = torch.Generator().manual_seed(seed(name, i))
    prev = torch.Generator().manual_seed(seed(name, i - 1, "scratch"))
    return {"base": base(), "own": torch.randn(64, 64, generator=g), "prev": torch.randn(32, 32, generator=prev),
            "i": i}


def seed(*parts):
    return zlib.crc32(repr(parts).encode())


def scratch(name, i):
    g = torch.Generator().manual_seed(seed(name, i, "scratch"))
    return {"prev": torch.randn(32, 32, generator=g)}


def writer(root, name, n):
    store = tc.Store(root)
    for i in range(n):
        store.save(f"{name}-scratch-{i}", scratch(name, i))
        store.delete(f"{name}-scratch-{i}")
        store.save(f"{name}-{i:02d}", state(name, i))


def collector(root, stop):
    store = None
    while not os.path.exists(stop):
        try:
            store = store or tc.Store(root)
            store.gc()
            time.sleep(0.05)
        except tc.MissingFileError:  # (nothing saved yet)
            time.sleep(0.05)


def big(trial):
    g = torch.Generator().manual_seed(trial)
    return {"w": [torch.randn(512, 512, generator=g) for _ in range(6)], "trial": trial}


def killer(root, trials):
    tc.Store(root).save("baseline", big(-1))
    rng = random.Random(7)
    for trial in range(trials):
        pid = os.fork()
        if pid == 0:
            try:
                store = tc.Store(root)
                if trial % 2:  # (killed before, during or after its background part)
                    store.save_async(f"k{trial:02d}", big(trial)).result()
                else:
                    store.save(f"k{trial:02d}", big(trial))
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # a background save under way when the process exits is finished first (its result never asked for)
    tc.Store(root).save_async("at-exit", big(trials))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "writer":
        writer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif what == "collector":
        collector(sys.argv[2], sys.argv[3])
    else:
        killer(sys.argv[2], int(sys.argv[3]))
