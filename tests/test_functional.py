"""The functional API against plain loops and hand-computed values."""

import math

import pytest
import torch

from rlhf_torchrl import functional as F


def test_masked_mean_and_var_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert F.masked_mean(x, m).item() == pytest.approx(2.5)  # (1+2+3+4)/4
    assert F.masked_mean(x, m, dim=1).tolist() == pytest.approx([2.0, 4.0])
    # values 1,2,3,4: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5
    assert F.masked_var(x, m).item() == pytest.approx(5 / 3)
    assert F.masked_var(x, m, unbiased=False).item() == pytest.approx(5 / 4)
    assert F.masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    w = F.masked_whiten(x, m)
    valid = w[m]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.var().item() == pytest.approx(1.0, abs=1e-5)
    assert (w[~m] == 0).all()
    expected = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / math.sqrt(5 / 3)
    torch.testing.assert_close(valid, expected)
    keep_mean = F.masked_whiten(x, m, shift_mean=False)[m]
    torch.testing.assert_close(keep_mean, expected + 2.5)


def test_kl_estimators_hand_computed():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    log_r = ref - lp  # [-0.5, 1.0]
    torch.testing.assert_close(F.kl_estimate(lp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(F.kl_estimate(lp, ref, "k2"), torch.tensor([0.125, 0.5]))
    k3 = torch.tensor([math.exp(v) - 1 - v for v in log_r.tolist()])
    torch.testing.assert_close(F.kl_estimate(lp, ref, "k3"), k3)
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        F.kl_estimate(lp, ref, "k4")


def test_kl_estimators_are_unbiased_on_samples():
    # k1 and k3 are unbiased estimators of KL(p || q) for samples from p.
    torch.manual_seed(0)
    p = torch.distributions.Categorical(logits=torch.tensor([0.0, 1.0, 2.0]))
    q = torch.distributions.Categorical(logits=torch.tensor([1.0, 0.5, 0.0]))
    exact = torch.distributions.kl_divergence(p, q)
    y = p.sample((200_000,))
    for est in ("k1", "k3"):
        assert F.kl_estimate(p.log_prob(y), q.log_prob(y), est).mean().item() == pytest.approx(
            exact.item(), rel=0.03
        )


def test_clamped_k3_is_k3_bounded_per_token_as_verl():
    """Below the bound, k3 as a plain formula; past it (k3 > 10 at log r > 2.61 or < -11.0),
    10 and no gradient; a huge log-ratio stays finite (verl clamps log r to [-20, 20] first)."""
    lp = torch.tensor([-1.0, -2.0, -0.1, -5.0, 0.0, -200.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.1, -2.0, -12.0, 0.0])
    log_r = (ref - lp).tolist()  # [-0.5, 1.0, 0.0, 3.0, -12.0, 200.0]
    plain = [math.exp(v) - 1 - v for v in log_r]  # [0.107, 0.718, 0, 16.1, 11.0, inf]
    k = F.clamped_k3(lp, ref)
    torch.testing.assert_close(k, torch.tensor([*plain[:3], 10.0, 10.0, 10.0]))
    assert F.K3_LOSS_BOUND == 10.0
    (grad,) = torch.autograd.grad(k.sum(), lp)
    # d k3 / d log pi = 1 - r inside the bound, 0 past it
    expected = [1 - math.exp(v) for v in log_r[:3]] + [0.0, 0.0, 0.0]
    torch.testing.assert_close(grad, torch.tensor(expected))
    torch.testing.assert_close(F.clamped_k3(lp, ref, bound=20.0)[3], torch.tensor(plain[3]))


def test_k3_in_the_loss_descends_the_reverse_kl():
    """The gradient of k3 as a loss term, averaged exactly over y ~ pi (a 6-token vocabulary,
    every token weighted by pi(y), pi held fixed in the weights as the sampled tokens are), is the
    gradient of KL(pi_ref || pi), not of KL(pi || pi_ref) (the label it had); its value is
    KL(pi || pi_ref)."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(6, dtype=torch.float64).log_softmax(-1)
    log_pi = theta.log_softmax(-1)
    pi = log_pi.exp().detach()
    value = (pi * F.clamped_k3(log_pi, ref)).sum()
    (k3_grad,) = torch.autograd.grad(value, theta, retain_graph=True)
    p, q = log_pi.exp(), ref.exp()
    reverse = (q * (ref - log_pi)).sum()  # KL(pi_ref || pi)
    forward = (p * (log_pi - ref)).sum()  # KL(pi || pi_ref)
    (reverse_grad,) = torch.autograd.grad(reverse, theta, retain_graph=True)
    (forward_grad,) = torch.autograd.grad(forward, theta, retain_graph=True)
    torch.testing.assert_close(k3_grad, reverse_grad)
    assert (k3_grad - forward_grad).abs().max() > 0.05  # a different direction
    torch.testing.assert_close(value, forward.detach())  # k3's value: KL(pi || pi_ref)


def test_per_token_rewards_against_loop():
    torch.manual_seed(0)
    B, R = 4, 6
    kl = torch.randn(B, R)
    lengths = [6, 3, 1, 0]
    mask = torch.zeros(B, R, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    score = torch.randn(B)
    reward, non_score = F.per_token_rewards(score, kl, mask, kl_coef=0.2)
    for i, n in enumerate(lengths):
        expected = torch.zeros(R)
        for t in range(n):
            expected[t] = -0.2 * kl[i, t]
        if n > 0:
            expected[n - 1] += score[i]
        torch.testing.assert_close(reward[i], expected)
        torch.testing.assert_close(non_score[i][:n], -0.2 * kl[i, :n])


def test_truncate_after_stop():
    tokens = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9], [5, 6, 3, 9]])
    out, mask, has_stop = F.truncate_after_stop(tokens, [2, 3], pad_token_id=0)
    assert out.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0], [5, 6, 3, 0]]
    assert mask.tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, False, False, False],
        [True, True, True, False],
    ]
    assert has_stop.tolist() == [True, False, True, True]


def test_position_ids_left_padding():
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert F.position_ids_from_mask(m).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_match_log_softmax(temperature):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (3, 5))
    full = torch.log_softmax(logits.float() / temperature, -1)
    expected = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    got = F.log_probs_from_logits(logits, tokens, temperature)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)
    ent = torch.distributions.Categorical(logits=logits.float() / temperature).entropy()
    torch.testing.assert_close(F.entropy_from_logits(logits.float() / temperature), ent)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_log_prob_gradient_matches_autograd(dtype):
    """The hand-written backward = autograd through log_softmax + gather (gradcheck in fp64)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 13, (2, 4))
    weights = torch.randn(2, 4, dtype=torch.float64)  # an arbitrary upstream gradient
    if dtype == torch.float64:
        logits = torch.randn(2, 4, 13, dtype=dtype, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x: F.log_probs_from_logits(x, tokens, 0.7), logits)
    logits = (torch.randn(2, 4, 13) * 3).to(dtype).requires_grad_()
    (F.log_probs_from_logits(logits, tokens, 0.7) * weights).sum().backward()
    reference = logits.detach().float().requires_grad_()
    expected = torch.log_softmax(reference / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), reference.grad.to(dtype).float())


