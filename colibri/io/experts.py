"""Routed-expert sources: what a MoE block asks for its experts.

`ResidentExperts` reads every expert blob into RAM once at load (one pread per expert into
one preallocated array per layer). The streaming store of a later issue (disk -> RAM LRU,
readahead, hot set) implements the same `get_many` contract, so models never know where an
expert came from.
"""
from __future__ import annotations

import os

import numpy as np

from colibri.errors import ColibriError
from colibri.io.container import Container


class ResidentExperts:
    def __init__(self, container: Container):
        self.layers: dict[str, list] = {}
        self.bytes_resident = 0
        for prefix, layout in container.expert_layouts.items():
            store = np.empty((layout.num_experts, layout.blob_bytes), dtype=np.uint8)
            fd = os.open(container.expert_file(prefix).path, os.O_RDONLY)
            try:
                for e in range(layout.num_experts):
                    _, offset, nbytes = container.expert_range(prefix, e)
                    n = os.preadv(fd, [memoryview(store[e])], offset)
                    if n != nbytes:
                        raise ColibriError(f"{container.dir}: short read of {prefix} expert {e}; the file is truncated")
            finally:
                os.close(fd)
            self.layers[prefix] = [layout.unpack(store[e]) for e in range(layout.num_experts)]
            self.bytes_resident += store.nbytes

    def get_many(self, prefix: str, ids: list[int]) -> list[dict]:
        experts = self.layers[prefix]
        return [experts[e] for e in ids]
