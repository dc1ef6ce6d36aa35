"""`colibri` command line (Typer). Every command builds one Engine (or calls the converter);
user mistakes (ColibriError) print one line and exit 1, never a traceback."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from colibri.errors import ColibriError, EngineFault

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run Mixture-of-Experts language models bigger than memory.")
err = Console(stderr=True, soft_wrap=True)  # soft_wrap: a message stays one line in a log or pipe

MODEL_HELP = ("Model container directory or .gguf file (any part of a split GGUF; it is read in place, "
              "indexed once into the cache; default: embedded SmolLM2-135M-Instruct).")
ModelOpt = typer.Option(None, "--model", "-m", help=MODEL_HELP)


def model_dir(model: Optional[Path], progress: bool = True, default: bool = False) -> Optional[Path]:
    """What -m names, as a model directory: a directory as is, a .gguf file's linked directory,
    indexed once into the cache (colibri.default_model.gguf_model_dir), nothing as None (Engine.load takes the
    default model) or, with `default`, the default model's directory."""
    from colibri.default_model import default_model_dir, gguf_model_dir

    if model is None:
        return default_model_dir(progress=progress) if default else None
    if model.is_dir():
        return model
    if model.is_file() and model.suffix.lower() == ".gguf":
        return gguf_model_dir(model, progress=progress)
    what = "does not exist" if not model.exists() else "is neither a directory nor a .gguf file"
    raise ColibriError(f"--model {model} {what}; -m takes a model directory (from `colibri convert`) "
                       "or a .gguf file")


def need_tokenizer(model: Optional[Path]) -> None:
    """Text in and out needs the tokenizer; a container converted without one fails here, before
    its weights load, saying how to fix it (the engine alone would say "pass token ids")."""
    from colibri.io.container import MANIFEST

    if model is not None and (model / MANIFEST).exists() and not (model / "tokenizer.json").exists():
        raise ColibriError(f"{model} has no tokenizer.json, so it can only be driven with token ids; copy "
                           "tokenizer.json and tokenizer_config.json from the original checkpoint into it")


def check_threads(threads: Optional[int]) -> Optional[int]:
    """--threads: at least 1; more than numba's pool (NUMBA_NUM_THREADS, all cores by default) is
    cut to the pool with a warning, as the engine would do silently."""
    if threads is None:
        return None
    if threads < 1:
        raise ColibriError(f"--threads must be >= 1, not {threads}")
    from numba import config

    if threads > config.NUMBA_NUM_THREADS:
        err.print(f"[yellow]warning:[/yellow] --threads {threads} is more than the {config.NUMBA_NUM_THREADS} "
                  f"threads numba runs here (NUMBA_NUM_THREADS; default: the cores): using "
                  f"{config.NUMBA_NUM_THREADS}", highlight=False)
        return config.NUMBA_NUM_THREADS
    return threads


def threads_option(**kw):
    """--threads for every command that loads a model (None: the engine's default)."""
    return typer.Option(None, "--threads", callback=check_threads, help="Kernel threads, at least 1 "
                        "(default: all cores; use 1 when other work keeps the cores busy).", **kw)


def checked(name: str):
    """A typer callback checking an EngineConfig field with the engine's own rule
    (colibri.engine.config.check), its message naming the option as typed."""
    def callback(value):
        from colibri.engine.config import check

        check(name, value, flag=True)
        return value

    return callback


def activations_option(**kw):
    """--activations for every command that loads a model."""
    return typer.Option("f32", "--activations", callback=checked("activations"), help="the quantized matrices' activations: "
                        "f32 (exact, the default) or int8 (integer dot products: faster where the CPU is the "
                        "bottleneck, not exact; docs/benchmarks.md: Quality).", **kw)


def kv_cache_option(**kw):
    """--kv-cache for every command that loads a model."""
    return typer.Option("f32", "--kv-cache", callback=checked("kv_cache"), help="KV cache element type: f32 (exact, "
                        "the default) or f16 (half the memory and the bytes read per token at long contexts, "
                        "as llama.cpp's default cache; not exact).", **kw)