def _gae_loop(rewards, values, mask, gamma, lmbda):
    """The recursive definition, one row at a time, over the valid tokens only."""
    B, R = rewards.shape
    adv = torch.zeros(B, R)
    for i in range(B):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[i, t + 1] if t + 1 < n else 0.0
            delta = rewards[i, t] + gamma * next_v - values[i, t]
            last = delta + gamma * lmbda * last
            adv[i, t] = last
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lmbda", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (1.0, 0.0)])
def test_gae_against_recursive_definition(gamma, lmbda):
    torch.manual_seed(1)
    B, R = 5, 7
    lengths = [7, 4, 1, 0, 5]
    mask = torch.zeros(B, R, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    # garbage in the padded positions must not leak into valid ones
    rewards = torch.randn(B, R)
    values = torch.randn(B, R)
    adv, ret = F.gae(rewards, values, mask, gamma, lmbda)
    exp_adv, exp_ret = _gae_loop(rewards, values * mask, mask, gamma, lmbda)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)


def test_log_probs_are_exact_fp32_from_bf16_logits():
    """bf16 logits (autocast, bf16 weights): the log-probs and their gradient are those of the same
    logits upcast to fp32, not of a bf16 softmax."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 1000, generator=g) * 4).bfloat16().requires_grad_()
    tokens = torch.randint(0, 1000, (3, 5), generator=g)
    got = F.log_probs_from_logits(logits, tokens, 0.7)
    assert got.dtype == torch.float32
    upcast = logits.detach().float().requires_grad_()
    want = torch.log_softmax(upcast / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    weights = torch.randn(3, 5, generator=g)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), upcast.grad.bfloat16().float(), atol=1e-6, rtol=0)


def test_gae_and_returns_to_go_skip_the_holes_of_a_multi_turn_mask():
    """Observation tokens between two turns are not steps: GAE and returns-to-go over a mask with
    holes equal those over the same valid tokens packed together, and are 0 in the holes."""
    from rlhf_torchrl.functional import gae, packing_order, returns_to_go, unpack

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]]).bool()
    rewards, values = torch.randn(3, 7), torch.randn(3, 7)
    order = packing_order(mask)
    packed = mask.gather(1, order)
    assert packed.tolist() == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]]
    adv, ret = gae(rewards, values, mask, gamma=0.9, lmbda=0.8)
    adv_p, ret_p = gae(rewards.gather(1, order), values.gather(1, order), packed, 0.9, 0.8)
    torch.testing.assert_close(adv, unpack(adv_p, order))
    torch.testing.assert_close(ret, unpack(ret_p, order))
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # by hand, row 1: valid tokens at 0, 2, 4 (gamma 0.9): G_0 = r0 + 0.9 r2 + 0.81 r4
    g = returns_to_go(rewards, mask, gamma=0.9)
    r = rewards[1]
    torch.testing.assert_close(g[1, 0], r[0] + 0.9 * r[2] + 0.81 * r[4])
    torch.testing.assert_close(g[1, 2], r[2] + 0.9 * r[4])
    assert (g[~mask] == 0).all()
    # a right-padded mask is left as it is
    assert torch.equal(packing_order(mask[2:]), torch.arange(7).expand(1, 7))


# ---- PPO policy-loss variants and loss aggregation ----------------------------------------------

def test_aggregate_loss_hand_computed():
    """Two responses of 3 and 1 valid tokens (9s are padding; a NaN there must not leak)."""
    loss = torch.tensor([[1.0, 2.0, 6.0, float("nan")], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert F.aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(13 / 4)
    # per response: means 3 and 4, sums 9 and 4
    assert F.aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx((3 + 4) / 2)
    assert F.aggregate_loss(loss, mask, "seq_mean_token_sum").item() == pytest.approx((9 + 4) / 2)
    # Dr. GRPO: the sums over a constant (the generation budget, 10), then the mean over responses
    assert F.aggregate_loss(loss, mask, "seq_mean_token_sum_norm", 10).item() == \
        pytest.approx((9 / 10 + 4 / 10) / 2)
    # a response with no valid token counts in none of the means; an empty batch gives 0
    padded, padded_mask = torch.cat([loss, torch.ones(1, 4)]), torch.cat([mask, torch.zeros(1, 4)])
    for mode in F.LOSS_AGGREGATIONS:
        assert F.aggregate_loss(padded, padded_mask, mode, 10) == F.aggregate_loss(loss, mask, mode, 10)
        assert F.aggregate_loss(loss, torch.zeros_like(mask), mode, 10).item() == 0.0
    assert F.aggregation_size(padded_mask, "token_mean").item() == 4
    assert F.aggregation_size(padded_mask, "seq_mean_token_sum").item() == 2
    assert F.aggregation_size(padded_mask, "seq_mean_token_sum_norm", 10).item() == 20
    with pytest.raises(ValueError, match="token_mean.*seq_mean_token_mean"):
        F.aggregate_loss(loss, mask, "seq-mean")
    with pytest.raises(ValueError, match="constant"):
        F.aggregate_loss(loss, mask, "seq_mean_token_sum_norm")


def _aggregate_loop(loss, mask, mode, constant=None):
    rows = [[float(v) for v, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    rows = [r for r in rows if r]
    if mode == "token_mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    per_row = {"seq_mean_token_mean": lambda r: sum(r) / len(r), "seq_mean_token_sum": sum,
               "seq_mean_token_sum_norm": lambda r: sum(r) / constant}[mode]
    return sum(per_row(r) for r in rows) / len(rows)


@pytest.mark.parametrize("mode", F.LOSS_AGGREGATIONS)
def test_aggregate_loss_against_loop_and_exact_over_any_split(mode):
    """Against a plain loop; and parts weighted by their share of the whole batch's aggregation size
    add up to the whole batch's loss, for uneven splits (what ppo_update relies on)."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 5, dtype=torch.float64, generator=g)
    mask = torch.arange(5).expand(7, 5) < torch.tensor([[3], [5], [1], [0], [2], [5], [4]])
    whole = F.aggregate_loss(loss, mask, mode, 6)
    assert whole.item() == pytest.approx(_aggregate_loop(loss, mask, mode, 6), rel=1e-12)
    size = F.aggregation_size(mask, mode, 6)
    for parts in ([[0, 1, 2, 3, 4, 5, 6]], [[0, 1], [2, 3, 4, 5, 6]], [[6], [3], [0, 2, 4], [1, 5]]):
        total = sum(F.aggregation_size(mask[p], mode, 6) / size * F.aggregate_loss(loss[p], mask[p], mode, 6)
                    for p in parts)
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)


