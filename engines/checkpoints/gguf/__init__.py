"""GGUF checkpoints (llama.cpp's format; DeepSeek's `deepseek2` architecture) read where they lie: routed experts
in their ggml blocks for kt-kernel's llamafile kernel, everything else dequantized at load. `writer` writes the
demo model in this format for tests, benchmarks and side-by-side runs with llama.cpp."""
from engines.checkpoints.gguf.checkpoint import GGUFCheckpoint, GGUFExperts
from engines.checkpoints.gguf.files import is_gguf

__all__ = ["GGUFCheckpoint", "GGUFExperts", "is_gguf"]
