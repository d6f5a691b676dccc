"""What tracing costs a training step: a small transformer on the CPU, untraced and at each level.

    python benchmarks/trace_bench.py [--rounds 7] [--steps 5]

Each round runs ``--steps`` training steps untraced, then at level steps, modules and ops (the
order turns by one each round), timing each step; a level's ratio is the median over rounds of
(its median step time / the untraced median step time of the same round), so a slow stretch of
a shared machine cancels out. Also: the peak traced Python memory (tracemalloc, one extra step
per level: the recorder keeps no activation, so it should stay within a few MB of the untraced
step), the trace bytes per step, and reading speed (records per second of first_divergence).
Targets (issue 31): steps <= 1.05x, modules <= 1.5x, ops <= 3x. ``ops-thread`` is level ops
with ``off_thread=True`` (large tensors copied and hashed on a worker thread), for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch
from torch import nn

import tensorcanon

D, HEADS, LAYERS, SEQ, BATCH, VOCAB = 256, 4, 4, 128, 8, 1000
TARGETS = {"steps": 1.05, "modules": 1.5, "ops": 3.0}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)))


def _step(tr, model, opt, batch) -> None:
    if tr is not None:
        tr.step(batch)
    logits = model(batch[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    if tr is not None:
        tr.loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad()


def run_level(level: str | None, steps: int, folder: str, memory: bool = False) -> tuple[list[float], int, int]:
    """(step times, trace bytes, peak traced memory of the last step) of ``steps`` steps at ``level``."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, VOCAB, (steps + 1, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    path = os.path.join(folder, f"{level}.trace")
    times, peak = [], 0
    worker = level is not None and level.endswith("-thread")
    lv = level.removesuffix("-thread") if level else None
    tr_cm = tensorcanon.trace(path, level=lv, model=model, optimizer=opt, off_thread=worker) if lv else None
    tr = tr_cm.__enter__() if tr_cm else None
    try:
        _step(tr, model, opt, data[0])  # warm up (allocator, first-call costs)
        for i in range(steps):
            t = time.perf_counter()
            _step(tr, model, opt, data[i + 1])
            times.append(time.perf_counter() - t)
        if memory:
            tracemalloc.start()
            _step(tr, model, opt, data[0])
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        if tr_cm:
            tr_cm.__exit__(None, None, None)
    size = os.path.getsize(path) if level else 0
    return times, size, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    levels: list[str | None] = [None, "steps", "modules", "ops", "ops-thread"]
    ratios: dict[str, list[float]] = {lv: [] for lv in [*TARGETS, "ops-thread"]}
    medians: dict[str | None, list[float]] = {lv: [] for lv in levels}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            order = levels[r % len(levels):] + levels[:r % len(levels)]
            got = {}
            for lv in order:
                times, size, _ = run_level(lv, args.steps, folder)
                got[lv] = statistics.median(times)
                medians[lv].append(got[lv])
                if lv:
                    sizes[lv] = size // (args.steps + 1)
            for lv in ratios:
                ratios[lv].append(got[lv] / got[None])
            print(f"round {r + 1}: " + ", ".join(f"{lv or 'untraced'} {got[lv] * 1e3:.1f} ms" for lv in levels),
                  file=sys.stderr)
        peaks = {lv: run_level(lv, 1, folder, memory=True)[2] for lv in levels}
        # reading: records per second of a comparison of the ops trace with itself
        path = os.path.join(folder, "ops.trace")
        t = time.perf_counter()
        res = tensorcanon.first_divergence(path, path)
        read_s = time.perf_counter() - t
    print(f"torch {torch.__version__}, 1 thread, model d={D}, {LAYERS} layers, seq {SEQ}, batch {BATCH}; "
          f"{args.rounds} rounds of {args.steps} steps; load average {os.getloadavg()[0]:.2f}")
    print("| level | median step | ratio to untraced (median of per-round ratios) | target | result "
          "| trace bytes per step | peak traced memory of a step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| untraced | {statistics.median(medians[None]) * 1e3:.1f} ms | 1 | | | | "
          f"{peaks[None] / 2**20:.1f} MiB |")
    for lv, target in [*TARGETS.items(), ("ops-thread", TARGETS["ops"])]:
        ratio = statistics.median(ratios[lv])
        print(f"| {lv} | {statistics.median(medians[lv]) * 1e3:.1f} ms | {ratio:.2f}x "
              f"(rounds {min(ratios[lv]):.2f}-{max(ratios[lv]):.2f}) | <= {target}x | "
              f"{'pass' if ratio <= target else 'FAIL'} | {sizes[lv]:,} | {peaks[lv] / 2**20:.1f} MiB |")
    print(f"comparing the ops trace with itself: {res.matched:,} records in {read_s:.2f} s "
          f"({res.matched / read_s:,.0f} records/s, two streams)")


if __name__ == "__main__":
    main()
