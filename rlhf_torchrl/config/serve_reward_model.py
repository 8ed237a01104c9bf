"""The ``serve-reward-model`` command: serve a reward model over HTTP as
``serve_reward_model.yaml`` says."""

from __future__ import annotations

import importlib.util

import torch
from omegaconf import DictConfig

from rlhf_torchrl.config.model_checks import check_reward_model
from rlhf_torchrl.config.reward_model_schema import validate_serve_reward_model
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.rewards.reward_model import RewardModel
from rlhf_torchrl.runtime import resolve_device


def serve_reward_model(cfg: DictConfig) -> None:
    """Serve the reward model of ``cfg`` (``serve_reward_model.yaml``) over HTTP until
    interrupted (:func:`rlhf_torchrl.rewards.server.serve`).

    Args:
        cfg: the composed config (``serve_reward_model.yaml``).
    """
    from rlhf_torchrl.rewards.remote import bearer_token
    from rlhf_torchrl.rewards.server import serve

    validate_serve_reward_model(cfg)
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise ConfigError("serve-reward-model needs Starlette and uvicorn: "
                          "pip install 'rlhf_torchrl[serve]'.")
    token = bearer_token(cfg.token_env, "token_env")
    check_reward_model("model", cfg.model)  # config.json first: a clear line, no weights
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    reward_model = RewardModel.from_pretrained(cfg.model, dtype=cfg.dtype, batch_size=cfg.batch_size,
                                               max_length=cfg.max_length,
                                               device=resolve_device(cfg.device))
    serve(reward_model, name=cfg.model, host=cfg.host, port=cfg.port, token=token,
          max_request_bytes=int(cfg.max_request_mb * (1 << 20)),
          max_request_responses=cfg.max_request_responses, max_text_tokens=cfg.max_text_tokens,
          body_timeout=cfg.body_timeout_s, max_batch=cfg.max_batch,
          max_wait=cfg.max_wait_ms / 1000)
