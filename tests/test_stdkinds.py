"""collections.Counter, defaultdict and deque as node kinds (docs/FORMAT.md §6.10, issue 30 item 1)."""

from __future__ import annotations

import collections

import pytest
import torch

import tensorcanon
from tensorcanon.format import stdkinds
from tensorcanon.format.errors import FormatError, UnsupportedTypeError, UsageError

import hostile_lib as h


def _root_node(data: bytes):
    m, _, _ = h.manifest_of(data)
    return m["root"]


def _names(data: bytes) -> list:
    header, _ = h.split(data)
    return sorted(k for k in header if k != "__metadata__")


def _with_root(node) -> bytes:
    data = tensorcanon.dumps({"v": 0})
    return h.with_manifest(data, lambda m: m.__setitem__("root", ["dict", "v", node]))


def _train(model, opt, sched, steps):
    torch.manual_seed(0)
    lrs = []
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr())
    return lrs


def test_multisteplr_state_dict_round_trips_and_the_schedule_continues_identically():
    def build():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return model, opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4, 7], gamma=0.5)

    model, opt, sched = build()
    _train(model, opt, sched, 3)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    back = tensorcanon.loads(tensorcanon.dumps(state))
    assert type(back["sched"]["milestones"]) is collections.Counter
    assert back["sched"]["milestones"] == collections.Counter({2: 1, 4: 2, 7: 1})
    assert back["sched"] == sched.state_dict()
    expected = _train(model, opt, sched, 6)

    model2, opt2, sched2 = build()
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["opt"])
    sched2.load_state_dict(back["sched"])
    assert _train(model2, opt2, sched2, 6) == expected
    assert torch.equal(model.weight, model2.weight)


def test_counter_keys_are_in_canonical_order_whatever_the_insertion_order():
    a = collections.Counter({"b": 2, "a": 1, 3: 4})
    b = collections.Counter({3: 4, "a": 1, "b": 2})
    assert tensorcanon.dumps(a) == tensorcanon.dumps(b)
    assert _root_node(tensorcanon.dumps(a)) == ["counter", 3, 4, "a", 1, "b", 2]
    assert tensorcanon.dumps(a) != tensorcanon.dumps(dict(a))  # a Counter is not a dict
    back = tensorcanon.loads(tensorcanon.dumps(a))
    assert type(back) is collections.Counter and back == a


@pytest.mark.parametrize("name", sorted(stdkinds.FACTORIES))
def test_every_listed_default_factory_round_trips(name):
    value = collections.defaultdict(stdkinds.FACTORIES[name], {"x": 1, 2: [3]})
    back = tensorcanon.loads(tensorcanon.dumps(value))
    assert type(back) is collections.defaultdict and back.default_factory is stdkinds.FACTORIES[name]
    assert dict(back) == dict(value)
    assert _root_node(tensorcanon.dumps(value))[:2] == ["defaultdict", name]


def test_defaultdict_without_a_factory_and_nested_defaultdicts():
    value = collections.defaultdict(None, {1: collections.defaultdict(list, {"a": [torch.ones(2)]})})
    back = tensorcanon.loads(tensorcanon.dumps(value))
    assert back.default_factory is None and back[1].default_factory is list
    assert torch.equal(back[1]["a"][0], torch.ones(2))
    assert _names(tensorcanon.dumps(value)) == ["1.a.0"]


@pytest.mark.parametrize("factory, shown", [
    (lambda: 0, "<lambda>"), (collections.UserDict, "collections.UserDict"),
    (type("Local", (), {}), "Local"), (max, "max"),
])
def test_other_default_factories_are_refused_naming_the_factory_and_the_path(factory, shown):
    with pytest.raises(UnsupportedTypeError, match=r"default_factory is .*" + shown + r".*\(at \$\[\"cfg\"\]\[0\]\)"):
        tensorcanon.dumps({"cfg": [collections.defaultdict(factory)]})


def test_the_remedy_for_an_unlisted_factory_works():
    value = collections.defaultdict(lambda: 0, {"a": 1})
    with pytest.raises(UnsupportedTypeError, match=r"save dict\(value\)"):
        tensorcanon.dumps(value)
    back = tensorcanon.loads(tensorcanon.dumps(dict(value)))  # the advice, applied
    assert back == {"a": 1}
    rebuilt = collections.defaultdict(lambda: 0, back)
    assert rebuilt["missing"] == 0


@pytest.mark.parametrize("value", [
    collections.deque(), collections.deque([1, "a", None]), collections.deque([1, 2], maxlen=2),
    collections.deque(maxlen=0), collections.deque([torch.zeros(1)], maxlen=5),
])
def test_deques_round_trip_with_their_maxlen(value):
    back = tensorcanon.loads(tensorcanon.dumps(value))
    assert type(back) is collections.deque and back.maxlen == value.maxlen and len(back) == len(value)
    assert tensorcanon.dumps(back) == tensorcanon.dumps(value)


