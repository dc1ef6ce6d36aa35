"""Serving several clients at once: aggregate decode tok/s and the time between a client's tokens
at 1, 2, 4 and 8 concurrent streaming clients, for `colibri serve --max-batch N` (and --max-batch 1,
one generation at a time, as the baseline), beside llama.cpp's own `llama-server --parallel N`
on the same GGUF when its path is given. Every run: greedy, distinct prompts, the same number of
tokens per client. With a streamed-experts model, colibri's GB read from disk per generated token
too (its /metrics). Benchmark only: no asserts.

    python -m bench.engine.serve_batching [--llama-server PATH] [--clients 1,2,4,8] [--tokens 128] [--rounds 3]
    python -m bench.engine.serve_batching --model /tmp/olmoe --ram-gb 1.5 --no-baseline   # streamed experts
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import add_json_arg, child_env, interleaved, machine_line, median, write_json

TOPICS = ["the history of the printing press", "how a steam engine works", "the life cycle of a star",
          "why the sky is blue", "how bees make honey", "the rules of chess", "how vaccines work",
          "the water cycle"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd: list[str], port: int, env: dict, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{cmd[0]} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def stream(url: str, model: str, prompt: str, tokens: int) -> list[float]:
    """Arrival times of a streamed completion's tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times = []
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frame = json.loads(line[6:])
                if frame.get("choices") and frame["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return times


def measure(url: str, model: str, clients: int, tokens: int) -> dict:
    results: list = [None] * clients
    go = threading.Barrier(clients + 1)

    def work(i):
        go.wait()
        results[i] = stream(url, model, f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}.", tokens)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = [b - a for times in results for a, b in zip(times, times[1:])]
    firsts = [times[0] - t0 for times in results if times]
    n = sum(len(times) for times in results)
    # Decode rate: tokens after each client's first, over the span from the first first-token to the
    # last token (prefill of the prompts is not in it).
    span = max(times[-1] for times in results) - min(times[0] for times in results)
    # Steady state: only while every client is streaming (from the last client's first token to
    # the first client's last), so the other prompts' prefill chunks, which a batch interleaves
    # with the first clients' decode steps, and the tail where fewer clients remain, are out.
    start, end = max(times[0] for times in results), min(times[-1] for times in results)
    inside = sum(1 for times in results for t in times if start < t <= end)
    return {"clients": clients, "tokens": n, "wall_s": wall, "aggregate_tok_s": (n - clients) / span if span else 0,
            "steady_tok_s": inside / (end - start) if end > start else 0.0,
            "gap_p50_ms": 1e3 * median(gaps), "gap_p99_ms": 1e3 * quantile(gaps, 0.99),
            "ttft_max_s": max(firsts)}


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def expert_bytes(url: str) -> float | None:
    m = re.search(r"^colibri_expert_bytes_read_total ([0-9.e+]+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="colibri container (default: the embedded SmolLM2)")
    ap.add_argument("--gguf", default=None, help="the GGUF for llama-server (default: SmolLM2's)")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ram-gb", default=None, help="colibri's --ram-gb (streams experts when below the model)")
    ap.add_argument("--no-baseline", action="store_true", help="skip colibri --max-batch 1")
    ap.add_argument("--rounds", type=int, default=3, help="runs per client count; the median is kept")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/serve_batching"), help="servers' logs go here")
    add_json_arg(ap)
    a = ap.parse_args()

    from colibri.default_model import default_gguf, default_model_dir

    model = a.model or str(default_model_dir(progress=False))
    gguf = a.gguf or (str(default_gguf()) if a.model is None else None)
    counts = [int(c) for c in a.clients.split(",")]
    top = max(counts)
    env = child_env({**os.environ, "NUMBA_NUM_THREADS": str(a.threads), "OMP_NUM_THREADS": str(a.threads)})
    logs = a.logs
    logs.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    engines = []
    colibri = [sys.executable, "-m", "colibri.cli", "serve", "--model", model, "--model-id", "m", "--no-persist",
               "--threads", str(a.threads), "--max-tokens", str(a.tokens), "--max-queue", str(top)]
    if a.ram_gb:
        colibri += ["--ram-gb", a.ram_gb]
    engines.append((f"colibri --max-batch {top}", colibri + ["--max-batch", str(top)]))
    if not a.no_baseline:
        engines.append(("colibri --max-batch 1", colibri + ["--max-batch", "1"]))
    if a.llama_server and gguf:
        engines.append((f"llama-server --parallel {top}",
                        [a.llama_server, "-m", gguf, "--parallel", str(top), "-c", str(top * 1024), "-t", str(a.threads),
                         "-tb", str(a.threads), "--alias", "m", "--no-webui", "-cb"]))
    # Every server stays up for the whole run and the rounds interleave them (round 1: each
    # server at each client count, then round 2, ...): this VM's speed drifts by ~10% over
    # minutes, and one server measured after another would carry the drift into the ratios.
    servers = []
    try:
        for name, cmd in engines:
            port = free_port()
            servers.append((name, Server(cmd + ["--port", str(port)], port, env, logs / f"{name.split()[0]}-{port}.log")))
            measure(servers[-1][1].url, "m", 1, 8)  # warm: kernels, caches
        urls = dict(servers)

        def once(variant):
            name, c = variant
            url = urls[name].url
            before = expert_bytes(url) if name.startswith("colibri") else None
            r = measure(url, "m", c, a.tokens)
            after = expert_bytes(url) if before is not None else None
            r["gb_per_token"] = (after - before) / r["tokens"] / 1e9 if after is not None else None
            return r

        runs = interleaved([(name, c) for name, _ in servers for c in counts], a.rounds, once)
    finally:
        for _, srv in servers:
            srv.stop()
    rows = []
    for name, _ in engines:
        for c in counts:
            got = runs[(name, c)]
            r = sorted(got, key=lambda x: x["aggregate_tok_s"])[len(got) // 2]  # the median run
            rows.append((name, r))
            print(f"{name:28} clients {c}: {r['aggregate_tok_s']:6.1f} tok/s (all streaming: {r['steady_tok_s']:.1f}), gap p50 {r['gap_p50_ms']:.1f} ms "
                  f"p99 {r['gap_p99_ms']:.1f} ms" + (f", {r['gb_per_token']:.4f} GB/token" if r["gb_per_token"] is not None else ""),
                  flush=True)
    # "x 1 client": against this configuration's own single client; "x best 1": against the
    # fastest single client of the same program in any configuration (colibri --max-batch 1
    # skips the batching machinery)
    # "all streaming": the steady-state rate while every client streams (measure()), the median
    # over the rounds, and its ratio to the single client's
    print(f"\n{'engine':28} {'clients':>7} {'agg tok/s':>9} {'x 1 client':>10} {'x best 1':>8} {'all streaming':>13} "
          f"{'x 1':>6} {'gap p50 ms':>10} {'gap p99 ms':>10} {'GB/token':>8}")
    for name, r in rows:
        one = next(x for n, x in rows if n == name and x["clients"] == min(counts))
        best = max(x["aggregate_tok_s"] for n, x in rows
                   if n.split()[0] == name.split()[0] and x["clients"] == min(counts))
        gb = f"{r['gb_per_token']:8.4f}" if r["gb_per_token"] is not None else f"{'':8}"
        steady = median(runs[(name, r["clients"])], "steady_tok_s")
        steady_one = median(runs[(name, min(counts))], "steady_tok_s")
        # (no window where every client streams: one generation at a time, --max-batch 1)
        steady_cols = f"{steady:13.1f} {steady / steady_one:5.2f}x" if steady and steady_one else f"{'-':>13} {'-':>6}"
        print(f"{name:28} {r['clients']:7} {r['aggregate_tok_s']:9.1f} {r['aggregate_tok_s'] / one['aggregate_tok_s']:9.2f}x "
              f"{r['aggregate_tok_s'] / best:7.2f}x {steady_cols} {r['gap_p50_ms']:10.1f} {r['gap_p99_ms']:10.1f} {gb}")
    write_json(a.json, {"model": model, "median_runs": [{"engine": n, **r} for n, r in rows],
                        "runs": [{"engine": n, "clients": c, "rounds": v} for (n, c), v in runs.items()]}, args=a)


if __name__ == "__main__":
    main()
