"""Skips for a missing requirement (the embedded SmolLM2 model, tmux, Chromium, the console
script): with COLIBRI_REQUIRE=1 (CI sets it in .ci/run) each is a failure instead, so a run that
could not install something fails loudly rather than passing having tested less.

    from requirements import missing, needs
    if shutil.which("tmux") is None:
        missing("tmux is not installed")
    @needs(shutil.which("tmux") is not None, "tmux is not installed")   # as a decorator

tests/ is on sys.path through its conftest.py, so any test module imports it as `requirements`."""
from __future__ import annotations

import functools
import os

import pytest

ENV = "COLIBRI_REQUIRE"


def required() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def missing(reason: str):
    """Skip the running test (or fixture) for `reason`; under COLIBRI_REQUIRE=1 fail it."""
    if required():
        pytest.fail(f"{ENV}=1 and a requirement is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def needs(available: bool, reason: str):
    """A decorator: the test runs where `available`, else `missing(reason)`."""
    def wrap(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            if not available:
                missing(reason)
            return test(*args, **kwargs)
        return run
    return wrap
