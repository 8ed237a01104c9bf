"""Prompt loading and validation, the forms data comes in, mixtures, and the generation
env/collector on a real tokenizer."""

import itertools
import json

import pytest
import torch
from conftest import assert_same_rollouts

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.data import load_prompts
from rlhf_torchrl.data.prompts import (
    Prompt,
    check_prompts,
    polarity_sentences,
    prompt_token_ids,
    templated_length,
)
from rlhf_torchrl.errors import ConfigError
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


def test_a_plain_chat_template_gives_the_text_to_continue(tmp_path, tiny_llama_dir):
    """data.chat_template=plain: the policy reads the prompt's text as it is (no roles, no
    markers), in the trainer and in a Ray worker's tokenizer; a Jinja string is used as given."""
    from rlhf_torchrl.config import components, compose

    cfg = compose([f"output_dir={tmp_path}", f"model.policy={tiny_llama_dir}",
                   "data.chat_template=plain", "data.system_prompt=null"])
    tokenizer = components.make_tokenizer(cfg)
    assert components.collector_spec(cfg, [tokenizer.eos_token_id]).chat_template == "plain"
    prompts = load_prompts("polarity", template="{prompt}", max_words=4, limit=2)
    rollout = _collect(tiny_llama_dir, tokenizer, prompts, batch_size=2)
    assert rollout.get(K.PROMPT_TEXT).tolist() == [p.text for p in prompts]
    custom = load_tokenizer(tiny_llama_dir, chat_template="{{ messages[-1]['content'] }} =>")
    rendered = custom.apply_chat_template([{"role": "user", "content": "2 + 2"}], tokenize=False)
    assert rendered == "2 + 2 =>"


def test_a_stop_token_ends_responses_beside_eos(tmp_path, tiny_llama_dir):
    """generation.stop_token adds a stop to the tokenizer's EOS (a sentence ends at "."; a
    response that emits EOS first still ends there)."""
    from rlhf_torchrl.config import components, compose

    cfg = compose([f"output_dir={tmp_path}", f"model.policy={tiny_llama_dir}"])
    tokenizer = components.make_tokenizer(cfg)
    assert components.stop_token_ids(cfg, tokenizer) == [tokenizer.eos_token_id]
    cfg.generation.stop_token = "."
    period = tokenizer.convert_tokens_to_ids(".")
    assert components.stop_token_ids(cfg, tokenizer) == [period, tokenizer.eos_token_id]


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
                                     total_batches=2, dense=False)
        assert collector.collector.steps_env == (extra is not None)
        rollouts.append(list(collector))
        collector.shutdown()
    assert CountSteps.steps == 4
    for a, b in zip(*rollouts):
        assert torch.equal(a[K.RESPONSE_TOKENS], b[K.RESPONSE_TOKENS])
        assert a.get(K.PROMPT_TEXT).tolist() == b.get(K.PROMPT_TEXT).tolist()


@pytest.mark.parametrize("model_fixture, group, system_prompt, value_head", [
    ("stopping_llama_dir", 1, None, False),  # SmolLM2's chat template, responses that stop
    ("tiny_llama_dir", 2, "Be brief.", True),  # groups, a system message, values recorded
    ("bos_llama_dir", 1, None, False),  # a template that writes BOS (nothing added on top)
    ("tiny_gpt2_dir", 1, "Be kind.", False),  # learned positions
])
def test_the_dense_one_turn_path_collects_what_torchrls_env_collects(
        request, model_fixture, group, system_prompt, value_head, tokenizer):
    """RolloutCollector's dense path (make_generation_env's env and make_generation_policy's
    policy: no env reset or wrapper objects per batch) yields the rollouts of TorchRL's
    LLMCollector over the env, key for key, over batches that cross an epoch of the loader, with
    groups, a system prompt, left padding, responses that stop early and recorded log-probs,
    entropies and values; a user's env transform, or dense=False, takes TorchRL's path."""
    from torchrl.envs import Transform

    folder = request.getfixturevalue(model_fixture)
    tok = tokenizer if model_fixture != "bos_llama_dir" else load_tokenizer(folder)
    model = load_causal_lm(folder, tok).eval()
    head = torch.nn.Linear(model.config.hidden_size, 1) if value_head else None
    prompts = [Prompt([{"role": "user", "content": f"Prompt {i} " + "word " * (i % 4)}],
                      {"answer": [i], "tag": f"t{i}"}) for i in range(6)]
    prompts[3] = "a plain user message"
    rollouts = {}
    for dense in (None, False):
        env = make_generation_env(prompts, tok, batch_size=4, seed=1, samples_per_prompt=group,
                                  system_prompt=system_prompt)
        policy = make_generation_policy(model, tok, max_new_tokens=5, temperature=1.3,
                                        record_log_probs=True, record_entropy=True,
                                        samples_per_prompt=group, value_head=head)
        collector = RolloutCollector(env, policy, tokenizer=tok, seed=0, total_batches=4,
                                     samples_per_prompt=group, dense=dense)
        assert (collector.collector is None) == (dense is None)
        rollouts[dense] = list(collector)
        collector.shutdown()
    assert len(rollouts[None]) == 4
    stopped = 0
    for a, b in zip(rollouts[None], rollouts[False], strict=True):
        assert_same_rollouts(a, b)
        assert a.get(K.PROMPT_MASK).sum(-1).unique().numel() > 1  # left padding
        stopped += int(a.get(K.HAS_STOP).sum())
    assert stopped > 0 or model_fixture != "stopping_llama_dir"
    if model_fixture == "tiny_gpt2_dir":
        assert rollouts[None][0].get(K.PROMPT_TEXT).tolist()[0].count("Be kind.") == 1

    class Mark(Transform):
        def _reset(self, tensordict, tensordict_reset):
            return tensordict_reset

    env = make_generation_env(prompts, tok, batch_size=4).append_transform(Mark())
    policy = make_generation_policy(model, tok, max_new_tokens=5)
    assert RolloutCollector(env, policy, tokenizer=tok).collector is not None
    with pytest.raises(ConfigError, match="dense=True"):
        RolloutCollector(env, policy, tokenizer=tok, dense=True)


