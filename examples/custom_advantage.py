"""An advantage estimator of your own, plugged into the trainer.

A group-median baseline: each response's advantage is its return minus the median return of the
responses to the same prompt (robust to one lucky or broken sample in a group). Any TensorDict
module that writes "advantage" (B, R, 1) fits; one that reads no "state_value" gets no critic.

    python examples/custom_advantage.py                              # the arithmetic task
    python examples/custom_advantage.py ppo.num_iterations=5 output_dir=outputs/median
"""

import sys

import torch
from tensordict.nn import TensorDictModuleBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.config import builders, compose


class GroupMedianAdvantage(TensorDictModuleBase):
    """``A_it = G_it - median_g(R)``: the return-to-go against the group's median return."""

    def __init__(self):
        super().__init__()
        self.in_keys = [K.REWARD, K.RESPONSE_MASK, K.GROUP]
        self.out_keys = [K.ADVANTAGE]

    def forward(self, td):
        mask = td.get(K.RESPONSE_MASK)
        returns = F.returns_to_go(td.get(K.REWARD).squeeze(-1), mask)
        total, groups = returns[:, 0], td.get(K.GROUP)
        median = torch.empty_like(total)
        for group in groups.unique():
            rows = groups == group
            median[rows] = total[rows].median()
        advantage = torch.where(mask, returns - median.unsqueeze(-1), 0.0)
        td.set(K.ADVANTAGE, advantage.unsqueeze(-1))
        return td


if __name__ == "__main__":
    cfg = compose(["task=arithmetic", "generation.samples_per_prompt=4",
                   "output_dir=outputs/custom_advantage", *sys.argv[1:]])
    trainer = builders.build_trainer(cfg, advantage=GroupMedianAdvantage())
    assert trainer.critic is None  # the module reads no values: no value model was built
    report = trainer.fit()
    print("held-out accuracy:", report["eval_before"]["eval/accuracy"], "->",
          report["eval_after"]["eval/accuracy"])
