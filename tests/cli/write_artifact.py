"""A stand-in for a training script, for the golden `tensorcanon repro` tests.

Writes a plain safetensors file by hand (no torch import, so each run is
quick): a float32 tensor "w" = [1, 2, 3, 4] and an int64 tensor "step" = [7].
With ``--vary STATE`` it is nondeterministic the way real scripts are, through
state outside the process: each run adds the number of earlier runs (counted
in the STATE file) to w[2]. ``--log PATH`` also writes a text log, which
differs between runs when ``--vary-log`` is given. ``--fail`` exits with 3.
"""

import argparse
import json
import os
import struct
import sys


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--vary", metavar="STATE")
    p.add_argument("--log")
    p.add_argument("--vary-log", metavar="STATE")
    p.add_argument("--fail", action="store_true")
    p.add_argument("--skip-write", action="store_true")
    a = p.parse_args()
    print(f"training... writing {a.out}")
    if a.fail:
        sys.exit(3)
    earlier = 0
    for state in (a.vary, a.vary_log):
        if state:
            earlier = int(open(state).read()) if os.path.exists(state) else 0
            with open(state, "w") as f:
                f.write(str(earlier + 1))
    w = [1.0, 2.0, 3.0 + (earlier if a.vary else 0), 4.0]
    if not a.skip_write:
        write_safetensors(a.out, {"w": ("F32", [4], struct.pack("<4f", *w)),
                                  "step": ("I64", [1], struct.pack("<q", 7))})
    if a.log:
        with open(a.log, "w") as f:
            f.write(f"loss 0.25\nrun {earlier if a.vary_log else 0}\n")


if __name__ == "__main__":
    main()
