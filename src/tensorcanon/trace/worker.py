"""Hashing off the training thread: large tensors are copied (one memcpy) on the training thread
and hashed, with their sum of squares, on one worker thread, which also writes every record in
the order it was made. At most ``budget`` bytes of copies wait at a time: past it, the training
thread waits for the worker (so memory stays bounded, and the overhead falls back to hashing
in line when the worker cannot keep up)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from .layout import Record
from .summary import finish

FLUSH = object()
STOP = object()


class Worker:
    def __init__(self, write: Callable[[Record], None], flush: Callable[[], None], algorithm: str,
                 budget: int = 32 << 20) -> None:
        self.write, self.flush, self.algorithm, self.budget = write, flush, algorithm, budget
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.waiting = 0
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tensorcanon-trace", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is STOP:
                return
            if self.error is not None:
                continue
            try:
                if item is FLUSH:
                    self.flush()
                elif type(item) is Record:
                    self.write(item)
                else:
                    ident, (dtype, shape, data, floats) = item
                    self.write(Record._make((*ident, *finish(dtype, shape, data, floats, self.algorithm))))
                    with self.cond:
                        self.waiting -= len(data)
                        self.cond.notify_all()
            except BaseException as e:  # noqa: BLE001 (handed to the training thread at its next record)
                self.error = e
                with self.cond:
                    self.waiting = 0
                    self.cond.notify_all()

    def check(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def put_record(self, r: Record) -> None:
        self.check()
        self.queue.put(r)

    def put_job(self, ident: tuple[Any, ...], job: tuple[str, tuple[int, ...], bytes, Any]) -> None:
        self.check()
        n = len(job[2])
        with self.cond:
            while self.waiting and self.waiting + n > self.budget and self.error is None:
                self.cond.wait()
            self.waiting += n
        self.queue.put((ident, job))

    def put_flush(self) -> None:
        self.queue.put(FLUSH)

    def stop(self) -> None:
        """Wait until every record is written."""
        self.queue.put(STOP)
        self.thread.join()
        self.check()
