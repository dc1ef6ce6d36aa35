"""Expert-parallel decode on a local Ray cluster (colibri/cluster) against one process.

1. The transport at the sizes a MoE layer sends: one decode row up to a prefill chunk, round
   trip to an actor that returns it: as a Ray call (the array passed in the call: Ray inlines
   it under 100 KiB, else puts it in the shared-memory object store; or ray.put first and the
   reference passed), and over the actor's wire (colibri/cluster/wire.py: one TCP connection).
2. Decode and prefill tok/s with every expert resident: one process against the head plus N
   workers over each wire (tcp, ray), and where the cluster's time per MoE layer goes
   (workers' compute, transport, head fallback).
3. Experts that do not fit one process's budget: one process streaming under budget B, against
   N workers each with the same budget B holding their shard (hit rate and disk reads over
   the timed pass, after a warm-up pass).

In every configuration the engine first generates GREEDY tokens (--greedy) after an 8-token
prompt; the bench prints whether the cluster's tokens are one process's, token for token.

Decode is a fixed forced token sequence fed one token at a time (Engine.feed), after one
untimed pass over it. Each figure is from this machine as printed; nothing is projected.

    python -m tools.synthetic_moe /tmp/olmoe-1b-7b --preset olmoe-1b-7b
    python -m bench.scale.cluster --model /tmp/olmoe-1b-7b --workers 2
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, machine_line, median, write_json


def transport(repeats: int, width: int) -> list[dict]:
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def back(self, a):
            return a

        def wire(self, secret):  # the same rows back over a WireServer of this actor
            from colibri.cluster.wire import WireServer

            self.server = WireServer(ray.util.get_node_ip_address(), secret,
                                     lambda prefix, x, w, ids, experts, one, mode: (x, 0.0))
            return ray.util.get_node_ip_address(), self.server.port

    from colibri.cluster.wire import WireLink

    echo = Echo.remote()
    ray.get(echo.back.remote(np.zeros(1, np.float32)))
    secret = os.urandom(32)
    link = WireLink(*ray.get(echo.wire.remote(secret)), secret)
    rows = []
    for n in (1, 8, 64, 512):
        a = np.random.default_rng(0).standard_normal((n, width)).astype(np.float32)
        weights, ids = np.ones((n, 1), np.float32), np.zeros((n, 1), np.int64)
        for how in ("in the call", "ray.put first", "wire"):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                if how == "wire":
                    link.send("p", a, weights, ids, [0], True, "f32")
                    out = link.receive(30.0)[0]
                else:
                    arg = a if how == "in the call" else ray.put(a)
                    out = ray.get(echo.back.remote(arg))
                times.append(time.perf_counter() - t0)
            assert np.array_equal(out, a)
            rows.append({"rows": n, "bytes": a.nbytes, "how": how, "ms": 1e3 * median(times)})
    link.close()
    ray.kill(echo)
    return rows


def measure(model: Path, seq: list[int], prompt: list[int] | None = None, greedy: int = 24, **options) -> dict:
    """Decode tok/s over `seq` (and prefill tok/s of `prompt`, when given), with the expert
    store's figures and the cluster's time per MoE layer over the timed decode pass; first
    (untimed) `greedy` greedy tokens after seq[:8], to compare between configurations."""
    from colibri import Engine
    from colibri.cluster.head import Transport

    t0 = time.perf_counter()
    e = Engine.load(model, max_context=max(len(seq) + len(prompt or []), 8 + greedy) + 8, **options)
    load_s = time.perf_counter() - t0
    cluster = hasattr(e.experts, "compute")
    row = {"load_s": load_s, "moe_layers": len(e.container.expert_layouts)}
    row["greedy"] = e.generate(seq[:8], max_tokens=greedy, stop_at_eos=False).token_ids
    e.reset()
    if prompt:
        e.generate(prompt, max_tokens=1)  # untimed: the prefill kernels compiled or loaded
        best = None
        for _ in range(2):
            e.reset()
            if cluster:
                e.experts.transport = Transport()
            g = e.generate(prompt, max_tokens=1)
            if best is None or g.prefill_tok_s > best[0]:
                best = (g.prefill_tok_s, e.experts.transport.as_dict() if cluster else None)
        row["prefill_tok_s"] = best[0]
        if cluster:
            row["prefill_per_layer"] = best[1]
    e.reset()
    e.feed(seq)  # untimed: kernels compiled or loaded, experts faulted in, caches warm
    if cluster:
        e.experts.transport = Transport()
    before = e.expert_stats
    e.reset()
    times = e.feed(seq)
    after = e.expert_stats
    row["tok_s"] = len(times) / sum(times)
    if before is not None and after is not None:
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        row.update(hit_rate=hits / (hits + misses) if hits + misses else None,
                   disk_reads=after["reads"] - before["reads"], gb_read=(after["bytes_read"] - before["bytes_read"]) / 1e9)
    if cluster:
        row["per_layer"] = e.experts.transport.as_dict()
        row["faults"] = e.experts.faults
        e.experts.close()
    del e
    gc.collect()
    return row


def same(single: dict, cluster: dict, n: int) -> str:
    if single["greedy"] == cluster["greedy"]:
        return f"identical to one process ({n} tokens)"
    first = next(i for i, (a, b) in enumerate(zip(single["greedy"], cluster["greedy"])) if a != b)
    return f"DIFFER from one process at token {first}: {single['greedy']} vs {cluster['greedy']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt prefilled in part 2")
    ap.add_argument("--rounds", type=int, default=2, help="one process / cluster pairs in part 2")
    ap.add_argument("--budget-workers", type=int, default=3, help="workers in part 3")
    ap.add_argument("--budget-share", type=float, default=0.4,
                    help="budget B for part 3, as a share of all the experts' bytes")
    ap.add_argument("--budget-tokens", type=int, default=96, help="forced tokens in part 3")
    ap.add_argument("--repeats", type=int, default=50, help="round trips per size in part 1")
    ap.add_argument("--greedy", type=int, default=24, help="greedy tokens compared in every configuration")
    add_json_arg(ap)
    a = ap.parse_args()

    from colibri.cluster.head import connect
    from colibri.io.container import Container

    c = Container(a.model)
    experts_gb, dense_gb = c.expert_bytes / 2**30, c.dense_bytes / 2**30
    width = int(c.config["hidden_size"])
    tokens = np.random.default_rng(0).integers(100, int(c.config["vocab_size"]) - 1,
                                               size=max(a.tokens, a.budget_tokens) + a.prompt_tokens).tolist()
    seq, prompt = tokens[:a.tokens], tokens[-a.prompt_tokens:]
    print(machine_line())
    print(f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"{a.model.name}: {len(c.expert_layouts)} MoE layers, experts {experts_gb:.2f} GiB, dense {dense_gb:.2f} GiB; "
          f"{a.workers} workers; {a.tokens} forced tokens", flush=True)
    connect("local")
    report = {"model": str(a.model), "workers": a.workers, "tokens": a.tokens}

    report["transport"] = transport(a.repeats, width)
    print("\n1. round trip to an actor returning the array (median ms)")
    for r in report["transport"]:
        print(f"   {r['rows']:4d} rows x {width} f32 ({r['bytes'] / 1024:7.0f} KiB), {r['how']:13s}: {r['ms']:.3f}")

    print("\n2. all experts resident", flush=True)
    report["resident"] = []
    for _ in range(a.rounds):  # interleaved: the machine's other load drifts between runs
        single = measure(a.model, seq, prompt, a.greedy, stream_experts=False)
        print(f"   one process:      decode {single['tok_s']:.2f} tok/s, prefill {single['prefill_tok_s']:.1f} tok/s",
              flush=True)
        entry = {"single": single}
        for wire in ("tcp", "ray"):
            cluster = measure(a.model, seq, prompt, a.greedy, cluster="local", expert_workers=a.workers,
                              cluster_wire=wire)
            print(f"   head + {a.workers} workers, {wire} wire: decode {cluster['tok_s']:.2f} tok/s, prefill "
                  f"{cluster['prefill_tok_s']:.1f} tok/s", flush=True)
            for what, p in (("decode", cluster["per_layer"]),
                            (f"prefill ({a.prompt_tokens} tokens)", cluster["prefill_per_layer"])):
                print(f"     {what}, per MoE layer: {p['wall_ms_per_layer']:.2f} ms = workers computing "
                      f"{p['compute_ms_per_layer']:.2f} + transport {p['transport_ms_per_layer']:.2f} (+ head "
                      f"fallback {p['local_ms_per_layer']:.2f})", flush=True)
            print(f"     greedy tokens: {same(single, cluster, a.greedy)}", flush=True)
            entry[f"cluster_{wire}"] = cluster
        report["resident"].append(entry)

    budget = a.budget_share * experts_gb
    print(f"\n3. expert budget B = {budget:.2f} GiB per process ({a.budget_share:.0%} of the experts), "
          f"{a.budget_tokens} forced tokens", flush=True)
    seq = tokens[:a.budget_tokens]
    squeezed = measure(a.model, seq, greedy=a.greedy, stream_experts=True, ram_gb=dense_gb + budget)
    print(f"   one process under B:     {squeezed['tok_s']:.2f} tok/s, hit rate {squeezed['hit_rate']:.3f}, "
          f"{squeezed['disk_reads']} disk reads ({squeezed['gb_read']:.2f} GB)", flush=True)
    spread = measure(a.model, seq, greedy=a.greedy, cluster="local", expert_workers=a.budget_workers,
                     worker_ram_gb=budget)
    print(f"   {a.budget_workers} workers, B each:       {spread['tok_s']:.2f} tok/s, hit rate {spread['hit_rate']:.3f}, "
          f"{spread['disk_reads']} disk reads ({spread['gb_read']:.2f} GB)", flush=True)
    print(f"   greedy tokens: {same(squeezed, spread, a.greedy)}", flush=True)
    report["over_budget"] = {"budget_gib": budget, "single": squeezed, "cluster": spread}
    write_json(a.json, report, args=a)


if __name__ == "__main__":
    main()
