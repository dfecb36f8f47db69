"""Sampler, jitted steps, continuous-batching scheduler, the engine builder, calibration's
forward pass and the offline LLM API."""
