"""Reward-model training: a Bradley-Terry loss on preference pairs.

A reward model is any Hugging Face model as a one-label sequence classifier (``RewardModel``
renders and encodes the texts exactly as PPO will score them). Training follows "The N+
Implementation Details of RLHF with PPO" (Huang et al. 2024): the score head starts from
``N(0, 1/sqrt(d + 1))``, the loss is ``-log sigmoid(r(chosen) - r(rejected))``, held-out pairwise
accuracy is the headline, and after training the reward is shifted so that the reference
responses average zero. The shift is stored in the model's config (``reward_offset``), which
:class:`~rlhf_torchrl.rewards.reward_model.RewardModel` subtracts, so the saved directory is the PPO reward
model as it is (and a critic's initialisation: ``value_model.init=reward_model``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlhf_torchrl.data.prompts import _HH_ASSISTANT, _parse_hh
from rlhf_torchrl.data.readers import POLARITY, polarity_sentences, read_hub_rows, read_jsonl
from rlhf_torchrl.errors import ConfigError


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two responses to it.

    Args:
        prompt: the text a reward model without a chat template reads before the response (may be
            empty).
        chosen: the preferred response.
        rejected: the other response.
        messages: the same prompt as a conversation, for reward models with a chat template
            (empty: none).
    """

    prompt: str
    chosen: str
    rejected: str
    messages: tuple = ()


def _pair(prompt: str, chosen: str, rejected: str) -> PreferencePair:
    """A pair from data: Anthropic HH transcripts ("\n\nHuman: ... \n\nAssistant: ...") are
    split at their last assistant turn into the shared conversation and the two answers."""
    marker = _HH_ASSISTANT
    if not prompt and marker in chosen and marker in rejected:
        head_c, _, answer_c = chosen.rpartition(marker)
        head_r, _, answer_r = rejected.rpartition(marker)
        if head_c == head_r:
            prompt_text = head_c + marker
            return PreferencePair(prompt_text, " " + answer_c.strip(), " " + answer_r.strip(),
                                  tuple(_parse_hh(head_c)))
    messages = ({"role": "user", "content": prompt},) if prompt else ()
    return PreferencePair(prompt, chosen, rejected, messages)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``mean(-log sigmoid(chosen - rejected))``: the negative log-likelihood that the chosen
    response wins under the Bradley-Terry model.

    Args:
        chosen: (N,) the chosen responses' scores.
        rejected: (N,) the rejected responses' scores.
    """
    return -F.logsigmoid(chosen - rejected).mean()


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of pairs whose chosen response scores strictly higher.

    Args:
        chosen: (N,) the chosen responses' scores.
        rejected: (N,) the rejected responses' scores.
    """
    return float((chosen > rejected).float().mean())


def reward_head(model: nn.Module) -> nn.Linear:
    """The one-output linear layer a sequence classifier scores with (``score``, ``classifier``,
    ``classifier.out_proj``...).

    Args:
        model: a sequence classifier.
    """
    modules = dict(model.named_modules())
    for name in ("score", "classifier", "classifier.out_proj", "v_head"):
        module = modules.get(name)
        if isinstance(module, nn.Linear) and module.out_features == 1:
            return module
    raise ConfigError(f"{type(model).__name__} has no one-output score head (score/classifier): "
                     "load it as AutoModelForSequenceClassification with num_labels=1.")


@torch.no_grad()
def init_reward_head(model: nn.Module) -> nn.Linear:
    """Weights ~ N(0, 1/sqrt(d + 1)) (d: the head's input width), bias 0: initial rewards of
    unit scale whatever the width.

    Args:
        model: a sequence classifier (:func:`reward_head` finds its head).
    """
    head = reward_head(model)
    head.weight.normal_(0.0, 1.0 / math.sqrt(head.in_features + 1))
    if head.bias is not None:
        head.bias.zero_()
    return head


