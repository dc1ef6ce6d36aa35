"""Running `colibri serve`: check the options, bind the port, load the Engine, restore the KV
slots, start the scheduler thread and uvicorn. SIGTERM (or Ctrl-C) drains: new requests get 503
while the admitted ones finish, then the server exits; a second signal stops at once."""
from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from colibri.errors import ColibriError
from colibri.serve.connections import KEEP_ALIVE_S, ConnectionGuard, ConnectionLimits, protocol_class
from colibri.serve.security import MAX_BODY_BYTES, allowed_hosts, check_bind

log = logging.getLogger("colibri.serve")


@dataclass
class ServeOptions:
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    model_id: str | None = None
    model_aliases: list[str] = field(default_factory=list)  # other names requests may use
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    allow_any_content_type: bool = False  # accept POST bodies not declared application/json
    allowed_hosts: list[str] = field(default_factory=list)
    allow_insecure_bind: bool = False
    max_queue: int = 8
    queue_timeout: float = 300.0
    kv_slots: int = 1
    max_tokens: int = 4096
    max_context: int | None = None
    state_dir: Path | None = None
    persist: bool = True
    max_connections: int = 64         # open connections in all
    max_connections_per_ip: int = 8   # open connections from one client address
    header_timeout: float = 10.0      # seconds a client has to send a request's headers
    read_timeout: float = 30.0
    drain_timeout: float = 120.0
    log_level: str = "info"
    ram_gb: float | None = None       # engine budget for resident weights (None: planned)
    threads: int | None = None        # kernel threads (None: all cores)
    prefill_chunk: int = 512          # prompt tokens per forward pass (memory bound, cancellation point)
    profile_phases: bool | None = None  # time each turn's phases for its profile (None: where experts stream)
    # How streamed experts are read and placed: EngineConfig's expert_io, mirrors, primary_weight,
    # prefetch, prefetch_depth and repin (absent: the engine's defaults).
    experts: dict = field(default_factory=dict)
    speculative: str = "off"          # draft tokens and check them in one pass: off | ngram | mtp | auto
    draft_tokens: int = 6             # drafts per pass
    activations: str = "f32"          # the quantized matrices' activations: f32 (exact) | int8
    kv_cache: str = "f32"             # KV cache element type: f32 (exact) | f16
    max_batch: int | None = None      # generations at once, sharing forward passes (each needs a KV slot); None: sized here
    device: str = "cpu"               # where the dense forward runs: cpu | cuda | auto
    vram_gb: float | None = None      # --device cuda: the routed experts' VRAM tier (None: sized to the GPU)
    gpu_layers: int | None = None     # --device cuda: leading layers on the GPU (None: as many as fit)
    cluster: str | None = None        # routed experts on Ray workers: a Ray address or "local"
    expert_workers: int = 2           # Ray actors holding the experts (with cluster)


def check(o: ServeOptions) -> None:
    """User mistakes, found before the model is loaded."""
    check_bind(o.host, o.api_key, o.allow_insecure_bind)
    if not 0 <= o.port <= 65535:
        raise ColibriError(f"--port must be between 0 and 65535, not {o.port}")
    if o.max_queue < 0:
        raise ColibriError(f"--max-queue must be >= 0, not {o.max_queue}")
    if o.queue_timeout <= 0 or o.read_timeout <= 0 or o.header_timeout <= 0 or o.drain_timeout < 0:
        raise ColibriError("--queue-timeout, --read-timeout and --header-timeout must be > 0, --drain-timeout >= 0")
    if o.max_tokens < 1:
        raise ColibriError(f"--max-tokens must be >= 1, not {o.max_tokens}")
    if not 1 <= o.kv_slots <= 16:
        raise ColibriError(f"--kv-slots must be between 1 and 16, not {o.kv_slots}")
    if o.max_batch is not None and not 1 <= o.max_batch <= 16:
        raise ColibriError(f"--max-batch must be between 1 and 16, not {o.max_batch}")
    if o.max_connections < 1:
        raise ColibriError(f"--max-connections must be >= 1, not {o.max_connections}")
    if o.max_connections_per_ip < 1:
        raise ColibriError(f"--max-connections-per-ip must be >= 1, not {o.max_connections_per_ip}")
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
                 self.scheduler.queued + self.scheduler.running)
        deadline = time.monotonic() + self.drain_timeout
        while not self.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, so a busy port is
    a one-line error at once instead of after a long load. Options as uvicorn's own bind:
    SO_REUSEADDR lets a restart take the port while old connections sit in TIME_WAIT (it never
    lets two servers listen on one port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except (socket.gaierror, UnicodeError) as e:  # a host name that does not resolve
        sock.close()
        raise ColibriError(f"cannot listen on {host!r}: {e}") from None
    except OSError as e:
        sock.close()
        raise ColibriError(_bind_error(host, port, e)) from None
    return sock


def start_listening(sock: socket.socket, host: str, port: int, backlog: int = 2048) -> None:
    """listen() right before serving: until then a client is refused rather than left waiting
    in the backlog while the model loads. Two servers that bound the same port with
    SO_REUSEADDR meanwhile are told apart here (only one may listen)."""
    try:
        sock.listen(backlog)
    except OSError as e:
        raise ColibriError(_bind_error(host, port, e)) from None


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} is in use on {host}; pick another with --port"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: no interface of this machine has that address; check --host"
    if e.errno == errno.EACCES:
        return f"not allowed to listen on port {port} (ports below 1024 need privileges); pick another with --port"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


