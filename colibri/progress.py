"""A start-up phase that may take more than a second, shown while it runs: on a terminal a
spinner whose text is re-rendered (bytes so far, rate), else one line, "reading ... done in
N s (R GB/s)", so logs show every phase too. colibri.warmup shows the kernel compile the same
way."""
from __future__ import annotations

import sys
import threading
import time



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
        console = status_console(out)
        if console is not None:
            console.print(text, highlight=False)
        else:
            stream = text_stream(out)
            stream.write(text + "\n")
            stream.flush()

    def __rich__(self) -> str:
        s = time.perf_counter() - self._t0
        rate = self.done / s / 1e9 if s > 0 else 0.0
        return f"{self.what}: {self.done / 1e9:.1f} of {self.total / 1e9:.1f} GB ({rate:.1f} GB/s)"

    def __enter__(self) -> "ByteProgress":
        self._t0 = time.perf_counter()
        self._console = status_console(self.out)
        if self._console is not None:
            self._status = self._console.status(self)
            self._status.start()
        else:
            stream = text_stream(self.out)
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
            stream = text_stream(self.out)
            stream.write(f"done: {summary}\n" if kind is None else "failed\n")
            stream.flush()


def status_console(out):
    """The Rich console to draw a spinner on, or None when `out` is not a terminal."""
    from rich.console import Console

    if isinstance(out, Console):
        return out if out.is_terminal else None
    if out is None:
        from rich import get_console

        shared = get_console()
        # `colibri chat` loads the model under a spinner on Rich's global console; a second live
        # display on another console would fight it for the same rows, so nest under it.
        if shared.is_terminal and getattr(shared, "_live_stack", None):
            return shared
        out = sys.stderr
    return Console(file=out) if out.isatty() else None


def text_stream(out):
    from rich.console import Console

    if isinstance(out, Console):
        return out.file
    return out if out is not None else sys.stderr
