"""Shared fixtures for the framework integration tests (Lightning, accelerate, transformers)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

# Nothing in these tests may reach the Hugging Face Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


class Unpickled(AssertionError):
    """Raised by the patched torch.load / pickle functions."""


@pytest.fixture
def no_unpickling(monkeypatch):
    """Make every way to unpickle raise: a load path that still uses one fails the test."""

    def refuse(*args, **kwargs):
        raise Unpickled("torch.load / pickle was called on the load path")

    class RefusingUnpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    yield


@pytest.fixture(autouse=True)
def _restore_determinism_settings(keep_determinism_settings):
    """The runs here seed and switch determinism on (seed_everything, resumed settings): put the
    process-wide switches back after each test (the fixture is in tests/conftest.py)."""
    yield