def wait_for_experts_option(**kw):
    """--wait-for-experts for the commands that answer a person (run, chat)."""
    return typer.Option(False, "--wait-for-experts", help="With every expert resident: read them all before the "
                        "first answer. By default the answer starts once the dense weights are in, waiting only "
                        "for the experts it routes to while the rest load (the first token came in ~10 s instead "
                        "of ~20 s on Qwen3-30B-A3B's shapes, docs/benchmarks.md: Start-up).", **kw)


def mirror_option(**kw):
    """--mirror for the commands that load a model (EngineConfig.mirrors)."""
    return typer.Option(None, "--mirror", callback=checked("mirrors"), metavar="DIR[:WEIGHT]", help="A copy of the "
                        "model's expert files on another drive (repeatable; make one with `cp -r MODEL DIR`): each "
                        "expert is read from one drive, so N drives read up to N times as fast. WEIGHT sets the "
                        "drive's share of the experts (default 1). A file that differs from the model's, or fails "
                        "a read, is read from the model's own drive instead, with a warning.", **kw)


def prefetch_option(**kw):
    """--prefetch: EngineConfig.prefetch (the store's guesses of the coming layers' experts)."""
    return typer.Option(False, "--prefetch/--no-prefetch", help="When experts stream from disk: read the experts "
                        "the next layers are predicted to use while the current one computes (a guess never "
                        "evicts an expert likelier to be used; docs/benchmarks.md: Expert placement).", **kw)


def prefetch_depth_option(**kw):
    """--prefetch-depth: EngineConfig.prefetch_depth."""
    return typer.Option(1, "--prefetch-depth", callback=checked("prefetch_depth"), help="With --prefetch: guess "
                        "the experts of the layer this many ahead as each layer starts (0-8; 0: each layer's "
                        "own, as it starts).", **kw)


def repin_option(**kw):
    """--repin: EngineConfig.repin."""
    return typer.Option(True, "--repin/--no-repin", help="When experts stream from disk: the pinned hot set "
                        "follows the routing heat at every turn end (bounded reads per turn); off, it is "
                        "pinned once at start from the saved heat.", **kw)


def primary_weight_option(**kw):
    """--primary-weight: EngineConfig.primary_weight."""
    return typer.Option(None, "--primary-weight", callback=checked("primary_weight"), help="With --mirror: the "
                        "weight of the drive holding the model itself (default 1, as a mirror's).", **kw)


def tiers(model, ram_gb: float | None, vram_gb: float | None, auto_tier: bool) -> tuple:
    """(--ram-gb, --vram-gb): as given; with --auto-tier and no --ram-gb, the plan's budgets for
    both (a --vram-gb given still wins)."""
    if auto_tier and ram_gb is None:
        from colibri.plan import engine_options

        planned = engine_options(model, None, True)
        ram_gb = planned.get("ram_gb")
        vram_gb = planned.get("vram_gb") if vram_gb is None else vram_gb
    return ram_gb, vram_gb


def device_option(**kw):
    """--device for every command that loads a model (EngineConfig.device)."""
    return typer.Option("cpu", "--device", callback=checked("device"), help="Where the forward runs: cpu, cuda "
                        "(weights, KV cache and a VRAM tier of routed experts in GPU memory; llama-family "
                        "and MoE models: Mixtral, Qwen2/3-MoE, OLMoE, GLM-4.5, DeepSeek-V3, Kimi-K2; needs a "
                        "CUDA GPU and numba-cuda, the gpu extra) or auto (cuda when a GPU is there and covers "
                        "the model).", **kw)


def gpu_layers_option(**kw):
    """--gpu-layers: EngineConfig.gpu_layers."""
    return typer.Option(None, "--gpu-layers", help="With --device cuda: decoder layers run on the GPU, the "
                        "first N (the rest and the head on the CPU, their KV cache in RAM; default: as many "
                        "as the GPU's free memory holds).", **kw)


