"""The registered policy losses (GSPO, CISPO, Clip-Cov, KL-Cov): each value and gradient against a
plain formula on the same log-probs, exact over micro-batch splits, refused in one line where a
setting cannot go with it."""

import pytest
import torch

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import TokenLevelActor
from rlhf_torchrl.objectives.policy_losses import POLICY_LOSSES, make_policy_loss
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.trainers.update import ppo_update
from tests.test_objectives import _prepared

RATIOS = [1.5, 1.25, 0.5, 0.5, 1.5, 4.0]
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -1.0, -2.0]


def _case(tiny_llama_dir, tokenizer, per_response_advantage=False):
    """An actor and a rollout whose old log-probs give each token a ratio of RATIOS under the
    current policy (cyclically), with ADVANTAGES (or one advantage per response)."""
    policy, _, _, td = _prepared(tiny_llama_dir, tokenizer)
    actor = TokenLevelActor(policy, temperature=0.7)
    with torch.no_grad():
        new = actor.get_dist(td.clone()).log_prob(td[K.RESPONSE_TOKENS])
    idx = torch.arange(new.numel()).reshape(new.shape) % len(RATIOS)
    td.set(K.LOG_PROB, new - torch.tensor(RATIOS).log()[idx])
    adv = torch.tensor(ADVANTAGES)[idx]
    if per_response_advantage:
        adv = torch.tensor(ADVANTAGES)[torch.arange(len(new)) % len(ADVANTAGES)][:, None].expand_as(new)
    td.set(K.ADVANTAGE, adv.unsqueeze(-1).contiguous())
    return actor, td


def _reference(actor, td, per_token, aggregate="token_mean"):
    """(value, gradients) of ``per_token(new, old, adv, mask)`` aggregated, on the actor's log-probs."""
    params = [p for p in actor.parameters() if p.requires_grad]
    new = actor.get_dist(td.clone()).log_prob(td[K.RESPONSE_TOKENS])
    mask = td[K.RESPONSE_MASK]
    loss = per_token(new, td[K.LOG_PROB], td[K.ADVANTAGE].squeeze(-1), mask)
    value = F.aggregate_loss(torch.where(mask, loss, torch.zeros_like(loss)), mask, aggregate)
    return value.detach(), torch.autograd.grad(value, params)


def _ours(actor, loss, td):
    params = [p for p in actor.parameters() if p.requires_grad]
    td = loss.prepare_minibatch(td.clone())
    out = loss(td)
    return out, torch.autograd.grad(out["loss_objective"], params, allow_unused=True)


def _close(grads, expected):
    for g, e in zip(grads, expected):
        torch.testing.assert_close(torch.zeros_like(e) if g is None else g, e, atol=1e-6, rtol=1e-4)


def test_every_policy_loss_is_registered():
    assert {"ppo", "gspo", "cispo", "clip_cov", "kl_cov"} <= set(POLICY_LOSSES)


def test_gspo_is_the_clipped_surrogate_of_each_responses_ratio(tiny_llama_dir, tokenizer):
    """GSPO (Zheng et al. 2025, eq. 5-7): s_i = exp(mean_t log r_it); loss = mean_i
    -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); with one advantage per response its
    gradient is GSPO's own, the sequence ratio's gradient flowing through every token."""
    actor, td = _case(tiny_llama_dir, tokenizer, per_response_advantage=True)
    low, high = 0.2, 0.28
    loss = make_ppo_loss(actor, clip_epsilon_low=low, clip_epsilon_high=high, policy_loss="gspo",
                         loss_aggregation="seq_mean_token_mean")

    def gspo(new, old, adv, mask):
        s = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))[:, None]
        return -torch.minimum(s * adv, s.clamp(1 - low, 1 + high) * adv)

    value, grads = _reference(actor, td, gspo, "seq_mean_token_mean")
    out, ours = _ours(actor, loss, td)
    torch.testing.assert_close(out["loss_objective"], value, atol=1e-6, rtol=1e-5)
    _close(ours, grads)
    # its diagnostics read the response's ratio: every token of a response shares one
    mask = td[K.RESPONSE_MASK]
    s = torch.exp(((td[K.LOG_PROB] * 0 + torch.tensor(RATIOS).log()[
        torch.arange(mask.numel()).reshape(mask.shape) % 6]) * mask).sum(-1) / mask.sum(-1))
    expected_ratio = F.masked_mean(s[:, None].expand_as(mask), mask)
    torch.testing.assert_close(out["ratio"], expected_ratio, atol=1e-5, rtol=1e-5)


