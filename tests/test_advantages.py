"""The advantage estimators and group statistics against plain Python loops."""

import math

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import (
    GRPOAdvantage,
    ReinforcePPAdvantage,
    ResponseGAE,
    RLOOAdvantage,
    group_metrics,
    informative_groups,
    make_advantage,
    needs_critic,
)
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller


def _batch(seed=0, groups=(5, 5, 2, 9, 2, 9, 5, 9, 2), width=6, with_kl=True):
    """Rows of ragged lengths in interleaved groups; rewards: -0.1 * KL, + the score at the end."""
    g = torch.Generator().manual_seed(seed)
    n = len(groups)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    score = torch.randn(n, generator=g, dtype=torch.float64)
    kl = torch.rand(n, width, generator=g, dtype=torch.float64) * float(with_kl)
    reward, non_score = F.per_token_rewards(score, kl, mask, kl_coef=0.1)
    return TensorDict({K.REWARD: reward.unsqueeze(-1), K.NON_SCORE_REWARD: non_score.unsqueeze(-1),
                       K.RESPONSE_MASK: mask, K.SCORE: score, K.GROUP: torch.tensor(groups)}, [n])


def _rows(td):
    mask = td.get(K.RESPONSE_MASK)
    rewards = td.get(K.REWARD).squeeze(-1)
    return [[float(r) for r, m in zip(row, valid) if m] for row, valid in zip(rewards, mask)]


def _to_go(rewards, gamma=1.0):
    out, acc = [], 0.0
    for r in reversed(rewards):
        acc = r + gamma * acc
        out.append(acc)
    return out[::-1]


def _check(td, expected):
    adv = td.get(K.ADVANTAGE).squeeze(-1)
    mask = td.get(K.RESPONSE_MASK)
    for i, row in enumerate(expected):
        assert adv[i, : len(row)].tolist() == pytest.approx(row, abs=1e-9)
        assert (adv[i, len(row):] == 0).all() and mask[i].sum() == len(row)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_returns_to_go_match_a_loop(gamma):
    td = _batch()
    got = F.returns_to_go(td.get(K.REWARD).squeeze(-1), td.get(K.RESPONSE_MASK), gamma)
    for i, row in enumerate(_rows(td)):
        assert got[i, : len(row)].tolist() == pytest.approx(_to_go(row, gamma), abs=1e-12)
        assert (got[i, len(row):] == 0).all()


def test_group_reductions_match_a_loop():
    values = torch.tensor([1.0, 4.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    groups = torch.tensor([3, 1, 3, 1, 3])
    members = {int(k): [float(v) for v, h in zip(values, groups) if h == k] for k in groups}
    for i, k in enumerate(groups.tolist()):
        same = members[k]
        mean = sum(same) / len(same)
        std = math.sqrt(sum((v - mean) ** 2 for v in same) / (len(same) - 1))
        others = list(same)
        others.remove(float(values[i]))
        assert float(F.group_mean(values, groups)[i]) == pytest.approx(mean)
        assert float(F.group_std(values, groups)[i]) == pytest.approx(std)
        loo = float(F.leave_one_out_mean(values, groups)[i])
        assert loo == pytest.approx(sum(others) / len(others))
    with pytest.raises(ValueError, match="at least 2 rows per group"):
        F.leave_one_out_mean(values, torch.tensor([0, 0, 1, 1, 2]))
    with pytest.raises(ValueError, match="at least 2 rows per group"):
        F.group_std(values, torch.tensor([0, 0, 1, 1, 2]))


def _kl_rows(td):
    """Per row: the valid tokens' KL rewards (-0.1 * KL)."""
    mask, kl = td.get(K.RESPONSE_MASK), td.get(K.NON_SCORE_REWARD).squeeze(-1)
    return [[float(k) for k, m in zip(row, valid) if m] for row, valid in zip(kl, mask)]


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_a_loop(scale_by_std):
    """The score against the group's scores (scaled by their spread), plus the KL penalty's
    return-to-go, unscaled."""
    td = _batch()
    groups, scores = td.get(K.GROUP).tolist(), td.get(K.SCORE).tolist()
    expected = []
    for i, kl in enumerate(_kl_rows(td)):
        same = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        mean = sum(same) / len(same)
        std = math.sqrt(sum((v - mean) ** 2 for v in same) / (len(same) - 1))
        scale = std + 1e-6 if scale_by_std else 1.0
        expected.append([(scores[i] - mean) / scale + g for g in _to_go(kl)])
    _check(GRPOAdvantage(scale_by_std=scale_by_std)(td), expected)


def test_rloo_matches_a_loop():
    td = _batch(seed=1)
    groups, scores = td.get(K.GROUP).tolist(), td.get(K.SCORE).tolist()
    expected = []
    for i, kl in enumerate(_kl_rows(td)):
        others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        expected.append([scores[i] - sum(others) / len(others) + g for g in _to_go(kl)])
    _check(RLOOAdvantage()(td), expected)


def test_group_baselines_never_scale_kl_noise():
    """A group whose scores are all equal gets no score advantage, only its KL credit, however
    small the spread of its KL-shaped returns (GRPO's division by the scores' spread alone)."""
    td = _batch(seed=4, groups=(0, 0, 0, 1, 1, 1))
    td.set(K.SCORE, torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5], dtype=torch.float64))
    reward, non_score = F.per_token_rewards(td.get(K.SCORE), -10 * td.get(K.NON_SCORE_REWARD).squeeze(-1),
                                            td.get(K.RESPONSE_MASK), kl_coef=0.1)
    td.set(K.REWARD, reward.unsqueeze(-1))
    adv = GRPOAdvantage()(td).get(K.ADVANTAGE).squeeze(-1)
    kl_to_go = F.returns_to_go(non_score, td.get(K.RESPONSE_MASK))
    torch.testing.assert_close(adv[:3], kl_to_go[:3])
    assert adv.abs().max() < 5


