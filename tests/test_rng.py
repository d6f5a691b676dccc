"""Generator objects and RngState: canonical values whose next draws survive a round trip."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

import tensorcanon
from tensorcanon import FormatError, RngRestoreError, RngState
from tensorcanon.training.rng import BIT_GENERATORS, RngRestoreWarning

from support import requires_cuda

BITGENS = sorted(BIT_GENERATORS)


def _advanced(obj):
    """Draw a little so the state is not a fresh seed (and leaves cached halves/gauss)."""
    if isinstance(obj, torch.Generator):
        torch.rand(7, generator=obj, device=obj.device)
    elif isinstance(obj, np.random.Generator):
        obj.random(3)
        obj.integers(0, 10, dtype=np.uint32)  # leaves a cached uint32 half
    elif isinstance(obj, np.random.RandomState):
        obj.standard_normal()  # leaves a cached gauss
    elif isinstance(obj, random.Random):
        obj.gauss(0, 1)
    return obj


def _draw(obj):
    if isinstance(obj, torch.Generator):
        return torch.rand(5, generator=obj, device=obj.device).cpu().tolist()
    if isinstance(obj, np.random.Generator):
        return [obj.random(3).tolist(), int(obj.integers(0, 2**32, dtype=np.uint32)),
                obj.standard_normal(2).tolist()]
    if isinstance(obj, np.random.RandomState):
        return [obj.standard_normal(3).tolist(), obj.randint(0, 1000, 3).tolist()]
    if isinstance(obj, random.Random):
        return [obj.random(), obj.gauss(0, 1), obj.getrandbits(70)]
    raise TypeError(type(obj))


def _generators():
    out = {"torch": torch.Generator().manual_seed(11), "random": random.Random(3),
           "legacy": np.random.RandomState(5), "legacy_pcg": np.random.RandomState(np.random.PCG64(1))}
    for name in BITGENS:
        out[f"numpy_{name}"] = np.random.Generator(BIT_GENERATORS[name][0](17))
    return out


@pytest.mark.parametrize("kind", sorted(_generators()))
def test_generator_round_trip_next_draws_identical(kind):
    g = _advanced(_generators()[kind])
    data = tensorcanon.dumps({"g": g, "list": [g]})
    loaded = tensorcanon.loads(data)
    assert tensorcanon.dumps(loaded) == data  # canonical: decoding and re-encoding keeps the bytes
    assert loaded["list"][0] is not g and type(loaded["g"]) is type(g)
    assert _draw(loaded["g"]) == _draw(g)
    assert _draw(loaded["g"]) == _draw(g)


def _spawn(g: np.random.Generator, n: int) -> list:
    """``g.spawn(n)``; built from the bit generator's own SeedSequence on numpy 1.24, which has
    no Generator.spawn (nor the public ``seed_seq``) but spawns children the same way."""
    if hasattr(g, "spawn"):
        return g.spawn(n)
    bg = g.bit_generator
    return [np.random.Generator(type(bg)(s)) for s in bg._seed_seq.spawn(n)]


@pytest.mark.parametrize("name", BITGENS)
def test_bare_bit_generator_and_spawn_round_trip(name):
    bg = BIT_GENERATORS[name][0](np.random.SeedSequence([1, 2, 3], spawn_key=(4,)))
    g = np.random.Generator(bg)
    _spawn(g, 2)
    g.random(5)
    loaded_g, loaded_bg = tensorcanon.loads(tensorcanon.dumps([g, bg]))
    assert type(loaded_bg) is type(bg) and loaded_bg.state["bit_generator"] == name
    # the seed sequence survives, so spawned children continue identically
    assert _spawn(loaded_g, 1)[0].random() == _spawn(g, 1)[0].random()
    assert _draw(loaded_g) == _draw(g)


def test_same_state_same_bytes_across_processes():
    code = ("import numpy as np, random, torch, tensorcanon, sys;"
            "o=[torch.Generator().manual_seed(1), random.Random(2), np.random.RandomState(3),"
            " np.random.default_rng(4)];"
            "sys.stdout.write(tensorcanon.fingerprint(o))")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": s}).stdout for s in ("1", "2")}
    local = tensorcanon.fingerprint([torch.Generator().manual_seed(1), random.Random(2),
                                     np.random.RandomState(3), np.random.default_rng(4)])
    assert out == {local}


def test_generators_in_metadata_and_verify():
    g = np.random.default_rng(9)
    data = tensorcanon.dumps({"x": torch.ones(2)}, metadata={"gen": g, "rng": RngState.capture()})
    assert tensorcanon.verify(data).startswith("xxh3-128:")
    meta = tensorcanon.read_metadata(data)
    assert _draw(meta["gen"]) == _draw(g)


# --------------------------------------------------------------------------- RngState


def _draw_all():
    return (random.random(), np.random.rand(), np.random.standard_normal(), torch.rand(3).tolist())


def test_capture_draw_restore_draw():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached gauss is part of the numpy state
    state = RngState.capture()
    first = _draw_all()
    state.restore()
    assert _draw_all() == first
    assert RngState.capture() != state


def test_rng_state_round_trip_and_stable_digest():
    torch.manual_seed(5)
    state = RngState.capture()
    assert RngState.capture() == state
    data = tensorcanon.dumps({"rng": state})
    loaded = tensorcanon.loads(data)["rng"]
    assert loaded == state and tensorcanon.dumps({"rng": loaded}) == data
    assert tensorcanon.fingerprint({"rng": state}) == tensorcanon.fingerprint({"rng": loaded})
    first = _draw_all()
    loaded.restore()
    assert _draw_all() == first
    assert "torch_cpu=5056 bytes" in repr(state)


def test_rng_state_restored_in_another_process(tmp_path):
    path = tmp_path / "rng.safetensors"
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    tensorcanon.save({"rng": RngState.capture()}, path)
    expected = repr(_draw_all())
    code = ("import sys, random, numpy as np, torch, tensorcanon;"
            "tensorcanon.load(sys.argv[1])['rng'].restore();"
            "print(repr((random.random(), np.random.rand(), np.random.standard_normal(), torch.rand(3).tolist())))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_restore_raises_when_devices_are_missing():
    state = RngState.capture()
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fake = RngState(state.python, state.numpy, state.torch_cpu, cuda=(bytes(16),) * (have + 8))
    snapshot = RngState.capture()
    with pytest.raises(RngRestoreError, match=f"{have + 8} cuda generator"):
        fake.restore()
    assert RngState.capture() == snapshot  # nothing was changed
    with pytest.warns(RngRestoreWarning, match="cuda"):
        fake.restore(strict=False)
    assert RngState.capture().torch_cpu == state.torch_cpu  # the rest was restored


def test_restore_refuses_other_numpy_bit_generator():
    state = RngState.capture()
    name, fields = "PCG64", (1, 1, 0, 0)
    fake = RngState(state.python, (name, fields, 0, 0.0), state.torch_cpu)
    with pytest.raises(RngRestoreError, match="PCG64"):
        fake.restore()


# --------------------------------------------------------------------------- validation


def _bad(node):
    """Decode one hand-made node with the library's decoder and return the error."""
    from tensorcanon.format.tree import Decoder

    with pytest.raises(FormatError) as e:
        Decoder([], 64).decode(["dict", "g", node])
    return str(e.value)


