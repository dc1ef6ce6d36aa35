"""Loading a model: the container, its routed experts (resident, streamed from disk, or on Ray
workers), the family's model over them (placed on a GPU with --device), the tokenizer, and the
kernels' warm-up. Engine.load calls `load` with a validated EngineConfig."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from threadpoolctl import threadpool_limits

from colibri.engine.config import EngineConfig
from colibri.io.container import Container
from colibri.io.expert_store import ExpertStore, load_history, shown
from colibri.io.experts import ResidentExperts, experts_fit, mirror_drives, open_experts, verify_reads
from colibri.models import family
from colibri.threads import run_apart
from colibri.tokenizer import Tokenizer
from colibri.warmup import compile_kernels, start_compile_process


class Loaded(NamedTuple):
    container: Container
    tokenizer: Tokenizer | None
    model: object
    experts: object


def load(model_dir: str | Path, config: EngineConfig, progress: bool = False) -> Loaded:
    """Everything an Engine runs on, read from `model_dir`; with `progress`, the reads that take
    over a second are shown, and the kernels are compiled (or loaded from numba's cache) before
    this returns."""
    if config.device != "cpu":
        from colibri.placement.cuda_model import check

        check(config.device)
    # numpy's BLAS (OpenBLAS) serves prefill attention and MLA; its threads keep spinning for a
    # while after each call, and on the cores the numba kernels run on they took about half the
    # CPU.
    threadpool_limits(limits=1, user_api="blas")
    if config.threads is not None:
        from colibri.kernels import set_threads

        set_threads(config.threads)
    container = Container(model_dir)
    container.interleave_rows = config.weight_layout == "interleaved"
    # The several-rows kernels too where this engine will run them: drafting, or the KV slots a
    # server batches generations over.
    rows = config.speculative != "off" or config.kv_slots > 1
    # A first start compiles in a process of its own too (colibri.warmup): started now, its
    # imports overlap the loading below.
    process = start_compile_process(container.dir, rows) if progress else None
    try:
        module = family(container.config.get("model_type"))
        from colibri.default_model import history_path

        show = None  # a display for the reads that take over a second (experts, hot set, dense weights)
        if progress:
            from colibri.progress import ByteProgress as show
        if config.cluster:  # routed experts on Ray workers; the head keeps the dense weights
            import sys

            from colibri.cluster import open_cluster_experts

            experts = open_cluster_experts(container, config, history_file=history_path(container.dir),
                                           out=sys.stderr if progress else None)
            model = build_dense(container, module, experts, show)
        elif experts_fit(container, config):  # every expert in RAM, read beside the dense weights
            model, experts = load_resident(container, config, module, show)
        else:
            experts = open_experts(container, config, show=show, history_file=history_path(container.dir))
            model = build_dense(container, module, experts, show)
        # Prefetch: the store's readahead when asked for; resident experts still loading take a
        # layer's coming experts first (RoutedMoE.wants_prefetch stops it once all are in).
        model.prefetch = (isinstance(experts, ExpertStore) and config.prefetch) or (
            isinstance(experts, ResidentExperts) and not experts.complete)
        model.prefetch_depth = config.prefetch_depth
        if config.device != "cpu":
            from colibri.placement.cuda_model import place

            vram = None if config.vram_gb is None else int(config.vram_gb * (1 << 30))
            model = place(model, config.device, container, experts, vram,
                          load_history(history_path(container.dir)), config.gpu_layers)
        model.activations = config.activations  # before the warm-up compiles its kernels
        model.kv_cache = config.kv_cache
    except BaseException:
        if process is not None:
            process.close()  # (its input ends: it exits)
        raise
    if progress:  # in a thread of its own: see run_apart (the server generates on another thread)
        run_apart(compile_kernels, model, model_dir=container.dir, rows=rows, process=process)
    tok_path = Path(model_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_dir(model_dir) if tok_path.exists() else None
    return Loaded(container, tokenizer, model, experts)


def build_dense(container: Container, module, experts, show):
    """The family's model over `experts`, its dense weights read now (shown when large)."""
    with shown(show, f"reading the dense weights of {container.dir.name}", container.dense_bytes) as reading:
        container.on_read = reading.add if reading else None
        try:
            return module.build(container.config, container, experts)
        finally:
            container.on_read = None


def load_resident(container: Container, config: EngineConfig, module, show):
    """(model, ResidentExperts): every expert read into RAM by background readers while this
    thread reads and builds the dense weights. Then either return at once, the experts loading
    on (config.experts_in_background: a forward reads or waits for the experts it needs), or
    wait for them, still shown. A build error cancels the reads; with the wait, a read error
    surfaces once the build is done."""
    # Answering while the experts load, the readers start once the dense weights are in: the
    # first forward's own reads of the experts it routes to then meet a disk with less else in
    # flight, and the first token comes sooner. Waiting for all, the readers start at once and
    # the dense build overlaps them.
    experts = ResidentExperts(container, verify=verify_reads(config), background=True,
                              start=not config.experts_in_background, **mirror_drives(config))
    try:
        model = build_dense(container, module, experts, show)
    except BaseException:
        experts.cancel()
        raise
    experts.start()
    if config.experts_in_background:
        if show is not None and not experts.complete and hasattr(show, "note"):
            show.note(f"the experts of {container.dir.name} ({container.expert_bytes / 1e9:.1f} GB) go on loading in "
                      "the background: an answer waits only for the experts it routes to")
    else:
        left = container.expert_bytes - experts.loaded_bytes
        with shown(show, f"reading the experts of {container.dir.name}", left) as reading:
            experts.on_read = reading.add if reading else None
            try:
                experts.wait()
            finally:
                experts.on_read = None
    return model, experts
