"""``tensorcanon.testing``, the documented import path of :mod:`tensorcanon.tools.testing`."""

from .tools.testing import assert_deterministic, assert_identical

__all__ = ["assert_identical", "assert_deterministic"]
