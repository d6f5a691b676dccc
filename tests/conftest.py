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


def torch_dtype(name: str) -> torch.dtype:
    """``torch.<name>``, or skip the calling test where the running torch lacks that dtype (the
    floor, torch 2.4, has no float8_e8m0fnu, float4_e2m1fn_x2 or int1..int7)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"torch {torch.__version__} has no torch.{name} (a later torch added it)")
    return dtype


def torch_dtypes(*names: str) -> list:
    """The named torch dtypes that the running torch has (for random sampling, where a dtype
    missing from an older torch is left out rather than skipping the whole test)."""
    return [d for d in (getattr(torch, n, None) for n in names) if isinstance(d, torch.dtype)]
