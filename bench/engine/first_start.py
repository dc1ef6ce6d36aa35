"""A first start as a new user meets it: `colibri run -n 4 "Hi"` with empty COLIBRI_HOME,
XDG_CACHE_HOME and numba cache, per CPU target (the host, and each --cpu NAME: numba compiles
for that LLVM CPU, NUMBA_CPU_NAME, e.g. haswell for an AVX2-only machine), then a cached start
in the same directories. Per run: the seconds from launch to the first token printed and to
the answer's end, CPU time (the engine's process and the compile process, colibri/compile_worker.py,
whose work the child waits for before it exits, so the cached start is cached), the figure the
progress message printed ("... done in N s"), the CPU seconds other processes took meanwhile (a
shared machine), and every numba compile (numba's "numba:compile" events, timed in the child;
the compile process logs its own, COLIBRI_WARMUP_LOG): the kernels compiled before the first
token and after it (in the background), in which process, with their seconds. Each run is a
fresh process in fresh directories; the targets alternate over --runs rounds. Benchmark only: no
asserts.

    python -m bench.engine.first_start [--cpu haswell] [--no-host] [--runs 1] [--top 15] [--json PATH]

Wrap it in `flock /tmp/bench.lock` on a shared machine: a first start is seconds of one or two
cores' work, and a neighbour's load shows in it directly.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import add_json_arg, child_env, interleaved, machine_line, median, named_cpu_env, write_json

# The child: colibri's CLI with a listener on numba's compile events and a clock on stdout. Each
# compile is recorded with its own seconds (inclusive) and those not spent in compiles nested
# in it (exclusive: a kernel calling another compiles the callee inside its own compile).
CHILD = r"""
import json, sys, threading, time
t0, t0_epoch = time.perf_counter(), time.time()
out_path, argv = sys.argv[1], sys.argv[2:]
from numba.core import event
records, stacks = [], {}
class Listener(event.Listener):
    def on_start(self, ev):
        d = ev.data["dispatcher"]
        stacks.setdefault(threading.get_ident(), []).append(
            [f"{d.py_func.__module__}.{d.py_func.__qualname__}", str(ev.data["args"]), time.perf_counter(), 0.0,
             time.thread_time(), 0.0])
    def on_end(self, ev):
        st = stacks[threading.get_ident()]
        name, args, start, nested, cpu0, cpu_nested = st.pop()
        took, cpu = time.perf_counter() - start, time.thread_time() - cpu0
        if st:
            st[-1][3] += took
            st[-1][5] += cpu
        records.append({"name": name, "args": args, "start_s": start - t0, "incl_s": took, "excl_s": took - nested,
                        "cpu_incl_s": cpu, "cpu_excl_s": cpu - cpu_nested,
                        "depth": len(st), "thread": threading.current_thread().name})
event.register("numba:compile", Listener())
first = []
write = sys.stdout.write
def timed_write(s):
    if s.strip() and not first:
        first.append(time.perf_counter() - t0)
    return write(s)
sys.stdout.write = timed_write
import resource
try:
    from colibri.cli import main
    sys.argv = ["colibri", *argv]
    main()
except SystemExit:
    pass
finally:
    end = time.perf_counter() - t0
    import colibri.warmup
    getattr(colibri.warmup, "finish", lambda: None)()  # the background compiles end here: counted
    ru = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_path, "w") as f:
        json.dump({"first_token_s": first[0] if first else None, "end_s": end, "exit_s": time.perf_counter() - t0,
                   "cpu_s": ru.ru_utime + ru.ru_stime, "worker_cpu_s": ch.ru_utime + ch.ru_stime,
                   "t0_epoch": t0_epoch, "compiles": records}, f)
