"""PPO-based RLHF for language models as a composable TorchRL pipeline."""

from . import functional, keys
from .advantages import (
    GRPOAdvantage,
    ReinforcePPAdvantage,
    ResponseGAE,
    RLOOAdvantage,
    make_advantage,
)
from .collectors import RolloutCollector, make_generation_env, make_generation_policy
from .kl_shaping import KLRewardShaper, make_kl_controller
from .modules import TokenCritic, TokenLevelActor, compute_old_quantities, make_critic
from .objectives import make_ppo_loss
from .reward_model import RewardModel
from .rollout import to_rollout
from .scoring import Scorer, load_reward_function
from .trainer import PPOTrainer
from .trajectory import merge_token_view, token_view
from .update import UpdateSettings, ppo_update

__version__ = "0.1.0"

__all__ = [
    "GRPOAdvantage",
    "RLOOAdvantage",
    "ReinforcePPAdvantage",
    "KLRewardShaper",
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
