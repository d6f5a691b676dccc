"""Training state: random state values, determinism settings, data order, seeded datasets.

Above :mod:`tensorcanon.format` and :mod:`tensorcanon.io` (docs/ARCHITECTURE.md).
"""
