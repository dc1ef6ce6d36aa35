"""Running `colibri serve`: check the bind, load the Engine, restore the KV slots, start the
scheduler thread and uvicorn. SIGTERM (or Ctrl-C) drains: new requests get 503 while the admitted
ones finish, then the server exits; a second signal stops at once."""
from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from colibri.errors import ColibriError
from colibri.serve.security import MAX_BODY_BYTES, allowed_hosts, check_bind

log = logging.getLogger("colibri.serve")


@dataclass
class ServeOptions:
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    model_id: str | None = None
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    allow_insecure_bind: bool = False
    max_queue: int = 8
    queue_timeout: float = 300.0
    kv_slots: int = 1
    max_tokens: int = 4096
    max_context: int | None = None
    state_dir: Path | None = None
    persist: bool = True
    max_connections: int = 256
    read_timeout: float = 30.0
    drain_timeout: float = 120.0
    log_level: str = "info"
    ram_gb: float | None = None       # engine budget for resident weights (None: planned)
    threads: int | None = None        # kernel threads (None: all cores)


def check(o: ServeOptions) -> None:
    """User mistakes, found before the model is loaded."""
    check_bind(o.host, o.api_key, o.allow_insecure_bind)
    if not 0 <= o.port <= 65535:
        raise ColibriError(f"--port must be between 0 and 65535, not {o.port}")
    if o.max_queue < 0:
        raise ColibriError(f"--max-queue must be >= 0, not {o.max_queue}")
    if o.queue_timeout <= 0 or o.read_timeout <= 0 or o.drain_timeout < 0:
        raise ColibriError("--queue-timeout and --read-timeout must be > 0, --drain-timeout >= 0")
    if o.max_tokens < 1:
        raise ColibriError(f"--max-tokens must be >= 1, not {o.max_tokens}")
    if not 1 <= o.kv_slots <= 16:
        raise ColibriError(f"--kv-slots must be between 1 and 16, not {o.kv_slots}")
    if o.max_connections < 1:
        raise ColibriError(f"--max-connections must be >= 1, not {o.max_connections}")
    if o.log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
        raise ColibriError(f"--log-level must be critical, error, warning, info or debug, not {o.log_level!r}")
    if "*" in o.cors_origins and not o.api_key:
        log.warning("--cors-origin '*' lets any web page use this server")


class DrainingServer(uvicorn.Server):
    """uvicorn, whose exit signal first drains the scheduler while the socket still answers
    (503 to newcomers), and exits with status 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, scheduler, drain_timeout: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout = scheduler, drain_timeout
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self.scheduler.begin_drain()
        threading.Thread(target=self._drain, name="colibri-drain", daemon=True).start()

    def _drain(self) -> None:
        log.info("draining: waiting for %d admitted request(s)",
                 self.scheduler.queued + int(self.scheduler.active is not None))
        deadline = time.monotonic() + self.drain_timeout
        while not self.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def run(o: ServeOptions) -> None:
    from colibri.engine import Engine
    from colibri.serve.app import ServeConfig, create_app, default_state_dir
    from colibri.serve.metrics import ServeMetrics
    from colibri.serve.scheduler import Scheduler

    check(o)
    logging.basicConfig(level=o.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log_level = o.log_level.lower()
    engine = Engine.load(o.model, progress=True, kv_slots=o.kv_slots, max_context=o.max_context, ram_gb=o.ram_gb,
                         threads=o.threads)
    state_dir = None
    if o.persist:
        state_dir = Path(o.state_dir) if o.state_dir else default_state_dir(engine)
        state_dir.mkdir(parents=True, exist_ok=True)
    metrics = ServeMetrics()
    scheduler = Scheduler(engine, max_queue=o.max_queue, state_dir=state_dir, metrics=metrics)
    metrics.attach(scheduler, engine)
    held = scheduler.restore()
    config = ServeConfig(model_id=o.model_id, api_key=o.api_key, cors_origins=list(o.cors_origins),
                         allowed_hosts=allowed_hosts(o.host, o.allowed_hosts), queue_timeout=o.queue_timeout,
                         max_tokens=o.max_tokens, max_body_bytes=MAX_BODY_BYTES, read_timeout=o.read_timeout)
    app = create_app(engine, scheduler, config, metrics)
    scheduler.start()
    model_id = o.model_id or engine.model_id
    print(f"colibri serve: {model_id} on http://{o.host}:{o.port} ({o.kv_slots} KV slot(s) holding {held} tokens; "
          f"state in {state_dir or 'memory only'})", file=sys.stderr, flush=True)
    uconfig = uvicorn.Config(app, host=o.host, port=o.port, log_level=log_level, access_log=False,
                             limit_concurrency=o.max_connections, timeout_keep_alive=5,
                             timeout_graceful_shutdown=10, lifespan="off", server_header=False)
    server = DrainingServer(uconfig, scheduler, o.drain_timeout)
    try:
        server.run()
    finally:
        scheduler.stop()
    if server._draining:
        print("colibri serve: drained, bye", file=sys.stderr, flush=True)

