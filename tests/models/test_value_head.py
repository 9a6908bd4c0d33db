import torch

from fleetrl.models.logprobs import build_inputs
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from fleetrl.models.value_head import CriticModel, backbone_of, build_critic


def _inputs():
    prompts = torch.tensor([[0, 49, 48, 14], [49, 48, 15, 16]])
    responses = torch.tensor([[17, 1, 0], [18, 19, 20]])
    return build_inputs(prompts, (prompts != 0).long(), responses, torch.tensor([[1, 1, 0], [1, 1, 1]]))


def test_backbone_of_llama_is_model_model():
    actor = build_tiny_model(build_tiny_tokenizer())
    assert backbone_of(actor) is actor.model


def test_critic_shape_and_zero_init():
    actor = build_tiny_model(build_tiny_tokenizer())
    critic = build_critic(actor)
    assert isinstance(critic, CriticModel)
    assert torch.count_nonzero(critic.value_head.weight) == 0 and critic.value_head.bias.item() == 0.0
    values = critic(*_inputs())
    assert values.shape == (2, 7) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(2, 7))


def test_critic_is_a_separate_copy_and_learns():
    actor = build_tiny_model(build_tiny_tokenizer())
    critic = build_critic(actor)
    assert critic.backbone is not actor.model
    before = actor.model.embed_tokens.weight.clone()
    critic(*_inputs()).sub(1.0).pow(2).mean().backward()
    # loss = mean over 14 values of (0 - 1)^2 -> d/dbias = 14 * 2 * (0 - 1) / 14 = -2; the zero head passes
    # no gradient to the backbone on this first step
    assert abs(critic.value_head.bias.grad.item() + 2.0) < 1e-6
    assert torch.count_nonzero(critic.backbone.embed_tokens.weight.grad) == 0
    with torch.no_grad():
        critic.backbone.embed_tokens.weight.add_(1.0)
    assert torch.equal(actor.model.embed_tokens.weight, before)


def test_build_critic_from_spec_and_state_dict_round_trip():
    critic = build_critic("tiny:seed=5")
    with torch.no_grad():
        critic.value_head.weight.normal_()
        critic.value_head.bias.fill_(0.5)
    state = critic.state_dict()
    assert "value_head.weight" in state and "backbone.embed_tokens.weight" in state
    fresh = build_critic("tiny:seed=5")
    fresh.load_state_dict(state)
    inputs = _inputs()
    expected = critic(*inputs)
    assert torch.equal(fresh(*inputs), expected) and expected.abs().sum() > 0
