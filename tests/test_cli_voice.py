"""The command line as people read it (issue 38, items 3, 4 and 6): one voice for errors, the
CLI's habits, and the torch.load trap.

- The API and the command line give the same reason for the same input (junk, an empty file, a
  directory, a pickle), from one judgement (format/container.not_ours, io/regular.directory_reason),
  and every message of ``load`` names the file.
- A tensorcanon file whose header or manifest no longer decodes is damaged: ``CORRUPT``, exit 1
  in verify, as a flipped data byte is; a file written that way (its digest vouches for its
  manifest) is malformed, exit 2.
- torch's weights-only refusal is replaced by ours: the blocking class and the remedy, no
  terminal escape codes.
- Each subcommand's own usage on a bad argument, with the option meant; ``check`` of a tensor
  file says to use verify; ``lock`` does not replace a lockfile unasked; help fits 80 columns;
  counts are pluralized; verify's lines fit the terminal; advice is one short line.
- ``torch.load("x.safetensors")`` (torch 2.13) returns the tensors only: a test documents it, and
  verify says so.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import warnings
from collections import OrderedDict

import pytest
import torch

import tensorcanon
import tensorcanon.io.reader
from tensorcanon.format import errors
from tensorcanon.tools import cli

from support import run_cli

JUNK = bytes(range(200, 256)) * 80  # 4,480 bytes whose first 8 claim an absurd header; byte 8 is not '{'


class Custom:
    """A class of the user's own in a torch.save checkpoint: torch's weights-only loader refuses it."""

    def __init__(self) -> None:
        self.a = 1


def _api_error(path) -> Exception:
    with pytest.raises(errors.TensorCanonError) as e:
        tensorcanon.load(path)
    return e.value


def _checkpoint() -> dict:
    """A small realistic checkpoint: a model, AdamW, a scheduler, random states and info."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}, "info": {"step": 3, "name": "run"}}


# --------------------------------------------------------------------------- one voice


@pytest.mark.parametrize("what", ["junk", "empty", "short", "text"])
def test_the_api_and_every_command_give_the_same_reason_naming_the_file(tmp_path, what):
    data = {"junk": JUNK, "empty": b"", "short": b"abc", "text": b"config: yes\nand some notes\n"}[what]
    path = tmp_path / f"{what}.bin"
    path.write_bytes(data)
    message = str(_api_error(path))
    assert message.startswith(f"{path}: not a safetensors or tensorcanon file: "), message
    assert "raise it" not in message  # (never advice to raise max_header_bytes for a file that is no header)
    for command in ("verify", "hash", "inspect", "convert"):
        argv = [command, str(path)] + ([str(tmp_path / "out.safetensors")] if command == "convert" else [])
        code, _, err = run_cli(*argv)
        assert code == 2 and err == f"tensorcanon: error: {message}\n", (command, err)


def test_junk_and_empty_files_say_what_they_are_not(tmp_path):
    (tmp_path / "random.bin").write_bytes(JUNK)
    (tmp_path / "empty.bin").write_bytes(b"")
    junk, empty = str(_api_error(tmp_path / "random.bin")), str(_api_error(tmp_path / "empty.bin"))
    assert "its first 8 bytes claim a header of" in junk and "the file has 4,480 bytes" in junk, junk
    assert "it is empty" in empty, empty


def test_a_directory_is_a_directory_unless_it_looks_like_an_unfinished_checkpoint(tmp_path):
    plain = tmp_path / "somedir"
    plain.mkdir()
    (plain / "notes.txt").write_text("hi")
    api = str(_api_error(plain))
    assert api.endswith("is a directory, not a tensorcanon file or a sharded checkpoint (it holds no "
                        "index.safetensors)"), api
    for command in ("verify", "hash", "inspect", "diff"):
        code, _, err = run_cli(command, str(plain), *([str(plain)] if command == "diff" else []))
        assert code == 2 and "is a directory, not a file or a sharded checkpoint (it holds no index.safetensors)" \
            in err and "interrupted" not in err, (command, err)
    unfinished = tmp_path / "ckpt"
    unfinished.mkdir()
    (unfinished / ("rank-00000-of-00002." + "0" * 32 + ".safetensors")).write_bytes(b"")
    for err in (str(_api_error(unfinished)), run_cli("verify", str(unfinished))[2]):
        assert "interrupted save" in err and "index.safetensors" in err, err


