"""Model definitions (Llama / Qwen2 / Qwen3 families) and checkpoint loaders."""
