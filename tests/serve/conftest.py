"""Black-box fixtures for tests/serve: a REAL `colibri serve` process on a free 127.0.0.1 port,
serving the SmolLM2 container, driven over HTTP (llama.cpp's ServerPreset, in pytest form)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MODEL_ID = "smollm2"
STARTUP_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m colibri.cli serve ...` with its log in a file; `url` once /health answers."""

    def __init__(self, model_dir: Path, workdir: Path, *args: str, api_key: str | None = None,
                 state_dir: Path | None = None, port: int | None = None, max_batch: str | None = "1"):
        self.model_dir, self.workdir, self.args, self.api_key = model_dir, workdir, list(args), api_key
        # Servers run one generation at a time unless a test asks (--max-batch on the command line
        # wins over this): admission, queue and slot tests count generations one by one.
        # max_batch=None leaves it unset, to the server's own sizing.
        self.max_batch = max_batch
        self.state_dir = state_dir or workdir / "state"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "colibri.cli", "serve", "--model", str(self.model_dir), "--port", str(self.port),
               "--model-id", MODEL_ID, "--state-dir", str(self.state_dir), "--log-level", "warning", *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        # One kernel thread per server: the test process and up to three servers share the machine's
        # cores, and parallel kernels that wait for each other slow down many-fold when oversubscribed.
        env = {"NUMBA_NUM_THREADS": "1", **os.environ, "COLIBRI_HOME": str(self.workdir / "home")}
        env.pop("COLI_MAX_BATCH", None)
        if self.max_batch is not None:
            env["COLI_MAX_BATCH"] = self.max_batch
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibri serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"colibri serve did not answer /health in {STARTUP_TIMEOUT} s:\n{self.log()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", headers=self.headers, timeout=30).json()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()


@pytest.fixture(scope="session")
def start_server(smollm2_container, tmp_path_factory):
    """Factory: start_server(*cli_args, api_key=, state_dir=, model_dir=) -> a started ServerProcess,
    stopped at the end of the session (or earlier by the test)."""
    started: list[ServerProcess] = []

    def start(*args: str, model_dir: Path | None = None, **kw) -> ServerProcess:
        s = ServerProcess(Path(model_dir or smollm2_container), tmp_path_factory.mktemp("serve"), *args, **kw)
        started.append(s)
        return s.start()

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """The shared default server: 3 KV slots, default queue (8), generation capped at 64 tokens."""
    return start_server("--kv-slots", "3", "--max-tokens", "64")


@pytest.fixture(scope="session")
def tokenizer(smollm2_container):
    from colibri.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_container)


@pytest.fixture(scope="session")
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
