"""Rewards: each response's score.

``scoring``: the scorer that combines reward models and functions; ``reward_model``: a sequence
classifier as a reward; ``functions``: ready-made reward functions; ``remote``: rewards scored by a
service over HTTP; ``server``: a reward model served over HTTP; ``training``: reward-model training
on preference pairs; ``steps``: rewards with one value per reasoning step, placed on tokens;
``process``: process reward models (the ``prm:`` entries of ``reward.functions``); ``judge``:
language-model judges (the ``judge`` entry of ``reward.functions``); ``distillation``: a
teacher's log-probs for on-policy distillation (``reward.teacher``); ``length``: DAPO's overlong
penalty and per-source score normalisation (``reward.overlong_buffer``,
``reward.normalize_per_source``).
"""

from rlhf_torchrl.rewards import judge, process  # noqa: F401 - the judge and prm reward kinds register