def vram_gb_option(**kw):
    """--vram-gb: EngineConfig.vram_gb."""
    return typer.Option(None, "--vram-gb", help="With --device cuda: GPU memory for routed experts (the VRAM "
                        "tier above the RAM cache; default: what is free after the dense weights, less "
                        "headroom; --auto-tier: the plan's).", **kw)


def cluster_option(**kw):
    """--cluster for every command that generates (colibri/cluster)."""
    return typer.Option(None, "--cluster", help="Compute the routed experts on Ray workers: a Ray cluster's "
                        "address, or `local` for a Ray instance on this machine bound to 127.0.0.1 (needs "
                        "pip install 'colibri[cluster]').", **kw)


def expert_workers_option(**kw):
    return typer.Option(2, "--expert-workers", min=1, help="Ray workers holding the experts with --cluster, "
                        "each owning a contiguous share of every MoE layer's experts.", **kw)


def speculative_option(**kw):
    """--speculative for every command that generates."""
    return typer.Option("off", "--speculative", help="Draft tokens and check them in one pass: off, ngram "
                        "(prompt lookup), mtp (the model's multi-token-prediction layer: DeepSeek-V3, GLM-4.5, "
                        "Qwen3-Next, Qwen3.5) or auto (MTP where the model has it, else ngram, while it measures "
                        "faster). Never changes the output.", **kw)


def check_mode(speculative: str, draft_tokens: int) -> None:
    """--speculative / --draft-tokens, checked before a model loads."""
    from colibri.speculative import check_mode as check

    check(speculative, draft_tokens)


def draft_tokens_option(**kw):
    return typer.Option(6, "--draft-tokens", help="Tokens drafted per pass with --speculative (1-32).", **kw)


def fit_max_tokens(engine, prompt, max_tokens: int, **encode) -> None:
    """The engine stops at the end of the context without a word; say so up front when -n asks
    for more than the context leaves after the prompt. (A prompt that fills the context is the
    engine's error.)"""
    room = engine.max_context - len(engine.encode_prompt(prompt, **encode))
    if 0 < room < max_tokens:
        err.print(f"note: -n {max_tokens} is past the context ({engine.max_context} tokens): "
                  f"generating at most {room}", highlight=False)


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
    mirror: Optional[list[str]] = mirror_option(),
    primary_weight: Optional[float] = primary_weight_option(),
    prefetch: bool = prefetch_option(),
    prefetch_depth: int = prefetch_depth_option(),
    repin: bool = repin_option(),
    threads: Optional[int] = threads_option(),
    auto_tier: bool = typer.Option(False, "--auto-tier", help="Apply `colibri plan` (its RAM and VRAM budgets) where "
                                   "--ram-gb is not given."),
    speculative: str = speculative_option(),
    draft_tokens: int = draft_tokens_option(),
    activations: str = activations_option(),
    kv_cache: str = kv_cache_option(),
    device: str = device_option(),
    vram_gb: Optional[float] = vram_gb_option(),
    gpu_layers: Optional[int] = gpu_layers_option(),
    stats: bool = typer.Option(False, "--stats", help="Print speed figures to stderr at the end."),
    cluster: Optional[str] = cluster_option(),
    expert_workers: int = expert_workers_option(),
    wait_for_experts: bool = wait_for_experts_option(),
):
    """Generate an answer to PROMPT, printed as it streams."""
    from colibri.engine import Engine

    if max_tokens < 0:
        raise ColibriError(f"--max-tokens must be >= 0, not {max_tokens}")
    check_mode(speculative, draft_tokens)
    model = model_dir(model)
    need_tokenizer(model)
    ram_gb, vram_gb = tiers(model, ram_gb, vram_gb, auto_tier)
    engine = Engine.load(model, progress=True, max_context=max_context, ram_gb=ram_gb, expert_io=expert_io,
                         prefetch=prefetch, prefetch_depth=prefetch_depth, repin=repin, threads=threads,
                         speculative=speculative, draft_tokens=draft_tokens,
                         activations=activations, kv_cache=kv_cache, cluster=cluster, expert_workers=expert_workers,
                         device=device, vram_gb=vram_gb, gpu_layers=gpu_layers, mirrors=mirror,
                         primary_weight=primary_weight, experts_in_background=not wait_for_experts)
    fit_max_tokens(engine, prompt, max_tokens, raw=raw, system=system)
    for ev in engine.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, raw=raw, system=system):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    engine.close()  # an answer done before the experts were all in: the readers stop, the process ends
    if stats and engine.last:
        g = engine.last
        err.print(f"[dim]{g.prompt_tokens} prompt tokens ({g.prefill_tok_s:.1f} tok/s), "
                  f"{g.completion_tokens} generated ({g.decode_tok_s:.1f} tok/s), "
                  f"TTFT {g.ttft_s * 1000:.0f} ms, load {engine.load_s:.2f} s, finish: {g.finish_reason}[/dim]")
        if g.speculative:
            s = g.speculative
            err.print(f"[dim]drafts: {s['accepted']} of {s['drafted']} accepted ({100 * s['acceptance']:.0f}%) "
                      f"in {s['passes']} passes[/dim]")


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
    if not (out / "tokenizer.json").exists():
        err.print(f"[yellow]warning:[/yellow] no tokenizer.json in {src}: the container can only be driven with "
                  f"token ids; copy tokenizer.json/tokenizer_config.json into {out} to chat with it",
                  highlight=False)


