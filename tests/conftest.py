"""Fixtures, and CI's guard against skipped tests; helpers that test modules import live in
support.py."""

import os

import pytest

# pytest imports readline when it starts (_pytest/capture.py), and GNU readline exports COLUMNS=80 and
# LINES=24 into the process's C environment where stdin is no terminal. os.environ does not show
# them, but pytest-xdist's workers (whose os.environ then holds them) and every process a test starts
# inherit them: the command line would wrap its output at 80 columns in a worker and not in a single
# process. Every test process gets the environment pytest was started with: take them out again.
for _name in ("COLUMNS", "LINES"):
    if _name not in os.environ:
        os.unsetenv(_name)

# With TENSORCANON_ONLY_CUDA_SKIPS=1 (.ci/run sets it), a test skipped for any reason but the lack
# of a CUDA device fails the run: a skipped test proves nothing, and the integration and
# distributed tests must run wherever CI runs.
# The one other: what the floors' torch (2.4) lacks, whose tests say "not tested on the floors" in their
# reason: torchao, whose releases follow torch's (tests/test_ecosystem_torchao.py), and the cached lengths
# a jagged tensor is given by hand (tests/test_lossless_kinds.py).
_ALLOWED_SKIP = ("CUDA", "not tested on the floors")
_skipped: list = []


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _skipped.append((report.nodeid, str(report.longrepr[2])))


def pytest_sessionfinish(session, exitstatus):
    # Under pytest-xdist the controller sees every worker's reports (pytest_runtest_logreport) and
    # decides the exit status; a worker's own verdict would be lost, so only the controller judges.
    if os.environ.get("TENSORCANON_ONLY_CUDA_SKIPS") != "1" or hasattr(session.config, "workerinput"):
        return
    bad = [(node, why) for node, why in _skipped if not any(a in why for a in _ALLOWED_SKIP)]
    if bad:
        lines = "\n".join(f"  {node}: {why}" for node, why in bad)
        print(f"\n{len(bad)} tests skipped for a reason other than a missing CUDA device (a skipped "
              f"test proves nothing; make them run here):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The slow tier: tests that start processes (training frameworks, process groups, torchrun, fresh
# interpreters, benchmarks, an S3 server). The README's command and CI run every tier;
# `pytest -m "not slow"` runs the fast, in-process one.
_SLOW_FILES = ("tests/integrations/", "tests/dcp/test_spawned.py", "tests/dcp/test_docs_examples.py",
               "tests/dcp/test_bench_smoke.py", "tests/dcp/test_fsdp.py", "tests/test_benchmarks_smoke.py",
               "tests/test_demo.py", "tests/test_processes.py", "tests/test_crash.py", "tests/test_remote_s3.py",
               "tests/dcp/test_remote_dcp.py", "tests/test_light.py",
               "tests/attacks/test_storage_attacks.py", "tests/test_ecosystem_torchao.py")
_SLOW_NAMES = ("fresh_process", "across_processes", "in_a_subprocess", "in_fresh_processes")


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath)
    for item in items:
        where = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if where.startswith(_SLOW_FILES) or any(n in item.name for n in _SLOW_NAMES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def cli_inputs(tmp_path, monkeypatch):
    """A copy of tests/cli/inputs (the command line's committed input files) as the working folder, with
    COLUMNS unset (the command line's output at its default width)."""
    import shutil

    folder = tmp_path / "inputs"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "cli", "inputs"), folder)
    monkeypatch.chdir(folder)
    monkeypatch.delenv("COLUMNS", raising=False)
    return folder


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server on 127.0.0.1 for the session, and a fault-injecting proxy in front of it:
    ``(server port, s3_support.Proxy)``, with the bucket s3_support.BUCKET made."""
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer
    from s3_support import BUCKET, Proxy, options

    from support import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = Proxy(port)
    s3fs.S3FileSystem(**options(port)).call_s3("create_bucket", Bucket=BUCKET)
    yield port, proxy
    proxy.server.shutdown()
    server.stop()


@pytest.fixture
def s3_direct(s3_server, monkeypatch):
    """``(storage options reaching the S3 server directly, the proxy)`` for one test: the proxy's
    faults and counts reset before and after it, s3fs's own retries bounded (2: quick here)."""
    import s3fs
    from s3_support import options

    port, proxy = s3_server
    proxy.reset()
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    yield options(port), proxy
    proxy.reset()


@pytest.fixture
def no_unpickling():
    """torch.load and every way to unpickle raise for the whole test (support.no_unpickling): a load
    path that still uses one fails it."""
    from support import no_unpickling as refusing

    with refusing("during the test"):
        yield


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
    from tensorcanon import codecs
    from tensorcanon.format import registry

    before = {name for name in codecs.NAMES if registry.by_name(name) is not None}
    yield
    for name in codecs.NAMES:
        reg = registry.by_name(name)
        if reg is not None and name not in before:
            registry.unregister(reg.cls)


def pytest_configure(config):
    import logging

    # DCP logs every step (and every expected failure, with tracebacks) on its own loggers, in
    # tests/dcp and in the store's and the attacks' tests of sharded checkpoints alike
    logging.getLogger("dcp_logger").setLevel(logging.CRITICAL)
    logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.CRITICAL)
