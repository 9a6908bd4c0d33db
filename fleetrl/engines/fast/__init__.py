"""The fast rollout engine: own Llama/Qwen2/Qwen3/Mistral forward, static KV cache, CUDA graphs, continuous batching."""
from fleetrl.engines.fast.engine import FastRolloutEngine

__all__ = ["FastRolloutEngine"]
