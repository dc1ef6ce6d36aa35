"""Start-up of a model whose experts are all resident, as a chat user meets it: the time until
the prompt is ready, then (after the user has typed for --typing seconds) the time from enter
to the first token of a short answer, for the two ways Engine.load can treat the experts:
waited for (the default, shown) and loading in the background while the engine answers
(`experts_in_background=True`, what `colibri serve` does). Each run is a fresh process with the
page cache dropped first (as root; else warm, and said so); the two modes alternate, since
this VM's disk speed drifts. The CPU time each run spent in the kernel is printed too: on a VM
whose balloon reports free pages to the host (virtio-balloon free page reporting), memory
freed a while ago must be backed by the host again on first touch, which shows as tens of
seconds of kernel time in the first large run after a pause. Benchmark only: no asserts.

    python -m bench.engine.startup /work/qwen3-30b [--typing 5] [--runs 2] [--tokens 16] [--back-memory 18]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import add_json_arg, child_env, interleaved, machine_line, write_json

CHILD = """
import json, sys, threading, time
t0 = time.perf_counter()
from colibri.engine import Engine
model, background, typing, tokens = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]), int(sys.argv[4])
out = {}
def turn():  # on a thread of its own, as chat and serve generate
    e = Engine.load(model, experts_in_background=background, max_context=512)
    out["ready_s"] = time.perf_counter() - t0
    time.sleep(typing)
    g = e.generate([{"role": "user", "content": "Hello! What can you tell me about the printing press?"}],
                   max_tokens=tokens, stop_at_eos=False)
    out["ttft_s"] = g.ttft_s
    out["first_token_from_launch_s"] = out["ready_s"] + typing + g.ttft_s
    e.experts.wait()
    out["all_experts_in_s"] = time.perf_counter() - t0
t = threading.Thread(target=turn); t.start(); t.join()
import resource
ru = resource.getrusage(resource.RUSAGE_SELF)
out["user_s"], out["sys_s"] = ru.ru_utime, ru.ru_stime
print(json.dumps(out))
"""

BACK = """
import sys
from colibri.memory import huge_pages
huge_pages(int(sys.argv[1]), touch=True)
"""


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--typing", type=float, default=5.0, help="seconds between the prompt being ready and enter")
    ap.add_argument("--runs", type=int, default=2, help="runs of each mode")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--back-memory", type=float, default=0.0, metavar="GIB",
                    help="before each run, touch and free this much memory in a child process, so that a VM's "
                         "host backs it again first (the run then meets memory as a bare machine would)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet after dropping the page cache")
    add_json_arg(ap)
    a = ap.parse_args()
    env = child_env()
    print(machine_line())

    def once(background: bool) -> dict:
        if a.back_memory > 0:
            subprocess.run([sys.executable, "-c", BACK, str(int(a.back_memory * (1 << 30)))], check=True, env=env)
        cold = drop_caches()
        time.sleep(a.settle)
        r = subprocess.run([sys.executable, "-c", CHILD, a.model, "1" if background else "0", str(a.typing),
                            str(a.tokens)], capture_output=True, text=True, env=env, check=True)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        mode = "background" if background else "waited for"
        print(f"experts {mode:10} ({'cold' if cold else 'warm page cache'}): prompt ready {got['ready_s']:.1f} s, "
              f"first token {got['ttft_s']:.1f} s after enter, {got['first_token_from_launch_s']:.1f} s from "
              f"launch; every expert in at {got['all_experts_in_s']:.1f} s; CPU user {got['user_s']:.1f} s, "
              f"kernel {got['sys_s']:.1f} s", flush=True)
        return {"cold": cold, **got}

    runs = interleaved([True, False], a.runs, once)
    write_json(a.json, {"model": a.model, "background": runs[True], "waited_for": runs[False]}, args=a)


if __name__ == "__main__":
    main()
