"""torchao's quantized weights go through without ceremony (issue 40; docs/FORMAT.md §6.9.5).

torchao is not a dependency of the suite's environment (once installed, transformers and accelerate
import it, with messages on stderr, in every process), so this test makes a venv of its own on top
of the running one (``--system-site-packages``) and installs there the torchao that constraints.txt
pins, as tests/test_light.py makes its torch-free venv. Three fresh processes run in it: one
quantizes a model with torchao and saves the state with no ``register`` call; one that imports
torchao loads it back (type, inner tensors bit-exact, the same outputs); one that does not import
torchao is refused in one line naming it, and imports nothing from torchao (an audit hook watches).

torchao's releases follow torch's: the pinned torchao needs the torch this suite is developed on
(constraints.txt); on the floors (torch 2.4) the test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import venv

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIN = dict(line.split("==") for line in open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8").read().split("\n")
           if line and not line.startswith("#"))
TORCH_FOR_TORCHAO = (2, 13)  # the torch the pinned torchao is tested with
NEWER_TORCH = (f"torchao {PIN.get('torchao')} needs a newer torch (>= {'.'.join(map(str, TORCH_FOR_TORCHAO))}) "
               f"than this one ({torch.__version__}): not tested on the floors")

_SCRIPT = textwrap.dedent('''
    import json, sys
    mode, path = sys.argv[1], sys.argv[2]
    import torch
    import tensorcanon as tc
    if mode == "save":
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        quantize_(model, Int8WeightOnlyConfig())
        x = torch.randn(3, 32)
        tc.save({"model": model.state_dict(), "x": x, "y": model(x).detach()}, path)
        print(json.dumps({"type": type(model[0].weight).__module__ + "." + type(model[0].weight).__qualname__}))
    elif mode == "with":
        import torchao  # the program's own import
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        state = tc.load(path)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        quantize_(model, Int8WeightOnlyConfig())
        w, back = model[0].weight, state["model"]["0.weight"]
        names, ctx = w.__tensor_flatten__()
        same_inner = all(torch.equal(getattr(w, n), getattr(back, n)) for n in names)
        resaved_same = tc.fingerprint(state) == tc.verify(path)  # (before load_state_dict makes them parameters)
        model.load_state_dict(state["model"], assign=True)
        print(json.dumps({"type": type(back).__module__ + "." + type(back).__qualname__,
                          "same_inner": same_inner, "same_ctx": back.__tensor_flatten__()[1] == ctx,
                          "same_output": torch.equal(model(state["x"]).detach(), state["y"]),
                          "resaved_same": resaved_same}))
    else:
        imported = []
        sys.addaudithook(lambda event, args: event == "import" and args[0].split(".")[0] == "torchao"
                         and imported.append(args[0]))
        ok = bool(tc.verify(path))
        try:
            tc.load(path)
            error = None
        except tc.UnsupportedTypeError as e:
            error = str(e)
        print(json.dumps({"verified": ok, "error": error, "imported": imported}))
''')


@pytest.fixture(scope="module")
def torchao_python(tmp_path_factory):
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < TORCH_FOR_TORCHAO:
        pytest.skip(NEWER_TORCH)
    folder = tmp_path_factory.mktemp("torchao-venv")
    venv.create(folder, system_site_packages=True, with_pip=True)
    python = str(folder / "bin" / "python")
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", f"torchao=={PIN['torchao']}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def _run(python: str, mode: str, path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    done = subprocess.run([python, "-c", _SCRIPT, mode, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_torchao_weights_round_trip_and_are_refused_without_torchao_in_fresh_processes(torchao_python, tmp_path):
    path = tmp_path / "quantized.safetensors"
    saved = _run(torchao_python, "save", path)
    assert saved["type"].startswith("torchao.")
    loaded = _run(torchao_python, "with", path)
    assert loaded == {"type": saved["type"], "same_inner": True, "same_ctx": True, "same_output": True,
                      "resaved_same": True}
    refused = _run(torchao_python, "without", path)
    assert refused["verified"] and refused["imported"] == []
    assert refused["error"] is not None and "\n" not in refused["error"]
    assert "import torchao before loading it" in refused["error"] and '$["model"]["0.weight"]' in refused["error"]
