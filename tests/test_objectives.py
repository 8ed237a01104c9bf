"""GAE module, ClipPPOLoss on the token-level actor/critic, and the PPO update."""

import itertools
import math

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.modules import (
    TokenLevelActor,
    compute_old_quantities,
    load_causal_lm,
    make_critic,
)
from rlhf_torchrl.objectives.advantages import ResponseGAE
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.trainers.update import ppo_update


def _rollout(tokenizer, B=8, P=5, R=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    pad = tokenizer.pad_token_id
    prompt = torch.randint(10, 1000, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    response = torch.randint(10, 1000, (B, R), generator=g)
    response_mask = torch.ones(B, R, dtype=torch.bool)
    for i in range(B):  # ragged: left-pad prompts, right-pad responses
        n_pad, n_resp = i % 3, R - (i % 4)
        prompt[i, :n_pad], prompt_mask[i, :n_pad] = pad, False
        response[i, n_resp:], response_mask[i, n_resp:] = pad, False
    return TensorDict({
        K.PROMPT_TOKENS: prompt, K.PROMPT_MASK: prompt_mask,
        K.RESPONSE_TOKENS: response, K.RESPONSE_MASK: response_mask,
        K.HAS_STOP: torch.zeros(B, dtype=torch.bool),
        K.SCORE: torch.randn(B, generator=g),
    }, batch_size=[B])


def _setup(model_dir, tokenizer, critic_init="policy", vf_coef=0.1, clip_value=0.2, dtype="float32",
           **loss_kwargs):
    torch.manual_seed(0)
    policy = load_causal_lm(model_dir, tokenizer, dtype=dtype)
    reference = load_causal_lm(model_dir, tokenizer, dtype=dtype).requires_grad_(False)
    critic = make_critic(policy=policy, tokenizer=tokenizer, init=critic_init,
                         name_or_path=model_dir, dtype=dtype)
    actor = TokenLevelActor(policy, temperature=0.7,
                            trunk_critic=critic if critic.shares_trunk else None)
    ref = TokenLevelActor(reference, temperature=0.7, out_key=K.REF_LOG_PROB)
    loss = make_ppo_loss(actor, critic, clip_epsilon=0.2, clip_value=clip_value, vf_coef=vf_coef,
                         **loss_kwargs)
    return policy, actor, ref, critic, loss


def _prepared(tiny_llama_dir, tokenizer, **kw):
    policy, actor, ref, critic, loss = _setup(tiny_llama_dir, tokenizer, **kw)
    td = _rollout(tokenizer)
    compute_old_quantities(td, actor=actor, reference=ref, critic=critic, chunk_size=3)
    KLRewardShaper(make_kl_controller(0.05))(td)
    ResponseGAE()(td)
    return policy, loss, critic, td


def test_response_gae_module_matches_functional():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    td = TensorDict({K.REWARD: torch.randn(2, 4, 1), K.VALUE: torch.randn(2, 4, 1) * mask.unsqueeze(-1),
                     K.RESPONSE_MASK: mask}, batch_size=[2])
    ResponseGAE(gamma=1.0, lmbda=0.95, whiten_advantages=True)(td)
    adv, ret = F.gae(td[K.REWARD].squeeze(-1), td[K.VALUE].squeeze(-1), mask, 1.0, 0.95)
    torch.testing.assert_close(td[K.VALUE_TARGET].squeeze(-1), ret)
    torch.testing.assert_close(td[K.ADVANTAGE].squeeze(-1), F.masked_whiten(adv, mask))
    valid = td[K.ADVANTAGE].squeeze(-1)[mask]
    assert valid.mean().abs() < 1e-6 and (valid.std() - 1).abs() < 1e-5


@pytest.mark.parametrize("critic_init", ["policy", "shared"])
def test_first_minibatch_is_on_policy(critic_init, instruct_llama_dir, tokenizer):
    """Sampled with recorded log-probs (the default path), from a checkpoint whose generation_config
    carries logits processors: the first minibatch has ratio 1, nothing clipped, approx KL 0."""
    policy, actor, ref, critic, loss = _setup(instruct_llama_dir, tokenizer, critic_init=critic_init)
    env = make_generation_env([f"Prompt {i}" for i in range(8)], tokenizer, batch_size=8, seed=0)
    gen = make_generation_policy(policy, tokenizer, max_new_tokens=6, temperature=0.7,
                                 record_log_probs=True)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=8)
    td = next(iter(collector))
    collector.shutdown()
    td.set(K.SCORE, torch.randn(8))
    compute_old_quantities(td, actor=actor, reference=ref, critic=critic, chunk_size=4)
    KLRewardShaper(make_kl_controller(0.05))(td)
    ResponseGAE()(td)
    opt = torch.optim.SGD(loss.parameters(), lr=0.0)
    stats = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1)
    assert stats["val/ratio"] == pytest.approx(1.0, abs=1e-4)
    assert stats["policy/clipfrac_avg"] == 0.0
    assert stats["policy/approxkl_avg"] < 1e-8


def test_clip_ppo_loss_matches_hand_formula(tiny_llama_dir, tokenizer):
    """Token-mean clipped surrogate and 0.5 * vf_coef * clipped value loss over valid tokens, and
    TRL's diagnostics (where TorchRL's own differ)."""
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, vf_coef=0.3, clip_value=0.1)
    # perturb the stored old quantities so that clipping is active
    g = torch.Generator().manual_seed(1)
    mask = td[K.RESPONSE_MASK]
    td.set(K.LOG_PROB, (td[K.LOG_PROB] + 0.3 * torch.randn(td[K.LOG_PROB].shape, generator=g)) * mask)
    td.set(K.VALUE, td[K.VALUE] + 0.2 * torch.randn(td[K.VALUE].shape, generator=g))
    out = loss(td)
    with torch.no_grad():
        actor = loss.actor_network
        new_lp = actor.get_dist(td.clone()).log_prob(td[K.RESPONSE_TOKENS])
        ratio = torch.exp(new_lp - td[K.LOG_PROB])
        adv = td[K.ADVANTAGE].squeeze(-1)
        pg1, pg2 = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)
        expected_pg = F.masked_mean(torch.max(pg1, pg2), mask)
        v = critic(td.clone())[K.VALUE].squeeze(-1)
        v_old, ret = td[K.VALUE].squeeze(-1), td[K.VALUE_TARGET].squeeze(-1)
        v_clip = v_old + (v - v_old).clamp(-0.1, 0.1)
        vf1, vf2 = (v - ret) ** 2, (v_clip - ret) ** 2
        expected_vf = 0.3 * F.masked_mean(0.5 * torch.max(vf1, vf2), mask)
        # TRL PPOTrainer / open-instruct definitions, over valid tokens
        log_ratio = new_lp - td[K.LOG_PROB]
        approxkl = F.masked_mean(0.5 * log_ratio**2, mask)
        pg_clipfrac = F.masked_mean((pg2 > pg1).float(), mask)
        vf_clipfrac = F.masked_mean((vf2 > vf1).float(), mask)
        outside = F.masked_mean(((ratio < 0.8) | (ratio > 1.2)).float(), mask)
    torch.testing.assert_close(out["loss_objective"], expected_pg, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["loss_critic"], expected_vf, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["approxkl"], approxkl, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["pg_clipfrac"], pg_clipfrac)
    torch.testing.assert_close(out["vf_clipfrac"], vf_clipfrac)
    torch.testing.assert_close(out["ratio"], F.masked_mean(ratio, mask), atol=1e-6, rtol=1e-5)
    # the cases this test exists for: TorchRL's approx KL (mean(old - new)) can be negative, its
    # clip fraction counts every ratio outside the range; TRL's counts where the clip binds
    assert out["approxkl"] > 0 and out["pg_clipfrac"] < outside


