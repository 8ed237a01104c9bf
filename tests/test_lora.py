"""LoRA through PEFT: the reference is the policy with adapters off, only adapters train."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs the [peft] extra")

from rlhf_torchrl import keys as K  # noqa: E402
from rlhf_torchrl.modules import TokenLevelActor, load_causal_lm, make_critic  # noqa: E402
from rlhf_torchrl.modules.lora import add_lora  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_recipe import _cfg, ppo  # noqa: E402


def _batch():
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, :2] = False  # left padding
    return TensorDict({K.PROMPT_TOKENS: torch.randint(10, 1000, (3, 5), generator=g),
                       K.PROMPT_MASK: mask,
                       K.RESPONSE_TOKENS: torch.randint(10, 1000, (3, 4), generator=g),
                       K.RESPONSE_MASK: torch.ones(3, 4, dtype=torch.bool)}, batch_size=[3])


def test_reference_is_the_policy_with_adapters_off(tiny_llama_dir, tokenizer):
    base = load_causal_lm(tiny_llama_dir, tokenizer)
    policy = add_lora(load_causal_lm(tiny_llama_dir, tokenizer), r=4)
    with torch.no_grad():  # trained adapters (LoRA's B starts at 0, a no-op)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.named_parameters())
    td = _batch()
    want = TokenLevelActor(base, temperature=0.7)(td.clone()).get(K.LOG_PROB)
    ref = TokenLevelActor(policy, temperature=0.7, adapters_off=True, out_key=K.REF_LOG_PROB)
    got = ref(td.clone()).get(K.REF_LOG_PROB)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with_adapters = TokenLevelActor(policy, temperature=0.7)(td.clone()).get(K.LOG_PROB)
    assert (with_adapters - want).abs().max() > 1e-2  # the adapters are back on afterwards
    # a shared-trunk critic reads the trunk with the adapters in it
    critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")
    assert critic.backbone is policy.get_base_model().model
    with pytest.raises(ValueError, match="PEFT"):
        TokenLevelActor(base, adapters_off=True)


@pytest.mark.parametrize("overrides", [["value_model.init=shared"],
                                       ["value_model.init=policy", "lora.critic=true"]],
                         ids=["shared-critic", "lora-critic"])
def test_lora_run_trains_only_the_adapters(tmp_path, tiny_llama_dir, overrides):
    """Adapters saved; the merged weights differ from the base only in the adapted matrices, by
    updates of rank <= r; embeddings and norms untouched."""
    report = ppo.train(_cfg(tmp_path, tiny_llama_dir, "lora.r=2", "lora.save_merged=true",
                            *overrides))
    assert report["iterations"] == 2
    saved = {p.name for p in (tmp_path / "policy").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved
    assert "model.safetensors" not in saved  # adapters only, not a second full model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "policy_merged").state_dict()
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed), changed
    for k in changed:
        assert torch.linalg.matrix_rank(merged[k] - base[k], atol=1e-6) <= 2, k
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # adapters start as a no-op
    assert rows[1]["objective/kl"] != 0.0


def test_lora_needs_a_rank(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="lora.r > 0"):
        ppo.train(_cfg(tmp_path, tiny_llama_dir, "lora.critic=true"))


def test_lora_policy_samples_on_policy_despite_checkpoint_processors(instruct_llama_dir, tokenizer):
    """A PEFT model generates with its base model's generation_config: the checkpoint's repetition
    penalty and suppressed tokens are swapped out there too, and the recorded log-probs are the
    training forward's."""
    from rlhf_torchrl.collectors import (
        RolloutCollector,
        make_generation_env,
        make_generation_policy,
    )
    from rlhf_torchrl.collectors.on_policy import check_on_policy

    policy = add_lora(load_causal_lm(instruct_llama_dir, tokenizer), r=4)
    own = policy.get_base_model().generation_config.to_dict()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    env = make_generation_env([f"Prompt {i}" for i in range(32)], tokenizer, batch_size=32, seed=0)
    gen = make_generation_policy(policy, tokenizer, max_new_tokens=6, record_log_probs=True)
    rollout = next(iter(RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=32, seed=0)))
    tokens = rollout.get(K.RESPONSE_TOKENS)[rollout.get(K.RESPONSE_MASK)]
    assert 0.25 < (tokens < 20_000).float().mean() < 0.55  # suppressed ids drawn at their true rate
    stats = check_on_policy(rollout, TokenLevelActor(policy), num_rows=32, atol=1e-3)
    assert stats["max_abs_diff"] < 1e-4
    # swapped only while generating (PEFT copies its config onto the base model's: restore that one)
    assert policy.get_base_model().generation_config.to_dict() == own
