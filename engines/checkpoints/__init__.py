"""Checkpoint formats as their makers ship them, read in place: block-scaled FP8 (DeepSeek's releases),
MXFP4 experts (DeepSeek-V4), GGUF quants, kt-kernel's pre-converted expert folders. Family-agnostic: a
model family maps tensor names; these modules decode what the names point at."""
