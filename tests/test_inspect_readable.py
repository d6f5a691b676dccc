"""``tensorcanon inspect`` as a person reads it, on a realistic checkpoint (issue 38 item 1): a small
transformer, AdamW after a few steps, a OneCycleLR schedule, every random state (tensorcanon's own
capture and the plain values of random, numpy and torch), the determinism settings and a dict of
training information. Random states and the settings are one row each, long lists of plain values
one row, and the table fits 80 columns and a pipe without cutting a path or a note. Also: inspect of
a packed list in the memory docs/SECURITY.md states (issue 37 item 5), of a trace (issue 38 item 4),
and of a file whose strings hold terminal control characters (issue 37 item 4)."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import struct
import sys
import tracemalloc

import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon.format import paths
from tensorcanon.tools import cli, inspectview, textout

from support import run_cli

RNG_PATHS = ('$["rng"]', '$["python_rng"]', '$["numpy_rng"]', '$["loader_generator"]', '$["np_generator"]')


def _realistic() -> dict:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    losses, lrs = [], []
    for _ in range(3):
        loss = model(torch.randn(4, 8, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        lrs.append(sched.get_last_lr()[0])
    sd = model.state_dict()
    return {
        "model": sd, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "rng": tensorcanon.RngState.capture(),  # tensorcanon's own capture of every generator
        "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state(),
        "loader_generator": torch.Generator().manual_seed(3), "np_generator": np.random.default_rng(5),
        "settings": tensorcanon.DeterminismSettings.capture(),
        "info": {"step": 3, "epoch": 0, "losses": losses, "lrs": lrs, "run": "tiny-transformer",
                 "lr_history": [i / 1000 for i in range(300)], "seen_ids": list(range(1000)),
                 "config": {"d_model": 32, "layers": 2},
                 "best_linear1": sd["layers.0.linear1.weight"]},  # the same tensor: a note, "same tensor as"
    }


def _realistic_keys() -> list[str]:
    return ["model", "optimizer", "scheduler", "rng", "python_rng", "numpy_rng", "torch_rng", "loader_generator",
            "np_generator", "settings", "info"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "ckpt.safetensors"
    tensorcanon.save(_realistic(), path)
    return str(path)


@pytest.fixture(scope="module")
def entries(ckpt):
    return json.loads(run_cli("inspect", "--json", ckpt)[1])


def _inspect(monkeypatch, *argv, columns=None):
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)  # in-process stdout: not a terminal, as a pipe
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run_cli("inspect", *argv)
    assert code == 0 and err == "", err
    return out


def _rows(out: str) -> list[str]:
    """The table's rows, a path continued on lines of its own (2 spaces, then text) joined to it."""
    table = out.split("\n\n")[1]
    return [line for line in re.sub(r"\n  (?=\S)", "", table).splitlines()[1:] if line.startswith("$")]


def _row(out: str, path: str) -> str:
    """The row of ``path``, with the lines its value is wrapped on."""
    table = re.sub(r"\n  (?=\S)", "", out.split("\n\n")[1]).splitlines()
    i = next(i for i, line in enumerate(table) if line == path or line.startswith(path + " "))
    j = next((k for k in range(i + 1, len(table)) if not table[k].startswith("  ") or table[k].startswith("    (")),
             len(table))
    return " ".join(line.strip() for line in table[i:j])


