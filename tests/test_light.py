"""The light install: reading and checking files never imports torch (issue 23).

``hash``, ``verify``, ``check``, ``lock`` and ``inspect`` (of tensorcanon files, plain safetensors
files, ``.npz`` files and sharded checkpoint directories), ``--help`` and ``--version`` of every
command, ``import tensorcanon``, ``tensorcanon.verify`` and ``tensorcanon.lockfile`` leave torch
unimported where it is installed, and work where it is not: a venv without torch, made once per
test session (numpy, xxhash and msgpack from PyPI at the versions constraints.txt pins), runs the
light commands on the same files as this interpreter and must print exactly the same, golden files
with dtypes only newer torch knows and a sharded checkpoint included. What needs torch says, in
one line, what to install. Timings are benchmarks/startup.py's business, not these tests'.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
GOLDEN = os.path.join(ROOT, "tests", "golden")
INPUTS = os.path.join(ROOT, "tests", "cli", "inputs")
RUN_CASES = os.path.join(ROOT, "tests", "cli", "run_cases.py")
# Golden files whose dtypes, values and trees cover what a reader meets: float8, uint16-64, int1-7
# and float4 (dtypes_u8, dtypes_native), torch.Size/dtype/device values, generators, RNG and
# determinism settings (registered), numpy arrays and scalars, tied tensors, the ecosystem's data objects
# (docs/FORMAT.md §6.9.5: verified with none of their libraries).
GOLDEN_FILES = ["dtypes_u8", "dtypes_native", "torch_values", "generators", "random_state", "numpy",
                "tied", "checkpoint", "memory_formats", "registered", "ecosystem"]
SHARDED = os.path.join(GOLDEN, "sharded", "two_ranks")
# Conformance files a verifier rejects by the checks load makes on the values of a tensor kind's parts
# (sparse indices, jagged offsets; docs/FORMAT.md §6.12), made on the verified bytes without torch.
TENSOR_KINDS_INVALID = [os.path.join(ROOT, "tests", "conformance", "invalid", f"{n}.bin") for n in (
    "meta_int_requires_grad", "nested_jagged_offsets_decreasing", "sparse_coo_index_out_of_range",
    "sparse_coo_uncoalesced", "sparse_csr_crow_decreasing")]
COMMANDS = ("hash", "verify", "inspect", "diff", "lock", "check", "convert", "consolidate", "repro")


def _golden(name: str) -> str:
    return os.path.join(GOLDEN, f"{name}.safetensors")


def _light_cases() -> list[dict]:
    """Command lines that must not need torch; each runs in a fresh copy of tests/cli/inputs."""
    golden = [_golden(n) for n in GOLDEN_FILES]
    v1 = [os.path.join(GOLDEN, "v1", f"{n}.safetensors") for n in ("dtypes_u8", "dtypes_native")]
    cases = [
        ("hash", ["hash", "base.safetensors", "plain.safetensors", "arrays.npz", SHARDED, *golden]),
        ("hash_verify", ["hash", "--verify", "base.safetensors", "one_element.safetensors", SHARDED, *golden]),
        ("hash_json", ["hash", "--json", "base.safetensors", "plain.safetensors", "notes.txt", SHARDED]),
        ("hash_corrupt", ["hash", "--verify", "corrupt.safetensors"]),
        ("hash_unreadable", ["hash", "truncated.safetensors", "notes.txt", "nope.safetensors"]),
        ("verify", ["verify", "base.safetensors", "one_element.safetensors", SHARDED, *golden, *v1]),
        ("verify_corrupt", ["verify", "base.safetensors", "corrupt.safetensors", "truncated.safetensors",
                            "plain.safetensors", "arrays.npz", "notes.txt", "nope.safetensors"]),
        ("verify_json", ["verify", "--json", "base.safetensors", "corrupt.safetensors", SHARDED]),
        ("verify_tensor_kinds", ["verify", _golden("tensor_kinds"), *TENSOR_KINDS_INVALID]),
        ("verify_expect", ["verify", "--expect", "sha256:" + "0" * 64, "base.safetensors"]),
        ("inspect_plain", ["inspect", "plain.safetensors"]),
        ("inspect_npz", ["inspect", "arrays.npz"]),
        ("inspect_json", ["inspect", "--json", "base.safetensors"]),
        ("inspect_sharded", ["inspect", SHARDED]),
        ("inspect_sharded_json", ["inspect", "--json", SHARDED]),
        ("inspect_truncated", ["inspect", "truncated.safetensors"]),
        *[(f"inspect_{n}", ["inspect", _golden(n)]) for n in GOLDEN_FILES],
        ("lock", ["lock", "base.safetensors", "plain.safetensors", "arrays.npz", "-o", "out.lock"]),
        ("lock_corrupt", ["lock", "*.safetensors", "-o", "out.lock"]),
        ("check_ok", ["check", "good.lock"]),
        ("check_failures", ["check", "bad.lock"]),
        ("check_json", ["check", "--json", "bad.lock"]),
        ("check_several", ["check", "good.lock", "bad.lock", "malformed.lock"]),
        ("check_malformed", ["check", "malformed.lock"]),
        ("version", ["--version"]),
        ("help", ["--help"]),
        *[(f"help_{c}", [c, "--help"]) for c in COMMANDS],
    ]
    return [{"name": name, "argv": argv, "files": ["out.lock"] if name.startswith("lock") else []}
            for name, argv in cases]


# Runs the cases through tensorcanon.tools.cli.main in one interpreter (tests/cli/run_cases.py), then
# checks the library's own light functions and that none of it imported torch.
_RUNNER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.path.dirname({run_cases!r}))
    import run_cases
    cases = json.loads(sys.stdin.read())
    results = [run_cases.run_case(c, {inputs!r}, {work!r}) for c in cases]
    import tensorcanon
    from tensorcanon import lockfile
    lock = os.path.join({work!r}, "api.lock")
    lockfile.write_lock(lockfile.make_lock([{golden!r}], lock, allow=[{golden_dir!r}]), lock)
    api = {{"verify": tensorcanon.verify({sharded!r}),
            "check": [r.status for r in lockfile.check_lock(lock, allow=[{golden_dir!r}])],
            "metadata": repr(tensorcanon.read_metadata({plain!r}))}}
    json.dump({{"results": results, "api": api, "torch": "torch" in sys.modules}}, sys.stdout)
""")