def test_update_metrics_are_trl_quantities(tiny_llama_dir, tokenizer):
    """ppo_update's metrics are the per-micro-batch TRL diagnostics, averaged over micro-batches."""
    _, loss, _, td = _prepared(tiny_llama_dir, tokenizer)
    g = torch.Generator().manual_seed(2)
    td.set(K.LOG_PROB, (td[K.LOG_PROB] + 0.3 * torch.randn(td[K.LOG_PROB].shape, generator=g))
           * td[K.RESPONSE_MASK])
    expected = loss(td)  # one minibatch, one micro-batch, before any step
    opt = torch.optim.SGD(loss.parameters(), lr=0.0)
    stats = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1)
    assert stats["policy/approxkl_avg"] == pytest.approx(float(expected["approxkl"]), rel=1e-5)
    assert stats["policy/clipfrac_avg"] == pytest.approx(float(expected["pg_clipfrac"]))
    assert stats["val/clipfrac_avg"] == pytest.approx(float(expected["vf_clipfrac"]))
    assert stats["val/ratio"] == pytest.approx(float(expected["ratio"]), rel=1e-5)
    assert stats["loss/policy_avg"] == pytest.approx(float(expected["loss_objective"]), rel=1e-5)
    assert stats["loss/value_avg"] == pytest.approx(float(expected["loss_critic"]) / 0.1, rel=1e-5)
    assert stats["val/ratio_var"] == 0.0  # one micro-batch


def test_ppo_update_steps_and_reports(tiny_llama_dir, tokenizer):
    policy, loss, _, td = _prepared(tiny_llama_dir, tokenizer, critic_init="shared")
    keys = set(td.keys(True))
    before = [p.detach().clone() for p in policy.parameters()]
    params = [p for p in loss.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    stats = ppo_update(td, loss, opt, num_ppo_epochs=2, num_mini_batches=2,
                       gradient_accumulation_steps=2, max_grad_norm=1.0)
    changed = sum(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert changed > 0
    for key in ("policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
                "val/clipfrac_avg", "val/ratio", "val/ratio_var", "grad_norm"):
        assert torch.isfinite(torch.tensor(stats[key])), key
    assert 0.0 <= stats["policy/clipfrac_avg"] <= 1.0 and stats["policy/approxkl_avg"] >= 0
    assert set(td.keys(True)) == keys  # the shared-trunk actor leaves nothing in the caller's rollout


# micro-batch splits: equal row slices (gradient_accumulation_steps) or token budgets
SPLITS = {"rows=1": {}, "rows=2": {"gradient_accumulation_steps": 2},
          "rows=4": {"gradient_accumulation_steps": 4},
          "rows=3 (uneven)": {"gradient_accumulation_steps": 3}, "tokens=40": {"micro_batch_tokens": 40},
          "tokens=24": {"micro_batch_tokens": 24}, "tokens=1": {"micro_batch_tokens": 1}}


@pytest.mark.parametrize("critic_init", ["policy", "shared"])
def test_micro_batches_keep_the_token_mean(critic_init, tiny_llama_dir, tokenizer):
    """Equal row slices or token-budget micro-batches (each trimmed to its own widths), of different
    valid-token counts, give the gradient and metrics of the whole padded minibatch (fp64)."""
    from rlhf_torchrl.trainers.micro_batches import token_budget_split

    grads, stats = {}, {}
    for name, split in SPLITS.items():
        _, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, critic_init=critic_init,
                                        dtype="float64")
        # strongly ragged: row i keeps 1 + i % 6 response tokens
        mask = torch.arange(6).expand(8, 6) < (1 + torch.arange(8) % 6)[:, None]
        td.set(K.RESPONSE_MASK, mask)
        td = td.apply(lambda x: x.double() if x.is_floating_point() else x)
        critic.head.double()
        params = [p for p in loss.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.0)  # leaves the gradient of the one step in .grad
        stats[name] = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1,
                                 max_grad_norm=None, **split)
        grads[name] = [p.grad.clone() for p in params]
        if "micro_batch_tokens" in split:
            parts = token_budget_split(td[K.PROMPT_MASK], mask, split["micro_batch_tokens"])
            assert sorted(torch.cat(parts).tolist()) == list(range(8))
            assert (len(parts) == 8) == (split["micro_batch_tokens"] == 1)  # 1: one row each
    for name in SPLITS:
        for a, b in zip(grads["rows=1"], grads[name]):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9)
        for key, value in stats["rows=1"].items():
            if key != "val/ratio_var":
                assert stats[name][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)


def test_ppo_update_takes_a_plain_clip_ppo_loss(tiny_llama_dir, tokenizer):
    """Any TorchRL ClipPPOLoss set up for the rollout layout runs (its own diagnostics reported),
    on a batch that does not split into equal minibatches (7 rows, 2 minibatches)."""
    from torchrl.objectives import ClipPPOLoss

    policy, _, critic, td = _prepared(tiny_llama_dir, tokenizer, critic_init="policy")
    td = td[:7]
    actor = TokenLevelActor(policy, temperature=0.7)
    loss = ClipPPOLoss(actor, critic, critic_coeff=0.05, loss_critic_type="l2", functional=False,
                       entropy_bonus=False)
    loss.set_keys(action=K.RESPONSE_TOKENS, sample_log_prob=K.LOG_PROB, value=K.VALUE,
                  advantage=K.ADVANTAGE, value_target=K.VALUE_TARGET)
    loss.loss_mask_key = K.RESPONSE_MASK
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW([p for p in loss.parameters() if p.requires_grad], lr=1e-3)
    stats = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=2)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    for key in ("loss/policy_avg", "loss/value_avg", "policy/clipfrac_avg", "policy/approxkl_avg",
                "val/ratio", "grad_norm"):
        assert math.isfinite(stats[key]), key


