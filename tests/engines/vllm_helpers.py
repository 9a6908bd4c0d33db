"""Shared pieces of the vLLM engine tests: tiny models vLLM's CPU attention accepts, prompts, the trainer's view."""
from __future__ import annotations

import torch

from fleetrl.engines.protocol import GenerationOutput
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer


def tiny(arch: str, seed: int = 0) -> tuple[torch.nn.Module, object]:
    """fp32 tiny model + word tokenizer. head_dim 64: vLLM's CPU attention takes multiples of 32 only (the default
    tiny model's 16 is refused). Qwen2's q/k/v biases and both arches' norms are randomised so they matter."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=128, num_heads=2, seed=seed, arch=arch)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            if arch == "qwen2":
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model, tok


def prompts(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


TEXTS = ["user : copy a b c assistant :", "user : add 1 2 assistant :", "user : next q assistant :"]


def trainer_logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, out: GenerationOutput,
                     temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at the response ids from one full forward of prompt + response, 0 where masked."""
    full = torch.cat([ids, out.responses], 1)
    with torch.no_grad():
        logits = model(full, attention_mask=torch.cat([mask, out.response_mask], 1)).logits.float()
    logits = logits[:, ids.shape[1] - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(2, out.responses[..., None])[..., 0] * out.response_mask
