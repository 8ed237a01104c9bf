"""TorchRL's own GAE and ClipPPOLoss in your own loop, on the library's rollouts.

The rollout is one row per response with (B, R) token entries; ``token_view`` gives it in
TorchRL's trajectory layout (batch (B, R), the response tokens as time steps, ``done`` at each
response's last token), where ``torchrl.objectives.value.GAE`` runs unchanged, and
``merge_token_view`` brings its advantages back. The loss is a plain ``ClipPPOLoss``, given the
rollout's keys and the response mask (three lines): without the mask it would average over pads.

    python examples/torchrl_gae_loop.py                       # SmolLM2-135M-Instruct, offline
    python examples/torchrl_gae_loop.py --model path/to/model --iterations 2
"""

import argparse

import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from rlhf_torchrl import (
    KLRewardShaper,
    RolloutCollector,
    Scorer,
    TokenLevelActor,
    compute_old_quantities,
    make_critic,
    make_generation_env,
    make_generation_policy,
    make_kl_controller,
    merge_token_view,
    ppo_update,
    token_view,
)
from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.data import load_prompts
from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
from rlhf_torchrl.rewards.functions import vader_sentiment

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m-instruct")
parser.add_argument("--iterations", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=16, help="responses per iteration")
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

torch.manual_seed(0)
tokenizer = load_tokenizer(args.model)
policy = load_causal_lm(args.model, tokenizer)
reference = load_causal_lm(args.model, tokenizer).requires_grad_(False)
critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")  # a head on the trunk

env = make_generation_env(load_prompts("polarity", max_words=8), tokenizer,
                          batch_size=args.batch_size)
sampler = make_generation_policy(policy, tokenizer, max_new_tokens=args.max_new_tokens,
                                 temperature=0.7, record_log_probs=True)
collector = RolloutCollector(env, sampler, tokenizer=tokenizer, seed=0)  # the env's batch size
scorer = Scorer({"sentiment": (vader_sentiment, 1.0)})
actor = TokenLevelActor(policy, temperature=0.7, trunk_critic=critic)
ref_actor = TokenLevelActor(reference, temperature=0.7, out_key=K.REF_LOG_PROB)
shaper = KLRewardShaper(make_kl_controller(0.05))  # -0.05 KL per token, the score at the last
gae = GAE(gamma=1.0, lmbda=0.95, value_network=None)  # TorchRL's, reading "state_value"

loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, clip_value=0.2, critic_coeff=0.05,
                   loss_critic_type="l2", entropy_bonus=False, functional=False)
loss.set_keys(action=K.RESPONSE_TOKENS, sample_log_prob=K.LOG_PROB)  # the rollout's entries
loss.loss_mask_key = K.RESPONSE_MASK  # averages over response tokens, not pads
optimizer = torch.optim.AdamW(loss.parameters(), lr=3e-6)

for iteration, rollout in zip(range(args.iterations), collector):
    scorer(rollout)  # "score" (B,)
    compute_old_quantities(rollout, actor=actor, reference=ref_actor, critic=critic)
    shaper(rollout)  # ("next", "reward") (B, R, 1)
    view = token_view(rollout)  # batch (B, R): TorchRL's trajectory layout
    gae(view)  # "advantage", "value_target" on the view
    merge_token_view(rollout, view)  # back to (B, R, 1) entries of the rollout, 0 on pads
    mask = rollout.get(K.RESPONSE_MASK)
    advantage = F.masked_whiten(rollout.get(K.ADVANTAGE).squeeze(-1), mask)  # over real tokens
    rollout.set(K.ADVANTAGE, torch.where(mask, advantage, 0.0).unsqueeze(-1))
    stats = ppo_update(rollout, loss, optimizer, num_ppo_epochs=1, num_mini_batches=2)
    print(f"iteration {iteration}: score {rollout['score'].mean():+.3f}, "
          f"policy loss {stats['loss/policy_avg']:+.4f}, value loss {stats['loss/value_avg']:.4f}",
          flush=True)
collector.shutdown()
