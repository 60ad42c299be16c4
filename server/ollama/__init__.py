"""Ollama-compatible routes (/api/chat, /api/generate, /api/tags, /api/show, /api/version) over the same
chat serving path as /v1/chat/completions, so Ollama clients connect unchanged."""
