"""The models of a PPO run, assembled: policy, frozen reference, critic, and their actors.

Example:
    >>> policy, reference, critic = make_models("smollm2-135m-instruct", tok, value_model="shared")
    >>> actor, ref_actor = make_actors(policy, reference, critic, temperature=0.7)
"""

from __future__ import annotations

import copy

import torch

from rlhf_torchrl.modules.actor import TokenLevelActor
from rlhf_torchrl.modules.compiled import compile_layers
from rlhf_torchrl.modules.critic import make_critic
from rlhf_torchrl.modules.lora import add_lora
from rlhf_torchrl.modules.models import load_causal_lm


def make_models(policy: str, tokenizer, *, reference: str | None = None, dtype: str = "float32",
                attn_implementation: str | None = None, lora: dict | None = None,
                lora_critic: bool = False, value_model: str | None = "shared",
                value_model_path: str | None = None, autocast_dtype: torch.dtype | None = None,
                gradient_checkpointing: bool = False, device: torch.device | str = "cpu",
                offload_reference: bool = False, packing: bool | str = False, compile: bool = False):
    """``(policy, reference, critic)``, dropout off everywhere, on ``device``.

    Args:
        policy: the policy's checkpoint (a Hub name or a path).
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        reference: a reference model of its own (the policy's vocabulary), or None: a frozen copy
            of the policy, or with ``lora`` the policy with its adapters off (no second copy).
        dtype: the models' dtype.
        attn_implementation: the attention kernel (None: transformers' default).
        lora: PEFT settings (``r``, ``alpha``, ``dropout``, ``target_modules``) for LoRA
            adapters on the policy (None: full fine-tuning).
        lora_critic: put adapters on a separate critic's trunk too.
        value_model: ``shared`` (a value head on the policy's trunk), ``policy`` (a copy),
            ``reward_model`` or ``model`` (loaded from ``value_model_path``), see
            :func:`~rlhf_torchrl.modules.make_critic`, or None: no critic (the critic-free
            advantage estimators; ``critic`` is None).
        value_model_path: the critic's checkpoint (None: the policy's).
        autocast_dtype: the critic's backbone runs under ``torch.autocast`` in this dtype.
        gradient_checkpointing: recompute activations in the backward (policy and a separate
            critic).
        device: where the models go.
        offload_reference: the reference lives on the CPU between its forwards.
        packing: the critic's packed forwards (:mod:`~rlhf_torchrl.modules.packing`; the actors'
            are :func:`make_actors`').
        compile: compile the decoder layers of all three for the actors' and critic's forwards
            (:func:`~rlhf_torchrl.modules.compiled.compile_layers`).
    """
    model = load_causal_lm(policy, tokenizer, dtype=dtype, attn_implementation=attn_implementation)
    if reference:
        frozen = load_causal_lm(reference, tokenizer, dtype=dtype,
                                attn_implementation=attn_implementation)
    elif lora:
        frozen = None  # the policy with its adapters off (make_actors)
    else:
        frozen = copy.deepcopy(model)
    if frozen is not None:
        frozen.eval().requires_grad_(False)
    if lora:
        model = add_lora(model, **lora)
    critic = None
    if value_model is not None:
        critic = make_critic(policy=model, tokenizer=tokenizer, init=value_model,
                             name_or_path=value_model_path or policy, dtype=dtype,
                             attn_implementation=attn_implementation,
                             autocast_dtype=autocast_dtype, lora=lora if lora_critic else None,
                             packing=packing)
    if gradient_checkpointing:
        # non-reentrant: works with frozen inputs and keyword arguments; active in train() only
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
        model.gradient_checkpointing_enable(**kwargs)
        if critic is not None and not critic.shares_trunk:
            critic.backbone.gradient_checkpointing_enable(**kwargs)
    model.to(device)
    if critic is not None:
        critic.to(device)
    if frozen is not None:
        frozen.to("cpu" if offload_reference else device)
    for compiled in (model, frozen, critic) if compile else ():
        if compiled is not None:
            compile_layers(compiled)  # a shared trunk's layers: compiled with the policy's
    return model, frozen, critic


def make_actors(policy, reference, critic, *, temperature: float,
                autocast_dtype: torch.dtype | None = None, packing: bool | str = False):
    """The policy's and the reference's :class:`TokenLevelActor` at the sampling ``temperature``;
    a shared-trunk critic gets its hidden states from the policy's forward.

    Args:
        policy (torch.nn.Module): the policy model.
        reference (torch.nn.Module | None): the reference model; None (LoRA): the policy with its
            adapters off.
        critic (rlhf_torchrl.modules.TokenCritic | None): the critic (None: no critic).
        temperature: the sampling temperature.
        autocast_dtype: the actors' autocast dtype (None: no autocast).
        packing: packed forwards (:mod:`~rlhf_torchrl.modules.packing`).
    """
    shared = critic is not None and critic.shares_trunk
    actor = TokenLevelActor(policy, temperature=temperature, autocast_dtype=autocast_dtype,
                            trunk_critic=critic if shared else None, packing=packing)
    ref = TokenLevelActor(reference if reference is not None else policy, temperature=temperature,
                          out_key=("ref_log_probs", "response"), autocast_dtype=autocast_dtype,
                          adapters_off=reference is None, packing=packing)
    return actor, ref
