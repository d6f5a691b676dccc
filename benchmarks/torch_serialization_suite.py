"""Run PyTorch's own serialization tests with tensorcanon in place of torch.save and torch.load.

    python benchmarks/torch_serialization_suite.py PATH/TO/test_serialization.py [--json OUT] \
        [-k REGEX] [--exclude REGEX] [--timeout SECONDS]

PATH is PyTorch's ``test/test_serialization.py`` (not part of this repository: take it from
PyTorch's sources for the installed version; torch's testing internals come with torch). Every
``torch.save(obj, f, ...)`` becomes ``tensorcanon.save(obj, f)`` and every
``torch.load(f, map_location=..., weights_only=..., mmap=...)`` becomes ``tensorcanon.load``.
Options that exist only for pickle (``pickle_module``, ``pickle_protocol``, ``encoding``) are
refused with tensorcanon's UsageError.

Each test ends in one of:

- ``pass``;
- ``refusal``: tensorcanon raised its own error (an unsupported value such as a storage or a
  tensor subclass, a pickle file handed to ``load``): README says what is refused and why;
- ``assertion``: the test's own check failed with no tensorcanon error: a behaviour that differs
  from torch's (for instance a test that expects torch's exception, or storage sharing), to be
  read case by case for a silent change of a value;
- ``foreign``: an exception that is not tensorcanon's, raised from inside tensorcanon: a bug;
- ``error``: any other exception (the test's own code, torch internals it calls directly);
- ``skip``, ``timeout``;
- ``crash``: the interpreter died (a signal) while the test ran: a bug. The suite goes on in a
  fresh interpreter from the next test.

Exit status 0 unless a test crashed or raised a foreign exception. Measured figures and the
outcome of each test go to ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from typing import Any

CATEGORIES = ("pass", "refusal", "assertion", "foreign", "error", "skip", "timeout", "crash")


# ------------------------------------------------------------------ the replacements


def _install() -> None:
    import torch

    import tensorcanon

    def save(obj: Any, f: Any, pickle_module: Any = None, pickle_protocol: Any = None,
             _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False) -> None:
        if pickle_module is not None or pickle_protocol is not None:
            raise tensorcanon.UsageError("pickle_module and pickle_protocol are torch.save's: "
                                         "tensorcanon never pickles")
        tensorcanon.save(obj, f)

    def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
             mmap: Any = None, **pickle_load_args: Any) -> Any:
        if pickle_module is not None or pickle_load_args:
            raise tensorcanon.UsageError(
                f"{'pickle_module' if pickle_module is not None else sorted(pickle_load_args)} is torch.load's: "
                "tensorcanon never unpickles")
        return tensorcanon.load(f, map_location=map_location, weights_only=weights_only, mmap=bool(mmap))

    torch.save = save
    torch.load = load


# ------------------------------------------------------------------ one interpreter's run


class _Timeout(BaseException):
    pass


def _from_tensorcanon(tb: Any) -> bool:
    frames = traceback.extract_tb(tb)
    return bool(frames) and "tensorcanon" in frames[-1].filename.replace(os.sep, "/").split("/src/")[-1]


def _classify(err: tuple) -> tuple[str, str]:
    import tensorcanon

    exc_type, exc, tb = err
    text = f"{exc_type.__name__}: {str(exc)[:300]}"
    if isinstance(exc, tensorcanon.TensorCanonError):
        return "refusal", text
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:  # a tensorcanon error inside the test's own check
        seen.add(id(cause))
        if isinstance(cause, tensorcanon.TensorCanonError):
            return "refusal", text
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, _Timeout):
        return "timeout", text
    if isinstance(exc, AssertionError):
        return "assertion", text
    if _from_tensorcanon(tb):
        return "foreign", text
    return "error", text


class _Result(unittest.TestResult):
    def __init__(self, out: Any, timeout: float) -> None:
        super().__init__()
        self.out, self.timeout = out, timeout
        self._start = 0.0
        self._done: set[str] = set()

    def _write(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        if test.id() in self._done:
            return
        self._done.add(test.id())
        self.out.write(json.dumps({"test": test.id(), "outcome": outcome, "detail": detail,
                                   "seconds": round(time.perf_counter() - self._start, 2)}) + "\n")
        self.out.flush()

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self.out.write(json.dumps({"start": test.id()}) + "\n")
        self.out.flush()
        self._start = time.perf_counter()
        signal.alarm(int(self.timeout))

    def stopTest(self, test: unittest.TestCase) -> None:
        signal.alarm(0)
        self._write(test, "pass")
        super().stopTest(test)

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._write(test, *_classify(err))

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._write(test, *_classify(err))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._write(test, "skip", reason[:200])

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        if err is not None:
            self._write(test, *_classify(err))


def _expecttest_stand_in() -> None:
    """torch's testing internals import ``expecttest`` (PyTorch's own test dependency) for its
    TestCase base and accept flag; where it is not installed a stand-in with those two is used
    (no test of the serialization suite compares expected-output strings)."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        import types

        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        stand_in.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in


