"""Reading every expert of a container into RAM, two ways, in fresh processes, alternating, page
cache dropped before each run (needs root for that; otherwise warm): "parallel" is what
colibri.io.experts.ResidentExperts does now (4 O_DIRECT readers), "serial" what it did before
(one buffered reader). Both allocate the same touched arena and verify every checksum.
Benchmark only: no asserts.

    python -m bench.io.resident_load /work/qwen3-30b [--runs 4]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import child_env, interleaved, machine_line, module_command


def child(model: str, mode: str) -> None:
    from colibri.io.container import Container
    from colibri.io.expert_store import arena

    c = Container(model)
    t0 = time.perf_counter()
    stores = {p: arena(l.num_experts * l.blob_bytes).reshape(l.num_experts, l.blob_bytes)
              for p, l in c.expert_layouts.items()}
    t_arena = time.perf_counter() - t0
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "parallel" else 0)
    fds = {p: os.open(c.expert_file(p).path, flags) for p in stores}

    def read(job):
        p, e = job
        _, offset, _ = c.expert_range(p, e)
        os.preadv(fds[p], [memoryview(stores[p][e])], offset)
        c.verify_expert(p, e, stores[p][e])

    jobs = [(p, e) for p, s in stores.items() for e in range(s.shape[0])]
    if mode == "parallel":
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(read, jobs))
    else:
        for job in jobs:
            read(job)
    total = time.perf_counter() - t0
    print(f"{mode:8} {total:6.1f} s (arena {t_arena:.1f} s), {c.expert_bytes / (total - t_arena) / 1e9:.2f} GB/s read",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=4, help="runs of each way")
    ap.add_argument("--child", choices=["parallel", "serial"])
    a = ap.parse_args()
    if a.child:
        child(a.model, a.child)
        return
    print(machine_line())

    def once(mode):  # the child prints its own row
        subprocess.run(["sync"])
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError:
            pass
        subprocess.run([*module_command(__spec__.name), a.model, "--child", mode], check=True, env=child_env())

    interleaved(["parallel", "serial"], a.runs, once, alternate=True)


if __name__ == "__main__":
    main()
