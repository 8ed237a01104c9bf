"""Data: the prompts a run answers and the rollouts it collects.

``prompts``: a prompt and the dataset fields that travel with it; ``readers``: one reader per form
the field stores prompts in; ``prompt_sets``: rows made into prompts, mixtures of sources, and
:func:`load_prompts`; ``rollout``: the dense rollout TensorDict every stage reads; ``trajectory``:
the same rollout in TorchRL's trajectory layout (the token view).
"""

from rlhf_torchrl.data.prompt_sets import PromptSet, load_prompts
from rlhf_torchrl.data.prompts import Prompt

__all__ = ["Prompt", "PromptSet", "load_prompts"]


def __getattr__(name: str):
    """The other names of the old ``rlhf_torchrl/data.py`` (now :mod:`.prompts`), for one release."""
    from rlhf_torchrl.deprecated import forward

    return forward(__name__, "rlhf_torchrl.data", "rlhf_torchrl.data.prompts", name)