# ---- chat, plan, info (colibri/tui.py, colibri/plan/, colibri/info.py) ----

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
    threads: Optional[int] = threads_option(),
    speculative: str = speculative_option(),
    draft_tokens: int = draft_tokens_option(),
    activations: str = activations_option(),
    kv_cache: str = kv_cache_option(),
    device: str = device_option(),
    vram_gb: Optional[float] = vram_gb_option(),
    gpu_layers: Optional[int] = gpu_layers_option(),
    cluster: Optional[str] = cluster_option(),
    expert_workers: int = expert_workers_option(),
    wait_for_experts: bool = wait_for_experts_option(),
    mirror: Optional[list[str]] = mirror_option(),
    primary_weight: Optional[float] = primary_weight_option(),
    prefetch: bool = prefetch_option(),
    prefetch_depth: int = prefetch_depth_option(),
    repin: bool = repin_option(),
):
    """Talk with a model in the terminal (plain lines in, plain text out when not a terminal)."""
    from colibri.plan import engine_options
    from colibri.tui import chat as run_chat

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    check_mode(speculative, draft_tokens)
    if not attach:
        model = model_dir(model)
        need_tokenizer(model)
    options = {} if attach else engine_options(model, ram_gb, auto_tier)
    if max_context is not None:
        options["max_context"] = max_context
    if threads is not None and not attach:
        options["threads"] = threads
    if not attach:
        options.update(speculative=speculative, draft_tokens=draft_tokens, activations=activations,
                       kv_cache=kv_cache, device=device, experts_in_background=not wait_for_experts,
                       prefetch=prefetch, prefetch_depth=prefetch_depth, repin=repin)
        options.update({k: v for k, v in (("vram_gb", vram_gb), ("gpu_layers", gpu_layers),
                                          ("primary_weight", primary_weight)) if v is not None})
        if mirror:
            options["mirrors"] = mirror
    if cluster and not attach:
        options.update(cluster=cluster, expert_workers=expert_workers)
    run_chat(model, attach=attach, system=system, max_tokens=max_tokens, stats=stats, sampling=sampling,
             engine_options=options)


