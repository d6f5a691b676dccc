"""A worker process that reads hostile files for tests/attacks/test_redteam_kinds.py.

torch builds sparse and nested tensors from the parts it is given and, unless asked to check them,
trusts them: a hostile part can crash the interpreter (SIGSEGV), not just raise. So every hostile
file is read here, in a process of its own, whose address space is capped (a claimed size that is
allocated fails here, not on the machine) and which the test restarts when it dies.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout (after a marker:
other output is not an answer). A request is ``{"op": "read", "path": P}`` (every read path of
hostile_lib.check, plus the command line's ``verify``), ``{"op": "diff", "a": A, "b": B}``
(``tensorcanon.diff`` and the command line's ``diff``), ``{"op": "cli", "argv": [...]}`` (the
command line) or ``{"op": "call", "code": C}`` (``exec`` of test-written code that sets ``result``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fuzz"))

warnings.simplefilter("ignore")

import torch
from torch.testing._internal.two_tensor import TwoTensor

import tensorcanon
from tensorcanon.format.errors import TensorCanonError
from tensorcanon.tools.cli import main

import hostile_lib as h

MARK = "@@answer "  # other lines on stdout (torch's, a warning) are not answers
HEADROOM = 2 << 30  # what a read may allocate beyond what the process holds at start


def _cap() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.RLIM_INFINITY))


def _attempt(fn) -> dict:
    try:
        fn()
    except TensorCanonError as e:
        return {"ok": False, "cls": type(e).__name__, "msg": str(e)}
    except BaseException as e:  # noqa: BLE001 - a foreign exception is what the test looks for
        return {"ok": False, "cls": type(e).__name__, "msg": str(e), "foreign": True,
                "tb": traceback.format_exc()[-2000:]}
    return {"ok": True}


def _cli(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException as e:  # noqa: BLE001
            return {"code": None, "raised": f"{type(e).__name__}: {e}", "stderr": err.getvalue()[-2000:]}
    return {"code": code, "stdout": out.getvalue()[-2000:], "stderr": err.getvalue()[-2000:]}


def read(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    answer = {"load": _attempt(lambda: tensorcanon.loads(data)),
              "verify": _attempt(lambda: tensorcanon.verify(data))}
    # every other read path (stream, mmap, open) must agree: hostile_lib's contract
    answer["contract"] = _attempt(lambda: h.check(data, strict=False))
    answer["cli_verify"] = _cli(["verify", path])
    return answer


def diff(a: str, b: str) -> dict:
    answer = {"diff": _attempt(lambda: tensorcanon.diff(a, b))}
    answer["cli_diff"] = _cli(["diff", a, b])
    return answer


def call(code: str) -> dict:
    scope: dict = {"tensorcanon": tensorcanon, "torch": torch, "h": h}
    answer = _attempt(lambda: exec(code, scope))
    answer["result"] = repr(scope.get("result"))
    return answer


def serve() -> None:
    tensorcanon.register(TwoTensor)
    tensorcanon.register_builtin_codecs()
    _cap()
    for line in sys.stdin:
        req = json.loads(line)
        with h.deadline(60):
            if req["op"] == "read":
                answer = read(req["path"])
            elif req["op"] == "diff":
                answer = diff(req["a"], req["b"])
            elif req["op"] == "cli":
                answer = _cli(req["argv"])
            else:
                answer = call(req["code"])
        sys.stdout.write(MARK + json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