def _grpo_batch(tiny_llama_dir, tokenizer, **loss_kwargs):
    """A rollout in groups of 2 with GRPO advantages, a policy and its critic-free loss."""
    from rlhf_torchrl.objectives.advantages import GRPOAdvantage

    torch.manual_seed(0)
    policy = load_causal_lm(tiny_llama_dir, tokenizer)
    reference = load_causal_lm(tiny_llama_dir, tokenizer).requires_grad_(False)
    with torch.no_grad():  # a reference unlike the policy: the KL term is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    actor = TokenLevelActor(policy, temperature=0.7)
    ref = TokenLevelActor(reference, temperature=0.7, out_key=K.REF_LOG_PROB)
    td = _rollout(tokenizer)
    td.set(K.GROUP, torch.arange(8) // 2)
    compute_old_quantities(td, actor=actor, reference=ref, chunk_size=4)
    assert K.VALUE not in td.keys()
    KLRewardShaper(make_kl_controller(0.0))(td)
    GRPOAdvantage()(td)
    return policy, actor, make_ppo_loss(actor, **loss_kwargs), td


def test_critic_free_loss_has_no_value_term(tiny_llama_dir, tokenizer):
    policy, _, loss, td = _grpo_batch(tiny_llama_dir, tokenizer, vf_coef=0.5, clip_value=0.2)
    out = loss(td)
    assert "loss_critic" not in out.keys() and "loss_objective" in out.keys()
    opt = torch.optim.AdamW([p for p in loss.parameters() if p.requires_grad], lr=1e-3)
    before = [p.detach().clone() for p in policy.parameters()]
    stats = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=2)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert "loss/value_avg" not in stats and "val/clipfrac_avg" not in stats
    assert math.isfinite(stats["loss/policy_avg"])


def test_kl_loss_term_matches_hand_formula(tiny_llama_dir, tokenizer):
    """loss_kl = coef * token-mean of k3(pi, pi_ref), and its gradient is that of the formula."""
    policy, actor, loss, td = _grpo_batch(tiny_llama_dir, tokenizer, kl_loss_coef=0.3)
    out = loss(td)
    mask = td.get(K.RESPONSE_MASK)
    params = [p for p in policy.parameters() if p.requires_grad]
    got = torch.autograd.grad(out["loss_kl"], params)
    new = actor.get_dist(td).log_prob(td.get(K.RESPONSE_TOKENS))
    log_r = td.get(K.REF_LOG_PROB) - new
    kl = ((log_r.exp() - 1) - log_r)[mask].mean()
    torch.testing.assert_close(out["loss_kl"], 0.3 * kl.detach())
    torch.testing.assert_close(out["kl_to_ref"], kl.detach())
    assert float(kl) > 1e-4
    for a, b in zip(got, torch.autograd.grad(0.3 * kl, params)):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)
    opt = torch.optim.SGD(params, lr=0.0)
    stats = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1)
    assert stats["policy/kl_to_ref_avg"] == pytest.approx(float(kl), rel=1e-4)


def test_token_budget_split_packs_similar_lengths():
    """Longest rows first, greedily packed under the padded-token budget; halved to a minimum count;
    empty parts only where no part can be halved."""
    from rlhf_torchrl.trainers.micro_batches import token_budget_split, trim_padding

    prompt = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]], dtype=torch.bool)
    response = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    # lengths 4, 7, 2, 5: order 1, 3, 0, 2; budget 12: [1] (7), [3, 0] (2 x 5 = 10), [2] alone
    # would join: 3 x max(2 + 3) = 15 > 12
    parts = [p.tolist() for p in token_budget_split(prompt, response, 12)]
    assert parts == [[1], [3, 0], [2]]
    assert [p.tolist() for p in token_budget_split(prompt, response, 12, min_parts=4)] == \
        [[1], [3], [0], [2]]
    assert [p.tolist() for p in token_budget_split(prompt, response, 100, min_parts=5)] == \
        [[1], [3], [0], [2], []]
    td = TensorDict({K.PROMPT_MASK: prompt[[0, 2]], K.PROMPT_TOKENS: torch.zeros(2, 3),
                     K.RESPONSE_MASK: response[[0, 2]], K.RESPONSE_TOKENS: torch.zeros(2, 4),
                     K.VALUE: torch.zeros(2, 4, 1)}, batch_size=[2])
    trimmed = trim_padding(td)
    assert trimmed[K.PROMPT_MASK].tolist() == [[1, 1], [0, 1]]
    assert trimmed[K.RESPONSE_MASK].shape == (2, 2) and trimmed[K.VALUE].shape == (2, 2, 1)


def test_adaptive_kl_controller_moves_towards_target():
    shaper = KLRewardShaper(make_kl_controller(0.1, target=1.0, horizon=100))
    mask = torch.ones(4, 5, dtype=torch.bool)
    td = TensorDict({K.LOG_PROB: torch.zeros(4, 5), K.REF_LOG_PROB: torch.full((4, 5), -1.0),
                     K.RESPONSE_MASK: mask, K.SCORE: torch.zeros(4)}, batch_size=[4])
    shaper(td)  # KL per sequence = 5 > target 1: the coefficient grows
    torch.testing.assert_close(td[K.KL], torch.ones(4, 5))
    new = shaper.update_kl_coef(td)
    # Ziegler et al.: e = clip(5/1 - 1, -0.2, 0.2) = 0.2; coef *= 1 + 0.2 * 4 / 100
    assert new == pytest.approx(0.1 * (1 + 0.2 * 4 / 100))
    td.set(K.REF_LOG_PROB, torch.full((4, 5), -0.01))
    shaper(td)  # KL per sequence = 0.05 < 1: it shrinks
    assert shaper.update_kl_coef(td) < new


def test_kl_shaper_rewards_and_done(tokenizer):
    td = _rollout(tokenizer)
    td.set(K.LOG_PROB, torch.randn(8, 6) * td[K.RESPONSE_MASK])
    td.set(K.REF_LOG_PROB, torch.randn(8, 6) * td[K.RESPONSE_MASK])
    KLRewardShaper(make_kl_controller(0.2), kl_estimator="k3")(td)
    mask = td[K.RESPONSE_MASK]
    kl = F.kl_estimate(td[K.LOG_PROB], td[K.REF_LOG_PROB], "k3") * mask
    reward, _ = F.per_token_rewards(td[K.SCORE], kl, mask, 0.2)
    torch.testing.assert_close(td[K.REWARD].squeeze(-1), reward)
    done = td[K.DONE].squeeze(-1)
    assert done.sum(-1).tolist() == [1] * 8
    assert (done.float().argmax(-1) == mask.sum(-1) - 1).all()
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        KLRewardShaper(make_kl_controller(0.2), kl_estimator="kl")


