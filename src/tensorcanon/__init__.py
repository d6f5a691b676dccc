"""tensorcanon: deterministic, verifiable tensor serialization without pickle.

The same content always gives the same bytes and the same digest. Files are
valid safetensors files; the format is specified in docs/FORMAT.md.

Example::

    import tensorcanon
    digest = tensorcanon.save({"model": model.state_dict()}, "ckpt.safetensors")
    ckpt = tensorcanon.load("ckpt.safetensors")
    assert tensorcanon.verify("ckpt.safetensors") == digest
"""

from typing import TYPE_CHECKING, Any

from .api import dumps, fingerprint, load, loads, read_metadata, save, verify
from .format import tensorkinds as _tensorkinds  # noqa: F401 - registers the tensor tags of FORMAT.md §6.12
from .format.codecs import register_all as register_builtin_codecs
from .format.errors import (
    DeviceUnavailableError,
    FileAccessError,
    FormatError,
    IntegrityError,
    LimitError,
    MissingDependencyError,
    MissingFileError,
    TensorCanonError,
    UnsupportedAlgorithmError,
    UnsupportedTypeError,
    UsageError,
)
from .format.limits import Limits
from .format.manifest import VERSION as FORMAT_VERSION
from .format.registry import register, unregister
from .tools.diff import DiffResult, diff
from .trace import first_divergence, trace
from .training.determinism import DeterminismSettings, seed_everything  # (registers DeterminismSettings)
from .training.rng import RngRestoreError, RngState  # importing rng registers the generator tags

if TYPE_CHECKING:
    from .io.lazy import LazyFile, open
    from .training.data import ResumableSampler, SamplerStateError, seed_worker
    from .training.seeded import SeededCollator, SeededDataset

__version__ = "0.4.0.dev0"  # the next release, 0.4.0, in development (CHANGELOG.md says how versions are numbered)

__all__ = [
    "save", "load", "dumps", "loads", "fingerprint", "verify", "read_metadata",
    "open", "LazyFile",
    "diff", "DiffResult", "Store",
    "trace", "first_divergence",
    "register", "unregister", "register_builtin_codecs", "Limits", "FORMAT_VERSION",
    "TensorCanonError", "FormatError", "LimitError", "IntegrityError",
    "UnsupportedTypeError", "DeviceUnavailableError", "UnsupportedAlgorithmError", "UsageError",
    "FileAccessError", "MissingFileError", "MissingDependencyError",
    "RngState", "RngRestoreError", "seed_everything", "DeterminismSettings",
    "seed_worker", "ResumableSampler", "SamplerStateError", "SeededDataset", "SeededCollator",
]

# Imported on first use, so that ``import tensorcanon`` (and the commands that only read files)
# never import torch: the data-loading classes subclass torch's; open is only needed when used.
# Name -> the module that defines it.
_LAZY = {
    "ResumableSampler": "training.data", "SamplerStateError": "training.data", "seed_worker": "training.data",
    "SeededDataset": "training.seeded", "SeededCollator": "training.seeded",
    "open": "io.lazy", "LazyFile": "io.lazy",
    "Store": "store",  # a content-addressed store of many checkpoints (docs/STORE.md)
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    if module.startswith("training."):  # they subclass torch's classes: without torch, say what to install
        from .format import optional

        optional.load()
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
