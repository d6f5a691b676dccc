"""The ``tensorcanon`` command line (also ``python -m tensorcanon``).

Commands: hash, verify, inspect, diff, lock, check, convert, consolidate, repro, diverge, store.
Every command that reads a file also accepts a sharded checkpoint directory
(tensorcanon.dcp), which it treats as its logical content. Output is
for people by default and JSON with ``--json``. Exit codes, for CI:

- 0: everything is as expected;
- 1: a difference or a mismatch was found (files differ, a digest does not
  match, a file is corrupt, a locked file is missing, runs are not
  reproducible);
- 2: the command could not do its job: a usage error, a file that cannot be
  read or is not a file tensorcanon reads, a command that failed.

Commands (``tensorcanon COMMAND --help`` lists each one's arguments)::

    hash FILE... [--verify]                 content digest of each file
    verify FILE... [--expect DIGEST]        re-hash files, name the first corrupt tensor
    inspect FILE [--depth N] [--tensors] [--path PATTERN]
    diff A B [--atol X] [--rtol Y] [--tensors-only]
    lock PATH_OR_GLOB... [-o LOCKFILE] [--force] [--allow FOLDER_OR_URL] [--timeout S]
    check LOCKFILE... [--allow FOLDER_OR_URL] [--timeout S]
    convert IN OUT [--to FORMAT] [--algorithm ALG] [--force]
    consolidate DIR OUT                     a sharded checkpoint as one file
    repro [--runs N] [--trace LEVEL] --out PATH... -- CMD...
    diverge A B [--json] [--tolerance R] [--html OUT]  the first record where two traces differ
    store ls|verify|export|gc|stats ROOT ...    a store of many checkpoints (docs/STORE.md)

A lockfile's lines may name files inside its own folder only; ``--allow`` adds folders and URL
prefixes (``s3://bucket/ckpt``). This docstring is installed with the package
(``python -m pydoc tensorcanon.tools.cli``); docs/CLI.md of the source tree describes every
command and its output in full.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TextIO, TypeVar

from ..format import digest, paths, tensorkinds, tree
from ..format.errors import FileAccessError, FormatError, IntegrityError, MissingDependencyError, TensorCanonError
from ..format.limits import DEFAULT
from ..format.tensorbytes import resolved
from ..format.tree import Decoder
from ..io import reader, storage, writer
from ..io.source import open_path
from ..trace import command as trace_command
from ..trace.command import nonnegative  # (the lower layer's argparse type: diverge's --tolerance too)
from . import diffview, lockfile, store_cli, textout, versions
from .diff import detect_format, diff, load_file, open_lazily
from .progress import BinaryReader, Progress, ProgressFile

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_ERROR = 2

PROG = "tensorcanon"

_T = TypeVar("_T")
_R = TypeVar("_R")
WORKERS = min(8, max(2, os.cpu_count() or 2))
"""Files verified at once by ``verify`` and ``check`` (threads: reading and hashing release the GIL)."""


def _each(fn: Callable[[_T], _R], items: list[_T], parallel: bool = True) -> Iterable[_R]:
    """``fn`` of every item, in order; on several threads when there are several items (and
    ``parallel``: no progress bars are drawn, which would interleave)."""
    if not parallel or len(items) < 2:
        return map(fn, items)
    pool = ThreadPoolExecutor(min(WORKERS, len(items)), thread_name_prefix="tensorcanon-file")
    futures = [pool.submit(fn, item) for item in items]
    pool.shutdown(wait=False)
    return (f.result() for f in futures)


class CommandLineError(Exception):
    """A bad combination of arguments found after parsing (exit 2)."""


# --------------------------------------------------------------------------- helpers


class _Out:
    """Where a command writes: stdout for results, stderr for errors and progress."""

    def __init__(self, stdout: TextIO, stderr: TextIO, as_json: bool, progress: bool) -> None:
        self.stdout, self.stderr = stdout, stderr
        self.as_json = as_json
        try:  # bars are drawn only on a terminal: elsewhere files are read unwrapped (and several at once)
            self.progress = progress and bool(stderr.isatty())
        except (AttributeError, ValueError, OSError):
            self.progress = False
        self._bars: list[Progress] = []

    def line(self, text: str = "") -> None:
        if not self.as_json:  # (every line escaped: a report that forgot a name from a file still prints it safely)
            print(textout.message(text, self.stdout), file=self.stdout)

    def json(self, obj: Any) -> None:
        if self.as_json:  # file names that are not UTF-8 are escaped: the JSON is always valid UTF-8
            print(textout.json_for_stream(textout.json_text(obj), self.stdout), file=self.stdout)

    def error(self, text: str) -> None:
        self.close_bars()
        print(textout.message(f"{PROG}: error: {text}", self.stderr), file=self.stderr)

    def warn(self, text: str) -> None:
        print(textout.message(f"{PROG}: warning: {text}", self.stderr), file=self.stderr)

    def wrap(self, verb: str) -> Callable[[Any, int], Any] | None:
        """A file wrapper that draws a progress bar (on a terminal, for large files); None elsewhere."""
        if not self.progress:
            return None

        def wrap(fh: BinaryReader, size: int) -> ProgressFile:
            name = getattr(fh, "name", None)
            # (the file's name, escaped as every line: the bar is drawn on a terminal)
            label = textout.message(f"{verb} {os.path.basename(name)}", self.stderr) if isinstance(name, str) else verb
            bar = Progress(size, label, stream=self.stderr)
            self._bars.append(bar)
            return ProgressFile(fh, bar)

        return wrap

    def close_bars(self) -> None:
        for bar in self._bars:
            bar.close()
        self._bars.clear()


def _message(e: BaseException, path: str | None = None) -> str:
    if isinstance(e, FileAccessError):
        return str(e)  # it names the path already
    if isinstance(e, OSError) and e.strerror:
        name = e.filename if e.filename is not None else path
        return f"{name}: {e.strerror}" if name else e.strerror
    text = str(e) or type(e).__name__
    if path and not text.startswith(path):
        return f"{path}: {text}"
    return text


_READ_ERRORS = (TensorCanonError, OSError)
_FORMAT_NAMES = {"tensorcanon": "tensorcanon", "safetensors": "plain safetensors", "torch": "torch.save",
                 "npz": "numpy .npz", "npy": "numpy .npy"}


# --------------------------------------------------------------------------- hash / verify


def cmd_hash(args: argparse.Namespace, out: _Out) -> int:
    from ..sharded import layout  # (the sharded package is imported only where a command needs it)

    code, results = EXIT_OK, []
    for given in args.files:
        path: Any = storage.redact(given)  # a URL is shown without credentials
        try:
            d, fmt = lockfile.content_digest(given, verify=args.verify, wrap=out.wrap("hash"))
        except _READ_ERRORS as e:
            damaged = reader.is_damage(e)  # (bytes changed since it was written: exit 1, as verify says)
            code = max(code, EXIT_DIFFERENT) if damaged else EXIT_ERROR
            _error(out, _message(e, path))
            results.append({"path": path, "status": "corrupt" if damaged else "error",
                            "error": str(e) if damaged else _message(e)})
            continue
        finally:
            out.close_bars()
        results.append({"path": path, "status": "ok", "digest": d, "format": fmt,
                        "verified": bool(args.verify or fmt not in ("tensorcanon", layout.FORMAT))})
        out.line(f"{d}  {textout.printable(path)}")
    out.json({"files": results})
    return code


def _error(out: _Out, text: str) -> None:
    """An error line whose text holds what a file or its name says: nothing in it that a terminal acts
    on (textout.terminal_safe: the library's messages quote names as ``repr`` does)."""
    out.error(textout.terminal_safe(text))


def _verify_one(given: str, wrap: Callable[[Any, int], Any] | None) -> tuple[str, Any, Any]:
    """``("ok", digest, drops)`` for one FILE of ``verify``, or ``("corrupt" | "error", exception,
    None)``; ``drops``: what ``torch.load`` would drop of a tensorcanon ``.safetensors`` file
    (:func:`_torch_load_drops`), else None."""
    path: Any = storage.redact(given)  # a URL is shown without credentials
    try:
        target = storage.resolve(given)  # a URL: an object in a store
        if _checkpoint_dir(target):
            from ..sharded import verify as verify_checkpoint  # a sharded checkpoint: every file, every chunk

            return "ok", verify_checkpoint(target), None
        if not isinstance(target, storage.Location) and trace_command.is_trace(target):
            return (*trace_command.verify_one(target), None)  # a trace of a training run (docs/TRACE.md)
        fmt = detect_format(target)
        if fmt != "tensorcanon":
            raise FormatError(
                f"{path} is a {_FORMAT_NAMES[fmt]} file, which records no digests to verify; "
                "`tensorcanon hash` gives its content digest, `tensorcanon convert` makes a tensorcanon "
                "file of it"
            )
        if isinstance(target, storage.Location):
            with reader.open_file(target.but(wrap=wrap), DEFAULT) as cf:
                return "ok", cf.verify(), None
        with open_path(target) as fh:
            f = wrap(fh, os.fstat(fh.fileno()).st_size) if wrap else fh
            with reader.open_file(f, DEFAULT) as cf:
                found = cf.verify()
                return "ok", found, _torch_load_drops(cf) if str(target).endswith(".safetensors") else None
    except _READ_ERRORS as e:
        return ("corrupt" if reader.is_damage(e) else "error"), e, None


def _torch_load_drops(cf: reader.CheckedFile) -> tuple[int, int, list[str]]:
    """What ``torch.load(path)`` gives for this tensorcanon file, named ``*.safetensors``:
    ``(tensors it returns, values it drops, the first few of those)``.

    Recent torch (2.13 does; older releases refuse the file) hands a path ending in ``.safetensors`` to
    the safetensors package,
    which returns the stored tensors as one flat dict under their stored names and nothing else,
    checking no digest: every part of the object that holds no tensor (an optimizer's
    param_groups, a scheduler, random states, a step count) is silently dropped. A dropped value
    is counted once, at the shallowest path that holds no tensor."""
    m = cf.manifest
    assert m is not None
    holding: set[tuple] = set()  # paths that hold a tensor, and every path above them

    def tensors(trail: tuple, node: Any) -> None:
        if tree.tag_of(node) in _TENSOR_TAGS:
            holding.update(trail[:i] for i in range(len(trail) + 1))

    def dropped(trail: tuple, node: Any) -> None:
        if trail and trail not in holding and trail[:-1] in holding:
            lost.append(trail)

    lost: list[tuple] = []
    for visit in (tensors, dropped):
        decoder = Decoder([None] * len(m.tensors), DEFAULT.max_depth, build_objects=False)
        decoder.visit = visit
        decoder.walk(m.root)
    return len(m.tensors), len(lost), [paths.join(t) for t in lost[:3]]


_TENSOR_TAGS = frozenset({"tensor", "tensor.attrs", *tensorkinds.TAGS})


def _checkpoint_dir(target: Any) -> bool:
    """True for a sharded checkpoint directory, or a directory URL of object storage holding one."""
    if isinstance(target, storage.Location):
        from ..sharded import tools

        return tools.is_checkpoint(target)
    return os.path.isdir(target)


def cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    if args.expect is not None and not digest.is_text(args.expect):
        raise CommandLineError(f"--expect {digest.text_error(args.expect)}")
    code, results = EXIT_OK, []
    wrap = out.wrap("verify")  # progress bars (a terminal): one file at a time; else several at once
    shown = [textout.printable(storage.redact(f)) for f in args.files]
    width = max(len(textout.escaped(p)) for p in shown)  # digests in one column
    columns = textout.terminal_width(out.stdout)
    trap: list[tuple[str, tuple[int, int, list[str]]]] = []  # files torch.load would read in part
    try:
        checked = _each(lambda given: _verify_one(given, wrap), args.files, parallel=wrap is None)
        for given, name, (status, found, drops) in zip(args.files, shown, checked, strict=True):
            path: Any = storage.redact(given)
            out.close_bars()
            if status == "corrupt":
                code = max(code, EXIT_DIFFERENT)
                results.append({"path": path, "status": "corrupt", "tensor": getattr(found, "path", None),
                                "error": str(found)})
                text = str(found)
                text = text[len(path) + 2:] if text.startswith(f"{path}: ") else text  # (named once)
                _fitted(out, f"CORRUPT   {name}: {textout.terminal_safe(text)}", columns)
                continue
            if status == "error":
                code = EXIT_ERROR
                _error(out, _message(found, path))
                results.append({"path": path, "status": "error", "error": _message(found)})
                continue
            if args.expect is not None and not digest.is_text(found):  # a trace: its records are chained, no digest
                code = EXIT_ERROR
                why = (f"{path} is a trace of a training run ({found}): it has no file digest to compare with "
                       "--expect (its frames are checked by their chain); verify it without --expect")
                out.error(why)
                results.append({"path": path, "status": "error", "error": why})
                continue
            if args.expect is not None and digest.same_content(found, args.expect) is not True:  # (the one rule)
                code = max(code, EXIT_DIFFERENT)
                results.append({"path": path, "status": "mismatch", "digest": found, "expected": args.expect})
                have, want = digest.algorithm_of(found), digest.algorithm_of(args.expect)
                why = "" if have == want else \
                    f" (the file uses {have} digests, --expect is {want}: compare with a {have} digest of it)"
                _fitted(out, f"MISMATCH  {name}: digest {found}, expected {args.expect}{why}", columns)
            else:
                results.append({"path": path, "status": "ok", "digest": found,
                                **({"torch_load_drops": drops[1]} if drops is not None else {})})
                out.line(f"OK        {textout.escaped(name):<{width}}  {found}")
            if drops is not None and drops[1]:
                trap.append((name, drops))
    finally:
        out.close_bars()
    out.json({"files": results})
    if trap and not out.as_json:  # said once, whatever the number of files
        name, (n, lost, first) = trap[0]
        listed = ", ".join(first) + (", ..." if lost > len(first) else "")
        also = f" (and so for {textout.plural(len(trap) - 1, 'more file')})" if len(trap) > 1 else ""
        _note(out, f"torch.load({name}) would return only its {textout.plural(n, 'tensor')} (a flat dict, "
                   f"nothing checked) and drop {textout.plural(lost, 'value')} ({listed}){also}: use tensorcanon.load")
    return code


def _fitted(out: _Out, line: str, columns: int | None) -> None:
    """A result line of verify, on a terminal wrapped to its width (continuation lines indented under
    the file name); whole in a file, a pipe or a CI log."""
    if columns is None or len(line) <= columns:
        out.line(line)
        return
    for part in textwrap.wrap(line, max(columns, 40), subsequent_indent=" " * 10, break_on_hyphens=False,
                              break_long_words=False):
        out.line(part)


def _note(out: _Out, text: str) -> None:
    """Advice about the output, on stderr: ``tensorcanon: note: ...``."""
    print(textout.message(f"{PROG}: note: {text}", out.stderr), file=out.stderr)


# --------------------------------------------------------------------------- inspect

_CONTAINERS = {"dict": "dict", "odict": "OrderedDict", "list": "list", "tuple": "tuple",
               "set": "set", "frozenset": "frozenset", "counter": "Counter", "defaultdict": "defaultdict",
               "deque": "deque"}
_PACKED = ("ints", "records")


def cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    from . import inspectview  # (the command's work: tools/inspectview.py)

    return inspectview.run(args, out, _message, _checkpoint_dir)


# --------------------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace, out: _Out) -> int:
    loaded = []
    with contextlib.ExitStack() as opened:
        for path in (args.a, args.b):
            try:  # (a directory is a sharded checkpoint, compared by its logical content)
                loaded.append(opened.enter_context(contextlib.closing(open_lazily(path))))
            except _READ_ERRORS as e:
                out.error(_message(e, storage.redact(path)))
                return EXIT_ERROR
        # tensors are read as they are compared, one pair at a time (memory: the largest tensors)
        result = diff(loaded[0], loaded[1], atol=args.atol, rtol=args.rtol, tensors_only=args.tensors_only)
    diffview.show(result, [side.format for side in loaded], [storage.redact(args.a), storage.redact(args.b)], out)
    return EXIT_DIFFERENT if result.differences else EXIT_OK  # (values within --atol/--rtol: 0)


# --------------------------------------------------------------------------- lock / check


def cmd_lock(args: argparse.Namespace, out: _Out) -> int:
    lockfile.refuse_replacing(args.output)  # (a tensor file named as the output: never replaced)
    if os.path.lexists(args.output) and not args.force:  # as convert: nothing is replaced unasked
        raise CommandLineError(f"LOCKFILE {args.output!r} already exists; pass --force to "
                               "replace it (with the digests of the files as they are now)")
    try:
        entries = lockfile.make_lock(args.paths, args.output, wrap=out.wrap("lock"), allow=args.allow,
                                     timeout=args.timeout)
        lockfile.write_lock(entries, args.output)
    except _READ_ERRORS as e:
        _error(out, _message(e))
        return EXIT_ERROR
    finally:
        out.close_bars()
    out.json({"lockfile": args.output, "entries": [
        {"path": e.path, "digest": e.digest, "size": e.size} for e in entries]})
    out.line(f"wrote {textout.printable(args.output)}: {textout.plural(len(entries), 'file')}")
    prefixes = sorted({_url_folder(e.path) for e in entries if storage.is_url(e.path)})
    if prefixes:  # check follows a URL line only under a prefix it is allowed
        allow = " ".join(f"--allow {p}" for p in prefixes)
        out.warn(textout.printable(f"check this lockfile with: {PROG} check {allow} {args.output}"))
    return EXIT_OK


def _url_folder(url: str) -> str:
    """The URL of the folder an object's URL is in (``s3://b/ckpt/a.safetensors``: ``s3://b/ckpt``)."""
    head, _, _ = url.rpartition("/")
    return head if "://" in head and not head.endswith(":/") else url


def cmd_check(args: argparse.Namespace, out: _Out) -> int:
    wrap = out.wrap("check")  # progress bars (a terminal): one file at a time; else several at once
    code, reports = EXIT_OK, []
    several = len(args.lockfiles) > 1
    for lock in args.lockfiles:
        try:
            results = lockfile.check_lock(lock, wrap=wrap, workers=1 if wrap else WORKERS, allow=args.allow,
                                          timeout=args.timeout)
        except _READ_ERRORS as e:
            _error(out, _message(e, lock))
            code = EXIT_ERROR
            reports.append({"lockfile": lock, "ok": False, "error": _message(e, lock), "files": []})
            continue
        finally:
            out.close_bars()
        failed = [r for r in results if not r.ok]
        if failed:
            code = max(code, EXIT_DIFFERENT)
        reports.append({"lockfile": lock, "ok": not failed, "files": [
            {"path": storage.redact(r.entry.path), "status": r.status, "expected_digest": r.entry.digest,
             "expected_size": r.entry.size, "digest": r.digest, "size": r.size, "message": r.message or None}
            for r in results]})
        pad = "  " if several else ""
        if several:
            out.line(f"{textout.printable(lock)}:")
        for r in results:  # (a lockfile's lines and the messages about their files: escaped)
            label = r.status.upper() if not r.ok else "ok"
            out.line(f"{pad}{label:<11} {textout.printable(str(storage.redact(r.entry.path)))}"
                     + (f": {textout.terminal_safe(r.message)}" if r.message else ""))
        n = len(results)
        if failed:
            out.line(f"{pad}{len(failed):,} of {textout.plural(n, 'file')} failed")
        else:
            out.line(f"{pad}{'1 file matches' if n == 1 else f'all {n:,} files match' if n else 'no files listed'}")
    if several:
        out.json({"ok": code == EXIT_OK, "lockfiles": reports})
    elif reports and "error" not in reports[0]:
        out.json(reports[0])
    return code


# --------------------------------------------------------------------------- convert


def _to_plain_safetensors(value: Any, out_path: str) -> tuple[int, list[str]]:
    """Write the flat view of ``value`` (tensors by their tensorcanon names) as plain safetensors."""
    import numpy as np

    from ..format import optional

    torch = optional.load()
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise MissingDependencyError(f"writing a plain safetensors file needs the safetensors package ({e}): "
                                     f"{optional.INSTALL}", name="safetensors") from None

    p = writer.plan(value, None, DEFAULT)
    tensors, seen = {}, set()
    for src in p.tensors:
        if not src.dtype.native:
            raise FormatError(
                f"tensor {paths.join(src.path)} has dtype {src.dtype.name}, which plain safetensors "
                "cannot hold; keep it in tensorcanon format (--to tensorcanon)"
            )
        t = torch.from_numpy(np.ascontiguousarray(src.value)) if src.kind == "ndarray" else resolved(src.value)
        t = t.cpu().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # safetensors refuses tensors that share memory
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        tensors[src.name] = t
    dropped = [paths.join(trail) for trail, node in tree.nodes(p.root, len(p.tensors), DEFAULT.max_depth)
               if tree.tag_of(node) not in ("tensor", *_CONTAINERS, *_PACKED)]  # (items of packed lists follow)
    writer.replace_atomically(out_path, lambda f, tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return len(tensors), dropped


_OTHER_FORMATS = {".pt": "torch.save", ".pth": "torch.save", ".bin": "torch.save (pytorch_model.bin)",
                  ".npz": "numpy .npz", ".npy": "numpy .npy"}


def cmd_convert(args: argparse.Namespace, out: _Out) -> int:
    from .. import api

    suffix = os.path.splitext(args.output)[1].lower()
    if suffix in _OTHER_FORMATS:  # a file named .pt that holds safetensors would fool every tool that trusts the name
        raise CommandLineError(
            f"OUT {args.output!r} names a {_OTHER_FORMATS[suffix]} file, but convert writes "
            "tensorcanon or plain safetensors files, which tools trusting that name would take for their own "
            "format (torch.load reads a safetensors file only by a .safetensors name, and then only its tensors): "
            "name it .safetensors")
    if args.algorithm is not None and args.to == "safetensors":
        raise CommandLineError(f"--algorithm {args.algorithm} applies to tensorcanon output only; plain safetensors "
                         "records no digests (drop --to safetensors, or --algorithm)")
    from ..sharded.tools import read_by

    reads = storage.written_over(args.output, read_by(args.input))  # by any path or URL, even with --force
    if reads is not None:
        raise CommandLineError(f"OUT {storage.redact(args.output)!r} is {storage.redact(reads)!r}, which convert "
                               "reads: writing it would destroy the input; give another OUT")
    if storage.exists(args.output) and not args.force:  # as repro: nothing the user has is overwritten unasked
        raise CommandLineError(f"OUT {args.output!r} already exists; pass --force to replace it")
    try:
        loaded = load_file(args.input, wrap=out.wrap("read"))
    except _READ_ERRORS as e:
        _error(out, _message(e, args.input))
        return EXIT_ERROR
    finally:
        out.close_bars()
    to = args.to or ("safetensors" if loaded.format == "tensorcanon" and args.algorithm is None else "tensorcanon")
    try:
        if to == "tensorcanon":
            algorithm = args.algorithm or loaded.algorithm or digest.DEFAULT  # keep a tensorcanon input's
            d = api.save(loaded.value, args.output, metadata=loaded.metadata, algorithm=algorithm)
            out.json({"input": args.input, "input_format": loaded.format, "output": args.output,
                      "output_format": to, "digest": d})
            out.line(f"wrote {textout.printable(args.output)} (tensorcanon, {d})")
        else:
            n, dropped = _to_plain_safetensors(loaded.value, args.output)
            for where in dropped:
                out.warn(textout.printable(f"{where} is not a tensor; plain safetensors cannot hold it, so it "
                                           "was left out"))
            out.json({"input": args.input, "input_format": loaded.format, "output": args.output,
                      "output_format": to, "tensors": n, "dropped": dropped})
            left_out = f", {textout.plural(len(dropped), 'non-tensor value')} left out" if dropped else ""
            out.line(f"wrote {textout.printable(args.output)} (safetensors, {textout.plural(n, 'tensor')}{left_out})")
    except (TensorCanonError, OSError) as e:
        _error(out, _message(e, args.output))
        return EXIT_ERROR
    return EXIT_OK


# --------------------------------------------------------------------------- repro


def _artifact_files(path: str) -> list[str]:
    """The files an --out path stands for (itself, or every file under a folder), relative."""
    if os.path.isdir(path):
        return sorted(os.path.relpath(os.path.join(root, n), path)
                      for root, _, names in os.walk(path) for n in names)
    return [""]


def _fingerprint(path: str) -> tuple[str, str]:
    """(digest, format) of one artifact: its content digest, or the hash of its bytes."""
    try:
        return lockfile.content_digest(path)
    except FormatError:
        import xxhash

        h = xxhash.xxh3_128()
        with open_path(path) as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        return digest.to_text(h.digest()), "bytes"


def _first_byte_difference(a: str, b: str) -> str:
    with open_path(a) as fa, open_path(b) as fb:
        offset = 0
        while True:
            x, y = fa.read(1 << 16), fb.read(1 << 16)
            if x != y:
                for i, (p, q) in enumerate(zip(x, y, strict=False)):  # the last reads may differ in length
                    if p != q:
                        return f"bytes differ first at offset {offset + i}"
                return f"sizes differ: {os.path.getsize(a)} and {os.path.getsize(b)} bytes"
            if not x:
                return "identical bytes"
            offset += len(x)


def _run(cmd: list[str], log: TextIO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a fresh process, its output going to ``log`` (our stderr), not our stdout."""
    try:
        fd = log.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests): copy the text
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        log.write(proc.stdout.decode("utf-8", "replace"))
        return proc
    log.flush()
    return subprocess.run(cmd, stdout=fd, stderr=fd, env=env)


def cmd_repro(args: argparse.Namespace, out: _Out) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CommandLineError("repro needs a command after '--', "
                               "e.g. tensorcanon repro --out model.safetensors -- python train.py")
    if args.runs < 2:
        raise CommandLineError(f"--runs must be at least 2 (got {args.runs}): one run has nothing to compare with")
    cwd = os.path.abspath(os.getcwd())
    for p in args.out:
        full = os.path.abspath(p)
        if os.path.isdir(full) and (cwd == full or cwd.startswith(full.rstrip(os.sep) + os.sep)):
            raise CommandLineError(f"--out {p!r} contains the current folder; "
                                   "name the files or a folder the command writes")
    # Every run must write its own artifacts, and what is there now was not written by these
    # runs: refuse rather than move, overwrite or delete anything the user has.
    existing = [p for p in args.out if os.path.lexists(p)]
    if existing:
        listed = ", ".join(repr(p) for p in existing)
        raise CommandLineError(
            f"--out {listed} already exist{'s' if len(existing) == 1 else ''}; repro needs every run to write "
            "its artifacts afresh and never deletes or overwrites files it did not write: move "
            f"{'it' if len(existing) == 1 else 'them'} away (or delete {'it' if len(existing) == 1 else 'them'}) "
            "yourself, or have the command write to a new path, and run repro again")
    with tempfile.TemporaryDirectory(prefix="tensorcanon-repro-") as keep:
        runs: list[list[dict[str, tuple[str, str]]]] = []   # run -> artifact -> file -> (digest, fmt)
        kept: list[list[str]] = []                          # run -> artifact -> saved location
        for r in range(1, args.runs + 1):
            print(f"{PROG} repro: run {r} of {args.runs}", file=out.stderr, flush=True)
            try:
                proc = _run(cmd, out.stderr, trace_command.repro_env(keep, r, args.trace) if args.trace else None)
            except OSError as e:
                _error(out, f"cannot run {cmd[0]!r}: {_message(e)}")
                return EXIT_ERROR
            if proc.returncode != 0:
                out.error(f"run {r}: the command exited with status {proc.returncode}")
                return EXIT_ERROR
            this, saved = [], []
            for i, p in enumerate(args.out):
                if not os.path.lexists(p):
                    _error(out, f"run {r}: the command did not write {p}")
                    return EXIT_ERROR
                files = {}
                for rel in _artifact_files(p):
                    try:
                        files[rel] = _fingerprint(os.path.join(p, rel) if rel else p)
                    except (TensorCanonError, OSError) as e:
                        _error(out, f"run {r}: {_message(e, os.path.join(p, rel) if rel else p)}")
                        return EXIT_ERROR
                this.append(files)
                if r < args.runs:  # keep this run's copy; the last run's stays in place
                    dest = os.path.join(keep, f"run{r}", str(i))
                    os.makedirs(dest)
                    dest = os.path.join(dest, os.path.basename(os.path.normpath(p)))
                    shutil.move(p, dest)
                    saved.append(dest)
                else:
                    saved.append(p)
            runs.append(this)
            kept.append(saved)
        if args.trace:  # each run's trace, and the first divergence between them (docs/TRACE.md)
            return trace_command.repro_with_traces(lambda o: _report_repro(args, o, runs, kept), out, keep, args.runs)
        return _report_repro(args, out, runs, kept)


def _report_repro(args: argparse.Namespace, out: _Out, runs: list[list[dict[str, tuple[str, str]]]],
                  kept: list[list[str]]) -> int:
    artifacts, all_same = [], True
    for i, p in enumerate(args.out):
        first = runs[0][i]
        single = list(first) == [""]  # a file, not a folder
        item = {"path": p, "identical": True, "digests": [
            run[i][""][0] if single and "" in run[i] else {rel: d for rel, (d, _) in run[i].items()}
            for run in runs]}
        differing_run = next((r for r in range(1, len(runs)) if runs[r][i] != first), None)
        if differing_run is None:
            only = next(iter(first.values()))[0] if len(first) == 1 else textout.plural(len(first), "file")
            out.line(f"{textout.printable(p)}: identical in {len(runs)} runs ({only})")
            artifacts.append(item)
            continue
        all_same = False
        item["identical"] = False
        item["first_differing_run"] = differing_run + 1
        other = runs[differing_run][i]
        out.line(f"{textout.printable(p)}: differs between run 1 and run {differing_run + 1}")
        names = sorted(set(first) | set(other))
        details = []
        for rel in names:
            if first.get(rel) == other.get(rel):
                continue
            label = os.path.join(p, rel) if rel else p
            if rel not in first or rel not in other:
                which = "run 1" if rel in first else f"run {differing_run + 1}"
                out.line(f"  {textout.printable(label)}: written only in {which}")
                details.append({"file": label, "only_in": which})
                continue
            (da, fa), (db, fb) = first[rel], other[rel]
            pad = "  "
            if rel:
                out.line(f"  {textout.printable(label)}:")
                pad = "    "
            out.line(f"{pad}run 1: {da}")
            out.line(f"{pad}run {differing_run + 1}: {db}")
            pa = os.path.join(kept[0][i], rel) if rel else kept[0][i]
            pb = os.path.join(kept[differing_run][i], rel) if rel else kept[differing_run][i]
            entry = {"file": label, "digests": [da, db]}
            if fa == "bytes" or fb == "bytes":
                how = _first_byte_difference(pa, pb)
                out.line(f"{pad}{how}")
                entry["bytes"] = how
            else:
                result = diff(pa, pb)
                first_tensor = result.first_tensor()
                if first_tensor is not None:
                    out.line(f"{pad}first differing tensor: {first_tensor}")
                for line in diffview.lines(result, diffview.width(out.stdout), pad, 10, first_tensor):
                    out.line(line)
                entry["differences"] = [d.to_dict() for d in result.differences]
            details.append(entry)
        item["details"] = details
        artifacts.append(item)
    out.json({"runs": len(runs), "identical": all_same, "artifacts": artifacts})
    n = len(args.out)
    if all_same:
        out.line(f"reproducible: {len(runs)} runs wrote identical artifacts")
        return EXIT_OK
    bad = sum(1 for a in artifacts if not a["identical"])
    out.line(f"not reproducible: {bad:,} of {textout.plural(n, 'artifact')} differed")
    if not args.trace:  # where the runs first part: a trace of each run says (docs/TRACE.md)
        _note(out, "to see where the runs first diverge, run again with --trace modules (the command "
                   "records with tensorcanon.trace; docs/TRACE.md)")
    return EXIT_DIFFERENT


# --------------------------------------------------------------------------- consolidate


def cmd_consolidate(args: argparse.Namespace, out: _Out) -> int:
    from ..sharded import consolidate

    try:
        found = consolidate(args.dir, args.output)
    except IntegrityError as e:
        _error(out, _message(e, args.dir))
        out.json({"dir": args.dir, "output": args.output, "status": "corrupt", "error": str(e)})
        return EXIT_DIFFERENT
    except _READ_ERRORS as e:
        _error(out, _message(e, args.dir))
        out.json({"dir": args.dir, "output": args.output, "status": "error", "error": _message(e)})
        return EXIT_ERROR
    out.json({"dir": args.dir, "output": args.output, "status": "ok", "digest": found})
    out.line(f"wrote {textout.printable(args.output)}  {found}")
    return EXIT_OK


# --------------------------------------------------------------------------- parser


EPILOG = f"""\
exit status: 0 ok, 1 difference or mismatch found, 2 usage error or unreadable
file.

A command's arguments: {PROG} COMMAND --help. The commands and exit
statuses, wherever tensorcanon is installed:
python -m pydoc tensorcanon.tools.cli. The full manual with examples is
docs/CLI.md of the source tree (not installed with the wheel)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a hint at what was meant: a command name or an option close to one
    that was mistyped (difflib), and errors of a subcommand's arguments from the subcommand's
    own parser, with its usage (argparse leaves an unknown option to the top-level parser, which
    prints the top-level usage and pulls a file name in with it)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subcommand():
            self.error(_unrecognized(extras, self._option_string_actions))
        return namespace, extras

    def _subcommand(self) -> bool:
        return not any(isinstance(a, argparse._SubParsersAction) for a in self._actions)

    def error(self, message: str) -> NoReturn:
        for action in self._actions:  # a mistyped command name: the closest ones
            if isinstance(action, argparse._SubParsersAction) and "invalid choice" in message:
                given = message.split("invalid choice: ", 1)[1].split(" ", 1)[0].strip("'\"")
                message += _did_you_mean(given, list(action.choices))
        # (an argument may be a file name a glob expanded, ``--\x1b[2J``: escaped like every error line)
        super().error(textout.message(message, sys.stderr))


def _did_you_mean(given: str, names: Iterable[str]) -> str:
    """`` (did you mean X or Y?)`` for the names close to ``given`` (a prefix of one counts), or ''."""
    names = list(names)
    close = [n for n in names if n.startswith(given) and len(given) > 2] if given.startswith("-") else []
    close += [n for n in difflib.get_close_matches(given, names, n=3, cutoff=0.6) if n not in close]
    if not close:
        return ""
    shown = [*close[:3]]
    return f" (did you mean {' or '.join(shown) if len(shown) < 3 else ', '.join(shown[:-1]) + ' or ' + shown[-1]}?)"


def _unrecognized(extras: list[str], options: dict[str, Any]) -> str:
    """The error for arguments a subcommand does not take: its unknown options with the ones
    meant, or (with none) the extra arguments themselves."""
    unknown = [x.split("=", 1)[0] for x in extras if x.startswith("-") and len(x) > 1 and not _number(x)]
    if not unknown:
        return f"unrecognized argument{'s' if len(extras) != 1 else ''}: {' '.join(extras)}"
    known = [o for o in options if o.startswith("--")]
    parts = [f"{u}{_did_you_mean(u, known)}" for u in unknown]
    return f"unrecognized option{'s' if len(unknown) != 1 else ''} {', '.join(parts)}"


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _positive(text: str) -> float:
    x = nonnegative(text)
    if x == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return x


def _whole(text: str) -> int:
    if not text.isdigit() or len(text) > 6:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    common.add_argument("--no-progress", action="store_true",
                        help="never draw progress bars (they appear only on a terminal, for large files)")

    parser = _Parser(  # its usage errors exit with status 2, as ours do
        prog=PROG,
        description="Hash, verify, inspect, compare and lock tensor files; check that runs reproduce.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=versions.describe(PROG))
    sub: Any = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("hash", parents=[common], help="print the content digest of each file")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="tensor files (any format `convert` reads), sharded checkpoint directories or URLs")
    p.add_argument("--verify", action="store_true", help="re-hash every tensor instead of trusting the manifest")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser("verify", parents=[common], help="re-hash files and name the first corrupt tensor")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="tensorcanon files, sharded checkpoint directories or URLs")
    p.add_argument("--expect", metavar="DIGEST",
                   help="also require this digest (of every FILE): xxh3-128:<32 hex> or sha256:<64 hex>, "
                        "in the algorithm the file records")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", parents=[common], help="show the object tree, tensor by tensor")
    p.add_argument("file", metavar="FILE", help="a tensor file (any format `convert` reads), a sharded "
                   "checkpoint directory or a URL")
    p.add_argument("--depth", type=_whole, metavar="N", help="show values down to N levels below $ (level 0) only")
    p.add_argument("--tensors", action="store_true", help="show tensors only")
    p.add_argument("--path", metavar="PATTERN",
                   help="show the values at the paths PATTERN matches and what they hold: '$[\"optimizer\"]', "
                        "'*[\"exp_avg\"]' (* any text, ? one character); a PATTERN that does not start with $ "
                        "matches anywhere in a path: exp_avg")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("diff", parents=[common], help="structural and numeric differences between two files")
    p.add_argument("a", metavar="A", help="the reference file (or directory, or URL)")
    p.add_argument("b", metavar="B", help="the file compared with it; relative differences are relative to B")
    p.add_argument("--atol", type=nonnegative, default=0.0, help="absolute tolerance (default 0: bit-exact)")
    p.add_argument("--rtol", type=nonnegative, default=0.0, help="relative tolerance, relative to B (default 0)")
    p.add_argument("--tensors-only", action="store_true",
                   help="compare tensors only: ignore container types (dict/OrderedDict), key order, "
                        "sharing and non-tensor values, e.g. against a file written by transformers")
    p.set_defaults(func=cmd_diff)

    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--allow", action="append", default=[], metavar="FOLDER_OR_URL",
                       help="also let lockfile lines name files under this folder, or objects under this URL "
                            "prefix (s3://bucket/prefix); repeatable. By default a line may name only files "
                            "inside the lockfile's folder")
    scope.add_argument("--timeout", type=_positive, default=lockfile.TIMEOUT, metavar="SECONDS",
                       help=f"give up after this many seconds in all (default {lockfile.TIMEOUT:g})")

    p = sub.add_parser("lock", parents=[common, scope], help="write a lockfile of expected digests")
    p.add_argument("paths", nargs="+", metavar="PATH_OR_GLOB",
                   help="files, folders (every tensor file under them) or quoted globs ('ckpt/**/*.safetensors'), "
                        "or URLs of objects in a store")
    p.add_argument("-o", "--output", default="tensors.lock", metavar="LOCKFILE",
                   help="lockfile to write (default tensors.lock); it must not exist, unless --force")
    p.add_argument("--force", action="store_true", help="replace LOCKFILE if it exists (a lockfile only)")
    p.set_defaults(func=cmd_lock)

    p = sub.add_parser("check", parents=[common, scope], help="verify files against lockfiles")
    p.add_argument("lockfiles", nargs="+", metavar="LOCKFILE", help="lockfiles written by `tensorcanon lock`")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("convert", parents=[common], help="convert .pt/.safetensors/.npz to tensorcanon and back")
    p.add_argument("input", metavar="IN", help="the file to convert: .pt/.pth/.bin, .npz/.npy, plain safetensors, "
                   "a tensorcanon file or a sharded checkpoint directory")
    p.add_argument("output", metavar="OUT", help="the file to write (atomically); it must not exist, unless --force")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--to", choices=["tensorcanon", "safetensors"],
                   help="output format (default: safetensors for a tensorcanon input without --algorithm, "
                        "else tensorcanon)")
    p.add_argument("--algorithm", choices=sorted(digest.ALGORITHMS, key=lambda a: a != digest.DEFAULT),
                   help="digest algorithm recorded in tensorcanon output (default: a tensorcanon input's own, "
                        f"else {digest.DEFAULT}; sha256 for tamper-evidence); implies --to tensorcanon")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("consolidate", parents=[common],
                       help="write a sharded checkpoint directory as one tensorcanon file")
    p.add_argument("dir", metavar="DIR", help="a sharded checkpoint directory (written by tensorcanon.dcp)")
    p.add_argument("output", metavar="OUT", help="the tensorcanon file to write; not DIR or a file in it")
    p.set_defaults(func=cmd_consolidate)

    p = sub.add_parser("repro", parents=[common], help="run a command several times and compare what it writes",
                       usage=f"{PROG} repro [-h] [--json] [--no-progress] [--runs N]\n"
                             f"{' ' * len(f'usage: {PROG} repro ')}[--trace LEVEL] --out PATH [PATH ...] -- CMD ...")
    p.add_argument("--runs", type=int, default=2, metavar="N", help="number of runs (default 2)")
    p.add_argument("--out", nargs="+", required=True, metavar="PATH",
                   help="files (or folders) each run writes; none may exist before the first run")
    p.add_argument("--trace", choices=["steps", "modules", "ops"], metavar="LEVEL", default=None,
                   help="trace each run at LEVEL (steps, modules, ops: the command records with tensorcanon.trace) "
                        "and report the first divergence between the runs (docs/TRACE.md)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command, after '--'")
    p.set_defaults(func=cmd_repro)

    trace_command.add_parser(sub, common, trace_command.run)  # diverge (docs/TRACE.md)
    store_cli.add_parser(sub, common)  # store ls|verify|export|gc|stats (docs/STORE.md)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 different, 2 error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    out = _Out(sys.stdout, sys.stderr, args.json, not args.no_progress)
    code: int | None = None
    try:
        code = args.func(args, out)
        sys.stdout.flush()  # (a closed pipe shows here, not at exit)
        return code
    except CommandLineError as e:
        text = f"{PROG} {args.command}: error: {e}\n(see '{PROG} {args.command} --help')"
        print(textout.message(text, sys.stderr), file=sys.stderr)
        return EXIT_ERROR
    except TensorCanonError as e:
        _error(out, str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        out.error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`tensorcanon inspect x | head -1`): not an error.
        # Python's documented recipe: point stdout at devnull, so the flush at exit cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK if code is None else code
    except Exception as e:  # noqa: BLE001 - the last line: any input gives exit 2 and a message, never a traceback
        _error(out, f"{args.command} failed: {type(e).__name__}: {e} (this is a bug in tensorcanon, please "
                  "report it with the command that caused it)")
        return EXIT_ERROR
    finally:
        out.close_bars()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
