"""masenvs: multi-agent LLM environments, trace capture and AT-GRPO training."""

from masenvs.env import EnvConfig, MASEnv, RewardParts, RewardWeights, Snapshot, play_round
from masenvs.registry import env_class, list_envs, make, register

__all__ = [
    "EnvConfig",
    "MASEnv",
    "RewardParts",
    "RewardWeights",
    "Snapshot",
    "env_class",
    "list_envs",
    "make",
    "play_round",
    "register",
]
__version__ = "0.1.0"
