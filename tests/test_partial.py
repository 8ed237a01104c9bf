"""Partial rollouts: paused responses continued by newer weights, every token with the version and
log-prob it was sampled with; the recipe on them, and its exact resume after SIGKILL.

The tiny Llama of ``stopping_llama_dir`` stops after 1, 2, ... tokens at random (EOS as likely as
each of three words): with 2 tokens a round and 8 at most, some responses finish in the first
round and others run on through later ones, across iterations.
"""

import copy
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import (
    PartialRolloutCollector,
    RolloutCollector,
    make_generation_env,
    make_generation_policy,
)
from rlhf_torchrl.collectors.on_policy import OffPolicyError, check_on_policy
from rlhf_torchrl.collectors.partial import current_tokens, resume_batch
from rlhf_torchrl.collectors.sampling import row_stream_seeds
from rlhf_torchrl.modules import TokenLevelActor

PROMPTS = ["The film was", "I did not expect", "Its story", "The acting", "A slow start but",
           "Music and light", "The ending", "Nothing"]
MAX_NEW, SEGMENT = 8, 2


def _collector(model, tokenizer, *, start_batch=0, state=None, batch_size=4):
    first = resume_batch(state) if state is not None else start_batch
    env = make_generation_env(PROMPTS, tokenizer, batch_size=batch_size, seed=0, start_batch=first)
    policy = make_generation_policy(model, tokenizer, max_new_tokens=MAX_NEW, record_log_probs=True)
    return PartialRolloutCollector(env, policy, tokenizer=tokenizer, max_new_tokens=MAX_NEW,
                                   segment_tokens=SEGMENT, seed=0, start_batch=start_batch,
                                   state=state)


def _update(model, tokenizer) -> None:
    """An "update": the policy changes (EOS a little less likely: longer responses)."""
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id, 0] -= 0.05


