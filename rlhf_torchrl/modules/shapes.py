"""A causal LM's shape from its ``config.json`` alone, and the FLOPs of its forward passes: what
``rlhf-torchrl plan`` and the benchmarks' MFU count. No weight is loaded.

:meth:`ModelShape.counted` counts the parameters on an instance of the model's own class on the
``meta`` device (no memory, tens of milliseconds): exact for whatever transformers builds, mixtures
of experts, non-gated MLPs and biases included. :meth:`ModelShape.from_config` reads the widths
alone and counts a dense, gated (SwiGLU) decoder's matmuls: exact for Llama-like models, a
fallback elsewhere.

The FLOPs are the matmuls' multiply-adds, 2 FLOPs each (embedding look-ups, norms and
activations are left out: under 1% at these sizes); a mixture of experts' per token are its
router's, its shared experts' and ``num_experts_per_tok`` routed experts'. Attention's two matmuls
are counted over the causal half of the score matrix, the work a causal kernel does. A backward
pass is counted as twice its forward (the gradients of the inputs and of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the memory and FLOPs of a decoder-only transformer depend on.

    Args:
        layers: decoder layers.
        hidden: the residual stream's width.
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention: fewer than ``heads``).
        head_dim: each head's width.
        intermediate: the MLP's inner width.
        vocab: the vocabulary (the embedding's and LM head's rows).
        tied: the LM head shares the embedding's weights.
        gated_mlp: a gated MLP (SwiGLU: 3 matrices) rather than 2.
        learned_positions: rows of a learned position embedding (GPT-2's; 0: rotary).
        total: the model's parameters, counted (None: from the widths).
        head: the LM head's own parameters, counted (0 where it is tied to the embedding).
        layer: a decoder layer's parameters, counted (the mean over the layers; every expert).
        layer_active: the matmul weights one token goes through in a decoder layer, counted (the
            mean over the layers; of the routed experts, ``num_experts_per_tok``).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    gated_mlp: bool = True
    learned_positions: int = 0
    total: int | None = None
    head: int | None = None
    layer: float | None = None
    layer_active: float | None = None

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """The shape of a transformers config (Llama, Qwen2/3, Mistral, GPT-2, ...).

        Args:
            config (transformers.PretrainedConfig): the model's config (a multimodal model's: its
                language model's).
        """
        config = language_model_config(config)
        get = lambda *names, default=None: next(  # noqa: E731
            (getattr(config, n) for n in names if getattr(config, n, None) is not None), default)
        hidden = get("hidden_size", "n_embd", "d_model")
        heads = get("num_attention_heads", "n_head")
        head_dim = get("head_dim", default=hidden // heads)
        gpt2 = getattr(config, "model_type", "") == "gpt2"
        return cls(layers=get("num_hidden_layers", "n_layer"), hidden=hidden, heads=heads,
                   kv_heads=get("num_key_value_heads", default=heads), head_dim=head_dim,
                   intermediate=get("intermediate_size", "n_inner", default=4 * hidden),
                   vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", True)),
                   gated_mlp=not gpt2,
                   learned_positions=getattr(config, "n_positions", 0) if gpt2 else 0)

    @classmethod
    def counted(cls, config, model=None) -> ModelShape:
        """:meth:`from_config`'s shape with its parameters counted on an instance of the model's
        own class on the ``meta`` device (no memory is allocated; no weight is read): the whole
        model's, the LM head's, a decoder layer's, and the matmul weights a token goes through in
        a layer (the router's, the shared experts' and ``num_experts_per_tok`` of the routed
        experts'). :meth:`from_config`'s alone where transformers cannot build the class.

        Args:
            config (transformers.PretrainedConfig): the model's config.
            model: :func:`meta_model` of ``config``, where it was built already.
        """
        import dataclasses

        shape = cls.from_config(config)
        model = model if model is not None else meta_model(config)
        if model is None:  # a class transformers cannot build: the widths' count
            return shape
        layers = decoder_layers(model, shape.layers)
        if layers is None:
            return shape
        head = model.get_output_embeddings()
        tied = head is None or head.weight is model.get_input_embeddings().weight
        experts, routed = routed_experts(config)
        layer, active = 0, 0.0
        for name, param in layers.named_parameters():
            layer += param.numel()
            if param.dim() < 2:  # norms, biases: no matmul
                continue
            # routed experts (a module named experts, or weights stacked by expert: JetMoE's):
            # a token visits `routed` of them
            if experts and ("experts" in name.split(".")
                            or (param.dim() == 3 and param.shape[0] == experts)):
                active += param.numel() * routed / experts
            else:
                active += param.numel()
        return dataclasses.replace(
            shape, layers=len(layers), total=sum(p.numel() for p in model.parameters()),
            head=0 if tied else sum(p.numel() for p in head.parameters()),
            layer=layer / len(layers), layer_active=active / len(layers))

    @property
    def layer_matmul_params(self) -> int | float:
        """Weights of one layer's matmuls a token goes through: q, k, v, o and the MLP's (of a
        mixture of experts, the router's, the shared experts' and the routed experts' it visits)."""
        if self.layer_active is not None:
            return self.layer_active
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int | float:
        """Parameters of one decoder layer: its matmuls' weights (every expert's) and norms."""
        if self.layer is not None:
            return self.layer
        return self.layer_matmul_params + 2 * self.hidden

    @property
    def trunk_params(self) -> int:
        """Parameters of the trunk: the layers (with their norms) and the embedding."""
        if self.total is not None:
            return self.total - self.head
        norms = self.layers * 2 * self.hidden + self.hidden
        embeddings = (self.vocab + self.learned_positions) * self.hidden
        return self.layers * self.layer_matmul_params + norms + embeddings

    @property
    def params(self) -> int:
        """Parameters of the causal LM: the trunk, and the LM head unless tied."""
        if self.total is not None:
            return self.total
        return self.trunk_params + (0 if self.tied else self.vocab * self.hidden)

    def forward_flops(self, rows: int, length: int, head_positions: int) -> float:
        """FLOPs of one forward over ``rows`` sequences of ``length`` tokens, the LM head (or a
        value head, ``vocab`` 1) applied at ``head_positions`` positions of each row.

        Args:
            rows: sequences.
            length: tokens per sequence (padded positions count: they are computed).
            head_positions: positions per row the output head runs on.
        """
        linear = 2 * self.layers * self.layer_matmul_params * length
        attention = 2 * self.layers * self.heads * self.head_dim * length * length  # causal half
        return rows * (linear + attention + 2 * self.hidden * self.vocab * head_positions)

    def decode_flops(self, rows: int, prompt: int, new: int) -> float:
        """FLOPs of sampling ``new`` tokens after ``prompt`` with a KV cache: the prefill, then one
        token per step attending to all before it.

        Args:
            rows: sequences.
            prompt: prompt tokens per row.
            new: tokens sampled per row.
        """
        prefill = self.forward_flops(rows, prompt, 1)
        per_token = 2 * self.layers * self.layer_matmul_params + 2 * self.hidden * self.vocab
        context = 4 * self.layers * self.heads * self.head_dim * (new * prompt + new * new / 2)
        return prefill + rows * (new * per_token + context)


#: the config keys that name a mixture's routed experts per layer (Mixtral's, Qwen-MoE's,
#: DeepSeek's, Aria's)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def language_model_config(config):
    """``config``'s language model's config: a multimodal model's text config (the part a text
    run's tokens go through), else ``config``.

    Args:
        config (transformers.PretrainedConfig): the model's config.
    """
    if getattr(config, "hidden_size", None) is None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def routed_experts(config) -> tuple[int, int]:
    """(routed experts per mixture-of-experts layer, the experts a token visits) of ``config``;
    (0, 0) for a dense model.

    Args:
        config (transformers.PretrainedConfig): the model's config.
    """
    def first(*names) -> int:
        return next((n for name in names
                     if isinstance(n := getattr(config, name, None), int) and n > 0), 0)

    experts = first(*EXPERT_COUNTS)
    return experts, first("num_experts_per_tok", "moe_topk") if experts else 0


def meta_model(config):
    """An instance of ``config``'s causal-LM class on the ``meta`` device (shapes, no memory);
    None where transformers cannot build it.

    Args:
        config (transformers.PretrainedConfig): the model's config.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a class transformers does not map, a config it refuses
        return None


def lora_params(model, r: int, targets="all-linear", peft: bool | None = None) -> int:
    """Parameters of rank-``r`` LoRA adapters on ``model``'s ``targets``: those PEFT itself adds to a
    copy of ``model`` on the ``meta`` device (a mixture's fused experts included, where PEFT
    adapts them); without PEFT, PEFT's rule for linear layers: every linear layer but the output
    head (``"all-linear"``), the modules whose names end with one of a list's
    (``["q_proj", "v_proj"]``), or those a regular expression matches whole; ``r`` x (inputs +
    outputs) each.

    Args:
        model: the model (on the ``meta`` device: a copy is adapted).
        r: the adapters' rank.
        targets: PEFT's ``target_modules``.
        peft: count with PEFT itself (None: where it is installed and ``model`` is on ``meta``).
    """
    import copy
    import importlib.util
    import re

    if peft is None:
        peft = importlib.util.find_spec("peft") is not None and _is_meta(model)
    if peft:
        import warnings

        from rlhf_torchrl.modules.lora import add_lora

        with warnings.catch_warnings():  # (PEFT's notes on the copy: patterns it did not use)
            warnings.simplefilter("ignore")
            adapted = add_lora(copy.deepcopy(model), r=r, target_modules=targets)
        return sum(p.numel() for p in adapted.parameters() if p.requires_grad)

    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            sizes = module.in_features + module.out_features
        elif isinstance(module, Conv1D):  # GPT-2's: weight (inputs, outputs)
            sizes = sum(module.weight.shape)
        else:
            continue
        if isinstance(targets, str) and targets == "all-linear":
            chosen = module is not head
        elif isinstance(targets, str):
            chosen = re.fullmatch(targets, name) is not None
        else:
            chosen = any(name == t or name.endswith(f".{t}") for t in targets)
        count += r * sizes if chosen else 0
    return count


def _is_meta(model) -> bool:
    return all(p.is_meta for p in model.parameters())


def decoder_layers(model, count: int | None = None):
    """``model``'s decoder layers (a ``torch.nn.ModuleList``): its base model's ``layers``, ``h`` or
    ``blocks``, else the first list of ``count`` modules in it (OPT's ``model.decoder.layers``);
    None where there is none.

    Args:
        model: a transformers causal LM.
        count: the config's layer count.
    """
    import torch

    base = model.base_model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers
    return next((m for _, m in model.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and count and len(m) == count), None)


def training_flops(shape: ModelShape, rows: int, length: int, head_positions: int,
                   recompute: bool = False) -> float:
    """FLOPs of a forward and backward (3x the forward) over ``rows`` x ``length`` tokens; with
    ``recompute`` (gradient checkpointing) the decoder layers' forward once more in the backward.

    Args:
        shape: the model's shape.
        rows: sequences.
        length: tokens per sequence.
        head_positions: positions per row the output head runs on.
        recompute: the layers' activations are recomputed in the backward (not the head's).
    """
    return (3 * shape.forward_flops(rows, length, head_positions)
            + (shape.forward_flops(rows, length, 0) if recompute else 0.0))
