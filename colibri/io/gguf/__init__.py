"""GGUF -> Hugging Face-shaped checkpoint (config, tensors, experts, tokenizer) as a lossless
repack, for the llama.cpp architectures of colibri's families: llama (and Mixtral, llama with
experts), qwen2moe, qwen3moe, olmoe, glm4moe, deepseek2 (DeepSeek-V3 / Kimi-K2), the Gated DeltaNet
hybrids qwen35moe and qwen3next, and gpt-oss.

Follows transformers' GGUF loader (`modeling_gguf_pytorch_utils.py`, `integrations/ggml.py`,
`integrations/gguf/gguf_tokenizer_mapping.py`) where it has the architecture -- same tensor
names, same reverse permutation of llama's attn_q / attn_k, same tokenizer -- and llama.cpp's
convert_hf_to_gguf.py and src/models/*.cpp elsewhere, so colibri, transformers and llama.cpp
read one GGUF identically.

Modules: reader (files, split sets, tensor table, byte repacks), config (metadata -> config.json),
names (tensor names), tokenizer, checkpoint (read_gguf, GGUFStack).
"""
from colibri.io.gguf.checkpoint import GGUFCheckpoint, GGUFStack, GGUFTensors, read_gguf, tensor_from_spec
from colibri.io.gguf.config import ARCHITECTURES
from colibri.io.gguf.reader import SUPPORTED_TYPES
from colibri.io.gguf.tokenizer import bytes_to_unicode

__all__ = ["ARCHITECTURES", "GGUFCheckpoint", "GGUFStack", "GGUFTensors", "SUPPORTED_TYPES", "bytes_to_unicode",
           "read_gguf", "tensor_from_spec"]
