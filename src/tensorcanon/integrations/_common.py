"""What the framework integrations share: finding the sampler, checking saveability,
restoring settings. Imports no framework."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..format.errors import UnsupportedTypeError
from ..format.limits import DEFAULT, Limits
from ..io.placement import device_exists
from ..training.data import ResumableSampler
from ..training.determinism import DeterminismSettings, DeterminismWarning


@contextlib.contextmanager
def framework_import(extra: str, *packages: str) -> Iterator[None]:
    """Around an integration's framework imports: a missing ``packages`` raises a
    ``ModuleNotFoundError`` that says which extra installs it; other import errors pass unchanged."""
    try:
        yield
    except ImportError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in packages:
            raise
        raise ModuleNotFoundError(
            f"tensorcanon.integrations.{extra} needs the {missing} package, which cannot be imported "
            f"({e}); install it with: pip install {missing} (the [{extra}] extra of tensorcanon)",
            name=e.name) from e


def sampler_of(loader: Any) -> ResumableSampler | None:
    """The :class:`ResumableSampler` a DataLoader draws from (directly or through its
    batch sampler, as accelerate builds it), or None."""
    for s in (getattr(loader, "sampler", None),
              getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(s, ResumableSampler):
            return s
    return None


def batch_size_of(loader: Any) -> int | None:
    """Samples per batch (per process) of a DataLoader, or None when it has no fixed size."""
    bs = getattr(loader, "batch_size", None)
    if bs is None:
        bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return bs if type(bs) is int and bs > 0 else None


def check_saveable(obj: Any, what: str, limits: Limits = DEFAULT) -> None:
    """Raise :class:`UnsupportedTypeError` now if ``obj`` could not be saved.

    Plans the file without hashing or copying any tensor, so it costs little even
    for a large model. ``what`` names the object in the message.
    """
    from ..io.writer import plan

    try:
        plan(obj, None, limits)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"{what} could not be saved by tensorcanon: {e}",
                                   path=e.path) from None


def apply_settings(saved: DeterminismSettings, apply: bool) -> None:
    """Put back the saved determinism switches (when ``apply``) and warn, one
    :class:`DeterminismWarning` each, about what still differs from the saved run."""
    differences = saved.apply() if apply else saved.compare()
    for d in differences:
        warnings.warn(f"resumed run differs from the saved one: {d}", DeterminismWarning, stacklevel=3)


def cpu_when_missing(tensor: torch.Tensor, recorded: str) -> torch.Tensor | None:
    """``map_location`` callable: tensors recorded on a device this machine lacks go to
    the CPU (as Lightning's and accelerate's loaders do); the others keep their device."""
    return None if device_exists(torch.device(recorded)) else tensor