def test_score_only_rewards_give_every_token_the_same_advantage():
    """With the KL in the loss (none in the reward) a response's advantage is one number: its score
    against the group's, as GRPO and RLOO define it."""
    td = _batch(seed=2, with_kl=False)
    score, groups = td.get(K.SCORE), td.get(K.GROUP)
    adv = RLOOAdvantage()(td.clone()).get(K.ADVANTAGE).squeeze(-1)
    mask = td.get(K.RESPONSE_MASK)
    expected = (score - F.leave_one_out_mean(score, groups)).unsqueeze(-1).expand_as(adv)
    torch.testing.assert_close(adv[mask], expected[mask])


@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_reinforce_pp_matches_a_loop(gamma):
    td = _batch(seed=3)
    per_row = [_to_go(r, gamma) for r in _rows(td)]
    flat = [g for row in per_row for g in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / (len(flat) - 1) + 1e-8)
    expected = [[(g - mean) / std for g in row] for row in per_row]
    _check(ReinforcePPAdvantage(gamma=gamma)(td), expected)


def test_group_statistics_and_dynamic_filter():
    td = TensorDict({K.SCORE: torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]),
                     K.GROUP: torch.tensor([4, 4, 7, 7, 9, 9])}, [6])
    assert informative_groups(td).tolist() == [False, False, True, True, False, False]
    stats = group_metrics(td)
    assert stats["group/size"] == 2
    assert stats["group/equal_score_frac"] == pytest.approx(2 / 3)
    assert stats["group/score_std"] == pytest.approx(math.sqrt(0.5) / 3)
    # one response per prompt: no group statistics
    assert group_metrics(TensorDict({K.SCORE: torch.ones(3), K.GROUP: torch.arange(3)}, [3])) == {}


def test_group_filter_reads_the_scores_the_baseline_compares():
    """DAPO's filter compares each row's score as the group baseline does: clipped (raw 2 and 3
    under score_clip=1 are both 1: dropped), with a multi-turn episode's turn rewards (equal
    scores 0.5, a tool's 0.5 in one row: kept), and not rounded apart by the KL in the reward
    (0.7 and 0.7: recovered as (0.7 - 0.05 * KL) + 0.05 * KL, fp32 rounds them apart: dropped)."""
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    score = torch.tensor([2.0, 3.0, 0.5, 0.5, 0.0, 1.0, 0.7, 0.7])
    mask = torch.ones(8, 3, dtype=torch.bool)
    turn_reward = torch.zeros(8, 3)
    turn_reward[2, 1] = 0.5  # a tool's reward at the end of row 2's first turn
    log_prob = torch.full((8, 3), -1.0)
    ref_log_prob = log_prob.clone()
    ref_log_prob[:, -1] = torch.tensor([-1.1] * 6 + [-1.37, -1.1])  # KL 0.1 (0.37) at the end
    td = TensorDict({K.SCORE: score, K.GROUP: groups, K.RESPONSE_MASK: mask,
                     K.TURN_REWARD: turn_reward, K.LOG_PROB: log_prob,
                     K.REF_LOG_PROB: ref_log_prob}, [8])
    KLRewardShaper(make_kl_controller(0.05), score_clip=1.0)(td)
    assert informative_groups(td).tolist() == [False, False, True, True, True, True, False, False]
    assert group_metrics(td)["group/equal_score_frac"] == 0.5
    from rlhf_torchrl.objectives.advantages import group_scores

    assert group_scores(td).tolist() == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.7, 0.7])
    assert group_scores(td)[6] == group_scores(td)[7]
    # the baseline reads the same scores: the dropped groups have no score advantage, only KL
    kl_to_go = F.returns_to_go(td.get(K.NON_SCORE_REWARD).squeeze(-1), mask)
    advantage = RLOOAdvantage()(td).get(K.ADVANTAGE).squeeze(-1)
    dropped = [0, 1, 6, 7]
    torch.testing.assert_close(advantage[dropped], kl_to_go[dropped], rtol=0, atol=0)
    assert advantage[2, 0] - kl_to_go[2, 0] == pytest.approx(0.5)  # 1.0 (0.5 + the tool's) - 0.5


