"""Multi-token prediction (MTP) layers: DeepSeek-V3 / Kimi-K2, GLM-4.5, Qwen3-Next and Qwen3.5 / 3.6
MoE ship extra decoder layers trained to predict the token after next. colibri uses the first as
a drafter for speculative decoding (colibri/speculative.py, MTPDrafter); the main model checks
every draft, so these layers change speed, never tokens.

One MTP row at position p takes the main model's final hidden state there (after its final norm)
and the embedding of the token at p + 1, and predicts the token at p + 2:

    x = proj([embedding_norm(embed(t[p+1])), hidden_norm(h[p])])   (the embedding first)
    x = decoder_layer(x)                             (attention over its own one-layer cache)
    logits = head(final_norm(x))

Drafting further, the row's output stands in for h and the draft for the token. The families
differ in names and in a few details (`MTPLayout`):

- DeepSeek-V3 / GLM-4.5 (after vLLM's vllm/model_executor/models/deepseek_mtp.py; transformers
  has no MTP): the layer is model.layers.N (N = num_hidden_layers, `num_nextn_predict_layers`
  of them) with enorm, hnorm, eh_proj and shared_head.norm, and may repeat the embedding and
  the head (embed_tokens, shared_head.head). The embedding at position 0 is zero, and the
  output fed back is x before the final norm.
- Qwen3-Next and Qwen3.5 / 3.6 MoE (after vLLM, github.com/vllm-project/vllm:
  vllm/model_executor/models/qwen3_next_mtp.py, Qwen3NextMultiTokenPredictor, and
  qwen3_5_mtp.py, Qwen3_5MultiTokenPredictor, which computes the same): the checkpoint's
  top-level `mtp.` block (fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm and layers.0, a
  decoder layer of full attention with the family's MoE block) is converted to model.layers.N
  (io/convert.py), so it sits where DeepSeek's does. Its norms are stored as offsets from 1 like
  every Qwen3-Next norm (linear_attention.UnitOffsetNorms). The hidden state is the main
  model's after its final norm (what Qwen3NextModel.forward returns and vLLM's proposer hands
  over); fc (no bias) takes [embedding, hidden] in that order; no position is masked; the
  embedding and the head are the main model's. The output fed back is x after the final norm
  `norm` (the predictor returns it normed and the proposer feeds that return value back). The
  layer count is `mtp_num_hidden_layers` (Qwen3.5's config.json) or `num_nextn_predict_layers`,
  else 1 where the weights are there, as vLLM's predictors default (Qwen3-Next's config.json
  names none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from colibri.kernels import embedding
from colibri.models.cache import KVCache
from colibri.models.layers import linear, rms_norm

if TYPE_CHECKING:  # decoder.py imports this module (build_decoder attaches the MTP layer)
    from colibri.models.decoder import DecoderLayer


@dataclass(frozen=True)
class MTPLayout:
    """How a family names and wires its MTP layer: tensor names under the layer's prefix, and the
    details where the families differ (see the module docstring)."""

    projection: str                  # the [D, 2D] input fusion
    embedding_norm: str
    hidden_norm: str
    final_norm: str
    head: str | None                 # the layer's own copy of the head, where the family may ship one
    zero_first_embedding: bool       # the embedding at position 0 is zero
    feeds_back_normed: bool          # a further draft reads the output after the final norm (else before)
    count_fields: tuple[str, ...]    # config fields that declare the layer count, the first present wins
    default_count: int               # the count where the config declares none

    def declared_layers(self, args) -> int:
        """How many MTP layers the config `args` declares."""
        for name in self.count_fields:
            value = getattr(args, name, None)
            if value is None:
                value = args.extra.get(name)
            if value is not None:
                return int(value)
        return self.default_count


DEEPSEEK = MTPLayout(projection="eh_proj", embedding_norm="enorm", hidden_norm="hnorm", final_norm="shared_head.norm",
                     head="shared_head.head", zero_first_embedding=True, feeds_back_normed=False,
                     count_fields=("num_nextn_predict_layers",), default_count=0)
QWEN3_NEXT = MTPLayout(projection="fc", embedding_norm="pre_fc_norm_embedding", hidden_norm="pre_fc_norm_hidden",
                       final_norm="norm", head=None, zero_first_embedding=False, feeds_back_normed=True,
                       count_fields=("mtp_num_hidden_layers", "num_nextn_predict_layers"), default_count=1)


class MTPHead:
    def __init__(self, args, w, layer: DecoderLayer, prefix: str, layout: MTPLayout, embed, lm_head, rope,
                 new_cache):
        self.args = args
        self.prefix = prefix
        self.layout = layout
        self.layer = layer
        self.rope = rope
        self.embedding_norm = w.tensor(f"{prefix}.{layout.embedding_norm}.weight")
        self.hidden_norm = w.tensor(f"{prefix}.{layout.hidden_norm}.weight")
        self.projection = w.tensor(f"{prefix}.{layout.projection}.weight")  # [D, 2D]
        self.norm = w.tensor(f"{prefix}.{layout.final_norm}.weight")
        # DeepSeek's checkpoints repeat the main model's embedding and head here; a converted
        # container may keep only the main ones.
        own_embed = f"{prefix}.embed_tokens.weight"
        self.embed = w.tensor(own_embed) if w.has(own_embed) else embed
        own_head = f"{prefix}.{layout.head}.weight" if layout.head else None
        self.head = w.tensor(own_head) if own_head and w.has(own_head) else lm_head
        self._new_cache = new_cache

    def new_cache(self, max_tokens: int) -> KVCache:
        """The MTP layer's own one-layer cache."""
        return self._new_cache(max_tokens)

    def __call__(self, hidden: np.ndarray, ids, positions: np.ndarray, cache: KVCache, at: int):
        """Rows at true `positions` [L] (consecutive): hidden [L, D] (the main model's normed final
        hidden states, or an earlier row's output), ids [L] the tokens at positions + 1; their
        K/V go to the cache from index `at`. Returns (the last row's logits [V], the output
        rows [L, D] a further draft feeds back)."""
        eps = self.args.rms_norm_eps
        e = embedding(self.embed, np.asarray(ids, dtype=np.int64))
        if self.layout.zero_first_embedding:
            e[np.asarray(positions) == 0] = 0.0
        x = linear(np.concatenate([rms_norm(e, self.embedding_norm, eps), rms_norm(hidden, self.hidden_norm, eps)],
                                  axis=1), self.projection)
        cos, sin = self.rope.cos_sin(np.asarray(positions))
        L = x.shape[0]
        cache.reserve(at + L)
        x = self.layer(x, cache, 0, at, cos, sin)
        cache.length = at + L
        if self.layout.feeds_back_normed:
            x = rms_norm(x, self.norm, eps)
            return linear(x[-1:], self.head)[0], x
        return linear(rms_norm(x[-1:], self.norm, eps), self.head)[0], x


def attach(model, args, w, make_layer, new_cache, layout: MTPLayout = DEEPSEEK) -> None:
    """Let `model` build its first MTP layer (model.mtp) when the config declares one and
    the container holds its weights; make_layer(i) builds decoder layer i as the family does,
    new_cache(n) a one-layer cache of that family's kind. Built on first use, not at load: the
    layer and its copy of the head are ~1 GB of RAM at DeepSeek-V3's size, which a model that
    never drafts with it should not spend."""
    prefix = f"model.layers.{args.num_hidden_layers}"
    if layout.declared_layers(args) < 1 or not w.has(f"{prefix}.{layout.projection}.weight"):
        return
    model.build_mtp = lambda: MTPHead(args, w, make_layer(args.num_hidden_layers), prefix, layout, model.embed,
                                      model.lm_head, model.rope, new_cache)