def test_each_token_keeps_the_version_and_log_prob_it_was_sampled_with(stopping_llama_dir, tokenizer):
    """Batch k is sampled by version k, the paused responses' earlier tokens by older versions. For
    every version in a batch, the recorded log-probs of its tokens are that version's forward over
    the whole response (exactly), and not the current version's where it is older."""
    model = AutoModelForCausalLM.from_pretrained(stopping_llama_dir)
    snapshots, reference = [copy.deepcopy(model.state_dict())], copy.deepcopy(model)
    mixed = 0
    for k, rollout in enumerate(_collector(model, tokenizer)):
        mask, versions = rollout.get(K.RESPONSE_MASK), rollout.get(K.TOKEN_VERSION)
        assert rollout.shape == (4,) and versions.shape == mask.shape
        assert (versions[:, 1:] >= versions[:, :-1])[mask[:, 1:]].all()  # in order of sampling
        assert (versions[mask] <= k).all()
        oldest = versions.masked_fill(~mask, k).amin(-1)
        assert torch.equal(rollout.get(K.POLICY_VERSION), oldest)
        assert (rollout.get(K.SEGMENTS) >= (mask.sum(-1) + SEGMENT - 1) // SEGMENT).all()
        for version in versions[mask].unique().tolist():
            reference.load_state_dict(snapshots[version])
            rows, tokens = current_tokens(rollout, version)
            check_on_policy(rows, TokenLevelActor(reference), num_rows=4, atol=1e-5, tokens=tokens)
            if version < k:  # older tokens are not the current policy's
                with pytest.raises(OffPolicyError):
                    check_on_policy(rows, TokenLevelActor(model), num_rows=4, atol=1e-5,
                                    tokens=tokens)
        mixed += int((oldest < versions.masked_fill(~mask, -1).amax(-1)).sum())
        if k == 4:
            break
        _update(model, tokenizer)
        snapshots.append(copy.deepcopy(model.state_dict()))
    assert mixed > 0  # some responses were paused and continued by newer weights


def test_segments_are_drawn_from_each_rows_own_streams(stopping_llama_dir, tokenizer):
    """With the weights fixed: a response's first segment is the first tokens the whole-response
    collector draws for the same row (segment 0 is its stream), and each later segment is what the
    row alone draws from the stream of (seed, batch, row, segment): no row depends on the rows
    sampled beside it."""
    model = AutoModelForCausalLM.from_pretrained(stopping_llama_dir)
    collector = _collector(model, tokenizer)
    yielded, to_rollout = [], collector._to_rollout
    collector._to_rollout = lambda groups: yielded.extend(groups) or to_rollout(groups)
    rollouts = iter(collector)
    next(rollouts)
    next(rollouts)
    started = [r for group in [*yielded, *collector.running, *collector.finished] for r in group]
    continued = [r for r in started if r.segments > 1]
    assert continued and any(r.batch == 0 for r in continued)
    env = make_generation_env(PROMPTS, tokenizer, batch_size=4, seed=0)
    policy = make_generation_policy(model, tokenizer, max_new_tokens=MAX_NEW, record_log_probs=True)
    whole = next(iter(RolloutCollector(env, policy, tokenizer=tokenizer, seed=0)))
    for r in started:
        if r.batch == 0:  # the first SEGMENT tokens of the whole response
            expected = whole.get(K.RESPONSE_TOKENS)[r.row][whole.get(K.RESPONSE_MASK)[r.row]]
            assert r.tokens[:SEGMENT] == expected[:SEGMENT].tolist()
    sampler = collector.sampler
    for r in continued:
        for s in range(1, r.segments):
            prefix = r.prompt + r.tokens[:s * SEGMENT]
            sampler.set_streams(row_stream_seeds(0, r.batch, [r.row], segment=s))
            new = collector.policy.generate_tokens(torch.tensor([prefix]),
                                                   torch.ones(1, len(prefix)), SEGMENT)
            sampler.pop()
            n = len(r.tokens[s * SEGMENT:(s + 1) * SEGMENT])
            assert new[0, :n].tolist() == r.tokens[s * SEGMENT:(s + 1) * SEGMENT]


def test_a_collector_resumed_from_its_pending_state_continues_exactly(stopping_llama_dir, tokenizer,
                                                                      tmp_path):
    """pending() after batch 1, written and read back as a checkpoint does, rebuilds a collector
    (its env at the saved prompt batch, version 2) whose batches 2 and 3 are the uninterrupted
    one's, paused responses included."""
    from tensordict import TensorDict

    model = AutoModelForCausalLM.from_pretrained(stopping_llama_dir)
    snapshots, batches = [copy.deepcopy(model.state_dict())], []
    collector = _collector(model, tokenizer)
    for k, rollout in enumerate(collector):
        batches.append(rollout)
        if k == 1:
            (state,) = collector.pending()
            state.save(tmp_path / "state")
            assert (state.get(("rows", "queue")) == 1).any()  # responses in flight
        if k == 3:
            break
        _update(model, tokenizer)
        snapshots.append(copy.deepcopy(model.state_dict()))
    state = TensorDict.load(tmp_path / "state", allow_pickle=False).clone()
    model.load_state_dict(snapshots[2])
    resumed = iter(_collector(model, tokenizer, start_batch=2, state=state))
    for k in (2, 3):
        model.load_state_dict(snapshots[k])
        again = next(resumed)
        assert again.get(K.RESPONSE_TEXT).tolist() == batches[k].get(K.RESPONSE_TEXT).tolist()
        for key, value in batches[k].items(True, True):
            if isinstance(value, torch.Tensor):
                assert torch.equal(again.get(key), value), key
    with pytest.raises(ValueError, match="paused before iteration 2, not 3"):
        _collector(model, tokenizer, start_batch=3, state=state)


@pytest.mark.parametrize("overlap", [None, 1], ids=["synchronous", "overlap"])
def test_paused_responses_are_not_resumed_without_partial_rollouts(overlap):
    """A checkpoint's pending state of paused responses (its ``next_batch``), given to a collector
    without partial rollouts, synchronous or sampling ahead, is refused with the setting to use:
    it is neither dropped nor read as batches sampled ahead."""
    from tensordict import TensorDict

    from rlhf_torchrl.collectors.factory import CollectorSpec, make_collector
    from rlhf_torchrl.errors import ConfigError

    paused = TensorDict({"next_batch": torch.tensor(2)}, batch_size=[])
    spec = CollectorSpec(batch_size=4, max_new_tokens=MAX_NEW, stop_token_ids=(0,), overlap=overlap)
    with pytest.raises(ConfigError, match="partial rollouts paused: resume with "
                                          "collection.partial_rollout=true and the same "
                                          "partial_rollout_tokens"):
        make_collector(spec, PROMPTS, None, None, start_batch=2, pending=[paused])


# ---- the recipe ---------------------------------------------------------------------------------
PARTIAL = ["collection.partial_rollout=true", "collection.partial_rollout_tokens=2"]


def test_recipe_trains_on_partial_rollouts(tmp_path, stopping_llama_dir, caplog):
    """The recipe with partial rollouts: responses span several versions, the old log-probs are
    recomputed by the policy being updated (PPO's ratio is 1 at the first minibatch of every
    iteration), the sampler's weight the loss (TIS, capped at 2), and the on-policy check compares
    the first batch's tokens."""
    from test_recipe import _cfg

    from rlhf_torchrl.config.builders import build_trainer

    trainer = build_trainer(_cfg(tmp_path, stopping_llama_dir, *PARTIAL, "ppo.num_iterations=3",
                                 "generation.max_new_tokens=8"))
    first = {}  # iteration -> the first minibatch's losses and diagnostics
    forward = trainer.loss_module.forward

    def recording(td):
        out = forward(td)
        first.setdefault(trainer.iteration, out.detach().clone())
        return out

    trainer.loss_module.forward = recording
    with caplog.at_level("INFO"):
        trainer.fit()
    assert any(r.message.startswith("On-policy check") for r in caplog.records)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["partial/token_staleness"] == 0
    assert max(m["partial/mixed_version_frac"] for m in lines) > 0
    assert max(m["partial/max_token_staleness"] for m in lines) >= 1
    for iteration, m in enumerate(lines):
        assert float(first[iteration]["ratio"]) == pytest.approx(1.0, abs=1e-5)
        assert 0 < m["policy/tis_weight_avg"] <= 2.0 and m["partial/segments"] >= 1
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))


