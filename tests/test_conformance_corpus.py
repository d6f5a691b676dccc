"""The conformance corpus (tests/conformance/): tensorcanon passes it, and it is what its script builds."""

from __future__ import annotations

import json
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).parent / "conformance"

import build_corpus
import runner

MANIFEST = json.loads((HERE / "manifest.json").read_text(encoding="utf-8"))

# Allowed rejections that only this machine's capabilities cause (an MPS device; the dtypes an
# older torch lacks). Anything else that is not a pass is a failure.
_LACKING = {"valid/mps_generator.safetensors", "valid/mps0_generator.safetensors"}
if not isinstance(getattr(torch, "float8_e8m0fnu", None), torch.dtype):  # the torch 2.4 floor
    _LACKING |= {"valid/dtypes_u8.safetensors", "valid/v2_dtypes_u8.safetensors", "valid/v1_dtypes_u8.safetensors"}


def test_tensorcanon_passes_the_corpus_strictly():
    results = runner.run(runner.python_reader(runner.tensorcanon_reader), strict=True)
    failed = [f"{r.file}: {r.detail}" for r in results if r.status == "fail"]
    assert not failed, "\n".join(failed)
    allowed = {r.file for r in results if r.status == "allowed"}
    assert allowed <= _LACKING, f"allowed rejections beyond this machine's capabilities: {allowed - _LACKING}"
    if torch.backends.mps.is_available():  # (an MPS machine builds them)
        assert not allowed & {"valid/mps_generator.safetensors", "valid/mps0_generator.safetensors"}


def test_the_committed_corpus_is_what_the_script_builds():
    files = build_corpus.render(build_corpus.cases())
    committed = {str(p.relative_to(HERE)) for sub in ("valid", "invalid") for p in (HERE / sub).iterdir()}
    assert committed == set(files) - {"manifest.json"}, "run python tests/conformance/build_corpus.py"
    for name, data in files.items():
        assert (HERE / name).read_bytes() == data, f"{name} is stale: run python tests/conformance/build_corpus.py"


def test_every_case_names_a_real_rule_and_section():
    ids = {e["id"] for e in json.loads((HERE.parent / "golden" / "conformance.json").read_text())["requirements"]}
    spec = (HERE.parent.parent / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    for case in MANIFEST["cases"]:
        if case["expect"] == "reject":
            assert case["rule"] in ids, case
            assert f"\n### {case['section']} " in spec or f"\n#### {case['section']} " in spec \
                or f"\n## {case['section']}. " in spec, case
            assert case["category"] in MANIFEST["categories"], case


def test_a_command_reader_and_the_judging_rules():
    """The command protocol, on two cases: a reader that accepts everything with one digest."""
    valid = next(c for c in MANIFEST["cases"] if c["expect"] == "accept")
    invalid = next(c for c in MANIFEST["cases"] if c["expect"] == "reject" and c["when"] == "building")
    code = f"print('accept {valid['digest']}')"
    read = runner.command_reader(f"{sys.executable} -c \"{code}\" {{file}}")
    assert runner.judge(valid, read(str(HERE / valid["file"])), strict=True).status == "pass"
    assert runner.judge(invalid, read(str(HERE / invalid["file"])), strict=True).status == "fail"
    assert runner.judge(invalid, read(str(HERE / invalid["file"])), strict=False).status == "allowed"
    reject = runner.command_reader(f"{sys.executable} -c \"print('reject limit: too deep')\" {{file}}")
    assert reject(str(HERE / valid["file"])) == ("reject", "limit", "too deep")
    assert runner.judge(valid, reject(str(HERE / valid["file"])), strict=False).status == "fail"
