"""InverseCDFSampler: exact draws, truncation, and the log-probs it records during generation."""

import pytest
import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.collectors.on_policy import OffPolicyError, check_on_policy
from rlhf_torchrl.collectors.sampling import (
    InverseCDFSampler,
    ignored_generation_settings,
    sample_inverse_cdf,
)
from rlhf_torchrl.modules import (
    TokenLevelActor,
    compute_old_quantities,
    load_causal_lm,
    make_critic,
)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over cells expecting >= 5 draws (the rest pooled), and its dof."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]).double()
    keep = exp > 0
    return float(((obs - exp)[keep] ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def _assert_matches(draws: torch.Tensor, probs: torch.Tensor):
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "drew a token of probability 0"
    stat, dof = _chi_square(counts, probs.double())
    # mean dof, sd sqrt(2 dof): 6 sd is far beyond chance at a fixed seed, far below any bias
    assert stat < dof + 6 * (2 * dof) ** 0.5, (stat, dof)


def test_inverse_cdf_draws_follow_the_weights():
    torch.manual_seed(0)
    n = 700  # not a multiple of the 256-entry block; blocks 0 and 2 partly zero, block 1 all zero
    weights = torch.rand(n) ** 4
    weights[0] = 0.0
    weights[256:512] = 0.0
    weights[-3:] = 0.0
    draws = sample_inverse_cdf(weights.expand(100_000, n).contiguous())
    _assert_matches(draws, weights / weights.sum())


def test_inverse_cdf_single_positive_weight():
    weights = torch.zeros(4, 300)
    weights[:, 299] = 1e-30  # the last entry, in a padded block, far below fp32 resolution of 1
    assert sample_inverse_cdf(weights).tolist() == [299] * 4


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (0, 0.8)])
def test_sampler_matches_the_temperature_scaled_distribution(top_k, top_p):
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(1, 500) * 2
    temperature = 0.7
    expected = logits / temperature
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    probs = expected.softmax(-1)[0]
    sampler = InverseCDFSampler(temperature, top_k, top_p, record=True, record_entropy=True)
    rows = 50_000
    scores = sampler(None, logits.expand(rows, -1).clone())
    draws = scores.argmax(-1)  # what greedy generate emits
    assert torch.isinf(scores).sum(-1).eq(499).all()
    _assert_matches(draws, probs)
    # recorded: log-probs and entropy of the distribution drawn from (truncated where set)
    log_probs, entropies = sampler.pop()
    drawn = torch.log_softmax(expected, -1)[0]
    torch.testing.assert_close(log_probs[:, 0], drawn[draws], atol=1e-5, rtol=0)
    entropy = -(probs * drawn.masked_fill(probs == 0, 0.0)).sum()
    torch.testing.assert_close(entropies[:, 0], entropy.expand(rows), atol=1e-5, rtol=0)
    assert sampler.pop() == (None, None)


def test_generation_samples_the_full_distribution(tiny_llama_dir, tokenizer):
    """No hidden top-k: a near-uniform next-token distribution gives hundreds of distinct tokens.

    (transformers 5 falls back to top_k=50 when ``generation_config.top_k`` is None; see
    tests/test_torchrl_upstream.py.)
    """
    model = load_causal_lm(tiny_llama_dir, tokenizer)
    env = make_generation_env(["Say a word."] * 512, tokenizer, batch_size=512, seed=0)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=1)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=512)
    first_tokens = next(iter(collector)).get(K.RESPONSE_TOKENS)[:, 0]
    collector.shutdown()
    assert first_tokens.unique().numel() > 300  # 512 draws over ~49k tokens: ~509 distinct


def test_sampler_stops_on_nan_logits():
    scores = torch.zeros(2, 300)
    scores[1, 5] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or infinite logits"):
        InverseCDFSampler(0.7)(None, scores)