def test_cispo_keeps_the_gradient_of_clipped_tokens(tiny_llama_dir, tokenizer):
    """CISPO (MiniMax-M1, eq. 4): loss_t = -sg(min(r_t, 1 + eps_high)) A_t log pi_t; a token past
    the clip keeps its gradient, where PPO's has none."""
    actor, td = _case(tiny_llama_dir, tokenizer)
    loss = make_ppo_loss(actor, clip_epsilon=0.2, policy_loss="cispo")

    def cispo(new, old, adv, mask):
        return -(new - old).exp().clamp(max=1.2).detach() * adv * new

    _, grads = _reference(actor, td, cispo)
    out, ours = _ours(actor, loss, td)
    _close(ours, grads)
    r_hat = torch.tensor(RATIOS).clamp(max=1.2)
    idx = torch.arange(td[K.RESPONSE_MASK].numel()).reshape(td[K.RESPONSE_MASK].shape) % 6
    mask = td[K.RESPONSE_MASK]
    torch.testing.assert_close(out["loss_objective"], (-r_hat * torch.tensor(ADVANTAGES))[idx][mask].mean(),
                               atol=1e-5, rtol=1e-5)
    assert float(out["cispo_truncated_frac"]) == pytest.approx(
        float(((idx == 0) | (idx == 1) | (idx == 4) | (idx == 5))[mask].float().mean()))
    # every token's ratio past the upper clip, A > 0: PPO's gradient is 0, CISPO's is not
    past = td.clone()
    past.set(K.LOG_PROB, td[K.LOG_PROB] - 2.0)
    past.set(K.ADVANTAGE, torch.ones_like(td[K.ADVANTAGE]))
    _, ppo_grads = _ours(actor, make_ppo_loss(actor, clip_epsilon=0.2), past)
    _, cispo_grads = _ours(actor, loss, past)
    assert all(g is None or float(g.abs().max()) == 0 for g in ppo_grads)
    assert max(float(g.abs().max()) for g in cispo_grads if g is not None) > 0


def test_clip_cov_cuts_the_gradient_of_chosen_high_covariance_tokens(tiny_llama_dir, tokenizer):
    """Clip-Cov (Cui et al. 2025): the chosen tokens' covariance lies in [low, high], there are
    max(1, ratio * tokens) of them, and they keep their loss but lose their gradient."""
    actor, td = _case(tiny_llama_dir, tokenizer)
    mask = td[K.RESPONSE_MASK]
    cov = F.token_covariance(td[K.LOG_PROB], td[K.ADVANTAGE].squeeze(-1), mask)
    low, high = float(cov[mask].quantile(0.5)), float(cov[mask].max())
    torch.manual_seed(0)
    loss = make_ppo_loss(actor, clip_epsilon=0.2, policy_loss="clip_cov",
                         policy_loss_args={"ratio": 0.1, "low": low, "high": high})
    prepared = loss.prepare_minibatch(td.clone())
    chosen = prepared[K.COV_SELECTED]
    assert int(chosen.sum()) == max(1, int(0.1 * int(mask.sum())))
    assert bool((cov[chosen] >= low).all() and (cov[chosen] <= high).all() and mask[chosen].all())

    def clip_cov(new, old, adv, mask):
        r = (new - old).exp()
        ppo = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
        return torch.where(chosen, ppo.detach(), ppo)

    value, grads = _reference(actor, prepared, clip_cov)
    out = loss(prepared)
    params = [p for p in actor.parameters() if p.requires_grad]
    ours = torch.autograd.grad(out["loss_objective"], params, allow_unused=True)
    torch.testing.assert_close(out["loss_objective"], value, atol=1e-6, rtol=1e-5)
    _close(ours, grads)
    ppo_value = make_ppo_loss(actor, clip_epsilon=0.2)(td.clone())["loss_objective"]
    torch.testing.assert_close(out["loss_objective"], ppo_value)  # the value is PPO's
    assert float(out["cov_selected_frac"]) == pytest.approx(float(chosen[mask].float().mean()))


