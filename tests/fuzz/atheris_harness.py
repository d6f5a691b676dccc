"""Coverage-guided fuzzing of the loader with atheris (optional, not a test dependency).

Usage::

    pip install atheris
    python tests/fuzz/atheris_harness.py -atheris_runs=100000 [corpus_dir]

It seeds from valid sample files and the committed attack corpus, then feeds
every mutated input to all read paths through ``hostile_lib.check``: any
exception that is not a TensorCanonError, a hang past the per-case deadline,
or an accepted file that does not re-save to the same bytes is a crash.
"""

from __future__ import annotations

import os
import sys

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

with atheris.instrument_imports():
    import tensorcanon  # noqa: F401 - imported here so that atheris instruments it

    import hostile_lib as h


def one_input(data: bytes) -> None:
    h.check(bytes(data), stream=len(data) < 4096)


def main() -> None:
    args = list(sys.argv)
    if not any(not a.startswith("-") for a in args[1:]):
        import tempfile

        seeds = tempfile.mkdtemp(prefix="tensorcanon-fuzz-")  # libFuzzer adds new inputs here
        print(f"corpus: {seeds}", file=sys.stderr)
        for i, data in enumerate(h.sample_files()):
            with open(os.path.join(seeds, f"sample{i}.bin"), "wb") as f:
                f.write(data)
        args.append(seeds)
        args.append(os.path.join(HERE, "..", "attacks"))
    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