def _run_cases(python: str, work: str, env: dict) -> dict:
    os.makedirs(work)
    code = _RUNNER.format(run_cases=RUN_CASES, inputs=INPUTS, work=work, golden=GOLDEN, golden_dir=GOLDEN,
                          sharded=SHARDED, plain=os.path.join(INPUTS, "plain.safetensors"))
    proc = subprocess.run([python, "-c", code], input=json.dumps(_light_cases()), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    for r in found["results"]:  # the only difference two runs may have: the folder each ran in
        for key in ("stdout", "stderr"):
            r[key] = r[key].replace(r["folder"], "<CASE>")
        r["files"] = {k: v.replace(r["folder"], "<CASE>") if v else v for k, v in r["files"].items()}
        del r["folder"]
    return found


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "PYTHONPATH")}
    env.update(PYTHONPATH=SRC, PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _pins() -> dict[str, str]:
    """The versions of the light core this interpreter has: those constraints.txt pins (CI's
    floors job: those of constraints-floors.txt)."""
    import importlib.metadata as md

    return {name: md.version(name) for name in ("numpy", "xxhash", "msgpack")}


@pytest.fixture(scope="session")
def light_python() -> str:
    """A venv without torch: numpy, xxhash and msgpack at the versions installed here (the pinned
    ones), tensorcanon from src/ (PYTHONPATH). Made once and kept in the temporary folder between
    sessions (its name holds the Python and the versions); 10-30 s when made."""
    pins = _pins()
    key = hashlib.sha256(json.dumps([sys.version, sys.executable, pins]).encode()).hexdigest()[:12]
    venv = os.path.join(tempfile.gettempdir(), f"tensorcanon-light-venv-{key}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, "ready")):
        building = tempfile.mkdtemp(prefix="tensorcanon-light-venv-", dir=tempfile.gettempdir())
        subprocess.run([sys.executable, "-m", "venv", building], check=True, capture_output=True)
        proc = subprocess.run([os.path.join(building, "bin", "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *(f"{k}=={v}" for k, v in pins.items())],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            shutil.rmtree(building, ignore_errors=True)
            pytest.skip(f"cannot install {', '.join(pins)} from PyPI into a venv without torch: "
                        f"{proc.stderr.strip()[-500:]}")
        shutil.rmtree(venv, ignore_errors=True)
        os.rename(building, venv)  # (venvs hold absolute paths: pip and scripts are not used after this)
        open(os.path.join(venv, "ready"), "w").close()
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') "
                            "is not None)"], capture_output=True)
    assert probe.returncode == 0, "the light venv must not have torch"
    return python


def test_light_install_prints_what_the_full_install_prints(light_python, tmp_path):
    full = _run_cases(sys.executable, str(tmp_path / "full"), _env())
    light = _run_cases(light_python, str(tmp_path / "light"), _env())
    assert not full["torch"], "a light command imported torch where torch is installed"
    assert not light["torch"]
    assert light["api"] == full["api"]
    assert full["api"]["check"] and set(full["api"]["check"]) == {"ok"}, full["api"]  # every golden file, v1 too
    by_name = {r["name"]: r for r in full["results"]}
    for r in light["results"]:
        assert r == by_name[r["name"]], r["name"]
    codes = {r["name"]: r["code"] for r in full["results"]}
    assert codes["verify"] == codes["hash_verify"] == codes["check_ok"] == 0, codes
    assert codes["check_failures"] == 1 and codes["verify_corrupt"] == codes["check_several"] == 2, codes
    kinds = by_name["verify_tensor_kinds"]
    assert codes["verify_tensor_kinds"] == 2 and kinds["stdout"].count("OK ") == 1, kinds
    for path in TENSOR_KINDS_INVALID:  # each rejected, naming the node's path
        assert any(os.path.basename(path) in line and "at $" in line
                   for line in (kinds["stdout"] + kinds["stderr"]).splitlines()), (path, kinds)


def test_light_commands_do_not_import_torch_where_it_is_installed(tmp_path):
    """In this interpreter (torch installed), measured the way the issue asks: -X importtime."""
    for argv in (["verify", _golden("dtypes_u8"), SHARDED], ["check", os.path.join(INPUTS, "good.lock")],
                 ["inspect", _golden("torch_values")], ["hash", os.path.join(INPUTS, "plain.safetensors")],
                 ["lock", "--allow", GOLDEN, "-o", str(tmp_path / "t.lock"), GOLDEN], ["--help"],
                 ["convert", "--help"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tensorcanon", *argv],
                              capture_output=True, text=True, env=_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert "tensorcanon.tools.cli" in imported and "torch" not in imported, argv


def test_files_of_tensors_are_checked_without_numpy(tmp_path):
    """numpy too is imported only for a file whose contents need it (arrays, random state), so
    that verify and check of a checkpoint of tensors start in about a tenth of a second."""
    shutil.copy(_golden("state_dict"), tmp_path)
    shutil.copy(os.path.join(INPUTS, "plain.safetensors"), tmp_path)
    subprocess.run([sys.executable, "-m", "tensorcanon", "lock", "-o", "t.lock", "."], cwd=tmp_path, check=True,
                   env=_env(), capture_output=True)
    for argv in (["verify", "state_dict.safetensors"], ["check", "t.lock"], ["hash", "plain.safetensors"],
                 ["inspect", "state_dict.safetensors"], ["--help"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tensorcanon", *argv], cwd=tmp_path,
                              capture_output=True, text=True, env=_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert "numpy" not in imported and "torch" not in imported, argv


def test_import_tensorcanon_is_light_and_complete():
    code = textwrap.dedent("""
        import sys, tensorcanon
        assert "torch" not in sys.modules, "import tensorcanon imported torch"
        assert set(tensorcanon.__all__) <= set(dir(tensorcanon)), set(tensorcanon.__all__) - set(dir(tensorcanon))
        light = [n for n in tensorcanon.__all__ if n not in ("ResumableSampler", "SamplerStateError", "seed_worker",
                                                             "SeededDataset", "SeededCollator")]
        for name in light:
            getattr(tensorcanon, name)
        assert "torch" not in sys.modules, "a light attribute imported torch"
        for name in tensorcanon.__all__:
            assert getattr(tensorcanon, name) is not None, name
        import torch
        assert tensorcanon.ResumableSampler.__module__ == "tensorcanon.training.data"
        assert tensorcanon.diff.__module__ == "tensorcanon.tools.diff" and callable(tensorcanon.diff)
        import tensorcanon.tools.diff  # importing the module leaves the function of that name
        assert callable(tensorcanon.diff)
        t = {"w": torch.arange(3.0), "g": torch.Generator().manual_seed(1), "d": torch.float8_e4m3fn}
        back = tensorcanon.loads(tensorcanon.dumps(t))
        assert torch.equal(back["w"], t["w"]) and back["d"] is torch.float8_e4m3fn
        assert torch.equal(back["g"].get_state(), t["g"].get_state())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_torch_imported_after_tensorcanon_saves_as_before():
    """torch imported by the program after tensorcanon: its types still encode (the stand-in is
    replaced before any tensor reaches the encoder)."""
    code = textwrap.dedent("""
        import tensorcanon
        from tensorcanon.format import tensorbytes, tree
        import torch
        obj = {"p": torch.nn.Parameter(torch.ones(2)), "s": torch.Size([2, 3]), "dev": torch.device("cpu"),
               "cl": torch.zeros(1, 2, 3, 4).to(memory_format=torch.channels_last), "g": torch.Generator()}
        back = tensorcanon.loads(tensorcanon.dumps(obj))
        assert type(back["p"]) is torch.nn.Parameter and back["s"] == obj["s"]
        assert back["cl"].is_contiguous(memory_format=torch.channels_last)
        assert tree.torch is torch and tensorbytes.torch is torch
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_what_needs_torch_says_what_to_install(tmp_path):
    """torch made unimportable (``sys.modules["torch"] = None``): each command that needs it fails
    with exit 2 and one line naming the extra; the light commands still work."""
    shutil.copytree(INPUTS, tmp_path / "in")
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        sys.modules["torch"] = None
        from tensorcanon.tools import cli
        out = {}
        for argv in (["diff", "base.safetensors", "one_element.safetensors"], ["hash", "weights.pt"],
                     ["inspect", "weights.pt"], ["convert", "plain.safetensors", "x.safetensors"],
                     ["verify", "base.safetensors"], ["check", "good.lock"]):
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                code = cli.main(argv)
            out[argv[0] + " " + argv[1]] = [code, err.getvalue()]
        import tensorcanon
        for fn in (lambda: tensorcanon.load("base.safetensors"), lambda: tensorcanon.ResumableSampler):
            try:
                fn()
            except tensorcanon.MissingDependencyError as e:
                assert isinstance(e, ImportError)
                out[str(len(out))] = [2, "tensorcanon: error: " + str(e) + "\\n"]
        json.dump(out, sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                          cwd=tmp_path / "in")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert len(found) == 8, found
    for what, (code, err) in found.items():
        if what.startswith(("verify", "check")):  # (verify's one note: what torch.load would drop of the file)
            assert code == 0 and (err == "" or err.startswith("tensorcanon: note: torch.load(")), (what, err)
            assert err.count("\n") <= 1, (what, err)
            continue
        assert code == 2 and err.count("\n") == 1, (what, err)
        assert "pip install torch safetensors (the [torch] extra" in err, (what, err)


def test_readme_commands_install_what_they_need():
    """The light core has no torch, so the demo command installs the torch extra and the test extra
    holds it (the README's two commands, which tests/test_readme.py ties to .ci/run)."""
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    core = [re.split("[<>=!~ ;]", d)[0] for d in project["dependencies"]]
    assert sorted(core) == ["msgpack", "numpy", "xxhash"], core
    extras = project["optional-dependencies"]
    for extra in ("torch", "test", "lightning", "accelerate", "transformers"):
        assert {"torch>=2.4", "safetensors>=0.8"} <= set(extras[extra]), extra
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert 'python -m pip install -c constraints.txt -e ".[torch]" && python examples/demo.py' in readme
    assert 'python -m pip install -c constraints.txt -e ".[test]" && python -m pytest -q' in readme
    hooks = open(os.path.join(ROOT, ".pre-commit-hooks.yaml"), encoding="utf-8").read()
    assert "id: tensorcanon-check" in hooks and "entry: tensorcanon check" in hooks and "language: python" in hooks


def test_startup_benchmark_runs(light_python):
    """benchmarks/startup.py end to end (a smoke test: its structure, never its timings)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "startup.py"), "--runs", "1",
                           "--large-mib", "0", "--light-python", light_python],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a timing target missed on a busy machine
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tensorcanon ") and line.count("|") == 7]
    assert len(rows) == 12 and all(line.endswith("| no |") for line in rows), proc.stdout
    assert "| target | bound | measured | result |" in proc.stdout
    assert "imports torch | no | yes |" not in proc.stdout, proc.stdout