@pytest.mark.parametrize("columns", [80, None], ids=["80 columns", "piped"])
def test_a_realistic_checkpoint_reads_in_few_rows_that_fit(ckpt, entries, monkeypatch, columns):
    out = _inspect(monkeypatch, ckpt, columns=columns)
    lines = out.splitlines()
    tensors = [e["path"] for e in entries["entries"] if e["dtype"]]
    longest = max(len(e["path"]) for e in entries["entries"])
    limit = columns or max(inspectview.PIPE_WIDTH, longest)
    assert max(map(len, lines)) <= limit, [line for line in lines if len(line) > limit]
    rows = _rows(out)
    # one row per tensor, and few others: the 629 rows of random.getstate() and the 1,300 items of
    # the info lists are one row each
    assert len(tensors) == 99 and len(rows) <= len(tensors) + 80, len(rows)
    assert len(lines) <= 2 * len(rows) + 20, len(lines)
    for p in RNG_PATHS:  # a random state: one row, none for its parts
        assert sum(1 for r in rows if r.startswith(p)) == 1, p
    joined = re.sub(r"\n  (?=\S)", "", out).splitlines()
    for p in tensors:  # every path whole, never cut in the middle (numpy's state: one row, its key inside)
        if p.startswith('$["numpy_rng"]['):
            continue
        assert any(line == p or line.startswith(p + " ") for line in joined), p
    assert "..." not in "".join(r.split("  ")[0] for r in rows)
    # the note survives: the tied tensor's row names the tensor it shares (in its row, or below it)
    (tied,) = [e for e in entries["entries"] if e["same_as"]]
    assert tied["same_as"] == '$["info"]["best_linear1"]' and tied["path"] == '$["model"]["layers.0.linear1.weight"]'
    note = f"same tensor as {tied['same_as']}"
    assert note in _row(out, tied["path"]) or f"\n    ({note})\n" in out, _row(out, tied["path"])
    # DTYPE, SHAPE and BYTES hold nothing for other values: a value starts at the DTYPE column
    header = out.split("\n\n")[1].splitlines()[0]
    step = next(r for r in rows if r.startswith('$["info"]["step"] '))
    assert step.index(" 3", len('$["info"]["step"]')) + 1 == header.index("DTYPE"), (header, step)
    # sizes with thousands separators and units
    t = entries["totals"]
    total = " ".join(line.strip() for line in lines[lines.index(next(x for x in lines if x.startswith("total:"))):])
    assert f"{t['tensor_bytes']:,} bytes ({t['tensor_bytes'] / 1024:.0f} KiB) of tensor data" in total, total
    assert f"file {t['file_bytes']:,} bytes (" in total and f"{t['entries']:,} entries" in total


def test_random_states_and_lists_say_what_they_hold(ckpt, monkeypatch):
    out = _inspect(monkeypatch, ckpt)
    rng = _row(out, '$["rng"]')
    assert "RngState" in rng and "python (MT19937, pos 624)" in rng and "numpy (MT19937, pos 624)" in rng
    assert "torch cpu (MT19937, seed 0)" in rng
    assert "random.getstate() (MT19937, pos 624)" in _row(out, '$["python_rng"]')
    assert "numpy.random.get_state() (MT19937, pos 624)" in _row(out, '$["numpy_rng"]')
    assert "torch cpu (MT19937, seed 3)" in _row(out, '$["loader_generator"]')
    assert "numpy Generator (PCG64, seed 5)" in _row(out, '$["np_generator"]')
    assert "DeterminismSettings" in _row(out, '$["settings"]') and torch.__version__ in _row(out, '$["settings"]')
    lr = _row(out, '$["info"]["lr_history"]')
    assert lr.split("list", 1)[1].strip().startswith("300 floats: 0.0, 0.001, 0.002") and lr.endswith("...")
    assert "1,000 ints: 0, 1, 2" in _row(out, '$["info"]["seen_ids"]')
    assert "{'d_model': 32, 'layers': 2}" in _row(out, '$["info"]["config"]')
    assert "metadata" in _row(out, '$["model"]["_metadata"]')  # torch's module versions: one row
    assert not any(r.startswith('$["model"]["_metadata"][') for r in _rows(out))


def test_json_keeps_the_parts_the_text_shows_in_one_row(ckpt, entries, monkeypatch):
    rows = {e["path"]: e for e in entries["entries"]}
    assert len(rows) == len(entries["entries"]) == entries["totals"]["entries"]
    # parts the text folds into their value's row are entries of their own
    assert rows['$["settings"]["torch_version"]']["value"] == repr(torch.__version__)
    assert rows['$["numpy_rng"][1]']["dtype"] == "uint32"  # (the tensor inside numpy's state)
    assert rows['$["model"]["_metadata"]["layers.0"]["version"]']["value"] == "1"
    # a list of plain values is one entry, its items summed up from the file (never an entry each)
    lr = rows['$["info"]["lr_history"]']
    assert lr["items"] == {"count": 300, "types": ["float"], "first": [i / 1000 for i in range(8)]}
    assert rows['$["info"]["seen_ids"]']["items"]["count"] == 1000
    assert not any(p.startswith('$["info"]["lr_history"][') for p in rows)
    assert rows['$["rng"]']["type"] == "RngState" and "python (MT19937, pos 624)" in rows['$["rng"]']["value"]
    # the text says the same totals
    text = _inspect(monkeypatch, ckpt)
    assert f"total: {entries['totals']['entries']:,} entries, {entries['totals']['tensors']} tensors" in text


