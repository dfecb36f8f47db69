"""jfp8kv: a JAX LLM inference engine whose paged KV cache can be stored in FP8."""

from jfp8kv.engine.llm import LLM, generate
from jfp8kv.engine.types import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "generate"]
__version__ = "0.1.0"
