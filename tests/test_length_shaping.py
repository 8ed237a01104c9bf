"""Length shaping and per-source normalisation (issue 49, item 4): DAPO's soft overlong penalty
against hand-computed values, the running per-source statistics against a plain loop, their
checkpoint round trip and exact resume, the settings refused in one line, and a recipe run on a
mixture of two sources."""

import json
import math
import statistics

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from test_recipe import _cfg, ppo
from test_resume import EXACT, _rows, _stop_at

from rlhf_torchrl import keys as K
from rlhf_torchrl.config import builders, checks
from rlhf_torchrl.data.prompt_sets import SOURCE_COLUMN, PromptMixture, load_prompts
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional import batch_moments, merge_moments, overlong_penalty
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.rewards.length import OverlongPenalty, PerSourceScoreNorm, ScoreTransforms
from rlhf_torchrl.trainers.checkpoint import list_checkpoints


def dapo_eq13(length: int, l_max: int, l_cache: int) -> float:
    """DAPO's eq. 13 as printed (Yu et al. 2025), one response at a time."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_at_the_boundaries():
    """L_max=16, L_cache=4: nothing up to 12 tokens, -1/4 a token after, -1 at 16 and beyond;
    the penalty scales it; every length 0..20 as eq. 13 says."""
    lengths = torch.tensor([0, 11, 12, 13, 14, 15, 16, 17])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, 16, 4), expected)
    assert torch.equal(overlong_penalty(lengths, 16, 4, penalty=0.5), expected / 2)
    assert not torch.signbit(overlong_penalty(lengths, 16, 4)[:3]).any()  # +0.0, not -0.0
    for l_max, l_cache in [(16, 4), (10, 1), (10, 9), (7, 3)]:
        every = torch.arange(0, l_max + 5)
        loop = torch.tensor([dapo_eq13(int(n), l_max, l_cache) for n in every])
        torch.testing.assert_close(overlong_penalty(every, l_max, l_cache), loop)
    for bad in (0, 16, 20):
        with pytest.raises(ValueError, match="must be > 0 and below"):
            overlong_penalty(lengths, 16, bad)


def _rollout(lengths, width=None, score=None, observation=None):
    width = width or max(lengths)
    mask = torch.arange(width).expand(len(lengths), width) < torch.tensor(lengths)[:, None]
    td = TensorDict({K.RESPONSE_MASK: mask,
                     K.SCORE: torch.zeros(len(lengths)) if score is None else torch.tensor(score)},
                    [len(lengths)])
    if observation is not None:
        td.set(K.OBSERVATION_MASK, observation)
    return td


def test_overlong_penalty_module_counts_the_policys_own_tokens_and_logs():
    """A multi-turn row of 10 tokens of its own and 6 a tool wrote counts 10; the score gets the
    penalty; the stats say who was penalised and who reached the limit."""
    # row 0: 10 policy tokens, then a 6-token tool message, then 2 more of the policy's (12)
    mask = torch.zeros(3, 20, dtype=torch.bool)
    observation = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, :10], observation[0, 10:16], mask[0, 16:18] = True, True, True
    mask[1, :14] = True
    mask[2, :20] = True
    td = TensorDict({K.RESPONSE_MASK: mask, K.OBSERVATION_MASK: observation,
                     K.SCORE: torch.tensor([1.0, 1.0, 0.5])}, [3])
    OverlongPenalty(max_length=16, buffer=4, penalty=2.0)(td)
    # 12 tokens: none; 14: -2 * 2/4; 20 (beyond the limit): -2
    assert torch.equal(td.get(K.SCORE), torch.tensor([1.0, 0.0, -1.5]))
    stats = td.get(K.REWARD_STATS)
    assert torch.equal(stats["overlong_penalty"], torch.tensor([0.0, -1.0, -2.0]))
    assert torch.equal(stats["overlong_frac"], torch.tensor([0.0, 1.0, 1.0]))
    assert torch.equal(stats["truncated_frac"], torch.tensor([0.0, 0.0, 1.0]))
    for bad, match in [(dict(max_length=16, buffer=16), "below the 16 tokens"),
                       (dict(max_length=16, buffer=0), "must be > 0"),
                       (dict(max_length=16, buffer=4, penalty=-1.0), "give a number >= 0")]:
        with pytest.raises(ConfigError, match=match):
            OverlongPenalty(**bad)


def test_penalty_comes_before_the_clip_and_the_group_baselines():
    """As in verl's DAPORewardManager: the penalty is part of the score that reward.score_clip
    clips and the group baselines compare (``shaped_score``)."""
    td = _rollout([4, 16], width=16, score=[0.2, 0.2])
    td.set(K.LOG_PROB, torch.zeros(2, 16))
    td.set(K.REF_LOG_PROB, torch.zeros(2, 16))
    ScoreTransforms(OverlongPenalty(16, 4))(td)
    KLRewardShaper(make_kl_controller(0.0), score_clip=0.5)(td)
    assert torch.allclose(td.get(K.SHAPED_SCORE), torch.tensor([0.2, -0.5]))  # clip(0.2 - 1)
    assert torch.allclose(td.get(K.REWARD)[1, 15, 0], torch.tensor(-0.5))  # at the last token


def _with_sources(scores, sources):
    lengths = torch.arange(len(scores))[:, None] * 5 % 17  # 0, 5, 10, 15, 3, ... tokens
    td = TensorDict({K.SCORE: torch.tensor(scores, dtype=torch.float32),
                     K.RESPONSE_MASK: torch.arange(16).expand(len(scores), 16) < lengths},
                    [len(scores)])
    td.set((K.DATA, SOURCE_COLUMN), NonTensorStack(*(NonTensorData(s) for s in sources)))
    return td


def _batches(seed=0, n_batches=6, n_sources=3):
    """Batches of uneven sizes and source shares, on different scales; a source absent from some."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n_batches):
        size = int(torch.randint(3, 9, (1,), generator=g))
        sources = torch.randint(0, n_sources - (b % 2), (size,), generator=g).tolist()
        scores = [float(torch.randn((), generator=g)) * 10 ** s + 5 * s for s in sources]
        scores = torch.tensor(scores, dtype=torch.float32).tolist()  # (as the rollout holds them)
        out.append((scores, sources))
    return out


