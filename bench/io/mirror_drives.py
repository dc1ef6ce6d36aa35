"""Two drives at B each read ~2B (`--mirror`, colibri/io/mirrors.py): every expert of a model
read once through ExpertReader (O_DIRECT, checksums on, by --threads readers: 4 is the resident
load's READ_THREADS, 2 the streaming store's default readahead threads), from one drive and from
two (the model's own and a mirror), in fresh processes, alternating, the page cache dropped
before each run. Each expert goes to one drive, so two drives are both busy only while each has
a read in flight: with R readers on two equal drives, all R wait on the same drive about
2^(1-R) of the time (R = 4: 1/8; R = 2: 1/2), which a real pair of drives loses. The cgroup
throttle lets a device that sat idle catch up in short bursts (a drive's rate while busy, as
printed, goes above B), so here that loss shows less than it would on real drives; the one-drive
runs read at B exactly.

Each drive is a loop device (an ext4 image in --workdir, `losetup --direct-io=on`, so the reads
reach the device the limit is set on) throttled to B for the reading process only: a child cgroup
with the read limit on both devices (cgroup v2 `io.max` rbps where the io controller is
available, else v1 `blkio.throttle.read_bps_device`), the reading process moved into it. The
model is copied whole to the first drive and its expert files to the second (a mirror).
Benchmark only: no asserts. Needs root; mounts, loop devices, images and the cgroup are removed
on every exit, a failed one included.

    python -m tools.synthetic_moe /tmp/mirror_olmoe --preset olmoe-1b-7b --layers 4
    python -m bench.io.mirror_drives /tmp/mirror_olmoe --rate-mbs 200 [--threads 2,4,8] [--runs 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import add_json_arg, child_env, interleaved, machine_line, median, module_command, write_json

CGROUP_NAME = "colibri-mirror-bench"


# ----------------------------------------------------------------------------- the reading child

def child(primary: str, mirror: str | None, threads: int, procs: str) -> None:
    """Move this process into the throttled cgroup, then read every expert once; print one JSON line."""
    Path(procs).write_text(f"{os.getpid()}\n")
    from colibri.io.container import Container
    from colibri.io.expert_reader import ExpertReader, aligned_buffer

    c = Container(primary)
    reader = ExpertReader(c, "require", mirrors=[(mirror, None)] if mirror else [])
    jobs = [(p, e) for p, layout in c.expert_layouts.items() for e in range(layout.num_experts)]
    max_blob = max(layout.blob_bytes for layout in c.expert_layouts.values())
    buffers = [aligned_buffer(max_blob) for _ in range(threads)]  # one per reader thread

    def read_share(i: int) -> None:
        for p, e in jobs[i::threads]:
            reader.read(p, e, buffers[i], verify=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_share, range(threads)))
    seconds = time.perf_counter() - t0
    reader.close()
    print(json.dumps({"seconds": seconds, "bytes": c.expert_bytes, "drives": reader.drive_stats()}), flush=True)


# ----------------------------------------------------------------------------- the setup (root)

def run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class Throttle:
    """A child cgroup limiting reads from the given block devices to `rate` bytes/s. Made by
    create(), so that remove() undoes however far it got."""

    def __init__(self):
        self.dir: Path | None = None
        self.kind = ""

    def create(self, devices: list[str], rate: int) -> None:
        v2 = _cgroup2_with_io()
        if v2 is not None:
            self.kind = "cgroup v2 io.max"
            subtree = v2 / "cgroup.subtree_control"
            if "io" not in subtree.read_text().split():
                subtree.write_text("+io\n")
            self.dir = v2 / CGROUP_NAME
            self.dir.mkdir()
            for dev in devices:
                (self.dir / "io.max").write_text(f"{dev} rbps={rate}\n")
            return
        v1 = Path("/sys/fs/cgroup/blkio")
        if not (v1 / "blkio.throttle.read_bps_device").exists():
            raise SystemExit("no block-io cgroup here: neither cgroup v2 with the io controller nor v1 blkio")
        self.kind = "cgroup v1 blkio.throttle.read_bps_device"
        self.dir = v1 / CGROUP_NAME
        self.dir.mkdir()
        for dev in devices:
            (self.dir / "blkio.throttle.read_bps_device").write_text(f"{dev} {rate}\n")

    @property
    def procs(self) -> Path:
        return self.dir / "cgroup.procs"

    def remove(self) -> None:
        if self.dir is not None and self.dir.exists():
            self.dir.rmdir()  # (the children have exited: it is empty)


def _cgroup2_with_io() -> Path | None:
    """The cgroup v2 hierarchy this process is in, where it offers the io controller."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "io" in controllers.read_text().split():
            return root
    return None


