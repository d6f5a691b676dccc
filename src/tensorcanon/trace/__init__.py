"""Canonical traces of training runs, and the first divergence between two (docs/TRACE.md)."""

from .compare import Divergence, first_divergence
from .recorder import Recorder, trace

__all__ = ["trace", "Recorder", "first_divergence", "Divergence"]