# ---- clip-higher, dual clip, loss aggregation ---------------------------------------------------

# tokens of known ratio r and advantage A, and the per-token loss by hand with the ratio clipped to
# [1 - 0.2, 1 + 0.28] and the dual clip c = 3 (tests/test_functional.py works the same six out)
RATIOS = [1.5, 1.25, 0.5, 0.5, 1.5, 4.0]
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -1.0, -2.0]
CLIP_HIGHER_DUAL = [-1.28, -1.25, -0.5, 0.8, 1.5, 6.0]
SYMMETRIC = [-1.2, -1.2, -0.5, 0.8, 1.5, 8.0]  # clip_epsilon=0.2, no dual clip (the default)


def _known_ratios(tiny_llama_dir, tokenizer):
    """A rollout whose old log-probs give the tokens the ratios of RATIOS (cyclically) under the
    current policy, with the advantages of ADVANTAGES; ``idx`` maps each token to its case."""
    policy, _, _, td = _prepared(tiny_llama_dir, tokenizer)
    actor = TokenLevelActor(policy, temperature=0.7)
    with torch.no_grad():
        new = actor.get_dist(td.clone()).log_prob(td[K.RESPONSE_TOKENS])
    idx = torch.arange(new.numel()).reshape(new.shape) % len(RATIOS)
    td.set(K.LOG_PROB, new - torch.tensor(RATIOS).log()[idx])
    td.set(K.ADVANTAGE, torch.tensor(ADVANTAGES)[idx].unsqueeze(-1))
    return actor, td, idx


def test_clip_higher_and_dual_clip_match_hand_values(tiny_llama_dir, tokenizer):
    """loss_objective is the token-mean of the hand-computed per-token losses, for clip-higher with
    a dual clip and for today's symmetric clip; the bound fractions count the right tokens."""
    actor, td, idx = _known_ratios(tiny_llama_dir, tokenizer)
    mask = td[K.RESPONSE_MASK]
    tuned = make_ppo_loss(actor, clip_epsilon=0.2, clip_epsilon_high=0.28, dual_clip=3.0)
    out = tuned(td)
    expected = torch.tensor(CLIP_HIGHER_DUAL)[idx][mask].mean()
    torch.testing.assert_close(out["loss_objective"], expected, atol=1e-5, rtol=1e-5)
    share = [float((idx[mask] == case).float().mean()) for case in range(len(RATIOS))]
    assert float(out["pg_clipfrac_high"]) == pytest.approx(share[0])  # A > 0, r = 1.5 > 1.28
    assert float(out["pg_clipfrac_low"]) == pytest.approx(share[3])  # A < 0, r = 0.5 < 0.8
    assert float(out["pg_clipfrac_dual"]) == pytest.approx(share[5])  # A < 0, r = 4 > 3
    assert float(out["pg_clipfrac"]) == pytest.approx(share[0] + share[3])
    # truncated importance sampling weights each token's surrogate by w = 0.5: the cap scales too
    weighted = td.clone()
    weighted.set(K.BEHAVIOUR_LOG_PROB, td[K.LOG_PROB] - math.log(0.5))
    tis = make_ppo_loss(actor, clip_epsilon=0.2, clip_epsilon_high=0.28, dual_clip=3.0, tis_cap=2.0)
    torch.testing.assert_close(tis(weighted)["loss_objective"], 0.5 * expected, atol=1e-5, rtol=1e-5)
    plain = make_ppo_loss(actor, clip_epsilon=0.2)(td)
    torch.testing.assert_close(plain["loss_objective"], torch.tensor(SYMMETRIC)[idx][mask].mean(),
                               atol=1e-5, rtol=1e-5)
    assert "pg_clipfrac_dual" not in plain.keys()
    assert float(plain["pg_clipfrac_high"]) == pytest.approx(share[0] + share[1])  # 1.25 > 1.2 too
    # per response first: each row's mean of its tokens' losses, then the mean over rows
    seq = make_ppo_loss(actor, clip_epsilon_low=0.2, clip_epsilon_high=0.28, dual_clip=3.0,
                        loss_aggregation="seq_mean_token_mean")(td)
    rows = [torch.tensor(CLIP_HIGHER_DUAL)[i][m].mean() for i, m in zip(idx, mask)]
    torch.testing.assert_close(seq["loss_objective"], torch.stack(rows).mean(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="clip_epsilon_low must be in"):
        make_ppo_loss(actor, clip_epsilon_low=1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        make_ppo_loss(actor, dual_clip=0.9)
    with pytest.raises(ValueError, match="constant"):
        make_ppo_loss(actor, loss_aggregation="seq_mean_token_sum_norm")


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_every_loss_term_follows_the_aggregation(mode, tiny_llama_dir, tokenizer):
    """Policy, value, entropy and KL terms are each the mode's average of their per-token values."""
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, entropy_coef=0.01,
                                         kl_loss_coef=0.3, loss_aggregation=mode,
                                         loss_aggregation_constant=6)
    mask = td[K.RESPONSE_MASK]
    g = torch.Generator().manual_seed(1)
    for key in (K.LOG_PROB, K.REF_LOG_PROB):  # the ratio moves, the reference differs
        td.set(key, td[key] + 0.3 * torch.randn(mask.shape, generator=g))
    out = loss(td)
    with torch.no_grad():
        dist = TokenLevelActor(policy, temperature=0.7).get_dist(td.clone())
        new_lp = dist.log_prob(td[K.RESPONSE_TOKENS])
        ratio, adv = (new_lp - td[K.LOG_PROB]).exp(), td[K.ADVANTAGE].squeeze(-1)
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        v = critic(td.clone())[K.VALUE].squeeze(-1)
        v_old, ret = td[K.VALUE].squeeze(-1), td[K.VALUE_TARGET].squeeze(-1)
        vf = 0.5 * torch.max((v - ret) ** 2, (v_old + (v - v_old).clamp(-0.2, 0.2) - ret) ** 2)
        log_r = td[K.REF_LOG_PROB] - new_lp
        k3 = log_r.exp() - 1 - log_r
        entropy = dist.entropy()
    for key, per_token in (("loss_objective", pg), ("loss_critic", 0.1 * vf),
                           ("loss_entropy", -0.01 * entropy), ("loss_kl", 0.3 * k3)):
        expected = F.aggregate_loss(per_token, mask, mode, 6)
        torch.testing.assert_close(out[key].detach(), expected, atol=1e-6, rtol=1e-5, msg=key)
        if key != "loss_entropy":  # (the tiny model's entropy is the same at every token)
            assert not torch.allclose(expected, F.masked_mean(per_token, mask)), key


#: equal row slices (an uneven split among them) and token-budget micro-batches of a minibatch
SPLITS = {"rows=1": {}, "rows=3 (uneven)": {"gradient_accumulation_steps": 3},
          "tokens=24": {"micro_batch_tokens": 24}}


def _ragged_fp64(tiny_llama_dir, tokenizer, **loss_kwargs):
    """The loss in fp64 and a rollout of 8 rows of 1..6 response tokens."""
    _, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, dtype="float64", **loss_kwargs)
    mask = torch.arange(6).expand(8, 6) < (1 + torch.arange(8) % 6)[:, None]  # 1..6 tokens a row
    td.set(K.RESPONSE_MASK, mask)
    td = td.apply(lambda x: x.double() if x.is_floating_point() else x)
    critic.head.double()
    return loss, td


