"""TorchRL's own value estimators on token_view(rollout) equal ResponseGAE's (unwhitened)
advantages and value targets on the policy's tokens, single responses and multi-turn episodes
with the environment's tokens between the turns; merge_token_view brings them back."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.value import GAE, TD0Estimator, TDLambdaEstimator, VTrace

from rlhf_torchrl import keys as K
from rlhf_torchrl.data.trajectory import LogProbReader, merge_token_view, token_view
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import ResponseGAE

GAMMA, LMBDA = 0.99, 0.9


def _rollout(holes: bool, B=5, R=7, seed=0) -> TensorDict:
    """Right-padded responses of lengths 7, 6, 5, 4, 7 with shaped rewards and values; with
    ``holes``, rows 1 and 3 are multi-turn episodes (the environment's tokens inside)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, R, dtype=torch.bool)
    for i in range(B):
        mask[i, R - i % 4:] = False
    observation = torch.zeros(B, R, dtype=torch.bool)
    if holes:
        for row, cols in ((1, slice(2, 4)), (3, slice(1, 2))):
            mask[row, cols], observation[row, cols] = False, True
    reward = torch.where(mask, torch.randn(B, R, generator=g), 0.0).unsqueeze(-1)
    return TensorDict({
        K.RESPONSE_TOKENS: torch.randint(10, 100, (B, R), generator=g), K.RESPONSE_MASK: mask,
        K.OBSERVATION_MASK: observation, K.REWARD: reward,
        K.VALUE: torch.randn(B, R, 1, generator=g),  # nonzero on pads and holes too
        K.LOG_PROB: -torch.rand(B, R, generator=g), K.SCORE: torch.randn(B, generator=g),
        K.PROMPT_TOKENS: torch.ones(B, 3, dtype=torch.long),
    }, batch_size=[B])


def _vtrace():
    vtrace = VTrace(gamma=GAMMA, value_network=None, actor_network=LogProbReader())
    vtrace.set_keys(sample_log_prob=K.LOG_PROB)  # on-policy: the ratio is 1
    return vtrace


# estimator -> the ResponseGAE lambda it equals (VTrace on-policy, rho = c = 1: TD(1))
ESTIMATORS = {
    "GAE": (lambda: GAE(gamma=GAMMA, lmbda=LMBDA, value_network=None), LMBDA),
    "TD0Estimator": (lambda: TD0Estimator(gamma=GAMMA, value_network=None), 0.0),
    "TDLambdaEstimator": (lambda: TDLambdaEstimator(gamma=GAMMA, lmbda=LMBDA, value_network=None),
                          LMBDA),
    "VTrace": (_vtrace, 1.0),
}


@pytest.mark.parametrize("holes", [False, True], ids=["one-response", "multi-turn"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_torchrl_estimators_on_the_view_equal_response_gae(name, holes):
    make, lmbda = ESTIMATORS[name]
    rollout = _rollout(holes)
    expected = ResponseGAE(gamma=GAMMA, lmbda=lmbda, whiten_advantages=False)(rollout.clone())
    view = token_view(rollout)
    make()(view)  # TorchRL's module, unchanged
    merged = merge_token_view(rollout.clone(), view)
    mask = rollout.get(K.RESPONSE_MASK).unsqueeze(-1)
    for key in (K.ADVANTAGE, K.VALUE_TARGET):
        assert merged.get(key).shape == (5, 7, 1)
        torch.testing.assert_close(merged.get(key), expected.get(key), atol=1e-6, rtol=1e-6)
        assert not merged.get(key)[~mask].any(), key  # 0 on pads and the environment's tokens


def test_the_view_is_torchrls_trajectory_layout():
    """Batch (B, R); done and terminated at each row's last policy token only; V_{t+1} the next
    policy token's value (past a hole), 0 after the last; a right-padded rollout's tensors shared,
    the rollout itself unchanged; text and per-response entries left out."""
    rollout = _rollout(holes=False)
    rollout.set(K.DONE, torch.zeros(5, 7, 1, dtype=torch.bool))  # a stale entry: not read
    view = token_view(rollout)
    assert view.batch_size == (5, 7) and K.SCORE not in view.keys(True) and K.PROMPT_TOKENS not in view.keys(True)
    assert view.get(K.REWARD).data_ptr() == rollout.get(K.REWARD).data_ptr()
    lengths = [7, 6, 5, 4, 7]
    done = view.get(K.DONE).squeeze(-1)
    assert done.sum(-1).tolist() == [1] * 5 and done.long().argmax(-1).tolist() == [n - 1 for n in lengths]
    assert torch.equal(view.get(K.TERMINATED), view.get(K.DONE))
    assert not rollout.get(K.DONE).any()
    values, nxt = rollout.get(K.VALUE).squeeze(-1), view.get(("next", K.VALUE)).squeeze(-1)
    for i, n in enumerate(lengths):
        assert torch.equal(nxt[i, : n - 1], values[i, 1:n]) and not nxt[i, n - 1:].any()

    episodes = _rollout(holes=True)  # row 1: policy tokens 0, 1, 4, 5 (2-3 the tool's)
    view = token_view(episodes)
    assert view.get(K.TOKEN_POSITION)[1, :4].tolist() == [0, 1, 4, 5]
    v = episodes.get(K.VALUE)[1].squeeze(-1)
    assert view.get(("next", K.VALUE))[1, :4].squeeze(-1).tolist() == pytest.approx(
        [float(v[1]), float(v[4]), float(v[5]), 0.0])
    assert view.get(K.DONE)[1].squeeze(-1).tolist() == [False, False, False, True, False, False, False]


def test_merge_writes_the_keys_asked_for():
    rollout = _rollout(holes=True)
    view = token_view(rollout)
    view.set("my_estimate", torch.arange(35.0).reshape(5, 7, 1))
    merge_token_view(rollout, view, keys=["my_estimate"])
    out = rollout.get("my_estimate").squeeze(-1)
    assert out[1].tolist() == [7.0, 8.0, 0.0, 0.0, 9.0, 10.0, 0.0]  # steps 0-3 at positions 0, 1, 4, 5
    with pytest.raises(ConfigError, match="merge_token_view needs a view made by token_view"):
        merge_token_view(rollout, TensorDict(batch_size=[5, 7]))


def test_the_view_needs_the_shaped_rewards():
    rollout = _rollout(holes=False).exclude(K.REWARD)
    with pytest.raises(ConfigError, match=r"^token_view reads \('next', 'reward'\), which this "
                                          r"rollout does not have: it is written by the reward "
                                          r"shaper \(KLRewardShaper"):
        token_view(rollout)


@pytest.mark.parametrize("name", ["GAE", "TDLambdaEstimator"])
def test_a_torchrl_estimator_on_the_rollout_runs_on_its_token_view(name, caplog):
    """Run on the rollout itself, TorchRL's estimator stops at its own error (the rollout has one
    row per response); OnTokenView, which PPOTrainer puts around it, runs it on the view."""
    import logging

    from rlhf_torchrl import OnTokenView, PPOTrainer

    make, lmbda = ESTIMATORS[name]
    rollout = _rollout(holes=True)
    if name == "GAE":  # (TDLambdaEstimator fails further on, on the missing done)
        with pytest.raises(ValueError, match="is missing, and no value network was provided"):
            make()(rollout.clone())
    expected = ResponseGAE(gamma=GAMMA, lmbda=lmbda, whiten_advantages=False)(rollout.clone())
    with caplog.at_level(logging.WARNING, logger="rlhf_torchrl.trainers.ppo"):
        trainer = PPOTrainer(collector=[], scorer=None, actor=None, reference=None, critic=None,
                             shaper=None, advantage=make(), loss_module=torch.nn.Linear(1, 1),
                             optimizer=None, num_iterations=1, pad_token_id=0)
    assert isinstance(trainer.advantage, OnTokenView) and "token_view(rollout)" in caplog.text
    out = trainer.advantage(rollout.clone())
    for key in (K.ADVANTAGE, K.VALUE_TARGET):
        torch.testing.assert_close(out.get(key), expected.get(key), atol=1e-6, rtol=1e-6)


def test_on_token_view_refuses_an_estimator_with_a_value_network():
    from rlhf_torchrl import OnTokenView

    with pytest.raises(ConfigError, match="^GAE has a value network, which on the rollout's token "
                                          "view would see single tokens: build it with "
                                          "value_network=None"):
        OnTokenView(GAE(gamma=1.0, lmbda=0.95, value_network=torch.nn.Linear(1, 1)))
    renamed = GAE(gamma=1.0, lmbda=0.95, value_network=None)
    renamed.set_keys(advantage="adv")
    with pytest.raises(ConfigError, match="leave its keys at TorchRL's defaults"):
        OnTokenView(renamed)