@app.command()
def plan(
    model: Optional[Path] = ModelOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON (with --machines or "
                                  "--machine-spec: an object of plans by machine name)."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="Plan with this RAM budget for weights."),
    vram_gb: Optional[float] = typer.Option(None, "--vram-gb", help="Plan with at most this much VRAM."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context length to reserve KV cache for."),
    machines: Optional[str] = typer.Option(
        None, "--machines", help="Also plan for named machines, side by side with this one (probed): "
        "`default` (desktop-64g, workstation-128g-24gvram, server-512g) or a .toml/.json file holding one "
        "[NAME] table per machine: ram_gb (GiB), disk_gbs (GB/s), cores, optional mem_gbs (GB/s), drives and "
        "gpus = [{name, vram_gb, bandwidth_gbs}]. Add :NAME,NAME to take only those: default:server-512g."),
    machine_spec: Optional[list[str]] = typer.Option(
        None, "--machine-spec", help="One more named machine, repeatable: "
        "NAME:ram_gb=64,disk_gbs=2,cores=8[,mem_gbs=60][,drives=2][,vram_gb=24] (GiB, GB/s; vram_gb once per GPU)."),
    drives: Optional[int] = typer.Option(None, "--drives", min=1, help="Plan this machine with its experts striped "
                                         "over N identical drives (`--mirror`): the disk's read rate times N."),
    as_stored: bool = typer.Option(False, "--as-stored", help="Plan a --layers slice as the layers it holds "
                                   "(what the engine loads), not as the full model."),
    machine: Optional[Path] = typer.Option(None, "--machine", hidden=True, help="Machine description JSON (tests)."),
):
    """How to split a model over VRAM, RAM and disk here (or on named machines), and the speed to
    expect. Reads headers only: a container, a Hugging Face checkpoint, or a config.json alone; a
    synthetic slice (tools/synthetic_moe.py --layers) is planned as the full model."""
    import json

    from colibri import plan as planner

    named = planner.named_machines(machines, machine_spec)  # a mistake in them fails before any probe
    model = model_dir(model, progress=not json_out, default=True)
    facts = planner.analyze_model(model, project_slice=not as_stored)
    here = planner.read_machine_file(machine) if machine else planner.probe_machine(facts)
    if drives is not None:
        here.drives = drives
    options = {"ram_gb": ram_gb, "vram_gb": vram_gb, "max_context": max_context}
    if named:  # a comparison: a machine the model does not fit is a finding, not an error
        plans = planner.plan_machines(facts, [here, *named], **options)
        if json_out:
            print(json.dumps(plans, indent=2))
        else:
            planner.render_comparison(plans, Console(highlight=False))
        return
    result = planner.build_plan(facts, here, **options)
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

    model = model_dir(model, progress=not json_out, default=True)
    facts = describe(model)
    if json_out:
        print(json.dumps(facts, indent=2))
    else:
        render_info(facts, Console(highlight=False))


@app.command()
def serve(
    model: Optional[Path] = typer.Option(None, "--model", "-m", envvar="COLI_MODEL",
                                         help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", envvar="COLI_HOST", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", envvar="COLI_PORT"),
    model_id: Optional[str] = typer.Option(None, "--model-id", envvar="COLI_MODEL_ID",
                                           help="Model name clients ask for (default: the directory's name)."),
    served_model_name: Optional[list[str]] = typer.Option(
        None, "--served-model-name", envvar="COLI_SERVED_MODEL_NAME",
        help="Another name clients may ask for (repeatable; for clients that hard-code one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="COLI_API_KEY",
                                          help="Require this key (Bearer or x-api-key)."),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin", envvar="COLI_CORS_ORIGIN",
                                                    help="Allow this exact browser origin (repeatable; '*' = any)."),
    allow_any_content_type: bool = typer.Option(
        False, "--allow-any-content-type", envvar="COLI_ALLOW_ANY_CONTENT_TYPE",
        help="Accept POST bodies not sent as Content-Type: application/json (for clients that cannot set it)."),
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
                                   help="Most tokens one request may generate (larger asks get a 400)."),
    max_context: Optional[int] = typer.Option(None, "--max-context", envvar="COLI_MAX_CONTEXT",
                                              help="Context length in tokens (default: the model's, at most 8192)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", envvar="COLI_STATE_DIR",
                                             help="Where KV slots persist (default: in the colibri cache)."),
    persist: bool = typer.Option(True, "--persist/--no-persist", envvar="COLI_PERSIST",
                                 help="Save KV slots at every turn end and restore them at start."),
    max_connections: int = typer.Option(64, "--max-connections", envvar="COLI_MAX_CONNECTIONS",
                                        help="Open connections in all (more are refused with 503)."),
    max_connections_per_ip: int = typer.Option(8, "--max-connections-per-ip", envvar="COLI_MAX_CONNECTIONS_PER_IP",
                                               help="Open connections from one client address (more get 429)."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", envvar="COLI_HEADER_TIMEOUT",
                                         help="Seconds a client may take to send a request's headers."),
    read_timeout: float = typer.Option(30.0, "--read-timeout", envvar="COLI_READ_TIMEOUT",
                                       help="Seconds a client may take to send its request body."),
    drain_timeout: float = typer.Option(120.0, "--drain-timeout", envvar="COLI_DRAIN_TIMEOUT",
                                        help="On SIGTERM, seconds to let admitted requests finish."),
    log_level: str = typer.Option("info", "--log-level", envvar="COLI_LOG_LEVEL"),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", envvar="COLI_RAM_GB",
                                           help="RAM budget for weights (dense + cached experts)."),
    auto_tier: bool = typer.Option(False, "--auto-tier", envvar="COLI_AUTO_TIER",
                                   help="Apply `colibri plan` where --ram-gb is not given."),
    threads: Optional[int] = threads_option(envvar="COLI_THREADS"),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", envvar="COLI_PREFILL_CHUNK", min=1,
                                      help="Prompt tokens per forward pass: bounds a long prompt's memory, and a "
                                           "client that leaves stops its prefill within one chunk."),
    profile_phases: Optional[bool] = typer.Option(
        None, "--profile-phases/--no-profile-phases", envvar="COLI_PROFILE_PHASES",
        show_default="on where experts stream from disk or run on a cluster",
        help="Time each turn's phases (attention, dense MLP, routing, routed experts, head) for its profile "
             "(the `colibri` field of answers, GET /v1/profile). Off, a dense model decodes each token in one call."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", envvar="COLI_MAX_BATCH", show_default="4, fewer "
                                            "if 4 full-context KV caches would not fit in half the free memory",
                                            help="Generations run at once, sharing each forward pass (1-16; each holds "
                                                 "a KV slot, so --kv-slots is raised to it). Tokens are the same as alone."),
    speculative: str = speculative_option(envvar="COLI_SPECULATIVE"),
    draft_tokens: int = draft_tokens_option(envvar="COLI_DRAFT_TOKENS"),
    activations: str = activations_option(envvar="COLI_ACTIVATIONS"),
    kv_cache: str = kv_cache_option(envvar="COLI_KV_CACHE"),
    device: str = device_option(envvar="COLI_DEVICE"),
    vram_gb: Optional[float] = vram_gb_option(envvar="COLI_VRAM_GB"),
    gpu_layers: Optional[int] = gpu_layers_option(envvar="COLI_GPU_LAYERS"),
    cluster: Optional[str] = cluster_option(envvar="COLI_CLUSTER"),
    expert_workers: int = expert_workers_option(envvar="COLI_EXPERT_WORKERS"),
    expert_io: str = typer.Option("pread", "--expert-io", envvar="COLI_EXPERT_IO",
                                  help="How missed experts are read: pread, direct (O_DIRECT), mmap."),
    mirror: Optional[list[str]] = mirror_option(envvar="COLI_MIRROR"),
    primary_weight: Optional[float] = primary_weight_option(envvar="COLI_PRIMARY_WEIGHT"),
    prefetch: bool = prefetch_option(envvar="COLI_PREFETCH"),
    prefetch_depth: int = prefetch_depth_option(envvar="COLI_PREFETCH_DEPTH"),
    repin: bool = repin_option(envvar="COLI_REPIN"),
):
    """Serve the model over an OpenAI- and Anthropic-compatible HTTP API."""
    from colibri.serve.server import ServeOptions
    from colibri.serve.server import run as run_server

    check_mode(speculative, draft_tokens)
    model = model_dir(model)
    ram_gb, vram_gb = tiers(model, ram_gb, vram_gb, auto_tier)

    run_server(ServeOptions(model=model, host=host, port=port, model_id=model_id,
                            model_aliases=served_model_name or [], api_key=api_key,
                            cors_origins=cors_origin or [], allow_any_content_type=allow_any_content_type,
                            allowed_hosts=allowed_host or [],
                            allow_insecure_bind=allow_insecure_bind, max_queue=max_queue, queue_timeout=queue_timeout,
                            kv_slots=kv_slots, max_tokens=max_tokens, max_context=max_context, state_dir=state_dir,
                            persist=persist, max_connections=max_connections,
                            max_connections_per_ip=max_connections_per_ip, header_timeout=header_timeout,
                            read_timeout=read_timeout,
                            drain_timeout=drain_timeout, log_level=log_level, ram_gb=ram_gb, threads=threads,
                            prefill_chunk=prefill_chunk, profile_phases=profile_phases,
                            speculative=speculative, draft_tokens=draft_tokens, max_batch=max_batch, activations=activations, kv_cache=kv_cache, device=device,
                            vram_gb=vram_gb,
                            gpu_layers=gpu_layers,
                            cluster=cluster,
                            expert_workers=expert_workers,
                            experts={"expert_io": expert_io, "mirrors": mirror or [], "primary_weight": primary_weight,
                                     "prefetch": prefetch, "prefetch_depth": prefetch_depth, "repin": repin}))


