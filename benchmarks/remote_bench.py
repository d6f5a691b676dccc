"""Object storage: upload and download throughput of tensorcanon against torch.save through fsspec.

Run from the repository root (needs the s3 and test extras: fsspec, s3fs, moto[server])::

    python benchmarks/remote_bench.py              # ~256 MiB state, 3 rounds
    python benchmarks/remote_bench.py --mib 32 --runs 1   # a smoke run

A moto S3 server runs on 127.0.0.1 in a process of its own, so that its memory and
CPU are not counted as the client's. Each measurement runs in a fresh client
process: it builds the state and the S3 client, notes its peak RSS (``ru_maxrss``),
runs the operation once and reports the time and how far the peak RSS rose above
the mark taken after the state existed (the memory the operation itself needed;
for loads, the state is dropped first, so it is what a load needs beyond that).

Operations, on the same server and the same state (float32 tensors of 4 MiB):

- tensorcanon.save to ``s3://…`` (parallel multipart upload, header part last);
- torch.save into ``s3fs.S3FileSystem.open(…, "wb")`` (s3fs's own multipart, sequential);
- tensorcanon.load from ``s3://…`` (parallel ranged reads, every byte verified);
- tensorcanon.verify of ``s3://…`` (streamed, no local copy);
- torch.load from ``s3fs.S3FileSystem.open(…, "rb")`` (weights_only=True);
- tensorcanon.open + one tensor of the state;
- tensorcanon.dcp.save / load of a checkpoint directory URL (one rank), against DCP's own
  ``FsspecWriter`` / ``FsspecReader`` (torch.distributed.checkpoint, pickled metadata) on the
  same server; loads fill a state of zeros in place (its memory is counted before the mark).

The server is in-process Python (moto): absolute figures say more about moto than about
S3; compare the rows with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

MiB = 1 << 20

SERVER = """
import logging, sys, time
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
server.stop()
"""

CLIENT = """
import json, resource, sys, time
import torch, s3fs, tensorcanon
op, endpoint, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
fs = s3fs.S3FileSystem(**options)
g = torch.Generator().manual_seed(0)
if op.endswith(" load") and "dcp" in op.lower():  # the target a load fills in place: zeros, counted before the mark
    state = {f"layer{i:03d}": torch.zeros(1024, 1024) for i in range(mib // 4)}
else:
    state = {f"layer{i:03d}": torch.randn(1024, 1024, generator=g) for i in range(mib // 4)}
nbytes = sum(t.numel() * 4 for t in state.values())
fs.exists("bench/none")  # the S3 client is made (botocore's service model loaded) before the mark
if op.startswith(("tensorcanon.dcp", "DCP")):
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    import tensorcanon.dcp as tcd
    warnings.filterwarnings("ignore")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tc_url, pt_url = "s3://bench/state.safetensors", "s3://bench/state.pt"
t = time.perf_counter()
if op == "tensorcanon.save":
    tensorcanon.save(state, tc_url, storage_options=options)
elif op == "torch.save (s3fs file)":
    with fs.open(pt_url, "wb") as f:
        torch.save(state, f)
elif op == "tensorcanon.load":
    del state
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    out = tensorcanon.load(tc_url, storage_options=options)
elif op == "tensorcanon.verify":
    tensorcanon.verify(tc_url, storage_options=options)
elif op == "torch.load (s3fs file)":
    del state
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with fs.open(pt_url, "rb") as f:
        out = torch.load(f, weights_only=True)
elif op == "tensorcanon.dcp.save":
    tcd.save(state, "s3://bench/dcp-tensorcanon", storage_options=options)
elif op == "DCP FsspecWriter save":
    dcp.save(state, storage_writer=FsspecWriter("s3://bench/dcp-fsspec", **options))
elif op == "tensorcanon.dcp.load":
    tcd.load(state, "s3://bench/dcp-tensorcanon", storage_options=options)
elif op == "DCP FsspecReader load":
    dcp.load(state, storage_reader=FsspecReader("s3://bench/dcp-fsspec", **options))
elif op == "tensorcanon.open + 1 tensor":
    with tensorcanon.open(tc_url, storage_options=options) as f:
        f['$["layer001"]']
    nbytes = 4 * MiB
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "bytes": nbytes, "peak_mib": (peak - before) / 1024}))
""".replace("MiB", str(MiB))

OPS = ["tensorcanon.save", "torch.save (s3fs file)", "tensorcanon.load", "torch.load (s3fs file)",
       "tensorcanon.verify", "tensorcanon.open + 1 tensor",
       "tensorcanon.dcp.save", "DCP FsspecWriter save", "tensorcanon.dcp.load", "DCP FsspecReader load"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the state in MiB (default 256)")
    ap.add_argument("--runs", type=int, default=3, help="rounds; each figure is a median (default 3)")
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        endpoint = f"http://127.0.0.1:{port}"
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, key="bench", secret="bench").call_s3("create_bucket", Bucket="bench")
        results: dict[str, list[dict]] = {op: [] for op in OPS}
        for _ in range(args.runs):
            for op in OPS:  # in order: each load reads what the save of its round wrote
                proc = subprocess.run([sys.executable, "-c", CLIENT, op, endpoint, str(args.mib)],
                                      capture_output=True, text=True, check=True)
                results[op].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)
    print(f"{args.mib} MiB state ({args.mib // 4} float32 tensors of 4 MiB), moto S3 server on 127.0.0.1, "
          f"median of {args.runs}; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print("| operation | seconds | MiB/s | peak RSS above the state (MiB) |\n|---|---|---|---|")
    for op, runs in results.items():
        secs = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak_mib"] for r in runs)
        print(f"| {op} | {secs:.3f} | {runs[0]['bytes'] / MiB / secs:.0f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