def test_clip_higher_and_dual_clip_hand_computed():
    """Six tokens of known ratio r and advantage A, clipped to [1 - 0.2, 1 + 0.28], dual clip c = 3."""
    ratio = torch.tensor([1.5, 1.25, 0.5, 0.5, 1.5, 4.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0])
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    # A > 0: r = 1.5 stops at 1.28; r = 1.25 is inside clip-higher's range (a symmetric 0.2 would
    # stop it at 1.2); r = 0.5 keeps -0.5 (the min of the surrogate). A < 0: r = 0.5 stops at 0.8
    # (loss 0.8); r = 1.5 keeps 1.5; r = 4 gives 2 * 4 = 8, which the dual clip caps at 2 * 3 = 6
    torch.testing.assert_close(clipped, torch.tensor([-1.28, -1.25, -0.5, 0.8, 1.5, 8.0]))
    torch.testing.assert_close(F.dual_clip(clipped, adv, 3.0),
                               torch.tensor([-1.28, -1.25, -0.5, 0.8, 1.5, 6.0]))
    # with an importance weight w on the surrogate the cap is w * -A * c
    w = torch.full((6,), 0.5)
    torch.testing.assert_close(F.dual_clip(w * clipped, adv, 3.0, w),
                               torch.tensor([-0.64, -0.625, -0.25, 0.4, 0.75, 3.0]))
    high, low, dual = F.clip_binds(ratio, adv, 0.2, 0.28, dual_clip=3.0)
    assert high.tolist() == [True, False, False, False, False, False]
    assert low.tolist() == [False, False, False, True, False, False]
    assert dual.tolist() == [False, False, False, False, False, True]
    # the two bounds add up to where the clip binds (TRL's pg_clipfrac)
    binds = -adv * ratio.clamp(0.8, 1.28) > -adv * ratio
    assert (binds == (high | low)).all()
    with pytest.raises(ValueError, match="> 1"):
        F.dual_clip(clipped, adv, 1.0)