def _same_over_splits(td, loss, what, keys) -> tuple[dict, dict]:
    """One PPO step over ``td`` split each way of SPLITS: the same gradient and the same ``keys``
    of the update's metrics every way; returns each way's gradients and metrics."""
    params = [p for p in loss.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)  # leaves the gradient of the one step in .grad
    grads, stats = {}, {}
    for name, split in SPLITS.items():
        stats[name] = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1,
                                 max_grad_norm=None, **split)
        grads[name] = [p.grad.clone() for p in params]
    for name in SPLITS:
        for a, b in zip(grads["rows=1"], grads[name]):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9, msg=(what, name))
        for key in keys:
            assert stats[name][key] == pytest.approx(stats["rows=1"][key], rel=1e-9, abs=1e-12), key
    return grads, stats


def test_micro_batches_keep_every_aggregation(tiny_llama_dir, tokenizer):
    """For every aggregation, with clip-higher, the dual clip and a KL term on: equal row slices and
    token-budget micro-batches give the whole minibatch's gradient and losses (fp64; verl #6957
    normalised per micro-batch). (No entropy term: the entropy is computed in fp32 whatever the
    model's dtype, too coarse for this check; its aggregation is checked above.)"""
    loss, td = _ragged_fp64(tiny_llama_dir, tokenizer, kl_loss_coef=0.1, clip_epsilon_high=0.28,
                            dual_clip=1.5)
    g = torch.Generator().manual_seed(3)
    mask = td[K.RESPONSE_MASK]
    td.set(K.LOG_PROB, td[K.LOG_PROB] + 0.5 * torch.randn(mask.shape, generator=g, dtype=torch.float64))
    first = None
    for mode in (*F.LOSS_AGGREGATIONS[1:], "token_mean"):
        loss.loss_aggregation, loss.loss_aggregation_constant = mode, 6
        grads, stats = _same_over_splits(td, loss, mode, (
            "loss/policy_avg", "loss/value_avg", "policy/dual_clipfrac_avg",
            "policy/clipfrac_high_avg", "policy/clipfrac_low_avg"))
        assert stats["rows=1"]["policy/dual_clipfrac_avg"] > 0  # the dual clip acts
        out = loss(td)
        assert stats["rows=1"]["loss/policy_avg"] == pytest.approx(float(out["loss_objective"].detach()), rel=1e-9)
        if first is None:
            first = grads["rows=1"]
        else:  # the modes differ from token_mean's gradient
            assert not all(torch.allclose(a, b) for a, b in zip(first, grads["rows=1"]))


