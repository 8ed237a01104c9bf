"""RLOO in your own loop, from the library's components (no trainer, no config).

Four responses to each prompt, scored for positive sentiment; each response's advantage is its
score against the mean of the other three (leave-one-out), the KL to the reference sits in the
loss, and the update is the PPO-clipped one on a critic-free loss.

    python examples/rloo_loop.py                       # SmolLM2-135M-Instruct, offline
    python examples/rloo_loop.py --model path/to/model --iterations 2
"""

import argparse

import torch

from rlhf_torchrl import (
    KLRewardShaper,
    RLOOAdvantage,
    RolloutCollector,
    Scorer,
    TokenLevelActor,
    compute_old_quantities,
    make_generation_env,
    make_generation_policy,
    make_kl_controller,
    make_ppo_loss,
    ppo_update,
)
from rlhf_torchrl import keys as K
from rlhf_torchrl.data import load_prompts
from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
from rlhf_torchrl.objectives.advantages import group_metrics
from rlhf_torchrl.rewards.functions import vader_sentiment

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m-instruct")
parser.add_argument("--iterations", type=int, default=10)
parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

torch.manual_seed(0)
tokenizer = load_tokenizer(args.model)
policy = load_causal_lm(args.model, tokenizer)
reference = load_causal_lm(args.model, tokenizer).requires_grad_(False)
batch = args.prompts * args.samples  # responses per iteration

# Collect: a TorchRL ChatEnv serving each prompt `samples` times in a row, and a collector drawing
# every response from its own random stream; log-probs are recorded while sampling.
prompts = load_prompts("polarity", max_words=8)
env = make_generation_env(prompts, tokenizer, batch_size=batch, samples_per_prompt=args.samples)
sampler = make_generation_policy(policy, tokenizer, max_new_tokens=args.max_new_tokens,
                                 temperature=0.7, record_log_probs=True)
collector = RolloutCollector(env, sampler, tokenizer=tokenizer, seed=0,  # the env's batch size
                             samples_per_prompt=args.samples)

scorer = Scorer({"sentiment": (vader_sentiment, 1.0)})
actor = TokenLevelActor(policy, temperature=0.7)
ref_actor = TokenLevelActor(reference, temperature=0.7, out_key=K.REF_LOG_PROB)
shaper = KLRewardShaper(make_kl_controller(0.0))  # no KL in the reward: it is in the loss
advantage = RLOOAdvantage()
loss = make_ppo_loss(actor, kl_loss_coef=0.05)  # no critic: no value term
optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-6)

for iteration, rollout in zip(range(args.iterations), collector):
    scorer(rollout)  # "score" (B,)
    compute_old_quantities(rollout, actor=actor, reference=ref_actor)  # reference log-probs
    shaper(rollout)  # per-token rewards: the score at the last response token
    advantage(rollout)  # "advantage" (B, R, 1): score minus the leave-one-out group mean
    stats = ppo_update(rollout, loss, optimizer, num_ppo_epochs=1, num_mini_batches=2)
    groups = group_metrics(rollout)
    print(f"iteration {iteration}: score {rollout['score'].mean():+.3f}, "
          f"within-group std {groups['group/score_std']:.3f}, "
          f"KL to reference {stats['policy/kl_to_ref_avg']:.4f}, "
          f"policy loss {stats['loss/policy_avg']:+.4f}", flush=True)
collector.shutdown()
