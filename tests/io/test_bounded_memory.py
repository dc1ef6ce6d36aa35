"""A model larger than the memory limit runs: a cgroup-v1 memory group (page cache counted)
smaller than the model holds the process; it decodes without being killed and its peak RSS
stays within dense + expert budget + a stated overhead."""
import json
import subprocess
import sys

from tools import memlimit
import pytest
from tools import synthetic_moe

MiB = 1 << 20
# Above the process's baseline (interpreter, numpy, numba + LLVM loaded; their shared libraries
# count in RSS but were charged to the page cache before the process joined the group):
# tokenizer, KV cache, readahead staging buffers, per-token temporaries.
OVERHEAD = 150 * MiB

CHILD = """
import json, resource, sys
import numpy as np
from colibri import Engine
from colibri.kernels import matvec, quantize
matvec(quantize(np.ones((64, 64), np.float32), "int4_g64"), np.ones(64, np.float32))  # loads numba + LLVM
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
e = Engine.load(sys.argv[1], ram_gb=float(sys.argv[2]), stream_experts=True, expert_io=sys.argv[3])
e.feed(np.random.default_rng(0).integers(100, 49000, 12).tolist())
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "base": base, **e.expert_stats}))
"""


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory):
    """The medium synthetic MoE, with numba's cache warm for its kernels. Compiling is a
    first-start cost outside what is measured here: LLVM holds ~300 MB while it compiles this
    model's kernels (measured: peak RSS 525 MB cold vs 392 MB cached), more than the whole
    limit below. So the same child runs once without a limit first, as `colibri` itself
    compiles on first start (colibri.warmup) before serving."""
    reason = memlimit.why_unavailable()
    if reason:
        pytest.skip(f"no memory cgroup can be made here: {reason}")
    model = tmp_path_factory.getbasetemp() / "medium-moe"
    if not model.exists():
        synthetic_moe.write_container(model, "medium", progress=False)
    from colibri.io.container import Container

    c = Container(model)
    budget = c.dense_bytes + 40 * MiB
    warm = subprocess.run([sys.executable, "-c", CHILD, str(model), str(budget / (1 << 30)), "pread"],
                          capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr[-2000:]
    return model, c.dense_bytes + c.expert_bytes, budget


@pytest.mark.parametrize("io", ["pread", "direct"])
def test_larger_than_limit_model_decodes_in_bounded_memory(medium_model, io):
    model, size, budget = medium_model
    limit = 400 * MiB
    assert size > limit + 100 * MiB  # the model really is larger than the memory it runs in
    r = memlimit.run_limited([sys.executable, "-c", CHILD, str(model), str(budget / (1 << 30)), io], limit,
                             timeout=600)
    assert r.returncode == 0 and not r.oom_killed, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    grown = out["rss"] - out["base"]
    assert grown <= budget + OVERHEAD, f"peak RSS grew {grown / MiB:.0f} MiB over a {out['base'] / MiB:.0f} MiB baseline"
    assert out["bytes_read"] > 0 and out["misses"] > 0  # experts really streamed from disk