def test_estimator_registry():
    assert isinstance(make_advantage("gae"), ResponseGAE) and needs_critic(make_advantage("gae"))
    for name, cls in (("grpo", GRPOAdvantage), ("rloo", RLOOAdvantage),
                      ("reinforce_pp", ReinforcePPAdvantage)):
        module = make_advantage(name)
        assert isinstance(module, cls) and not needs_critic(module)
    assert not make_advantage("grpo", scale_by_std=False).scale_by_std
    from rlhf_torchrl.objectives.advantages import (
        compares_groups,  # where DAPO's group filter applies
    )

    assert [compares_groups(make_advantage(name)) for name in ("gae", "grpo", "rloo", "reinforce_pp")
            ] == [False, True, True, False]
    with pytest.raises(ConfigError, match="grpo, rloo"):
        make_advantage("ppo")


def _with_values(td, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = td.get(K.RESPONSE_MASK)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    td.set(K.VALUE, values.unsqueeze(-1))
    return td


def _gae_rows(td, lmbdas, gamma=1.0):
    """GAE by the recursive definition, row by row at each row's own lambda."""
    out = []
    for row, values, lmbda in zip(_rows(td), _value_rows(td), lmbdas):
        adv, acc = [], 0.0
        for t in reversed(range(len(row))):
            next_v = values[t + 1] if t + 1 < len(row) else 0.0
            acc = row[t] + gamma * next_v - values[t] + gamma * lmbda * acc
            adv.append(acc)
        out.append(adv[::-1])
    return out


def _check_close(td, expected):
    """As _check, to float32 rounding: TorchRL's GAE takes its discount in float32."""
    adv = td.get(K.ADVANTAGE).squeeze(-1)
    for i, row in enumerate(expected):
        assert adv[i, : len(row)].tolist() == pytest.approx(row, abs=1e-6)
        assert (adv[i, len(row):] == 0).all()


def _value_rows(td):
    mask = td.get(K.RESPONSE_MASK)
    return [[float(v) for v, m in zip(row, valid) if m]
            for row, valid in zip(td.get(K.VALUE).squeeze(-1), mask)]


def test_gae_critic_lambda_gives_the_value_targets():
    """ppo.lmbda_critic: the value targets are GAE(lmbda_critic) + V (VC-PPO's 1.0: the Monte
    Carlo return, whatever the values), the advantages stay GAE(lmbda), whitened."""
    td = _with_values(_batch())
    ResponseGAE(lmbda=0.95, lmbda_critic=1.0, whiten_advantages=False)(td)
    targets = td.get(K.VALUE_TARGET).squeeze(-1)
    for i, row in enumerate(_rows(td)):  # gamma 1, lambda 1: the return-to-go
        assert targets[i, : len(row)].tolist() == pytest.approx(_to_go(row), abs=1e-9)
    _check_close(td, _gae_rows(td, [0.95] * len(td)))
    whitened = _with_values(_batch())
    ResponseGAE(lmbda=0.95, lmbda_critic=1.0)(whitened)
    mask = whitened.get(K.RESPONSE_MASK)
    torch.testing.assert_close(whitened.get(K.ADVANTAGE).squeeze(-1),
                               F.masked_whiten(td.get(K.ADVANTAGE).squeeze(-1), mask))
    torch.testing.assert_close(whitened.get(K.VALUE_TARGET), td.get(K.VALUE_TARGET))
    # the defaults: one lambda for both, as PPO has it
    plain = _with_values(_batch())
    ResponseGAE(lmbda=0.95, whiten_advantages=False)(plain)
    values = plain.get(K.VALUE).squeeze(-1)
    torch.testing.assert_close(plain.get(K.VALUE_TARGET).squeeze(-1),
                               (plain.get(K.ADVANTAGE).squeeze(-1) + values) * mask)


def test_gae_length_adaptive_policy_lambda():
    """ppo.lmbda_length_alpha: each response's advantages use 1 - 1/(alpha * its length) (VAPO),
    the value targets lmbda_critic (or lmbda when unset)."""
    td = _with_values(_batch(width=30))
    lengths = td.get(K.RESPONSE_MASK).sum(-1).tolist()
    ResponseGAE(lmbda=0.95, lmbda_length_alpha=0.2, whiten_advantages=False)(td)
    per_row = [max(0.0, 1 - 1 / (0.2 * n)) if n else 0.0 for n in lengths]
    assert len(set(per_row)) > 2  # the rows differ
    _check_close(td, _gae_rows(td, per_row))
    targets = td.get(K.VALUE_TARGET).squeeze(-1)
    for i, (adv, values) in enumerate(zip(_gae_rows(td, [0.95] * len(td)), _value_rows(td))):
        expected = [a + v for a, v in zip(adv, values)]
        assert targets[i, : len(adv)].tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ConfigError, match="lmbda_critic must be in"):
        ResponseGAE(lmbda_critic=1.5)
    with pytest.raises(ConfigError, match="lmbda_length_alpha must be > 0"):
        make_advantage("gae", lmbda_length_alpha=0.0)
    module = make_advantage("gae", lmbda_critic=1.0, lmbda_length_alpha=0.05)
    assert (module.lmbda_critic, module.lmbda_length_alpha) == (1.0, 0.05)
