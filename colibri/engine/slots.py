"""KV slots: each one conversation's KV cache and exactly the token ids it holds, which slot a
prompt goes to, how much of a slot a prompt reuses, and a slot saved to disk and restored."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from colibri.engine.config import check
from colibri.errors import ColibriError


@dataclass
class KVSlot:
    """One conversation's context: its KV cache and exactly the token ids it holds."""

    cache: object
    ids: list[int] = field(default_factory=list)
    last_used: float = 0.0


def new_slots(model, n: int, max_context: int) -> list[KVSlot]:
    check("kv_slots", n)
    return [KVSlot(model.new_cache(max_context)) for _ in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_prefix(slot: KVSlot, ids: list[int]) -> int:
    """How many of `ids` a generation in `slot` takes from the KV cache: the common prefix, less
    the last token at least, whose logits the generation needs."""
    return min(common_prefix(slot.ids, ids), len(ids) - 1)


def reuse_prefix(kv: KVSlot, ids: list[int], keep: bool = True) -> int:
    """Keep the cached tokens shared with `ids` (at least one token is left to prefill, since
    its logits are needed; none unless `keep`); returns how many were reused."""
    n = kv.cache.rewind(reusable_prefix(kv, ids) if keep else 0)  # a recurrent state: back to a snapshot
    kv.ids = kv.ids[:n]
    return n


def pick_slot(slots: list[KVSlot], ids: list[int], exclude: set[int] = frozenset()) -> int:
    """The slot sharing the longest token prefix with `ids`, else the least recently used;
    never one in `exclude` (slots other generations are using)."""
    free = [i for i in range(len(slots)) if i not in exclude]
    if not free:
        raise ColibriError("every KV slot is in use")
    best, best_len = None, 0
    for i in free:
        n = common_prefix(slots[i].ids, ids)
        if n > best_len:
            best, best_len = i, n
    if best is not None:
        return best
    return min(free, key=lambda i: slots[i].last_used)


def clear(slot: KVSlot) -> None:
    slot.cache.truncate(0)
    slot.ids = []


def save(slot: KVSlot, path: str | Path, model_id: str) -> None:
    from colibri.io.kv_store import save_kv

    save_kv(path, slot.ids, slot.cache, model_id)


def load(slot: KVSlot, path: str | Path, model_id: str) -> int:
    """Restore a slot written by `save` (left empty when the file does not fit it); returns how
    many tokens it holds."""
    from colibri.io.kv_store import load_kv

    try:
        slot.ids = load_kv(path, slot.cache, model_id)
    except ColibriError:
        clear(slot)
        raise
    slot.last_used = time.time()
    return len(slot.ids)
