"""OpenAI-compatible HTTP server: `python -m jfp8kv.serve`."""
