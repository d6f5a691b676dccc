"""The GPU-aware path: CUDA tensors streamed through a small ring of pinned buffers.

Saving: a CUDA tensor's canonical bytes are copied device-to-host in chunks,
asynchronously on a side stream, into one of a few pinned staging buffers,
while the previous chunk is hashed and written. Only the ring (a few tens of
MiB) is ever held on the host: never a CPU copy of the tensor or of the state.

Loading: the file is read chunk by chunk into the pinned ring, each chunk is
hashed, then copied to the device with ``non_blocking=True``; a buffer is
reused only once the copy out of it has completed (CUDA events).

Nothing here runs unless a tensor is on a CUDA device; the CPU path does not
import or touch CUDA. The buffers are allocated on first use and kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

from ..format import tensorbytes
from ..format.tensorbytes import resolved

CHUNK = 16 << 20   # bytes per pinned staging buffer
DEPTH = 3          # buffers in the ring: copies in flight while one chunk is consumed

_lock = threading.Lock()     # one stream of chunks at a time uses the shared ring
_ring: list[torch.Tensor] = []
_streams: dict[int, torch.cuda.Stream] = {}


def is_cuda(value: object) -> bool:
    """True for a torch tensor that lives on a CUDA device."""
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _buffers() -> list[torch.Tensor]:
    if not _ring:
        for _ in range(DEPTH):
            _ring.append(tensorbytes.host_empty(CHUNK, torch.uint8, pin_memory=True))
    return _ring


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def canonical_flat(t: torch.Tensor) -> torch.Tensor:
    """The tensor's canonical bytes as a flat contiguous uint8 tensor on its own device.

    Resolves lazy conjugation/negation and non-contiguous layouts on the GPU
    (one device-side copy of that tensor only when needed), and stores bool as 0/1.
    """
    t = resolved(t)
    flat = t.contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    u = flat.view(torch.uint8)
    if t.dtype is torch.bool:
        u = (u != 0).to(torch.uint8)
    return u


def host_chunks(t: torch.Tensor) -> Iterator[memoryview]:
    """Yield the canonical bytes of CUDA tensor ``t`` as host memoryviews, in order.

    Up to DEPTH device-to-host copies run ahead on a side stream; each yielded
    view is valid until the next one is requested (its buffer is then reused).
    """
    src = canonical_flat(t)
    n = src.numel()
    if n == 0:
        return
    with _lock:
        ring = _buffers()
        stream = _side_stream(src.device)
        # The side stream must see every kernel already queued that writes ``t``.
        stream.wait_stream(torch.cuda.current_stream(src.device))
        events: list = [None] * len(ring)
        starts = list(range(0, n, CHUNK))
        issued = 0

        def issue(k: int) -> None:
            slot = k % len(ring)
            lo = starts[k]
            hi = min(lo + CHUNK, n)
            with torch.cuda.stream(stream):
                ring[slot][: hi - lo].copy_(src[lo:hi], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            events[slot] = ev

        try:
            while issued < min(len(ring), len(starts)):
                issue(issued)
                issued += 1
            for k in range(len(starts)):
                slot = k % len(ring)
                events[slot].synchronize()
                lo = starts[k]
                size = min(CHUNK, n - lo)
                yield ring[slot].numpy().data[:size]
                # The consumer is done with this buffer: refill it with a later chunk.
                if issued < len(starts):
                    issue(issued)
                    issued += 1
        finally:
            stream.synchronize()  # no copy may still target a buffer another call reuses


def read_to_device(readinto: Callable[[memoryview], None], nbytes: int, device: torch.device,
                   update: Callable[[memoryview], None] | None) -> torch.Tensor:
    """Read ``nbytes`` through the pinned ring into a new uint8 tensor on ``device``.

    ``readinto(view)`` fills a host view with the next bytes of the file;
    ``update(view)`` (the hasher) sees every chunk before it is copied.
    """
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes == 0:
        return out
    with _lock:
        ring = _buffers()
        events: list = [None] * len(ring)
        stream = torch.cuda.current_stream(out.device)
        try:
            for k, lo in enumerate(range(0, nbytes, CHUNK)):
                slot = k % len(ring)
                if events[slot] is not None:
                    events[slot].synchronize()  # the copy out of this buffer is done
                size = min(CHUNK, nbytes - lo)
                view = ring[slot].numpy().data[:size]
                readinto(view)
                if update is not None:
                    update(view)
                out[lo : lo + size].copy_(ring[slot][:size], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                events[slot] = ev
        finally:
            stream.synchronize()
    return out


__all__ = ["is_cuda", "host_chunks", "read_to_device", "canonical_flat", "CHUNK", "DEPTH"]
