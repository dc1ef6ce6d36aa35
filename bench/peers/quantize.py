"""llama.cpp's own quantizer, through the llama-cpp-python binding of a peer venv: makes the
K/IQ/MXFP4 files the GGUF benchmarks run, exactly as `llama-quantize` would (the same
library call), without building the llama.cpp tools.

    PEER_VENV/bin/python -m bench.peers.quantize IN.gguf OUT.gguf Q4_K_M [--allow-requantize] [--threads 2]

TYPE is a llama_ftype name without its LLAMA_FTYPE_MOSTLY_ prefix (Q4_K_M, Q6_K, Q2_K,
IQ4_XS, Q8_0, MXFP4_MOE, ...). Runs in the peer's Python only: colibri never imports llama_cpp.
"""
from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("type", help="e.g. Q4_K_M, Q6_K, Q2_K, IQ4_XS, Q8_0, MXFP4_MOE")
    ap.add_argument("--allow-requantize", action="store_true",
                    help="the source is already quantized (e.g. a Q4_0 twin): requantize its tensors")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{a.type.upper()}", None)
    if ftype is None:
        names = sorted(n[len("LLAMA_FTYPE_MOSTLY_"):] for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        sys.exit(f"unknown type {a.type!r}; llama.cpp knows: {', '.join(names)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = a.threads
    params.allow_requantize = a.allow_requantize
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.dst.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc}) on {a.src}")
    print(f"{a.dst}: {a.type} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
