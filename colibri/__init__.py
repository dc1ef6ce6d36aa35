"""colibri: run Mixture-of-Experts language models bigger than memory."""

__version__ = "0.1.0"
__all__ = ["Engine", "ColibriError", "__version__"]

from colibri.errors import ColibriError


def __getattr__(name):
    # Imported lazily so `colibri --help` does not pay for numba and the model code.
    if name == "Engine":
        from colibri.engine import Engine

        return Engine
    raise AttributeError(name)