def test_a_pickle_says_it_is_one_and_to_convert_it(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "zip.pt")
    with open(tmp_path / "legacy.bin", "wb") as f:
        torch.save({"w": torch.ones(2)}, f, _use_new_zipfile_serialization=False)
    (tmp_path / "proto2.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    for name in ("zip.pt", "legacy.bin", "proto2.pkl"):
        message = str(_api_error(tmp_path / name))
        assert message.startswith(f"{tmp_path / name}: not a safetensors or tensorcanon file: it is a ")
        assert "torch.save" in message and "`tensorcanon convert" in message and "never unpickles" in message
    code, out, err = run_cli("convert", str(tmp_path / "legacy.bin"), str(tmp_path / "legacy.safetensors"))
    assert code == 0 and "wrote" in out, err


def test_a_flipped_byte_in_the_manifest_is_damage_everywhere(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    tensorcanon.save(_checkpoint(), path)
    data = bytearray(path.read_bytes())
    data[data.index(b'"tensorcanon.manifest":"') + 100] = ord("!")  # not base64
    path.write_bytes(data)
    e = _api_error(path)
    assert isinstance(e, tensorcanon.FormatError) and e.damaged, e
    assert str(e).startswith(f"{path}: manifest: is not valid base64") and "the file is damaged" in str(e)
    code, out, err = run_cli("verify", str(path))
    assert code == 1 and out.startswith(f"CORRUPT   {path}: manifest: is not valid base64") and err == "", (out, err)
    code, out, err = run_cli("hash", str(path))
    assert code == 1 and "the file is damaged" in err
    code, out, _ = run_cli("verify", "--json", str(path))
    assert code == 1 and json.loads(out)["files"][0]["status"] == "corrupt"
    lock = tmp_path / "ckpt.lock"
    lock.write_text(f"tensorcanon-lock 3\nxxh3-128:{'0' * 32} {len(data)} ckpt.safetensors\n")
    code, out, _ = run_cli("check", str(lock))
    assert code == 1 and out.startswith("CORRUPT     ckpt.safetensors: "), out


def test_a_header_that_no_longer_decodes_is_damage_and_a_file_written_wrong_is_not(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    tensorcanon.save({"w": torch.ones(3), "step": 1}, path)
    data = bytearray(path.read_bytes())
    data[data.index(b'"data_offsets"')] = ord("'")  # the header's JSON no longer parses
    path.write_bytes(data)
    e = _api_error(path)
    assert e.damaged and "header is not valid JSON" in str(e) and str(path) in str(e)
    code, out, _ = run_cli("verify", str(path))
    assert code == 1 and out.startswith("CORRUPT ")
    # A manifest its own digest vouches for, which breaks a rule: written that way, not damaged.
    crafted = os.path.join(os.path.dirname(__file__), "attacks", "manifest_hash_flood.bin")
    e = _api_error(crafted)
    assert isinstance(e, tensorcanon.FormatError) and not e.damaged and str(e).startswith(crafted)
    code, out, err = run_cli("verify", crafted)
    assert code == 2 and out == "" and "damaged" not in err


def test_load_names_the_file_in_every_error(tmp_path):
    path = tmp_path / "damaged.safetensors"
    tensorcanon.save({"w": torch.ones(2)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    hostile = os.path.join(os.path.dirname(__file__), "attacks", "header_not_json.bin")
    for f in (path, hostile):
        for call in (tensorcanon.load, tensorcanon.verify, lambda p: tensorcanon.load(p, mmap=True)):
            with pytest.raises(errors.TensorCanonError) as e:
                call(f)
            assert str(f) in str(e.value), str(e.value)
    with pytest.raises(tensorcanon.FormatError) as e:
        tensorcanon.read_metadata(hostile)
    assert str(e.value).startswith(f"{hostile}: header is not valid JSON"), str(e.value)


def test_torchs_refusal_names_the_class_and_the_remedy_without_escape_codes(tmp_path):
    torch.save({"w": torch.ones(2), "c": Custom()}, tmp_path / "custom.pt")
    code, out, err = run_cli("convert", str(tmp_path / "custom.pt"), str(tmp_path / "out.safetensors"))
    assert code == 2 and out == ""
    assert "\x1b" not in err and "two options" not in err, err
    assert f"{Custom.__module__}.Custom" in err and "add_safe_globals([Custom])" in err, err
    assert "tensorcanon.register(Custom)" in err and "tensorcanon.save(torch.load(path, weights_only=True), out)" in err
    assert not os.path.exists(tmp_path / "out.safetensors")


# --------------------------------------------------------------------------- habits


def test_a_mistyped_option_gets_the_subcommands_usage_and_the_option_meant(tmp_path):
    code, out, err = run_cli("verify", "--expected", "X", "f.safetensors")
    assert code == 2 and out == ""
    assert err.startswith("usage: tensorcanon verify ") and \
        err.endswith("tensorcanon verify: error: unrecognized option --expected (did you mean --expect?)\n"), err
    code, _, err = run_cli("diff", "--tol", "1e-3", "A.safetensors", "A.safetensors")
    last = err.splitlines()[-1]
    assert code == 2 and err.startswith("usage: tensorcanon diff ") and "A.safetensors" not in last, err
    assert last.startswith("tensorcanon diff: error: unrecognized option --tol (did you mean ") and "--atol" in last
    code, _, err = run_cli("verfy", "x")
    assert code == 2 and err.rstrip().endswith("(did you mean verify?)"), err
    code, _, err = run_cli("diff", "a", "b", "c")
    assert code == 2 and err.splitlines()[-1] == "tensorcanon diff: error: unrecognized argument: c", err


def test_check_of_a_tensor_file_says_to_use_verify(tmp_path):
    path = tmp_path / "good.safetensors"
    tensorcanon.save({"w": torch.ones(2)}, path)
    code, out, err = run_cli("check", str(path))
    assert code == 2 and out == "" and "not a lockfile" in err and f"use `tensorcanon verify {path}`" in err, err
    assert "UTF-8" not in err
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert "not a lockfile" in run_cli("check", str(tmp_path / "w.pt"))[2]


def test_lock_does_not_replace_a_lockfile_unasked(tmp_path):
    tensorcanon.save({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    code, out, _ = run_cli("lock", "a.safetensors", "-o", "tensors.lock", cwd=tmp_path)
    assert code == 0 and out == "wrote tensors.lock: 1 file\n"
    before = (tmp_path / "tensors.lock").read_text()
    tensorcanon.save({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    code, out, err = run_cli("lock", "a.safetensors", "-o", "tensors.lock", cwd=tmp_path)
    assert code == 2 and out == "" and "already exists; pass --force" in err, err
    assert (tmp_path / "tensors.lock").read_text() == before
    code, out, _ = run_cli("lock", "--force", "a.safetensors", "-o", "tensors.lock", cwd=tmp_path)
    assert code == 0 and (tmp_path / "tensors.lock").read_text() != before
    code, out, _ = run_cli("check", "tensors.lock", cwd=tmp_path)
    assert code == 0 and out.splitlines()[-1] == "1 file matches", out


@pytest.mark.parametrize("command", ["", "hash", "verify", "inspect", "diff", "lock", "check", "convert",
                                     "consolidate", "repro", "diverge"])
def test_help_fits_80_columns(monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(*([command] if command else []), "--help")
    assert code == 0 and out
    assert [line for line in out.splitlines() if len(line) > 80] == []


def test_verify_lines_fit_the_terminal_and_are_whole_in_a_pipe(tmp_path, monkeypatch):
    path = tmp_path / "corrupt.safetensors"
    tensorcanon.save({"model": OrderedDict(weight=torch.ones(3))}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    monkeypatch.setenv("COLUMNS", "")
    code, piped, _ = run_cli("verify", path.name, cwd=tmp_path)
    assert code == 1 and len(piped.splitlines()) == 1 and len(piped) > 200
    monkeypatch.setenv("COLUMNS", "80")
    code, fitted, _ = run_cli("verify", path.name, cwd=tmp_path)
    lines = fitted.splitlines()
    assert code == 1 and len(lines) > 1 and all(len(line) <= 80 for line in lines), fitted
    assert " ".join(line.strip() for line in lines) == piped.strip()


def test_counts_are_pluralized_in_repro(tmp_path):
    """``and 1 more difference``, ``1 of 1 artifact``, and the hint to trace the runs."""
    a = {f"t{i:02d}": torch.zeros(1) for i in range(12)}
    b = {k: v + 1 for k, v in a.items()}
    tensorcanon.save(a, tmp_path / "a.safetensors")
    tensorcanon.save(b, tmp_path / "b.safetensors")
    da, db = tensorcanon.verify(tmp_path / "a.safetensors"), tensorcanon.verify(tmp_path / "b.safetensors")
    args = cli.build_parser().parse_args(["repro", "--out", "m.safetensors", "--", "true"])
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    out = cli._Out(stdout, stderr, as_json=False, progress=False)
    code = cli._report_repro(args, out, [[{"": (da, "tensorcanon")}], [{"": (db, "tensorcanon")}]],
                             [[str(tmp_path / "a.safetensors")], [str(tmp_path / "b.safetensors")]])
    text = stdout.getvalue()
    assert code == 1 and "... and 1 more difference\n" in text and "not reproducible: 1 of 1 artifact differed" in text
    assert "--trace modules" in stderr.getvalue()


def test_the_pythonhashseed_advice_is_one_short_line(monkeypatch):
    from tensorcanon.training import determinism

    monkeypatch.setattr(determinism, "_hashseed_warned", False)
    monkeypatch.setattr(determinism, "_hashes_randomized", lambda: True)
    monkeypatch.setenv("PYTHONHASHSEED", "")
    state = random.getstate(), torch.get_rng_state(), torch.are_deterministic_algorithms_enabled()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tensorcanon.seed_everything(7, deterministic=False)
            tensorcanon.seed_everything(7, deterministic=False)
    finally:
        random.setstate(state[0])
        torch.set_rng_state(state[1])
    notes = [str(w.message) for w in caught if issubclass(w.category, determinism.DeterminismWarning)]
    assert len(notes) == 1 and "\n" not in notes[0] and len(notes[0]) <= 120, notes
    assert "PYTHONHASHSEED=7" in notes[0]


def test_convert_no_longer_claims_torch_load_cannot_read_a_safetensors_file(tmp_path):
    tensorcanon.save({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    code, _, err = run_cli("convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt"))
    assert code == 2 and "cannot read" not in err and "name it .safetensors" in err, err


# --------------------------------------------------------------------------- the torch.load trap


def test_torch_load_of_a_safetensors_name_returns_the_tensors_only(tmp_path):
    """Documents torch's behaviour: torch 2.13 hands a path ending in ``.safetensors`` to the
    safetensors package, which returns the stored tensors as a flat dict, and nothing else (an
    optimizer's param_groups, a scheduler, random states, info), checking no digest. Older torch
    refuses the file (it is no pickle). Either way tensorcanon.load gives it all back."""
    state = _checkpoint()
    path = tmp_path / "ckpt.safetensors"
    tensorcanon.save(state, path)
    with tensorcanon.io.reader.open_file(path) as cf:
        stored = [row.name for row in cf.rows]
    try:
        flat = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch < 2.13: read as a pickle, refused
        assert "safetensors" not in type(e).__module__
        flat = None
    if flat is not None:
        assert isinstance(flat, dict) and all(isinstance(v, torch.Tensor) for v in flat.values())
        assert len(flat) == len(stored) == 9 and "optimizer.state.0.exp_avg" in flat
        assert not any("param_groups" in k or "scheduler" in k or "info" in k for k in flat)
    back = tensorcanon.load(path)
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"] and back["info"] == state["info"]


def test_verify_says_what_torch_load_would_drop(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    tensorcanon.save(_checkpoint(), path)
    tensorcanon.save({"model": {"w": torch.ones(2)}}, tmp_path / "weights.safetensors")
    code, out, err = run_cli("verify", str(path), str(tmp_path / "weights.safetensors"))
    assert code == 0 and out.count("OK ") == 2
    assert err.count("\n") == 1 and err.startswith(f"tensorcanon: note: torch.load({path}) would return only its "
                                                   "9 tensors (a flat dict, nothing checked) and drop "), err
    assert '$["info"]' in err and '$["optimizer"]["param_groups"]' in err and err.endswith("use tensorcanon.load\n")
    code, out, _ = run_cli("verify", "--json", str(path), str(tmp_path / "weights.safetensors"))
    drops = [f.get("torch_load_drops") for f in json.loads(out)["files"]]
    assert drops[0] >= 4 and drops[1] == 0
    code, out, err = run_cli("verify", str(tmp_path / "weights.safetensors"))
    assert code == 0 and err == ""  # only tensors: torch.load loses nothing but the nesting


def test_a_trace_given_to_load_or_inspect_says_what_it_is(tmp_path):
    from tensorcanon.format import container
    from tensorcanon.trace import layout

    assert container.TRACE_MAGIC == layout.MAGIC  # (the one magic, named in the format layer for the reader)
    path = tmp_path / "run.trace"
    path.write_bytes(layout.MAGIC + b"\x00" * 64)
    message = str(_api_error(path))
    assert "it is a trace of a training run" in message and "tensorcanon verify" in message, message
    code, _, err = run_cli("inspect", str(path))  # (inspect reads traces: a damaged one is named as one)
    assert code == 2 and "a trace of a training run" in err and "tensorcanon verify" in err, err


def test_a_safetensors_file_whose_length_starts_like_a_pickle_is_read_as_one(tmp_path):
    """A header length of 0x0280 bytes starts with 80 02, as a protocol-2 pickle does: a pickle is
    named only where the bytes already fail as a safetensors file (container.not_ours)."""
    path = tmp_path / "model.safetensors"
    for k in range(2000):
        digest = tensorcanon.save({"w": torch.ones(2)}, path, metadata={"pad": "x" * k})
        if path.read_bytes()[:2] == b"\x80\x02":
            break
    else:
        pytest.fail("no padding gave a header length of 0x0280")
    for command in ("hash", "verify"):
        code, out, err = run_cli(command, str(path))
        assert code == 0 and digest in out, (command, out, err)