# ---- separate lambdas, the critic's fit, the positive-example NLL -------------------------------

def test_gae_with_a_lambda_per_row_against_recursive_definition():
    """VAPO's length-adaptive lambda is one per response: each row of the vectorised GAE equals
    the recursive definition at that row's own lambda (garbage in pads, a row of 0 tokens), also
    where the mask has holes."""
    torch.manual_seed(2)
    B, R = 5, 7
    mask = torch.arange(R).expand(B, R) < torch.tensor([[7], [4], [1], [0], [5]])
    rewards, values = torch.randn(B, R), torch.randn(B, R)
    lmbda = torch.tensor([0.0, 0.5, 0.9, 1.0, 0.3])
    adv, ret = F.gae(rewards, values, mask, 0.9, lmbda)
    for i in range(B):
        exp_adv, exp_ret = _gae_loop(rewards[i:i + 1], (values * mask)[i:i + 1], mask[i:i + 1], 0.9,
                                     float(lmbda[i]))
        torch.testing.assert_close(adv[i:i + 1], exp_adv)
        torch.testing.assert_close(ret[i:i + 1], exp_ret)
    holes = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0]]).bool()
    two = torch.tensor([0.2, 0.7])
    adv, _ = F.gae(rewards[:2], values[:2], holes, 1.0, two)
    for i in range(2):
        alone, _ = F.gae(rewards[i:i + 1], values[i:i + 1], holes[i:i + 1], 1.0, float(two[i]))
        torch.testing.assert_close(adv[i:i + 1], alone)