@app.command()
def bench(
    model: Optional[Path] = ModelOpt,
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="RAM budget for weights (dense + cached experts)."),
    expert_io: str = typer.Option("pread", "--expert-io", help="pread, direct or mmap."),
    mirror: Optional[list[str]] = mirror_option(),
    primary_weight: Optional[float] = primary_weight_option(),
    prefetch: bool = prefetch_option(),
    prefetch_depth: int = prefetch_depth_option(),
    hot_set: bool = typer.Option(True, "--hot-set/--no-hot-set"),
    repin: bool = repin_option(),
    tokens: int = typer.Option(32, "--tokens", help="Forced tokens decoded per run."),
    prompt_tokens: int = typer.Option(256, "--prompt-tokens", help="Prompt length for prefill and TTFT."),
    threads: Optional[int] = threads_option(),
    auto_tier: bool = typer.Option(False, "--auto-tier", help="Apply `colibri plan` where --ram-gb is not given."),
    activations: str = activations_option(),
    kv_cache: str = kv_cache_option(),
    device: str = device_option(),
    vram_gb: Optional[float] = vram_gb_option(),
    gpu_layers: Optional[int] = gpu_layers_option(),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    cluster: Optional[str] = cluster_option(),
    expert_workers: int = expert_workers_option(),
):
    """Cold and warm decode tok/s, prefill, TTFT, expert hit rate, GB read per token, peak RSS,
    and where each decoded token's time goes (attention, dense MLP, routing, routed experts,
    disk wait); on a --layers slice of a bigger model, the whole model's projected tok/s."""
    import json

    from colibri.bench import render, run_bench

    if tokens < 2:
        raise ColibriError(f"--tokens must be at least 2, not {tokens}")
    if prompt_tokens < 1:
        raise ColibriError(f"--prompt-tokens must be at least 1, not {prompt_tokens}")
    model = model_dir(model)
    ram_gb, vram_gb = tiers(model, ram_gb, vram_gb, auto_tier)
    report = run_bench(model, tokens=tokens, prompt_tokens=prompt_tokens, ram_gb=ram_gb, expert_io=expert_io, prefetch=prefetch,
                       prefetch_depth=prefetch_depth, hot_set=hot_set, repin=repin, threads=threads, activations=activations, kv_cache=kv_cache, cluster=cluster,
                       expert_workers=expert_workers, device=device, vram_gb=vram_gb, gpu_layers=gpu_layers,
                       mirrors=mirror, primary_weight=primary_weight)
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        render(report, Console())


