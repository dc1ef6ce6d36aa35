"""A colibri head process for the multi-node tests (tests/cluster/test_multinode.py): run inside
the head node's network namespace, it joins the Ray cluster at --cluster, generates greedy
tokens for each --model, and reports on stdout as JSON lines:

    {"event": "ready", "model": M, "workers": [{"pid", "node", "port"}...], "adopted": n}
    {"event": "token", "model": M, "i": i, "id": token}
    {"event": "paused", "model": M, "i": i}     then it waits for one line on stdin ("go")
    {"event": "done", "model": M, "tokens": [...], "logits": [...], "faults": n, "workers": [...]}

`--pause-at I` stops after the I-th token of a generation (the test cuts a link or kills a
node there), `--rounds N` generates N times per model (a pause before each later round lets
the test bring a node back and `--wait-workers` waits for every worker to serve again).
After the last model it waits for "exit" (close the workers) or is killed (a crash: workers
stay for the next head to adopt).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


EVENT = "@event "  # what else reaches stdout (Ray's own messages) is not an event


def say(**event) -> None:
    print(EVENT + json.dumps(event), flush=True)


def wait_line() -> str:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("stdin closed")
    return line.strip()


def workers_of(experts) -> list[dict]:
    return [{"pid": (w.info or {}).get("pid"), "node": (w.info or {}).get("node"),
             "port": (w.info or {}).get("port"), "link": w.link is not None} for w in experts.workers]


def wait_serving(experts, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with experts._lock:
            if all(experts._usable(w) for w in experts.workers):
                return
        time.sleep(0.2)
    raise SystemExit(f"workers did not all serve again within {timeout} s: {workers_of(experts)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompt", required=True, help="token ids, comma-separated")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--pause-at", type=int, action="append", default=[])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=None, help="seconds a worker may take per layer")
    ap.add_argument("--wait-workers", type=float, default=0.0,
                    help="before each later round, wait up to this long for every worker to serve")
    a = ap.parse_args()

    from colibri.engine import Engine

    prompt = [int(t) for t in a.prompt.split(",")]
    for model in a.model:
        engine = Engine.load(model, max_context=64, cluster=a.cluster, expert_workers=a.workers)
        experts = engine.experts
        if a.deadline is not None:
            experts.deadline_s = a.deadline
        say(event="ready", model=model, workers=workers_of(experts), adopted=experts.adopted)
        for round_ in range(a.rounds):
            if round_:
                say(event="paused", model=model, i=-1, round=round_)
                wait_line()
                if a.wait_workers:
                    wait_serving(experts, a.wait_workers)
                engine.reset()
            tokens = []
            for ev in engine.stream(prompt, max_tokens=a.tokens, stop_at_eos=False):
                if ev.token_id is None:
                    continue
                tokens.append(ev.token_id)
                say(event="token", model=model, i=len(tokens), id=ev.token_id)
                if len(tokens) in a.pause_at and round_ == 0:
                    say(event="paused", model=model, i=len(tokens))
                    wait_line()
            # The last position's logits over prompt + tokens in a fresh context (a prefill chunk).
            logits = engine.logits(prompt + tokens)[-1].astype(np.float64).tolist()
            say(event="done", model=model, round=round_, tokens=tokens, logits=logits, faults=experts.faults,
                workers=workers_of(experts), transport=experts.transport.as_dict())
        if model != a.model[-1]:
            experts.close()
    if wait_line() == "exit":
        experts.close()


if __name__ == "__main__":
    main()