def test_depth_tensors_and_path_select_rows(ckpt, entries, monkeypatch):
    def shown(*argv):
        text_rows = _rows(_inspect(monkeypatch, ckpt, *argv))
        data = json.loads(run_cli("inspect", "--json", ckpt, *argv)[1])
        assert data["totals"] == entries["totals"]  # the file's, whatever is shown
        return text_rows, [e["path"] for e in data["entries"]]

    rows, paths = shown("--depth", "1")
    assert paths == [e["path"] for e in entries["entries"] if e["path"].count("[") <= 1]
    assert len(rows) == len(paths) == 1 + len(_realistic_keys())
    rows, paths = shown("--tensors")
    assert paths == [e["path"] for e in entries["entries"] if e["dtype"]] and len(rows) == len(paths)
    rows, paths = shown("--path", "exp_avg_sq")
    assert len(paths) == len(rows) == 24 and all(p.endswith('["exp_avg_sq"]') for p in paths)
    rows, paths = shown("--path", '$["info"]')
    assert paths == [e["path"] for e in entries["entries"] if e["path"].startswith('$["info"]')]
    assert paths[0] == '$["info"]'
    assert [r.split("  ")[0] for r in rows] == [p for p in paths if not p.startswith('$["info"]["config"][')]
    rows, paths = shown("--path", '$["optimizer"]["state"][?]["step"]', "--tensors")
    assert len(paths) == 10 and all(re.fullmatch(r'\$\["optimizer"\]\["state"\]\[\d\]\["step"\]', p) for p in paths)
    out = _inspect(monkeypatch, ckpt, "--depth", "0")
    assert "shown: 1 row for" in out and "selected by --depth 0" in out
    for bad in (["--depth", "-1"], ["--depth", "x"]):
        code, out, err = run_cli("inspect", ckpt, *bad)
        assert code == 2 and out == "" and "--depth" in err, err


def test_a_path_too_long_for_any_width_wraps_between_its_keys(tmp_path, monkeypatch):
    key = "encoder." + ".".join(f"block_{i}" for i in range(20)) + ".weight"
    t = torch.ones(2)
    path = tmp_path / "long.safetensors"
    tensorcanon.save({"model": {key: t}, "tied": t}, path)
    long = f'$["model"]["{key}"]'
    for columns in (40, 60, 80, 200):
        out = _inspect(monkeypatch, path, columns=columns)
        assert max(map(len, out.splitlines())) <= max(columns, 48), columns  # (48: the shortest tensor row)
        joined = re.sub(r"\n  (?=\S)", "", out).splitlines()
        assert long in joined or any(line.startswith(long + " ") for line in joined), columns
        note = re.sub(r"\n    (?!\()", "", out)  # a note wrapped on lines of its own
        assert f"same tensor as {long}" in note, (columns, out)


def test_printable_escapes_controls_and_bidi():
    """The one rule (format/text.py): what str.isprintable calls unprintable is escaped; a backslash
    and printable text of any script are kept."""
    assert textout.printable("a\x1b[2Jb\rc\u202ed\u2066e\x7f\x85\\f é") == \
        "a\\x1b[2Jb\\rc\\u202ed\\u2066e\\x7f\\x85\\f é"
    for c in range(0x110000):
        if textout.CONTROLS.match(chr(c)):
            assert "\\" in textout.printable(chr(c)) and chr(c) not in textout.printable(chr(c))


def test_control_characters_from_the_file_never_reach_the_terminal(tmp_path, monkeypatch):
    evil = "ok\x1b[2J\x1b]0;owned\x07\rsame: \u202eevil\x9b1m\\"
    path = tmp_path / "evil.safetensors"
    tensorcanon.save({evil: torch.ones(1), "v": evil, "list": [evil, "x"], "d": {evil: 1},
                      "nested": {evil: {"w": torch.zeros(1), "n": 2}}}, path, metadata={"note": evil, evil: 2})
    unsafe = textout.CONTROLS
    for columns in (None, 80):
        out = _inspect(monkeypatch, path, columns=columns)
        assert not unsafe.search(out.replace("\n", "")), [line for line in out.splitlines() if unsafe.search(line)]
        assert '$["ok\\u001b[2J' in out  # the key, escaped where its path is shown
    raw = run_cli("inspect", "--json", str(path))[1]
    assert not unsafe.search(raw.replace("\n", ""))
    data = json.loads(raw)  # and the JSON still holds the file's own strings
    assert data["metadata"]["note"] == evil
    assert any(e["path"] == paths.join((evil,)) for e in data["entries"])


