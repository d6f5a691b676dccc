"""tensorcanon: deterministic, verifiable tensor serialization without pickle.

The same content always gives the same bytes and the same digest. Files are
valid safetensors files; the format is specified in docs/FORMAT.md.

Example::

    import tensorcanon
    digest = tensorcanon.save({"model": model.state_dict()}, "ckpt.safetensors")
    ckpt = tensorcanon.load("ckpt.safetensors")
    assert tensorcanon.verify("ckpt.safetensors") == digest
"""

from .api import dumps, fingerprint, load, loads, read_metadata, save, verify
from .codecs import register_all as register_builtin_codecs
from .data import ResumableSampler, SamplerStateError, seed_worker
from .determinism import DeterminismSettings, seed_everything
from .diff import DiffResult, diff
from .errors import (
    DeviceUnavailableError,
    FileAccessError,
    FormatError,
    IntegrityError,
    LimitError,
    MissingFileError,
    TensorCanonError,
    UnsupportedAlgorithmError,
    UnsupportedTypeError,
    UsageError,
)
from .lazy import LazyFile, open
from .limits import Limits
from .manifest import VERSION as FORMAT_VERSION
from .registry import register, unregister
from .rng import RngRestoreError, RngState  # importing rng registers the generator tags
from .seeded import SeededCollator, SeededDataset

__version__ = "0.1.0"

__all__ = [
    "save", "load", "dumps", "loads", "fingerprint", "verify", "read_metadata",
    "open", "LazyFile",
    "diff", "DiffResult",
    "register", "unregister", "register_builtin_codecs", "Limits", "FORMAT_VERSION",
    "TensorCanonError", "FormatError", "LimitError", "IntegrityError",
    "UnsupportedTypeError", "DeviceUnavailableError", "UnsupportedAlgorithmError", "UsageError",
    "FileAccessError", "MissingFileError",
    "RngState", "RngRestoreError", "seed_everything", "DeterminismSettings",
    "seed_worker", "ResumableSampler", "SamplerStateError", "SeededDataset", "SeededCollator",
]
