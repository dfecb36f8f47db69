"""Sampler, jitted steps, continuous-batching scheduler and the offline LLM API."""
