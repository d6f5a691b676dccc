import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
