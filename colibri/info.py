"""`colibri info`: what a model container holds, from its manifest, config and file sizes
(no tensor is read): family, parameters total and active, quantization per tensor class,
sizes on disk, experts, context length, chat template."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from math import prod
from pathlib import Path

from colibri.io.container import Container

# Tensor classes, first match wins; 1-D tensors (norms, biases) are classed before these.
_CLASSES = (
    ("embedding", re.compile(r"embed_tokens\.weight$")),
    ("lm_head", re.compile(r"lm_head\.weight$")),
    ("router", re.compile(r"\.(gate|shared_expert_gate)\.weight$")),
    ("shared experts", re.compile(r"\.shared_experts?\.")),
    ("attention", re.compile(r"\.self_attn\.")),
    ("dense MLP", re.compile(r"\.mlp\.")),
)


def tensor_class(name: str, shape: list[int]) -> str:
    if len(shape) == 1:
        return "norms and biases"
    for cls, pattern in _CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def _disk(c: Container, files: dict[str, int]) -> dict:
    """What the model takes on disk: a container's files, or for a GGUF read in place its parts
    (the directory holds only the index, `index_bytes`)."""
    if c.gguf:
        parts = {str(f): f.stat().st_size for f in c.gguf.files}
        return {"total_bytes": sum(parts.values()), "dense_bytes": c.dense_bytes, "expert_bytes": c.expert_bytes,
                "index_bytes": sum(files.values()), "files": parts}
    return {"total_bytes": sum(files.values()), "dense_bytes": files.get(c.manifest["dense_file"], 0),
            "expert_bytes": sum(n for f, n in files.items() if f.startswith("experts-")), "files": files}


def describe(model_dir: str | Path | Container) -> dict:
    c = model_dir if isinstance(model_dir, Container) else Container(model_dir)
    cfg = c.config
    classes: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0, "schemes": {}})
    dense_params = 0
    for name, spec in c.manifest["tensors"].items():
        params = prod(spec["shape"])
        nbytes = c.tensor_bytes(name)
        entry = classes[tensor_class(name, spec["shape"])]
        entry["tensors"] += 1
        entry["params"] += params
        entry["bytes"] += nbytes
        entry["schemes"][spec["scheme"]] = entry["schemes"].get(spec["scheme"], 0) + 1
        dense_params += params

    from colibri.plan import experts_per_token

    top_k = experts_per_token(cfg)
    expert_params = active_expert_params = 0
    expert_layers = []
    for prefix, layout in c.expert_layouts.items():
        per_expert = sum(prod(p["shape"]) for p in layout.projections.values())
        expert_params += per_expert * layout.num_experts
        active_expert_params += per_expert * min(top_k, layout.num_experts)
        expert_layers.append({"prefix": prefix, "experts": layout.num_experts, "expert_bytes": layout.blob_bytes,
                              "params_per_expert": per_expert})
        entry = classes["routed experts"]
        entry["tensors"] += layout.num_experts * len(layout.projections)
        entry["params"] += per_expert * layout.num_experts
        entry["bytes"] += layout.blob_bytes * layout.num_experts
        for p in layout.projections.values():
            entry["schemes"][p["scheme"]] = entry["schemes"].get(p["scheme"], 0) + layout.num_experts

    files = {p.name: p.stat().st_size for p in sorted(c.dir.iterdir()) if p.is_file()}
    tok_cfg = c.dir / "tokenizer_config.json"
    has_template = (c.dir / "chat_template.jinja").is_file()
    if not has_template and tok_cfg.is_file():
        try:
            has_template = bool(json.loads(tok_cfg.read_text()).get("chat_template"))
        except ValueError:
            pass
    return {
        "dir": str(c.dir),
        "model_type": cfg.get("model_type", "?"),
        "architectures": cfg.get("architectures", []),
        "source": c.manifest.get("source"),
        "format_version": c.manifest.get("version"),
        "layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "context_length": cfg.get("max_position_embeddings"),
        "params_total": dense_params + expert_params,
        "params_active": dense_params + active_expert_params,
        "params_dense": dense_params,
        "experts": {"moe_layers": len(expert_layers), "per_layer": max((e["experts"] for e in expert_layers), default=0),
                    "total": sum(e["experts"] for e in expert_layers), "top_k": top_k if expert_layers else 0,
                    "expert_bytes": max((e["expert_bytes"] for e in expert_layers), default=0)},
        "quantization": {k: v for k, v in sorted(classes.items(), key=lambda kv: -kv[1]["bytes"])},
        "disk": _disk(c, files),
        "chat_template": has_template,
        "tokenizer": (c.dir / "tokenizer.json").is_file(),
    }


def quant_summary(info: dict) -> str:
    """A short label for a banner: the schemes by share of bytes, e.g. 'q4_1 73%, q8_0 27%'."""
    by_scheme: dict[str, float] = defaultdict(float)
    for entry in info["quantization"].values():
        n = sum(entry["schemes"].values()) or 1
        for scheme, count in entry["schemes"].items():
            by_scheme[scheme] += entry["bytes"] * count / n
    total = sum(by_scheme.values()) or 1
    top = sorted(by_scheme.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{s} {b / total:.0%}" for s, b in top if b / total >= 0.01)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def render_info(info: dict, console) -> None:
    from rich.table import Table

    from colibri.plan import size_text as _size

    e = info["experts"]
    console.print(f"[bold]{Path(info['dir']).name}[/bold]  ({info['dir']})", highlight=False)
    rows = [
        ("family", f"{info['model_type']} ({', '.join(info['architectures']) or '-'})"),
        ("parameters", f"{_count(info['params_total'])} total, {_count(info['params_active'])} active per token"),
        ("layers", f"{info['layers']} (hidden {info['hidden_size']}, vocabulary {info['vocab_size']})"),
        ("experts", f"{e['total']} routed in {e['moe_layers']} layers ({e['per_layer']} per layer, top-k "
                    f"{e['top_k']}, {_size(e['expert_bytes'])} each)" if e["total"] else "none (a dense model)"),
        ("context", str(info["context_length"])),
        ("chat template", "yes" if info["chat_template"] else "no (use --raw prompts)"),
        ("on disk", f"{_size(info['disk']['total_bytes'])} (dense {_size(info['disk']['dense_bytes'])}, "
                    f"experts {_size(info['disk']['expert_bytes'])})"),
        ("converted from", str(info["source"])),
    ]
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column()
    for k, v in rows:
        facts.add_row(k, v)
    console.print(facts)
    q = Table(title="quantization by tensor class")
    for col in ("class", "tensors", "parameters", "scheme", "size"):
        q.add_column(col, justify="left" if col in ("class", "scheme") else "right")
    for cls, entry in info["quantization"].items():
        schemes = ", ".join(f"{s} ({n})" if len(entry["schemes"]) > 1 else s for s, n in entry["schemes"].items())
        q.add_row(cls, str(entry["tensors"]), _count(entry["params"]), schemes, _size(entry["bytes"]))
    console.print(q)