def polarity_pairs(eval_fraction: float = 0.2, seed: int = 0):
    """(train, eval) pairs from the review sentences gensim ships: a positive sentence is chosen
    over a negative one. Sentences are split first, so held-out pairs hold unseen sentences; train
    pairs are one random pairing (re-paired each epoch by :func:`train_reward_model`), eval pairs
    every held-out (positive, negative) combination.

    Args:
        eval_fraction: the share of sentences held out for evaluation.
        seed: the split's and the pairing's seed.
    """
    rng = random.Random(seed)
    by_label = {"pos": [], "neg": []}
    for label, text in polarity_sentences():
        by_label[label].append(text)
    train, held = {}, {}
    for label, texts in by_label.items():
        texts = texts[:]
        rng.shuffle(texts)
        k = max(1, round(len(texts) * eval_fraction))
        held[label], train[label] = texts[:k], texts[k:]
    pairs = [PreferencePair("", c, r) for c, r in zip(train["pos"], train["neg"])]
    eval_pairs = [PreferencePair("", c, r) for c in held["pos"] for r in held["neg"]]
    return pairs, eval_pairs


def load_preference_pairs(source: str, *, split: str = "train", prompt_column: str = "prompt",
                          chosen_column: str = "chosen", rejected_column: str = "rejected",
                          eval_fraction: float = 0.1, limit: int | None = None, seed: int = 0):
    """(train, eval) :class:`PreferencePair` lists from ``"polarity"``, a JSON-lines file or a
    Hugging Face dataset with chosen/rejected columns (and an optional prompt column; Anthropic
    HH rows are whole transcripts: no prompt). Rows are shuffled with ``seed`` and the last
    ``eval_fraction`` held out.

    Args:
        source: ``"polarity"``, a ``.jsonl`` path, or a Hugging Face dataset name or folder.
        split: the dataset's split.
        prompt_column: the prompt's column (a row without it: a pair without a prompt).
        chosen_column: the chosen response's column.
        rejected_column: the rejected response's column.
        eval_fraction: the share of rows held out for evaluation.
        limit: keep the first ``limit`` rows (None: all).
        seed: the shuffle's seed.
    """
    if source == POLARITY:
        return polarity_pairs(eval_fraction, seed)
    if source.endswith((".jsonl", ".json")):
        rows = read_jsonl(source, chosen_column)
    else:
        rows = read_hub_rows(source, split, chosen_column)
    pairs = []
    for row, where in rows[:limit]:
        if rejected_column not in row:
            raise ConfigError(f"{where}: no {rejected_column!r} field (set data.rejected_column).")
        chosen, rejected = row[chosen_column], row[rejected_column]
        if not isinstance(chosen, str) or not isinstance(rejected, str):
            raise ConfigError(f"{where}: {chosen_column!r} and {rejected_column!r} must be text.")
        pairs.append(_pair(str(row.get(prompt_column) or ""), chosen, rejected))
    if len(pairs) < 2:
        raise ConfigError(f"{source}: {len(pairs)} preference pair(s); training needs at least 2.")
    random.Random(seed).shuffle(pairs)
    k = max(1, round(len(pairs) * eval_fraction))
    return pairs[:-k], pairs[-k:]


def _texts(reward_model, pairs, which: str) -> list[str]:
    messages = [list(p.messages) for p in pairs] if reward_model.has_chat_template else None
    return reward_model.render([p.prompt for p in pairs], [getattr(p, which) for p in pairs],
                               messages=messages)


def scores(reward_model, pairs, which: str, *, grad: bool = False) -> torch.Tensor:
    """The raw scores (no offset) of ``which`` (chosen/rejected) responses of ``pairs``.

    Args:
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): the model that scores.
        pairs (list[PreferencePair]): the pairs.
        which: ``"chosen"`` or ``"rejected"``.
        grad: keep the graph (training); False: no grad.
    """
    texts = _texts(reward_model, pairs, which)
    out = []
    with torch.set_grad_enabled(grad):
        for i in range(0, len(texts), reward_model.batch_size):
            inputs = reward_model.encode(texts[i : i + reward_model.batch_size]).to(reward_model.device)
            out.append(reward_model.model(**inputs).logits[:, 0].float())
    return torch.cat(out)