def test_length_adaptive_lambda_hand_computed():
    """1 - 1 / (alpha * length), clamped to [0, 1]: alpha 0.05 (VAPO) gives 0 up to 20 tokens."""
    lengths = torch.tensor([0, 10, 20, 25, 40, 100, 1000])
    mask = torch.arange(1000).expand(7, 1000) < lengths[:, None]
    lmbda = F.length_adaptive_lmbda(mask, 0.05)
    torch.testing.assert_close(lmbda, torch.tensor([0.0, 0.0, 0.0, 0.2, 0.5, 0.8, 0.98]))
    assert F.length_adaptive_lmbda(mask, 1.0)[1] == pytest.approx(0.9)  # 1 - 1/10
    with pytest.raises(ValueError, match="lmbda_length_alpha must be > 0"):
        F.length_adaptive_lmbda(mask, 0.0)


def test_explained_variance_hand_computed():
    """1 - Var(R - V) / Var(R) over valid tokens (pads hold garbage): a perfect critic 1, the mean
    0, worse below; constant targets 0."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, -9.0]])  # mean 2.5, Var 1.25
    assert float(F.explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(F.explained_variance(torch.full((2, 3), 2.5), returns, mask)) == pytest.approx(0.0)
    off = torch.tensor([[2.0, 1.0, 0.0], [4.0, 3.0, 0.0]])  # R - V = -1, 1, -1, 1: Var 1
    assert float(F.explained_variance(off, returns, mask)) == pytest.approx(1 - 1 / 1.25)
    assert float(F.explained_variance(returns, torch.ones(2, 3), mask)) == 0.0


def test_positive_nll_hand_computed_and_exact_over_any_split():
    """VAPO's positive-example NLL: the mean -log p over the tokens of the responses at or above
    the threshold (here rows 0 and 2: 3 + 1 tokens); with positive_nll_weights, parts of the
    batch, each normalised by its own aggregation size and weighted by its share of the batch's
    (as ppo_update weights every loss term), add up to it for every aggregation mode."""
    log_prob = torch.tensor([[-1.0, -2.0, -3.0, 9.0], [-5.0, -5.0, 9.0, 9.0],
                             [-4.0, 9.0, 9.0, 9.0], [-7.0, -7.0, -7.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    positive = torch.tensor([1.0, 0.5, 2.0, -1.0]) >= 1.0
    whole = F.positive_nll(log_prob, mask, positive)
    assert float(whole) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert float(F.positive_nll(log_prob, mask, torch.zeros(4, dtype=torch.bool))) == 0.0
    for mode in F.LOSS_AGGREGATIONS:
        weights = F.positive_nll_weights(positive, mask, mode, 6)
        size = F.aggregation_size(mask, mode, 6)
        for parts in ([[0, 1, 2, 3]], [[0], [1, 2, 3]], [[3, 1], [2], [0]]):
            total = 0.0
            for p in parts:
                m = mask[p]
                part = torch.where(m, -log_prob[p] * weights[p, None], 0.0).sum() \
                    / F.aggregation_size(m, mode, 6)
                total += F.aggregation_size(m, mode, 6) / size * part
            torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14, msg=f"{mode} {parts}")


# ---- the corrections for tokens another policy sampled ------------------------------------------

# three responses' ratios pi_old / pi_sampler (row 0: 3 tokens, row 1: 4, row 2: 2; pads hold
# garbage), and each correction's weights by hand with cap C = 2 (icepop's low: 1 / C = 0.5)
IS_RATIOS = [[3.0, 1.5, 0.25, 1e30], [2.0, 0.5, 1.0, 1.0], [4.0, 4.0, 1e-30, 1e-30]]
IS_MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
IS_WEIGHTS = {
    "tis": [[2.0, 1.5, 0.25], [2.0, 0.5, 1.0, 1.0], [2.0, 2.0]],     # min(r, 2)
    "mis": [[0.0, 1.5, 0.25], [2.0, 0.5, 1.0, 1.0], [0.0, 0.0]],     # r [r <= 2]: r = 3, 4 drop out
    "icepop": [[0.0, 1.5, 0.0], [2.0, 0.5, 1.0, 1.0], [0.0, 0.0]],  # r [0.5 <= r <= 2]: 0.25 too
    # geometric means: row 0 (3 * 1.5 * 0.25)^(1/3) = 1.04, row 1 (2 * 0.5)^(1/4) = 1, row 2 4:
    # rows 0 and 1 are inside [0.5, 2] with their ratios untruncated, row 2 drops out
    "seq_mask_tis": [[3.0, 1.5, 0.25], [2.0, 0.5, 1.0, 1.0], [0.0, 0.0]],
}


@pytest.mark.parametrize("mode", F.OFF_POLICY_CORRECTIONS)
def test_off_policy_corrections_hand_computed(mode):
    log_ratio = torch.tensor(IS_RATIOS, dtype=torch.float64).log()
    mask = torch.tensor(IS_MASK).bool()
    log_weight, keep = F.off_policy_log_weight(log_ratio, mask, mode, cap=2.0)
    weights = log_weight.exp()
    for row, expected in enumerate(IS_WEIGHTS[mode]):
        got = weights[row][mask[row]].tolist()
        assert got == pytest.approx(expected, rel=1e-12), row
        assert keep[row][mask[row]].tolist() == [w > 0 for w in expected]
    assert keep[~mask].all()  # padding is never counted as dropped
    dropped = F.masked_mean((~keep).double(), mask)  # what policy/is_masked_frac logs
    assert float(dropped) == pytest.approx(sum(w == 0 for r in IS_WEIGHTS[mode] for w in r) / 9)
    if mode == "tis":  # today's TIS, bit for bit
        assert torch.equal(log_weight[mask], log_ratio.clamp_max(math.log(2.0))[mask])
    # a pad's log-probs may hold anything (NaN): its weight is 1, and no NaN reaches a gradient
    poisoned = torch.where(mask, log_ratio, torch.full_like(log_ratio, math.nan)).requires_grad_()
    log_weight, _ = F.off_policy_log_weight(poisoned, mask, mode, cap=2.0)
    assert torch.equal(log_weight[~mask], torch.zeros_like(log_weight[~mask]))
    (log_weight.exp() * mask).sum().backward()
    assert torch.isfinite(poisoned.grad).all()


def test_off_policy_corrections_with_a_lower_bound():
    """``low``: tis raises the weights below it (OpenRLHF's and NeMo-RL's clamp), mis masks them
    too, and seq_mask_tis at NeMo-RL's tight window [0.999, 1.002] keeps row 1 alone (geometric
    mean exactly 1), its ratios untruncated."""
    log_ratio = torch.tensor(IS_RATIOS, dtype=torch.float64).log()
    mask = torch.tensor(IS_MASK).bool()

    def weights(mode, cap, low):
        w = F.off_policy_log_weight(log_ratio, mask, mode, cap=cap, low=low)[0].exp()
        return [w[i][mask[i]].tolist() for i in range(3)]

    assert weights("tis", 2.0, 0.5)[0] == pytest.approx([2.0, 1.5, 0.5])
    assert weights("mis", 2.0, 0.5)[0] == pytest.approx([0.0, 1.5, 0.0])
    assert weights("seq_mask_tis", 1.002, 0.999) == [[0.0] * 3, pytest.approx([2.0, 0.5, 1.0, 1.0]),
                                                      [0.0] * 2]
    assert weights("icepop", 5.0, 0.5)[2] == pytest.approx([4.0, 4.0])  # Ring-1T's [0.5, 5]
    with pytest.raises(ValueError, match="choose one of"):
        F.off_policy_log_weight(log_ratio, mask, "clip", cap=2.0)
    with pytest.raises(ValueError, match="leaves no room"):
        F.check_off_policy_correction("icepop", 0.8)  # [1 / 0.8, 0.8] is empty
    with pytest.raises(ValueError, match="leaves no room"):
        F.check_off_policy_correction("mis", 2.0, low=3.0)


def _bf16_products_in_fp32(a, b):
    """What CUDA's bf16 x bf16 -> fp32 matmul computes: exact products, fp32 sums."""
    return a.float() @ b.float()


