"""colibri: run Mixture-of-Experts language models bigger than memory."""

__version__ = "0.1.0"
__all__ = ["Engine", "ColibriError", "__version__"]

import os

# GNU OpenMP (numba's threading layer here) spins 300,000 rounds in a finished parallel region
# before its worker sleeps: ~16 ms where `pause` is slow (recent Xeons). That held a core busy
# through the next decode token, whose team (colibri.kernels.team) then ran on one core: 11.1
# ms a SmolLM2 token instead of 7.2. 10,000 rounds still cover the gaps between the regions
# of a layer-by-layer token (8.3 ms a token either way; 1,000 made it 15). Set before numba
# loads the library, which reads it once; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from colibri.errors import ColibriError  # noqa: E402


def __getattr__(name):
    # Imported lazily so `colibri --help` does not pay for numba and the model code.
    if name == "Engine":
        from colibri.engine import Engine

        return Engine
    raise AttributeError(name)
