"""Prompt loading and validation, and the generation env/collector on a real tokenizer."""

import json

import pytest
import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.data import (
    Prompt,
    check_prompts,
    load_prompts,
    polarity_sentences,
    prompt_token_ids,
    templated_length,
)
from rlhf_torchrl.modules import load_causal_lm, load_tokenizer


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _collect(model_dir, tokenizer, prompts, batch_size, **policy_kwargs):
    """One rollout from the real env + collector."""
    model = load_causal_lm(model_dir, tokenizer).eval()
    env = make_generation_env(prompts, tokenizer, batch_size=batch_size, shuffle=False)
    policy = make_generation_policy(model, tokenizer, max_new_tokens=3, **policy_kwargs)
    collector = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=batch_size)
    rollout = next(iter(collector))
    collector.shutdown()
    return rollout


def test_polarity_prompts():
    pairs = polarity_sentences()
    assert len(pairs) == 200 and {label for label, _ in pairs} == {"pos", "neg"}
    prompts = load_prompts("polarity", template="Review: {prompt}", limit=5, system_prompt="Be brief.")
    assert len(prompts) == 5 and all(p.text.startswith("Review: ") for p in prompts)
    assert prompts[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in prompts[0].messages] == ["system", "user"]


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"prompt": "there"}) + "\n")
    assert [p.text for p in load_prompts(str(path))] == ["hi", "there"]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "hi"}])
    with pytest.raises(ValueError, match="bad.jsonl:1.*'prompt' field"):
        load_prompts(bad)
    with pytest.raises(ValueError, match="\\{prompt\\}"):
        load_prompts(str(path), template="no placeholder")