def test_sampler_rejects_bad_settings():
    with pytest.raises(ValueError, match="temperature"):
        InverseCDFSampler(0.0)
    with pytest.raises(ValueError, match="top_p"):
        InverseCDFSampler(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        InverseCDFSampler(1.0, top_k=-1)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_recorded_log_probs_equal_a_full_forward(request, model_fixture, tokenizer):
    """Old log-probs recorded while sampling (KV cache, left-padded prompts) = a fresh forward."""
    model = load_causal_lm(request.getfixturevalue(model_fixture), tokenizer)
    prompts = ["a", "hello there, how are you doing today?", "one two three four five six", "x y"]
    env = make_generation_env(prompts * 2, tokenizer, batch_size=4, seed=0)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=12, temperature=0.7,
                                 record_log_probs=True, record_entropy=True)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=4)
    rollouts = iter(collector)
    for _ in range(2):
        rollout = next(rollouts)
        assert rollout.get(K.PROMPT_MASK).sum(-1).unique().numel() > 1  # ragged prompts
        recorded = rollout.select(K.LOG_PROB, K.ENTROPY).clone()
        actor = TokenLevelActor(model, temperature=0.7)
        fresh = rollout.exclude(K.LOG_PROB, K.ENTROPY)
        compute_old_quantities(fresh, actor=actor, reference=actor,
                         critic=make_critic(policy=model, tokenizer=tokenizer, init="shared"),
                         chunk_size=4)
        mask = rollout.get(K.RESPONSE_MASK)
        for key in (K.LOG_PROB, K.ENTROPY):
            torch.testing.assert_close(recorded.get(key), fresh.get(key), atol=1e-4, rtol=0)
            assert (recorded.get(key)[~mask] == 0).all()
    collector.shutdown()


def test_evaluation_keeps_recorded_log_probs(tiny_llama_dir, tokenizer):
    """With recorded log-probs, the policy is not run (unless asked); values come from the trunk."""
    model = load_causal_lm(tiny_llama_dir, tokenizer)
    env = make_generation_env(["a b", "c"] * 2, tokenizer, batch_size=2, seed=0)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=5, record_log_probs=True)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=2)
    rollout = next(iter(collector))
    collector.shutdown()
    assert K.ENTROPY not in rollout.keys(True)
    marked = rollout.get(K.LOG_PROB) - 1.0  # a value a recomputation could not give
    rollout.set(K.LOG_PROB, marked)
    critic = make_critic(policy=model, tokenizer=tokenizer, init="shared")
    actor = TokenLevelActor(model, trunk_critic=critic)
    recomputed = compute_old_quantities(rollout.clone(), actor=actor, reference=actor, critic=critic,
                                  chunk_size=2, recompute_log_probs=True)
    compute_old_quantities(rollout, actor=actor, reference=actor, critic=critic, chunk_size=2)
    assert torch.equal(rollout.get(K.LOG_PROB), marked)
    torch.testing.assert_close(rollout.get(K.ENTROPY), -marked)  # the sample estimate
    torch.testing.assert_close(rollout.get(K.VALUE), recomputed.get(K.VALUE))
    torch.testing.assert_close(recomputed.get(K.LOG_PROB), marked + 1.0, atol=1e-4, rtol=0)


def _collect_once(model, tokenizer, n_rows=16, temperature=1.0, max_new_tokens=6, **sampling):
    env = make_generation_env([f"Prompt number {i}" for i in range(n_rows)], tokenizer,
                              batch_size=n_rows, seed=0)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=max_new_tokens,
                                 temperature=temperature, record_log_probs=True, **sampling)
    # per-row streams: the same draws whatever ran before in this process
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=n_rows, seed=0)
    rollout = next(iter(collector))
    collector.shutdown()
    return rollout


