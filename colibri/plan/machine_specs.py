"""Named machines for `colibri plan --machines` and `--machine-spec`: a machine described by a few
figures (RAM, disk read rate, cores, GPUs), in a TOML or JSON file or on the command line, made
into the Machine the planner plans for. machines.toml, next to this file, is `--machines default`.

A file holds one table per machine, named by the machine (JSON: an object of objects):

    [desktop-64g]
    ram_gb = 64          # installed RAM, GiB (as --ram-gb)
    disk_gbs = 2.0       # disk read rate, GB/s
    cores = 8
    mem_gbs = 60         # optional: memory read bandwidth the kernels can draw, GB/s
    drives = 2           # optional: identical drives the experts are striped over (--mirror), each at disk_gbs
    gpus = [{ name = "24 GB GPU", vram_gb = 24, bandwidth_gbs = 1000 }]   # optional
"""
from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

from colibri.errors import ColibriError
from colibri.plan.machine import GPU, Machine
from colibri.plan.policy import GiB

DEFAULT_FILE = Path(__file__).with_name("machines.toml")
FIELDS = {  # what each field of a machine holds, as error messages say it
    "ram_gb": "installed RAM in GiB",
    "disk_gbs": "disk read rate in GB/s",
    "cores": "CPU cores",
    "mem_gbs": "memory read bandwidth in GB/s",
    "drives": "identical drives the experts are striped over (--mirror), each reading disk_gbs",
    "gpus": "a list of {name, vram_gb, bandwidth_gbs}",
}
REQUIRED = ("ram_gb", "disk_gbs", "cores")
GPU_FIELDS = {"name": "its name", "vram_gb": "its memory in GiB", "bandwidth_gbs": "its memory bandwidth in GB/s"}
SPEC_KEYS = ("ram_gb", "disk_gbs", "cores", "mem_gbs", "drives", "vram_gb")  # a file's fields; one vram_gb per GPU
SPEC_SYNTAX = "NAME:ram_gb=64,disk_gbs=2,cores=8[,mem_gbs=60][,drives=2][,vram_gb=24]"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _positive(value, where: str, what: str, whole: bool = False) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
          and (not whole or float(value).is_integer()))
    if not ok:
        kind = "a positive whole number" if whole else "a positive number"
        raise ColibriError(f"{where}: {what} must be {kind}, not {value!r}")
    return value


def machine_from_spec(name: str, spec, source: str) -> Machine:
    """The Machine a description stands for; `source` (a file, --machine-spec) is in its messages."""
    where = f"machine {name!r} in {source}"
    if not _NAME.match(name):
        raise ColibriError(f"{where}: a machine name is letters, digits and . _ + - (no spaces)")
    if not isinstance(spec, dict):
        raise ColibriError(f"{where}: expected a table of {', '.join(FIELDS)}, not {type(spec).__name__}")
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise ColibriError(f"{where}: unknown field {unknown[0]!r}; fields: "
                           + ", ".join(f"{k} ({v})" for k, v in FIELDS.items()))
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise ColibriError(f"{where}: missing {missing[0]} ({FIELDS[missing[0]]})")
    ram = int(_positive(spec["ram_gb"], where, "ram_gb") * GiB)
    gpus = spec.get("gpus", [])
    if not isinstance(gpus, list):
        raise ColibriError(f"{where}: gpus must be a list of {{name, vram_gb}}, not {gpus!r}")
    return Machine(cores=int(_positive(spec["cores"], where, "cores", whole=True)),
                   ram_total_bytes=ram, ram_available_bytes=ram,
                   gpus=[_gpu(g, i, where) for i, g in enumerate(gpus)],
                   disk_read_gbs=float(_positive(spec["disk_gbs"], where, "disk_gbs")), disk_probe="described",
                   mem_read_gbs=float(_positive(spec["mem_gbs"], where, "mem_gbs")) if "mem_gbs" in spec else None,
                   drives=int(_positive(spec["drives"], where, "drives", whole=True)) if "drives" in spec else 1,
                   source=source, name=name)


