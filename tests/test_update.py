"""The PPO update's critic-only passes (ppo.critic_epochs); its minibatches and micro-batches are
tested with the loss in tests/test_objectives.py."""

import pytest
import torch
from test_objectives import _prepared

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.trainers.optim import make_optimizer
from rlhf_torchrl.trainers.update import critic_pass_loss, make_minibatch_buffer, ppo_update


def _run(model_dir, tokenizer, critic_init, critic_epochs):
    policy, loss, critic, td = _prepared(model_dir, tokenizer, critic_init=critic_init)
    optimizer, scheduler = make_optimizer(policy, critic, lr=1e-3, value_head_lr=1e-2, total_steps=10)
    stats = ppo_update(td, loss, optimizer, num_ppo_epochs=1, num_mini_batches=2, scheduler=scheduler,
                       replay_buffer=make_minibatch_buffer(8, 4, seed=0), critic_epochs=critic_epochs)
    return policy, critic, stats, scheduler


@pytest.mark.parametrize("critic_init", ["policy", "shared"])
def test_critic_passes_train_the_critic_alone(critic_init, tiny_llama_dir, tokenizer):
    """critic_epochs=3 after one PPO epoch: the policy (a shared trunk too) ends exactly where the
    PPO epoch left it, the critic's own parameters train further, the learning-rate schedule
    advances with the PPO steps alone, and the passes' value loss is reported apart."""
    policy, critic, once, scheduler = _run(tiny_llama_dir, tokenizer, critic_init, None)
    policy_k, critic_k, more, scheduler_k = _run(tiny_llama_dir, tokenizer, critic_init, 3)
    for a, b in zip(policy.parameters(), policy_k.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(critic.head.weight, critic_k.head.weight)
    if critic_init == "policy":  # a separate critic's trunk is the critic's own
        assert any(not torch.equal(a, b) for a, b in zip(critic.backbone.parameters(),
                                                          critic_k.backbone.parameters()))
    assert scheduler.last_epoch == scheduler_k.last_epoch == 2
    assert "loss/value_critic_passes_avg" not in once
    assert 0 < more["loss/value_critic_passes_avg"] < once["loss/value_avg"]  # it keeps learning
    for key in ("loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "grad_norm"):
        assert more[key] == pytest.approx(once[key], rel=1e-6), key


class _Processes:
    """A data-parallel stand-in: the loss runs whole, as under DDP or FSDP2."""

    enabled = True

    def loss(self, loss_module, td):
        return loss_module(td)


def test_critic_pass_loss_is_the_value_term(tiny_llama_dir, tokenizer):
    """One process: the critic's forward alone, the policy held out of autograd; several
    processes: the whole loss with the other terms at 0. Both give the loss's loss_critic and the
    value head the same gradient."""
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, critic_init="shared",
                                         entropy_coef=0.01, kl_loss_coef=0.1)
    expected = loss(td)["loss_critic"].detach()
    alone = critic_pass_loss(loss, td)
    assert list(alone.keys()) == ["loss_critic"]
    torch.testing.assert_close(alone["loss_critic"].detach(), expected)
    alone["loss_critic"].backward()
    head_grad = critic.head.weight.grad.clone()
    assert all(p.grad is None for p in policy.parameters())  # not even the shared trunk's
    assert all(p.requires_grad for p in policy.parameters())  # restored
    critic.head.zero_grad()
    whole = critic_pass_loss(loss, td, _Processes())
    assert {"loss_objective", "loss_critic", "loss_entropy", "loss_kl"} <= set(whole.keys())
    torch.testing.assert_close(whole["loss_critic"].detach(), expected)
    assert all(float(v) == 0 for k, v in whole.items() if k != "loss_critic")
    sum(whole.values()).backward()
    torch.testing.assert_close(critic.head.weight.grad, head_grad)
    assert all(p.grad is None or not p.grad.any() for p in policy.parameters())


def test_critic_epochs_need_a_critic_and_the_ppo_epochs(tiny_llama_dir, tokenizer):
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer)
    optimizer = torch.optim.SGD(loss.parameters(), lr=0.0)
    with pytest.raises(ConfigError, match="critic_epochs=1: the critic trains in each of the "
                                          "num_ppo_epochs=2"):
        ppo_update(td, loss, optimizer, num_ppo_epochs=2, num_mini_batches=1, critic_epochs=1)
    critic_free = make_ppo_loss(loss.actor_network)
    td.exclude(K.VALUE_TARGET)
    with pytest.raises(ConfigError, match="this loss has no critic"):
        ppo_update(td, critic_free, optimizer, num_ppo_epochs=1, num_mini_batches=1, critic_epochs=2)
