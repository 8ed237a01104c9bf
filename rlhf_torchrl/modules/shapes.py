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
are counted over the query-key pairs each layer's mask keeps, the work a causal kernel does: the
causal half of the score matrix in a full-attention layer, the window in a sliding one, the chunk
in a chunked one, none in a linear-attention, recurrent or convolutional one
(:func:`attention_spans`), at the widths of the scores' and the values' heads. A dense model's
forward equals torch's own count of its eager forward (``FlopCounterMode``; ``tests/test_plan.py``)
with attention's products taken over the causal half. A backward pass is counted as twice its
forward (the gradients of the inputs and of the weights).
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
        spans: each layer's attention over positions (:func:`attention_spans`; None: every layer
            full causal attention).
        qk_head_dim: a head's width in the scores' product where it is not ``head_dim``
            (DeepSeek's latent attention: its rotary and non-rotary parts).
        v_head_dim: a head's width in the values' product where it is not ``head_dim``.
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
    spans: tuple[tuple[str, int], ...] | None = None
    qk_head_dim: int | None = None
    v_head_dim: int | None = None

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
                   learned_positions=getattr(config, "n_positions", 0) if gpt2 else 0,
                   spans=attention_spans(config), qk_head_dim=get("qk_head_dim"),
                   v_head_dim=get("v_head_dim"))

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
        pairs = sum(count * attended_pairs(length, kind, size)
                    for (kind, size), count in self._span_counts())
        return rows * (linear + self.attention_flops_per_pair * pairs
                       + 2 * self.hidden * self.vocab * head_positions)

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of attention's two matmuls per query-key pair, over all heads: a score (the
        query and key heads' width) and its share of the values (the value heads' width)."""
        qk, v = self.qk_head_dim or self.head_dim, self.v_head_dim or self.head_dim
        return 2 * self.heads * (qk + v)

    def _span_counts(self) -> list[tuple[tuple[str, int], int]]:
        """(span, layers with it), each distinct span once; every layer full attention where
        the spans are unknown or do not name every layer."""
        if self.spans is None or len(self.spans) != self.layers:
            return [(FULL, self.layers)]
        return [(span, self.spans.count(span)) for span in dict.fromkeys(self.spans)]

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
        keys = sum(count * decode_keys(prompt, new, kind, size)
                   for (kind, size), count in self._span_counts())
        context = self.attention_flops_per_pair * keys
        return prefill + rows * (new * per_token + context)


#: a full causal attention layer's span (:func:`attention_spans`)
FULL = ("full", 0)
#: transformers' layer types (``config.layer_types``) whose queries see a window of the positions
#: before them, those that see their chunk's, and those with no attention over positions
WINDOWED = ("sliding_attention", "hybrid_sliding", "reference_sliding_attention")
CHUNKED = ("chunked_attention",)
UNATTENDED = ("linear_attention", "mamba", "conv", "moe", "mlp")


def attention_spans(config, cache: bool = False) -> tuple[tuple[str, int], ...] | None:
    """Each decoder layer's attention over positions, as transformers masks it
    (``cache_utils.get_layer_types_and_kwargs`` and ``masking_utils``): ``("full", 0)``, causal
    attention over every position before; ``("window", w)``, over the ``w`` positions ending at
    the query's own (``sliding_window``); ``("chunk", c)``, over the positions before it in its
    chunk of ``c`` (``attention_chunk_size``); ``("none", 0)``, a linear-attention, recurrent,
    convolutional or MLP-only layer, whose work per token does not grow with the length. None
    where transformers cannot say (every layer then counts as full).

    Args:
        config (transformers.PretrainedConfig): the model's config.
        cache: the spans of the KV cache instead: a layer that reads another's cache (Gemma 3n's
            last ones) holds none, ``("none", 0)``, where it still attends over its own span.
    """
    config = language_model_config(config)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
    except Exception:  # noqa: BLE001 - a transformers without it, a config it cannot read
        return None
    own = getattr(config, "layer_types", None)  # before KV-sharing layers became "dummy"
    spans = []
    for i, (kind, extra) in enumerate(zip(types, kwargs)):
        size = extra.get("sliding_window")
        if kind == "dummy" and not cache and isinstance(own, (list, tuple)) \
                and len(own) == len(types):
            kind = own[i]  # (its window: the layer's own config's, the cache gives it none)
            layer = config.per_layer_config[i]
            size = getattr(layer, "attention_chunk_size" if kind in CHUNKED else "sliding_window",
                           None)
        if kind in WINDOWED and size:
            spans.append(("window", int(size)))
        elif kind in CHUNKED and size:
            spans.append(("chunk", int(size)))
        elif kind in UNATTENDED or (kind == "dummy" and cache):
            spans.append(("none", 0))
        else:
            spans.append(FULL)
    return tuple(spans)


def attended_pairs(length: int, kind: str, size: int) -> float:
    """Query-key pairs a causal mask keeps over ``length`` positions (a layer's
    :func:`attention_spans` entry, ``kind`` and ``size``), counted as the area under the keys a
    query sees: ``length**2 / 2`` under full attention (the score matrix's causal half), less in
    a window or a chunk. Within ``length / 2`` of the mask's own count, at or under it.

    Args:
        length: positions.
        kind: ``"full"``, ``"window"``, ``"chunk"`` or ``"none"``.
        size: the window's or the chunk's positions.
    """
    if kind == "none":
        return 0.0
    if kind == "window" and length > size:  # the first `size` as full, then `size` a query
        return size * size / 2 + (length - size) * size
    if kind == "chunk" and length > size:  # whole chunks, then the last one's part
        return (length // size) * size * size / 2 + (length % size) ** 2 / 2
    return length * length / 2


def decode_keys(prompt: int, new: int, kind: str, size: int) -> float:
    """Keys the ``new`` decoding steps after ``prompt`` positions attend to, summed over the steps
    (one layer's :func:`attention_spans` entry, ``kind`` and ``size``) as the area under them:
    ``prompt + t`` positions before step ``t`` and half its own under full attention, at most
    the window in a sliding layer, the current chunk's in a chunked one. Within ``new / 2`` of the
    mask's own count, at or under it.

    Args:
        prompt: prompt positions.
        new: decoding steps.
        kind: ``"full"``, ``"window"``, ``"chunk"`` or ``"none"``.
        size: the window's or the chunk's positions.
    """
    if kind == "none":
        return 0.0
    if kind == "window":  # min(prompt + t, size): growing until the window is full
        growing = min(new, max(size - prompt, 0))
        return growing * prompt + growing * growing / 2 + (new - growing) * size
    if kind == "chunk":
        return sum((prompt + t) % size for t in range(new)) + new / 2
    return new * prompt + new * new / 2


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
