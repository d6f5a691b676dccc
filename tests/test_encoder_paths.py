"""The encoder's fast paths (tree.Encoder.enc_sequence, enc_dict: leaves written inline, checked
in bulk from 16 items, a small dict's key order remembered) give exactly the nodes, and the
errors, of the general path (enc_container, which walks walk.container value by value)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings, strategies as st

import tensorcanon
from tensorcanon.format import tree


class Key(str):
    """A str subclass: equal to (and hashing as) the str it holds, but not a str key."""


leaves = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63 - 1, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64]),
    st.floats(allow_nan=True), st.booleans(), st.none(), st.binary(max_size=4),
    st.text(max_size=4), st.sampled_from(["\ud800", "é", "\u0120x", "\U0001f600"]),
    st.complex_numbers(allow_nan=False, max_magnitude=10),
)
keys = st.one_of(st.text(max_size=3), st.sampled_from(["loss", "step", "\u0120x", "é", "\ud800"]),
                 st.builds(Key, st.sampled_from(["loss", "a"])), st.integers(-3, 3), st.none())


def _values(children):
    return st.one_of(
        st.lists(children, max_size=40),
        st.lists(children, max_size=40).map(tuple),
        st.dictionaries(st.text(max_size=3), children, max_size=40),
        st.dictionaries(keys, children, max_size=40),
        st.lists(st.dictionaries(st.sampled_from(["loss", "step", "epoch"]), children), max_size=20),
        st.lists(children, max_size=5).map(lambda v: collections.OrderedDict(enumerate(v))),
    )


values = st.recursive(leaves, _values, max_leaves=80)


def _outcome(fn):
    try:
        return "nodes", fn()
    except tensorcanon.TensorCanonError as e:
        return type(e).__name__, str(e)


@settings(max_examples=400, deadline=None)
@given(values)
def test_fast_paths_give_the_general_paths_nodes_and_errors(value):
    if type(value) not in (list, tuple, dict):
        return
    fast = _outcome(lambda: tree.Encoder(256).encode(value))
    general = _outcome(lambda: tree.Encoder(256).enc_container(value, 1))
    assert fast == general


@pytest.mark.parametrize("n", [15, 16, 40])
def test_bulk_checks_at_the_threshold(n):
    """Just below, at and above the bulk size: a big int is written as one, a bad str refused at its path."""
    for value, where in ((["a"] * (n - 1) + ["\ud800"], f"$[{n - 1}]"),
                         ({f"k{i:02d}": "v" for i in range(n - 1)} | {"z": "\ud800"}, '$["z"]'),
                         ({f"k{i:02d}": 1 for i in range(n - 1)} | {"\ud800": 1}, "$")):
        with pytest.raises(tensorcanon.UnsupportedTypeError) as e:
            tensorcanon.dumps(value)
        assert e.value.path == where
    big = [1.5] * (n - 1) + [2**64]
    assert tensorcanon.loads(tensorcanon.dumps(big)) == big


def test_a_remembered_key_order_is_not_taken_for_keys_of_a_str_subclass():
    """{Key("loss"): 1} equals {"loss": 1} as a dict key tuple, but its key is no str: refused
    (as the general path refuses it), even right after a dict whose key order was remembered."""
    value = [{"loss": 1.0, "step": 1}, {Key("loss"): 1.0, "step": 2}]
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="Key") as e:
        tensorcanon.dumps(value)
    assert e.value.path == "$[1]"
    assert _outcome(lambda: tree.Encoder(256).encode(value)) == \
        _outcome(lambda: tree.Encoder(256).enc_container(value, 1))