@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16x3_linear_is_fp32_to_16_bits_against_float64(bias):
    """Three bf16 products with fp32 sums (a CPU emulates CUDA's kernel): a logit within 2**-14 of
    the products' scale, 100x closer than a bf16 product; the backward is bf16's (within 1%)."""
    from rlhf_torchrl.functional.matmul import split_bf16_linear

    torch.manual_seed(0)
    x, w = torch.randn(2, 37, 256), torch.randn(5000, 256) * 0.05
    b = torch.randn(5000) if bias else None
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    out = split_bf16_linear(x, w, b, mm=_bf16_products_in_fp32)
    assert out.shape == (2, 37, 5000) and out.dtype == torch.float32
    error = (out.double() - exact).abs().max().item()
    bf16 = ((x.bfloat16() @ w.bfloat16().T).double() + (0 if b is None else b.double())
            - exact).abs().max().item()
    assert error < 2**-14 * exact.abs().max().item() and error < bf16 / 100
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    grad = torch.randn(2, 37, 5000)
    (split_bf16_linear(xs, ws, mm=_bf16_products_in_fp32) * grad).sum().backward()
    (torch.nn.functional.linear(xf, wf) * grad).sum().backward()
    for split, full in ((xs.grad, xf.grad), (ws.grad, wf.grad)):
        assert ((split - full).norm() / full.norm()).item() < 1e-2


