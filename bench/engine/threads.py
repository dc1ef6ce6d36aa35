"""Decode tok/s against the kernel thread setting, with and without a competing CPU-bound process
(the README's threads table). Benchmark only: no asserts.

Every run is its own process (load the default SmolLM2 model, a 2-token warm-up generation,
then one greedy generation timed token by token), interleaved: for each repeat, each competitor
state, each setting. A competitor is `python -c "while True: pass"`, started before the run and
killed after it. Each row is the median over the repeats, with the range; the "background"
line is the CPU other processes (not the run, not the competitor) used meanwhile, in cores,
which tells how noisy the machine was.

    python -m bench.engine.threads [--repeats 3] [--tokens 96] [--competitors 0 1 2]
    python -m bench.engine.threads --setting "threads=2 NUMBA_THREADING_LAYER=workqueue" --setting default

A setting is `default` (Engine.load without threads=) or `threads=N`, optionally followed by
environment variables for that run (NUMBA_THREADING_LAYER=omp|workqueue|tbb, OMP_WAIT_POLICY=...).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from bench.common import add_json_arg, child_env, interleaved, machine_line, median, module_command, write_json

PROMPT = "Write a long story about a fox who learns to read."
HZ = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- child

def child(threads: int | None, tokens: int, max_s: float) -> dict:
    import numba

    from colibri import Engine

    e = Engine.load(threads=threads)
    e.generate(PROMPT, max_tokens=2)  # the first call's one-off costs (page faults, lazy set-up)
    e.reset()
    stamps = []
    for ev in e.stream(PROMPT, max_tokens=tokens, stop_at_eos=False):
        if ev.token_id is None:
            continue
        stamps.append(time.perf_counter())
        # A collapsed setting makes 3 tok/s: stop after max_s rather than wait a minute.
        if len(stamps) > 8 and stamps[-1] - stamps[0] > max_s:
            break
    return {"decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": len(stamps),
            # read in the thread that generated: numba's thread count is per-thread state
            "kernel_threads": numba.get_num_threads(), "layer": numba.threading_layer()}


# ----------------------------------------------------------------------------- parent

def busy_jiffies() -> int:
    """All cores' non-idle time since boot (USER_HZ ticks)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]  # guest is inside user
    return sum(f) - f[3] - f[4]  # minus idle, iowait


def proc_jiffies(pid: int) -> int:
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime + stime
    except OSError:
        return 0


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parse_setting(spec: str) -> tuple[int | None, dict]:
    threads, env = None, {}
    for word in spec.split():
        key, _, val = word.partition("=")
        if key == "threads":
            threads = int(val)
        elif key != "default":
            env[key] = val
    return threads, env


def wait_quiet(limit_s: float) -> float:
    """Wait (up to limit_s) for a half second in which the machine is idle, so that a run is not
    measured against someone else's burst; returns the busy cores last seen."""
    deadline = time.monotonic() + limit_s
    while True:
        b0, t0 = busy_jiffies(), time.monotonic()
        time.sleep(0.5)
        busy = (busy_jiffies() - b0) / HZ / (time.monotonic() - t0)
        if busy < 0.2 or time.monotonic() > deadline:
            return busy
        time.sleep(1.0)


def run_once(spec: str, competitors: int, a) -> dict | None:
    threads, env = parse_setting(spec)
    wait_quiet(a.quiet_wait)
    cmd = [*module_command(__spec__.name), "--child", "--tokens", str(a.tokens), "--max-s", str(a.max_s)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
    try:
        time.sleep(0.3 if hogs else 0)  # the competitor is running before the engine starts
        b0, c0, t0 = busy_jiffies(), children_cpu_s(), time.monotonic()
        h0 = sum(proc_jiffies(h.pid) for h in hogs)
        p = subprocess.run(cmd, capture_output=True, text=True, env=child_env({**os.environ, **env}), timeout=300)
        hog = sum(proc_jiffies(h.pid) for h in hogs) - h0
        wall = time.monotonic() - t0
        mine = (children_cpu_s() - c0) * HZ
        background = max(0.0, (busy_jiffies() - b0 - mine - hog) / HZ / wall)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if p.returncode != 0:
        print(f"{spec!r} failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["background_cores"] = background
    return r


def cpu_quota() -> str:
    quota = "none"
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            quota = open(path).read().strip()
            break
        except OSError:
            pass
    return quota


def machine_facts() -> str:
    import numba

    return (f"{machine_line()}\n# cgroup cpu quota {cpu_quota()}; NUMBA_NUM_THREADS {numba.config.NUMBA_NUM_THREADS}; "
            f"load average {os.getloadavg()[0]:.2f} at start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", help="default | 'threads=N [ENV=VALUE ...]' (repeatable)")
    ap.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2], help="busy processes per column")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--max-s", type=float, default=6.0, help="stop a run's decode after this long")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each run, wait up to this long for the machine to be idle")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    add_json_arg(ap)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.threads, a.tokens, a.max_s)))
        return

    cores = len(os.sched_getaffinity(0))
    settings = a.setting or [f"threads={n}" for n in sorted({1, cores})] + ["default"]
    print(machine_facts(), flush=True)

    def show(variant, i, r):
        if r:
            s, c = variant
            print(f"  repeat {i + 1}, {c} busy, {s}: {r['decode_tok_s']:.1f} tok/s "
                  f"({r['kernel_threads']} threads, {r['layer']}, "
                  f"background {r['background_cores']:.2f} cores)", flush=True)

    rows = interleaved([(s, c) for c in a.competitors for s in settings], a.repeats,
                       lambda v: run_once(v[0], v[1], a), on_result=show)
    print(f"\ndecode tok/s, SmolLM2-135M-Instruct, greedy, median of {a.repeats} interleaved runs (min-max); "
          "kernel threads used in brackets")
    head = " | ".join(f"{c} busy process{'es' if c != 1 else ''}" for c in a.competitors)
    print(f"| setting | {head} |")
    print("|---" * (len(a.competitors) + 1) + "|")
    for s in settings:
        cells = []
        for c in a.competitors:
            rs = rows[s, c]
            if not rs:
                cells.append("failed")
                continue
            v = [r["decode_tok_s"] for r in rs]
            used = "/".join(str(n) for n in sorted({r["kernel_threads"] for r in rs}))
            cells.append(f"{median(v):.1f} ({min(v):.0f}-{max(v):.0f}) [{used}]")
        print(f"| {s} | {' | '.join(cells)} |")
    layers = sorted({r["layer"] for rs in rows.values() for r in rs})
    print(f"threading layer(s) used: {', '.join(layers)}")
    for c in a.competitors:
        bg = [r["background_cores"] for s in settings for r in rows[s, c]]
        if bg:
            print(f"background CPU with {c} busy: median {median(bg):.2f} cores, max {max(bg):.2f}")
    write_json(a.json, {"machine_extra": {"cpu_quota": cpu_quota()},
                        "runs": [{"setting": s, "competitors": c, "runs": v} for (s, c), v in rows.items()]}, args=a)


if __name__ == "__main__":
    main()
