"""FP8 conversion at DeepSeek-V3's shapes: peak memory under a cgroup limit, rate, and a decode.

    python -m bench.io.fp8_convert [--layers 4] [--experts 256] [--vocab 49152] [--limit-mb N]
                                [--workdir DIR] [--width-divisor 1] [--no-decode] [--keep] [--json]

1. tools/synthetic_fp8.py writes a synthetic FP8 checkpoint (DeepSeek-V3 names, shapes, dtypes,
   128x128 block scales, several shards, one scale in another shard than its weight, SmolLM2's
   tokenizer) into a temporary directory under --workdir.
2. Its pages are flushed and dropped from the page cache (fsync + POSIX_FADV_DONTNEED, this
   checkpoint's files only): a page cached by the generator is charged to the generator's
   cgroup, so without this the converter would read it for free; with it, every page the
   converter reads or writes is charged to its own group, as with a real checkpoint read cold.
3. `colibri convert SRC OUT --bits 4` runs in a cgroup-v1 memory group of --limit-mb (default:
   the bound below plus 10%) through tools/memlimit.py. Page cache counts against a v1 limit,
   so the group's peak (RSS + cache) reaches the limit and the kernel reclaims cache there;
   that is expected. What must hold is that the converter is never OOM-killed, and its
   own peak RSS (VmHWM, from getrusage of the child) stays under the bound. A sampler in the
   group also records the largest rss / cache / dirty figures of memory.stat.
4. `colibri run -m OUT -n 8 "Hello"` must decode (random weights: the text is noise).

The bound, from the code (colibri/io/convert.py `_quantized`, io/fp8.py `row_chunks`): convert
takes one tensor at a time, reads its stored bytes in 16 MiB slabs (one pread each, into one
buffer), dequantizes and quantizes 64K elements at a time and fills the quantized result;
routed experts wait only until their three matrices are in, then are pwritten. So

    peak RSS <= baseline (~0.12 GB: interpreter, numpy, colibri)
                + max over tensors of (quantized bytes + one slab)
                + working set (one chunk and the quantizer's temporaries, ~2 MB; one expert's
                  matrices and packed blob, ~50 MB at full width; metadata; malloc slack)

The largest quantized tensor is embed_tokens / lm_head at q8_0 (1.125 bytes/element): 0.40 GB
at vocab 49152, 1.04 GB at DeepSeek-V3's 129280. Nothing depends on the number of experts,
layers or shards. The ContainerWriter adds no RSS: dense tensors are spooled to a scratch file
and each expert is pwritten at its place (page cache, which the cgroup reclaims). Before the
row chunks, each tensor was read whole and quantized as one float32 matrix: for q8_0 ~24 bytes
per element were live, 8.7 GB at vocab 49152 and ~22 GB at 129280.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import add_json_arg, child_env, machine_line, write_json
from tools import memlimit, synthetic_fp8

GB = 1e9
MiB = 1 << 20
BASELINE = 192 * MiB           # `colibri convert` before its first tensor: ~120 MB measured
SLAB = 16 * MiB                # convert reads a tensor's stored bytes in slabs of this size
WORKING_SET = 128 * MiB        # one row chunk and its quantizer temporaries (~2 MB), one expert's
                               # QTensors + packed blob (~50 MB at full width), metadata, malloc slack

# Runs inside the limited group: starts `colibri convert`, samples the group's memory.stat,
# and reports the converter's peak RSS (getrusage of the child: VmHWM) and the rate.
WRAPPER = r"""
import json, resource, subprocess, sys, threading, time
from pathlib import Path

def group():
    for line in open("/proc/self/cgroup"):
        _, ctl, path = line.rstrip("\n").split(":", 2)
        if "memory" in ctl.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")

stat, peaks, stop = group() / "memory.stat", {}, threading.Event()

def sample():
    while not stop.is_set():
        try:
            for line in open(stat):
                k, v = line.split()
                if k in ("rss", "cache", "dirty", "writeback", "mapped_file"):
                    peaks[k] = max(peaks.get(k, 0), int(v))
        except OSError:
            pass
        stop.wait(0.05)

threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
dt = time.perf_counter() - t0
stop.set()
print(json.dumps({"rc": r.returncode, "seconds": dt, "stderr": r.stderr[-3000:],
                  "child_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "group_stat_peaks": peaks}))
"""


def evict(directory: Path) -> None:
    """Flush and drop this directory's files from the page cache (no other file is touched)."""
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def predicted_bound(layers: int, experts: int, vocab: int, width_divisor: int) -> dict:
    """The peak-RSS bound of the docstring for this checkpoint, and the disk the run needs."""
    from colibri.io.convert import scheme_for

    cfg = synthetic_fp8.config_for(layers, experts, vocab, width_divisor)
    out_bytes = {"int4_g64": 0.5 + 4 / 64, "q8_0": 1 + 4 / 32, "f32": 4.0}
    largest, name, dense, routed = 0, "", 0, 0
    for s in synthetic_fp8.tensor_specs(cfg):
        if s.kind == "scale":
            continue
        n = s.nbytes // synthetic_fp8._DTYPE_BYTES[s.dtype]
        scheme = scheme_for(s.name, s.shape, 4) if len(s.shape) == 2 else "f32"
        quantized = int(n * out_bytes[scheme])
        if quantized + min(s.nbytes, SLAB) > largest:
            largest, name = quantized + min(s.nbytes, SLAB), s.name
        if ".experts." in s.name:
            routed += quantized
        else:
            dense += quantized
    source = sum(s.nbytes for s in synthetic_fp8.tensor_specs(cfg))
    # At the end of convert the dense part exists twice (scratch spool + dense.safetensors).
    return {"largest_tensor": name, "largest_tensor_in_flight": largest,
            "bound": BASELINE + largest + WORKING_SET, "disk_needed": source + routed + 2 * dense}


def colibri_cmd() -> list[str]:
    exe = shutil.which("colibri")
    return [exe] if exe else [sys.executable, "-c", "from colibri.cli import main; main()"]


def run(a) -> dict:
    sizes = synthetic_fp8.checkpoint_bytes(a.layers, a.experts, a.vocab, a.width_divisor)
    bound = predicted_bound(a.layers, a.experts, a.vocab, a.width_divisor)
    limit = (a.limit_mb * MiB) if a.limit_mb else int(bound["bound"] * 1.10)
    a.workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(a.workdir).free
    if bound["disk_needed"] > free:
        raise SystemExit(f"this run needs ~{bound['disk_needed'] / GB:.1f} GB of disk under {a.workdir} (checkpoint, "
                         f"container, dense spool), {free / GB:.1f} GB are free; use fewer --experts or another "
                         "--workdir")
    work = Path(tempfile.mkdtemp(prefix="fp8bench-", dir=a.workdir))
    res: dict = {"layers": a.layers, "experts": a.experts, "vocab": a.vocab, "width_divisor": a.width_divisor,
                 "source_bytes": sizes["total"], "expert_fp8_bytes": sizes["experts_fp8"], **bound,
                 "limit_bytes": limit}
    try:
        src, out = work / "fp8", work / "container"
        t = time.perf_counter()
        synthetic_fp8.write_checkpoint(src, a.layers, a.experts, a.vocab, a.seed, a.width_divisor,
                                       tokenizer=not a.no_tokenizer)
        res["generate_seconds"] = time.perf_counter() - t
        res["shards"] = len(list(src.glob("*.safetensors")))
        evict(src)
        cmd = [sys.executable, "-c", WRAPPER, *colibri_cmd(), "convert", str(src), str(out), "--bits", "4"]
        why = memlimit.why_unavailable()
        if why:
            print(f"no memory cgroup ({why}): converting without a limit", file=sys.stderr)
            res["limit_bytes"] = None
            p = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
            rc, stdout, stderr, group_peak, failcnt, oom = p.returncode, p.stdout, p.stderr, None, None, None
        else:
            r = memlimit.run_limited(cmd, limit, timeout=4 * 3600, env=child_env())
            rc, stdout, stderr, group_peak, failcnt, oom = (r.returncode, r.stdout, r.stderr, r.max_usage_bytes,
                                                            r.failcnt, r.oom_killed)
        inner = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
        res.update(convert_rc=inner.get("rc", rc), oom_killed=oom, group_peak_bytes=group_peak, failcnt=failcnt,
                   converter_peak_rss=inner.get("child_peak_rss"), group_stat_peaks=inner.get("group_stat_peaks"),
                   convert_seconds=inner.get("seconds"))
        if inner.get("rc") != 0 or rc != 0:
            res["convert_error"] = (inner.get("stderr") or stderr)[-2000:]
            return res
        res["rate_gb_s"] = sizes["total"] / inner["seconds"] / GB
        res["container_bytes"] = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        if not a.no_decode:
            t = time.perf_counter()
            d = subprocess.run([*colibri_cmd(), "run", "-m", str(out), "-n", "8", "Hello"], capture_output=True,
                               text=True, timeout=1800, env=child_env())
            res["decode"] = {"rc": d.returncode, "seconds": time.perf_counter() - t, "stdout": d.stdout.strip(),
                             "stderr_tail": d.stderr.strip()[-600:]}
            res["decode_ok"] = d.returncode == 0 and bool(d.stdout.strip())
    finally:
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return res


def report(res: dict) -> None:
    g = lambda b: "n/a" if b is None else f"{b / GB:.2f} GB"  # noqa: E731
    print(f"checkpoint: {res['layers']} layers, {res['experts']} experts, vocab {res['vocab']}, width/"
          f"{res['width_divisor']}: {g(res['source_bytes'])} in {res.get('shards')} shards "
          f"({g(res['expert_fp8_bytes'])} routed-expert FP8), generated in {res.get('generate_seconds', 0):.0f} s")
    print(f"bound: {g(res['bound'])} = baseline {g(BASELINE)} + largest tensor in flight "
          f"{g(res['largest_tensor_in_flight'])} ({res['largest_tensor']}) + working set {g(WORKING_SET)}")
    print(f"limit: {g(res['limit_bytes'])}; disk needed ~{g(res['disk_needed'])}")
    if "convert_error" in res:
        print(f"convert FAILED (rc {res['convert_rc']}, oom {res['oom_killed']}):\n{res['convert_error']}")
        return
    peaks = res.get("group_stat_peaks") or {}
    print(f"converter peak RSS: {g(res['converter_peak_rss'])}; group peak (RSS + page cache): "
          f"{g(res['group_peak_bytes'])}, failcnt {res['failcnt']}, oom-killed {res['oom_killed']}; "
          f"memory.stat max rss {g(peaks.get('rss'))}, cache {g(peaks.get('cache'))}, dirty {g(peaks.get('dirty'))}")
    print(f"convert: {res['convert_seconds']:.1f} s, {res['rate_gb_s']:.3f} GB/s of source bytes; "
          f"container {g(res['container_bytes'])}")
    if "decode" in res:
        d = res["decode"]
        print(f"decode: {'ok' if res['decode_ok'] else 'FAILED'} (rc {d['rc']}, {d['seconds']:.0f} s): {d['stdout']!r}")
        if not res["decode_ok"]:
            print(d["stderr_tail"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152, help="default 49152: SmolLM2's tokenizer covers every id")
    ap.add_argument("--width-divisor", type=int, default=1)
    ap.add_argument("--limit-mb", type=int, default=None, help="cgroup limit (default: the bound + 10%%)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the container")
    add_json_arg(ap)
    a = ap.parse_args()
    res = run(a)
    if a.json:
        write_json(a.json, res, args=a)
    if a.json != "-":
        print(machine_line())
        report(res)
    ok = res.get("convert_rc") == 0 and not res.get("oom_killed") and res.get("decode_ok", True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
