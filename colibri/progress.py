"""A start-up phase that may take more than a second, shown while it runs: on a terminal a
spinner whose text is re-rendered (bytes so far, rate), else one line, "reading ... done in
N s (R GB/s)", so logs show every phase too. colibri.warmup shows the kernel compile the same
way."""
from __future__ import annotations

import threading
import time

from colibri.warmup import _console, _stream


class ByteProgress:
    """`with ByteProgress("reading experts", total) as p: ... p.add(n) ...` (thread-safe add)."""

    def __init__(self, what: str, total: int, out=None):
        self.what, self.total, self.out = what, total, out
        self.done = 0
        self._lock = threading.Lock()
        self._status = self._console = None
        self._t0 = 0.0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes

    @staticmethod
    def note(text: str, out=None) -> None:
        """One line about a phase that goes on in the background (nothing to wait for here)."""
        console = _console(out)
        if console is not None:
            console.print(text, highlight=False)
        else:
            stream = _stream(out)
            stream.write(text + "\n")
            stream.flush()

    def __rich__(self) -> str:
        s = time.perf_counter() - self._t0
        rate = self.done / s / 1e9 if s > 0 else 0.0
        return f"{self.what}: {self.done / 1e9:.1f} of {self.total / 1e9:.1f} GB ({rate:.1f} GB/s)"

    def __enter__(self) -> "ByteProgress":
        self._t0 = time.perf_counter()
        self._console = _console(self.out)
        if self._console is not None:
            self._status = self._console.status(self)
            self._status.start()
        else:
            stream = _stream(self.out)
            stream.write(f"{self.what} ({self.total / 1e9:.1f} GB)... ")
            stream.flush()
        return self

    def __exit__(self, kind, *_) -> None:
        s = time.perf_counter() - self._t0
        summary = f"{self.total / 1e9:.1f} GB in {s:.1f} s ({self.total / max(s, 1e-9) / 1e9:.1f} GB/s)"
        if self._status is not None:
            self._status.stop()
            if kind is None:
                self._console.print(f"{self.what}: {summary}", highlight=False)
        else:
            stream = _stream(self.out)
            stream.write(f"done: {summary}\n" if kind is None else "failed\n")
            stream.flush()
