"""PerRank: a value that each rank saves and gets back as its own."""

from __future__ import annotations

from typing import Any

from ..format.errors import UsageError


class PerRank:
    """Marks per-rank state (an RNG state, a rank's sampler position) in a state dict.

    A value in a state dict is normally the same on every rank (or a shard of one
    tensor) and is saved once. Wrapped in ``PerRank`` it is saved by every rank in
    that rank's own file, and each rank gets its own value back on load.

    ``PerRank`` values must be values of a dict (or OrderedDict) reached from the
    state through dicts and lists. They are not part of the logical state: the
    logical digest and ``consolidate`` leave them out. Loading them with another
    world size than the save's raises an error naming the key, unless
    ``keep_per_rank_on_resize=True`` is passed (the values in the state dict are
    then kept as they are).

    Example::

        state = {"model": model_sd, "rng": tensorcanon.dcp.PerRank(tensorcanon.RngState.capture())}
        tensorcanon.dcp.save(state, "ckpt/step100")
        tensorcanon.dcp.load(state, "ckpt/step100")
        state["rng"].value.restore()      # this rank's own generator states
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        if type(value) is PerRank:
            raise UsageError("PerRank(PerRank(...)): wrap the value once")
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"

    # picklable: async_save's process executor sends the state to a child
    def __reduce__(self) -> tuple[type[PerRank], tuple[Any]]:
        return (PerRank, (self.value,))
