"""Models: loading, token-level actor, critic."""

from .actor_critic import (
    ResponseTokenDistribution,
    TokenCritic,
    TokenLevelActor,
    evaluate_rollout,
    make_critic,
    model_inputs,
)
from .models import (
    SMOLLM2,
    byte_tokenizer,
    disable_dropout,
    ensure_pad_token,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    match_vocab,
    resolve_model_path,
)

__all__ = [
    "SMOLLM2",
    "ResponseTokenDistribution",
    "TokenCritic",
    "TokenLevelActor",
    "byte_tokenizer",
    "disable_dropout",
    "evaluate_rollout",
    "ensure_pad_token",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "make_critic",
    "match_vocab",
    "model_inputs",
    "resolve_model_path",
]
