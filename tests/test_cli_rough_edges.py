"""The command line's rough edges of issue 32, each fixed and kept so: a closed pipe is not an
error, convert and repro both refuse to overwrite, one size for a sharded checkpoint, float32
values in their own shortest digits, keys quoted once, verify's digests in one column, help text
for every argument and a pointer to documentation that is installed, and inspect that fits an
80-column terminal with a Lightning checkpoint's long paths."""

from __future__ import annotations

import collections
import json
import os
import pydoc
import re
import shutil
import subprocess
import sys

import pytest
import torch

import tensorcanon
from tensorcanon.tools import cli, lockfile
from tensorcanon.tools.inspectview import size_text

from support import run_cli

HERE = os.path.dirname(os.path.abspath(__file__))
INPUTS = os.path.join(HERE, "cli", "inputs")
SHARDED = os.path.join(HERE, "golden", "sharded", "two_ranks")


@pytest.fixture
def inputs(cli_inputs):
    return cli_inputs


@pytest.mark.parametrize("argv", [["inspect", "base.safetensors"], ["hash", "base.safetensors", "plain.safetensors"],
                                  ["verify", "--json", "base.safetensors"]])
def test_a_closed_pipe_is_not_an_error(inputs, argv):
    proc = subprocess.Popen([sys.executable, "-m", "tensorcanon", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away before a line was written (`| head -0`)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b"", err


def test_convert_refuses_to_overwrite_unless_forced(inputs):
    assert run_cli("convert", "weights.pt", "w.safetensors")[0] == 0
    before = open("w.safetensors", "rb").read()
    code, out, err = run_cli("convert", "plain.safetensors", "w.safetensors")
    assert code == 2 and out == "" and "already exists" in err and "--force" in err, err
    assert open("w.safetensors", "rb").read() == before
    code, _, err = run_cli("convert", "--force", "arrays.npz", "w.safetensors")
    assert code == 0, err
    assert open("w.safetensors", "rb").read() != before
    os.symlink("w.safetensors", "link.safetensors")  # a dangling or live link is "existing" too
    assert run_cli("convert", "weights.pt", "link.safetensors")[0] == 2


def test_inspect_and_lock_give_a_checkpoint_one_size(tmp_path):
    shutil.copytree(SHARDED, tmp_path / "ckpt")
    code, out, _ = run_cli("inspect", "--json", str(tmp_path / "ckpt"))
    totals = json.loads(out)["totals"]
    (entry,) = lockfile.make_lock([str(tmp_path / "ckpt")], tmp_path / "t.lock")
    from tensorcanon import dcp

    assert totals["file_bytes"] == entry.size == len(tensorcanon.dumps(dcp.load_unsharded(str(tmp_path / "ckpt"))))
    stored = sum(os.path.getsize(tmp_path / "ckpt" / n) for n in os.listdir(tmp_path / "ckpt"))
    assert totals["stored_bytes"] == stored != entry.size
    text = re.sub(r"\n +", " ", run_cli("inspect", str(tmp_path / "ckpt"))[1])  # (the total's line, unwrapped)
    assert f"{size_text(entry.size)} as one file ({size_text(stored)} in its 3 files)" in text


def test_float32_values_print_in_their_own_shortest_digits(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensorcanon.save({"t": torch.tensor([0.45777494]), "h": torch.tensor([0.1], dtype=torch.bfloat16),
                      "c": torch.tensor([0.1 + 0.2j], dtype=torch.complex64)}, str(a))
    tensorcanon.save({"t": torch.tensor([0.45777497]), "h": torch.tensor([0.2], dtype=torch.bfloat16),
                      "c": torch.tensor([0.1 + 0.3j], dtype=torch.complex64)}, str(b))
    code, out, _ = run_cli("diff", str(a), str(b))
    assert code == 1
    assert "first at [0]: 0.45777494 -> 0.45777497" in out, out
    assert "first at [0]: 0.1 -> 0.2" in out, out  # bfloat16: the shortest digits that are that bfloat16
    assert "first at [0]: (0.1+0.2j) -> (0.1+0.3j)" in out, out
    assert repr(torch.tensor(0.45777494).item()) not in out  # not its float64 widening
    d = tensorcanon.diff(str(a), str(b)).differences
    assert json.loads(json.dumps(d[2].to_dict()))["stats"]["first_a"] == 0.45777494


def test_verify_digests_are_in_one_column(inputs):
    code, out, _ = run_cli("verify", "base.safetensors", "one_element.safetensors", SHARDED)
    assert code == 0
    starts = {line.index("xxh3-128:") for line in out.splitlines()}
    assert len(starts) == 1, out


def test_every_argument_has_help_and_help_points_to_installed_docs():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, (name, action.dest)
    text = parser.format_help()
    assert "docs/CLI.md." not in text.replace("\n", " ").split("source tree")[0]
    assert "python -m pydoc tensorcanon.tools.cli" in text
    doc = pydoc.render_doc("tensorcanon.tools.cli", renderer=pydoc.plaintext)  # what that command prints
    for command in sub.choices:
        assert re.search(rf"^\s+{command} ", doc, flags=re.M), command


def _lightning_like() -> dict:
    """A state shaped as a Lightning checkpoint: long module names, optimizer state by parameter
    index, callback states under keys that are the callback's repr, loops' progress counters."""
    names = [f"model.encoder.layers.{i}.self_attention.{p}_proj.{w}" for i in range(4) for p in "qkvo"
             for w in ("weight", "bias")]
    sd = collections.OrderedDict((n, torch.ones(8, 8) if n.endswith("weight") else torch.zeros(8)) for n in names)
    ckpt_key = ("ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, "
                "'every_n_epochs': 1, 'train_time_interval': None}")
    return {
        "epoch": 3, "global_step": 1200, "pytorch-lightning_version": "2.4.0",
        "state_dict": sd,
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"ready": 1200, "completed": 1200},
                                                             "current": {"ready": 300, "completed": 300}}}},
        "callbacks": {ckpt_key: {"best_model_path": "/checkpoints/epoch=2-step=900.ckpt",
                                 "best_model_score": torch.tensor(0.125), "dirpath": "/checkpoints"}},
        "optimizer_states": [{"state": {i: {"step": torch.tensor(1200.0), "exp_avg": torch.zeros_like(t),
                                            "exp_avg_sq": torch.zeros_like(t)} for i, t in enumerate(sd.values())},
                              "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": list(range(len(sd)))}]}],
        "lr_schedulers": [{"last_epoch": 3, "_step_count": 4}],
        "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.001, "hidden": 512},
    }