"""

DONE = re.compile(r"(?:done in|compiled kernels for \S+ in) ([0-9.]+) s")


def fresh_env(root: Path, cpu: str | None) -> dict:
    """Empty COLIBRI_HOME and XDG_CACHE_HOME under `root`; numba's cache under the latter (no
    NUMBA_CACHE_DIR); NUMBA_CPU_NAME for a named target."""
    env = child_env()
    env["COLIBRI_HOME"] = str(root / "home")
    env["XDG_CACHE_HOME"] = str(root / "cache")
    for var in ("NUMBA_CACHE_DIR", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        env.pop(var, None)
    if cpu:
        env.update(named_cpu_env(cpu))
    return env


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores): /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields]
        return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def run_once(env: dict, argv: list[str], out: Path) -> dict:
    log = out.with_suffix(".worker.jsonl")
    env = {**env, "COLIBRI_WARMUP_LOG": str(log)}  # the compile process's compiles (colibri/compile_worker.py)
    t0, busy0 = time.perf_counter(), busy_seconds()
    r = subprocess.run([sys.executable, "-c", CHILD, str(out), *argv], capture_output=True, text=True, env=env)
    wall, busy = time.perf_counter() - t0, busy_seconds() - busy0
    if r.returncode != 0 or not out.exists():
        sys.stderr.write(r.stderr[-3000:])
        raise SystemExit(f"the child failed (exit {r.returncode})")
    got = json.loads(out.read_text())
    if log.exists():
        for line in log.read_text().splitlines():
            c = json.loads(line)
            got["compiles"].append({"name": c["name"], "args": c["args"], "start_s": c["start"] - got["t0_epoch"],
                                    "incl_s": c["wall_s"], "excl_s": c["wall_s"], "cpu_incl_s": c["cpu_incl_s"],
                                    "cpu_excl_s": c["cpu_excl_s"], "depth": c["depth"], "thread": "compile process"})
    m = DONE.search(r.stderr)
    # what other processes took of the machine meanwhile (a shared machine: their load shows in the figures)
    others = busy - got["cpu_s"] - got["worker_cpu_s"]
    got.update(wall_s=wall, printed_s=float(m.group(1)) if m else None, answer=r.stdout.strip(),
               stderr=r.stderr.strip(), others_cpu_s=others)
    return got


def compile_cpu(run: dict, before: bool, where: str) -> float:
    """CPU seconds of the top-level compiles started before (or after) the first token, in this
    process ("here") or the compile process ("process")."""
    ft = run["first_token_s"] or float("inf")
    return sum(c["cpu_incl_s"] for c in run["compiles"] if c["depth"] == 0 and (c["start_s"] < ft) == before
               and (c["thread"] == "compile process") == (where == "process"))


def summary(runs: list[dict]) -> dict:
    """What one target's runs come to: first-start seconds (medians) and where they went."""
    first = [r["first"] for r in runs]
    cached = [r["cached"] for r in runs]
    out = {
        "first_token_s": median(first, "first_token_s"), "answer_end_s": median(first, "end_s"),
        "printed_s": median([r["printed_s"] for r in first if r["printed_s"] is not None]),
        "cpu_s": median(first, "cpu_s"), "compile_process_cpu_s": median(first, "worker_cpu_s"),
        "compiles": median([len(r["compiles"]) for r in first]),
        "cached_first_token_s": median(cached, "first_token_s"), "cached_end_s": median(cached, "end_s"),
        "cached_compiles": max(len(r["compiles"]) for r in cached),
    }
    for when in ("before", "after"):
        for where in ("here", "process"):
            out[f"compile_cpu_{when}_first_token_{where}_s"] = median([compile_cpu(r, when == "before", where)
                                                                      for r in first])
    return out


