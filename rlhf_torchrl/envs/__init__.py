"""Environments: what the policy acts in.

``prompt_env``: the prompt environment (TorchRL's ``ChatEnv`` over this process's share of each
batch); ``tools``: the tools a policy may call in a multi-turn episode; ``sandbox``: where the
``python`` tool runs the policy's programs.
"""