def test_checkpoint_generation_config_never_reaches_sampling(instruct_llama_dir, tokenizer, caplog):
    """An instruct checkpoint's repetition penalty, suppressed tokens, minimum length and sampling
    settings are left out of PPO's sampling, with a warning naming them; the recorded log-probs are
    those of the training forward."""
    model = load_causal_lm(instruct_llama_dir, tokenizer)
    own = model.generation_config.to_dict()
    with caplog.at_level("WARNING", logger="rlhf_torchrl.collectors.sampling"):
        rollout = _collect_once(model, tokenizer, n_rows=64)
    warning = caplog.text
    for setting in ("repetition_penalty=1.3", "min_new_tokens=4", "no_repeat_ngram_size=2",
                    "suppress_tokens=", "temperature=0.9", "top_k=20", "top_p=0.8"):
        assert setting in warning, setting
    tokens = rollout.get(K.RESPONSE_TOKENS)[rollout.get(K.RESPONSE_MASK)]
    # 20,000 of ~49k ids were suppressed by the checkpoint: sampled anyway, at their true rate
    assert 0.25 < (tokens < 20_000).float().mean() < 0.55
    stats = check_on_policy(rollout, TokenLevelActor(model, temperature=1.0), num_rows=64, atol=1e-3)
    assert stats["max_abs_diff"] < 1e-3 and stats["tokens"] == int(rollout.get(K.RESPONSE_MASK).sum())
    assert model.generation_config.to_dict() == own  # swapped only while generating
    assert ignored_generation_settings(model.generation_config)["repetition_penalty"] == 1.3


def test_on_policy_check_stops_on_a_mismatch(tiny_llama_dir, tokenizer):
    """Sampled at temperature 1.0, checked against a temperature-0.7 forward: a clear error."""
    model = load_causal_lm(tiny_llama_dir, tokenizer)
    rollout = _collect_once(model, tokenizer, n_rows=4, temperature=1.0)
    check_on_policy(rollout, TokenLevelActor(model, temperature=1.0), atol=1e-3)
    with pytest.raises(OffPolicyError, match="differ from the training forward's by up to .* nats"):
        check_on_policy(rollout, TokenLevelActor(model, temperature=0.7), atol=1e-3)
    with pytest.raises(KeyError, match="record_log_probs=True"):
        check_on_policy(rollout.exclude(K.LOG_PROB), TokenLevelActor(model), atol=1e-3)


@pytest.mark.parametrize("truncation", [{"top_k": 3}, {"top_p": 0.5}])
def test_truncated_sampling_fails_the_on_policy_check(tiny_llama_dir, tokenizer, truncation):
    """Tokens drawn by top-k/top-p carry the truncated distribution's log-probs (what was
    sampled), so the check against the full-distribution forward PPO trains with stops the run;
    the recipe refuses the settings before any work (tests/test_bad_inputs.py)."""
    model = load_causal_lm(tiny_llama_dir, tokenizer)
    rollout = _collect_once(model, tokenizer, n_rows=4, **truncation)
    with pytest.raises(OffPolicyError, match="differ from the training forward's"):
        check_on_policy(rollout, TokenLevelActor(model, temperature=1.0), atol=1e-3)


def _shard_rollouts(model, tokenizer, prompts, *, batch_size, world_size, batches=2, group=1):
    """The rollouts ``world_size`` processes would collect, rank by rank, as lists of batches."""
    out = []
    for rank in range(world_size):
        local = batch_size // world_size
        env = make_generation_env(prompts, tokenizer, batch_size=batch_size, seed=3, rank=rank,
                                  world_size=world_size, samples_per_prompt=group)
        gen = make_generation_policy(model, tokenizer, max_new_tokens=8, temperature=1.0,
                                     record_log_probs=True)
        collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=local, seed=7,
                                     row_offset=rank * local, total_batches=batches,
                                     samples_per_prompt=group)
        out.append(list(collector))
        collector.shutdown()
    return out


