"""PPO-based RLHF for language models as a composable TorchRL pipeline."""

from rlhf_torchrl import deprecated, functional, keys
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.data.rollout import to_rollout
from rlhf_torchrl.data.trajectory import merge_token_view, token_view
from rlhf_torchrl.modules import TokenCritic, TokenLevelActor, compute_old_quantities, make_critic
from rlhf_torchrl.objectives.advantages import (
    GRPOAdvantage,
    OnTokenView,
    ReinforcePPAdvantage,
    ResponseGAE,
    RLOOAdvantage,
    make_advantage,
)
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.rewards.reward_model import RewardModel
from rlhf_torchrl.rewards.scoring import Scorer, load_reward_function
from rlhf_torchrl.trainers.ppo import PPOTrainer
from rlhf_torchrl.trainers.update import UpdateSettings, ppo_update

__version__ = "0.1.0"

deprecated.install()  # the flat layout's module names, for one release

__all__ = [
    "GRPOAdvantage",
    "RLOOAdvantage",
    "ReinforcePPAdvantage",
    "KLRewardShaper",
    "OnTokenView",
    "PPOTrainer",
    "ResponseGAE",
    "RewardModel",
    "RolloutCollector",
    "Scorer",
    "TokenCritic",
    "TokenLevelActor",
    "UpdateSettings",
    "compute_old_quantities",
    "functional",
    "keys",
    "load_reward_function",
    "make_advantage",
    "make_critic",
    "make_generation_env",
    "make_generation_policy",
    "make_kl_controller",
    "make_ppo_loss",
    "merge_token_view",
    "ppo_update",
    "to_rollout",
    "token_view",
]
