"""Models: loading, the token-level actor and critic, and the old quantities they compute."""

from rlhf_torchrl.modules.actor import ResponseTokenDistribution, TokenLevelActor
from rlhf_torchrl.modules.critic import TokenCritic, make_critic
from rlhf_torchrl.modules.models import (
    SMOLLM2,
    byte_tokenizer,
    disable_dropout,
    ensure_pad_token,
    fuse_activations,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    match_vocab,
    resolve_model_path,
)
from rlhf_torchrl.modules.old_quantities import compute_old_quantities
from rlhf_torchrl.modules.sequences import model_inputs

__all__ = [
    "SMOLLM2",
    "ResponseTokenDistribution",
    "TokenCritic",
    "TokenLevelActor",
    "byte_tokenizer",
    "disable_dropout",
    "compute_old_quantities",
    "ensure_pad_token",
    "fuse_activations",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "make_critic",
    "match_vocab",
    "model_inputs",
    "resolve_model_path",
]
