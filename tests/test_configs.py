"""Config objects of real libraries: yacs's CfgNode and OmegaConf's DictConfig and ListConfig are saved by
the codecs tensorcanon ships (issue 40; docs/FORMAT.md §6.9.5) with no call, flags kept; a program's own
registration of one of these classes takes precedence over the built-in codec (issue 30's documented
calls still work), and unregistering it gives the built-in one back."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf
from yacs.config import CfgNode

import tensorcanon
from tensorcanon.format import ecosystem, registry


@pytest.fixture
def cleanup():
    yield
    for cls in (CfgNode, DictConfig, ListConfig):
        tensorcanon.unregister(cls)


def _cfg() -> CfgNode:
    cfg = CfgNode()
    cfg.MODEL = CfgNode({"DEPTH": 50, "NAME": "resnet"})
    cfg.SOLVER = CfgNode({"LR": 0.1, "STEPS": (30, 60)})
    cfg.OUTPUT_DIR = "out"
    return cfg


def test_a_yacs_cfgnode_needs_no_call(cleanup):
    cfg = _cfg()
    data = tensorcanon.dumps({"cfg": cfg, "epoch": 3})
    back = tensorcanon.loads(data)["cfg"]
    assert type(back) is CfgNode and type(back.MODEL) is CfgNode and back == cfg
    assert back.SOLVER.STEPS == (30, 60) and back.MODEL.DEPTH == 50
    assert tensorcanon.dumps({"cfg": back, "epoch": 3}) == data
    back.merge_from_list(["SOLVER.LR", 0.2])  # a working CfgNode
    assert back.SOLVER.LR == 0.2
    assert registry.by_type(CfgNode).name == ecosystem.CFG_NODE


def test_a_frozen_cfgnode_comes_back_frozen(cleanup):
    cfg = _cfg()
    cfg.freeze()
    back = tensorcanon.loads(tensorcanon.dumps(cfg))
    assert back == cfg and back.is_frozen() and back.MODEL.is_frozen()
    with pytest.raises(AttributeError):
        back.MODEL.DEPTH = 3


def test_a_programs_own_registration_takes_precedence(cleanup):
    """issue 30's documented call, `tensorcanon.register(CfgNode)`, still saves it its way (as a dict
    subclass, under its own name); unregistering it gives the built-in codec back."""
    tensorcanon.register(CfgNode)
    data = tensorcanon.dumps(_cfg())
    assert registry.by_type(CfgNode).name == "yacs.config.CfgNode"
    assert tensorcanon.loads(data) == _cfg()
    tensorcanon.unregister(CfgNode)
    assert registry.by_type(CfgNode).name == ecosystem.CFG_NODE
    assert tensorcanon.dumps(_cfg()) != data
    for cls in (DictConfig, ListConfig):
        tensorcanon.register(cls, encode=OmegaConf.to_container, decode=OmegaConf.create)
    assert registry.by_type(DictConfig).name == "omegaconf.dictconfig.DictConfig"


def test_omegaconf_configs_round_trip_with_interpolations_and_flags(cleanup):
    conf = OmegaConf.create({"model": {"depth": 50, "name": "${data.name}-net"}, "data": {"name": "cifar"},
                             "lrs": [0.1, 0.01], "missing": "???"})
    OmegaConf.set_struct(conf, True)
    OmegaConf.set_readonly(conf.model, True)
    layers = OmegaConf.create([1, 2, {"a": None}])
    back = tensorcanon.loads(tensorcanon.dumps({"conf": conf, "layers": layers}))
    assert type(back["conf"]) is DictConfig and back["conf"] == conf
    assert list(back["conf"]) == list(conf)  # key order is the config's (to_yaml writes it)
    assert back["conf"].model.name == "cifar-net"  # the interpolation is kept, and resolves
    assert OmegaConf.is_missing(back["conf"], "missing")
    assert OmegaConf.is_struct(back["conf"]) and OmegaConf.is_readonly(back["conf"].model)
    assert not OmegaConf.is_readonly(back["conf"].data)
    assert type(back["layers"]) is ListConfig and back["layers"] == layers