@pytest.mark.parametrize("mode", F.LOSS_AGGREGATIONS)
def test_micro_batch_weights_over_two_processes(mode, tokenizer):
    """Two simulated processes, each its slice of a minibatch of 7 rows (one row has no valid
    token), in micro-batches: the weighted micro-batch losses of both add up to the minibatch's
    (ppo_update scales each by the world size, which DDP's average over processes undoes)."""
    from rlhf_torchrl.trainers.micro_batches import micro_batches

    td = _rollout(tokenizer, B=7)
    mask = torch.arange(6).expand(7, 6) < torch.tensor([[3], [6], [0], [1], [5], [2], [4]])
    td.set(K.RESPONSE_MASK, mask)
    td.set("token_loss", torch.randn(7, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    whole = F.aggregate_loss(td["token_loss"], mask, mode, 6)
    for split in ({}, {"gradient_accumulation_steps": 3}, {"micro_batch_tokens": 20},
                  {"micro_batch_tokens": 20, "max_parts": lambda n: n + 3},  # halved, then empty
                  # rows of near-equal real tokens per process: equal counts, then any counts
                  {"balance": True, "gradient_accumulation_steps": 3},
                  {"balance": True, "micro_batch_tokens": 20}, {"balance": True, "packed": True}):
        total, weights, rows = 0.0, [], []
        for rank in range(2):
            parts = micro_batches(td, rank=rank, world_size=2, loss_aggregation=mode,
                                  loss_aggregation_constant=6, **split)
            for micro_batch, weight in parts:
                total += weight * F.aggregate_loss(micro_batch["token_loss"],
                                                   micro_batch[K.RESPONSE_MASK], mode, 6)
                weights.append(weight)
                rows += micro_batch["token_loss"][:, 0].tolist() if weight else []
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14, msg=str(split))
        assert sorted(rows) == sorted(td["token_loss"][:, 0].tolist())  # each row once
        if "max_parts" in split:
            assert 0.0 in weights  # a process with fewer micro-batches runs an empty one


def test_balance_auto_where_micro_batches_count_tokens():
    """distributed.balance=auto balances the update's rows where its micro-batches count real
    tokens (packed, or under a token budget) or a process's padded rows make several micro-batches
    (gradient accumulation), not for one padded micro-batch a process; true and false everywhere;
    any other value is refused with the choices."""
    from types import SimpleNamespace

    from rlhf_torchrl.distributed import DataParallel
    from rlhf_torchrl.errors import ConfigError
    from rlhf_torchrl.trainers.update import _split_settings

    for packing in (False, True):
        loss = SimpleNamespace(actor_network=SimpleNamespace(packing=packing))
        for budget, steps in itertools.product((None, 64), (1, 2)):
            for balance in (False, True, "auto"):
                split = _split_settings(loss, DataParallel(world_size=2, balance=balance), steps,
                                        budget, None)
                expected = balance is True or (balance == "auto" and (
                    packing or budget is not None or steps > 1))
                assert split["balance"] is expected, (packing, budget, steps, balance)
    with pytest.raises(ConfigError, match="choose one of"):
        DataParallel(balance="sometimes")


def test_balanced_partition_against_brute_force():
    """Karmarkar-Karp's differencing by hand on [8, 7, 6, 5, 4] (16 and 14, where 15 and 15
    exist); on 200 small random cases every row once, a spread of at most the largest cost, equal
    counts (within one) when asked, the heaviest set within 4/3 of the best partition's (found by
    trying every assignment) and equal to it in most cases."""
    import itertools
    import random

    from rlhf_torchrl.trainers.micro_batches import balanced_partition

    # 8 - 7 -> ({8}, {7}); 6 - 5 -> ({6}, {5}); 4 with ({8}, {7}) -> ({4, 7}, {8}), spread 3; with
    # ({6}, {5}): ({4, 7, 5}, {8, 6}) = (16, 14)
    assert balanced_partition([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]
    # runs of 3 sorted: (1, 2, 3), (4, 5, 6), (7): stand-ins fill the last run's empty places
    assert balanced_partition([1, 2, 3, 4, 5, 6, 7], 3, equal_size=True) == [[0, 1, 6], [2, 5], [3, 4]]
    assert balanced_partition([], 2) == [[], []] and balanced_partition([5], 3) == [[0], [], []]
    rng, optimal = random.Random(0), 0
    for _ in range(200):
        n, k, equal_size = rng.randint(1, 8), rng.choice([2, 3]), rng.random() < 0.5
        costs = [rng.randint(1, 50) for _ in range(n)]
        sets = balanced_partition(costs, k, equal_size=equal_size)
        assert len(sets) == k and sorted(i for s in sets for i in s) == list(range(n))
        sums = [sum(costs[i] for i in s) for s in sets]
        assert max(sums) - min(sums) <= max(costs)
        if equal_size:
            assert max(map(len, sets)) - min(map(len, sets)) <= 1
        best = min(max(sum(c for c, j in zip(costs, a) if j == part) for part in range(k))
                   for a in itertools.product(range(k), repeat=n)
                   if not equal_size or max(map(a.count, range(k))) - min(map(a.count, range(k))) <= 1)
        assert max(sums) <= best * 4 / 3
        optimal += max(sums) == best
    assert optimal >= 0.8 * 200, optimal


def test_config_keys_reach_the_loss(tmp_path, tiny_llama_dir):
    """ppo.clip_epsilon_low/high, dual_clip and loss_aggregation go from the config to the loss
    (the Dr. GRPO constant defaults to the generation budget); bad values get one clear line."""
    from rlhf_torchrl.config import checks, components, compose, validation
    from rlhf_torchrl.errors import ConfigError

    base = [f"output_dir={tmp_path}", f"model.policy={tiny_llama_dir}", "generation.max_new_tokens=6",
            "model.autocast=null"]  # fp32: the preset's auto is bf16, with TIS, on some CPUs
    actor = TokenLevelActor(load_causal_lm(tiny_llama_dir), temperature=0.7)
    default = components.make_loss(compose(base), actor, None)
    assert float(default.clip_epsilon) == pytest.approx(0.2) and default.dual_clip is None
    assert default.loss_aggregation == "token_mean"
    cfg = compose([*base, "ppo.clip_epsilon_high=0.28", "ppo.dual_clip=3",
                   "ppo.loss_aggregation=seq_mean_token_sum_norm", "env.max_turns=2"])
    validation.validate(cfg)
    loss = components.make_loss(cfg, actor, None)
    assert (float(loss.clip_epsilon_low), float(loss.clip_epsilon_high)) == pytest.approx((0.2, 0.28))
    assert loss.dual_clip == 3 and loss.loss_aggregation == "seq_mean_token_sum_norm"
    assert loss.loss_aggregation_constant == 12  # max_new_tokens x max_turns
    # the off-policy correction and its bounds, where the run keeps the sampler's log-probs
    sampled_elsewhere = [*base, "ppo.tis_cap=1.5", "generation.log_probs_from_sampling=false"]
    cfg = compose([*sampled_elsewhere, "ppo.off_policy_correction=seq_mask_tis", "ppo.off_policy_low=0.9"])
    checks.check_off_policy_correction(cfg)
    loss = components.make_loss(cfg, actor, None)
    assert (loss.off_policy_correction, loss.off_policy_low, loss.tis_cap) == ("seq_mask_tis", 0.9, 1.5)
    assert components.make_loss(compose(sampled_elsewhere), actor, None).off_policy_correction == "tis"
    # the policy loss and its own settings; one line where they cannot go together
    cfg = compose([*base, "ppo.policy_loss=clip_cov", "++ppo.policy_loss_args={ratio: 0.01, high: 3}"])
    checks.check_config(cfg)
    loss = components.make_loss(cfg, actor, None)
    assert (loss.policy_loss.name, loss.policy_loss.ratio, loss.policy_loss.high) == ("clip_cov", 0.01, 3.0)
    assert components.make_loss(compose(base), actor, None).policy_loss.name == "ppo"
    for bad, message in (("ppo.policy_loss=gspo", "gspo is defined for ppo.loss_aggregation="
                                                   "seq_mean_token_mean .now token_mean.: set it"),
                         ("ppo.policy_loss=sppo", "ppo.policy_loss='sppo' is not a registered policy loss"),
                         ("++ppo.policy_loss_args={eps: 1}", "eps is not a setting of ppo.policy_loss=ppo")):
        with pytest.raises(ConfigError, match=message):
            checks.check_config(compose([*base, bad]))
    with pytest.raises(ConfigError, match=r"ppo.off_policy_correction=icepop weights the loss .* set "
                                          r"its upper bound ppo.tis_cap"):
        checks.check_off_policy_correction(compose([*base, "ppo.off_policy_correction=icepop"]))
    with pytest.raises(ConfigError, match="leaves no room"):
        checks.check_off_policy_correction(compose([*sampled_elsewhere, "ppo.off_policy_low=2"]))
    for bad, message in (("ppo.dual_clip=1", r"ppo.dual_clip=1.0 is out of range: it must be > 1"),
                         ("ppo.clip_epsilon_low=1", r"ppo.clip_epsilon_low=1.0 is out of range: "
                                                    r"it must be in \(0, 1\)"),
                         ("ppo.loss_aggregation=seq_mean", r"ppo.loss_aggregation='seq_mean' is not "
                                                           r"one of the allowed values: token_mean"),
                         ("ppo.off_policy_correction=clip", r"ppo.off_policy_correction='clip' is not "
                                                            r"one of the allowed values: tis, mis")):
        with pytest.raises(ConfigError, match=message):
            validation.validate(compose([*base, bad]))


def test_positive_nll_term_matches_hand_formula(tiny_llama_dir, tokenizer):
    """ppo.positive_nll_coef: coef * the mean -log pi over the tokens of the responses scoring at
    least the threshold (VAPO), with the policy's gradient; its diagnostics; 0 without positives."""
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, positive_nll_coef=0.1,
                                         positive_nll_threshold=0.0)
    mask, positive = td[K.RESPONSE_MASK], td[K.SCORE] >= 0.0
    assert 0 < int(positive.sum()) < len(positive)
    params = [p for p in policy.parameters() if p.requires_grad]
    out = loss(td)
    got = torch.autograd.grad(out["loss_positive_nll"], params)
    new_lp = loss.actor_network.get_dist(td.clone()).log_prob(td[K.RESPONSE_TOKENS])
    expected = 0.1 * F.positive_nll(new_lp, mask, positive)
    want = torch.autograd.grad(expected, params)
    torch.testing.assert_close(out["loss_positive_nll"].detach(), expected.detach(), atol=1e-6, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert float(out["positive_nll"]) == pytest.approx(float(expected) / 0.1, rel=1e-5)
    share = F.masked_mean(positive[:, None].expand_as(mask).float(), mask)
    assert float(out["positive_token_frac"]) == pytest.approx(float(share))
    td.set(K.SCORE, torch.full_like(td[K.SCORE], -5.0))
    assert float(loss(td)["loss_positive_nll"]) == 0.0
    assert "loss_positive_nll" not in make_ppo_loss(loss.actor_network, critic)(td).keys()


def test_positive_nll_is_normalised_once_per_minibatch(tiny_llama_dir, tokenizer):
    """For every aggregation, micro-batches of rows and of token budgets give the whole minibatch's
    gradient and positive-NLL (fp64): the term is normalised by the positive tokens of the whole
    minibatch, not of each micro-batch (NeMo-RL's per-micro-batch normalisation grew it with the
    number of micro-batches)."""
    _, loss, critic, td = _prepared(tiny_llama_dir, tokenizer, dtype="float64", positive_nll_coef=0.5,
                                    positive_nll_threshold=0.0)
    mask = torch.arange(6).expand(8, 6) < (1 + torch.arange(8) % 6)[:, None]  # 1..6 tokens a row
    td.set(K.RESPONSE_MASK, mask)
    td = td.apply(lambda x: x.double() if x.is_floating_point() else x)
    critic.head.double()
    positive = td[K.SCORE] >= 0.0
    with torch.no_grad():
        new_lp = loss.actor_network.get_dist(td.clone()).log_prob(td[K.RESPONSE_TOKENS])
    whole = float(F.positive_nll(new_lp, mask, positive))
    params = [p for p in loss.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)  # leaves the gradient of the one step in .grad
    splits = {"rows=1": {}, "rows=4": {"gradient_accumulation_steps": 4},
              "rows=3 (uneven)": {"gradient_accumulation_steps": 3}, "tokens=16": {"micro_batch_tokens": 16}}
    for mode in F.LOSS_AGGREGATIONS:
        loss.loss_aggregation, loss.loss_aggregation_constant = mode, 6
        grads = {}
        for name, split in splits.items():
            stats = ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1, max_grad_norm=None,
                               **split)
            grads[name] = [p.grad.clone() for p in params]
            assert stats["loss/positive_nll_avg"] == pytest.approx(whole, rel=1e-9), (mode, name)
            assert stats["policy/positive_token_frac"] == pytest.approx(
                float(F.masked_mean(positive[:, None].expand_as(mask).double(), mask)), rel=1e-9)
        for name in splits:
            for a, b in zip(grads["rows=1"], grads[name]):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9, msg=(mode, name))
    # what per-micro-batch normalisation would have given: another number
    rows = torch.arange(8).tensor_split(4)
    per_part = [float(F.positive_nll(new_lp[r], mask[r], positive[r])) for r in rows]
    assert sum(per_part) / len(per_part) != pytest.approx(whole, rel=1e-3)