def test_a_reward_that_edits_the_conversation_leaves_the_dataset_alone(tiny_llama_dir, tokenizer):
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], {"answer": [i]})
               for i in range(4)]
    rollout = _collect(tiny_llama_dir, tokenizer, prompts, 2)
    rollout.get(K.PROMPT_MESSAGES).tolist()[0][-1]["content"] = "edited"
    rollout.get((K.DATA, "answer")).tolist()[0].append(99)
    assert [p.messages[-1]["content"] for p in prompts] == [f"question {i}" for i in range(4)]
    assert [p.fields["answer"] for p in prompts] == [[i] for i in range(4)]


# ---- the forms data comes in ---------------------------------------------------------------------
def _rows(n: int = 64) -> list[dict]:
    return [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(n)]


def verl_rows(rows: list[dict]) -> list[dict]:
    """``rows`` as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["prompt"]}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"]},
             "extra_info": {"split": "train", "index": i}} for i, r in enumerate(rows)]


def write_forms(folder, rows: list[dict]) -> dict[str, str]:
    """``rows`` in every form a user may bring: {form: data.source}."""
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_list(rows)
    (folder / "shards").mkdir()
    ds.select(range(0, 40)).to_parquet(str(folder / "shards" / "train-00000-of-00002.parquet"))
    ds.select(range(40, len(ds))).to_parquet(str(folder / "shards" / "train-00001-of-00002.parquet"))
    ds.to_parquet(str(folder / "p.parquet"))
    ds.to_csv(str(folder / "p.csv"), index=False)
    ds.to_pandas().to_csv(folder / "p.tsv", sep="\t", index=False)
    ds.save_to_disk(str(folder / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(folder / "saved_dict"))
    (folder / "hub_layout").mkdir()
    _write_jsonl(folder / "hub_layout" / "train.jsonl", rows)
    (folder / "p.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(verl_rows(rows)).to_parquet(str(folder / "verl.parquet"))
    return {"jsonl": _write_jsonl(folder / "p.jsonl", rows), "json": str(folder / "p.json"),
            "parquet": str(folder / "p.parquet"), "parquet-folder": str(folder / "shards"),
            "parquet-glob": str(folder / "shards" / "train-*.parquet"),
            "csv": str(folder / "p.csv"), "tsv": str(folder / "p.tsv"),
            "save_to_disk": str(folder / "saved"), "save_to_disk-dict": str(folder / "saved_dict"),
            "hub-layout-folder": str(folder / "hub_layout"), "verl": str(folder / "verl.parquet")}


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    pytest.importorskip("datasets")
    return write_forms(tmp_path_factory.mktemp("forms"), _rows())


def test_every_form_serves_the_same_first_batch(forms, tokenizer):
    """The same 64 prompts in each form: one reader each (Arrow for all but the JSON forms), the
    same prompts and answers, the same first batch from the generation env (its reset: the
    conversations, the rendered prompts and the fields a reward reads)."""
    from rlhf_torchrl.data.readers import source_form

    assert {name: source_form(path) for name, path in forms.items()} == {
        "jsonl": "jsonl", "json": "json", "parquet": "parquet", "parquet-folder": "parquet",
        "parquet-glob": "parquet", "csv": "csv", "tsv": "tsv", "save_to_disk": "saved",
        "save_to_disk-dict": "saved", "hub-layout-folder": "folder", "verl": "parquet"}
    first = {}
    for name, source in forms.items():
        # the GSM8K preset's column and template: verl's rows hold the prompt as written
        prompts = load_prompts(source, column="question" if name == "verl" else "prompt")
        assert len(prompts) == 64 and prompts[5].text == "What is 5 plus 5?", name
        assert (prompts.table.arrow is None) == (name in ("jsonl", "json")), name
        env = make_generation_env(prompts, tokenizer, batch_size=8, seed=3)
        batch = env.reset()
        first[name] = (batch.get("query").tolist(), batch.get(("text", "prompt")).tolist(),
                       [str(f["answer"]) for f in batch.get("fields").tolist()])  # CSV: ints
    assert all(batch == first["jsonl"] for batch in first.values()), first
    messages, _, answers = first["jsonl"]
    assert [2 * int(m[-1]["content"].split()[2]) for m in messages] == [int(a) for a in answers]


#: the tiniest run of the recipe's path: 2 iterations of 4 responses of 2 tokens, no evaluation,
#: checkpoint, saved policy or tracker
TWO_TINY_ITERATIONS = [
    "task=custom", "reward.functions=[rlhf_torchrl.rewards.functions.gsm8k_correct]",
    # a signal whatever the 2-token answers: the verifier alone gave every row 0 (and the fresh
    # value head 0 values), so nothing moved on some seeds of sampling
    "reward.missing_eos_penalty=1.0",
    "ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=1",
    "ppo.forward_batch_size=4", "generation.max_new_tokens=2", "optim.lr=1e-3", "eval.every=0",
    "checkpoint.every=0", "logging.save_model=false", "logging.logger=null",
    "logging.progress_bar=false", "model.autocast=null", "reuse_freed_memory=false", "threads=1"]


def test_every_form_trains_two_iterations_from_the_same_first_batch(forms, tiny_llama_dir,
                                                                    tmp_path):
    """Each form as a user gives it, the same command for all (`task=custom data.source=...`, the
    GSM8K verifier reading the answer column; verl's rows: their chat prompt and ground truth as
    written), through the recipe's path, build_trainer then fit, in this process: two PPO
    iterations with finite metrics and moved weights, the first rollout the same prompts and
    answers whatever the form."""
    import math

    from rlhf_torchrl.config import builders, compose

    first = {}
    for name, source in forms.items():
        out = tmp_path / name
        cfg = compose([f"output_dir={out}", f"model.policy={tiny_llama_dir}",
                       f"data.source={source}", *TWO_TINY_ITERATIONS])
        trainer = builders.build_trainer(cfg)

        def record(rollout, name=name):
            if name not in first:
                first[name] = (rollout.get(K.PROMPT_MESSAGES).tolist(),
                               rollout.get(K.PROMPT_TEXT).tolist(),
                               [str(a) for a in rollout.get((K.DATA, "answer")).tolist()])

        trainer.register_op("batch_process", record)
        before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
        report = trainer.fit()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert report["iterations"] == 2 and len(rows) == 2, name
        for row in rows:
            for metric in ("objective/kl", "objective/scores", "loss/policy_avg", "loss/value_avg"):
                assert math.isfinite(row[metric]), (name, metric)
        after = trainer.actor.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), name
    assert all(batch == first["jsonl"] for batch in first.values()), first
    messages, _, answers = first["jsonl"]
    assert len(messages) == 4
    assert [2 * int(m[-1]["content"].split()[2]) for m in messages] == [int(a) for a in answers]


def test_a_large_parquet_is_read_lazily_and_held_out_reproducibly(tmp_path, tokenizer, monkeypatch):
    """An Arrow source costs no rows until a batch serves them (data.check_prompts=served): the
    set is made, its columns checked, the held-out prompts carved out (the last rows), and the
    first batch served while reading that batch's rows alone."""
    import datasets

    datasets.Dataset.from_list(_rows(2000)).to_parquet(str(tmp_path / "big.parquet"))
    reads, read = [], datasets.Dataset.__getitem__
    monkeypatch.setattr(datasets.Dataset, "__getitem__",
                        lambda self, key: reads.append(key) or read(self, key))
    prompts = load_prompts(str(tmp_path / "big.parquet"), template="Q: {prompt}", check=False)
    train, held_out = prompts.hold_out(16)
    assert (len(train), len(held_out)) == (1984, 16) and reads == []
    make_generation_env(train, tokenizer, batch_size=8, seed=0).reset()
    assert len(reads) == 8 and all(0 <= i < 1984 for i in reads)
    assert [p.text for p in held_out] == [f"Q: What is {i} plus {i}?" for i in range(1984, 2000)]