def test_per_source_norm_matches_a_plain_loop():
    """Every batch's scores standardised by their source's mean and population std over every
    score of that source so far, this batch's included (statistics over all of them, kept in
    lists)."""
    eps = 1e-8
    norm = PerSourceScoreNorm(["a", "b", "c"], eps=eps)
    seen = {0: [], 1: [], 2: []}
    for scores, sources in _batches():
        out = norm(_with_sources(scores, sources))
        for s, x in zip(sources, scores):
            seen[s].append(x)
        expected = [(x - statistics.fmean(seen[s])) / math.sqrt(statistics.pvariance(seen[s]) + eps)
                    for x, s in zip(scores, sources)]
        torch.testing.assert_close(out.get(K.SCORE), torch.tensor(expected, dtype=torch.float32))
        assert torch.equal(out.get((K.REWARD_STATS, "unnormalized_score")), torch.tensor(scores))
    metrics = norm.metrics()
    for i, name in enumerate("abc"):
        assert metrics[f"reward/source_count/{name}"] == len(seen[i])
        assert math.isclose(metrics[f"reward/source_mean/{name}"], statistics.fmean(seen[i]))
        assert math.isclose(metrics[f"reward/source_std/{name}"], statistics.pstdev(seen[i]))
    # the sources may be named by the rows too, and a rollout without the field is source 0
    named = PerSourceScoreNorm(["a", "b"])(_with_sources([1.0, 2.0, 3.0, 5.0], ["a", "a", "b", 1]))
    assert torch.allclose(named.get(K.SCORE), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    one = PerSourceScoreNorm()(TensorDict({K.SCORE: torch.tensor([2.0, 4.0])}, [2]))
    assert torch.allclose(one.get(K.SCORE), torch.tensor([-1.0, 1.0]))


def test_moments_merge_exactly_and_non_finite_scores_are_left_out():
    values = torch.randn(50, dtype=torch.float64) * 3 + 1
    index = torch.randint(0, 2, (50,))
    whole = batch_moments(values, index, 2)
    merged = merge_moments(*batch_moments(values[:17], index[:17], 2),
                           *batch_moments(values[17:], index[17:], 2))
    for a, b in zip(whole, merged):
        torch.testing.assert_close(a, b)
    norm = PerSourceScoreNorm(2)
    out = norm(_with_sources([1.0, float("nan"), 3.0, 7.0], [0, 0, 0, 1]))
    assert norm.count.tolist() == [2.0, 1.0] and norm.mean.tolist() == [2.0, 7.0]
    assert math.isnan(float(out.get(K.SCORE)[1]))  # left for the trainer's guard
    with pytest.raises(ConfigError, match=r"A row's source is 'x': PerSourceScoreNorm knows"):
        norm(_with_sources([1.0], ["x"]))
    with pytest.raises(ConfigError, match="has 2 sources, and the rollout has no"):
        norm(TensorDict({K.SCORE: torch.ones(2)}, [2]))


def test_per_source_state_round_trips_through_a_checkpoint_file(tmp_path):
    """The statistics saved (torch.save, loaded back with weights_only=True, as trainer.pt is)
    and restored give a fresh normaliser the same outputs; another number of sources is one line."""
    batches = _batches(seed=1)
    first = ScoreTransforms(PerSourceScoreNorm(3), OverlongPenalty(16, 4))
    for scores, sources in batches[:3]:
        first(_with_sources(scores, sources))
    torch.save({"reward_transform": first.state_dict()}, tmp_path / "trainer.pt")
    state = torch.load(tmp_path / "trainer.pt", weights_only=True)["reward_transform"]
    second = ScoreTransforms(PerSourceScoreNorm(3), OverlongPenalty(16, 4))
    second.load_state_dict(state)
    for scores, sources in batches[3:]:
        a, b = first(_with_sources(scores, sources)), second(_with_sources(scores, sources))
        assert torch.equal(a.get(K.SCORE), b.get(K.SCORE))
    with pytest.raises(ConfigError, match="hold 3 sources, this run has 2: resume with the data.sources"):
        ScoreTransforms(PerSourceScoreNorm(2)).load_state_dict(state)


def test_a_mixture_tags_each_prompt_with_its_source(tmp_path):
    for name, word in (("a", "apple"), ("b", "banana")):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{word} {i}"}) + "\n" for i in range(6)))
    mixture = PromptMixture([load_prompts(str(tmp_path / "a.jsonl")),
                             load_prompts(str(tmp_path / "b.jsonl"))], [1, 1])
    assert [p.fields[SOURCE_COLUMN] for p in mixture] == [0] * 6 + [1] * 6
    train, held_out = mixture.hold_out(2)
    assert [p.fields[SOURCE_COLUMN] for p in held_out] == [0, 1]
    assert [p.fields[SOURCE_COLUMN] for p in train.with_length_check(None)][-1] == 1


#: two assistant turns with a calculator (a chat template with roles)
MULTI_TURN = ["env.max_turns=2", "env.tools=[calculator]", "data.chat_template=null"]


def _cfg_checked(tmp_path, model_dir, *overrides):
    return checks.check_config(_cfg(tmp_path, model_dir, *overrides))


@pytest.mark.parametrize("overrides,match", [
    (["reward.overlong_buffer=6"],  # TINY: generation.max_new_tokens=6
     r"^reward.overlong_buffer=6 must be below generation.max_new_tokens=6, the most tokens"),
    (["reward.overlong_buffer=0"], r"reward.overlong_buffer=0 is out of range"),
    (["reward.overlong_buffer=2", "reward.overlong_penalty=-1"],
     r"reward.overlong_penalty=-1.0 is out of range"),
    (["reward.overlong_buffer=12", *MULTI_TURN],
     r"must be below env.max_turns=2 x generation.max_new_tokens=6"),
    (["reward.overlong_buffer=9", *MULTI_TURN, "env.max_tokens=9"],
     r"must be below env.max_tokens=9"),
], ids=["buffer-at-the-limit", "buffer-0", "negative-penalty", "multi-turn", "multi-turn-budget"])
def test_bad_settings_are_one_line(tmp_path, tiny_llama_dir, overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        _cfg_checked(tmp_path, tiny_llama_dir, *overrides)
    assert "\n" not in str(info.value)


def test_settings_that_fit_pass_and_a_teacher_alone_has_no_score_to_normalise(tmp_path, tiny_llama_dir):
    _cfg_checked(tmp_path, tiny_llama_dir, "reward.overlong_buffer=5")
    _cfg_checked(tmp_path, tiny_llama_dir, "reward.overlong_buffer=11", *MULTI_TURN)
    with pytest.raises(ConfigError, match="reward.normalize_per_source normalises the score, and "
                                          "this run has none"):
        _cfg_checked(tmp_path, tiny_llama_dir, "reward.normalize_per_source=true", "reward.functions=[]",
                     f"reward.teacher={tiny_llama_dir}")


@pytest.fixture()
def mixture(tmp_path):
    """Two JSON-lines sources of review openings, weighted 1 to 1."""
    for name, word in (("films", "film"), ("shows", "show")):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": f"The {word} number {i} was"}) + "\n" for i in range(16)))
    return (f"data.sources=[{{source: {tmp_path / 'films.jsonl'}, weight: 1}}, "
            f"{{source: {tmp_path / 'shows.jsonl'}, weight: 1}}]")


SHAPING = ["reward.normalize_per_source=true", "reward.overlong_buffer=3"]


def test_recipe_on_a_mixture_shapes_and_normalises_each_score(tmp_path, stopping_llama_dir, mixture):
    """Two iterations of the recipe's trainer on a mixture, with a policy whose responses stop
    after 1-6 tokens: each row's score is its VADER score standardised by its source's
    statistics over every batch so far (a plain loop over the scores seen), plus the overlong
    penalty of its length; the metrics are logged and the checkpoint holds the statistics."""
    cfg = _cfg(tmp_path / "run", stopping_llama_dir, mixture, *SHAPING, "checkpoint.every=1",
               "eval.every=0")
    trainer = builders.build_trainer(cfg)
    seen, checked = {0: [], 1: []}, []

    def check(batch):
        raw = batch.get((K.REWARD_STATS, "unnormalized_score")).tolist()
        sources = batch.get((K.DATA, SOURCE_COLUMN)).tolist()
        lengths = batch.get(K.RESPONSE_MASK).sum(-1).tolist()
        for s, x in zip(sources, raw):
            seen[s].append(x)
        expected = [(x - statistics.fmean(seen[s])) / math.sqrt(statistics.pvariance(seen[s]) + 1e-8)
                    + dapo_eq13(n, 6, 3) for x, s, n in zip(raw, sources, lengths)]
        torch.testing.assert_close(batch.get(K.SCORE), torch.tensor(expected), atol=1e-5, rtol=1e-5)
        checked.append(sorted(set(lengths)))

    trainer.register_op("post_steps_log", check)
    trainer.fit()
    assert len(checked) == 2 and len({n for c in checked for n in c}) > 2  # lengths vary
    assert min(len(seen[0]), len(seen[1])) >= 2  # both sources, each more than once
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for name in ("reward/overlong_penalty", "reward/overlong_frac", "reward/truncated_frac",
                     "reward/unnormalized_score", "reward/source_mean/0", "reward/source_std/1"):
            assert math.isfinite(row[name]), name
        assert row["reward/overlong_penalty"] <= 0
    assert rows[-1]["reward/source_count/0"] + rows[-1]["reward/source_count/1"] == 8 == sum(
        len(v) for v in seen.values())
    (_, path), *_ = sorted(list_checkpoints(tmp_path / "run"), reverse=True)
    state = torch.load(f"{path}/trainer.pt", weights_only=True)["reward_transform"]
    counts = [v for k, v in state.items() if k.endswith(".count")]
    assert counts[0].tolist() == [len(seen[0]), len(seen[1])]


def test_resumed_run_with_normalisation_matches_the_uninterrupted_run(tmp_path, tiny_llama_dir,
                                                                      mixture):
    """The running statistics come back from the checkpoint: a run stopped after iteration 2 and
    resumed logs the rows (each source's running mean, std and count among them) of the run
    that went on."""
    overrides = [*EXACT, mixture, *SHAPING, "eval.every=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    ppo.train(_cfg(whole, tiny_llama_dir, *overrides))
    ppo.train(_cfg(cut, tiny_llama_dir, *overrides))
    expected = _rows(whole)
    assert len(expected) == 4 and expected[-1]["reward/source_count/0"] > 0
    _stop_at(cut, 2)
    ppo.train(_cfg(cut, tiny_llama_dir, *overrides))
    assert _rows(cut) == expected


def test_the_modules_compose_in_a_python_pipeline():
    """From Python, without the recipe: the transforms as the trainer's reward_transform, their
    statistics on post_steps_log."""
    transform = ScoreTransforms(PerSourceScoreNorm(["math", "chat"]), OverlongPenalty(8, 2))
    td = _with_sources([1.0, 3.0, 10.0, 30.0], [0, 0, 1, 1])
    td.set(K.RESPONSE_MASK, torch.arange(8).expand(4, 8) < torch.tensor([[2], [7], [8], [3]]))
    transform(td)
    assert torch.allclose(td.get(K.SCORE), torch.tensor([-1.0, 1.0 - 0.5, -1.0 - 1.0, 1.0]))
    assert transform.metrics(td)["reward/source_mean/chat"] == 20.0


def test_the_measurement_commands_pass_the_checks(tmp_path, capsys):
    """rlhf-torchrl bench overlong's runs (--dry-run prints them): each composes and passes the
    start-up checks; the shaped arm sets the buffer, the other none."""
    import shlex

    from rlhf_torchrl.benchmarks import overlong
    from rlhf_torchrl.config import compose

    assert overlong.main(["--seeds", "0", "1", "2", "--runs", str(tmp_path), "--dry-run"]) == {}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    buffers = []
    for line in lines:
        cfg = compose([w for w in shlex.split(line) if not w.startswith("hydra.")])
        checks.check_config(cfg)
        assert cfg.generation.max_new_tokens == 32 and cfg.data.source.startswith("reasoning_gym")
        buffers.append(cfg.reward.overlong_buffer)
    assert buffers == [None] * 3 + [8] * 3


def test_the_measurement_runs_end_to_end_on_a_tiny_model(tmp_path, tiny_llama_dir, capsys):
    """Both arms for 2 iterations with the tiny model (--extra): their table and plot."""
    from rlhf_torchrl.benchmarks import overlong

    extra = [f"model.policy={tiny_llama_dir}", "ppo.num_iterations=2", "ppo.batch_size=4",
             "ppo.forward_batch_size=4", "eval.num_prompts=4", "eval.every=1", "data.limit=16",
             "model.autocast=null", "optim.critic_warmup=0"]
    runs = overlong.main(["--seeds", "0", "--runs", str(tmp_path), "--max-new-tokens", "8",
                          "--buffer", "4", "--out", str(tmp_path / "curves.json"), "--extra", *extra])
    assert set(runs) == {"none", "overlong"}, capsys.readouterr().out
    shaped, plain = runs["overlong"][0], runs["none"][0]
    assert [x for x, _ in shaped["curve"]] == [0, 1, 2]
    assert shaped["penalty"][0] < 0 and plain["penalty"] == (0.0, 0.0)  # the tiny model rambles
    assert 0 <= shaped["truncated"][1] <= 1 and (tmp_path / "curves.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| overlong | 0 |" in table and "| none | 0 |" in table


def _normalise_on_rank(rank: int, folder: str) -> None:
    """One of two processes: its share of each batch (rows rank, rank + 2, ...) through a
    normaliser whose statistics sum over both."""
    import torch.distributed as dist

    from rlhf_torchrl.distributed import DataParallel

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
    try:
        norm = PerSourceScoreNorm(3, parallel=DataParallel(rank=rank, world_size=2))
        outs = []
        for scores, sources in _batches(seed=2):
            outs.append(norm(_with_sources(scores[rank::2], sources[rank::2])).get(K.SCORE))
        torch.save({"outs": outs, "state": norm.state_dict()}, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_hold_the_statistics_of_the_global_batch(tmp_path):
    """Under torchrun each process scores its rows; the statistics are the global batch's (the
    same on both processes, as one process normalising every row would hold them), and each row
    is normalised as that one process would normalise it."""
    torch.multiprocessing.spawn(_normalise_on_rank, args=(str(tmp_path),), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    one = PerSourceScoreNorm(3)
    for b, (scores, sources) in enumerate(_batches(seed=2)):
        whole = one(_with_sources(scores, sources)).get(K.SCORE)
        torch.testing.assert_close(ranks[0]["outs"][b], whole[0::2])
        torch.testing.assert_close(ranks[1]["outs"][b], whole[1::2])
    for rank in ranks:
        for name, value in one.state_dict().items():
            torch.testing.assert_close(rank["state"][name], value)
