"""Larger-than-RAM decode: colibri's expert store vs llama.cpp (llama-cpp-python, mmap, its
default) on the same synthetic MoE (tools/synthetic_moe.py, OLMoE-1B-7B shapes), under the same
cgroup-v1 memory limit. Each engine runs in its own process: a cold pass right after the page
cache is dropped, then a warm pass over the same tokens in the same process (so the limit binds
it too). Engines run one after the other, interleaved over repeats.

Routing is realistic: each engine is fed the same fixed token sequence one token at a time
(teacher forcing), never its own greedy output (BENCHMARKS.md point 7). Printed per run: decode
tok/s, expert hit rate, GB read from disk per token (/proc/self/io read_bytes, the same meter for
both engines), peak RSS, and the disk-bound limit = measured disk bandwidth / bytes missed per
token (the disk bandwidth: the better of one O_DIRECT stream and --read-threads of them).
Benchmark only: no asserts.

    python -m bench.peers.expert_streaming --model /tmp/olmoe --gguf /tmp/olmoe.gguf --limit-gb 2 \
        --llama-python /work/peer-venv/bin/python
Make the models first:  python -m tools.synthetic_moe /tmp/olmoe --preset olmoe-1b-7b --gguf /tmp/olmoe.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import add_json_arg, child_env, interleaved, machine_line, median, module_command, write_json


def peak_rss() -> int:
    """Peak RSS of this process (VmHWM: unlike ru_maxrss it is not inherited across exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def proc_read_bytes() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def token_sequence(n: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, 49000, size=n).tolist()


# ----------------------------------------------------------------------------- child runs

def _passes(run_pass, stats=None) -> dict:
    """Pass 1 right after the page cache was dropped (cold), pass 2 over the same sequence in
    the same process (warm). Both in one process, so the memory limit also binds the warm pass:
    pages cached by an earlier process would be charged to another cgroup and escape it."""
    out = {}
    for state in ("cold", "warm"):
        s0 = stats() if stats else None
        r0 = proc_read_bytes()
        times = run_pass()
        r1 = proc_read_bytes()
        steady = times[SKIP:]
        row = {"tok_s": len(steady) / sum(steady), "disk_bytes_per_tok": (r1 - r0) / len(times),
               "hit_rate": None, "wait_share": None}
        if stats:
            s1 = stats()
            asked = (s1["hits"] - s0["hits"]) + (s1["misses"] - s0["misses"])
            row.update(hit_rate=(s1["hits"] - s0["hits"]) / asked if asked else None,
                       wait_share=(s1["wait_s"] - s0["wait_s"]) / sum(times))
        out[state] = row
    out["peak_rss"] = peak_rss()
    return out


SKIP = 2  # first tokens of a pass left out of tok/s (kernel warm-up)


def child_colibri(a) -> dict:
    from colibri import Engine

    e = Engine.load(a.model, ram_gb=a.ram_gb, stream_experts=True, expert_io=a.expert_io,
                    prefetch=a.prefetch, hot_set=not a.no_hot_set, max_context=a.tokens + 16,
                    read_threads=a.read_threads, activations=a.activations)
    seq = token_sequence(a.tokens, a.seq_seed)

    def run_pass():
        e.reset()
        return e.feed(seq)

    return _passes(run_pass, lambda: dict(e.expert_stats))


def child_llama(a, repack: bool) -> dict:
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    if not repack:
        # llama.cpp's default CPU path repacks Q4_0 into interleaved copies in anonymous memory
        # (OOM under a limit smaller than the model); use_extra_bufts=False keeps pure mmap.
        default_params = lib.llama_model_default_params

        def mmap_only():
            p = default_params()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = mmap_only
    llm = Llama(model_path=str(a.gguf), n_ctx=a.tokens + 16, n_threads=a.threads, n_batch=64,
                use_mmap=True, verbose=False)
    seq = token_sequence(a.tokens, a.seq_seed)
    return _passes(lambda: llama_forced_pass(llm, seq))


def llama_forced_pass(llm, seq: list[int]) -> list[float]:
    """llama.cpp fed `seq` one token at a time from an empty context: seconds per token."""
    llm.reset()
    times = []
    for tok in seq:
        t = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t)
    return times


# ----------------------------------------------------------------------------- parent

