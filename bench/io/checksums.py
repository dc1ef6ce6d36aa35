"""What verifying expert checksums costs: the candidate checksums' speed at real expert sizes,
against a cold disk read of the same bytes, and a streamed decode with verification off, on
(xxh3_64, what containers record) and with crc32 (stdlib), interleaved.

    python -m bench.io.checksums                                   # checksum speeds only
    python -m bench.io.checksums --model /tmp/olmoe --ram-gb 1.5   # + streamed decode A/B/C

Make the model first: python -m tools.synthetic_moe /tmp/olmoe --preset olmoe-1b-7b.
Decode reads with O_DIRECT (the page cache never serves a miss), so every miss costs a disk read
and its verification; the budget keeps misses frequent. Benchmark only: no asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


from bench.common import add_json_arg, interleaved, machine_line, median, write_json  # noqa: E402
from colibri.io.container import CHECKSUMS, MANIFEST, Container, checksum  # noqa: E402

SIZES = {"1.2 MB": 1_200_128, "OLMoE expert 3.5 MB": 3_543_040, "DeepSeek-V3 expert 22 MB": 22_020_096}


def candidates() -> dict:
    """Digest functions to compare; xxh3_64 and crc32 are the ones the container knows."""
    import hashlib

    return {**CHECKSUMS,
            "sha1": lambda b: hashlib.sha1(b).hexdigest(),
            "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).hexdigest()}


def hash_speeds(repeat_bytes: float = 0.4e9) -> list[dict]:
    """Median seconds per expert, single thread, buffers cycled so they come from DRAM."""
    rng = np.random.default_rng(0)
    rows = []
    for label, n in SIZES.items():
        bufs = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for _ in range(4)]
        for name, f in candidates().items():
            f(bufs[0])
            times = []
            for r in range(max(5, int(repeat_bytes // n))):
                t0 = time.perf_counter()
                f(bufs[r % 4])
                times.append(time.perf_counter() - t0)
            t = median(times)
            rows.append({"size": label, "bytes": n, "checksum": name, "ms": t * 1e3, "gb_s": n / t / 1e9})
    return rows


def disk_read_speed(path: Path, block: int, total: int = 512 << 20) -> float | None:
    """GB/s of O_DIRECT reads of `block` bytes from `path` (no page cache: what a miss costs)."""
    from colibri.io.expert_store import aligned_buffer

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return None
    size = os.fstat(fd).st_size
    buf = aligned_buffer(block)
    done, t0 = 0, time.perf_counter()
    try:
        for off in range(4096, min(total, size - block), block):  # after the header page
            done += os.preadv(fd, [memoryview(buf)], off)
    finally:
        os.close(fd)
    return done / (time.perf_counter() - t0) / 1e9


def crc32_twin(model: Path, out: Path) -> Path:
    """The model with crc32 digests: expert and dense files hard-linked, only the manifest new."""
    out.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.name != MANIFEST and not (out / f.name).exists():
            os.link(f, out / f.name)
    manifest = json.loads((model / MANIFEST).read_text())
    c = Container(model)
    for prefix, spec in manifest["experts"].items():
        mm = c.expert_file(prefix)._mm
        spans = [c.expert_range(prefix, e)[1:] for e in range(spec["num_experts"])]
        spec.update(checksum="crc32", digests=[checksum(mm[o: o + n], "crc32") for o, n in spans])
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def decode(model: Path, variant: str, ram_gb: float, tokens: int, threads: int | None) -> dict:
    """tok/s of a teacher-forced streamed decode (first two tokens left out, as colibri bench)."""
    from colibri.engine import Engine

    engine = Engine.load(model, ram_gb=ram_gb, stream_experts=True, expert_io="direct", threads=threads,
                         hot_set=False, max_context=tokens + 8)
    engine.experts.config.verify = variant != "off"  # EngineConfig.verify_experts, set on the store
    verify_s = _time_verification(engine.container)
    seq = np.random.default_rng(0).integers(100, 49000, size=tokens).tolist()
    s0 = engine.expert_stats
    times = engine.feed(seq)
    s1 = engine.expert_stats
    engine.experts.close()
    steady = times[2:] or times
    reads = s1["reads"] - s0["reads"]
    return {"variant": variant, "tok_s": len(steady) / sum(steady), "reads_per_token": reads / len(times),
            "gb_read_per_token": (s1["bytes_read"] - s0["bytes_read"]) / len(times) / 1e9,
            "hit_rate": (s1["hits"] - s0["hits"]) / (s1["hits"] - s0["hits"] + s1["misses"] - s0["misses"]),
            "disk_wait_share": (s1["wait_s"] - s0["wait_s"]) / sum(times),
            "verify_ms_per_token": sum(verify_s) / len(times) * 1e3,
            "verify_share": sum(verify_s) / sum(times)}


def _time_verification(container: Container) -> list[float]:
    """CPU seconds of each verify_expert call (thread time: on a loaded machine wall time would
    count the reader thread's waits for a core; list.append is atomic across reader threads)."""
    spent: list[float] = []
    verify = container.verify_expert

    def timed(*args):
        t0 = time.thread_time()
        try:
            verify(*args)
        finally:
            spent.append(time.thread_time() - t0)
    container.verify_expert = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a container to decode (streamed); omit for speeds only")
    ap.add_argument("--ram-gb", type=float, default=1.5)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    add_json_arg(ap)
    a = ap.parse_args()
    print(machine_line())
    speeds = hash_speeds()
    for r in speeds:
        print(f"{r['size']:26s} {r['checksum']:12s} {r['ms']:8.3f} ms/expert {r['gb_s']:6.2f} GB/s")
    if not a.model:
        write_json(a.json, {"hash_speeds": speeds}, args=a)
        return
    c = Container(a.model)
    layout = next(iter(c.expert_layouts.values()))
    disk = disk_read_speed(c.dir / layout.file, layout.blob_bytes)
    print(f"# disk: O_DIRECT reads of one expert ({layout.blob_bytes / 1e6:.2f} MB): "
          + (f"{disk:.2f} GB/s" if disk else "O_DIRECT refused"))
    twin = crc32_twin(a.model, a.model.with_name(a.model.name + "-crc32"))
    models = {"off": a.model, "xxh3_64": a.model, "crc32": twin}
    # interleaved: the machine's load moves between runs
    runs = interleaved(models, a.repeats, lambda variant: decode(models[variant], variant, a.ram_gb, a.tokens, a.threads),
                       on_result=lambda variant, rep, row: print(json.dumps(
                           {"repeat": rep, **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}})))
    for variant, rows in runs.items():
        tok_s = [r["tok_s"] for r in rows]
        print(f"{variant:8s} median {median(tok_s):6.2f} tok/s  runs {' '.join(f'{t:.2f}' for t in tok_s)}")
    write_json(a.json, {"hash_speeds": speeds, "disk_gb_s": disk, "decode": runs}, args=a)


if __name__ == "__main__":
    main()