def kernel_table(run: dict, top: int) -> list[str]:
    """The top-level compiles of one first start (a kernel called from Python, its nested
    compiles included), in order, marked before or after the first token; then the functions
    whose own compile took longest (exclusive seconds, summed over signatures)."""
    ft = run["first_token_s"] or float("inf")
    lines = ["  top-level compiles (seconds, nested ones included), in order:"]
    for c in sorted((c for c in run["compiles"] if c["depth"] == 0), key=lambda c: c["start_s"]):
        when = "before" if c["start_s"] < ft else "after "
        lines.append(f"    {when} {c['start_s']:6.1f} s  {c['incl_s']:6.2f} s (CPU {c['cpu_incl_s']:5.2f} s)  "
                     f"{c['name']}"
                     f"{'' if c['thread'] == 'MainThread' else '  [' + c['thread'] + ']'}")
    own = defaultdict(lambda: [0.0, 0])
    for c in run["compiles"]:
        own[c["name"]][0] += c["cpu_excl_s"]
        own[c["name"]][1] += 1
    lines.append(f"  own compile CPU time (exclusive), top {top}:")
    for name, (s, n) in sorted(own.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {s:6.2f} s  {n:3d} signature(s)  {name}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="append", default=[], metavar="NAME",
                    help="also a first start compiled for this LLVM CPU (NUMBA_CPU_NAME), e.g. haswell; repeatable. "
                         "It must be a subset of this CPU's instructions")
    ap.add_argument("--no-host", action="store_true", help="only the --cpu targets, not this CPU's own")
    ap.add_argument("--runs", type=int, default=1, help="first starts per target (each in fresh directories)")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--prompt", default="Hi")
    ap.add_argument("--model", help="-m for colibri run (default: the embedded SmolLM2)")
    ap.add_argument("--top", type=int, default=15, help="functions listed by their own compile time")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    add_json_arg(ap)
    a = ap.parse_args()
    targets = ([] if a.no_host else [None]) + a.cpu
    if not targets:
        ap.error("nothing to run: --no-host without --cpu")
    argv = ["run", "-n", str(a.tokens), a.prompt] + (["-m", a.model] if a.model else [])
    print(machine_line())
    print(f"# colibri {' '.join(argv)}, empty COLIBRI_HOME / XDG_CACHE_HOME / numba cache, then a cached start")

    def once(cpu):
        root = Path(tempfile.mkdtemp(prefix="colibri-first-start-"))
        env = fresh_env(root, cpu)
        first = run_once(env, argv, root / "first.json")
        cached = run_once(env, argv, root / "cached.json")
        if not a.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        name = cpu or "host"
        print(f"{name}: first token {first['first_token_s']:.1f} s from launch (answer done {first['end_s']:.1f} s; "
              f"the message said {first['printed_s']} s), CPU {first['cpu_s']:.1f} s here and "
              f"{first['worker_cpu_s']:.1f} s in the compile process (other processes: {first['others_cpu_s']:.1f} "
              f"CPU s over the {first['wall_s']:.1f} s), {len(first['compiles'])} "
              f"compiles; cached start: first token {cached['first_token_s']:.2f} s, {len(cached['compiles'])} "
              f"compiles; answer {first['answer']!r}{'' if first['answer'] == cached['answer'] else ' DIFFERS'}",
              flush=True)
        for line in kernel_table(first, a.top):
            print(line)
        return {"first": first, "cached": cached}

    runs = interleaved(targets, a.runs, once)
    report = {}
    for cpu, rs in runs.items():
        s = summary(rs)
        report[cpu or "host"] = {"summary": s, "runs": rs}
        print(f"{cpu or 'host'} (median of {len(rs)}): first token {s['first_token_s']:.1f} s from launch; compile CPU "
              f"before it {s['compile_cpu_before_first_token_here_s']:.1f} s here + "
              f"{s['compile_cpu_before_first_token_process_s']:.1f} s in the compile process, after it "
              f"{s['compile_cpu_after_first_token_here_s']:.1f} + "
              f"{s['compile_cpu_after_first_token_process_s']:.1f} s; "
              f"cached start: first token {s['cached_first_token_s']:.2f} s ({s['cached_compiles']} compiles)")
    write_json(a.json, {"argv": argv, "targets": report}, args=a)


if __name__ == "__main__":
    main()