def url_of(host: str, port: int) -> str:
    return f"http://[{host.strip('[]')}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(o: ServeOptions) -> None:
    from colibri.batching import default_max_batch
    from colibri.engine import Engine
    from colibri.io.experts import available_memory
    from colibri.io.kv_store import private_dir
    from colibri.serve.app import ServeConfig, create_app, default_state_dir
    from colibri.serve.metrics import ServeMetrics
    from colibri.serve.scheduler import Scheduler

    check(o)
    logging.basicConfig(level=o.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log_level = o.log_level.lower()
    sock = bind_listener(o.host, o.port)
    port = sock.getsockname()[1]  # the real one when --port 0 asked for any
    scheduler = None
    try:
        # Every running generation holds a slot of its own: at least --max-batch slots.
        kv_slots = max(o.kv_slots, o.max_batch or 1)
        engine = Engine.load(o.model, progress=True, kv_slots=kv_slots, max_context=o.max_context,
                             ram_gb=o.ram_gb, threads=o.threads, prefill_chunk=o.prefill_chunk,
                             profile_phases=o.profile_phases,
                             speculative=o.speculative, draft_tokens=o.draft_tokens,
                             activations=o.activations, kv_cache=o.kv_cache, device=o.device, vram_gb=o.vram_gb,
                             gpu_layers=o.gpu_layers, cluster=o.cluster,
                             expert_workers=o.expert_workers, **o.experts,
                             # up once the dense weights are in: requests wait only for the
                             # resident experts they route to while the rest load
                             experts_in_background=True)
        max_batch = o.max_batch
        if max_batch is None:
            max_batch = default_max_batch(engine.slots[0].cache.bytes_per_token * engine.max_context,
                                          available_memory())
            engine.ensure_slots(max_batch)
            kv_slots = len(engine.slots)
        state_dir = None
        if o.persist:
            state_dir = Path(o.state_dir) if o.state_dir else default_state_dir(engine)
            private_dir(state_dir)  # saved conversations: 0700, their files 0600
        metrics = ServeMetrics()
        scheduler = Scheduler(engine, max_queue=o.max_queue, state_dir=state_dir, metrics=metrics,
                              max_batch=max_batch)
        metrics.attach(scheduler, engine)
        guard = ConnectionGuard(ConnectionLimits(o.max_connections, o.max_connections_per_ip, o.header_timeout))
        metrics.attach_connections(guard)
        held = scheduler.restore()
        config = ServeConfig(model_id=o.model_id, model_aliases=set(o.model_aliases), api_key=o.api_key, cors_origins=list(o.cors_origins),
                             allow_any_content_type=o.allow_any_content_type,
                             allowed_hosts=allowed_hosts(o.host, o.allowed_hosts), queue_timeout=o.queue_timeout,
                             max_tokens=o.max_tokens, max_body_bytes=MAX_BODY_BYTES, read_timeout=o.read_timeout)
        app = create_app(engine, scheduler, config, metrics)
        # uvicorn's own limit_concurrency answers 503 once connections or tasks reach it; the guard
        # already caps connections at accept time, so it stays only as a backstop for request tasks
        # that outlive their connection (one above the cap: it counts the asking connection too).
        uconfig = uvicorn.Config(app, host=o.host, port=port, log_level=log_level, access_log=False,
                                 http=protocol_class(guard), ws="none", limit_concurrency=o.max_connections + 1,
                                 timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=10, lifespan="off",
                                 server_header=False)
        server = DrainingServer(uconfig, scheduler, o.drain_timeout)
        start_listening(sock, o.host, port, uconfig.backlog)
        scheduler.start()
        model_id = o.model_id or engine.model_id
        print(f"colibri serve: {model_id} listening on {url_of(o.host, port)} ({kv_slots} KV slot(s) holding "
              f"{sum(held)} tokens; up to {max_batch} generation(s) at once{'' if o.max_batch else ' (--max-batch sized to this machine)'}; state in {state_dir or 'memory only'})",
              file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    finally:
        if scheduler is not None:
            scheduler.stop()
        sock.close()
    if server._draining:
        print("colibri serve: drained, bye", file=sys.stderr, flush=True)