@pytest.mark.parametrize("group", [1, 2])
def test_row_streams_make_collection_world_size_invariant(tiny_llama_dir, tokenizer, group):
    """One process collecting a global batch of 4 and two collecting 2 rows each (their shards of
    the same global batches) draw the same response for every row, with the same log-probs. In
    groups of 2 responses per prompt each process gets whole groups, each response its own stream."""
    model = load_causal_lm(tiny_llama_dir, tokenizer)
    prompts = [f"Prompt {i} " + "word " * (i % 5) for i in range(12)]
    (single,) = _shard_rollouts(model, tokenizer, prompts, batch_size=4, world_size=1, group=group)
    shards = _shard_rollouts(model, tokenizer, prompts, batch_size=4, world_size=2, group=group)
    for k, whole in enumerate(single):
        parts = [shards[0][k], shards[1][k]]
        assert whole.get(K.GROUP).tolist() == [i // group for i in range(4)]
        assert torch.cat([p.get(K.GROUP) for p in parts]).tolist() == whole.get(K.GROUP).tolist()
        texts = whole.get(K.PROMPT_TEXT).tolist()
        assert all(texts[i] == texts[i - i % group] for i in range(4))  # a group: one prompt
        assert len(set(texts)) == 4 // group
        assert whole.get(K.PROMPT_TEXT).tolist() == sum((p.get(K.PROMPT_TEXT).tolist() for p in parts), [])
        assert whole.get(K.RESPONSE_TEXT).tolist() == sum((p.get(K.RESPONSE_TEXT).tolist() for p in parts), [])
        for i, part in enumerate(parts):
            rows = whole[2 * i : 2 * i + 2]
            width = part.get(K.RESPONSE_MASK).shape[1]
            mask = part.get(K.RESPONSE_MASK)
            torch.testing.assert_close(rows.get(K.LOG_PROB)[:, :width] * mask, part.get(K.LOG_PROB),
                                       atol=1e-5, rtol=0)
    # the streams differ from row to row and batch to batch: not one response repeated
    texts = [t for r in single for t in r.get(K.RESPONSE_TEXT).tolist()]
    assert len(set(texts)) == len(texts)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_one_prefill_per_group_samples_what_a_prefill_per_row_does(request, model_fixture,
                                                                   tokenizer, monkeypatch):
    """Groups of 3 responses per prompt, prompts of different lengths (left padding): prefilling
    each prompt once and repeating its KV cache gives the tokens and recorded log-probs of a
    prefill per row."""
    import rlhf_torchrl.collectors.backends.transformers as generation

    calls = []
    original = generation.generate_in_groups
    monkeypatch.setattr(generation, "generate_in_groups",
                        lambda *a, **kw: calls.append(a[2]) or original(*a, **kw))
    model = load_causal_lm(request.getfixturevalue(model_fixture), tokenizer)
    prompts = [f"Prompt {i} " + "word " * i for i in range(12)]  # every prompt its own length
    rollouts = {}
    for shared in (True, False):
        env = make_generation_env(prompts, tokenizer, batch_size=6, seed=3, samples_per_prompt=3)
        gen = make_generation_policy(model, tokenizer, max_new_tokens=8, temperature=1.0,
                                     record_log_probs=True, samples_per_prompt=3 if shared else 1)
        collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=6, seed=7,
                                     total_batches=2, samples_per_prompt=3)
        rollouts[shared] = list(collector)
        collector.shutdown()
    assert calls == [3, 3]  # each batch went through the grouped prefill
    for a, b in zip(rollouts[True], rollouts[False]):
        assert a.get(K.PROMPT_MASK).sum(-1).unique().numel() > 1  # left padding in the batch
        assert torch.equal(a.get(K.RESPONSE_TOKENS), b.get(K.RESPONSE_TOKENS))
        torch.testing.assert_close(a.get(K.LOG_PROB), b.get(K.LOG_PROB), atol=1e-6, rtol=0)


