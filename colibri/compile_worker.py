"""A process that compiles kernels into numba's on-disk cache, by signature, for the engine's
process (colibri.warmup): `python -m colibri.compile_worker`.

A first start has more to compile than one core does in the time a user waits (~30 s on 2
cores for SmolLM2), and numba compiles one function at a time per process. This process takes
the kernels the first answer needs besides the prefill's, compiles them while the engine's
process compiles the prefill's, then the rest (the whole-token decode, the long-prompt tiles)
while the engine answers. numba's cache is a file cache: what this process saves, the engine
loads at its first call (colibri.kernels.cache_lock keeps two processes' saves apart).

Protocol (COLIBRI_WORKER_CACHE_DIR: the engine's numba cache directory; stdin, stdout; pickles
framed by an 8-byte length, colibri.warmup.write_frame):
- in: {"groups": [(group name, [(kernel "module.qualname", numba signature), ...]), ...],
  "marker": path or None, "nice": int, "claims": {group name: folder}}, then, once the engine's
  own warm-up is over, a list of the kernel names it used, or end of input if it stopped before;
- out, one line each: "compiling" at the first real compile (a cache miss), "done GROUP" after
  each group, "failed KERNEL: why" for a kernel it could not compile (the engine's process then
  compiles it at its first call).
A group named in "claims" is shared with the engine's process, which compiles its jobs from the
last one back: each job goes to whichever process creates its file in that folder first.
This process lowers its priority (`nice`) once the first group is done (the rest yields to the
engine's answers), and writes the warm-up marker (colibri.warmup) when every group is done and
the engine's list came, so a later start skips the warm-up. The engine may have exited by then:
this process does not need it, and ends when its work is done. COLIBRI_WARMUP_LOG=PATH appends
each compile as a JSON line (bench/engine/first_start.py reads them).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time


class _Out:
    """Lines to the engine's process; silently nothing once it has gone."""

    def __init__(self):
        self.ok = True

    def line(self, text: str) -> None:
        if not self.ok:
            return
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            self.ok = False


def _listen(out: _Out, log_path: str | None) -> None:
    """'compiling' at the first compile; each compile appended to log_path when given."""
    from numba.core import event

    stacks: dict = {}
    said = []

    class Listener(event.Listener):
        def on_start(self, ev):
            if not said:
                said.append(True)
                out.line("compiling")
            d = ev.data["dispatcher"]
            stacks.setdefault(threading.get_ident(), []).append(
                [f"{d.py_func.__module__}.{d.py_func.__qualname__}", time.time(), time.thread_time(), 0.0])

        def on_end(self, ev):
            st = stacks[threading.get_ident()]
            name, start, cpu0, nested = st.pop()
            cpu = time.thread_time() - cpu0
            if st:
                st[-1][3] += cpu
            if log_path:
                record = {"name": name, "args": str(ev.data["args"]), "start": start, "wall_s": time.time() - start,
                          "cpu_incl_s": cpu, "cpu_excl_s": cpu - nested, "depth": len(st), "pid": os.getpid()}
                try:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                except OSError:
                    pass

    event.register("numba:compile", Listener())


def main() -> int:
    stdin, out = sys.stdin.buffer, _Out()
    from numba.core import config

    # The engine's cache directory, exactly (kernels/__init__.py keeps a directory already set);
    # the kernels are imported before the work comes, while the engine still loads its model.
    config.CACHE_DIR = os.environ["COLIBRI_WORKER_CACHE_DIR"]
    from colibri.warmup import claim, kernel_dispatchers, read_frame, write_marker

    kernels = kernel_dispatchers()
    job = read_frame(stdin)
    if job is None:
        return 0
    _listen(out, os.environ.get("COLIBRI_WARMUP_LOG"))
    claims = job.get("claims", {})
    for i, (group, calls) in enumerate(job["groups"]):
        for k, (name, sig) in enumerate(calls):
            if group in claims and not claim(claims[group], k):  # the engine's process took it
                continue
            try:
                kernels[name].compile(sig)
            except Exception as e:  # noqa: BLE001 - the engine compiles it itself at its first call
                out.line(f"failed {name}: {' '.join(str(e).split())[:300]}")
        out.line(f"done {group}")
        if i == 0 and job.get("nice"):
            try:
                os.nice(job["nice"])
            except OSError:
                pass
    used = read_frame(stdin)  # the engine's own kernels, once its warm-up is over
    if used is not None and job.get("marker"):
        write_marker(job["marker"], set(used) | {n for n, d in kernels.items() if d.overloads})
    out.line("done all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