def test_decoder_validates_every_field():
    good_cpu = ["rng.torch", "cpu", bytes(torch.Generator().get_state().numpy())]
    from tensorcanon.format.tree import Decoder
    assert isinstance(Decoder([], 64).decode(good_cpu), torch.Generator)

    assert "5056 bytes" in _bad(["rng.torch", "cpu", b"\x00" * 10])
    assert "device" in _bad(["rng.torch", "tpu", b""])
    assert "canonical" in _bad(["rng.torch", "cuda", b"\x00" * 16])
    assert "takes 2 values" in _bad(["rng.torch", "cpu"])
    msg = _bad(["rng.bitgen", "os.system", None, 1])
    assert "not one of" in msg and '$["g"]' in msg
    assert "state.inc" in _bad(["rng.bitgen", "PCG64", None, 1, msgpack.ExtType(1, b"\x01" + bytes(16)), 0, 0])
    assert "needs a seed sequence" in _bad(["rng.bitgen", "PCG64", None, 1, 1, 0, 0])
    assert "has_uint32" in _bad(["rng.bitgen", "SFC64", ["tuple", 1, ["tuple"], 4, 0], bytes(32), 2, 0])
    assert "state.key" in _bad(["rng.bitgen", "MT19937", None, bytes(10), 0])
    assert "state.pos" in _bad(["rng.bitgen", "MT19937", None, bytes(2496), 625])
    assert "pool_size" in _bad(["rng.bitgen", "SFC64", ["tuple", 1, ["tuple"], 2, 0], bytes(32), 0, 0])
    assert "entropy" in _bad(["rng.bitgen", "SFC64", ["tuple", -1, ["tuple"], 4, 0], bytes(32), 0, 0])
    assert "rng.bitgen" in _bad(["rng.numpy", ["dict"]])
    assert "has_gauss" in _bad(["rng.legacy", 2, 0.0, ["rng.bitgen", "MT19937", None, bytes(2496), 0]])
    # numpy clears the cached Gaussian when it uses it, so no saved state has has_gauss 0 with a value
    assert "must have gauss 0.0" in _bad(["rng.legacy", 0, 1.5, ["rng.bitgen", "MT19937", None, bytes(2496), 0]])
    assert "must have gauss 0.0" in _bad(["rng.legacy", 0, -0.0, ["rng.bitgen", "MT19937", None, bytes(2496), 0]])
    assert "version must be 3" in _bad(["rng.random", 2, bytes(2496), 0, None])
    assert "position" in _bad(["rng.random", 3, bytes(2496), 700, None])
    assert "gauss_next" in _bad(["rng.random", 3, bytes(2496), 0, 1])
    assert "6 values" in _bad(["rng.state"])


