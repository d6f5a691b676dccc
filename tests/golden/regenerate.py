"""Rewrite the golden files: ONLY for a deliberate format change.

The committed ``<name>.safetensors`` files and ``digests.json`` are the
format's contract: tests/test_golden.py fails when any byte tensorcanon writes
for them changes. A deliberate change of the format MUST bump
``tensorcanon.format.manifest.VERSION`` (``tensorcanon.FORMAT_VERSION``), update
docs/FORMAT.md, and then regenerate with::

    python tests/golden/regenerate.py --format-change

The script refuses to run when the format version recorded in digests.json
equals the library's, unless ``--same-version`` is also passed (for adding a
new vector without changing the bytes of existing ones; it then refuses to
change any existing file).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tensorcanon as tc

import vectors

DIGESTS = HERE / "digests.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format-change", action="store_true", required=True,
                    help="confirm that the format changed on purpose")
    ap.add_argument("--same-version", action="store_true",
                    help="only add new vectors; never change an existing file")
    args = ap.parse_args(argv)
    old = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {"format_version": None, "digests": {}}
    if old["format_version"] == tc.FORMAT_VERSION and not args.same_version:
        print(f"FORMAT_VERSION is still {tc.FORMAT_VERSION}: bump it for a format change "
              "(or pass --same-version to add vectors only)", file=sys.stderr)
        return 2
    digests = {}
    for name in vectors.VECTORS:
        obj, meta = vectors.build(name)
        data = tc.dumps(obj, metadata=meta)
        path = HERE / f"{name}.safetensors"
        if args.same_version and path.exists() and path.read_bytes() != data:
            print(f"{name}: bytes changed under the same format version; refusing", file=sys.stderr)
            return 1
        path.write_bytes(data)
        digests[name] = tc.fingerprint(obj, metadata=meta)
        print(f"{name:16s} {len(data):7d} bytes  {digests[name]}")
    DIGESTS.write_text(json.dumps({"format_version": tc.FORMAT_VERSION, "digests": digests},
                                  indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
