"""--cluster across real network addresses: a Ray head and two worker nodes, each in its own
network namespace with its own address (tools/netns_cluster.py), and colibri's head as a real
process on the head node (tests/cluster/head_driver.py). Greedy tokens and logits equal one
process's for every MoE family of the suite (tests/cluster/cluster_models.py); a worker node's link cut mid-generation, a worker node killed,
and the colibri head killed change no token, and the workers come back on their nodes (or, for
the head, are adopted with their shards loaded). Ray token auth keeps a driver without the
token out; nothing listens outside the namespaces' addresses."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cluster_models import HF_VOCAB  # fixtures `models`, `hf_models`: conftest.py
from colibri.engine import Engine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(Path(__file__).with_name("head_driver.py"))
PROMPT = np.random.default_rng(1).integers(0, HF_VOCAB, size=8).tolist()
TOKENS = 8


@pytest.fixture(scope="module")
def cluster():
    from tools import netns_cluster

    why = netns_cluster.why_unavailable()
    if why is not None:
        if "not installed" in why:
            from requirements import missing

            missing(why)
        pytest.skip(why)
    # A cut link is noticed by Ray's health checks within seconds, not the default ~minute.
    c = netns_cluster.NetnsCluster(3, cpus=2, ray_env=netns_cluster.FAST_FAILURE_DETECTION,
                                   env={"PYTHONPATH": str(ROOT)})
    before = set(netns_cluster._parse_ss(subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout))
    c.start()
    c.root_listening_before = before
    yield c
    c.close()


@pytest.fixture(scope="module")
def every_model(models, hf_models):
    """Every MoE family of the suite: the synthetic presets' and the transformers checkpoints'."""
    return {family: str(path) for family, path in {**models, **hf_models}.items()}


@pytest.fixture(scope="module")
def expected(every_model):
    """One process's greedy tokens and last logits for each model."""
    out = {}
    for family, model in every_model.items():
        e = Engine.load(model, max_context=64, stream_experts=False)
        tokens = e.generate(PROMPT, max_tokens=TOKENS, stop_at_eos=False).token_ids
        out[family] = (tokens, e.logits(PROMPT + tokens)[-1])
    return out