def disk_bandwidth(path: Path, nbytes: int = 1 << 30, chunk: int = 4 << 20, streams: int = 1) -> float:
    """Cold O_DIRECT read of the first `nbytes` of the expert files, `chunk` bytes a read, by
    `streams` threads taking alternate chunks (bytes/s). With the engine's reader count, the
    bandwidth its reads can get where a drive serves several reads at once (an NVMe drive gives
    more at a deeper queue than one stream sees)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    files = [path] if path.is_file() else sorted(path.glob("experts-*.safetensors"))  # a .gguf: the file
    chunks = []  # (file, offset) in file order, up to nbytes
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, chunk):  # aligned offsets; the last read stops at the file's end
            if len(chunks) * chunk >= nbytes:
                break
            chunks.append((f, off))

    def read(first: int) -> int:
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        fds, done = {}, 0
        try:
            for f, off in chunks[first::streams]:
                if f not in fds:
                    fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
                done += max(0, os.preadv(fds[f], [buf], off))
        finally:
            for fd in fds.values():
                os.close(fd)
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = sum(pool.map(read, range(streams)))
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--limit-gb", type=float, default=2.0, help="cgroup memory limit for every engine")
    ap.add_argument("--ram-gb", type=float, help="colibri budget (default: limit minus 0.45 GiB for a limit under "
                    "4 GiB, else minus 1.5 GiB: with Qwen3-30B in 8 GiB, limit - 0.45 put RSS at 8.5 GB and warm "
                    "decode fell from ~6 to 2.4 tok/s while the group reclaimed around it)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--expert-io", default="direct")
    ap.add_argument("--read-threads", type=int, default=2, help="colibri readahead threads")
    ap.add_argument("--prefetch", action="store_true", help="colibri: prefetch predicted experts (off by default)")
    ap.add_argument("--no-hot-set", action="store_true")
    ap.add_argument("--llama-python", default=None, help="python with llama_cpp installed (peer venv)")
    ap.add_argument("--child-timeout", type=float, default=420, help="seconds one engine run may take")
    ap.add_argument("--ab", action="store_true", help="colibri only: prefetch and hot set each on/off")
    ap.add_argument("--seq-seed", type=int, default=0, help="seed of the forced token sequence")
    ap.add_argument("--activations", default="f32", help="colibri: f32 (exact) or int8")
    ap.add_argument("--int8", action="store_true", help="also colibri with --activations int8")
    ap.add_argument("--no-llama-default", action="store_true",
                    help="skip llama.cpp's default setting (its repack does not fit small limits)")
    ap.add_argument("--child", choices=["colibri", "llama", "llama-mmap"])
    add_json_arg(ap)
    a = ap.parse_args()
    gguf_file = None
    if a.model.suffix == ".gguf":  # colibri reads the file in place (its index in the cache), as moe_resident
        from colibri.default_model import gguf_model_dir

        gguf_file, a.model = a.model, gguf_model_dir(a.model, progress=not a.child)
    if a.child:
        out = child_colibri(a) if a.child == "colibri" else child_llama(a, repack=a.child == "llama")
        print(json.dumps(out))
        return

    from tools.memlimit import drop_caches, run_limited, why_unavailable

    from colibri.io.container import Container

    reason = why_unavailable()
    if reason:
        sys.exit(f"cannot run: {reason}")
    c = Container(a.model)
    ram_gb = a.ram_gb if a.ram_gb is not None else a.limit_gb - (0.45 if a.limit_gb < 4 else 1.5)
    per_tok_expert = sum(l.blob_bytes * int(c.config.get("num_experts_per_tok", 8))
                         for l in c.expert_layouts.values())
    streams = max(1, a.read_threads)
    drop_caches()
    bw = bw_one = disk_bandwidth(gguf_file or a.model)
    if streams > 1:  # the bound uses the better of one stream and the engine's reader count
        drop_caches()
        bw = max(bw_one, disk_bandwidth(gguf_file or a.model, streams=streams))
    env = child_env({"NUMBA_NUM_THREADS": str(a.threads), "OMP_NUM_THREADS": str(a.threads)})
    common = ["--model", str(a.model), "--tokens", str(a.tokens),
              "--threads", str(a.threads), "--expert-io", a.expert_io, "--ram-gb", str(ram_gb)]
    common += ["--prefetch"] * a.prefetch + ["--no-hot-set"] * a.no_hot_set
    common += ["--seq-seed", str(a.seq_seed), "--read-threads", str(a.read_threads)]
    # (label, child kind, python, extra args)
    engines = [("colibri", "colibri", sys.executable, [])]
    if a.int8:
        engines.append(("colibri int8 activations", "colibri", sys.executable, ["--activations", "int8"]))
    if a.ab:  # placement A/B: each policy switched alone
        engines = [("colibri hot set (default)", "colibri", sys.executable, []),
                   ("colibri hot+prefetch", "colibri", sys.executable, ["--prefetch"]),
                   ("colibri prefetch only", "colibri", sys.executable, ["--prefetch", "--no-hot-set"]),
                   ("colibri neither", "colibri", sys.executable, ["--no-hot-set"])]
    elif a.gguf and a.llama_python:
        engines += [("llama.cpp", "llama", a.llama_python, [])] * (not a.no_llama_default)
        engines += [("llama.cpp mmap-only", "llama-mmap", a.llama_python, [])]
        common += ["--gguf", str(a.gguf)]
    engines = [(label, kind, py, tuple(extra)) for label, kind, py, extra in engines]

    def once(engine) -> list[dict]:
        label, kind, py, extra = engine
        drop_caches()
        try:
            r = run_limited([*module_command(__spec__.name, py), "--child", kind, *common, *extra],
                            int(a.limit_gb * (1 << 30)), env=env, timeout=a.child_timeout)
        except subprocess.TimeoutExpired:
            return [{"engine": label, "state": "cold", "oom": False,
                     "error": f"no result within {a.child_timeout:.0f} s (thrashing under the limit)"}]
        if r.returncode != 0:
            return [{"engine": label, "state": "cold", "oom": r.oom_killed,
                     "error": (r.stderr.strip().splitlines() or ["?"])[-1]}]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return [{**out[state], "engine": label, "state": state, "peak_rss": out["peak_rss"],
                 "group_peak": r.max_usage_bytes} for state in ("cold", "warm")]

    rows = []

    def record(engine, rep, got):
        for r in got:
            if "error" not in r:
                r["repeat"] = rep
        rows.extend(got)

    interleaved(engines, a.repeats, once, on_result=record)  # A B A B
    report = {"model": str(a.model), "dense_bytes": c.dense_bytes, "expert_bytes": c.expert_bytes,
              "routed_bytes_per_token": per_tok_expert, "disk_bw": bw, "disk_bw_one_stream": bw_one,
              "limit_gb": a.limit_gb, "colibri_ram_gb": ram_gb, "tokens": a.tokens, "rows": rows}
    summary = {}
    for r in rows:
        if "error" not in r:
            summary.setdefault((r["engine"], r["state"]), []).append(r["tok_s"])
    if a.json:
        write_json(a.json, report, args=a)
        if a.json == "-":
            return
    print(machine_line())
    print(f"disk (O_DIRECT 4 MiB reads, cold): {bw_one / 1e9:.2f} GB/s one stream, {bw / 1e9:.2f} GB/s the "
          f"better of that and {streams}; routed expert bytes per token "
          f"{per_tok_expert / 1e9:.3f} GB; no-hit disk-bound limit {bw / per_tok_expert:.2f} tok/s; "
          f"memory limit {a.limit_gb} GiB, colibri budget {ram_gb:.2f} GiB")
    print(f"{'engine':25} {'state':5} {'tok/s':>7} {'hit':>5} {'GB/tok':>7} {'limit tok/s':>11} {'% limit':>7} "
          f"{'wait':>5} {'RSS GiB':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:25} {r['state']:5} failed: {r['error']} (oom killed: {r['oom']})")
            continue
        missed = r["disk_bytes_per_tok"]
        # Under 1 MB read per token the disk is not what bounds a pass: no limit to compare with.
        limit, share = (f"{bw / missed:11.2f}", f"{100 * r['tok_s'] * missed / bw:6.0f}%") if missed > 1e6 \
            else (f"{'-':>11}", f"{'-':>7}")
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        wait = "-" if r["wait_share"] is None else f"{r['wait_share']:.2f}"
        print(f"{r['engine']:25} {r['state']:5} {r['tok_s']:7.2f} {hit:>5} {missed / 1e9:7.3f} {limit} "
              f"{share} {wait:>5} {r['peak_rss'] / 2**30:7.2f}")
    if a.repeats > 1:
        print("medians over repeats: " + "; ".join(f"{e} {s_}: {median(v):.2f} tok/s"
                                                   for (e, s_), v in summary.items()))


if __name__ == "__main__":
    main()
