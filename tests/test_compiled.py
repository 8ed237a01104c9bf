"""The compiled step (model.compile): decoder layers under torch.compile (inductor), equal to the
eager forward and backward, one graph per grad mode whatever the shapes; and the compiled decode
step (generation.compile): a static KV cache, the eager tokens, one graph for every batch."""

import copy
import shutil

import pytest
import torch
from test_objectives import _rollout

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.modules import (
    TokenLevelActor,
    compute_old_quantities,
    load_causal_lm,
    make_critic,
)
from rlhf_torchrl.modules.compiled import compile_layers, decoder_layers
from rlhf_torchrl.objectives.advantages import ResponseGAE
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.objectives.ppo import make_ppo_loss

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="inductor on CPU needs a C++ compiler (g++)")


def _iteration(policy, td, packing):
    """Old quantities (no grad), then the PPO loss's forward and backward: what a step computes."""
    critic = make_critic(policy=policy, tokenizer=None, init="shared", packing=packing)
    torch.nn.init.constant_(critic.head.weight, 0.1)
    actor = TokenLevelActor(policy, temperature=0.7, trunk_critic=critic, packing=packing)
    ref = TokenLevelActor(policy, temperature=0.7, out_key=K.REF_LOG_PROB, packing=packing)
    td = compute_old_quantities(td.clone(), actor=actor, reference=ref, critic=critic, chunk_size=8)
    KLRewardShaper(make_kl_controller(0.05))(td)
    ResponseGAE()(td)
    loss = make_ppo_loss(actor, critic)
    policy.zero_grad(set_to_none=True)
    out = loss(td)
    sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    return td.select(K.LOG_PROB, K.VALUE, K.ENTROPY), out.detach(), grads


def _assert_equal(compiled, eager):
    (td_c, loss_c, grads_c), (td_e, loss_e, grads_e) = compiled, eager
    for key in (K.LOG_PROB, K.VALUE, K.ENTROPY):
        torch.testing.assert_close(td_c[key], td_e[key], atol=1e-5, rtol=1e-5)
    for key in ("loss_objective", "loss_critic"):
        torch.testing.assert_close(loss_c[key], loss_e[key], atol=1e-6, rtol=1e-5)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@needs_compiler
def test_compiled_step_equals_eager_and_other_lengths_do_not_recompile(tiny_llama_dir, tokenizer):
    """Two iterations of other batch sizes and widths, padded and packed: the compiled layers give
    the eager log-probs, values, losses and gradients, and the second iteration compiles nothing
    (dynamic shapes: one graph for the no-grad forward, one for the training forward)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = load_causal_lm(tiny_llama_dir, tokenizer)
    policy = copy.deepcopy(eager)
    assert compile_layers(policy) == len(decoder_layers(policy)) == 2
    first, second = _rollout(tokenizer, B=8, P=5, R=6), _rollout(tokenizer, B=6, P=7, R=4, seed=1)
    for packing in (False, True):
        _assert_equal(_iteration(policy, first, packing), _iteration(eager, first, packing))
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 4  # grad and no grad; a packed batch may give one more each
    for packing in (False, True):
        _assert_equal(_iteration(policy, second, packing), _iteration(eager, second, packing))
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    # generate (a KV cache) and any call outside compiled_region run the eager layers
    with torch.no_grad():
        policy.generate(first[K.PROMPT_TOKENS][:2], attention_mask=first[K.PROMPT_MASK][:2].long(),
                        max_new_tokens=3, do_sample=False)
    assert counters["stats"]["unique_graphs"] == graphs
    assert policy.state_dict().keys() == eager.state_dict().keys()  # checkpoints unchanged


@pytest.mark.slow
@needs_compiler
def test_recipe_packed_and_compiled(tmp_path, tiny_llama_dir):
    """model.packing=true, model.compile=true and generation.compile=true through the recipe's
    builders: the on-policy check (log-probs recorded by the compiled decode step against the
    packed, compiled training forward) passes, token-budget micro-batches of real tokens train,
    the metrics are finite and the weights move."""
    import json
    import math

    from test_recipe import _cfg, ppo

    ppo.train(_cfg(tmp_path, tiny_llama_dir, "model.packing=true", "model.compile=true",
                   "generation.compile=true", "ppo.micro_batch_tokens=64",
                   "value_model.init=policy"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(math.isfinite(r["loss/policy_avg"]) and math.isfinite(r["loss/value_avg"])
               for r in rows)
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _sample(model, tokenizer, prompts, static_cache_len):
    env = make_generation_env(prompts, tokenizer, batch_size=4, seed=3)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=6, temperature=0.7,
                                 record_log_probs=True, static_cache_len=static_cache_len)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=4, seed=7,
                                 total_batches=2)
    rollouts = list(collector)
    collector.shutdown()
    return rollouts


@pytest.mark.slow
@needs_compiler
def test_compiled_decode_draws_eager_tokens_and_compiles_once(tiny_llama_dir, tokenizer):
    """generation.compile: a static KV cache and transformers' compiled decode step draw the
    eager dynamic-cache decoding's tokens from the same row streams, with its log-probs to fp32
    rounding, and wider prompts compile nothing more: the cache's shape is fixed by
    ``static_cache_len``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = load_causal_lm(tiny_llama_dir, tokenizer)
    short = [f"Prompt {i}" for i in range(8)]
    long = [f"A longer prompt {i} " + "word " * 12 for i in range(8)]
    eager = _sample(model, tokenizer, short, None) + _sample(model, tokenizer, long, None)
    widths = [r.get(K.PROMPT_TOKENS).shape[1] for r in eager]
    assert widths[0] < widths[-1]  # the long prompts' batches are wider
    assert counters["stats"]["unique_graphs"] == 0
    compiled = _sample(model, tokenizer, short, 96)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # it did compile
    compiled += _sample(model, tokenizer, long, 96)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    for e, c in zip(eager, compiled):
        assert torch.equal(e.get(K.RESPONSE_TOKENS), c.get(K.RESPONSE_TOKENS))
        torch.testing.assert_close(c.get(K.LOG_PROB), e.get(K.LOG_PROB), atol=1e-5, rtol=0)
