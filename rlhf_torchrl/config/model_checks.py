"""The models a config names, checked from their ``config.json`` before any weights load: each
exists, a reward model is a one-label sequence classifier, the reference shares the policy's
vocabulary, and the longest prompt plus the response budget fits each model's positions."""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig

from rlhf_torchrl.config.derived import response_budget
from rlhf_torchrl.data.prompt_sets import PromptMixture, PromptSet
from rlhf_torchrl.data.prompts import templated_length
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)


def _model_config(setting: str, name: str, weights: bool = True):
    """The ``config.json`` of model ``name`` (a setting's value): a clear error if it cannot be
    read, before any weights are; with ``weights``, also if a local directory holds none (a plan
    reads the config alone)."""
    from transformers import AutoConfig

    from rlhf_torchrl.modules.models import resolve_model_path

    path = resolve_model_path(name)
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError(f"{setting}={name}: no such directory. Give a local model directory (with "
                         "config.json) or a Hugging Face hub id such as HuggingFaceTB/SmolLM2-135M.")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{setting}={name}: not a loadable Hugging Face model ({first}).") from None
    if weights and path == name and os.path.isdir(os.path.expanduser(path)):
        _check_weights(setting, name, os.path.expanduser(path))
    return config


#: the files that hold a local model directory's weights (one of them, or shards and their index)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                "pytorch_model.bin.index.json", "*.gguf")


def _check_weights(setting: str, name: str, path: str) -> None:
    """A local model directory holds weights as well as its ``config.json`` (else transformers
    fails later, after the data is read, with a trace)."""
    import glob

    if any(glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_FILES):
        return
    held = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
    raise ConfigError(f"{setting}={name} has a config.json but no weights (no model.safetensors, "
                      f"pytorch_model.bin or their shards; it holds {held}): save the model there "
                      f"with save_pretrained(), or point {setting} at the folder that has them.")


def check_models(cfg: DictConfig) -> None:
    """Each model's config read before any weights: it exists, the reward model is a one-label
    sequence classifier, the reference shares the policy's vocabulary.

    Args:
        cfg: the composed PPO config.
    """
    m, r, v = cfg.model, cfg.reward, cfg.value_model
    policy = _model_config("model.policy", m.policy)
    if m.reference:
        reference = _model_config("model.reference", m.reference)
        if getattr(reference, "vocab_size", None) != getattr(policy, "vocab_size", None):
            raise ConfigError(
                f"model.reference={m.reference} has a vocabulary of {reference.vocab_size} tokens and "
                f"model.policy={m.policy} one of {policy.vocab_size}: the per-token KL needs the same "
                "tokenizer. Use a reference with the policy's tokenizer (or model.reference=null)."
            )
    if r.model:
        check_reward_model("reward.model", r.model)
    if v.init == "model" and v.name_or_path:
        _model_config("value_model.name_or_path", v.name_or_path)


def check_reward_model(setting: str, name: str) -> None:
    """The model ``setting`` names is a sequence classifier with one label (its config read, no
    weights).

    Args:
        setting: the setting that names the model (for the error).
        name: the model's directory or Hub name.
    """
    reward = _model_config(setting, name)
    archs = getattr(reward, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"{setting}={name} is a {', '.join(archs) or 'model without an architecture'}, "
            "not a sequence classifier: a reward model is an AutoModelForSequenceClassification "
            f"with one label (train one with a Bradley-Terry loss), or drop {setting}."
        )
    if reward.num_labels != 1:
        raise ConfigError(f"{setting}={name} has {reward.num_labels} labels: a reward model "
                          "gives one score (num_labels=1).")


def check_sequence_length(cfg: DictConfig, prompts, tokenizer) -> None:
    """The longest prompt (chat template included, after ``data.truncate_prompts``) plus the
    longest response fits the positions of each model that reads the policy's tokens (policy,
    reference, a critic of its own, on-policy distillation's teacher), where its config gives a
    limit. Past it a learned position embedding (GPT-2's ``n_positions``) fails deep inside the
    first forward with an IndexError: refused, one line. A rotary model (a
    ``rope_parameters``/``rope_scaling`` config) computes any position, but reads positions it was
    never trained on: a warning.

    Args:
        cfg: the composed PPO config.
        prompts (Sequence | PromptSet | PromptMixture): the training prompts.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
    """
    m, v = cfg.model, cfg.value_model
    models = [("model.policy", m.policy), ("model.reference", m.reference)]
    if v.init == "model" and v.name_or_path:
        models.append(("value_model.name_or_path", v.name_or_path))
    if cfg.reward.teacher and cfg.reward.teacher_mapping == "token":  # it reads the same tokens
        models.append(("reward.teacher", cfg.reward.teacher))
    limits = []
    for setting, name in models:
        config = _model_config(setting, name) if name else None
        # (GPT-2's config maps max_position_embeddings to n_positions)
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int):
            rotary = any(getattr(config, a, None) for a in ("rope_parameters", "rope_scaling",
                                                            "rope_theta", "rotary_dim"))
            limits.append((positions, not rotary, setting, name))
    if not limits:
        return
    positions, learned, setting, name = min(limits)
    response, bound, lower = response_budget(cfg)
    if cfg.data.max_prompt_length + response <= positions:
        return  # every prompt fits data.max_prompt_length (the length check)
    if isinstance(prompts, (PromptSet, PromptMixture)):
        longest = prompts.longest  # None: checked as batches serve them, each within the limit
        what = (f"The longest prompt ({longest} tokens, chat template included)" if longest else
                f"A prompt of data.max_prompt_length={cfg.data.max_prompt_length} tokens (the "
                "prompts are checked as batches serve them, data.check_prompts)")
        longest = longest or cfg.data.max_prompt_length
    else:
        longest = max(templated_length(tokenizer, prompt) for prompt in prompts)
        what = f"The longest prompt ({longest} tokens, chat template included)"
    if longest + response <= positions:
        return
    fixes = []
    if positions > longest:
        fixes.append(f"set {lower}={positions - longest} or less")
    if positions > response:
        fixes.append(f"cut the prompts (data.max_prompt_length={positions - response} "
                     "data.truncate_prompts=true)")
    message = (f"{what} plus {response} "
               f"response tokens ({bound}) is {longest + response} tokens, more than the "
               f"{positions} positions of {setting}={name}")
    if not learned:  # rotary: it runs, on positions it was not trained on
        log.warning("%s (a rotary model: it runs on positions it was never trained on). To stay "
                    "within them: %s.", message, ", or ".join(fixes) or "use a longer-context model")
        return
    raise ConfigError(f"{message}: {', or '.join(fixes) or 'use a model with more positions'}.")
