"""OpenAI's Batch API: uploaded JSONL files of requests, run as background work with a durable record."""
