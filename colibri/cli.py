"""`colibri` command line (Typer). Every command builds one Engine (or calls the converter);
user mistakes (ColibriError) print one line and exit 1, never a traceback."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from colibri.errors import ColibriError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run Mixture-of-Experts language models bigger than memory.")
err = Console(stderr=True)

ModelOpt = typer.Option(None, "--model", "-m", help="Model container directory (default: embedded SmolLM2-135M-Instruct).")


@app.command()
def run(
    prompt: str = typer.Argument(..., help="The prompt (chat template applied unless --raw)."),
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as plain text, no chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context length in tokens "
                                              "(default: the model's, at most 8192)."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="RAM budget for weights (dense + cached "
                                           "experts); default: planned from available memory."),
    expert_io: str = typer.Option("pread", "--expert-io", help="How missed experts are read: pread, direct, mmap."),
    prefetch: bool = typer.Option(False, "--prefetch/--no-prefetch", help="Prefetch the next layer's predicted "
                                  "experts (off: it measured slower, see README)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Kernel threads (default: all cores)."),
    auto_tier: bool = typer.Option(False, "--auto-tier", help="Apply `colibri plan` (its RAM budget) where "
                                   "--ram-gb is not given."),
    stats: bool = typer.Option(False, "--stats", help="Print speed figures to stderr at the end."),
):
    """Generate an answer to PROMPT, printed as it streams."""
    from colibri.engine import Engine

    if max_tokens < 0:
        raise ColibriError(f"--max-tokens must be >= 0, not {max_tokens}")
    if auto_tier and ram_gb is None:
        from colibri.plan import engine_options

        ram_gb = engine_options(model, None, True).get("ram_gb")
    engine = Engine.load(model, progress=True, max_context=max_context, ram_gb=ram_gb, expert_io=expert_io,
                         prefetch=prefetch, threads=threads)
    for ev in engine.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, raw=raw, system=system):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if stats and engine.last:
        g = engine.last
        err.print(f"[dim]{g.prompt_tokens} prompt tokens ({g.prefill_tok_s:.1f} tok/s), "
                  f"{g.completion_tokens} generated ({g.decode_tok_s:.1f} tok/s), "
                  f"TTFT {g.ttft_s * 1000:.0f} ms, load {engine.load_s:.2f} s, finish: {g.finish_reason}[/dim]")


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint directory or .gguf file."),
    dst: Path = typer.Argument(..., help="Output container directory (must not exist or be empty)."),
    bits: int = typer.Option(4, "--bits", help="4 (int4 g64, default), 8 (int8 g32) or 32 (float32, exact). "
                             "Ignored for GGUF, which is repacked losslessly."),
):
    """Convert a checkpoint into a colibri model container."""
    from colibri.io.convert import convert as do_convert

    out = do_convert(src, dst, bits=bits, progress=True)
    err.print(f"wrote {out}")


# ---- chat, plan, info (colibri/tui.py, colibri/plan.py, colibri/info.py) ----

AutoTierOpt = typer.Option(False, "--auto-tier", help="Apply `colibri plan` (its RAM budget) where --ram-gb is not given.")


@app.command()
def chat(
    model: Optional[Path] = ModelOpt,
    attach: Optional[str] = typer.Option(None, "--attach", help="URL of a running `colibri serve`: talk to it "
                                         "instead of loading a model."),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n", help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context length in tokens."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="RAM budget for weights (dense + cached experts)."),
    auto_tier: bool = AutoTierOpt,
    stats: Optional[str] = typer.Option(None, "--stats", help="Stats line per turn: full, compact or off "
                                        "(default: full in a terminal, off when piped)."),
):
    """Talk with a model in the terminal (plain lines in, plain text out when not a terminal)."""
    from colibri.plan import engine_options
    from colibri.tui import chat as run_chat

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    options = {} if attach else engine_options(model, ram_gb, auto_tier)
    if max_context is not None:
        options["max_context"] = max_context
    run_chat(model, attach=attach, system=system, max_tokens=max_tokens, stats=stats, sampling=sampling,
             engine_options=options)


@app.command()
def plan(
    model: Optional[Path] = ModelOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="Plan with this RAM budget for weights."),
    vram_gb: Optional[float] = typer.Option(None, "--vram-gb", help="Plan with at most this much VRAM."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context length to reserve KV cache for."),
    machine: Optional[Path] = typer.Option(None, "--machine", hidden=True, help="Machine description JSON (tests)."),
):
    """How to split a model over VRAM, RAM and disk here, and the speed to expect (reads headers only)."""
    import json

    from colibri import plan as planner

    if model is None:
        from colibri.default_model import default_model_dir

        model = default_model_dir(progress=not json_out)
    facts = planner.analyze_model(model)
    mach = planner.read_machine_file(machine) if machine else planner.probe_machine(facts)
    result = planner.build_plan(facts, mach, ram_gb=ram_gb, vram_gb=vram_gb, max_context=max_context)
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        planner.render_plan(result, Console(highlight=False))
    planner.check_fits(result)


@app.command()
def info(
    model: Optional[Path] = ModelOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the facts as JSON."),
):
    """What a model container holds: family, parameters, quantization, sizes, experts, context."""
    import json

    from colibri.info import describe, render_info

    if model is None:
        from colibri.default_model import default_model_dir

        model = default_model_dir(progress=not json_out)
    facts = describe(model)
    if json_out:
        print(json.dumps(facts, indent=2))
    else:
        render_info(facts, Console(highlight=False))


@app.command()
def serve(
    model: Optional[Path] = typer.Option(None, "--model", "-m", envvar="COLI_MODEL",
                                         help="Model container directory (default: embedded SmolLM2-135M-Instruct)."),
    host: str = typer.Option("127.0.0.1", "--host", envvar="COLI_HOST", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", envvar="COLI_PORT"),
    model_id: Optional[str] = typer.Option(None, "--model-id", envvar="COLI_MODEL_ID",
                                           help="Model name clients ask for (default: the directory's name)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="COLI_API_KEY",
                                          help="Require this key (Bearer or x-api-key)."),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin", envvar="COLI_CORS_ORIGIN",
                                                    help="Allow this exact browser origin (repeatable; '*' = any)."),
    allowed_host: Optional[list[str]] = typer.Option(None, "--allowed-host", envvar="COLI_ALLOWED_HOST",
                                                     help="Accept this Host header name besides localhost "
                                                     "(repeatable; '*' = any)."),
    allow_insecure_bind: bool = typer.Option(False, "--allow-insecure-bind", envvar="COLI_ALLOW_INSECURE_BIND",
                                             help="Listen on a non-loopback address without an API key."),
    max_queue: int = typer.Option(8, "--max-queue", envvar="COLI_MAX_QUEUE",
                                  help="Requests that may wait for their turn (more get 429)."),
    queue_timeout: float = typer.Option(300.0, "--queue-timeout", envvar="COLI_QUEUE_TIMEOUT",
                                        help="Seconds a request may wait before a 429."),
    kv_slots: int = typer.Option(1, "--kv-slots", envvar="COLI_KV_SLOTS", help="Conversations kept warm (1-16)."),
    max_tokens: int = typer.Option(4096, "--max-tokens", envvar="COLI_MAX_TOKENS",
                                   help="Most tokens one request may generate (larger asks are clamped)."),
    max_context: Optional[int] = typer.Option(None, "--max-context", envvar="COLI_MAX_CONTEXT",
                                              help="Context length in tokens (default: the model's, at most 8192)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", envvar="COLI_STATE_DIR",
                                             help="Where KV slots persist (default: in the colibri cache)."),
    persist: bool = typer.Option(True, "--persist/--no-persist", envvar="COLI_PERSIST",
                                 help="Save KV slots at every turn end and restore them at start."),
    max_connections: int = typer.Option(256, "--max-connections", envvar="COLI_MAX_CONNECTIONS"),
    read_timeout: float = typer.Option(30.0, "--read-timeout", envvar="COLI_READ_TIMEOUT",
                                       help="Seconds a client may take to send its request body."),
    drain_timeout: float = typer.Option(120.0, "--drain-timeout", envvar="COLI_DRAIN_TIMEOUT",
                                        help="On SIGTERM, seconds to let admitted requests finish."),
    log_level: str = typer.Option("info", "--log-level", envvar="COLI_LOG_LEVEL"),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", envvar="COLI_RAM_GB",
                                           help="RAM budget for weights (dense + cached experts)."),
    auto_tier: bool = typer.Option(False, "--auto-tier", envvar="COLI_AUTO_TIER",
                                   help="Apply `colibri plan` where --ram-gb is not given."),
    threads: Optional[int] = typer.Option(None, "--threads", envvar="COLI_THREADS", help="Kernel threads."),
):
    """Serve the model over an OpenAI- and Anthropic-compatible HTTP API."""
    from colibri.serve.server import ServeOptions
    from colibri.serve.server import run as run_server

    if auto_tier and ram_gb is None:
        from colibri.plan import engine_options

        ram_gb = engine_options(model, None, True).get("ram_gb")

    run_server(ServeOptions(model=model, host=host, port=port, model_id=model_id, api_key=api_key,
                            cors_origins=cors_origin or [], allowed_hosts=allowed_host or [],
                            allow_insecure_bind=allow_insecure_bind, max_queue=max_queue, queue_timeout=queue_timeout,
                            kv_slots=kv_slots, max_tokens=max_tokens, max_context=max_context, state_dir=state_dir,
                            persist=persist, max_connections=max_connections, read_timeout=read_timeout,
                            drain_timeout=drain_timeout, log_level=log_level, ram_gb=ram_gb, threads=threads))


@app.command()
def bench(
    model: Optional[Path] = ModelOpt,
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="RAM budget for weights (dense + cached experts)."),
    expert_io: str = typer.Option("pread", "--expert-io", help="pread, direct or mmap."),
    prefetch: bool = typer.Option(False, "--prefetch/--no-prefetch"),
    hot_set: bool = typer.Option(True, "--hot-set/--no-hot-set"),
    tokens: int = typer.Option(32, "--tokens", help="Forced tokens decoded per run."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Kernel threads (default: all cores)."),
    auto_tier: bool = typer.Option(False, "--auto-tier", help="Apply `colibri plan` where --ram-gb is not given."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Cold and warm decode tok/s, prefill, TTFT, expert hit rate, GB read per token, peak RSS."""
    import json

    from colibri.bench import render, run_bench

    if tokens < 2:
        raise ColibriError(f"--tokens must be at least 2, not {tokens}")
    if auto_tier and ram_gb is None:
        from colibri.plan import engine_options

        ram_gb = engine_options(model, None, True).get("ram_gb")
    report = run_bench(model, tokens=tokens, ram_gb=ram_gb, expert_io=expert_io, prefetch=prefetch,
                       hot_set=hot_set, threads=threads)
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        render(report, Console())


def main() -> None:
    try:
        app()
    except ColibriError as e:
        err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
