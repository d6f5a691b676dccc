"""Start-up cost of the commands CI runs (issue 23): wall time and peak memory of ``tensorcanon
verify``, ``check``, ``hash``, ``inspect`` and ``--help`` on a small file, next to ``sha256sum`` of
the same file and an empty Python, in an environment without torch (the light install) and in this
one (torch installed); ``python -X importtime`` shows whether each imported torch. Also verify of a
large file against reading and hashing the same bytes (xxh3-128), which must stay at least 1.3x as
fast (its two threads), in the light environment.

    python benchmarks/startup.py [--runs 21] [--light-python PATH] [--large-mib 512] [--dir DIR]

Without ``--light-python`` it makes (once, then reuses) the venv that tests/test_light.py uses:
numpy, xxhash and msgpack at the versions installed here, tensorcanon from src/. Each command
runs as its own process, ``--runs`` times, in rounds (every command once, then again) so that a
slow stretch of the machine slows every command alike; the figures are medians, peak RSS the
largest seen (``wait4``'s ``ru_maxrss``). Run it on a quiet machine: the targets are for one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
MiB = 1 << 20


def light_venv() -> str:
    """The torch-free venv of tests/test_light.py (same name, so either makes it for the other):
    numpy, xxhash and msgpack at the versions installed here (constraints.txt pins them)."""
    import importlib.metadata as md

    pins = {name: md.version(name) for name in ("numpy", "xxhash", "msgpack")}
    key = hashlib.sha256(json.dumps([sys.version, sys.executable, pins]).encode()).hexdigest()[:12]
    venv = os.path.join(tempfile.gettempdir(), f"tensorcanon-light-venv-{key}")
    if not os.path.exists(os.path.join(venv, "ready")):
        building = tempfile.mkdtemp(prefix="tensorcanon-light-venv-", dir=tempfile.gettempdir())
        subprocess.run([sys.executable, "-m", "venv", building], check=True)
        subprocess.run([os.path.join(building, "bin", "python"), "-m", "pip", "install", "-q",
                        *(f"{k}=={v}" for k, v in pins.items())], check=True)
        shutil.rmtree(venv, ignore_errors=True)
        os.rename(building, venv)
        open(os.path.join(venv, "ready"), "w").close()
    return os.path.join(venv, "bin", "python")


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLUMNS", "PYTHONDONTWRITEBYTECODE")}
    e["PYTHONPATH"] = SRC
    return e


def run_once(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0,):
        raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}")
    return wall, usage.ru_maxrss * 1024  # Linux: kilobytes


def imports_torch(argv: list[str]) -> bool | None:
    if argv[0] == "sha256sum":
        return None
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True, env=env())
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines() if "|" in line)


def make_files(folder: str, light_python: str) -> dict[str, str]:
    """A 4 KB checkpoint-like file, its lockfile; written by the light install (numpy arrays)."""
    code = f"""
import numpy as np, tensorcanon
from tensorcanon import lockfile
rng = np.random.default_rng(0)
obj = {{"model": {{f"layer{{i}}.weight": rng.standard_normal((4, 8)).astype(np.float32) for i in range(6)}},
        "step": 100, "lr": 1e-3}}
tensorcanon.save(obj, {os.path.join(folder, "small.safetensors")!r})
lock = {os.path.join(folder, "tensors.lock")!r}
lockfile.write_lock(lockfile.make_lock([{os.path.join(folder, "small.safetensors")!r}], lock), lock)
"""
    subprocess.run([light_python, "-c", code], check=True, env=env())
    return {"file": os.path.join(folder, "small.safetensors"), "lock": os.path.join(folder, "tensors.lock")}


def large_verify(light_python: str, folder: str, mib: int, runs: int) -> dict[str, float]:
    """tensorcanon.verify of a file of ``mib`` MiB vs a raw read + xxh3-128 of it, in rounds."""
    code = f"""