def test_column_mapping_chat_columns_and_verl_rows(tmp_path, forms):
    """data.column picks the prompt column in any form (a chat column of messages lists
    included), every other column travels as a field; verl's rows give their ground truth as
    the fields ground_truth and answer, which the GSM8K verifier reads."""
    import datasets

    from rlhf_torchrl.rewards.functions import gsm8k_correct

    chats = [{"messages": [{"role": "system", "content": "Be terse."},
                           {"role": "user", "content": f"Say {i}."},
                           {"role": "assistant", "content": f"{i}"}], "id": i} for i in range(4)]
    datasets.Dataset.from_list(chats).to_parquet(str(tmp_path / "chats.parquet"))
    prompts = load_prompts(str(tmp_path / "chats.parquet"), column="messages")
    assert prompts[2].messages == chats[2]["messages"][:2]
    assert prompts[2].fields == {"id": 2, "reference_answer": "2"}
    gsm8k_template = "{prompt} Let's think step by step and output the final answer after \"####\"."
    verl = load_prompts(forms["verl"], column="question", template=gsm8k_template)
    assert verl[3].messages == [{"role": "user", "content": "What is 3 plus 3?"}]  # as written
    assert (verl[3].fields["ground_truth"], verl[3].fields["answer"]) == ("6", "6")
    assert verl[3].fields["extra_info"] == {"split": "train", "index": 3}
    assert gsm8k_correct([""] * 2, ["so #### 6", "#### 7"], answer=[verl[3].fields["answer"]] * 2) == [1.0, 0.0]
    # the prompt column named: the template applies to verl's messages like any other's
    templated = load_prompts(forms["verl"], column="prompt", template="Q: {prompt}")
    assert templated[3].text == "Q: What is 3 plus 3?" and templated[3].fields["answer"] == "6"


