"""bench/serve/soak.py still runs: a 20-second soak of its two real servers (the tiny synthetic
MoE with its experts streamed, and on a local Ray cluster whose expert worker is SIGKILLed),
every kind of request sent, and its JSON report checked rather than its exit status alone."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_holds(tmp_path):
    for client in ("openai", "anthropic"):
        pytest.importorskip(client)
    cluster = importlib.util.find_spec("ray") is not None
    report = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.serve.soak", "--minutes", "0.3", "--sample-s", "1", "--probe-every", "5",
           "--header-timeout", "2", "--wave-s", "4", "--work", str(tmp_path / "work"), "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(cmd + ([] if cluster else ["--no-cluster"]), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    r = json.loads(report.read_text())
    assert r["script"] == "bench.serve.soak" and r["ok"]
    assert r["unexpected"] == {}, r["unexpected_examples"]
    # every probe (start, every 5 s, after the kill, end; both servers) gave the first one's tokens
    assert r["probe"]["identical"] and r["probe"]["count"] >= (5 if cluster else 2)
    assert all(p["identical"] for p in r["probe"]["probes"])
    # every kind of request was answered as it should be, malformed ones with their 4xx
    served = r["kinds"]["streamed"]
    assert all(k["served"] > 0 for k in served.values()), served
    assert r["expected"] and {k.split()[0] for k in r["expected"]} <= {"400", "403", "404", "413", "415", "429",
                                                                       "503"}
    assert served["leave"]["served"] <= r["servers"]["streamed"]["cancelled"] + 1  # the one at the stop may finish
    for name, s in r["servers"].items():
        assert s["exit_code"] == 0 and s["active"] == 0 and s["queued"] == 0 and s["failed"] == 0, (name, s)
        assert len(r["samples"][name]) >= 5 and all(x["rss_mb"] > 0 and x["fds"] > 0 for x in r["samples"][name])
    assert r["servers"]["streamed"]["expert_misses"] > 0  # the experts were read from disk
    if r["wave"]:  # 127.0.1.x bound (Linux): every dripper was cut off at the header deadline
        assert r["wave"]["closes"].get("408", 0) > 0 and r["wave"]["uncut"] == 0, r["wave"]
    if cluster:
        assert sum(k["served"] for k in r["kinds"]["cluster"].values()) > 0
        kill = r["worker_kill"]
        assert kill["pid"] and kill["pid"] not in kill["workers_after"] and kill["new_worker_s"] is not None
        assert r["servers"]["cluster"]["worker_faults"] >= 1
        assert any(p["when"] == "after the kill" and p["identical"] for p in r["probe"]["probes"])
