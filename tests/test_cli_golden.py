"""Golden tests of the command line: every command and exit status, against committed files.

Inputs live in tests/cli/inputs (made once by tests/cli/make_inputs.py), expected
outputs in tests/cli/expected/<case>.txt: the command, its exit status, its
stdout and stderr, and any text file it writes. All cases run in one fresh
interpreter (tests/cli/run_cases.py) through the same entry point as
``python -m tensorcanon``; tests/test_cli.py runs real processes too, and
``TENSORCANON_CLI_PROCESSES=1`` runs every case as its own ``python -m
tensorcanon`` process (about two minutes).

After an intended change of output, regenerate and review:
``TENSORCANON_UPDATE_GOLDEN=1 python -m pytest tests/test_cli_golden.py``.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CLI = os.path.join(HERE, "cli")
INPUTS = os.path.join(CLI, "inputs")
EXPECTED = os.path.join(CLI, "expected")
WRITE_ARTIFACT = os.path.join(CLI, "write_artifact.py")
UPDATE = os.environ.get("TENSORCANON_UPDATE_GOLDEN") == "1"
# Not a terminal of any width: inspect fits a terminal's width when $COLUMNS is set (some libraries
# set it in the C environment of the test process, where os.environ does not show it).
ENV = {**os.environ, "COLUMNS": ""}

ZERO = "xxh3-128:" + "0" * 32


def _base_digest():
    with open(os.path.join(INPUTS, "good.lock")) as f:
        for line in f:
            if line.rstrip("\n").endswith(" base.safetensors"):
                return line.split(" ")[0]
    raise AssertionError("good.lock lists no base.safetensors")


def _art(*args):
    return [sys.executable, WRITE_ARTIFACT, *args]


# (name, argv, expected exit status, text files to capture)
CASES = [
    ("no_command", [], 2, []),
    ("unknown_command", ["frobnicate"], 2, []),
    ("version", ["--version"], 0, []),
    # hash
    ("hash", ["hash", "base.safetensors", "plain.safetensors", "weights.pt", "arrays.npz"], 0, []),
    ("hash_verify", ["hash", "--verify", "base.safetensors", "one_element.safetensors"], 0, []),
    ("hash_manifest_only_corrupt", ["hash", "corrupt.safetensors"], 0, []),
    ("hash_verify_corrupt", ["hash", "--verify", "corrupt.safetensors"], 1, []),
    ("hash_unreadable", ["hash", "truncated.safetensors", "notes.txt", "nope.safetensors"], 2, []),
    ("hash_json", ["hash", "--json", "base.safetensors", "weights.pt", "notes.txt"], 2, []),
    # verify
    ("verify_ok", ["verify", "base.safetensors", "one_element.safetensors"], 0, []),
    ("verify_corrupt", ["verify", "base.safetensors", "corrupt.safetensors"], 1, []),
    ("verify_expect_ok", ["verify", "--expect", "{base_digest}", "base.safetensors"], 0, []),
    ("verify_expect_mismatch", ["verify", "--expect", ZERO, "base.safetensors"], 1, []),
    ("verify_json", ["verify", "--json", "base.safetensors", "corrupt.safetensors"], 1, []),
    ("verify_plain", ["verify", "plain.safetensors"], 2, []),
    ("verify_truncated", ["verify", "truncated.safetensors"], 1, []),
    ("verify_missing_file", ["verify", "nope.safetensors"], 2, []),
    ("verify_bad_expect", ["verify", "--expect", "nope", "base.safetensors"], 2, []),
    ("verify_no_file", ["verify"], 2, []),
    # inspect
    ("inspect", ["inspect", "base.safetensors"], 0, []),
    ("inspect_plain", ["inspect", "plain.safetensors"], 0, []),
    ("inspect_pt", ["inspect", "weights.pt"], 0, []),
    ("inspect_npz", ["inspect", "arrays.npz"], 0, []),
    ("inspect_json", ["inspect", "--json", "base.safetensors"], 0, []),
    ("inspect_not_tensors", ["inspect", "notes.txt"], 2, []),
    ("inspect_truncated", ["inspect", "truncated.safetensors"], 2, []),
    # diff
    ("diff_identical", ["diff", "base.safetensors", "base.safetensors"], 0, []),
    ("diff_one_element", ["diff", "base.safetensors", "one_element.safetensors"], 1, []),
    ("diff_one_element_atol", ["diff", "--atol", "100", "base.safetensors", "one_element.safetensors"], 0, []),
    ("diff_one_element_rtol", ["diff", "--rtol", "0.5", "base.safetensors", "one_element.safetensors"], 1, []),
    ("diff_changed", ["diff", "base.safetensors", "changed.safetensors"], 1, []),
    ("diff_json", ["diff", "--json", "base.safetensors", "one_element.safetensors"], 1, []),
    ("diff_plain_pt", ["diff", "plain.safetensors", "weights.pt"], 0, []),
    ("diff_plain_npz", ["diff", "plain.safetensors", "arrays.npz"], 1, []),
    ("diff_corrupt", ["diff", "base.safetensors", "corrupt.safetensors"], 2, []),
    ("diff_missing_argument", ["diff", "base.safetensors"], 2, []),
    ("diff_bad_atol", ["diff", "--atol", "-1", "base.safetensors", "base.safetensors"], 2, []),
    # lock / check
    ("lock", ["lock", "base.safetensors", "plain.safetensors", "weights.pt", "arrays.npz", "-o", "out.lock"],
     0, ["out.lock"]),
    ("lock_glob", ["lock", "*.pt", "one_*.safetensors", "-o", "out.lock"], 0, ["out.lock"]),
    ("lock_json", ["lock", "--json", "base.safetensors", "-o", "out.lock"], 0, ["out.lock"]),
    ("lock_corrupt", ["lock", "*.safetensors", "-o", "out.lock"], 2, ["out.lock"]),
    ("lock_no_match", ["lock", "nothing*.safetensors", "-o", "out.lock"], 2, ["out.lock"]),
    ("check_ok", ["check", "good.lock"], 0, []),
    ("check_failures", ["check", "bad.lock"], 1, []),
    ("check_json", ["check", "--json", "bad.lock"], 1, []),
    ("check_malformed", ["check", "malformed.lock"], 2, []),
    ("check_not_a_lockfile", ["check", "notes.txt"], 2, []),
    ("check_missing_lockfile", ["check", "nope.lock"], 2, []),
    # convert
    ("convert_pt", ["convert", "weights.pt", "w.safetensors"], 0, []),
    ("convert_npz", ["convert", "--json", "arrays.npz", "a.safetensors"], 0, []),
    ("convert_plain", ["convert", "plain.safetensors", "p.safetensors"], 0, []),
    ("convert_to_plain", ["convert", "base.safetensors", "flat.safetensors"], 0, []),
    ("convert_copy", ["convert", "--to", "tensorcanon", "base.safetensors", "copy.safetensors"], 0, []),
    ("convert_not_tensors", ["convert", "notes.txt", "x.safetensors"], 2, []),
    ("convert_corrupt", ["convert", "corrupt.safetensors", "x.safetensors"], 2, []),
    ("convert_bad_format", ["convert", "--to", "pickle", "weights.pt", "x.pkl"], 2, []),
    # repro
    ("repro_identical", ["repro", "--out", "m.safetensors", "--", *_art("m.safetensors")], 0, []),
    ("repro_tensor_differs", ["repro", "--runs", "3", "--out", "m.safetensors", "--",
                              *_art("m.safetensors", "--vary", "state")], 1, []),
    ("repro_bytes_differ", ["repro", "--out", "m.safetensors", "log.txt", "--",
                            *_art("m.safetensors", "--log", "log.txt", "--vary-log", "state")], 1, []),
    ("repro_json", ["repro", "--json", "--out", "m.safetensors", "--",
                    *_art("m.safetensors", "--vary", "state")], 1, []),
    ("repro_command_fails", ["repro", "--out", "m.safetensors", "--", *_art("m.safetensors", "--fail")], 2, []),
    ("repro_not_written", ["repro", "--out", "m.safetensors", "--", *_art("m.safetensors", "--skip-write")], 2, []),
    ("repro_out_exists", ["repro", "--out", "base.safetensors", "--", *_art("base.safetensors")], 2, []),
    ("repro_no_command", ["repro", "--out", "m.safetensors"], 2, []),
    ("repro_one_run", ["repro", "--runs", "1", "--out", "m.safetensors", "--", *_art("m.safetensors")], 2, []),
]


# Usage errors reported by argparse itself: their wording and line wrapping change between
# Python versions, so only the exit status and the presence of an error are compared.
ARGPARSE_ERRORS = {"no_command", "unknown_command", "verify_no_file", "diff_missing_argument",
                   "diff_bad_atol", "convert_bad_format"}


def _render(name, argv, result):
    shown = " ".join(argv)
    stderr = result["stderr"].rstrip("\n")
    if name in ARGPARSE_ERRORS:
        assert stderr.startswith("usage: tensorcanon") and "error: " in stderr, stderr
        stderr = "<an argparse usage message and error>"
    text = [f"$ tensorcanon {shown}", f"[exit {result['code']}]", "--- stdout", result["stdout"].rstrip("\n"),
            "--- stderr", stderr]
    for fname, content in sorted(result["files"].items()):
        text += [f"--- file {fname}", "(not written)" if content is None else content.rstrip("\n")]
    out = "\n".join(text) + "\n"
    out = out.replace(result["folder"] + os.sep, "").replace(result["folder"], "<CASE>")
    out = out.replace(WRITE_ARTIFACT, "<write_artifact.py>").replace(sys.executable, "<python>")
    return out


def _one_process_per_case(cases, work):
    """Each case as its own ``python -m tensorcanon`` process (TENSORCANON_CLI_PROCESSES=1; ~2 s a case)."""
    out = []
    for case in cases:
        folder = os.path.join(work, case["name"])
        shutil.copytree(INPUTS, folder)
        proc = subprocess.run([sys.executable, "-m", "tensorcanon", *case["argv"]], cwd=folder,
                              capture_output=True, text=True, timeout=300, env=ENV)
        files = {}
        for name in case["files"]:
            path = os.path.join(folder, name)
            files[name] = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        out.append({"name": case["name"], "code": proc.returncode, "stdout": proc.stdout,
                    "stderr": proc.stderr, "files": files, "folder": folder})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("cli_golden"))
    digest = _base_digest()
    cases = [{"name": n, "argv": [a.replace("{base_digest}", digest) for a in argv], "files": files}
             for n, argv, _, files in CASES]
    if os.environ.get("TENSORCANON_CLI_PROCESSES") == "1":
        found = _one_process_per_case(cases, work)
    else:
        proc = subprocess.run([sys.executable, os.path.join(CLI, "run_cases.py"), INPUTS, work],
                              input=json.dumps(cases), capture_output=True, text=True, timeout=300, env=ENV)
        assert proc.returncode == 0, proc.stderr
        found = json.loads(proc.stdout)
    return {r["name"]: (r, next(c["argv"] for c in cases if c["name"] == r["name"])) for r in found}


def test_case_names_are_unique():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names))


def test_every_exit_status_is_covered():
    for command in ("hash", "verify", "diff", "check", "repro"):
        codes = {code for name, argv, code, _ in CASES if argv and argv[0] == command}
        assert codes == {0, 1, 2}, (command, codes)
    for command in ("inspect", "lock", "convert"):  # these find no differences: 0 or 2
        codes = {code for name, argv, code, _ in CASES if argv and argv[0] == command}
        assert codes == {0, 2}, (command, codes)


@pytest.mark.parametrize("name, argv, code, files", CASES, ids=[c[0] for c in CASES])
def test_golden(results, name, argv, code, files):
    result, real_argv = results[name]
    got = _render(name, real_argv, result)
    path = os.path.join(EXPECTED, name + ".txt")
    if UPDATE:
        os.makedirs(EXPECTED, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(got)
    assert result["code"] == code, got
    with open(path, encoding="utf-8") as f:
        expected = f.read()
    assert got == expected