def _child(path: str, results: str, include: str | None, exclude: str | None, done: set[str],
           timeout: float) -> None:
    """Import the test file with the replacements installed and run its tests, one JSON line each."""
    _expecttest_stand_in()

    def on_alarm(*_: Any) -> None:
        raise _Timeout(f"over {timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    spec = importlib.util.spec_from_file_location("torch_serialization_suite_tests", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # (its import-time probe of torch.save runs with torch's own)
    _install()
    suite = unittest.TestSuite()

    def add(s: Any) -> None:
        for t in s:
            if isinstance(t, unittest.TestSuite):
                add(t)
            elif t.id() not in done and (include is None or re.search(include, t.id())) \
                    and not (exclude and re.search(exclude, t.id())):
                suite.addTest(t)

    add(unittest.defaultTestLoader.loadTestsFromModule(module))
    with open(results, "a", encoding="utf-8") as out:
        suite.run(_Result(out, timeout))


# ------------------------------------------------------------------ the parent: restarts after a crash


def _read(results: str) -> tuple[dict[str, dict], str | None]:
    outcomes: dict[str, dict] = {}
    started = None
    if not os.path.exists(results):
        return outcomes, None
    with open(results, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if "start" in row:
                started = row["start"]
            else:
                outcomes[row["test"]] = row
                started = None
    return outcomes, started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", help="PyTorch's test/test_serialization.py")
    ap.add_argument("-k", dest="include", help="run only tests whose id matches this regex")
    ap.add_argument("--exclude", help="leave out tests whose id matches this regex")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test (default 300)")
    ap.add_argument("--json", help="write every test's outcome and the counts here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        done = set(_read(args.child)[0])
        _child(args.test_file, args.child, args.include, args.exclude, done, args.timeout)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.jsonl")
        for _ in range(1000):  # one interpreter per crash
            cmd = [sys.executable, os.path.abspath(__file__), args.test_file, "--child", results,
                   "--timeout", str(args.timeout)]
            cmd += ["-k", args.include] if args.include else []
            cmd += ["--exclude", args.exclude] if args.exclude else []
            proc = subprocess.run(cmd, cwd=tmp)
            outcomes, started = _read(results)
            if proc.returncode == 0 or started is None:
                if proc.returncode != 0:
                    print(f"the test run failed (status {proc.returncode}) outside any test", file=sys.stderr)
                    return 2
                break
            code = proc.returncode
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
            with open(results, "a", encoding="utf-8") as f:
                f.write(json.dumps({"test": started, "outcome": "crash", "detail": f"the interpreter died: {why}",
                                    "seconds": None}) + "\n")
        outcomes, _ = _read(results)
    counts = {c: sum(1 for r in outcomes.values() if r["outcome"] == c) for c in CATEGORIES}
    for r in sorted(outcomes.values(), key=lambda r: (CATEGORIES.index(r["outcome"]), r["test"])):
        if r["outcome"] != "pass":
            print(f"{r['outcome']:9} {r['test']}: {r['detail']}")
    print("counts:", ", ".join(f"{c} {n}" for c, n in counts.items()), f"(of {len(outcomes)})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"counts": counts, "tests": sorted(outcomes.values(), key=lambda r: r["test"])}, f, indent=1)
    return 1 if counts["crash"] or counts["foreign"] else 0


if __name__ == "__main__":
    sys.exit(main())