def test_without_a_bf16_to_fp32_matmul_the_split_linear_is_the_fp32_one():
    """A CPU has no ``torch.mm(..., out_dtype=torch.float32)``: the fp32 product, bit for bit."""
    from rlhf_torchrl.functional.matmul import has_fp32_out_mm, split_bf16_linear

    assert not has_fp32_out_mm(torch.device("cpu"))
    x, w, b = torch.randn(3, 7, 16), torch.randn(11, 16), torch.randn(11)
    assert split_bf16_linear(x, w, b).equal(torch.nn.functional.linear(x, w, b))


def test_a_few_rows_or_bf16_operands_take_fewer_products(monkeypatch):
    """A decoding step's few rows keep the fp32 product (splitting the weight costs more than it
    saves); an operand in bf16 already has no low part, and its products are left out (the same
    result from a shorter inner dimension)."""
    from rlhf_torchrl.functional import matmul

    widths = []

    def emulated(a, b):
        widths.append(a.shape[1])
        return a.float() @ b.float()

    monkeypatch.setattr(matmul, "has_fp32_out_mm", lambda device: True)
    monkeypatch.setattr(matmul, "mm_fp32_out", emulated)
    w = torch.randn(300, 16)
    few = torch.randn(matmul.SPLIT_MIN_ROWS - 1, 16)
    assert matmul.split_bf16_linear(few, w).equal(torch.nn.functional.linear(few, w)) and not widths
    many = torch.randn(2, matmul.SPLIT_MIN_ROWS // 2, 16)
    matmul.split_bf16_linear(many, w)
    assert widths == [48]  # hi hi, hi lo, lo hi
    exact = many.double() @ w.bfloat16().double().T
    out = matmul.split_bf16_linear(many, w.bfloat16())
    assert widths[-1] == 32 and out.dtype == torch.float32  # the weight's low part is zero
    assert (out.double() - exact).abs().max() < 2**-14 * exact.abs().max()
    grad_w = torch.zeros(300, 16, dtype=torch.bfloat16, requires_grad=True)
    matmul.split_bf16_linear(many, grad_w).sum().backward()
    assert grad_w.grad.dtype == torch.bfloat16  # each gradient in its input's dtype