import json, os, statistics, time, numpy as np, xxhash, tensorcanon
p = {os.path.join(folder, "large.safetensors")!r}
tensorcanon.save({{f"t{{i}}": np.full(({mib} * {MiB} // 16 // 4,), i, dtype=np.float32) for i in range(16)}}, p)
def raw():
    buf = memoryview(bytearray(1 << 20)); h = xxhash.xxh3_128()
    with open(p, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
times = {{"raw read + xxh3-128": [], "tensorcanon.verify": []}}
ops = {{"raw read + xxh3-128": raw, "tensorcanon.verify": lambda: tensorcanon.verify(p)}}
for r in range({runs}):
    names = list(ops)[r % 2:] + list(ops)[:r % 2]
    for name in names:
        t0 = time.perf_counter(); ops[name](); times[name].append(time.perf_counter() - t0)
os.remove(p)
print(json.dumps({{k: statistics.median(v) for k, v in times.items()}}))
"""
    proc = subprocess.run([light_python, "-c", code], check=True, capture_output=True, text=True, env=env())
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=21, help="runs of each command (default 21)")
    ap.add_argument("--light-python", default=None, help="a Python without torch (default: the test venv)")
    ap.add_argument("--large-mib", type=int, default=512, help="size of the large verify (0: skip)")
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp folder)")
    args = ap.parse_args(argv)
    light = args.light_python or light_venv()
    probe = subprocess.run([light, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "True", f"{light} has torch: it is not a light install"
    folder = tempfile.mkdtemp(prefix="tc-startup-", dir=args.dir)
    try:
        files = make_files(folder, light)
        pythons = {"no torch": light, "torch installed": sys.executable}
        commands = {
            "sha256sum FILE": ["sha256sum", files["file"]],
            "python -c pass": ["{py}", "-c", "pass"],
            "tensorcanon verify FILE": ["{py}", "-m", "tensorcanon", "verify", files["file"]],
            "tensorcanon check LOCKFILE": ["{py}", "-m", "tensorcanon", "check", files["lock"]],
            "tensorcanon hash FILE": ["{py}", "-m", "tensorcanon", "hash", files["file"]],
            "tensorcanon inspect FILE": ["{py}", "-m", "tensorcanon", "inspect", files["file"]],
            "tensorcanon --help": ["{py}", "-m", "tensorcanon", "--help"],
            "tensorcanon verify --help": ["{py}", "-m", "tensorcanon", "verify", "--help"],
            "python -c 'import torch' (what each command paid before)": ["{py}", "-c", "import torch"],
        }
        jobs = {}
        for where, py in pythons.items():
            for name, argv_ in commands.items():
                if name.startswith("sha256sum") and where != "no torch":
                    continue
                if "import torch" in name and where == "no torch":
                    continue
                jobs[(name, where)] = [py if a == "{py}" else a for a in argv_]
        for argv_ in jobs.values():  # warm up: .pyc files written, page cache filled
            run_once(argv_)
        walls: dict = {k: [] for k in jobs}
        rss: dict = {k: 0 for k in jobs}
        keys = list(jobs)
        for r in range(args.runs):
            for k in keys[r % len(keys):] + keys[: r % len(keys)]:
                w, m = run_once(jobs[k])
                walls[k].append(w)
                rss[k] = max(rss[k], m)
        load = os.getloadavg()
        print(f"# tensorcanon start-up ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n")
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
              f"{platform.python_version()}; {args.runs} runs each, in rounds; load average after: "
              f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}. Small file: {os.path.getsize(files['file'])} bytes.\n")
        print("| command | environment | median wall | fastest – slowest | peak RSS | imports torch |")
        print("| --- | --- | --- | --- | --- | --- |")
        for (name, where), argv_ in jobs.items():
            w = walls[(name, where)]
            t = imports_torch(argv_)
            print(f"| {name} | {where} | {statistics.median(w) * 1e3:.0f} ms | {min(w) * 1e3:.0f} – "
                  f"{max(w) * 1e3:.0f} ms | {rss[(name, where)] / MiB:.0f} MiB | "
                  f"{'—' if t is None else 'yes' if t else 'no'} |")
        checks = []
        for name in ("tensorcanon verify FILE", "tensorcanon check LOCKFILE"):
            light_w = statistics.median(walls[(name, "no torch")])
            full_w = statistics.median(walls[(name, "torch installed")])
            checks.append((f"{name}, no torch: wall", "≤ 0.2 s", f"{light_w:.3f} s", light_w <= 0.2))
            checks.append((f"{name}, no torch: peak RSS", "≤ 60 MB", f"{rss[(name, 'no torch')] / 1e6:.0f} MB",
                           rss[(name, "no torch")] <= 60e6))
            checks.append((f"{name}, torch installed: wall", "≤ 0.25 s", f"{full_w:.3f} s", full_w <= 0.25))
            for where in pythons:
                t = imports_torch(jobs[(name, where)])
                checks.append((f"{name}, {where}: imports torch", "no", "yes" if t else "no", not t))
        if args.large_mib:
            r = large_verify(light, folder, args.large_mib, max(5, args.runs // 3))
            speed = r["raw read + xxh3-128"] / r["tensorcanon.verify"]
            checks.append((f"verify {args.large_mib} MiB (no torch), speed vs raw read + xxh3-128", "≥ 1.3×",
                           f"{speed:.2f}× ({r['tensorcanon.verify'] * 1e3:.0f} ms vs "
                           f"{r['raw read + xxh3-128'] * 1e3:.0f} ms)", speed >= 1.3))
        print("\n| target | bound | measured | result |\n| --- | --- | --- | --- |")
        for what, bound, got, ok in checks:
            print(f"| {what} | {bound} | {got} | {'pass' if ok else 'FAIL'} |")
        return 0 if all(ok for *_, ok in checks) else 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
