"""Run golden CLI cases in one fresh interpreter (used by tests/test_cli_golden.py).

Starting Python and importing torch takes about two seconds; one process per
case would make the golden suite take over a minute. So the test starts this
script once, in a subprocess, and it runs every case through
``tensorcanon.tools.cli.main`` exactly as ``python -m tensorcanon`` does, each in
its own fresh copy of tests/cli/inputs, capturing stdout, stderr, the exit
status and the text files the case names. tests/test_cli.py checks that real
``python -m tensorcanon`` processes print the same.

Input (stdin) and output (stdout) are JSON lists.
"""

import contextlib
import io
import json
import os
import shutil
import sys


def run_case(case, inputs, work):
    folder = os.path.join(work, case["name"])
    shutil.copytree(inputs, folder)
    out, err = io.StringIO(), io.StringIO()
    from tensorcanon.tools.cli import main

    here = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(case["argv"])
    finally:
        os.chdir(here)
    files = {}
    for name in case.get("files", []):
        path = os.path.join(folder, name)
        files[name] = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    return {"name": case["name"], "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "files": files, "folder": folder}


def main():
    cases = json.load(sys.stdin)
    inputs = sys.argv[1]
    work = sys.argv[2]
    results = [run_case(c, inputs, work) for c in cases]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