def test_mixture_batches_are_reproducible_resumable_and_weighted():
    """Each slot's source is drawn by weight, each source serves its own shuffled order: the same
    seed gives the same batches, a skip (a resumed run) gives the uninterrupted run's next ones,
    ranks split each global batch, and the proportions are the weights'."""
    from rlhf_torchrl.data.prompt_sets import MixtureBatchSampler, apportion

    def batches(n, **kwargs):
        sampler = MixtureBatchSampler([100, 10], [3.0, 1.0], 8, **kwargs)
        return list(itertools.islice((b for _ in itertools.count() for b in sampler), n))

    whole = batches(200, seed=0)
    assert whole == batches(200, seed=0) and whole != batches(200, seed=1)
    assert batches(190, seed=0, skip=10) == whole[10:]
    assert all(len(b) == 8 and 0 <= min(b) and max(b) < 110 for b in whole)
    small = [i for b in whole for i in b if i >= 100]
    assert abs(len(small) / (8 * 200) - 0.25) < 0.04
    assert sorted(small[:10]) == list(range(100, 110))  # a whole pass of the small set first
    ranks = [batches(5, seed=0, rank=r, world_size=2, repeats=2) for r in (0, 1)]
    for k in range(5):
        assert ranks[0][k] + ranks[1][k] == [i for i in whole[k] for _ in range(2)]
    assert apportion(5, [3, 1]) == [4, 1] and apportion(8, [1, 1, 1]) == [3, 3, 2]


def test_a_mixture_serves_both_sources_and_holds_out_by_weight(forms, tokenizer):
    """A mixture of a Parquet and a JSON-lines source through the generation env: batches draw
    from both, a later start_batch continues the same order, the held-out prompts are the last
    rows of each source, shared by weight."""
    from rlhf_torchrl.data.prompt_sets import PromptMixture

    math = load_prompts(forms["parquet"], template="Math: {prompt}")
    chat = load_prompts(forms["jsonl"], template="Chat: {prompt}")
    train, held_out = PromptMixture([math, chat], [3, 1]).hold_out(8)
    assert train.sizes == [58, 62] and [p.text[:4] for p in held_out] == ["Math"] * 6 + ["Chat"] * 2
    assert held_out[0].text == "Math: What is 58 plus 58?"

    def served(start_batch, n):
        env = make_generation_env(train, tokenizer, batch_size=8, seed=0, start_batch=start_batch)
        return [[m[-1]["content"] for m in env.reset().get("query").tolist()] for _ in range(n)]

    texts = served(0, 4)
    assert {t[:4] for batch in texts for t in batch} == {"Math", "Chat"}
    assert served(2, 2) == texts[2:]