def test_kl_cov_penalises_the_top_covariance_tokens(tiny_llama_dir, tokenizer):
    """KL-Cov (Cui et al. 2025): loss_t = -r_t A_t, plus coef |log pi_t - log pi_old_t| on the
    top max(1, ratio * tokens) tokens by covariance."""
    actor, td = _case(tiny_llama_dir, tokenizer)
    mask = td[K.RESPONSE_MASK]
    loss = make_ppo_loss(actor, clip_epsilon=0.2, policy_loss="kl_cov",
                         policy_loss_args={"ratio": 0.2, "coef": 0.5})
    prepared = loss.prepare_minibatch(td.clone())
    chosen = prepared[K.COV_SELECTED]
    cov = F.token_covariance(td[K.LOG_PROB], td[K.ADVANTAGE].squeeze(-1), mask)
    k = max(1, int(0.2 * int(mask.sum())))
    assert int(chosen.sum()) == k
    assert float(cov[chosen].min()) >= float(cov[mask & ~chosen].max())

    def kl_cov(new, old, adv, mask):
        return -(new - old).exp() * adv + torch.where(chosen, 0.5 * (new - old).abs(),
                                                      torch.zeros_like(new))

    value, grads = _reference(actor, prepared, kl_cov)
    out = loss(prepared)
    params = [p for p in actor.parameters() if p.requires_grad]
    _close(torch.autograd.grad(out["loss_objective"], params, allow_unused=True), grads)
    torch.testing.assert_close(out["loss_objective"], value, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name,args", [("clip_cov", {"ratio": 0.2, "low": -1e9, "high": 1e9}),
                                       ("kl_cov", {"ratio": 0.2})])
def test_covariance_controls_are_exact_over_micro_batches(name, args, tiny_llama_dir, tokenizer):
    """The tokens are chosen once per minibatch: the same gradient however it is split."""
    actor, td = _case(tiny_llama_dir, tokenizer)
    loss = make_ppo_loss(actor, clip_epsilon=0.2, policy_loss=name, policy_loss_args=args)
    params = [p for p in loss.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    grads = {}
    for split in ({}, {"gradient_accumulation_steps": 3}, {"micro_batch_tokens": 7}):
        torch.manual_seed(0)  # Clip-Cov's random choice: the same draw each way
        ppo_update(td.clone(), loss, opt, num_ppo_epochs=1, num_mini_batches=1, max_grad_norm=None,
                   **split)
        grads[str(split)] = [p.grad.clone() for p in params]
    first, *others = grads.values()
    for other in others:
        for a, b in zip(first, other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_policy_loss_settings_are_refused_in_one_line(tiny_llama_dir, tokenizer):
    with pytest.raises(ConfigError, match="gspo is defined for ppo.loss_aggregation=seq_mean_token_mean"):
        make_policy_loss("gspo").check(loss_aggregation="token_mean", dual_clip=None)
    with pytest.raises(ConfigError, match="cispo has no clipped surrogate for ppo.dual_clip=3"):
        make_policy_loss("cispo").check(loss_aggregation="token_mean", dual_clip=3.0)
    with pytest.raises(ConfigError, match=r"policy_loss_args: bogus is not a setting of "
                                          r"ppo.policy_loss=clip_cov \(it takes ratio, low, high\)"):
        make_policy_loss("clip_cov", {"bogus": 1})
    with pytest.raises(ConfigError, match="ppo.policy_loss='sppo' is not a registered policy loss: "
                                          "choose one of ppo, .*plugins"):
        make_policy_loss("sppo")


def test_functional_pieces_match_plain_loops():
    g = torch.Generator().manual_seed(0)
    log_ratio, adv = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    mask = torch.arange(5).expand(4, 5) < torch.tensor([[5], [3], [1], [4]])
    seq = F.sequence_log_ratio(log_ratio, mask)
    for i in range(4):
        vals = [float(log_ratio[i, t]) for t in range(5) if mask[i, t]]
        assert float(seq[i]) == pytest.approx(sum(vals) / len(vals), rel=1e-5, abs=1e-6)
    logp = torch.randn(4, 5, generator=g)
    cov = F.token_covariance(logp, adv, mask)
    valid = [(i, t) for i in range(4) for t in range(5) if mask[i, t]]
    mean_lp = sum(float(logp[i, t]) for i, t in valid) / len(valid)
    mean_a = sum(float(adv[i, t]) for i, t in valid) / len(valid)
    for i in range(4):
        for t in range(5):
            want = (float(logp[i, t]) - mean_lp) * (float(adv[i, t]) - mean_a) if mask[i, t] else 0.0
            assert float(cov[i, t]) == pytest.approx(want, abs=1e-6)
    top = F.top_k_tokens(cov, mask, 3)
    assert sorted(float(c) for c in cov[top]) == sorted(float(cov[i, t]) for i, t in valid)[-3:]
    assert int(F.top_k_tokens(cov, mask, 100).sum()) == len(valid)
    sub = F.random_subset(mask, 4, generator=g)
    assert int(sub.sum()) == 4 and bool(mask[sub].all())
    assert int(F.random_subset(mask, 100).sum()) == len(valid)
