"""KV cache persistence: a slot's token ids and its K/V arrays in one .npz file, written
crash-safely (temporary file, fsync, rename), so a killed process never leaves a torn file.
A slot holds a whole conversation, so its file is private to the user (0600), from the moment
the temporary file exists; `private_dir` makes the directory that holds them 0700."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

FORMAT_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700

log = logging.getLogger("colibri")


def save_kv(path: str | os.PathLike, ids: list[int], cache, model_id: str) -> None:
    n = cache.length
    arrays = {"ids": np.asarray(ids[:n], dtype=np.int64), "version": np.array(FORMAT_VERSION),
              "model_id": np.array(model_id)}
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        arrays[f"k{i}"] = k[:, :n]
        arrays[f"v{i}"] = v[:, :n]
    for name, a in cache.saved_state().items():  # a recurrent state (models/recurrent.py)
        arrays[f"state_{name}"] = a
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(_create_private(tmp), "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _create_private(path: Path) -> int:
    """A new file only the owner can read, 0600 from its creation (a chmod afterwards would leave
    a moment in which it is readable). A temporary file left by a crash is replaced; O_EXCL and
    O_NOFOLLOW refuse to write through a link planted in its place."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)


def private_dir(path: str | os.PathLike) -> Path:
    """Create `path` as a 0700 directory, or take an existing one down to 0700 if others could
    read or enter it (a warning says so)."""
    path = Path(path)
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            os.chmod(path, DIR_MODE)
            log.warning("%s was readable by others (mode %04o); it holds saved conversations, so it is now 0700",
                        path, mode)
    except FileExistsError:
        raise ColibriError(f"{path} exists and is not a directory; pick another --state-dir") from None
    except PermissionError as e:
        raise ColibriError(f"cannot make {path} private to this user ({e.strerror}); pick another --state-dir") \
            from None
    return path


def load_kv(path: str | os.PathLike, cache, model_id: str) -> list[int]:
    """Restore a saved slot into `cache`; returns its token ids. A file from another model or
    format, or a damaged one, raises ColibriError (the caller starts that slot empty)."""
    try:
        with np.load(path) as z:
            if int(z["version"]) != FORMAT_VERSION or str(z["model_id"]) != model_id:
                raise ColibriError(f"{path}: KV file is for another model or format")
            ids = z["ids"].tolist()
            if len(cache.k) and z["k0"].dtype != cache.k[0].dtype:
                raise ColibriError(f"{path}: KV file was saved with another --kv-cache")
            cache.truncate(0)
            cache.reserve(len(ids))
            for i in range(len(cache.k)):
                cache.k[i][:, : len(ids)] = z[f"k{i}"]
                cache.v[i][:, : len(ids)] = z[f"v{i}"]
            cache.restore_state({name[len("state_"):]: z[name] for name in z.files if name.startswith("state_")})
    except ColibriError:
        raise
    except Exception as e:  # truncated zip, missing arrays, wrong shapes
        raise ColibriError(f"{path}: unreadable KV file ({e})") from None
    cache.length = len(ids)
    return ids
