"""Seeding and the settings that change numerical results.

:func:`seed_everything` applies the complete seeding recipe;
:class:`DeterminismSettings` records the switches, versions and hardware that
decide whether a resumed run can reproduce the original, and :meth:`compare`
says what differs. Settings save canonically as the registered type
``"tensorcanon.DeterminismSettings"``. docs/RNG.md is the user guide.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..format import optional, registry
from ..format.errors import UnsupportedTypeError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())  # imported on first use: a file holding settings loads without it

__all__ = ["seed_everything", "DeterminismSettings", "SettingDifference", "DeterminismWarning"]

CUBLAS_DETERMINISTIC = ":4096:8"


class DeterminismWarning(UserWarning):
    """A determinism setting could not take effect (e.g. set after CUDA started)."""


# PYTHONHASHSEED as this interpreter found it, read when tensorcanon is imported: seed_everything
# sets the variable later, for child processes, but the interpreter's own hashing never changes.
_STARTUP_HASHSEED = os.environ.get("PYTHONHASHSEED")
_hashseed_warned = False  # seed_everything warns about randomized str hashes once per process


def _interpreter_hashseed() -> str | None:
    """The PYTHONHASHSEED that applies to this interpreter: ``"0"`` when str hashing is not
    randomized, the value it started with when that fixes the hashes (or says ``"random"``),
    None when hashes are randomized because it was not set."""
    if not sys.flags.hash_randomization:
        return "0"
    if sys.flags.ignore_environment:  # python -E: the variable was never read
        return None
    # "0" with randomized hashing means the variable was set after start-up (before tensorcanon
    # was imported): it does not apply.
    return None if _STARTUP_HASHSEED == "0" else _STARTUP_HASHSEED


def randomized(hashseed: str | None) -> bool:
    """Whether a recorded ``pythonhashseed`` means str hashes were randomized (nil, ``""`` or
    ``"random"``): each process then hashes differently, so there is no order to match."""
    return hashseed in (None, "", "random")


def _hashes_randomized() -> bool:
    return randomized(_interpreter_hashseed())


def seed_everything(seed: int, *, deterministic: bool = True, warn_only: bool = False) -> int:
    """Seed every generator and (by default) switch torch to deterministic algorithms.

    Seeds Python's ``random``, numpy's global generator, torch's CPU generator
    and every CUDA device (also MPS/XPU, through ``torch.manual_seed``). With
    ``deterministic=True`` it also calls
    ``torch.use_deterministic_algorithms(True, warn_only=warn_only)``, sets
    ``cudnn.deterministic=True`` and ``cudnn.benchmark=False``, and sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless already set (warning when CUDA
    has already initialized, since cuBLAS reads it at start-up).

    PYTHONHASHSEED only takes effect when an interpreter starts: when it is
    not set, this sets it for child processes started later. When this
    process's own ``str`` hashes are randomized (it started without a fixed
    PYTHONHASHSEED) it warns once per process. Returns ``seed``.

    Example::

        seed = tensorcanon.seed_everything(1234)
    """
    if type(seed) is not int or not 0 <= seed <= 2**32 - 1:
        raise UsageError(f"seed must be an int in [0, 2**32-1] (numpy's range), got {seed!r}")
    if deterministic:
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                warnings.warn(
                    "CUBLAS_WORKSPACE_CONFIG was set after CUDA initialized, so cuBLAS may ignore it; "
                    "call seed_everything before any CUDA work, or export CUBLAS_WORKSPACE_CONFIG=:4096:8",
                    DeterminismWarning, stacklevel=2)
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if os.environ.get("PYTHONHASHSEED") in (None, "", "random"):
        os.environ["PYTHONHASHSEED"] = str(seed)
    global _hashseed_warned
    if not _hashseed_warned and _hashes_randomized():
        _hashseed_warned = True
        warnings.warn(  # one short line, once per process (a demo or every run under repro says it)
            f"PYTHONHASHSEED only takes effect at start-up: start Python with "
            f"PYTHONHASHSEED={os.environ['PYTHONHASHSEED']} to fix this process's set order too",
            DeterminismWarning, stacklevel=2)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA (lazily), MPS and XPU
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


class SettingDifference(NamedTuple):
    """One setting that differs between a saved run and now."""

    field: str
    saved: Any
    current: Any
    why: str

    def __str__(self) -> str:
        return f"{self.field}: saved {self.saved!r}, now {self.current!r} ({self.why})"


_WHY = {
    "deterministic_algorithms": "nondeterministic kernels may be chosen",
    "deterministic_warn_only": "nondeterministic ops warn instead of raising",
    "cudnn_deterministic": "cuDNN may pick nondeterministic algorithms",
    "cudnn_benchmark": "cuDNN autotuning may pick other algorithms",
    "cudnn_allow_tf32": "convolutions round to TF32 or not",
    "cuda_matmul_allow_tf32": "matmuls round to TF32 or not",
    "float32_matmul_precision": "float32 matmuls use another precision",
    "cublas_workspace_config": "cuBLAS reductions may be nondeterministic",
    "pythonhashseed": "str hashes and set order differ",
    "num_threads": "CPU reductions split work differently",
    "torch_version": "kernels and generators may differ",
    "numpy_version": "numpy algorithms may differ",
    "cuda_version": "CUDA libraries may give other numbers",
    "cudnn_version": "cuDNN kernels may give other numbers",
    "machine": "another CPU architecture may round differently",
    "gpu_names": "another GPU model gives other numbers",
    "gpu_sm_counts": "the CUDA Philox offset advance depends on the SM count: same state, other numbers",
}


@dataclass(frozen=True)
class DeterminismSettings:
    """What, besides the random state, decides whether a run reproduces.

    Example::

        ckpt["settings"] = tensorcanon.DeterminismSettings.capture()
        ...
        for d in tensorcanon.load(path)["settings"].compare():
            print("differs:", d)
    """

    deterministic_algorithms: bool
    deterministic_warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cudnn_allow_tf32: bool
    cuda_matmul_allow_tf32: bool
    float32_matmul_precision: str
    cublas_workspace_config: str | None
    pythonhashseed: str | None
    num_threads: int
    torch_version: str
    numpy_version: str
    cuda_version: str | None
    cudnn_version: int | None
    machine: str
    gpu_names: tuple = ()
    gpu_sm_counts: tuple = ()

    def __post_init__(self) -> None:
        problem = settings_problem({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problem is not None:
            raise UsageError(f"DeterminismSettings: {problem}")

    @classmethod
    def capture(cls) -> DeterminismSettings:
        """Record the current settings, versions and hardware."""
        names: tuple = ()
        sms: tuple = ()
        if torch.cuda.is_available():
            props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
            names = tuple(p.name for p in props)
            sms = tuple(int(p.multi_processor_count) for p in props)
        return cls(
            deterministic_algorithms=bool(torch.are_deterministic_algorithms_enabled()),
            deterministic_warn_only=bool(torch.is_deterministic_algorithms_warn_only_enabled()),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
            cuda_matmul_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
            float32_matmul_precision=str(torch.get_float32_matmul_precision()),
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            pythonhashseed=_interpreter_hashseed(),
            num_threads=int(torch.get_num_threads()),
            torch_version=str(torch.__version__),
            numpy_version=str(np.__version__),
            cuda_version=torch.version.cuda,
            cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            machine=platform.machine(),
            gpu_names=names,
            gpu_sm_counts=sms,
        )

    def compare(self, current: DeterminismSettings | None = None) -> list[SettingDifference]:
        """The settings that differ between ``self`` (saved) and ``current`` (default: now).

        An empty list means nothing recorded differs. Each item names the
        field, both values and why it matters; ``str(item)`` reads as a sentence.
        ``pythonhashseed`` differs only when the saved run's str hashes were fixed: a
        run whose hashes were randomized (saved None) had an order no process can
        repeat, so a resume with any hash seed is as faithful as one can be.
        """
        if current is None:
            current = DeterminismSettings.capture()
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(current, f.name)
            if f.name == "pythonhashseed" and randomized(a):
                continue  # nothing to match: the saved run's own hash order was random
            if a != b:
                out.append(SettingDifference(f.name, a, b, _WHY[f.name]))
        return out

    def apply(self) -> list[SettingDifference]:
        """Apply the switches that can change inside a running process.

        Sets deterministic algorithms (and warn_only), the cuDNN flags, TF32,
        float32 matmul precision, the thread count and CUBLAS_WORKSPACE_CONFIG
        (effective only before CUDA starts). Returns what still differs
        afterwards (versions, hardware, PYTHONHASHSEED).
        """
        torch.use_deterministic_algorithms(self.deterministic_algorithms,
                                           warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.cuda_matmul_allow_tf32
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        torch.set_num_threads(self.num_threads)
        if self.cublas_workspace_config is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config
        return self.compare()


_TYPES: dict[type | tuple[type, None], tuple[str, ...]] = {  # (T, None): T or None
    bool: ("deterministic_algorithms", "deterministic_warn_only", "cudnn_deterministic",
           "cudnn_benchmark", "cudnn_allow_tf32", "cuda_matmul_allow_tf32"),
    str: ("float32_matmul_precision", "torch_version", "numpy_version", "machine"),
    (str, None): ("cublas_workspace_config", "pythonhashseed", "cuda_version"),
    (int, None): ("cudnn_version",),
    int: ("num_threads",),
}
_WANT = {bool: "a bool", str: "a str", (str, None): "a str or None", (int, None): "an int (not a bool) or None",
         int: "an int (not a bool)"}
_FIELD_NAMES = {f.name for f in dataclasses.fields(DeterminismSettings)}


PRECISIONS = ("highest", "high", "medium")  # what torch.get_float32_matmul_precision() returns


def settings_problem(state: Any) -> str | None:
    """What keeps ``state`` (field name -> value) from being a DeterminismSettings, or None.

    docs/FORMAT.md §6.7.2. The one check: the constructor, the writer and the reader all use it,
    so what can be built can be saved and what is saved loads.
    """
    if type(state) is not dict or set(state) != _FIELD_NAMES:
        return f"expected exactly the fields {sorted(_FIELD_NAMES)}"
    for kind, names in _TYPES.items():
        for name in names:
            v = state[name]
            ok = (type(v) is kind) if isinstance(kind, type) else (v is None or type(v) is kind[0])
            if not ok:
                return f"field {name!r} must be {_WANT[kind]}, not {type(v).__name__}"
    if state["float32_matmul_precision"] not in PRECISIONS:
        return f"field 'float32_matmul_precision' must be one of {PRECISIONS}"
    names, sms = state["gpu_names"], state["gpu_sm_counts"]
    if type(names) is not tuple or not all(type(n) is str for n in names):
        return "field 'gpu_names' must be a tuple of str"
    if type(sms) is not tuple or not all(type(n) is int for n in sms) or len(sms) != len(names):
        return "field 'gpu_sm_counts' must be a tuple of ints, one per GPU of gpu_names"
    return None


def _encode(s: DeterminismSettings) -> dict:
    state = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    problem = settings_problem(state)  # (a frozen value can still be changed with object.__setattr__)
    if problem is not None:
        raise UnsupportedTypeError(f"DeterminismSettings cannot be saved: {problem}")
    return state


def _decode(state: Any) -> DeterminismSettings:
    problem = settings_problem(state)
    if problem is not None:
        raise ValueError(problem)
    return DeterminismSettings(**state)


registry.register(DeterminismSettings, name="tensorcanon.DeterminismSettings", encode=_encode, decode=_decode)
registry.specify("tensorcanon.DeterminismSettings", _decode)  # docs/FORMAT.md §6.7.2: verify checks it too
