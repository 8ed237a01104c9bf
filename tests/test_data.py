"""Prompt loading and validation, and the generation env/collector on a real tokenizer."""

import json

import pytest
import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.data import check_prompts, load_prompts, polarity_sentences, templated_length
from rlhf_torchrl.modules import load_causal_lm


def test_polarity_prompts():
    pairs = polarity_sentences()
    assert len(pairs) == 200 and {label for label, _ in pairs} == {"pos", "neg"}
    prompts = load_prompts("polarity", template="Review: {prompt}", limit=5)
    assert len(prompts) == 5 and all(p.startswith("Review: ") for p in prompts)


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"prompt": "there"}) + "\n")
    assert load_prompts(str(path)) == ["hi", "there"]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    assert load_prompts(str(chat), column="messages") == ["hello"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*'prompt' field"):
        load_prompts(str(bad))
    with pytest.raises(ValueError, match="\\{prompt\\}"):
        load_prompts(str(path), template="no placeholder")


def test_prompt_length_check_and_left_truncation(tokenizer):
    long_prompt = "word " * 100
    short = "hello"
    limit = templated_length(tokenizer, short) + 10
    with pytest.raises(ValueError, match="Prompt 1 is .* tokens.*truncate_prompts"):
        check_prompts([short, long_prompt], tokenizer, max_prompt_length=limit)
    out, n = check_prompts([short, long_prompt], tokenizer, max_prompt_length=limit, truncate=True)
    assert n == 1 and out[0] == short
    assert templated_length(tokenizer, out[1]) <= limit
    assert long_prompt.strip().endswith(out[1].strip())  # the end is kept
    with pytest.raises(ValueError, match="empty"):
        check_prompts([], tokenizer, max_prompt_length=30)


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
    assert load_prompts(str(tmp_path), split="train", column="query") == ["q0", "q1", "q2"]
    with pytest.raises(ValueError, match="no column 'prompt'.*query"):
        load_prompts(str(tmp_path), split="train")