def _gpu(g, i: int, where: str) -> GPU:
    where = f"{where}, GPU {i}"
    if not isinstance(g, dict) or set(g) - set(GPU_FIELDS) or "vram_gb" not in g:
        raise ColibriError(f"{where}: expected {{name, vram_gb[, bandwidth_gbs]}}, not {g!r}")
    vram = int(_positive(g["vram_gb"], where, "vram_gb") * GiB)
    bandwidth = float(_positive(g["bandwidth_gbs"], where, "bandwidth_gbs")) if "bandwidth_gbs" in g else None
    return GPU(str(g.get("name") or f"GPU {i}"), vram, vram, bandwidth)


def _read_table(path: Path) -> dict:
    try:
        text = path.read_text()
        if path.suffix.lower() == ".json":
            table = json.loads(text)
        elif path.suffix.lower() == ".toml":
            table = tomllib.loads(text)
        else:
            raise ColibriError(f"machine file {path}: name it .toml or .json (its format)")
    except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError and json's errors are ValueErrors
        raise ColibriError(f"cannot read the machine file {path} ({e})") from None
    if not isinstance(table, dict) or not table:
        raise ColibriError(f"machine file {path}: expected one table per machine ([NAME] with "
                           f"{', '.join(REQUIRED)}), found {'nothing' if not table else type(table).__name__}")
    return table


def read_machines(source: str) -> list[Machine]:
    """`--machines SOURCE`: `default` (machines.toml here) or a .toml/.json file, optionally
    followed by :NAME,NAME to take only those machines, in that order."""
    picked: list[str] = []
    where = source
    if source != "default" and not Path(source).exists() and ":" in source:
        where, _, names = source.rpartition(":")
        picked = [n.strip() for n in names.split(",") if n.strip()]
    path = DEFAULT_FILE if where == "default" else Path(where)
    if not path.is_file():
        hint = f" (`{source}` is a default machine: use --machines default:{source})" \
            if source in _read_table(DEFAULT_FILE) else ""
        raise ColibriError(f"--machines {source}: no such file{hint}; give `default`, a .toml or .json file, "
                           "or either followed by :NAME,NAME")
    table = _read_table(path)
    label = "the default machines" if where == "default" else str(path)
    unknown = [n for n in picked if n not in table]
    if unknown:
        raise ColibriError(f"--machines {source}: no machine named {unknown[0]!r} in {label}; "
                           f"it has {', '.join(table)}")
    return [machine_from_spec(name, table[name], label) for name in (picked or table)]


def parse_machine_spec(text: str) -> Machine:
    """`--machine-spec NAME:ram_gb=64,disk_gbs=2,cores=8[,mem_gbs=60][,drives=2][,vram_gb=24]`: the fields of a
    machine file in one line, vram_gb once per GPU."""
    name, sep, rest = text.partition(":")
    if not sep or not rest.strip():
        raise ColibriError(f"--machine-spec {text!r}: expected {SPEC_SYNTAX}")
    spec: dict = {}
    for item in rest.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in SPEC_KEYS:
            raise ColibriError(f"--machine-spec {text!r}: {item.strip()!r} is not one of "
                               f"{', '.join(k + '=' for k in SPEC_KEYS)} (expected {SPEC_SYNTAX})")
        try:
            number = float(value)
        except ValueError:
            raise ColibriError(f"--machine-spec {text!r}: {key}={value!r} is not a number") from None
        if key == "vram_gb":
            spec.setdefault("gpus", []).append({"name": f"GPU {len(spec.get('gpus', []))}", "vram_gb": number})
        elif key in spec:
            raise ColibriError(f"--machine-spec {text!r}: {key} is given twice")
        else:
            spec[key] = number
    return machine_from_spec(name.strip(), spec, "--machine-spec")


def named_machines(source: str | None, specs: list[str] | None) -> list[Machine]:
    """The machines of --machines and --machine-spec, in that order; a name may appear once."""
    machines = (read_machines(source) if source else []) + [parse_machine_spec(s) for s in specs or []]
    seen: set[str] = set()
    for m in machines:
        if m.name in seen:
            raise ColibriError(f"two machines are named {m.name!r} (--machines and --machine-spec); rename one")
        seen.add(m.name)
    return machines
