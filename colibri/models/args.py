"""The config.json fields the shared decoder reads (`ModelArgs`); each family subclasses it with
its own fields and checks (docs/design.md section 5)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from colibri.errors import ColibriError


@dataclass
class ModelArgs:
    """The config.json fields the shared decoder reads; families subclass and add theirs."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    bos_token_id: int | list | None = None
    eos_token_id: int | list | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict):
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in cfg.items() if k in names and k != "extra"}
        args = cls(**known, extra={k: v for k, v in cfg.items() if k not in names})
        return args

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise ColibriError(f"config field hidden_act={self.hidden_act!r} is not implemented (only 'silu')")

    # Family hooks -------------------------------------------------------------
    def mlp_kind(self, layer: int) -> str:
        """'dense' or 'moe' for decoder layer `layer`."""
        return "dense"

    def rope_params(self) -> dict:
        """transformers v5 keeps rope settings in `rope_parameters`; v4 in rope_theta/rope_scaling."""
        p = dict(self.rope_parameters or {})
        if self.rope_scaling:
            p = {**self.rope_scaling, **p}
        if "rope_theta" not in p:
            p["rope_theta"] = self.rope_theta if self.rope_theta is not None else 10000.0
        p.setdefault("rope_type", p.get("type", "default"))
        p.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        return p