@pytest.mark.parametrize("overrides, says", [
    (["collection.partial_rollout_tokens=2"], "set collection.partial_rollout=true"),
    ([*PARTIAL, "collection.overlap=1"], "partial_rollout with collection.overlap"),
    ([*PARTIAL, "generation.log_probs_from_sampling=true"], "log_probs_from_sampling=true"),
    (["collection.partial_rollout=true", "collection.partial_rollout_tokens=6"],
     "no response would ever be paused"),
])
def test_partial_rollout_settings_that_cannot_work_are_refused(tmp_path, tiny_llama_dir, overrides,
                                                               says):
    from test_recipe import _cfg

    from rlhf_torchrl.config import checks
    from rlhf_torchrl.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        checks.check_config(_cfg(tmp_path, tiny_llama_dir, *overrides))


@pytest.mark.processes  # the suite of its own (pyproject.toml's markers)
def test_sigkill_with_paused_responses_then_resume(tmp_path, stopping_llama_dir):
    """Killed with SIGKILL mid-run and started again with the same command, a run with partial
    rollouts logs what the uninterrupted run logs: every checkpoint holds the responses paused
    in flight, each process's own, and the resumed collector continues them."""
    from test_resume import _command, _complete, _rows, _run_until, _safe_rows

    from rlhf_torchrl.trainers.checkpoint import latest_checkpoint, load_rollouts

    whole, out = tmp_path / "whole", tmp_path / "run"
    _complete([*_command(stopping_llama_dir, whole), *PARTIAL], whole)
    command = [*_command(stopping_llama_dir, out), *PARTIAL]
    assert _run_until(command, out, lambda o: len(_safe_rows(o)) >= 3)
    (state,) = load_rollouts(latest_checkpoint(str(out)))  # what the resumed run starts from
    assert (state.get(("rows", "queue")) == 1).any()  # responses paused in flight
    _complete(command, out)
    assert _rows(out) == _rows(whole) and len(_rows(whole)) == 5
    assert max(row["partial/mixed_version_frac"] for row in _rows(whole)) > 0
