"""Multi-turn episodes with tools, on a tiny Llama taught to call the calculator (conftest)."""

import pytest
import torch
from conftest import PLAIN_QUESTION, TOOL_CALL, TOOL_QUESTION

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import (
    MultiTurnCollector,
    RolloutCollector,
    make_generation_env,
    make_generation_policy,
)
from rlhf_torchrl.collectors.on_policy import check_on_policy
from rlhf_torchrl.data.rollout import END_REASONS
from rlhf_torchrl.envs.tools import ToolResult, calculator
from rlhf_torchrl.modules import TokenLevelActor, load_causal_lm, make_critic

PROMPTS = [TOOL_QUESTION, PLAIN_QUESTION] * 4
T = 0.5  # the taught answers, nearly surely (at 1.0 a row strays about once in ten)


def _collect(model, tokenizer, tools, *, batch_size=8, world_size=1, max_turns=3, critic=None,
             max_tokens=None, batches=1, prompts=PROMPTS):
    """Each process's batches (``tools``: one dict for all, or a list of one per process)."""
    out = []
    for rank in range(world_size):
        local = batch_size // world_size
        env = make_generation_env(prompts, tokenizer, batch_size=batch_size, shuffle=False,
                                  rank=rank, world_size=world_size)
        policy = make_generation_policy(model, tokenizer, max_new_tokens=16, temperature=T,
                                        record_log_probs=True,
                                        value_head=None if critic is None else critic.head)
        first = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=local, seed=5,
                                 row_offset=rank * local, total_batches=batches)
        collector = MultiTurnCollector(first, policy, tokenizer=tokenizer,
                                       tools=tools[rank] if isinstance(tools, list) else tools,
                                       max_turns=max_turns, max_new_tokens=16, max_tokens=max_tokens)
        out.append(list(collector))
        collector.shutdown()
    return out


def test_an_episode_is_one_sequence_with_the_tools_output_masked(tool_llama_dir, tokenizer):
    """The calculator rows take two turns: call, tool message, answer. Their policy tokens keep
    the log-probs and values recorded while sampling (the on-policy check recomputes them over
    the whole sequence, tool output attended to); the tool's tokens are observations only."""
    model = load_causal_lm(tool_llama_dir, tokenizer)
    critic = make_critic(policy=model, tokenizer=tokenizer, init="shared")
    torch.nn.init.normal_(critic.head.weight)
    (rollouts,) = _collect(model, tokenizer, {"calculator": calculator}, critic=critic)
    rollout = rollouts[0]
    policy, observed = rollout.get(K.RESPONSE_MASK), rollout.get(K.OBSERVATION_MASK)
    assert not (policy & observed).any()
    texts = rollout.get(K.RESPONSE_TEXT).tolist()
    turns = rollout.get(K.TURNS).tolist()
    called = [i for i, t in enumerate(texts) if TOOL_CALL in t]
    assert len(called) >= 3, texts  # the taught behaviour, nearly always
    for i in range(rollout.shape[0]):
        attended = policy[i] | observed[i]
        assert attended[: int(attended.sum())].all()  # one contiguous sequence, right-padded
        if i in called:
            assert turns[i] == 2 and rollout.get(K.TOOL_CALLS)[i] == 1
            assert END_REASONS[rollout.get(K.EPISODE_END)[i]] == "answer"
            seen = tokenizer.decode(rollout.get(K.RESPONSE_TOKENS)[i][observed[i]])
            assert seen.startswith("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"), seen
            assert "The answer is 5" in texts[i]
        elif PLAIN_QUESTION in rollout.get(K.PROMPT_TEXT).tolist()[i]:
            assert turns[i] == 1 and not observed[i].any()
    for key in (K.LOG_PROB, K.VALUE):
        values = rollout.get(key).reshape(policy.shape)
        assert (values[~policy] == 0).all()
    assert (rollout.get(K.VALUE).squeeze(-1)[policy] != 0).all()  # recorded on every turn
    assert (rollout.get(K.LOG_PROB)[policy] <= 0).all()
    actor = TokenLevelActor(model, temperature=T, trunk_critic=critic)
    stats = check_on_policy(rollout, actor, num_rows=8, atol=1e-4, critic=critic)
    assert stats["tokens"] == int(policy.sum()) and stats["value_max_abs_diff"] < 1e-4


def failing(expression: str) -> str:
    raise RuntimeError("the calculator is broken")


def slow(expression: str) -> str:
    import time

    time.sleep(2)
    return "5"


def submit(expression: str) -> ToolResult:
    return ToolResult("submitted", reward=0.5, stop=True)


@pytest.mark.parametrize("tool, says", [(failing, "Error: calculator failed: RuntimeError"),
                                        (slow, "did not answer within 0.3 s")])
