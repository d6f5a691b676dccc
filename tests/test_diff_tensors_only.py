"""diff(tensors_only=True) and `tensorcanon diff --tensors-only`: compare weights across writers.

A model's state_dict() is an OrderedDict with _metadata; transformers and safetensors write a
plain dict of the same tensors. The whole-object diff reports the container difference (as it
should); the tensors-only diff compares only the tensors at each path.
"""

import collections
import json
import subprocess
import sys

import torch
from safetensors.torch import save_file

import tensorcanon


def _state():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).state_dict()


def test_a_state_dict_and_the_plain_file_safetensors_wrote_differ_only_in_structure(tmp_path):
    sd = _state()
    tensorcanon.save(sd, tmp_path / "canon.safetensors")
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "plain.safetensors")
    whole = tensorcanon.diff(tmp_path / "canon.safetensors", tmp_path / "plain.safetensors")
    assert [d.kind for d in whole] == ["type"]  # OrderedDict in A, dict in B
    only = tensorcanon.diff(tmp_path / "canon.safetensors", tmp_path / "plain.safetensors", tensors_only=True)
    assert only.identical and only.tensors_only
    assert str(only).splitlines()[-1].startswith("identical tensors (tensors only")  # not "identical" alone


def test_tensors_only_still_reports_every_tensor_difference():
    a = collections.OrderedDict(w=torch.zeros(3), b=torch.ones(2), step=1)
    a._metadata = {"": {"version": 1}}
    b = {"w": torch.tensor([0.0, 5.0, 0.0]), "b": torch.ones(2), "extra": torch.zeros(1), "step": 2}
    result = tensorcanon.diff(a, b, tensors_only=True)
    assert [(d.path, d.kind) for d in result] == [('$["extra"]', "added"), ('$["w"]', "values")]
    assert result.differences[1].stats.first_index == (1,)
    # a dtype or shape change is a tensor difference too
    result = tensorcanon.diff({"w": torch.zeros(3)}, {"w": torch.zeros(3, dtype=torch.float64)}, tensors_only=True)
    assert [d.kind for d in result] == ["dtype"]
    # non-tensor values, order, sharing and container types are ignored
    t = torch.ones(2)
    assert tensorcanon.diff({"x": [t, t], "n": "a"}, {"x": (t, t.clone()), "n": "b"}, tensors_only=True).identical
    assert not tensorcanon.diff({"x": [t, t], "n": "a"}, {"x": (t, t.clone()), "n": "b"}).identical


def test_the_command_line_option(tmp_path):
    sd = _state()
    tensorcanon.save(sd, tmp_path / "canon.safetensors")
    changed = {k: v.clone() for k, v in sd.items()}
    changed["2.bias"][0] += 1
    save_file(changed, tmp_path / "plain.safetensors")
    run = [sys.executable, "-m", "tensorcanon", "diff", "--tensors-only", "--json",
           "canon.safetensors", "plain.safetensors"]
    proc = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["tensors_only"] is True
    assert [(d["path"], d["kind"]) for d in data["differences"]] == [('$["2.bias"]', "values")]
    proc = subprocess.run(run[:5] + run[6:], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout.rstrip().endswith("1 difference (bit-exact, tensors only)")
