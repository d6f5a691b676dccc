"""Config objects of real libraries, registered in the one call README documents (issue 30 items 3, 6):
yacs's CfgNode (a dict subclass) and OmegaConf's DictConfig and ListConfig (not dict subclasses: a codec)."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf
from yacs.config import CfgNode

import tensorcanon


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


def test_a_yacs_cfgnode_registers_in_one_call(cleanup):
    cfg = _cfg()
    with pytest.raises(tensorcanon.UnsupportedTypeError, match=r"tensorcanon\.register\(CfgNode\)"):
        tensorcanon.dumps({"cfg": cfg})
    tensorcanon.register(CfgNode)  # the documented call (and the advice)
    data = tensorcanon.dumps({"cfg": cfg, "epoch": 3})
    back = tensorcanon.loads(data)["cfg"]
    assert type(back) is CfgNode and type(back.MODEL) is CfgNode and back == cfg
    assert back.SOLVER.STEPS == (30, 60) and back.MODEL.DEPTH == 50
    assert tensorcanon.dumps({"cfg": back, "epoch": 3}) == data
    back.merge_from_list(["SOLVER.LR", 0.2])  # a working CfgNode
    assert back.SOLVER.LR == 0.2


def test_a_frozen_cfgnode_is_refused_and_a_codec_saves_it(cleanup):
    tensorcanon.register(CfgNode)
    cfg = _cfg()
    cfg.freeze()
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="register it with encode= and decode="):
        tensorcanon.dumps(cfg)

    def decode(state):
        node = CfgNode(state[0])
        if state[1]:
            node.freeze()
        return node

    tensorcanon.register(CfgNode, encode=lambda c: [dict(c), c.is_frozen()], decode=decode, replace=True)
    back = tensorcanon.loads(tensorcanon.dumps(cfg))
    assert back == cfg and back.is_frozen() and back.MODEL.is_frozen()


def test_omegaconf_configs_round_trip_through_the_documented_codec(cleanup):
    for cls in (DictConfig, ListConfig):
        tensorcanon.register(cls, encode=OmegaConf.to_container, decode=OmegaConf.create)
    conf = OmegaConf.create({"model": {"depth": 50, "name": "${data.name}-net"}, "data": {"name": "cifar"},
                             "lrs": [0.1, 0.01]})
    layers = OmegaConf.create([1, 2, {"a": None}])
    back = tensorcanon.loads(tensorcanon.dumps({"conf": conf, "layers": layers}))
    assert type(back["conf"]) is DictConfig and back["conf"] == conf
    assert back["conf"].model.name == "cifar-net"  # the interpolation is kept, and resolves
    assert type(back["layers"]) is ListConfig and back["layers"] == layers