class Head:
    """head_driver.py in the head node's namespace, read event by event."""

    def __init__(self, cluster, models: list[str], *args: str, env: dict | None = None):
        argv = [sys.executable, DRIVER, "--cluster", cluster.address, "--prompt", ",".join(map(str, PROMPT)),
                "--tokens", str(TOKENS), *[a for m in models for a in ("--model", m)], *args]
        self.p = cluster.popen(0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
        self.log: list[dict] = []
        self.lines: queue.Queue = queue.Queue()  # a thread reads: select() misses lines already buffered
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.p.stdout] + [self.lines.put(None)],
                         daemon=True).start()

    def next(self, event: str, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:  # the head exited
                break
            if not line.startswith("@event "):
                self.log.append({"event": "stdout", "line": line})  # Ray's own messages
                continue
            ev = json.loads(line[len("@event "):])
            self.log.append(ev)
            if ev["event"] == event:
                return ev
        self.kill()
        raise AssertionError(f"no {event!r} from the head (exit {self.p.poll()}); events {self.log[-5:]}; "
                             f"stderr:\n{self.p.stderr.read()[-3000:]}")

    def say(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def exit(self) -> None:
        self.say("exit")
        assert self.p.wait(timeout=60) == 0, self.p.stderr.read()[-3000:]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()


def _node_of(cluster, ip: str) -> int:
    return next(k for k in range(cluster.nodes) if cluster.ip(k) == ip)


def _check_done(done: dict, expected) -> None:
    tokens, logits = expected
    assert done["tokens"] == tokens
    np.testing.assert_allclose(done["logits"], logits, rtol=1e-5, atol=1e-5)  # see test_cluster._same_logits


def test_tokens_and_logits_across_nodes_and_nothing_listens_outside(cluster, every_model, expected):
    head = Head(cluster, list(every_model.values()))
    try:
        for family in every_model:
            ready = head.next("ready")
            # The plan puts the two workers on the two worker nodes (the head's node last), each
            # reached at its node's own address over the wire.
            assert sorted(w["node"] for w in ready["workers"]) == [cluster.ip(1), cluster.ip(2)]
            assert all(w["link"] for w in ready["workers"])
            _check_done(head.next("done"), expected[family])
        listening = cluster.listening()
        new_in_root = set(listening.pop("root")) - cluster.root_listening_before
        assert not new_in_root, f"listening in the initial namespace since the cluster started: {new_in_root}"
        for k in range(3):
            for address, port in listening[cluster.ns(k)]:
                assert address in (cluster.ip(k), "127.0.0.1", "0.0.0.0", "*", "::", "[::]"), (k, address, port)
        ports = {w["port"] for w in ready["workers"]}
        for k in (1, 2):  # each wire server on its node's address, not a wildcard
            assert any(a == cluster.ip(k) and p in ports for a, p in listening[cluster.ns(k)])
        head.exit()
    finally:
        head.kill()


def test_a_link_cut_mid_generation_changes_no_token_and_the_node_returns(cluster, every_model, expected):
    family = "olmoe-1b-7b"
    head = Head(cluster, [every_model[family]], "--pause-at", "3", "--rounds", "2", "--deadline", "3",
                "--wait-workers", "180")
    try:
        ready = head.next("ready")
        node = _node_of(cluster, ready["workers"][1]["node"])
        head.next("paused")
        cluster.cut(node)
        t0 = time.monotonic()
        head.say("go")
        done = head.next("done")
        _check_done(done, expected[family])  # node 2's experts computed by the head after the deadline
        assert done["faults"] >= 1
        assert time.monotonic() - t0 >= 3
        # A partition longer than Ray's failure detection: the node is marked dead, and its raylet
        # exits once it hears so after the link is back; the node's supervisor starts it again.
        cluster.wait_dead(node, timeout=60)
        cluster.restore(node)
        cluster.start_node(node)
        head.next("paused")
        head.say("go")  # the head waits for the worker to serve again, then generates again
        again = head.next("done")
        _check_done(again, expected[family])
        # At most one more: the restart placed on the node before Ray had marked it dead fails.
        assert again["faults"] - done["faults"] <= 1
        assert again["workers"][1]["node"] == cluster.ip(node) and again["workers"][1]["link"]
        assert again["workers"][1]["pid"] != ready["workers"][1]["pid"]
        head.exit()
    finally:
        head.kill()
        for k in (1, 2):
            cluster.restore(k)


def test_a_worker_node_killed_mid_generation_and_restarted(cluster, every_model, expected):
    family = "qwen3-30b-a3b"
    head = Head(cluster, [every_model[family]], "--pause-at", "3", "--rounds", "2", "--deadline", "10",
                "--wait-workers", "180")
    try:
        node = _node_of(cluster, head.next("ready")["workers"][0]["node"])
        head.next("paused")
        cluster.kill_node(node)  # the node "machine" crashes: raylet, worker and all
        t0 = time.monotonic()
        head.say("go")
        done = head.next("done")
        _check_done(done, expected[family])
        assert done["faults"] >= 1
        assert time.monotonic() - t0 < 10  # a dead connection is noticed at once, not at the deadline
        cluster.start_node(node)
        head.next("paused")
        head.say("go")
        again = head.next("done")
        _check_done(again, expected[family])
        assert again["workers"][0]["node"] == cluster.ip(node) and again["workers"][0]["link"]
        head.exit()
    finally:
        head.kill()
        alive = cluster.alive()
        for k in (1, 2):
            if cluster.ip(k) not in alive:
                cluster.start_node(k)


def test_a_killed_head_is_restarted_and_adopts_its_workers(cluster, every_model, expected):
    family = "glm-4.5-air"
    first = Head(cluster, [every_model[family]])
    try:
        ready = first.next("ready")
        _check_done(first.next("done"), expected[family])
    finally:
        first.kill()  # SIGKILL: no close, the workers stay
    second = Head(cluster, [every_model[family]])
    try:
        again = second.next("ready")
        assert again["adopted"] == 2
        assert [w["pid"] for w in again["workers"]] == [w["pid"] for w in ready["workers"]]
        _check_done(second.next("done"), expected[family])
        second.exit()
    finally:
        second.kill()


def test_a_driver_without_the_token_is_refused(cluster, every_model):
    env = {**{k: v for k, v in cluster.env().items() if not k.startswith("RAY_AUTH")},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64, "RAY_gcs_server_port_wait_time_s": "1"}
    p = cluster.run(0, [sys.executable, "-c", "from colibri.cli import main; main()", "run", "hi", "-n", "1", "-m", every_model["olmoe-1b-7b"],
                        "--cluster", cluster.address], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    assert "cannot join the Ray cluster" in p.stderr + p.stdout