def preference_metrics(reward_model, pairs) -> dict[str, float]:
    """Held-out pairwise accuracy, loss and mean margin.

    Args:
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): the model to evaluate.
        pairs (list[PreferencePair]): the held-out pairs.
    """
    reward_model.model.eval()
    chosen, rejected = scores(reward_model, pairs, "chosen"), scores(reward_model, pairs, "rejected")
    return {"eval/accuracy": pairwise_accuracy(chosen, rejected),
            "eval/loss": float(bradley_terry_loss(chosen, rejected)),
            "eval/margin": float((chosen - rejected).mean())}


def train_reward_model(reward_model, train_pairs, eval_pairs, *, epochs: int = 1,
                       batch_size: int = 16, lr: float = 5e-5, weight_decay: float = 0.0,
                       max_grad_norm: float | None = 1.0, seed: int = 0, log=None) -> list[dict]:
    """AdamW on the Bradley-Terry loss, linear decay to 0; each epoch re-pairs the chosen and
    rejected responses of prompt-less pairs (more distinct pairs from the same sentences) and
    reports train loss/accuracy and the held-out metrics. Returns one row per epoch.

    Args:
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): the model to train, in place.
        train_pairs (list[PreferencePair]): the training pairs.
        eval_pairs (list[PreferencePair]): the held-out pairs.
        epochs: passes over the training pairs.
        batch_size: pairs per optimiser step.
        lr: AdamW's peak learning rate.
        weight_decay: AdamW's weight decay.
        max_grad_norm: gradient-norm clip (None: none).
        seed: the shuffles' and re-pairings' seed.
        log (Callable | None): called with each epoch's row (None: not called).
    """
    model = reward_model.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(train_pairs) / batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)
    rng = random.Random(seed)
    history = []
    for epoch in range(epochs):
        pairs = _repair(train_pairs, rng) if epoch else list(train_pairs)
        rng.shuffle(pairs)
        model.train()
        losses, wins = [], []
        for i in range(0, len(pairs), batch_size):
            batch = pairs[i : i + batch_size]
            chosen = scores(reward_model, batch, "chosen", grad=True)
            rejected = scores(reward_model, batch, "rejected", grad=True)
            loss = bradley_terry_loss(chosen, rejected)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss) * len(batch))
            wins.append(pairwise_accuracy(chosen.detach(), rejected.detach()) * len(batch))
        row = {"epoch": epoch, "train/loss": sum(losses) / len(pairs),
               "train/accuracy": sum(wins) / len(pairs), **preference_metrics(reward_model, eval_pairs)}
        history.append(row)
        if log is not None:
            log(row)
    model.eval()
    return history


def _repair(pairs, rng: random.Random) -> list[PreferencePair]:
    """Prompt-less pairs with their rejected responses shuffled among them; pairs with prompts
    are kept as they are (a response only answers its own prompt)."""
    free = [p for p in pairs if not p.prompt]
    rejected = [p.rejected for p in free]
    rng.shuffle(rejected)
    return ([PreferencePair("", p.chosen, r, p.messages) for p, r in zip(free, rejected)]
            + [p for p in pairs if p.prompt])


def reward_offset(reward_model, pairs) -> float:
    """Mean raw score of the reference responses (both sides of ``pairs``): the shift that makes
    them average zero.

    Args:
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): the trained model.
        pairs (list[PreferencePair]): the reference pairs.
    """
    reward_model.model.eval()
    both = torch.cat([scores(reward_model, pairs, "chosen"), scores(reward_model, pairs, "rejected")])
    return float(both.mean())
