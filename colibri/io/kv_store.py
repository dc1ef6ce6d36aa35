"""KV cache persistence: a slot's token ids and its K/V arrays in one .npz file, written
crash-safely (temporary file, fsync, rename), so a killed process never leaves a torn file."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

FORMAT_VERSION = 1


def save_kv(path: str | os.PathLike, ids: list[int], cache, model_id: str) -> None:
    n = cache.length
    arrays = {"ids": np.asarray(ids[:n], dtype=np.int64), "version": np.array(FORMAT_VERSION),
              "model_id": np.array(model_id)}
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        arrays[f"k{i}"] = k[:, :n]
        arrays[f"v{i}"] = v[:, :n]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_kv(path: str | os.PathLike, cache, model_id: str) -> list[int]:
    """Restore a saved slot into `cache`; returns its token ids. A file from another model or
    format, or a damaged one, raises ColibriError (the caller starts that slot empty)."""
    try:
        with np.load(path) as z:
            if int(z["version"]) != FORMAT_VERSION or str(z["model_id"]) != model_id:
                raise ColibriError(f"{path}: KV file is for another model or format")
            ids = z["ids"].tolist()
            cache.truncate(0)
            cache.reserve(len(ids))
            for i in range(len(cache.k)):
                cache.k[i][:, : len(ids)] = z[f"k{i}"]
                cache.v[i][:, : len(ids)] = z[f"v{i}"]
    except ColibriError:
        raise
    except Exception as e:  # truncated zip, missing arrays, wrong shapes
        raise ColibriError(f"{path}: unreadable KV file ({e})") from None
    cache.length = len(ids)
    return ids
