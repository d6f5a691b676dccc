"""README's table of what training code saves is what benchmarks/saved_objects.py measures (issue 40,
item 4): each row runs again here, tensorcanon's outcome and torch's side by side."""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import saved_objects

MARK = "<!-- saved-objects: the output of benchmarks/saved_objects.py (tests/test_saved_objects.py) -->\n"


def _columns(table: str, n: int) -> list[list[str]]:
    return [line.split(" | ")[:n] for line in table.splitlines()]


def test_readme_shows_what_the_objects_do_now():
    """The whole table with the torch constraints.txt pins (README's figures come from it); with another
    torch (the floors' 2.4, whose torch.load still unpickles by default) tensorcanon's column."""
    import torch

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert MARK in readme
    shown = readme.split(MARK, 1)[1].split("\n\n", 1)[0] + "\n"
    pins = open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8").read()
    pinned = f"torch=={torch.__version__.split('+')[0]}\n" in pins
    now = saved_objects.table()
    if pinned:
        assert shown == now, "README.md's table is stale: run python benchmarks/saved_objects.py"
    else:
        assert _columns(shown, 2) == _columns(now, 2)


def test_the_ecosystem_objects_round_trip_and_the_refusals_name_a_remedy():
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|", saved_objects.table(), re.M)[2:])  # (not the head)
    for what in ("`transformers.TrainingArguments`", "`transformers` `ModelOutput`",
                 "`transformers.BatchEncoding` (fast tokenizer)", "`torch.nn.utils.rnn.PackedSequence`",
                 "OmegaConf `DictConfig`", "yacs `CfgNode` (frozen)"):
        assert rows[what] == "round-trips", (what, rows[what])
    for what, outcome in rows.items():
        assert outcome == "round-trips" or outcome.startswith(("refused: ", "once registered: ", "opt-in: ")), what