def test_a_tool_that_raises_or_hangs_becomes_its_message(tool_llama_dir, tokenizer, tool, says):
    model = load_causal_lm(tool_llama_dir, tokenizer)
    env = make_generation_env(PROMPTS[:2], tokenizer, batch_size=2, shuffle=False)
    policy = make_generation_policy(model, tokenizer, max_new_tokens=16, temperature=T,
                                    record_log_probs=True)
    first = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=2, seed=5, total_batches=1)
    collector = MultiTurnCollector(first, policy, tokenizer=tokenizer, tools={"calculator": tool},
                                   max_turns=2, max_new_tokens=16, tool_timeout=0.3)
    (rollout,) = list(collector)
    observed = rollout.get(K.OBSERVATION_MASK)[0]
    assert says in tokenizer.decode(rollout.get(K.RESPONSE_TOKENS)[0][observed])
    assert rollout.get(K.TOOL_ERRORS)[0] == 1 and rollout.get(K.TURNS)[0] == 2


def test_tool_rewards_land_on_the_turn_and_a_tool_can_end_the_episode(tool_llama_dir, tokenizer):
    model = load_causal_lm(tool_llama_dir, tokenizer)
    (rollouts,) = _collect(model, tokenizer, {"calculator": submit})
    rollout = rollouts[0]
    assert any(TOOL_CALL in text for text in rollout.get(K.RESPONSE_TEXT).tolist())
    for i, text in enumerate(rollout.get(K.RESPONSE_TEXT).tolist()):
        reward = rollout.get(K.TURN_REWARD)[i]
        if TOOL_CALL in text:
            last = int(rollout.get(K.RESPONSE_MASK)[i].nonzero().max())
            assert reward[last] == 0.5 and reward.sum() == 0.5
            assert END_REASONS[rollout.get(K.EPISODE_END)[i]] == "tool_stop"
            assert rollout.get(K.TURNS)[i] == 1 and not rollout.get(K.OBSERVATION_MASK)[i].any()
        else:
            assert reward.sum() == 0


def test_turn_and_token_budgets_end_episodes(tool_llama_dir, tokenizer):
    model = load_causal_lm(tool_llama_dir, tokenizer)
    (one,) = _collect(model, tokenizer, {"calculator": calculator}, max_turns=1)
    ends = [END_REASONS[e] for e in one[0].get(K.EPISODE_END).tolist()]
    assert "max_turns" in ends and not one[0].get(K.OBSERVATION_MASK).any()
    (tight,) = _collect(model, tokenizer, {"calculator": calculator}, max_tokens=20)
    ends = [END_REASONS[e] for e in tight[0].get(K.EPISODE_END).tolist()]
    assert "max_tokens" in ends
    width = (tight[0].get(K.RESPONSE_MASK) | tight[0].get(K.OBSERVATION_MASK)).sum(-1)
    assert int(width.max()) <= 20


def test_two_processes_sample_the_episodes_one_does(tool_llama_dir, tokenizer):
    """Every turn of every row has its own stream (row, batch, turn): 2 processes' shards are the
    1-process batch, token for token, whichever rows go on to a second turn."""
    model = load_causal_lm(tool_llama_dir, tokenizer)
    (whole,) = _collect(model, tokenizer, {"calculator": calculator}, batches=2)
    shards = _collect(model, tokenizer, {"calculator": calculator}, world_size=2, batches=2)
    for k, batch in enumerate(whole):
        for rank in range(2):
            part = shards[rank][k]
            rows = batch[4 * rank : 4 * rank + 4]
            assert part.get(K.RESPONSE_TEXT).tolist() == rows.get(K.RESPONSE_TEXT).tolist()
            width = part.get(K.RESPONSE_MASK).shape[1]
            torch.testing.assert_close(rows.get(K.LOG_PROB)[:, :width], part.get(K.LOG_PROB))


def scripted(*replies: str) -> dict:
    """A calculator that answers its calls with ``replies``, in the order they come."""
    answers = iter(replies)
    return {"calculator": lambda expression: next(answers)}


