"""Determinism across real process boundaries.

Each child process builds the same content (dicts and sets filled in an order
that depends on its argument, hash-ordered containers, frozenset keys whose
repr follows hash order) and writes it. Every child runs with a different
PYTHONHASHSEED; all must write identical bytes and report identical digests.
"""

import hashlib
import os
import pathlib
import subprocess
import sys
import textwrap

import tensorcanon as tc

CHILD = textwrap.dedent(r'''
    import collections, hashlib, json, sys
    import numpy as np
    import torch
    import tensorcanon as tc

    order, out = int(sys.argv[1]), sys.argv[2]

    def filled(pairs):
        pairs = list(pairs)
        if order % 2:
            pairs.reverse()
        if order >= 2:
            pairs = pairs[1::2] + pairs[0::2]
        d = {}
        for k, v in pairs:
            d[k] = v
        return d

    words = ["alpha", "beta", "gamma", "delta", "épsilon", "ζeta", "eta", "theta"]
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    od = collections.OrderedDict([("z", 1), ("a", 2)])
    od._metadata = {"": {"version": 1}}
    obj = {
        "model": filled((f"layer{i}.weight", torch.arange(i + 1, dtype=torch.float64) * i) for i in range(8)),
        "tied": [w, w, w.t()],
        "set": set(filled((x, None) for x in words)),
        "frozen": frozenset(filled((x, None) for x in words + [3, -1, None, b"b", (1, "a")])),
        "keys": filled([(w_, i) for i, w_ in enumerate(words)] + [(7, "int"), (None, "none"), (2.5, "float"),
                                                              ((1, "t"), "tuple"), (b"x", "bytes")]),
        frozenset(words): torch.ones(2, dtype=torch.int16),
        (frozenset({"q", "r", "s", "t"}), 1): torch.zeros(3, dtype=torch.bfloat16),
        "odict": od,
        "np": np.arange(6, dtype=">f8").reshape(2, 3).T,
    }
    meta = filled([("run", "x"), ("seed", 3), ("tags", {"b", "a", "c"})])
    digest = tc.save(obj, out, metadata=meta)
    print(json.dumps({"digest": digest, "fingerprint": tc.fingerprint(obj, metadata=meta),
                      "dumps_sha": hashlib.sha256(tc.dumps(obj, metadata=meta)).hexdigest()}))
''')


def run_child(tmp_path: pathlib.Path, seed: str, order: int, name: str) -> tuple[dict, bytes]:
    import json

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONHASHSEED"] = seed
    res = subprocess.run([sys.executable, str(script), str(order), str(out)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), out.read_bytes()


def test_processes_with_different_hash_seeds_and_orders_write_identical_bytes(tmp_path):
    runs = [("0", 0, "a.safetensors"), ("1", 1, "b.safetensors"), ("random", 2, "other name.bin"),
            ("12345", 3, "c")]
    results = [run_child(tmp_path, *r) for r in runs]
    first_info, first_bytes = results[0]
    assert first_info["digest"] == first_info["fingerprint"]
    assert first_info["dumps_sha"] == hashlib.sha256(first_bytes).hexdigest()
    for info, data in results[1:]:
        assert data == first_bytes
        assert info == first_info
    # and this process (whatever its seed) reads them and agrees on the digest
    assert tc.verify(first_bytes) == first_info["digest"]


def test_same_object_under_different_file_names_gives_identical_bytes(tmp_path):
    obj = {"w": tc.loads(tc.dumps({"x": __import__("torch").arange(10.0)}))["x"], "name": "n"}
    paths = [tmp_path / "a.safetensors", tmp_path / "sub dir" / "long-name.ckpt.pt", tmp_path / "ü.bin"]
    paths[1].parent.mkdir()
    digests = {tc.save(obj, p) for p in paths}
    assert len(digests) == 1
    assert len({p.read_bytes() for p in paths}) == 1
