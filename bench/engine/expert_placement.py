"""Expert placement where the disk is the limit: next-layer guesses, live re-pinning, and a hot
set learned on one topic served prompts of another.

The model is a synthetic MoE with topic-dependent routing (tools/synthetic_moe.py `--topics`):
each topic heats its own experts. A training process feeds prompts of one topic, as a user's
earlier sessions would, and leaves the routing history and heat in a private COLIBRI_HOME. Each
variant then starts a fresh process from that history and is fed held-out prompts (new token
draws) of the trained topic and of another one, one prompt per turn, one token at a time
(teacher forcing: realistic routing, BENCHMARKS.md point 7). Experts are read with O_DIRECT, so
the RAM budget is the only cache and every miss is a disk read.

Variants (each placement lever off and on):
  lru          no hot set: one LRU over the budget's slots
  pin-once     half the slots pinned at start from the history, never changed
  repin        pinned at start, then following the heat at every turn end
  ... each with `+guess`: the next layer's experts guessed and read ahead (prefetch)

Printed per variant: decode tok/s per turn (the last turns show where re-pinning converged), hit
rate, GB read per token, the disk bound (bytes read / measured disk bandwidth), the guesses'
precision and recall, re-pins. Benchmark only: no asserts.

    python -m tools.synthetic_moe /tmp/q3topics --preset qwen3-30b-a3b --layers 12 --topics 4
    python -m bench.engine.expert_placement --model /tmp/q3topics --experts-per-layer 32
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import add_json_arg, child_env, interleaved, machine_line, median, module_command, write_json

VARIANTS = {  # name: (hot_set, repin, prefetch)
    "lru": (False, False, False),
    "pin-once": (True, False, False),
    "repin": (True, True, False),
    "lru+guess": (False, False, True),
    "pin-once+guess": (True, False, True),
    "repin+guess": (True, True, True),
}


def budget_gb(model: Path, experts_per_layer: float) -> float:
    from colibri.io.container import Container

    c = Container(model)
    per_layer = sum(l.blob_bytes for l in c.expert_layouts.values())
    return (c.dense_bytes + experts_per_layer * per_layer) / (1 << 30)


def prompts(model: Path, topic: int, n: int, tokens: int, seed: int) -> list[list[int]]:
    from tools import synthetic_moe

    cfg = json.loads((model / "config.json").read_text())
    return [synthetic_moe.topic_tokens(cfg, topic, tokens, seed=seed * 1000 + i) for i in range(n)]


# ----------------------------------------------------------------------------- child runs

def child(a) -> dict:
    """One process: load from the history in COLIBRI_HOME, feed each prompt as a turn."""
    from colibri import Engine

    hot_set, repin, prefetch = VARIANTS[a.variant] if a.variant != "train" else (True, True, False)
    e = Engine.load(a.model, ram_gb=budget_gb(a.model, a.experts_per_layer), stream_experts=True,
                    expert_io=a.expert_io, hot_set=hot_set, repin=repin, prefetch=prefetch,
                    read_threads=a.read_threads, max_context=a.tokens + 16)
    turns = []
    for ids in prompts(a.model, a.topic, a.prompts, a.tokens, a.seed):
        s0 = dict(e.expert_stats)
        e.reset()
        times = e.feed(ids)
        s1 = dict(e.expert_stats)
        d = {k: s1[k] - s0[k] for k in ("hits", "misses", "bytes_read", "wait_s", "predicted", "predicted_used",
                                        "needed", "guess_reads", "guess_reads_used", "repins")}
        d.update(tok_s=len(times[1:]) / sum(times[1:]), seconds=sum(times), tokens=len(times))
        turns.append(d)
    e.close()
    return {"turns": turns}


def run_child(a, variant: str, topic: int, home: Path, seed: int) -> dict:
    cmd = [*module_command(__spec__.name), "--child", variant, "--model", str(a.model), "--topic", str(topic),
           "--prompts", str(a.prompts if variant != "train" else a.train_prompts), "--tokens", str(a.tokens),
           "--experts-per-layer", str(a.experts_per_layer), "--expert-io", a.expert_io,
           "--read-threads", str(a.read_threads), "--seed", str(seed)]
    env = child_env(dict(os.environ, COLIBRI_HOME=str(home)))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(turns: list[dict], disk_bps: float) -> dict:
    tokens = sum(t["tokens"] for t in turns)
    asked = sum(t["hits"] + t["misses"] for t in turns)
    read = sum(t["bytes_read"] for t in turns)
    predicted, used, needed = (sum(t[k] for t in turns) for k in ("predicted", "predicted_used", "needed"))
    return {"tok_s": tokens / sum(t["seconds"] for t in turns), "tok_s_turns": [round(t["tok_s"], 2) for t in turns],
            "hit_rate": sum(t["hits"] for t in turns) / asked if asked else None,
            "gb_per_token": read / tokens / 1e9, "disk_bound_tok_s": disk_bps * tokens / read if read else None,
            "precision": used / predicted if predicted else None, "recall": used / needed if needed else None,
            "guess_reads": sum(t["guess_reads"] for t in turns), "guess_reads_used": sum(t["guess_reads_used"] for t in turns),
            "repins": sum(t["repins"] for t in turns), "wait_share": sum(t["wait_s"] for t in turns) / sum(t["seconds"] for t in turns)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a synthetic MoE written with --topics")
    ap.add_argument("--experts-per-layer", type=float, default=32, help="RAM budget in experts per MoE layer")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per prompt (one prompt per turn)")
    ap.add_argument("--prompts", type=int, default=6, help="measured prompts (turns) per variant and topic")
    ap.add_argument("--train-prompts", type=int, default=6, help="prompts of the trained topic before the runs")
    ap.add_argument("--train-topic", type=int, default=0)
    ap.add_argument("--test-topic", type=int, default=1, help="the held-out topic")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--expert-io", default="direct")
    ap.add_argument("--read-threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--disk-gbps", type=float, default=None, help="the disk's read bandwidth (default: measured)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--topic", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    add_json_arg(ap)
    a = ap.parse_args()
    if a.child:
        a.variant = a.child
        print(json.dumps(child(a)))
        return

    from bench.peers.expert_streaming import disk_bandwidth

    print(machine_line())
    disk_bps = a.disk_gbps * 1e9 if a.disk_gbps else disk_bandwidth(a.model)
    print(f"# disk {disk_bps / 1e9:.2f} GB/s (O_DIRECT, 4 MiB reads); budget {a.experts_per_layer:g} experts per "
          f"MoE layer ({budget_gb(a.model, a.experts_per_layer):.2f} GiB with the dense weights); "
          f"{a.prompts} prompts x {a.tokens} tokens per run")
    trained = Path(tempfile.mkdtemp(prefix="colibri-placement-"))
    try:
        t0 = time.perf_counter()
        if run_child(a, "train", a.train_topic, trained, seed=0) is None:
            sys.exit("the training run failed")
        print(f"# trained on topic {a.train_topic}: {a.train_prompts} prompts in {time.perf_counter() - t0:.0f} s")

        def one(key):
            variant, topic = key
            home = Path(tempfile.mkdtemp(prefix="colibri-placement-run-"))
            try:
                shutil.copytree(trained, home, dirs_exist_ok=True)  # every run starts from the same history
                r = run_child(a, variant, topic, home, seed=1 + topic)
                return None if r is None else summarize(r["turns"], disk_bps)
            finally:
                shutil.rmtree(home, ignore_errors=True)

        keys = [(v, t) for t in (a.train_topic, a.test_topic) for v in a.variants.split(",")]
        runs = interleaved(keys, a.repeats, one, alternate=True,
                           on_result=lambda k, rnd, r: print(f"  {k[0]:15s} topic {k[1]} round {rnd}: {r}", flush=True))
    finally:
        shutil.rmtree(trained, ignore_errors=True)
    print(f"\n| variant | topic | tok/s | last turn tok/s | hit rate | GB/token | disk bound tok/s | precision | recall | re-pins |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    report = {}
    for (variant, topic), rs in runs.items():
        if not rs:
            continue
        row = {k: median(rs, k) for k in ("tok_s", "hit_rate", "gb_per_token", "disk_bound_tok_s", "repins")}
        row["last_turn_tok_s"] = median(rs, lambda r: r["tok_s_turns"][-1])
        for k in ("precision", "recall"):
            row[k] = median(rs, k) if rs[0][k] is not None else None
        report[f"{variant}@{topic}"] = {"median": row, "runs": rs}
        fmt = lambda v, f: "-" if v is None else format(v, f)
        which = "trained" if topic == a.train_topic else "held-out"
        print(f"| {variant} | {topic} ({which}) | {row['tok_s']:.2f} | {row['last_turn_tok_s']:.2f} | "
              f"{row['hit_rate']:.3f} | {row['gb_per_token']:.3f} | {fmt(row['disk_bound_tok_s'], '.2f')} | "
              f"{fmt(row['precision'], '.3f')} | {fmt(row['recall'], '.3f')} | {row['repins']:.0f} |")
    write_json(a.json, {"disk_bps": disk_bps, "results": report}, args=a)


if __name__ == "__main__":
    main()
