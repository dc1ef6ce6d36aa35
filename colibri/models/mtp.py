"""Multi-token prediction (MTP) layers: DeepSeek-V3 / Kimi-K2 and GLM-4.5 ship
`num_nextn_predict_layers` extra decoder layers (model.layers.N, N = num_hidden_layers) trained
to predict the token after next. colibri uses the first as a drafter for speculative decoding
(colibri/speculative.py, MTPDrafter); the main model checks every draft, so these layers change
speed, never tokens.

One MTP row at position p takes the main model's final hidden state there (after its final norm)
and the embedding of the token at p + 1, and predicts the token at p + 2:

    x = eh_proj([enorm(embed(t[p+1])), hnorm(h[p])])      (the embedding is zero at position 0)
    x = decoder_layer(x)                                  (attention over its own one-layer cache)
    logits = shared_head.head(shared_head.norm(x))

Drafting further, the row's output x stands in for h and the draft for the token, as vLLM and
SGLang run DeepSeek's MTP (after vLLM's models/deepseek_mtp.py; transformers has no MTP).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from colibri.kernels import embedding
from colibri.models.cache import KVCache
from colibri.models.layers import linear, rms_norm

if TYPE_CHECKING:  # decoder.py imports this module (build_decoder attaches the MTP layer)
    from colibri.models.decoder import DecoderLayer


class MTPHead:
    def __init__(self, args, w, layer: DecoderLayer, prefix: str, embed, lm_head, rope, new_cache):
        self.args = args
        self.prefix = prefix
        self.layer = layer
        self.rope = rope
        self.enorm = w.tensor(f"{prefix}.enorm.weight")
        self.hnorm = w.tensor(f"{prefix}.hnorm.weight")
        self.eh_proj = w.tensor(f"{prefix}.eh_proj.weight")  # [D, 2D]
        self.norm = w.tensor(f"{prefix}.shared_head.norm.weight")
        # Checkpoints repeat the main model's embedding and head here; a converted container may
        # keep only the main ones.
        self.embed = w.tensor(f"{prefix}.embed_tokens.weight") if w.has(f"{prefix}.embed_tokens.weight") else embed
        head = f"{prefix}.shared_head.head.weight"
        self.head = w.tensor(head) if w.has(head) else lm_head
        self._new_cache = new_cache

    def new_cache(self, max_tokens: int) -> KVCache:
        """The MTP layer's own one-layer cache."""
        return self._new_cache(max_tokens)

    def __call__(self, hidden: np.ndarray, ids, positions: np.ndarray, cache: KVCache, at: int):
        """Rows at true `positions` [L] (consecutive): hidden [L, D] (the main model's normed final
        hidden states, or an earlier row's output), ids [L] the tokens at positions + 1; their
        K/V go to the cache from index `at`. Returns (the last row's logits [V], output rows
        [L, D])."""
        eps = self.args.rms_norm_eps
        e = embedding(self.embed, np.asarray(ids, dtype=np.int64))
        e[np.asarray(positions) == 0] = 0.0
        x = linear(np.concatenate([rms_norm(e, self.enorm, eps), rms_norm(hidden, self.hnorm, eps)], axis=1),
                   self.eh_proj)
        cos, sin = self.rope.cos_sin(np.asarray(positions))
        L = x.shape[0]
        cache.reserve(at + L)
        x = self.layer(x, cache, 0, at, cos, sin)
        cache.length = at + L
        return linear(rms_norm(x[-1:], self.norm, eps), self.head)[0], x


def attach(model, args, w, make_layer, new_cache) -> None:
    """Let `model` build its first MTP layer (model.mtp_head()) when the config declares one and
    the container holds its weights; make_layer(i) builds decoder layer i as the family does,
    new_cache(n) a one-layer cache of that family's kind. Built on first use, not at load: the
    layer and its copy of the head are ~1 GB of RAM at DeepSeek-V3's size, which a model that
    never drafts with it should not spend."""
    n = int(args.num_nextn_predict_layers or 0)
    prefix = f"model.layers.{args.num_hidden_layers}"
    if n < 1 or not w.has(f"{prefix}.eh_proj.weight"):
        return
    model.build_mtp = lambda: MTPHead(args, w, make_layer(args.num_hidden_layers), prefix, model.embed,
                                      model.lm_head, model.rope, new_cache)
