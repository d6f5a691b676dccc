"""What the command line does with traces: ``tensorcanon diverge``, and ``verify`` of a trace file.

tools/cli.py registers the ``diverge`` parser with :func:`add_parser` and hands a trace file given
to ``verify`` to :func:`verify_one`; the work is done here.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from ..format.errors import FormatError, IntegrityError, TensorCanonError, UsageError
from . import layout
from .compare import first_divergence

EXIT_SAME, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2
is_trace = layout.is_trace


def verify_one(path: str) -> tuple[str, Any]:
    """``("ok", summary)`` for an intact, complete trace; ``("corrupt", IntegrityError)`` naming the
    record for a damaged or incomplete one; ``("error", exception)`` when it cannot be read."""
    try:
        header, n = layout.verify(path)
    except IntegrityError as e:
        return "corrupt", e
    except FormatError as e:
        where = str(e).split(": ", 2)[1] if str(e).count(": ") >= 2 else "the trace"
        return "corrupt", IntegrityError(str(e), path=where)
    except (TensorCanonError, OSError) as e:
        return "error", e
    return "ok", (f"trace of {n:,} record{'' if n == 1 else 's'}, level {header.level}, "
                  f"rank {header.rank} of {header.world_size}")


def nonnegative(text: str) -> float:
    """The argparse type of an option that takes a finite number >= 0 (``diverge --tolerance``, and
    ``diff --atol``/``--rtol`` of tools/cli.py, which imports it from here: the lower layer). argparse
    prefixes the message with the option: ``argument --tolerance: '-1' must be a finite number >= 0``."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return v


def add_parser(sub: Any, common: argparse.ArgumentParser, func: Any) -> argparse.ArgumentParser:
    """The ``diverge`` subcommand's parser (``func`` runs it)."""
    p = sub.add_parser("diverge", parents=[common], help="the first record where two traces of training runs differ",
                       description="Compare two traces (tensorcanon.trace) and name the first record that differs, "
                                   "what matched before it, and whether its inputs were already different. "
                                   "docs/TRACE.md.")
    p.add_argument("a", metavar="A", help="a trace file")
    p.add_argument("b", metavar="B", help="another trace file")
    p.add_argument("--tolerance", type=nonnegative, metavar="R", default=None,
                   help="compare float records by the relative difference of their L2 norms, up to R, instead of "
                        "bitwise (runs that cannot be bitwise equal: CPU against GPU, another torch)")
    p.add_argument("--html", metavar="OUT", default=None,
                   help="also write a self-contained page: steps x modules coloured by distance, the first "
                        "divergence marked")
    p.set_defaults(func=func)
    return p


def _refuse_output_onto_input(out_path: str, inputs: tuple[str, ...]) -> None:
    """A UsageError when ``out_path`` is the same file (device and inode) as one of ``inputs``."""
    from ..io.regular import same_file

    path = same_file(out_path, inputs)
    if path is not None:
        raise UsageError(f"cannot write the page to {out_path}: it is the trace {path} being compared, "
                         "which writing it would destroy; give --html another file")


def run(args: argparse.Namespace, out: Any) -> int:
    """``tensorcanon diverge``: exit 0 same, 1 different, 2 error (``out`` is the CLI's writer)."""
    if args.html is not None:
        _refuse_output_onto_input(args.html, (args.a, args.b))
    result = first_divergence(args.a, args.b, tolerance=args.tolerance, grid=args.html is not None)
    if args.html is not None:
        from .page import write_page

        write_page(result, args.html)
    for line in result.lines():
        out.line(line)
    out.json(result.to_json())
    return EXIT_SAME if result.same else EXIT_DIFFERENT


# --------------------------------------------------------------------------- repro --trace


def repro_env(folder: str, run: int, level: str) -> dict[str, str]:
    """The environment of run ``run`` of ``repro --trace LEVEL``: its trace goes to ``folder``."""
    import os

    from .recorder import ENV_LEVEL, ENV_PATH

    return {**os.environ, ENV_PATH: os.path.join(folder, f"run{run}.trace"), ENV_LEVEL: level}


class _Held:
    """The CLI's writer, holding back the JSON document so the traces' report joins it."""

    def __init__(self, out: Any) -> None:
        self.out, self.doc = out, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)

    def json(self, obj: Any) -> None:
        self.doc = obj


def repro_with_traces(report: Any, out: Any, folder: str, runs: int) -> int:
    """``repro --trace``: the artifacts' report (``report(out)``), then the first divergence between
    run 1's trace and each other run's; exit 1 if either differs."""
    import os

    held = _Held(out)
    code = report(held)
    traces: list[dict[str, Any]] = []
    first = os.path.join(folder, "run1.trace")
    for r in range(2, runs + 1):
        other = os.path.join(folder, f"run{r}.trace")
        if not (os.path.exists(first) and os.path.exists(other)):
            out.line(f"traces: run {1 if not os.path.exists(first) else r} wrote no trace: the command must record "
                     "one with tensorcanon.trace(...) (docs/TRACE.md)")
            traces.append({"run": r, "error": "no trace written"})
            code = max(code, EXIT_ERROR)
            continue
        result = first_divergence(first, other)
        out.line(f"traces of run 1 and run {r}:")
        for line in result.lines():
            out.line(f"  {line}")
        traces.append({"run": r, **result.to_json()})
        if not result.same:
            code = max(code, EXIT_DIFFERENT)
    if held.doc is not None or getattr(out, "as_json", False):
        out.json({**(held.doc or {}), "traces": traces})
    return code