@app.command()
def perplexity(
    text_file: Path = typer.Argument(..., help="A UTF-8 text file to score."),
    model: Optional[Path] = ModelOpt,
    ctx: int = typer.Option(512, "--ctx", help="Tokens per window."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Tokens between window starts (default: ctx/2)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Score only the text's first N tokens."),
    save_logits: Optional[Path] = typer.Option(None, "--save-logits", help="Save this run as a reference "
                                               "(the top-256 next-token log probabilities per token)."),
    kl_divergence: Optional[Path] = typer.Option(None, "--kl-divergence", help="Compare this run with a "
                                                 "reference saved by --save-logits: KL divergence, top-1 agreement."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", help="RAM budget for weights (dense + cached experts)."),
    threads: Optional[int] = threads_option(),
    activations: str = activations_option(),
    kv_cache: str = kv_cache_option(),
    device: str = device_option(),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Perplexity of the model over TEXT_FILE with a sliding window (docs/usage.md: Perplexity), and the KL
    divergence of its next-token distributions against a saved reference run."""
    import json

    from rich.progress import Progress

    from colibri.engine import Engine
    from colibri.eval import check_windows, load_reference, read_text, save_reference, score_text

    stride = max(ctx // 2, 1) if stride is None else stride
    check_windows(ctx, stride)
    text = read_text(text_file)
    model = model_dir(model)
    need_tokenizer(model)
    engine = Engine.load(model, progress=not as_json, ram_gb=ram_gb, threads=threads, max_context=ctx,
                         activations=activations, kv_cache=kv_cache, device=device)
    trained = engine.container.config.get("max_position_embeddings")
    if trained and ctx > int(trained):
        raise ColibriError(f"--ctx {ctx} is longer than the context {engine.model_id} was trained for ({trained})")
    ids = engine.encode_prompt(text, raw=True)
    if max_tokens is not None:
        if max_tokens < 2:
            raise ColibriError(f"--max-tokens must be at least 2, not {max_tokens}")
        ids = ids[:max_tokens]
    reference = load_reference(kl_divergence, ids, ctx, stride) if kl_divergence else None
    with Progress(console=err, transient=True, disable=as_json) as bar:
        task = bar.add_task(f"scoring {len(ids)} tokens", total=None)
        scores = score_text(engine, ids, ctx, stride, keep_top=save_logits is not None, reference=reference,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    if save_logits:
        save_reference(save_logits, scores, ids, engine.model_id)
    report = {"model": engine.model_id, "text": str(text_file), "tokens": len(ids), **scores.summary()}
    if reference is not None:
        report["reference_perplexity"] = reference.perplexity
    if as_json:
        print(json.dumps(report, indent=1))
        return
    out = Console()
    out.print(f"{report['model']} on {text_file}: {report['tokens_scored']} tokens scored in {report['windows']} "
              f"windows (ctx {ctx}, stride {stride}), {report['tokens_per_s']:.0f} tok/s")
    out.print(f"perplexity [bold]{report['perplexity']:.4f}[/bold] (mean NLL {report['mean_nll']:.5f})")
    if reference is not None:
        out.print(f"against {kl_divergence} (perplexity {report['reference_perplexity']:.4f}): KL mean "
                  f"{report['kl_mean']:.6f}, median {report['kl_median']:.6f}, p99 {report['kl_p99']:.6f}, "
                  f"max {report['kl_max']:.6f}; top-1 agreement {report['top1_agreement']:.2%}")
    if save_logits:
        out.print(f"reference saved to {save_logits}")


def main() -> None:
    try:
        app()
    except (ColibriError, EngineFault) as e:
        err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
