"""GGUF import (colibri/io/gguf/): this name stays for the callers that import it."""
from colibri.io.gguf import (ARCHITECTURES, SUPPORTED_TYPES, GGUFCheckpoint, GGUFStack, GGUFTensors,  # noqa: F401
                             bytes_to_unicode, read_gguf)
