"""Where a short-context decode token's time goes, against the read-bandwidth roof (issue 15,
item 1). On the default model (SmolLM2 Q4_1) unless --model is given. Benchmark only: no asserts.

    python -m bench.engine.decode_phases [--model DIR] [--activations f32|int8] [--tokens 200] [--rounds 3]

Prints, for a token decoded after a ~150-token prompt (--context N for another length):
- the token's time two ways, interleaved: every layer in one compiled call (the default,
  decode.token_layers) and the layers one by one (two compiled calls per layer, as before);
- the per-layer path's phase clock (embedding, attention blocks, feed-forward blocks, head);
- the matrix kernels alone on the token's weights, once with the weights in the CPU caches
  (one layer's matrix, repeated) and once streamed from memory (every layer's in turn, as a
  token reads them): how fast the arithmetic is, and what reading from DRAM adds;
- where the default path's token goes: the embedding and RoPE tables, the one compiled call
  through every layer, the head (final norm and lm_head), and the rest of forward();
- the roof: the token's weight bytes over the measured read bandwidth (bench/membw.py), and
  the same bytes read matrix by matrix by a plain sum with no arithmetic in the way
  (membw.read_bandwidth_each): once with each thread reading its own share of every matrix and
  never waiting, once with the threads sharing each matrix and meeting after it, as a token
  reads them. The three bandwidths apart say what splitting the bytes into matrices costs and
  what the meetings add.
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, interleaved, machine_line, median, write_json


def _per_token(fn, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="container directory (default: the embedded SmolLM2)")
    ap.add_argument("--activations", default="f32", choices=["f32", "int8"])
    ap.add_argument("--tokens", type=int, default=200, help="decode steps per timing")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=150,
                    help="prompt tokens before the timed tokens (150; e.g. 8160 for issue 15's item 2)")
    add_json_arg(ap)
    a = ap.parse_args()

    from bench.membw import read_bandwidth, read_bandwidth_each
    from numba import get_num_threads

    from colibri import Engine
    from colibri.generate import decode_one
    from colibri.kernels import idot
    from colibri.profile import PHASES

    e = Engine.load(a.model, activations=a.activations)
    m = e.model
    out: dict = {}

    def work():
        # Every parallel kernel on this one thread: OpenMP keeps a team per calling thread, and
        # with more teams than cores it stops spinning between regions (27 ms a token here
        # instead of 8 when the bandwidth probe ran on the main thread first).
        out["bw"] = read_bandwidth()
        out["bw_each"] = read_bandwidth_each(_token_arrays(m))
        out["bw_apart"] = read_bandwidth_each(_token_arrays(m), meet=False)
        cache = m.new_cache(a.context + a.tokens + 8)
        for p0 in range(0, a.context, 512):  # prefill in chunks, as the engine does
            m.forward(np.arange(p0, min(a.context, p0 + 512)) % e.vocab_size, cache)
        start = cache.length

        def decode(i):
            decode_one(m, cache, 100 + i % 50)

        def run(program):
            m._program = program
            cache.length = start
            return _per_token(decode, a.tokens)

        covered = m._token_program() is not None
        for program in (None, False):  # compile (or load) both paths' kernels outside the timing
            m._program = program
            cache.length = start
            decode(0)
        runs = interleaved([None, False] if covered else [False], a.rounds, run)
        whole, layers = runs.get(None, []), runs[False]
        if covered:
            m._program = None
            split = [_one_call_split(m, cache, start, a.tokens) for _ in range(a.rounds)]
            out["split"] = {k: median(split, k) for k in split[0]}
        m._program = None
        cache.length = start
        PHASES.start()
        total = _per_token(decode, a.tokens)
        seconds = PHASES.stop()
        phases: dict[str, float] = {}
        for (phase, _), s in seconds.items():
            phases[phase] = phases.get(phase, 0.0) + s / a.tokens
        phases["other"] = total - sum(phases.values())
        out.update(covered=covered, whole=whole, layers=layers, phases=phases, kernels=_kernels(m, idot))

    th = threading.Thread(target=work)  # off the main thread, as the engine runs them
    th.start()
    th.join()
    bw = out["bw"]
    weight_bytes = _weight_bytes(m)
    roof = weight_bytes / bw
    print(machine_line())
    print(f"model {Path(e.container.dir).name}, activations {a.activations}, threads {get_num_threads()}")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; weights read per token {weight_bytes / 1e6:.1f} MB; "
          f"roof {roof * 1e3:.2f} ms = {1 / roof:.0f} tok/s")
    rows = ([("every layer in one call", out["whole"])] if out["covered"] else []) + [
        ("layer by layer", out["layers"])]
    bw_each = out["bw_each"]
    bw_apart = out["bw_apart"]
    print(f"the same bytes read matrix by matrix, each thread its own share of each, never meeting: "
          f"{bw_apart / 1e9:.1f} GB/s, {weight_bytes / bw_apart * 1e3:.2f} ms")
    print(f"the same bytes read matrix by matrix (a plain sum, the threads meeting after each): "
          f"{bw_each / 1e9:.1f} GB/s, {weight_bytes / bw_each * 1e3:.2f} ms")
    print(f"{'decode path':28} {'ms/token':>9} {'tok/s':>7} {'% of roof':>9}   (median of {a.rounds})")
    for name, ts in rows:
        t = median(ts)
        print(f"{name:28} {t * 1e3:9.2f} {1 / t:7.1f} {roof / t:9.0%}")
    if "split" in out:
        sp = dict(out["split"])
        forward = sp.pop("forward")
        print(f"the one-call path's token, {forward * 1e3:.2f} ms (its parts run alternately with it): "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sp.items()))
    print("phase clock of the layer-by-layer path (ms/token): "
          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in out["phases"].items()))
    print(f"{'matrices (all layers)':28} {'MB':>6} {'in cache ms':>11} {'GB/s':>6} {'streamed ms':>11} {'GB/s':>6}")
    for name, (nbytes, hot, cold) in out["kernels"].items():
        print(f"{name:28} {nbytes / 1e6:6.1f} {hot * 1e3:11.2f} {nbytes / hot / 1e9:6.1f} {cold * 1e3:11.2f} "
              f"{nbytes / cold / 1e9:6.1f}")
    write_json(a.json, {"model": str(e.container.dir), "read_bandwidth_gbs": bw / 1e9, "weight_bytes": weight_bytes,
                        "roof_s": roof, **{k: v for k, v in out.items() if k != "kernels"},
                        "kernels": {k: dict(zip(("bytes", "hot_s", "cold_s"), v)) for k, v in out["kernels"].items()}},
               args=a)


def _one_call_split(m, cache, start: int, n: int) -> dict:
    """Seconds per token of the one-call path's parts, run as DecoderModel.forward runs them
    for one token (this bench's copy of its steps: keep them in step with forward), and of
    forward() itself, the two alternating token by token so that both see the same machine."""
    from colibri.generate import decode_one
    from colibri.kernels import idot
    from colibri.kernels.cpu import embedding
    from colibri.models.layers import linear, rms_norm

    program = m._token_program()
    parts = {"embedding + RoPE": 0.0, "layers (one call)": 0.0, "head": 0.0}
    whole = 0.0
    cache.length = start
    for i in range(n):
        token = 100 + i % 50
        t0 = time.perf_counter()
        decode_one(m, cache, token)
        whole += time.perf_counter() - t0
        cache.length -= 1  # the same position again, by the parts
        with idot.activations(m.activations):
            pos = cache.length
            t0 = time.perf_counter()
            cos, sin = m.rope.cos_sin(np.arange(pos, pos + 1))
            x = embedding(m.embed, np.asarray([token], np.int64))
            t1 = time.perf_counter()
            x = m._token_layers(program, x, cache, pos, cos, sin)
            cache.length = pos + 1
            t2 = time.perf_counter()
            linear(rms_norm(x, m.norm, m.args.rms_norm_eps), m.lm_head)
            t3 = time.perf_counter()
        parts["embedding + RoPE"] += t1 - t0
        parts["layers (one call)"] += t2 - t1
        parts["head"] += t3 - t2
    parts["the rest of forward()"] = whole - sum(parts.values())
    return {k: v / n for k, v in parts.items()} | {"forward": whole / n}


def _token_arrays(m) -> list:
    """The arrays a token's matrix products read, in the order it reads them."""
    arrays = []
    for layer in m.layers:
        attn_args, mlp_args = layer._fused if layer._fused is not None else layer._build_fused()
        for w in ([attn_args[1], attn_args[3]] if attn_args else []) + ([mlp_args[1], mlp_args[3]] if mlp_args else []):
            arrays += [w[0], w[1]] + ([w[2]] if w[2] is not w[1] else [])
    head = m.lm_head
    arrays += [getattr(head, k) for k in ("q", "scales", "mins") if getattr(head, k, None) is not None]
    return arrays


def _weight_bytes(m) -> int:
    return sum(a.nbytes for a in _token_arrays(m))


def _kernels(m, idot) -> dict:
    """Per matrix kind: (bytes over all layers, seconds for all layers with one layer's matrix
    in cache, seconds streaming every layer's)."""
    from numba import get_num_threads

    from colibri.kernels.cpu.matvec import matvec_int4
    from colibri.memory import Slab

    nthreads = get_num_threads()
    int8 = idot.current() == "int8" or m.activations == "int8"
    fused = [layer._fused for layer in m.layers if layer._fused and layer._fused[0] and layer._fused[1]]
    if not fused:
        return {}
    kinds = {"q/k/v": [f[0][1] for f in fused], "o": [f[0][3] for f in fused],
             "gate/up": [f[1][1] for f in fused], "down": [f[1][3] for f in fused]}
    result = {}
    for name, ws in kinds.items():
        xs = [np.random.default_rng(0).standard_normal(w[0].shape[1] * 2).astype(np.float32) for w in ws]
        ys = [np.empty(w[0].shape[0], np.float32) for w in ws]
        prepared = [idot.quantize(x, w[4]) for x, w in zip(xs, ws)]

        def one(w, x, xa, y):
            q, s, o, c, h, cs, ilv = w
            if int8:
                idot.matvec_prepared(q, s, o, c, h, ilv, xa, y, nthreads)
            else:
                matvec_int4(q, s, o, c, h, cs, ilv, x, y, nthreads)

        def hot():
            for _ in ws:
                one(ws[0], xs[0], prepared[0], ys[0])

        hot()
        best_hot = min(_per_token(lambda i: hot(), 20) for _ in range(3))
        # Streamed: copies of every layer's matrices (in huge pages, as the model's), cycled past
        # 256 MB, so each matrix comes from memory as in a token.
        nbytes = sum(w[0].nbytes + w[1].nbytes + (w[2].nbytes if w[2] is not w[1] else 0) for w in ws)
        slab = Slab()
        copies = [[tuple(slab.copy(p) if isinstance(p, np.ndarray) else p for p in w) for w in ws]
                  for _ in range(max(2, -(-(256 << 20) // nbytes)))]

        def cold(i):
            for w, x, xa, y in zip(copies[i % len(copies)], xs, prepared, ys):
                one(w, x, xa, y)

        cold(0)
        best_cold = min(_per_token(cold, len(copies)) for _ in range(3))
        result[name] = (nbytes, best_hot, best_cold)
    return result


if __name__ == "__main__":
    main()
