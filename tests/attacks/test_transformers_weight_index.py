"""CanonicalTrainer rewrites the weight files save_pretrained wrote, including the shards any
``*.safetensors.index.json`` in its output folder lists (issue 29). A stale or hostile index must
not make a save rewrite a file outside that folder: absolute names, ``..`` and links that lead out
are refused with an error naming the index, and nothing is rewritten."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import tensorcanon
from tensorcanon.integrations.transformers import _make_weights_canonical


def _plain(path) -> bytes:
    save_file({"w": torch.arange(4.0)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _index(folder, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture()
def setup(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    victim = elsewhere / "victim.safetensors"
    return out, victim, _plain(victim)


@pytest.mark.parametrize("name", [
    "../elsewhere/victim.safetensors", "ABSOLUTE", "shards/../../elsewhere/victim.safetensors",
    "..\\elsewhere\\victim.safetensors", "C:\\victim.safetensors", "", 7, None,
])
def test_an_index_naming_a_file_outside_the_folder_is_refused(setup, name):
    out, victim, before = setup
    shard = _plain(out / "model-00001-of-00001.safetensors")
    _index(out, {"w": str(victim) if name == "ABSOLUTE" else name, "v": "model-00001-of-00001.safetensors"})
    with pytest.raises(tensorcanon.FormatError, match="model.safetensors.index.json") as e:
        _make_weights_canonical(str(out))
    assert "remove or fix this index" in str(e.value)
    assert victim.read_bytes() == before
    assert (out / "model-00001-of-00001.safetensors").read_bytes() == shard  # nothing rewritten either


def test_a_shard_that_links_out_of_the_folder_is_refused(setup):
    out, victim, before = setup
    os.symlink(victim, out / "model-00001-of-00001.safetensors")
    _index(out, {"w": "model-00001-of-00001.safetensors"})
    with pytest.raises(tensorcanon.FormatError, match="leads out of the output folder"):
        _make_weights_canonical(str(out))
    assert victim.read_bytes() == before


def test_model_safetensors_that_links_out_of_the_folder_is_refused(setup):
    out, victim, before = setup
    os.symlink(victim, out / "model.safetensors")
    with pytest.raises(tensorcanon.FormatError, match="outside the output folder"):
        _make_weights_canonical(str(out))
    assert victim.read_bytes() == before


def test_a_broken_index_is_a_named_error(setup):
    out, _, _ = setup
    (out / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(tensorcanon.FormatError, match="not a readable weight index"):
        _make_weights_canonical(str(out))
    (out / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(tensorcanon.FormatError, match="not a readable weight index"):
        _make_weights_canonical(str(out))


def test_shards_inside_the_folder_are_made_canonical(setup):
    out, victim, before = setup
    for i in (1, 2):
        _plain(out / f"model-0000{i}-of-00002.safetensors")
    _index(out, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    _make_weights_canonical(str(out))
    for i in (1, 2):
        with safe_open(str(out / f"model-0000{i}-of-00002.safetensors"), "pt") as f:
            assert "tensorcanon.digest" in f.metadata() and f.metadata()["format"] == "pt"
    assert victim.read_bytes() == before