def test_inspect_fits_80_columns_with_a_lightning_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "last.ckpt")
    tensorcanon.save(_lightning_like(), path)
    whole = json.loads(run_cli("inspect", "--json", path)[1])["entries"]
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli("inspect", path)
    assert code == 0
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    table = out.split("\n\n")[1]
    header = table.splitlines()[0]
    starts = [header.index(h) for h in ("TYPE", "DTYPE", "SHAPE")]
    assert starts[1] - starts[0] <= 18  # TYPE shortened, not 35 columns
    # no path is cut: each is whole on its row, or on lines of its own (continued after 2 spaces)
    joined = re.sub(r"\n  (?=\S)", "", table).splitlines()
    tensors = [e["path"] for e in whole if e["dtype"]]
    for p in tensors:
        assert any(line == p or line.startswith(p + " ") for line in joined), p
    assert any(line == tensors[-1] for line in joined)  # (the longest ones: on lines of their own)
    assert "..." not in "".join(line.split("  ")[0] for line in joined)


ROOT = os.path.dirname(HERE)
CLI_MD = os.path.join(ROOT, "docs", "CLI.md")


def _blocks_and_headings(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """CommonMark's fences (``` opens with an optional info string; only a line of backticks, as
    many or more, closes) and the ATX headings outside them."""
    blocks, headings, fence, info, body = [], [], None, "", []
    for line in text.splitlines():
        stripped = line.strip()
        if fence is None:
            m = re.match(r"^ {0,3}(`{3,})([^`]*)$", line)
            if m:
                fence, info, body = m.group(1), m.group(2).strip(), []
            elif re.match(r"^ {0,3}#{1,6} ", line):
                headings.append(stripped)
        elif re.fullmatch(r"`{3,}", stripped) and len(stripped) >= len(fence) and not line.startswith("    "):
            blocks.append((info, "\n".join(body)))
            fence = None
        else:
            body.append(line)
    assert fence is None, "a fence is never closed"
    return blocks, headings


def test_cli_md_renders_with_every_heading_and_its_yaml_parses():
    import yaml

    text = open(CLI_MD, encoding="utf-8").read()
    blocks, headings = _blocks_and_headings(text)
    for command in ("hash", "verify", "inspect", "diff", "lock and check", "convert", "consolidate", "repro"):
        assert f"## {command}" in headings, (command, headings)
    assert "### In CI" in headings and "### As a pre-commit hook" in headings
    hooks = {h["id"]: h for h in yaml.safe_load(open(os.path.join(ROOT, ".pre-commit-hooks.yaml")))}
    configs = [yaml.safe_load(body) for info, body in blocks if info == "yaml"]
    assert len(configs) == 3
    for config in configs[1:]:  # the pre-commit snippets
        (repo,) = config["repos"]
        assert "<owner>" not in str(repo["repo"]) and [h["id"] for h in repo["hooks"]] == ["tensorcanon-check"]
        if repo["repo"] == "local":
            hook = repo["hooks"][0]
            assert hook["entry"] == hooks["tensorcanon-check"]["entry"]
            assert hook["files"] == hooks["tensorcanon-check"]["files"]
    # no install line that needs a package index (tensorcanon is on none): a path, a wheel or git
    assert not re.search(r"pip install \"?tensorcanon(\[\w+\])?\"?(?=\s|$)(?! @)", text), "install from an index"
    synopsis = blocks[0][1]
    for command in cli.build_parser()._subparsers._group_actions[0].choices:
        assert f"tensorcanon {command} " in synopsis, command


@pytest.mark.parametrize(("argv", "message"), [
    (["diff", "--atol", "abc", "a", "b"], "tensorcanon diff: error: argument --atol: 'abc' is not a number"),
    (["diff", "--rtol", "-1", "a", "b"], "tensorcanon diff: error: argument --rtol: '-1' must be a finite number >= 0"),
    (["diverge", "--tolerance", "x", "a", "b"],
     "tensorcanon diverge: error: argument --tolerance: 'x' is not a number"),
    (["diverge", "--tolerance", "nan", "a", "b"],
     "tensorcanon diverge: error: argument --tolerance: 'nan' must be a finite number >= 0"),
    (["diverge", "--tolerance", "inf", "a", "b"],
     "tensorcanon diverge: error: argument --tolerance: 'inf' must be a finite number >= 0"),
    (["lock", "--timeout", "0", "x"], "tensorcanon lock: error: argument --timeout: '0' must be > 0"),
])
def test_number_options_name_the_command_the_option_and_the_value(argv, message, capsys):
    """diff's tolerances, diverge's tolerance and lock's timeout share one argparse type
    (trace.command.nonnegative, the lower layer's): each error names its own command and option."""
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err.splitlines()