def test_chat_rows_keep_the_conversation_up_to_the_last_user_turn(tmp_path):
    """A messages row keeps its system message and earlier turns; a trailing assistant turn is the
    reference answer, never the prompt."""
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation, "id": 7}])
    [prompt] = load_prompts(path, column="messages", system_prompt="ignored: the row has one")
    assert prompt.messages == conversation[:4]
    assert prompt.fields == {"reference_answer": "Blue.", "id": 7}
    no_user = _write_jsonl(tmp_path / "no_user.jsonl",
                           [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(ValueError, match="no_user.jsonl:1: the conversation has no user turn"):
        load_prompts(no_user, column="messages")
    not_a_message = _write_jsonl(tmp_path / "bad_msg.jsonl", [{"messages": [{"speaker": "me"}]}])
    with pytest.raises(ValueError, match="bad_msg.jsonl:1:.*not a chat message"):
        load_prompts(not_a_message, column="messages")


def test_hh_transcripts_become_conversations(tmp_path):
    """Anthropic HH rows ("\\n\\nHuman: ... \\n\\nAssistant: ...") are split into turns."""
    chosen = ("\n\nHuman: What is a good name for a cat?\n\nAssistant: Whiskers.\n\nHuman: "
              "Another one?\n\nAssistant: Mittens.")
    prompt_only = "\n\nHuman: Say hi.\n\nAssistant:"
    path = _write_jsonl(tmp_path / "hh.jsonl", [{"chosen": chosen, "rejected": "..."},
                                                {"chosen": prompt_only, "rejected": "..."}])
    first, second = load_prompts(path, column="chosen")
    assert first.messages == [
        {"role": "user", "content": "What is a good name for a cat?"},
        {"role": "assistant", "content": "Whiskers."},
        {"role": "user", "content": "Another one?"},
    ]
    assert first.fields == {"reference_answer": "Mittens.", "rejected": "..."}
    assert second.messages == [{"role": "user", "content": "Say hi."}]
    assert "reference_answer" not in second.fields


def test_conversations_are_rendered_by_the_template(tmp_path, tiny_llama_dir, tokenizer):
    """The env renders the whole kept conversation with the policy's template; the reference
    answer is not part of the prompt."""
    conversation = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."}]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 2)
    prompts = load_prompts(path, column="messages")
    rollout = _collect(tiny_llama_dir, tokenizer, prompts, batch_size=2)
    expected = tokenizer.apply_chat_template(conversation[:4], add_generation_prompt=True,
                                             tokenize=False)
    assert rollout.get(K.PROMPT_TEXT).tolist() == [expected, expected]
    assert "Blue." not in expected and "You are terse." in expected and "Hello." in expected
    assert rollout.get(K.PROMPT_MESSAGES).tolist() == [conversation[:4]] * 2


def test_prompt_length_check_and_left_truncation(tokenizer):
    long_prompt = "word " * 100
    short = "hello"
    limit = templated_length(tokenizer, short) + 10
    with pytest.raises(ValueError, match="Prompt 1 is .* tokens.*truncate_prompts"):
        check_prompts([short, long_prompt], tokenizer, max_prompt_length=limit)
    out, n = check_prompts([short, long_prompt], tokenizer, max_prompt_length=limit, truncate=True)
    assert n == 1 and out[0].text == short
    assert templated_length(tokenizer, out[1]) <= limit
    assert long_prompt.strip().endswith(out[1].text.strip())  # the end is kept
    with pytest.raises(ValueError, match="empty"):
        check_prompts([], tokenizer, max_prompt_length=30)


def test_rendered_prompts_get_one_bos(bos_llama_dir):
    """A template that writes BOS, a tokenizer that adds one: the policy reads exactly one, and the
    length check counts what the policy reads."""
    tokenizer = load_tokenizer(bos_llama_dir)
    bos = tokenizer.bos_token_id
    prompts = [Prompt([{"role": "user", "content": text}]) for text in ("hi", "a longer prompt here")]
    rollout = _collect(bos_llama_dir, tokenizer, prompts, batch_size=2)
    tokens, mask = rollout[K.PROMPT_TOKENS], rollout[K.PROMPT_MASK]
    for row, m, prompt in zip(tokens, mask, prompts):
        ids = row[m].tolist()
        assert ids.count(bos) == 1 and ids[0] == bos
        assert ids == prompt_token_ids(tokenizer, prompt)
        assert len(ids) == templated_length(tokenizer, prompt)


def test_dataset_fields_travel_into_the_rollout(tmp_path, tiny_llama_dir, tokenizer):
    """Every column but the prompt rides with its row: env, collector, rollout, in the right rows."""
    rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i), "level": i % 3}
            for i in range(8)]
    prompts = load_prompts(_write_jsonl(tmp_path / "math.jsonl", rows))
    model = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    env = make_generation_env(prompts, tokenizer, batch_size=4, seed=0)  # shuffled
    policy = make_generation_policy(model, tokenizer, max_new_tokens=2)
    collector = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=4, total_batches=2)
    seen = 0
    for rollout in collector:
        for text, messages, answer, level in zip(
                rollout.get(K.PROMPT_TEXT).tolist(), rollout.get(K.PROMPT_MESSAGES).tolist(),
                rollout.get((K.DATA, "answer")).tolist(), rollout.get((K.DATA, "level")).tolist()):
            i = int(messages[-1]["content"].split()[2])
            assert f"What is {i} plus {i}?" in text
            assert answer == str(2 * i) and level == i % 3
            seen += 1
    collector.shutdown()
    assert seen == 8


