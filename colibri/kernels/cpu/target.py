"""The CPU numba compiles colibri's kernels for, as the kernels choose their instruction forms:
the host, or a target named by NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (bench --cpu), read from the
name and the flags, never from the host. Chosen at compile time, so a cache compiled for a
named target uses exactly what that target has.
"""
from __future__ import annotations

import os

# Target CPUs (NUMBA_CPU_NAME) by the integer dot instructions they have: a cache compiled for a
# named target (bench option --cpu, a portable cache) uses exactly what that target has.
_VNNI_CPUS = {"cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
              "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "znver4", "znver5"}
_AVX2_CPUS = _VNNI_CPUS | {"haswell", "broadwell", "skylake", "skylake-avx512", "alderlake", "raptorlake",
                           "meteorlake", "arrowlake", "lunarlake", "znver1", "znver2", "znver3", "x86-64-v3",
                           "x86-64-v4"}


def isa_of(cpu_name: str, cpu_features: str = "") -> str:
    """The integer-dot form ("vnni", "avx2" or "generic") numba's code for the LLVM CPU
    `cpu_name` with the +/- feature list `cpu_features` (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)
    gets: read from the name and the list, never from the host."""
    name, flags = cpu_name.lower(), _flags(cpu_features)
    vnni = all(flags.get(k, name in _VNNI_CPUS) for k in ("avx512vnni", "avx512bw", "avx512vl"))
    return "vnni" if vnni else "avx2" if flags.get("avx2", name in _AVX2_CPUS) else "generic"


def _flags(cpu_features: str) -> dict:
    """A +/- feature list ("+avx2,-avx512f") as {feature: wanted}."""
    return {f[1:]: f[0] == "+" for f in cpu_features.replace(" ", "").split(",") if f}


def _named_target() -> tuple[str, str] | None:
    """(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES) where numba compiles for a named target rather than
    the host."""
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host" or config.CPU_FEATURES:
        return config.CPU_NAME or "", config.CPU_FEATURES or ""
    return None


def native_isa() -> str:
    """The integer dot instructions of the CPU numba compiles for: "vnni" (AVX-512 VNNI
    `vpdpbusd`), "avx2" (`vpmaddubsw` + `vpmaddwd`, as llama.cpp's AVX2 path) or "generic"
    (portable IR); a named target by `isa_of`."""
    named = _named_target()
    if named:
        return isa_of(*named)
    import llvmlite.binding as llvm

    f = llvm.get_host_cpu_features()
    vnni = all(f.get(k, False) for k in ("avx512vnni", "avx512vl", "avx512bw"))
    return "vnni" if vnni else "avx2" if f.get("avx2", False) else "generic"


def target_isa() -> str:
    """native_isa, or a narrower form forced by COLIBRI_IDOT=avx2 / generic (the tests compare
    them)."""
    best = native_isa()
    forced = os.environ.get("COLIBRI_IDOT")
    order = ("generic", "avx2", "vnni")
    if forced in order and order.index(forced) < order.index(best):
        return forced
    return best


_AVX512_CPUS = _VNNI_CPUS | {"skylake-avx512", "x86-64-v4", "knl", "knm"}


def narrow_tiles() -> bool:
    """Whether the target has 16 vector registers rather than AVX-512's 32 (AVX2 and older): the
    decode tiles then hold their 16-lane vectors as 8-lane halves (cpu/codegen.py), since 16 x 16
    lanes of accumulators and activations do not fit in 16 ymm registers and LLVM spilled them
    every block. COLIBRI_TILES=narrow / wide forces a form (the tests compare them)."""
    forced = os.environ.get("COLIBRI_TILES")
    if forced in ("narrow", "wide"):
        return forced == "narrow"
    named = _named_target()
    if named:
        name, features = named
        return not _flags(features).get("avx512f", name.lower() in _AVX512_CPUS)
    import llvmlite.binding as llvm

    return not llvm.get_host_cpu_features().get("avx512f", False)


# Every CPU with AVX2 has F16C (vcvtph2ps): half -> float in one instruction.
F16C = native_isa() in ("avx2", "vnni")

# x86's byte shuffle (SSSE3 pshufb, on every x86-64 CPU colibri targets) looks 16 table entries up
# in one instruction; elsewhere the kernels that need it take a generic form.
def _pshufb() -> bool:
    import llvmlite.binding as llvm

    return (llvm.get_process_triple().startswith(("x86_64", "i686"))
            and bool(llvm.get_host_cpu_features().get("ssse3", False)))


PSHUFB = _pshufb()