def test_each_row_keeps_its_own_token_budget(tool_llama_dir, tokenizer):
    """Two calculator episodes (call: 15 tokens; tool message "5": 11; answer: 7) under
    max_tokens=43. The first row's tool answers at length (26 tokens), leaving its episode 2: it
    is cut there, mid-answer. The second row, sampled beside it, still gives the whole answer it
    gives alone (rank 1 of 2), token for token; the cut row's recorded log-probs and values are
    those of its kept tokens."""
    model = load_causal_lm(tool_llama_dir, tokenizer)
    critic = make_critic(policy=model, tokenizer=tokenizer, init="shared")
    torch.nn.init.normal_(critic.head.weight)
    long_reply = "5 " * 8
    settings = dict(batch_size=2, max_tokens=43, critic=critic, prompts=[TOOL_QUESTION] * 2)
    ((together,),) = _collect(model, tokenizer, scripted(long_reply, "5"), **settings)
    (_, (alone,)) = _collect(model, tokenizer, [scripted(long_reply), scripted("5")],
                             world_size=2, **settings)
    ends = [END_REASONS[e] for e in together.get(K.EPISODE_END).tolist()]
    width = (together.get(K.RESPONSE_MASK) | together.get(K.OBSERVATION_MASK)).sum(-1).tolist()
    assert ends == ["max_tokens", "answer"] and width == [43, 33], (ends, width)
    assert together.get(K.HAS_STOP).tolist() == [False, True]
    texts = together.get(K.RESPONSE_TEXT).tolist()
    assert texts[1] == alone.get(K.RESPONSE_TEXT).tolist()[0] and texts[1].endswith("is 5.")
    # the rewards read the policy's own turns: the tool's "5 5 ..." before the cut answer is no
    # answer of the policy's (a last-number verifier would credit it); the transcript keeps it
    assert TOOL_CALL in texts[0] and long_reply.strip() not in texts[0]
    assert long_reply.strip() in together.get(K.EPISODE_TEXT).tolist()[0]
    for key in (K.RESPONSE_TOKENS, K.RESPONSE_MASK, K.OBSERVATION_MASK):
        assert torch.equal(together.get(key)[1, :33], alone.get(key)[0, :33]), key
    for key in (K.LOG_PROB, K.VALUE):  # up to the rounding of another batch's padding
        torch.testing.assert_close(together.get(key)[1, :33], alone.get(key)[0, :33],
                                   atol=1e-4, rtol=1e-4)
    policy = together.get(K.RESPONSE_MASK)
    assert (together.get(K.LOG_PROB)[~policy] == 0).all() and policy[0].sum() == 15 + 2
    actor = TokenLevelActor(model, temperature=T, trunk_critic=critic)
    stats = check_on_policy(together, actor, num_rows=2, atol=1e-4, critic=critic)
    assert stats["tokens"] == int(policy.sum()) and stats["value_max_abs_diff"] < 1e-4


def says_five(prompts, responses):
    """1 where the episode's last turn says the answer."""
    return [1.0 if response.rstrip().endswith("The answer is 5.") else 0.0 for response in responses]


def episode_settings(tmp_path) -> list[str]:
    """The recipe's overrides for calculator episodes on the taught tiny Llama's questions."""
    import json

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in PROMPTS * 2))
    return [f"data.source={data}", "data.template=null", "data.max_words=null",
            "data.system_prompt=null", "data.chat_template=null", "env.max_turns=3",
            "env.tools=[calculator]",
            "env.describe_tools=false", "generation.max_new_tokens=16",
            "reward.functions=[test_multiturn.says_five]", f"generation.temperature={T}",
            "optim.lr=1e-5"]


def test_recipe_trains_on_episodes_with_tools_and_resumes_exactly(tmp_path, tool_llama_dir):
    """The recipe with env.tools: episode metrics in every row and in the evaluation; the
    on-policy check passes on multi-turn rows; a run resumed from its first checkpoint continues
    as the uninterrupted run."""
    import json

    from test_recipe import _cfg, ppo
    from test_resume import _rows, _stop_at

    settings = [*episode_settings(tmp_path), "eval.every=2", "eval.num_prompts=4",
                "ppo.num_iterations=3", "checkpoint.every=1", "checkpoint.keep=null"]
    report = ppo.train(_cfg(tmp_path / "whole", tool_llama_dir, *settings))
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/turns_per_episode"] >= 1 and "env/end_max_turns" in r for r in rows)
    assert rows[0]["env/turns_per_episode"] > 1 and rows[0]["env/observation_tokens"] > 0
    assert rows[0]["env/tool_calls_per_episode"] > 0 and rows[0]["objective/scores"] > 0
    assert report["eval_before"]["eval/turns_per_episode"] > 1
    assert (tmp_path / "whole" / "plots" / "episodes.png").stat().st_size > 0  # in report.html
    assert "eval/tool_calls_per_episode" in report["eval_after"]
    cut = tmp_path / "cut"
    ppo.train(_cfg(cut, tool_llama_dir, *settings))
    _stop_at(cut, 1)
    ppo.train(_cfg(cut, tool_llama_dir, *settings))
    assert _rows(cut) == _rows(tmp_path / "whole")


def test_episodes_sampled_ahead_are_the_synchronous_runs_at_overlap_zero(tmp_path, tool_llama_dir):
    """collection.overlap=0 with tools: the background sampler runs whole episodes (tool calls
    included) and the run's metrics are the synchronous run's."""
    from test_async import _comparable, _run

    settings = episode_settings(tmp_path)
    sync = _run(tmp_path / "sync", tool_llama_dir, *settings)
    overlapped = _run(tmp_path / "async", tool_llama_dir, *settings, "collection.overlap=0")
    assert sync[0]["env/tool_calls_per_episode"] > 0
    assert [_comparable(m) for m in overlapped] == [_comparable(m) for m in sync]
