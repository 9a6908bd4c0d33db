"""The `vllm` rollout engine (engine.py); vllm itself is imported only when an engine is built."""
from fleetrl.engines.vllm.engine import VLLMRolloutEngine

__all__ = ["VLLMRolloutEngine"]