@pytest.mark.parametrize("model_fixture, group", [("tiny_llama_dir", 3), ("tiny_gpt2_dir", 1)])
def test_values_read_off_the_sampling_pass_equal_the_critics(request, model_fixture, group,
                                                             tokenizer):
    """A shared-trunk critic's values recorded while sampling (KV cache, left padding, one
    prefill per group) equal the critic's own forward, 0 on pads; the on-policy check compares
    them and stops on a gap; evaluation keeps them unless it recomputes."""
    from rlhf_torchrl.modules.lora import trunk

    model = load_causal_lm(request.getfixturevalue(model_fixture), tokenizer)
    critic = make_critic(policy=model, tokenizer=tokenizer, init="shared")
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.head.weight)  # values far from 0, different at every state
    torch.nn.init.constant_(critic.head.bias, 0.3)
    prompts = [f"Prompt {i} " + "word " * i for i in range(12)]
    env = make_generation_env(prompts, tokenizer, batch_size=6, seed=3, samples_per_prompt=group)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=8, temperature=1.0,
                                 record_log_probs=True, samples_per_prompt=group,
                                 value_head=critic.head)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=6, seed=7,
                                 total_batches=2, samples_per_prompt=group)
    actor = TokenLevelActor(model, temperature=1.0, trunk_critic=critic)
    for rollout in collector:
        mask = rollout.get(K.RESPONSE_MASK)
        assert rollout.get(K.PROMPT_MASK).sum(-1).unique().numel() > 1
        recorded = rollout.get(K.VALUE)
        assert recorded.shape == (*mask.shape, 1) and recorded.dtype == torch.float32
        assert (recorded.squeeze(-1)[~mask] == 0).all() and recorded.abs().max() > 0.1
        fresh = critic(rollout.select(*critic.in_keys).clone()).get(K.VALUE)
        torch.testing.assert_close(recorded, fresh, atol=1e-5, rtol=0)
        stats = check_on_policy(rollout, actor, num_rows=6, critic=critic)
        assert stats["value_max_abs_diff"] < 1e-5
    collector.shutdown()
    assert not trunk(model)._forward_hooks  # the hook lives only while generate runs
    shifted = rollout.clone()
    shifted.set(K.VALUE, recorded + 0.01 * mask.unsqueeze(-1))
    with pytest.raises(OffPolicyError, match="values recorded while sampling differ"):
        check_on_policy(shifted, actor, num_rows=6, critic=critic)
    compute_old_quantities(shifted, actor=actor, reference=actor, critic=critic, chunk_size=6)
    assert torch.equal(shifted.get(K.VALUE), recorded + 0.01 * mask.unsqueeze(-1))  # kept
    compute_old_quantities(shifted, actor=actor, reference=actor, critic=critic, chunk_size=6,
                     recompute_log_probs=True)
    torch.testing.assert_close(shifted.get(K.VALUE), fresh, atol=1e-5, rtol=0)


def test_the_kv_cache_goes_by_the_name_this_transformers_takes(tiny_llama_dir, tokenizer):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns on every
    batch): the static-cache path passes whichever the model's forward takes, and warns nothing."""
    import inspect
    import warnings

    from rlhf_torchrl.collectors.backends.transformers import (
        StaticCaches,
        cache_kwarg,
        generate_with_static_cache,
    )
    from rlhf_torchrl.modules import load_causal_lm

    model = load_causal_lm(tiny_llama_dir, tokenizer)
    assert cache_kwarg(model) in inspect.signature(type(model).forward).parameters

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_kwarg(Older()) == "past_key_values"
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(load_causal_lm(tiny_llama_dir, tokenizer),
                                  peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_kwarg(wrapped) == cache_kwarg(model)  # the wrapped model's name, not PEFT's
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = generate_with_static_cache(model, model.generate, StaticCaches(8), None, input_ids=ids,
                                         max_new_tokens=3, do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] >= ids.shape[1] + 1