# ---- the off-policy corrections in the loss -----------------------------------------------------

# pi_old / pi_sampler of the tokens, cyclically (5 cases against RATIOS' 6: every pairing occurs)
IS_CASES = [3.0, 1.5, 0.25, 1.0, 0.6]


def _sampled_elsewhere(td):
    """The sampler's log-probs of ``td``'s tokens, so that pi_old / pi_sampler cycles IS_CASES."""
    mask = td[K.RESPONSE_MASK]
    rho = torch.tensor(IS_CASES, dtype=td[K.LOG_PROB].dtype)[
        torch.arange(mask.numel()).reshape(mask.shape) % len(IS_CASES)]
    td.set(K.BEHAVIOUR_LOG_PROB, td[K.LOG_PROB] - rho.log())
    return rho


@pytest.mark.parametrize("mode,cap,low", [("tis", 2.0, None), ("tis", 2.0, 0.5), ("mis", 2.0, None),
                                          ("icepop", 2.0, None), ("seq_mask_tis", 1.2, 0.8)])
def test_off_policy_correction_weights_each_tokens_surrogate(mode, cap, low, tiny_llama_dir, tokenizer):
    """loss_objective is the token-mean of w_t times the hand-computed per-token loss (SYMMETRIC),
    w_t the correction's weight by hand; the share it drops is logged (tis: the share at its cap)."""
    actor, td, idx = _known_ratios(tiny_llama_dir, tokenizer)
    mask = td[K.RESPONSE_MASK]
    rho = _sampled_elsewhere(td)
    lower = low if low is not None else (1 / cap if mode in ("icepop", "seq_mask_tis") else 0.0)
    g = F.masked_mean(rho.log(), mask, dim=-1).exp()[:, None]  # each response's geometric mean
    w = {"tis": rho.clamp(lower, cap), "mis": rho * ((rho <= cap) & (rho >= lower)),
         "icepop": rho * ((rho <= cap) & (rho >= lower)),
         "seq_mask_tis": rho * ((g <= cap) & (g >= lower))}[mode]
    loss = make_ppo_loss(actor, clip_epsilon=0.2, tis_cap=cap, off_policy_correction=mode,
                         off_policy_low=low)
    out = loss(td)
    expected = (w * torch.tensor(SYMMETRIC)[idx])[mask].mean()
    torch.testing.assert_close(out["loss_objective"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["tis_weight"], F.masked_mean(w, mask), atol=1e-6, rtol=1e-5)
    if mode == "tis":
        assert "is_masked" not in out.keys()
        assert float(out["tis_capped"]) == pytest.approx(float(F.masked_mean((rho >= cap).float(), mask)))
    else:
        dropped = float(F.masked_mean((w == 0).float(), mask))
        assert 0 < dropped < 1 and float(out["is_masked"]) == pytest.approx(dropped)


def test_off_policy_corrections_stay_exact_over_micro_batches(tiny_llama_dir, tokenizer):
    """A masking correction is a weight on each token's surrogate, computed per token or per row:
    for each aggregation, equal row slices and token-budget micro-batches give the whole
    minibatch's gradient, loss and masked share (fp64)."""
    loss, td = _ragged_fp64(tiny_llama_dir, tokenizer, tis_cap=1.6)
    _sampled_elsewhere(td)
    for correction, mode in (("icepop", "token_mean"), ("seq_mask_tis", "seq_mean_token_mean"),
                             ("mis", "seq_mean_token_sum")):
        loss.off_policy_correction, loss.loss_aggregation = correction, mode
        _, stats = _same_over_splits(td, loss, correction, (
            "loss/policy_avg", "policy/is_masked_frac", "policy/tis_weight_avg"))
        assert 0 < stats["rows=1"]["policy/is_masked_frac"] < 1, correction
        out = loss(td)
        assert stats["rows=1"]["loss/policy_avg"] == pytest.approx(
            float(out["loss_objective"].detach()), rel=1e-9)


@pytest.mark.parametrize("cap", [1.32, 1.57, 1.99, 2.15, 2.0])
def test_tis_capped_counts_every_token_past_the_cap(cap, tiny_llama_dir, tokenizer):
    """Every token's pi_old / pi_sampler is 3 > cap: the share at the cap is 1, for caps whose
    exp(log C) rounds below C in fp32 (it read 0 for 1.32, 1.57, 1.99 and 2.15)."""
    actor, td, _ = _known_ratios(tiny_llama_dir, tokenizer)
    td.set(K.BEHAVIOUR_LOG_PROB, td[K.LOG_PROB] - math.log(3.0))
    out = make_ppo_loss(actor, clip_epsilon=0.2, tis_cap=cap)(td)
    assert float(out["tis_capped"]) == 1.0
    assert float(out["tis_weight"]) == pytest.approx(cap, rel=1e-6)
    td.set(K.BEHAVIOUR_LOG_PROB, td[K.LOG_PROB] - math.log(cap / 1.01))  # each just below
    assert float(make_ppo_loss(actor, clip_epsilon=0.2, tis_cap=cap)(td)["tis_capped"]) == 0.0


def test_a_loss_with_tis_cap_requires_the_samplers_log_probs(tiny_llama_dir, tokenizer):
    """A loss built with tis_cap never runs uncorrected: a rollout without ("log_probs",
    "behaviour") is refused by the loss and by ppo_update before any work, naming the key."""
    from rlhf_torchrl.errors import ConfigError

    actor, td, _ = _known_ratios(tiny_llama_dir, tokenizer)
    loss = make_ppo_loss(actor, clip_epsilon=0.2, tis_cap=2.0)
    match = r"reads \('log_probs', 'behaviour'\), which this rollout does not have: .*tis_cap"
    with pytest.raises(ConfigError, match=match):
        loss(td)
    opt = torch.optim.SGD([p for p in loss.parameters() if p.requires_grad], lr=0.0)
    with pytest.raises(ConfigError, match=match):
        ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=1)
    assert "tis_weight" not in make_ppo_loss(actor, clip_epsilon=0.2)(td).keys()  # no cap: none


