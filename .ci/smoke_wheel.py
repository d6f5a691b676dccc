"""Smoke test of an installed tensorcanon wheel, run by .ci/run from a folder outside the
source tree, in a fresh venv: first with the light install (the wheel and its dependencies, no
torch), then with the torch extra and pytest added.

    python smoke_wheel.py SOURCE_ROOT --light     # the light install: no torch in the venv
    python smoke_wheel.py SOURCE_ROOT             # with the torch extra and pytest

Checks what only the built distribution can get wrong: that the package imports from
site-packages (not the source tree), that its metadata and ``__version__`` agree, that
``py.typed`` is shipped, that the console script, ``python -m tensorcanon`` and the pytest
plugin entry point work, and that a save/load/verify round trip does. The light run checks that
torch is not installed, that verify, check, hash, inspect, lock and every --help work on
committed files (golden files with dtypes only newer torch knows, a plain safetensors file, an
.npz, a sharded checkpoint) with the digests the source tree records, without importing torch,
and that a command needing torch says in one line what to install.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.resources
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap


def run(*argv: str, cwd: str, expect: int = 0) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != expect:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}, expected {expect}\n"
                         f"{proc.stdout}\n{proc.stderr}")
    return proc.stdout


LIGHT_COMMANDS = ("hash", "verify", "inspect", "diff", "lock", "check", "convert", "consolidate", "repro")


def light(src: pathlib.Path) -> None:
    """The light install: no torch, and the commands that read files work without it."""
    import importlib.util
    import json

    assert importlib.util.find_spec("torch") is None, "torch is installed in the light venv"
    import tensorcanon
    from tensorcanon import lockfile

    where = pathlib.Path(tensorcanon.__file__).resolve()
    assert "site-packages" in where.parts and src not in where.parents, f"imported from {where}"
    assert md.version("tensorcanon") == tensorcanon.__version__
    requires = md.requires("tensorcanon") or []
    core = [r for r in requires if "extra ==" not in r]
    assert not any(r.startswith(("torch", "safetensors")) for r in core), core
    golden = src / "tests" / "golden"
    digests = json.loads((golden / "digests.json").read_text())["digests"]
    names = ["dtypes_u8", "dtypes_native", "torch_values", "random_state", "state_dict"]
    script = shutil.which("tensorcanon")
    assert script and pathlib.Path(script).parent == pathlib.Path(sys.executable).parent, script
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            shutil.copy(golden / f"{n}.safetensors", tmp)
        shutil.copytree(golden / "sharded" / "two_ranks", pathlib.Path(tmp, "ckpt"))
        for n in ("plain.safetensors", "arrays.npz"):
            shutil.copy(src / "tests" / "cli" / "inputs" / n, tmp)
        files = [f"{n}.safetensors" for n in names]
        out = run(script, "verify", *files, "ckpt", cwd=tmp)
        for n in names:
            # (verify lines its digests up in one column: a name is followed by one or more spaces)
            assert re.search(rf"^OK +{re.escape(n)}\.safetensors +{digests[n]}$", out, re.M), (n, out)
        assert tensorcanon.verify(pathlib.Path(tmp, "dtypes_u8.safetensors")) == digests["dtypes_u8"]
        run(script, "hash", *files, "plain.safetensors", "arrays.npz", "ckpt", cwd=tmp)
        for target in ("dtypes_u8.safetensors", "torch_values.safetensors", "plain.safetensors", "ckpt"):
            run(script, "inspect", target, cwd=tmp)
        run(script, "lock", ".", "-o", "tensors.lock", cwd=tmp)
        out = run(script, "check", "tensors.lock", cwd=tmp)
        assert out.rstrip().endswith(f"all {len(files) + 3} files match"), out
        assert all(r.ok for r in lockfile.check_lock(pathlib.Path(tmp, "tensors.lock")))
        run(sys.executable, "-m", "tensorcanon", "--help", cwd=tmp)
        for command in LIGHT_COMMANDS:
            run(script, command, "--help", cwd=tmp)
        assert "torch" not in sys.modules, "tensorcanon.verify or lockfile imported torch"
        proc = subprocess.run([script, "diff", "plain.safetensors", "arrays.npz"], cwd=tmp,
                              capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "pip install torch safetensors (the [torch] extra" in lines[0], proc.stderr
    print(f"light wheel smoke test passed (no torch): tensorcanon {tensorcanon.__version__} from {where.parent}")


def main(source_root: str) -> None:
    src = pathlib.Path(source_root).resolve()
    here = pathlib.Path.cwd().resolve()
    assert src not in here.parents and here != src, f"run this from outside {src}"
    if "--light" in sys.argv[2:]:
        light(src)
        return

    import torch

    import tensorcanon

    where = pathlib.Path(tensorcanon.__file__).resolve()
    assert "site-packages" in where.parts and src not in where.parents, f"imported from {where}"
    assert md.version("tensorcanon") == tensorcanon.__version__, (md.version("tensorcanon"),
                                                                  tensorcanon.__version__)
    assert importlib.resources.files("tensorcanon").joinpath("py.typed").is_file(), "py.typed missing"
    dist_files = {str(f) for f in md.distribution("tensorcanon").files or ()}
    assert not any(f.startswith("tests/") for f in dist_files), "tests/ ended up in the wheel"

    with tempfile.TemporaryDirectory() as tmp:
        # library round trip
        model = torch.nn.Linear(4, 2)
        obj = {"model": model.state_dict(), "step": 3, "rng": tensorcanon.RngState.capture()}
        path = os.path.join(tmp, "ckpt.safetensors")
        digest = tensorcanon.save(obj, path)
        assert tensorcanon.verify(path, expect=digest) == digest == tensorcanon.fingerprint(obj)
        back = tensorcanon.load(path)
        assert all(torch.equal(back["model"][k], v) for k, v in obj["model"].items())
        assert back["step"] == 3 and back["rng"] == obj["rng"]

        # the console script and python -m, both from this venv
        script = shutil.which("tensorcanon")
        assert script and pathlib.Path(script).parent == pathlib.Path(sys.executable).parent, script
        out = run(script, "verify", "--expect", digest, path, cwd=tmp)
        assert digest in out, out
        out = run(sys.executable, "-m", "tensorcanon", "--version", cwd=tmp)
        assert tensorcanon.__version__ in out, out
        other = os.path.join(tmp, "other.safetensors")
        tensorcanon.save({**obj, "step": 4}, other)
        out = run(sys.executable, "-m", "tensorcanon", "diff", path, other, cwd=tmp, expect=1)
        assert "step" in out, out

        # the pytest plugin, found through its pytest11 entry point
        eps = [ep for ep in md.entry_points(group="pytest11") if ep.name == "tensorcanon"]
        assert len(eps) == 1 and eps[0].value == "tensorcanon_pytest", eps
        test = pathlib.Path(tmp, "test_snap.py")
        test.write_text(textwrap.dedent("""
            import os
            import torch

            def test_snapshot(tensor_snapshot):
                tensor_snapshot(torch.arange(4.0) * float(os.environ.get("SCALE", "1")))
        """))
        pytest_cmd = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test))
        run(*pytest_cmd, cwd=tmp, expect=1)  # no snapshot yet: fails and says how to create it
        run(*pytest_cmd, "--tensorcanon-update", cwd=tmp)
        run(*pytest_cmd, cwd=tmp)
        os.environ["SCALE"] = "2"
        run(*pytest_cmd, cwd=tmp, expect=1)  # a different value fails against the snapshot
    print(f"wheel smoke test passed: tensorcanon {tensorcanon.__version__} from {where.parent}")


if __name__ == "__main__":
    main(sys.argv[1])
