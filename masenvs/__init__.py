"""masenvs: multi-agent LLM environments, trace capture and AT-GRPO training."""

from masenvs.env import (
    EnvConfig,
    EnvConfigError,
    IgnoredActionsWarning,
    MASEnv,
    RewardParts,
    RewardWeights,
    Snapshot,
    play_round,
)
from masenvs.registry import env_class, list_envs, make, register
from masenvs.wrappers import GymnasiumEnv, make_vec

__all__ = [
    "EnvConfig",
    "EnvConfigError",
    "GymnasiumEnv",
    "IgnoredActionsWarning",
    "MASEnv",
    "RewardParts",
    "RewardWeights",
    "Snapshot",
    "env_class",
    "list_envs",
    "make",
    "make_vec",
    "play_round",
    "register",
]
__version__ = "0.1.0"