def test_kl_loss_term_is_clamped_per_token(tiny_llama_dir, tokenizer):
    """Tokens whose reference log-prob is far below or above the policy's add k3's bound, 10,
    and no gradient; the others their k3 (verl's low_var_kl clamp)."""
    policy, actor, loss, td = _grpo_batch(tiny_llama_dir, tokenizer, kl_loss_coef=0.5)
    mask = td.get(K.RESPONSE_MASK)
    far = torch.zeros_like(mask)
    far[:, 0], far[:, 1] = True, True  # (B, R): the first two tokens of every row
    with torch.no_grad():
        new = actor.get_dist(td).log_prob(td.get(K.RESPONSE_TOKENS))
    shift = torch.zeros_like(new)
    shift[:, 0], shift[:, 1] = -15.0, 5.0  # log r = -15 (k3 ~ 14) and +5 (k3 ~ 142)
    td.set(K.REF_LOG_PROB, td.get(K.REF_LOG_PROB) + shift)
    out = loss(td)
    log_r = td.get(K.REF_LOG_PROB) - new
    k3 = (log_r.exp() - 1) - log_r
    assert bool((k3[far & mask] > 10).all())
    expected = torch.where(far, torch.full_like(k3, 10.0), k3)[mask].mean()
    torch.testing.assert_close(out["kl_to_ref"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss_kl"], 0.5 * expected, atol=1e-5, rtol=1e-5)
    # the gradient: the unclamped tokens' alone
    params = [p for p in policy.parameters() if p.requires_grad]
    got = torch.autograd.grad(out["loss_kl"], params)
    new = actor.get_dist(td).log_prob(td.get(K.RESPONSE_TOKENS))
    log_r = td.get(K.REF_LOG_PROB) - new
    plain = torch.where(far, torch.zeros_like(log_r), (log_r.exp() - 1) - log_r)
    want = torch.autograd.grad(0.5 * plain[mask].sum() / mask.sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)


def test_an_incompatible_torchrl_is_refused_in_one_line():
    """TokenPPOLoss overrides ClipPPOLoss._log_weight, a private method: the installed torchrl
    (0.14.1: 4 values) passes; one whose _log_weight gives 3 values (TorchRL's main branch) is
    refused in one line naming both versions; pyproject.toml pins the tested release."""
    import re
    from pathlib import Path

    import torchrl
    from torchrl.objectives import ClipPPOLoss

    from rlhf_torchrl.errors import MissingDependencyError
    from rlhf_torchrl.objectives import ppo as objectives

    objectives.check_torchrl_contract(ClipPPOLoss)
    assert torchrl.__version__ == objectives.TESTED_TORCHRL

    class ThreeValues(ClipPPOLoss):  # the shape of TorchRL's main branch
        def _log_weight(self, tensordict, adv_shape):
            return tensordict, None, adv_shape

        def forward(self, tensordict):
            log_weight, dist, kl_approx = self._log_weight(tensordict, None)
            return log_weight

    with pytest.raises(MissingDependencyError) as info:
        objectives.check_torchrl_contract(ThreeValues)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "rlhf_torchrl needs torchrl 0.14.1 (pip install 'torchrl==0.14.1')")
    assert f"gives 4 values there and 3 in the installed torchrl {torchrl.__version__}" in message
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^\s*"torchrl==0\.14\.1",', pyproject, re.M), "pin the tested torchrl"