class LoopDrive:
    """An ext4 file system on a loop device over an image file, mounted under `workdir`. Made
    in steps by create(), so that remove() undoes however far it got."""

    def __init__(self, workdir: Path, name: str):
        self.image, self.mount = workdir / f"{name}.img", workdir / name
        self.device: str | None = None
        self.mounted = False
        self.majmin = ""

    def create(self, nbytes: int) -> None:
        with open(self.image, "wb") as f:
            f.truncate(nbytes)
        self.device = run(["losetup", "-f", "--show", "--direct-io=on", str(self.image)])
        run(["mkfs.ext4", "-q", "-F", self.device])
        self.mount.mkdir()
        run(["mount", self.device, str(self.mount)])
        self.mounted = True
        self.majmin = Path(f"/sys/class/block/{Path(self.device).name}/dev").read_text().strip()

    def remove(self) -> None:
        if self.mounted:
            run(["umount", str(self.mount)])
            self.mounted = False
        if self.device:
            run(["losetup", "-d", self.device])
            self.device = None
        self.image.unlink(missing_ok=True)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def label(variant: tuple[int, int]) -> str:
    drives, threads = variant
    return f"{drives} drive{'s' if drives > 1 else ''}, {threads} readers"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a colibri container (e.g. from tools.synthetic_moe)")
    ap.add_argument("--rate-mbs", type=float, default=200.0, help="each drive's read limit, MB/s (10^6 bytes)")
    ap.add_argument("--threads", default="4", help="reader threads, a comma list: each count is run with one "
                    "drive and with two (default 4, the resident load's READ_THREADS)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each variant, alternating")
    ap.add_argument("--workdir", type=Path, default=None, help="where the drive images go (default: a new "
                    "directory under /var/tmp)")
    add_json_arg(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--primary", help=argparse.SUPPRESS)
    ap.add_argument("--mirror", help=argparse.SUPPRESS)
    ap.add_argument("--procs", help=argparse.SUPPRESS)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a.child:
        child(a.primary, a.mirror, threads[0], a.procs)
        return
    if a.model is None:
        ap.error("give a model directory")
    if os.geteuid() != 0:
        raise SystemExit("needs root: loop devices, mounts, cgroups and dropping the page cache")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise SystemExit(f"needs {tool}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cleanup below runs
    print(machine_line())
    model = Path(a.model)
    from colibri.io.container import Container

    c = Container(model)
    expert_files = sorted({p for prefix in c.expert_layouts for p in c.expert_paths(prefix)})
    whole = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    workdir = Path(tempfile.mkdtemp(prefix="colibri-mirror-", dir=a.workdir or "/var/tmp"))
    drives: list[LoopDrive] = []
    throttle = Throttle()
    try:
        for name, nbytes in (("primary", whole), ("mirror", sum(p.stat().st_size for p in expert_files))):
            drives.append(LoopDrive(workdir, name))
            drives[-1].create(int(nbytes * 1.1) + (128 << 20))  # + ext4's own
        primary, mirror = drives[0].mount / model.name, drives[1].mount / model.name
        shutil.copytree(model, primary)
        mirror.mkdir()
        for p in expert_files:
            shutil.copy(p, mirror / p.name)
        throttle.create([d.majmin for d in drives], int(a.rate_mbs * 1e6))
        print(f"# {model} ({c.expert_bytes / 1e9:.2f} GB of experts), drives {drives[0].device} and "
              f"{drives[1].device} (loop, direct-io) each limited to {a.rate_mbs:.0f} MB/s by {throttle.kind}; "
              "O_DIRECT, checksums on", flush=True)

        def once(variant: tuple[int, int]) -> dict | None:
            n_drives, n_threads = variant
            drop_caches()
            cmd = [*module_command(__spec__.name), "--child", "--primary", str(primary),
                   "--threads", str(n_threads), "--procs", str(throttle.procs)]
            if n_drives == 2:
                cmd += ["--mirror", str(mirror)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
            if done.returncode != 0:
                print(f"# {label(variant)}: the reading process failed:\n{done.stderr}", file=sys.stderr)
                return None
            return json.loads(done.stdout.strip().splitlines()[-1])

        def show(variant: tuple[int, int], rnd: int, r: dict | None) -> None:
            if r is None:
                return
            per_drive = ", ".join(
                f"{'primary' if i == 0 else 'mirror'} {d['bytes_read'] / 1e9:.2f} GB in {d['reads']} reads, "
                f"busy {d['read_s']:.2f} s ({d['bytes_read'] / d['read_s'] / 1e6 if d['read_s'] else 0:.0f} MB/s)"
                for i, d in enumerate(r["drives"].values()))
            print(f"{label(variant):18} run {rnd + 1}: {r['bytes'] / r['seconds'] / 1e9:.3f} GB/s "
                  f"({r['seconds']:.2f} s); {per_drive}", flush=True)

        variants = [(n_drives, t) for t in threads for n_drives in (1, 2)]
        runs = interleaved(variants, a.runs, once, alternate=True, on_result=show)
        rates = {v: median([r["bytes"] / r["seconds"] / 1e9 for r in rs]) for v, rs in runs.items()}
        for t in threads:
            one, two = rates[(1, t)], rates[(2, t)]
            print(f"median, {t} readers: one drive {one:.3f} GB/s, two drives {two:.3f} GB/s ({two / one:.2f}x; "
                  f"each drive limited to {a.rate_mbs / 1e3:.3f} GB/s)")
        write_json(a.json, {"rate_mbs": a.rate_mbs, "throttle": throttle.kind,
                            "runs": {label(v): rs for v, rs in runs.items()},
                            "median_gbs": {label(v): r for v, r in rates.items()}}, args=a)
    finally:
        problems = []
        for step in [throttle.remove] + [d.remove for d in reversed(drives)]:
            try:
                step()
            except (OSError, subprocess.CalledProcessError) as e:
                problems.append(str(e))
        shutil.rmtree(workdir, ignore_errors=True)
        if problems:
            print(f"# cleanup left something behind: {'; '.join(problems)}", file=sys.stderr)


if __name__ == "__main__":
    main()