def test_collector_emits_dense_truncated_rollouts(tiny_llama_dir, tokenizer):
    torch.manual_seed(0)
    model = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    prompts = ["hi", "a much longer prompt with many more words in it", "ok", "four"]
    env = make_generation_env(prompts, tokenizer, batch_size=2)
    # stop on a frequent token so that truncation actually happens
    stop = [tokenizer.eos_token_id, *range(100, 20000)]
    policy = make_generation_policy(model, tokenizer, max_new_tokens=8, temperature=1.0,
                                    stop_token_ids=stop)
    collector = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=2,
                                 stop_token_ids=stop, total_batches=4)
    seen_prompts = []
    for rollout in collector:
        assert rollout.batch_size == (2,)
        pt, pm = rollout[K.PROMPT_TOKENS], rollout[K.PROMPT_MASK]
        rt, rm = rollout[K.RESPONSE_TOKENS], rollout[K.RESPONSE_MASK]
        assert pm[:, -1].all()  # left-padded
        assert (pt[~pm] == tokenizer.pad_token_id).all()
        assert (rt[~rm] == tokenizer.pad_token_id).all()  # pad after the stop token
        for row, mask, has_stop in zip(rt, rm, rollout[K.HAS_STOP]):
            n = int(mask.sum())
            assert mask[:n].all()  # right-padded, contiguous
            is_stop = torch.isin(row[:n], torch.tensor(stop))
            assert bool(has_stop) == bool(is_stop.any())
            if has_stop:
                assert is_stop[-1] and not is_stop[:-1].any()  # cut right after the first stop
        seen_prompts += rollout.get(K.PROMPT_TEXT).tolist()
    collector.shutdown()
    assert len(seen_prompts) == 8
    # every batch starts from fresh prompts (one turn per episode), never a previous response
    assert all(any(p in s for p in prompts) and s.count("<|im_start|>assistant") == 1 for s in seen_prompts)
    # rendered with the tokenizer's own chat template (SmolLM2's ChatML, default system prompt)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "ok"}],
                                             add_generation_prompt=True, tokenize=False)
    assert expected in seen_prompts


def test_hf_dataset_from_local_directory(tmp_path):
    """The hub code path (datasets.load_dataset) on a local directory in the same schema."""
    pytest.importorskip("datasets")
    (tmp_path / "train.jsonl").write_text(
        "\n".join(json.dumps({"query": f"q{i}", "other": i}) for i in range(3)) + "\n")
    prompts = load_prompts(str(tmp_path), split="train", column="query")
    assert [p.text for p in prompts] == ["q0", "q1", "q2"]
    assert [p.fields for p in prompts] == [{"other": 0}, {"other": 1}, {"other": 2}]
    with pytest.raises(ValueError, match="no column 'prompt'.*query"):
        load_prompts(str(tmp_path), split="train")


def test_a_users_env_transform_still_sees_every_step(tiny_llama_dir, tokenizer):
    """The one-turn collector skips the env's step only where it writes nothing a rollout keeps
    (make_generation_env's env): a transform a user appends to the env runs at every step, and
    the rollouts are the same either way."""
    from torchrl.envs import Transform

    class CountSteps(Transform):
        steps = 0

        def _step(self, tensordict, next_tensordict):
            CountSteps.steps += tensordict.numel()
            return next_tensordict

    model = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    prompts = ["hi", "a longer prompt", "ok", "four"]
    rollouts = []
    for extra in (None, CountSteps()):
        env = make_generation_env(prompts, tokenizer, batch_size=2, shuffle=False)
        if extra is not None:
            env = env.append_transform(extra)
        policy = make_generation_policy(model, tokenizer, max_new_tokens=3)
        collector = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=2, seed=0,
                                     total_batches=2)
        assert collector.collector.steps_env == (extra is not None)
        rollouts.append(list(collector))
        collector.shutdown()
    assert CountSteps.steps == 4
    for a, b in zip(*rollouts):
        assert torch.equal(a[K.RESPONSE_TOKENS], b[K.RESPONSE_TOKENS])
        assert a.get(K.PROMPT_TEXT).tolist() == b.get(K.PROMPT_TEXT).tolist()


def test_a_reward_that_edits_the_conversation_leaves_the_dataset_alone(tiny_llama_dir, tokenizer):
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], {"answer": [i]})
               for i in range(4)]
    rollout = _collect(tiny_llama_dir, tokenizer, prompts, 2)
    rollout.get(K.PROMPT_MESSAGES).tolist()[0][-1]["content"] = "edited"
    rollout.get((K.DATA, "answer")).tolist()[0].append(99)
    assert [p.messages[-1]["content"] for p in prompts] == [f"question {i}" for i in range(4)]
    assert [p.fields["answer"] for p in prompts] == [[i] for i in range(4)]
