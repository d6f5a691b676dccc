"""The object of ``v1/names.safetensors``: tensors under keys of every key type.

Written once by the version-1 writer (tensorcanon at commit bc91ae3), whose
names for non-str keys came from Python's ``repr()``; kept read-only so that
version-2 readers are tested on the version-1 name rule (docs/FORMAT.md §3.3).
"""

from __future__ import annotations

import struct

import torch


def names():
    payload_nan = struct.unpack(">d", bytes.fromhex("7ff800000000beef"))[0]
    return {
        ("a", 1): torch.zeros(1), ("it's",): torch.ones(1), ("\x00\x85\xa0é\u2028",): torch.zeros(2),
        b"k\x00'": torch.ones(2), 1.5: torch.zeros(3), float("nan"): torch.ones(3),
        payload_nan: torch.zeros(4), -0.0: torch.ones(4), 1e16: torch.zeros(5), None: torch.ones(5),
        True: torch.zeros(6), frozenset({2, "b", (1,)}): torch.ones(6), 2**70: torch.zeros(7),
        -(2**70): torch.ones(7), 7: torch.zeros(8), "": torch.ones(8), ((),): torch.zeros(9),
    }
