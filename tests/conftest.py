"""Fixtures only: helpers that test modules import live in support.py."""

import pytest


@pytest.fixture
def keep_determinism_settings():
    """For tests that call seed_everything: put the process-wide switches and the
    environment variables it sets back afterwards, so later tests see the defaults."""
    import os

    import tensorcanon

    saved = tensorcanon.DeterminismSettings.capture()
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")}
    yield
    saved.apply()
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def builtin_codecs_left_off():
    """The built-in codecs are off in a fresh process; a test (or a golden vector) that turns them
    on must not change what later tests see, so they are turned off again after each test."""
    from tensorcanon import codecs, registry

    before = {name for name in codecs.NAMES if registry.by_name(name) is not None}
    yield
    for name in codecs.NAMES:
        reg = registry.by_name(name)
        if reg is not None and name not in before:
            registry.unregister(reg.cls)
