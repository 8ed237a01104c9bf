"""PPO learns: a tiny model raises a learnable synthetic reward from its base rate to near max.

The reward is the fraction of response tokens whose id is a multiple of 10: about 0.10 for a
random model, 1.00 at best. It reads the tokens from the rollout (the ``tensordict`` argument of
the reward-function contract). Everything else is the real pipeline: TorchRL env + collector,
scoring, old/ref log-probs, KL shaping, GAE, ClipPPOLoss through the replay buffer.
"""

import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.modules import (
    TokenLevelActor,
    compute_old_quantities,
    load_causal_lm,
    make_critic,
)
from rlhf_torchrl.objectives.advantages import ResponseGAE
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.rewards.scoring import Scorer
from rlhf_torchrl.trainers.update import ppo_update


def multiple_of_ten(prompts, responses, tensordict):
    tokens, mask = tensordict[K.RESPONSE_TOKENS], tensordict[K.RESPONSE_MASK]
    hits = ((tokens % 10) == 0) & mask
    return (hits.sum(-1) / mask.sum(-1).clamp_min(1)).tolist()


def test_ppo_raises_synthetic_reward(tiny_llama_dir, tokenizer):
    torch.manual_seed(0)
    policy = load_causal_lm(tiny_llama_dir, tokenizer)
    reference = load_causal_lm(tiny_llama_dir, tokenizer).eval().requires_grad_(False)
    critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")
    stop = [tokenizer.eos_token_id]
    prompts = [f"Say something about the number {i}." for i in range(64)]
    env = make_generation_env(prompts, tokenizer, batch_size=32, seed=0)
    gen = make_generation_policy(policy, tokenizer, max_new_tokens=4, temperature=1.0,
                                 stop_token_ids=stop)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=32, stop_token_ids=stop)
    scorer = Scorer({"multiple_of_ten": (multiple_of_ten, 1.0)})
    actor = TokenLevelActor(policy, temperature=1.0, trunk_critic=critic)
    ref = TokenLevelActor(reference, temperature=1.0, out_key=K.REF_LOG_PROB)
    shaper = KLRewardShaper(make_kl_controller(0.0))
    gae = ResponseGAE(gamma=1.0, lmbda=0.95)
    loss = make_ppo_loss(actor, critic, clip_epsilon=0.2, clip_value=0.2, vf_coef=0.5)
    # responses are drawn from the full 49k-token distribution (no top-k): the tiny model needs a
    # large step size to move a tenth of the vocabulary's mass within a few dozen iterations
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, eps=1e-5)
    critic_head = [p for p in critic.head.parameters()]
    optimizer.add_param_group({"params": critic_head, "lr": 1e-2})

    scores = []
    for iteration, rollout in enumerate(collector):
        policy.eval()
        scorer(rollout)
        compute_old_quantities(rollout, actor=actor, reference=ref, critic=critic, chunk_size=32)
        shaper(rollout)
        gae(rollout)
        ppo_update(rollout, loss, optimizer, num_ppo_epochs=4, num_mini_batches=4)
        scores.append(rollout[K.SCORE].mean().item())
        if iteration >= 5 and sum(scores[-3:]) / 3 > 0.9 or iteration == 39:
            break
    collector.shutdown()
    print("mean reward per iteration:", [round(x, 2) for x in scores])
    assert 0.03 < sum(scores[:2]) / 2 < 0.25, scores  # base rate ~0.10
    assert sum(scores[-3:]) / 3 > 0.9, scores
