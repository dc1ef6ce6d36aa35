"""Run one script under several compiled forms of the kernels (an integer-dot form forced by
COLIBRI_IDOT, a tile form by COLIBRI_TILES), each in its own process, all at once, and return
what each printed and saved: the tests compare the forms' bits.

Each form compiles into its own numba cache without being told: colibri's cache directory ends
in a digest of the kernel sources and of those variables (colibri/kernels/__init__.py). The form
this process runs gets this process's environment unchanged, so it loads the kernels the suite
has compiled already instead of compiling them again (compiling every form afresh, one after
the other, took ~9 of CI's minutes). Where NUMBA_CACHE_DIR is set, colibri uses it as it is, without the digest; then each
form gets a directory of its own under tmp_path.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_in_forms(tmp_path: Path, script: str, args: tuple[str, ...], variable: str, forms: tuple[str, ...],
                 own: str, timeout: float = 900) -> dict[str, tuple[str, np.ndarray]]:
    """`python -c script OUT.npy *args` once per value of `variable` in `forms` (`own`: the form
    this process compiled), at once; {form: (its stdout stripped, the array it saved)}."""
    procs = {}
    for form in forms:
        env = dict(os.environ)
        if env.get(variable, own) != form:  # this process's own form keeps its environment, so its cache
            env[variable] = form
        if "NUMBA_CACHE_DIR" in os.environ:
            env["NUMBA_CACHE_DIR"] = str(tmp_path / f"cache-{form}")
        out = tmp_path / f"{form}.npy"
        procs[form] = (out, subprocess.Popen([sys.executable, "-c", script, str(out), *args], env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    try:
        for form, (out, p) in procs.items():
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"{variable}={form}:\n{stderr[-2000:]}"
            results[form] = (stdout.strip(), np.load(out))
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