# ------------------------------------------------------------------ memory (docs/SECURITY.md)

def _manifest_size(path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return len(base64.b64decode(header["__metadata__"]["tensorcanon.manifest"]))


def _peak(argv) -> int:
    """tracemalloc's peak while the command runs, its output to /dev/null (a pipe holds nothing)."""
    with open(os.devnull, "w") as sink:
        old = sys.stdout
        sys.stdout = sink
        tracemalloc.start()
        try:
            code = cli.main(argv)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            sys.stdout = old
            assert code == 0


@pytest.mark.parametrize("value", [[i % 200 for i in range(300_000)], [{"a": None}] * 30_000],
                         ids=["300,000 ints", "30,000 one-key dicts"])
def test_inspect_of_a_packed_list_stays_within_the_manifests_bound(tmp_path, value):
    """A packed list is summed up from its node, never expanded into an object per item (text: 565x
    the file, JSON: 2,315x before); docs/SECURITY.md states ~90x the manifest for any reader."""
    path = tmp_path / "packed.safetensors"
    tensorcanon.save({"x": value}, path)
    size = _manifest_size(path)
    for argv in (["inspect", str(path)], ["inspect", "--json", str(path)]):
        peak = _peak(argv)
        assert peak < 40 * size, f"{argv[:-1]} took {peak / size:.0f}x the manifest's {size:,} bytes"


def test_inspect_of_many_values_streams_its_rows(tmp_path):
    """A row per value is written as the walk reaches it, not kept: inspect of 5,000 small values
    takes the memory load does (the tree's own objects), whatever the rows and the JSON entries."""
    path = tmp_path / "many.safetensors"
    tensorcanon.save({f"k{i}": [i, "x"] for i in range(5_000)}, path)
    size = _manifest_size(path)
    tracemalloc.start()
    try:
        tensorcanon.load(path)
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for argv in (["inspect", str(path)], ["inspect", "--json", str(path)]):
        peak = _peak(argv)
        assert peak < 1.5 * load_peak and peak < 90 * size, (argv[:-1], peak / size, load_peak / size)


# ------------------------------------------------------------------ traces

def _trace(path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensorcanon.trace(str(path), level="modules", model=model, optimizer=opt) as tr:
        for _ in range(3):
            x = torch.randn(3, 4)
            tr.step(x)
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_inspect_of_a_trace_sums_it_up_and_says_what_to_use(tmp_path, monkeypatch):
    from tensorcanon.trace import layout

    path = tmp_path / "run.trace"
    _trace(path)
    header, records = layout.verify(path)
    out = _inspect(monkeypatch, path)
    assert "not a tensorcanon file" not in out
    assert "tensorcanon trace of a training run" in out and f"level:    {header.level};" in out
    assert f"records:  {records:,}, steps 0 to 2; complete" in out
    assert "`tensorcanon diverge A B`" in out and "`tensorcanon verify FILE`" in out
    data = json.loads(run_cli("inspect", "--json", str(path))[1])
    assert data["format"] == "tensorcanon-trace" and data["records"] == records and data["complete"] is True
    assert sum(data["kinds"].values()) == records and data["steps"] == [0, 2]
    # a run that stopped: its records so far, and why it is incomplete
    cut = tmp_path / "cut.trace"
    cut.write_bytes(path.read_bytes()[:300])
    out = _inspect(monkeypatch, cut)
    assert "incomplete: the file ends" in out
    # a damaged one: exit 2, naming what checks it
    bad = tmp_path / "bad.trace"
    data_bytes = bytearray(path.read_bytes())
    data_bytes[200] ^= 1
    bad.write_bytes(bytes(data_bytes))
    code, out, err = run_cli("inspect", str(bad))
    assert code == 2 and out == "" and "does not match" in err and "tensorcanon verify" in err, err
