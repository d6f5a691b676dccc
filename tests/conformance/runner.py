"""Run a reader against the conformance corpus and say, case by case, whether it conforms.

A reader is either a command or a Python callable (README.md):

* ``python tests/conformance/runner.py --command "my-reader {file}"``: the command reads the file named
  in place of ``{file}`` and prints one line, ``accept <file digest>`` or ``reject <category>``
  (then, optionally, ``: <message>``), where the category is one of manifest.json's
  ``categories`` (format, limit, integrity, unsupported);
* ``python tests/conformance/runner.py --python package.module:function``: ``function(path)`` returns the
  file digest (``"xxh3-128:…"``) when it accepts the file and raises when it rejects it; the
  exception's class name gives the category (see :func:`category_of`).
  ``--python runner:tensorcanon_reader`` runs the reference implementation.

Exit status 0 when every case passes. This file needs nothing but the Python standard library
(``tensorcanon_reader`` imports tensorcanon when called), so another implementation can copy it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import importlib
import json
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent

Reader = Callable[[str], tuple[str, str, str]]  # path -> ("accept", digest, "") or ("reject", category, message)


@dataclasses.dataclass
class Result:
    file: str
    status: str  # "pass", "allowed" (a rejection or acceptance the case permits) or "fail"
    detail: str


def category_of(exc: BaseException) -> str:
    """The corpus category of a reader's exception, by its class name (and its bases'):
    ``*Limit*`` → limit, ``*Integrity*`` → integrity, ``*Unsupported*``/``*Unavailable*`` →
    unsupported, anything else → format."""
    names = [c.__name__ for c in type(exc).__mro__]
    for word, category in (("Limit", "limit"), ("Integrity", "integrity"), ("Unsupported", "unsupported"),
                           ("Unavailable", "unsupported")):
        if any(word in n for n in names):
            return category
    return "format"


def python_reader(fn: Callable[[str], str]) -> Reader:
    def read(path: str) -> tuple[str, str, str]:
        try:
            return "accept", fn(path), ""
        except Exception as e:  # noqa: BLE001 - every rejection is an outcome to compare
            return "reject", category_of(e), f"{type(e).__name__}: {e}"
    return read


def command_reader(template: str, timeout: float = 60.0) -> Reader:
    def read(path: str) -> tuple[str, str, str]:
        argv = [path if a == "{file}" else a.replace("{file}", path) for a in shlex.split(template)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        line = (done.stdout.strip().splitlines() or [""])[0]
        verdict, _, rest = line.partition(" ")
        if verdict == "accept":
            return "accept", rest.strip(), ""
        if verdict == "reject":
            category, _, message = rest.partition(":")
            return "reject", category.strip(), message.strip()
        return "reject", "?", f"unreadable output {line[:200]!r} (exit status {done.returncode})"
    return read


def judge(case: dict, outcome: tuple[str, str, str], strict: bool) -> Result:
    """Compare one outcome with the case's expectation (README.md, "Passing")."""
    verdict, value, message = outcome
    file = case["file"]
    if case["expect"] == "accept":
        if verdict == "accept":
            ok = value == case["digest"]
            return Result(file, "pass" if ok else "fail", "" if ok else f"digest {value}, expected {case['digest']}")
        why = case.get("may_reject", {}).get(value)
        if why is not None:
            return Result(file, "allowed", f"rejected as {value}: {why}")
        return Result(file, "fail", f"rejected a valid file ({value}): {message}")
    if verdict == "accept":
        if case["when"] == "building" and not strict:
            return Result(file, "allowed", "accepted: only a reader that builds values must reject it")
        return Result(file, "fail", f"accepted an invalid file ({case['section']} {case['rule']})")
    if value != case["category"]:
        detail = f"rejected as {value}, expected {case['category']}: {message}"
        return Result(file, "fail" if strict else "allowed", detail)
    if strict and not (message.startswith(case["error"] + ":") and case["message"] in message):
        return Result(file, "fail", f"expected {case['error']} saying {case['message']!r}, got {message}")
    return Result(file, "pass", "")


def run(read: Reader, manifest_path: pathlib.Path = HERE / "manifest.json", strict: bool = False) -> list[Result]:
    """Every case of the manifest, read by ``read`` and judged. ``strict``: rejections must also
    have the reference implementation's error class and message, and a reader must build values."""
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    out = []
    for case in manifest["cases"]:
        path = manifest_path.parent / case["file"]
        if hashlib.sha256(path.read_bytes()).hexdigest() != case["sha256"]:
            out.append(Result(case["file"], "fail", "the file's sha256 differs from the manifest's (a bad copy)"))
            continue
        out.append(judge(case, read(str(path)), strict))
    return out


def tensorcanon_reader(path: str) -> str:
    """The reference reader under the corpus's contract: builds every value, with the built-in codecs
    enabled, ``golden.GoldenConfig`` and ``golden.Split`` registered and the libraries of the ecosystem's
    codecs imported (§6.9.5: transformers, omegaconf, yacs, where installed), verifies every tensor;
    returns the file digest."""
    for library in ("transformers", "omegaconf", "yacs.config"):  # the program's own imports
        try:
            importlib.import_module(library)
        except ImportError:  # (a reader without one rejects such a file as unsupported: allowed)
            pass
    import tensorcanon
    from tensorcanon import codecs
    from tensorcanon.format import registry

    enabled = [name for name in codecs.NAMES if registry.by_name(name) is None]
    tensorcanon.register_builtin_codecs()
    golden = None
    if registry.by_name("golden.GoldenConfig") is None:
        @dataclasses.dataclass
        class GoldenConfig:
            lr: float
            steps: int
            tags: tuple
        golden = tensorcanon.register(GoldenConfig, name="golden.GoldenConfig")
    split = None
    if registry.by_name("golden.Split") is None:
        class GoldenSplit(enum.Enum):
            TRAIN = "train"
            TEST = "test"
            FOLD = (1, 2)
        split = tensorcanon.register(GoldenSplit, name="golden.Split")
    try:
        tensorcanon.load(path)
        return tensorcanon.verify(path)
    finally:  # leave the process's registrations as they were
        if golden is not None:
            tensorcanon.unregister(golden)
        if split is not None:
            tensorcanon.unregister(split)
        for name in enabled:
            reg = registry.by_name(name)
            if reg is not None:
                registry.unregister(reg.cls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--command", help='a command line with {file} in it, e.g. "my-reader {file}"')
    how.add_argument("--python", help="module:function taking a path, returning the file digest or raising")
    parser.add_argument("--manifest", type=pathlib.Path, default=HERE / "manifest.json")
    parser.add_argument("--strict", action="store_true", help="also match tensorcanon's error classes and messages")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every case, not only failures")
    args = parser.parse_args(argv)
    if args.python:
        module, _, name = args.python.partition(":")
        sys.path[:0] = [str(pathlib.Path.cwd()), str(HERE)]  # the caller's modules, and runner itself
        read = python_reader(getattr(importlib.import_module(module), name))
    else:
        read = command_reader(args.command)
    results = run(read, args.manifest, args.strict)
    for r in results:
        if args.verbose or r.status != "pass":
            print(f"{r.status:7} {r.file}  {r.detail}")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "allowed", "fail")}
    print(f"{counts['pass']} passed, {counts['allowed']} allowed, {counts['fail']} failed, of {len(results)} cases")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
