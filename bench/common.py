"""What every bench script shares: the machine it ran on, interleaved repeats with medians, a
`--json PATH` report, and the command line of a script's own child processes.

Stdlib only at import time: the peer children (llama.cpp's venv) import their script, and so this.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# -- machine facts ---------------------------------------------------------------------------

def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo ({} off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out.setdefault(k.strip(), v.strip())
    return out


def isa(flags: Iterable[str] | None = None) -> str:
    """The widest x86 vector class the CPU reports: "AVX-512 (VNNI, BF16, FP16), AMX", "AVX2",
    ...; the machine name elsewhere (aarch64: "NEON"/"SVE")."""
    if flags is None:
        flags = _cpuinfo().get("flags", _cpuinfo().get("Features", "")).split()
    f = set(flags)
    if "avx512f" in f:
        extra = [n for flag, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"))
                 if flag in f]
        name = "AVX-512" + (f" ({', '.join(extra)})" if extra else "")
        return name + (", AMX" if "amx_tile" in f else "")
    if "avx2" in f:
        return "AVX2" + (" (AVX-VNNI)" if "avx_vnni" in f else "")
    if "avx" in f:
        return "AVX"
    if "sse4_2" in f:
        return "SSE4.2"
    if "sve" in f:
        return "SVE"
    if "asimd" in f:
        return "NEON"
    return platform.machine() or "?"


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed: no version
        return None


def machine() -> dict:
    """Facts about this machine and run, for a report: CPU model and ISA class, cores (all and
    usable by this process), RAM, python/numpy/numba versions, the UTC date and time."""
    info = _cpuinfo()
    ram = _ram_bytes()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine() or "?",
        "isa": isa(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_threads": os.environ.get("NUMBA_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def machine_line(m: dict | None = None) -> str:
    """machine() as one printed line: "# Intel Xeon ..., AVX-512 (...), 2 cores, 24.0 GiB, ..."."""
    m = m or machine()
    return (f"# {m['cpu']}, {m['isa']}, {m['cores']} cores ({m['usable_cores']} usable), "
            f"{m['ram_gib']} GiB RAM; {m['python']}, numpy {m['numpy']}, numba {m['numba']}; {m['date']}")


# -- a named CPU target ----------------------------------------------------------------------

def add_target_args(ap) -> None:
    """--cpu / --llama-lib: measure another CPU class on the machine at hand (issue: every CPU
    class), colibri's kernels compiled for it and llama.cpp built for it, side by side."""
    ap.add_argument("--cpu", metavar="NAME",
                    help="compile colibri's kernels for this LLVM CPU (NUMBA_CPU_NAME), e.g. haswell or znver2 for "
                         "an AVX2-only machine, znver4, skylake-avx512; its own numba cache. It must be a subset "
                         "of this CPU's instructions")
    ap.add_argument("--llama-lib", metavar="DIR",
                    help="directory of a libllama built for the same target (LLAMA_CPP_LIB_PATH), e.g. "
                         "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF for the AVX2 row")


def named_cpu_env(cpu: str) -> dict:
    """The numba settings that compile for the LLVM CPU `cpu` with that CPU's own instructions:
    NUMBA_CPU_FEATURES must be set, and empty, for LLVM to take the named CPU's features; left
    unset, numba passes the host's features with the name, and `haswell` on an AVX-512 machine
    gets AVX-512 code."""
    return {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": ""}


def target_env(env: dict, a) -> dict:
    """`env` for the children of a run with `add_target_args`: NUMBA_CPU_NAME and a cache of its
    own for colibri (a cache compiled for one target is never loaded for another), the named
    libllama for llama.cpp."""
    env = dict(env)
    if getattr(a, "cpu", None):
        env.update(named_cpu_env(a.cpu))
        env["NUMBA_CACHE_DIR"] = str(Path(env.get("NUMBA_CACHE_DIR") or Path.home() / ".cache" / "colibri" / "numba")
                                     / f"target-{a.cpu}")
    if getattr(a, "llama_lib", None):
        env["LLAMA_CPP_LIB_PATH"] = str(Path(a.llama_lib).resolve())
    return env


def target_line(a) -> str:
    """How the kernels were compiled, for the report: the host, or the named target and the
    integer-dot form it gets (kernels/idot.py)."""
    if not getattr(a, "cpu", None):
        return "kernels compiled for this CPU (host)"
    from colibri.kernels.idot import isa_of

    lib = f"; llama.cpp from {a.llama_lib}" if getattr(a, "llama_lib", None) else "; llama.cpp as installed"
    return f"kernels compiled for --cpu {a.cpu} (integer dot: {isa_of(a.cpu)}){lib}"


# -- interleaved repeats ---------------------------------------------------------------------

def interleaved(variants: Iterable, repeats: int, run: Callable, *, alternate: bool = False,
                on_result: Callable | None = None) -> dict:
    """Runs every variant once per round, `repeats` rounds, in order (A B C A B C ...), so the
    machine's drift over minutes falls on all of them alike; `alternate` reverses every second
    round (A B C C B A ...), so that each goes first in turn (caches, turbo). `run(variant)` returns one result
    (a number, a dict, anything); None is a failed run and is left out. Returns
    {variant: [results, in round order]}. `on_result(variant, round, result)` sees each as it
    comes (to print raw rows)."""
    variants = list(variants)
    out: dict = {v: [] for v in variants}
    for rnd in range(repeats):
        for v in (variants[::-1] if alternate and rnd % 2 else variants):
            r = run(v)
            if on_result is not None:
                on_result(v, rnd, r)
            if r is not None:
                out[v].append(r)
    return out


def median(values: Iterable, key: str | Callable | None = None) -> float:
    """The median of `values`, or of each one's `key` (a dict key or a function); nan when
    there are none (a variant whose runs all failed)."""
    if isinstance(key, str):
        vals = [v[key] for v in values if isinstance(v, dict) and key in v]
    elif key is not None:
        vals = [key(v) for v in values]
    else:
        vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def medians(runs: dict, key: str | Callable | None = None) -> dict:
    """{variant: median} of interleaved()'s {variant: [results]}."""
    return {v: median(rs, key) for v, rs in runs.items()}


# -- JSON reports ----------------------------------------------------------------------------

def add_json_arg(ap, help: str = "also write the report as JSON to PATH ('-' or no PATH: stdout)") -> None:
    """`--json [PATH]`: bare `--json` is stdout, as the scripts that had a flag used it."""
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help=help)


def write_json(path: str | os.PathLike | None, report: dict, *, script: str | None = None,
               args=None) -> dict | None:
    """Writes `report` with the machine, the script and its arguments added; '-' is stdout, None
    writes nothing. Returns what it wrote."""
    if path is None:
        return None
    full = {"script": script or _script_name(), "machine": machine()}
    if args is not None:
        full["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    full.update(report)
    text = json.dumps(full, indent=1, default=str)
    if str(path) == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")
    return full


def _script_name() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).name


# -- child processes -------------------------------------------------------------------------

def module_command(module: str, python: str = sys.executable) -> list[str]:
    """`python -m bench.group.name`: how a script starts a child of itself (pass `__spec__.name`)."""
    return [python, "-m", module]


def child_env(env: dict | None = None) -> dict:
    """`env` (default os.environ) with the repository first on PYTHONPATH, so a child started
    from any directory or by another python (a peer venv) imports this tree's bench, tools and colibri."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env