def test_tensor_names_inside_the_new_containers_follow_their_paths():
    value = {"c": collections.Counter({"w": torch.ones(1)}), "q": collections.deque([torch.zeros(1)]),
             "d": collections.defaultdict(list, {"b": torch.ones(2)})}
    data = tensorcanon.dumps(value)
    assert _names(data) == ["c.w", "d.b", "q.0"]
    assert sorted(tensorcanon.open(data).keys()) == ['$["c"]["w"]', '$["d"]["b"]', '$["q"][0]']


def test_the_containers_cannot_be_registered_and_subclasses_are_refused():
    for cls in (collections.Counter, collections.defaultdict, collections.deque):
        with pytest.raises(UsageError, match="saved by the format itself"):
            tensorcanon.register(cls)

    class MyCounter(collections.Counter):
        pass

    with pytest.raises(UnsupportedTypeError, match="MyCounter"):
        tensorcanon.dumps(MyCounter("ab"))


def test_a_counter_with_attributes_is_refused():
    c = collections.Counter("ab")
    c.note = "x"
    with pytest.raises(UnsupportedTypeError, match="attributes set on it"):
        tensorcanon.dumps(c)


def test_keys_without_canonical_order_are_refused_in_each_mapping():
    for value in (collections.Counter({1 + 2j: 1}), collections.defaultdict(int, {1 + 2j: 1})):
        with pytest.raises(UnsupportedTypeError, match="no canonical order"):
            tensorcanon.dumps(value)


BAD = [
    (("counter", "b", 1, "a", 2), "not in canonical order"),
    (("counter", "a"), "odd number"),
    (("counter", True, 1, 1, 2), "treats as equal"),
    (("defaultdict",), "default factory slot"),
    (("defaultdict", "os.system", "a", 1), "not a default factory"),
    (("defaultdict", 3), "not a default factory"),
    (("defaultdict", "list", "b", 1, "a", 2), "not in canonical order"),
    (("deque",), "maxlen slot"),
    (("deque", -1), "maxlen"),
    (("deque", True), "maxlen"),
    (("deque", 1, 1, 2), "holds 2 items"),
    (("deque", 2**63), "maxlen"),
]


@pytest.mark.parametrize("node, match", BAD, ids=[repr(n)[:40] for n, _ in BAD])
def test_reader_rejects_nodes_that_break_the_rules(node, match):
    bad = _with_root(list(node))
    with pytest.raises(FormatError, match=match):
        tensorcanon.loads(bad)
    with pytest.raises(FormatError, match=match):
        tensorcanon.verify(bad)


def test_keys_that_share_a_hash_are_refused_in_a_counter():
    keys = {(2**61 - 1) * i: 1 for i in range(1, 70)}
    with pytest.raises(UnsupportedTypeError, match="share one Python hash"):
        tensorcanon.dumps(collections.Counter(keys))
    with pytest.raises(UnsupportedTypeError, match="share one Python hash"):
        tensorcanon.dumps(collections.defaultdict(int, keys))


def test_diff_compares_the_new_containers_and_string_arrays():
    import numpy as np

    a = {"q": collections.deque([torch.ones(2)], maxlen=3), "m": collections.Counter({3: 1}),
         "s": np.array(["a", "b"]), "d": collections.defaultdict(list, a=[1])}
    b = {"q": collections.deque([torch.zeros(2)], maxlen=4), "m": collections.Counter({3: 2}),
         "s": np.array(["a", "c"]), "d": collections.defaultdict(list, a=[2])}
    found = {d.path for d in tensorcanon.diff(a, b).differences}
    assert found == {'$["q"]', '$["q"][0]', '$["m"][3]', '$["s"]', '$["d"]["a"][0]'}
    assert not tensorcanon.diff(tensorcanon.loads(tensorcanon.dumps(a)), a).differences  # loaded: the same


def test_inspect_shows_the_new_containers_and_string_arrays(tmp_path, capsys):
    import numpy as np

    from tensorcanon.tools.cli import main as tensorcanon_cli

    path = tmp_path / "x.safetensors"
    tensorcanon.save({"c": collections.Counter("aab"), "q": collections.deque([1], maxlen=2),
                      "d": collections.defaultdict(int, a=1), "s": np.array([["ab"], ["c"]])}, path)
    assert tensorcanon_cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("Counter", "{'a': 2, 'b': 1}", "deque", "deque([1], maxlen=2)", "defaultdict", "{'a': 1}",
                 "U2 array of shape [2, 1]"):
        assert text in out, text


def test_the_parts_of_a_tuple_key_are_not_entries_of_the_tree():
    """tree.nodes: keys and set members are not entries (a tuple key's items were listed as values)."""
    from tensorcanon.format import tree

    data = tensorcanon.dumps({"p": {("a", 1): "x"}, "s": {(1, 2)}, "c": collections.Counter({(3,): 1})})
    m, _, _ = h.manifest_of(data)
    found = [t for t, _ in tree.nodes(m["root"], 0, 64)]
    assert found == [(), ("c",), ("c", (3,)), ("p",), ("p", ("a", 1)), ("s",)], found