def test_unsupported_generators_are_refused():
    class MyBitGen(np.random.PCG64):
        pass

    with pytest.raises(tensorcanon.UnsupportedTypeError, match="MyBitGen"):
        tensorcanon.dumps(np.random.Generator(MyBitGen(1)))
    with pytest.raises(tensorcanon.UnsupportedTypeError):
        tensorcanon.dumps(random.SystemRandom())


def test_digest_covers_generator_state():
    g = torch.Generator().manual_seed(1)
    before = tensorcanon.fingerprint({"g": g})
    assert tensorcanon.fingerprint({"g": torch.Generator().manual_seed(1)}) == before
    torch.rand(1, generator=g)
    assert tensorcanon.fingerprint({"g": g}) != before


# --------------------------------------------------------------------------- CUDA


@requires_cuda
def test_cuda_generator_round_trip_to_its_device():
    dev = f"cuda:{torch.cuda.device_count() - 1}"
    g = torch.Generator(device=dev).manual_seed(5)
    torch.rand(10, generator=g, device=dev)
    loaded = tensorcanon.loads(tensorcanon.dumps(g))
    assert str(loaded.device) == dev
    assert torch.equal(torch.rand(8, generator=loaded, device=dev), torch.rand(8, generator=g, device=dev))


@requires_cuda
def test_cuda_rng_state_capture_restore():
    torch.cuda.manual_seed_all(3)
    state = RngState.capture()
    assert len(state.cuda) == torch.cuda.device_count()
    first = [torch.rand(4, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    loaded = tensorcanon.loads(tensorcanon.dumps(state))
    loaded.restore()
    again = [torch.rand(4, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_cuda_generator_on_cpu_machine_names_device():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    node = ["dict", "g", ["rng.torch", "cuda:0", bytes(16)]]
    from tensorcanon.format.tree import Decoder

    with pytest.raises(tensorcanon.DeviceUnavailableError, match=r'cuda:0.*\$\["g"\]|\$\["g"\].*cuda:0'):
        Decoder([], 64).decode(node)
    Decoder([], 64, build_objects=False).decode(node)  # verify checks structure only
