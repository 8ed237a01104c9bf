"""LoRA through PEFT: the policy trained through adapters, its reference the same weights without them.

``add_lora`` wraps a model with PEFT's ``get_peft_model`` (base weights frozen, adapters trainable).
The reference policy is then no second model: :class:`~rlhf_torchrl.modules.TokenLevelActor` with
``adapters_off=True`` runs the policy inside PEFT's ``disable_adapter()``, which is exactly the
base model, so the KL penalty is measured against the weights training started from. Needs the
``[peft]`` extra (``pip install "rlhf_torchrl[peft]"``; from a checkout ``pip install -e ".[peft]"``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from rlhf_torchrl.errors import ConfigError, MissingDependencyError


def add_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "all-linear",
    task_type: str = "CAUSAL_LM",
) -> nn.Module:
    """``model`` with LoRA adapters; only the adapters require grad.

    Args:
        model: the model to adapt.
        r: the adapters' rank.
        alpha: LoRA's scaling numerator (the update is scaled by ``alpha / r``).
        dropout: dropout on the adapters' input.
        target_modules: the modules that get adapters: PEFT names or ``"all-linear"``.
        task_type: ``CAUSAL_LM`` for a policy, ``FEATURE_EXTRACTION`` for a critic's trunk.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise MissingDependencyError("LoRA needs PEFT: pip install \"rlhf_torchrl[peft]\" (or pip install peft).") from e
    if r < 1:
        raise ConfigError(f"LoRA rank must be >= 1, got {r}.")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type=task_type, bias="none")
    with warnings.catch_warnings():  # PEFT reads an attribute transformers 5.2x deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return get_peft_model(model, config)


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (it has adapters that can be switched off).

    Args:
        model: a model.
    """
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (``model`` itself otherwise): the one whose
    ``generation_config`` and ``base_model`` (trunk, with the adapters injected) count.

    Args:
        model: a model, PEFT or not.
    """
    return model.get_base_model() if is_peft(model) else model


def trunk(model: nn.Module) -> nn.Module:
    """The transformer trunk of a causal LM (``LlamaModel`` in ``LlamaForCausalLM``), adapters
    included for a PEFT model.

    Args:
        model: a causal LM, PEFT or not.
    """
    return hf_model(model).base_model
