"""Reward-model training: the Bradley-Terry pieces by hand, the recipe on the packaged pairs, and
the saved model as PPO's reward model and critic initialisation."""

import json
import math

import pytest
import reward_model  # noqa: E402  (recipes/ is on the path through test_recipe)
import torch
from test_recipe import _cfg, ppo

from rlhf_torchrl.config import compose
from rlhf_torchrl.rewards.reward_model import RewardModel
from rlhf_torchrl.rewards.training import (
    bradley_terry_loss,
    init_reward_head,
    load_preference_pairs,
    pairwise_accuracy,
    polarity_pairs,
)


def test_bradley_terry_loss_and_accuracy_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    expected = -sum(math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip([2, 0, -1], [1, 0, 1])) / 3
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx(expected, rel=1e-6)
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(1 / 3)  # a tie is not a win


def test_reward_head_init_scale():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(hidden_size=1024, num_hidden_layers=1,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     num_labels=1))
    head = init_reward_head(model)
    assert head is model.classifier and float(head.bias.abs().max()) == 0.0
    assert float(head.weight.std()) == pytest.approx(1 / math.sqrt(1025), rel=0.1)


def test_polarity_pairs_hold_out_unseen_sentences():
    train, held = polarity_pairs(eval_fraction=0.2, seed=0)
    seen = {p.chosen for p in train} | {p.rejected for p in train}
    assert len(train) == 80 and len(held) == 20 * 20
    assert not seen & ({p.chosen for p in held} | {p.rejected for p in held})


def test_jsonl_pairs_and_their_errors(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(10)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held = load_preference_pairs(str(path), eval_fraction=0.2)
    assert len(train) == 8 and len(held) == 2 and all(p.chosen.startswith("good") for p in train)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"chosen": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: no 'rejected' field"):
        load_preference_pairs(str(bad))


def test_hh_transcripts_split_at_the_last_assistant_turn(tmp_path):
    convo = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Name a fruit."
    rows = [{"chosen": convo + "\n\nAssistant: An apple.", "rejected": convo + "\n\nAssistant: No."}] * 4
    path = tmp_path / "hh.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = load_preference_pairs(str(path), eval_fraction=0.25)
    pair = train[0]
    assert pair.prompt == convo + "\n\nAssistant:" and (pair.chosen, pair.rejected) == (" An apple.", " No.")
    assert [m["role"] for m in pair.messages] == ["user", "assistant", "user"]
    assert pair.messages[-1]["content"] == "Name a fruit."


def _rm_cfg(out, *overrides):
    return compose([f"output_dir={out}", *overrides], config_name="reward_model")


def test_recipe_improves_held_out_accuracy_on_the_packaged_pairs(tmp_path):
    """MiniLM on gensim's review sentences: 2 epochs lift held-out accuracy well above chance,
    and the saved model's training responses average zero."""
    report = reward_model.train(_rm_cfg(tmp_path, "train.epochs=2"))
    assert report["eval/accuracy"] > report["eval/accuracy_before"] + 0.1
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["eval/accuracy"] == report["eval/accuracy"]
    rm = RewardModel.from_pretrained(report["model_path"])
    assert rm.offset == pytest.approx(report["reward_offset"])
    train, _ = polarity_pairs(0.2, seed=0)
    texts = [p.chosen for p in train] + [p.rejected for p in train]
    from tensordict import TensorDict

    scores = rm(texts, [""] * len(texts), TensorDict({}, batch_size=[len(texts)]))
    assert abs(float(scores.mean())) < 1e-4


def test_trained_reward_model_serves_ppo_as_reward_and_critic(tmp_path, tiny_llama_dir):
    """A reward model trained from the policy's own base (same tokenizer) on local JSON-lines
    pairs: PPO scores with it and initialises its critic from it."""
    rows = [{"prompt": "Review:", "chosen": f"great film number {i}", "rejected": f"awful film {i}"}
            for i in range(12)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = reward_model.train(_rm_cfg(tmp_path / "rm", f"model.name={tiny_llama_dir}",
                                        f"data.source={data}", "train.epochs=1", "train.batch_size=4"))
    out = ppo.train(_cfg(tmp_path / "ppo", tiny_llama_dir, f"reward.model={report['model_path']}",
                         "reward.functions=[]", "value_model.init=reward_model",
                         "ppo.num_iterations=1"))
    assert math.isfinite(out["initial_score"])


def test_recipe_refuses_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="train.epochs=0 is out of range"):
        reward_model.train(_rm_cfg(tmp_path, "train.epochs=0"))
    with pytest.raises(ValueError, match="data.eval_fraction=1.0 is out of range"):
        reward_model.train(_rm_cfg(tmp_path, "data.eval_fraction=1.0"))
    with pytest.raises(ValueError, match=r"train.lr=0.0 is out of range: it must be > 0"):
        reward_model.train(_rm_cfg(tmp_path, "train.lr=0"))
    with pytest.raises(ValueError, match="model.dtype='float7' is not one of the allowed values"):
        reward_model.train(_rm_cfg(tmp_path, "model.dtype=float7"))


@pytest.mark.parametrize("overrides, message", [
    (["model=m", "port=70000"], r"port=70000 is out of range: it must be in \[0, 65535\]"),
    (["model=m", "max_request_mb=0"], r"max_request_mb=0.0 is out of range: it must be > 0"),
    (["model=m", "max_wait_ms=-1"], r"max_wait_ms=-1.0 is out of range: it must be >= 0"),
    (["model=m", "dtype=float7"], r"dtype='float7' is not one of the allowed values: float32"),
    ([], r"model must be set"),
])
def test_the_server_refuses_bad_settings_before_loading(tmp_path, overrides, message):
    """serve_reward_model.yaml has a schema of its own: ranges and choices checked first."""
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.serve_reward_model import serve_reward_model

    cfg = compose(overrides, config_name="serve_reward_model")
    with pytest.raises(ValueError, match=message):
        serve_reward_model(cfg)


def test_the_reward_model_configs_are_typed():
    """A value of the wrong type or an unknown key fails while composing, as in the PPO config."""
    from hydra.errors import ConfigCompositionException

    from rlhf_torchrl.config import compose

    for overrides, name in [(["train.epochs=abc"], "reward_model"), (["port=abc"], "serve_reward_model"),
                            (["train.epoch=3"], "reward_model"), (["prot=8000"], "serve_reward_model")]:
        with pytest.raises(ConfigCompositionException):
            compose(overrides, config_name=name)
