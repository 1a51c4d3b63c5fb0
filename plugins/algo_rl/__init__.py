"""RL algorithms ``grpo``, ``ppo`` and ``turn_grpo`` (per-turn credit), and on-policy distillation ``distill``."""

from swarmkit import hookimpl
from swarmkit_plugins.algo_rl.distill_schema import DistillConfig
from swarmkit_plugins.algo_rl.schema import GRPOConfig, PPOConfig
from swarmkit_plugins.algo_rl.turn_schema import TurnGRPOConfig


@hookimpl
def register_algos(register):
    register(
        "grpo",
        "swarmkit_plugins.algo_rl.grpo:GRPO",
        schema=GRPOConfig,
        requires=("torch",),
        description="group-relative advantages, clipped surrogate, optional KL",
    )
    register(
        "ppo",
        "swarmkit_plugins.algo_rl.ppo:PPO",
        schema=PPOConfig,
        requires=("torch",),
        description="value head, GAE, clipped surrogate and value loss",
    )
    register(
        "turn_grpo",
        "swarmkit_plugins.algo_rl.turn:TurnGRPO",
        schema=TurnGRPOConfig,
        requires=("torch",),
        description="per-turn credit: call rewards, discounted returns, per-turn group baseline",
    )
    register(
        "distill",
        "swarmkit_plugins.algo_rl.distill:Distill",
        schema=DistillConfig,
        requires=("torch",),
        description="on-policy distillation: per-token advantages from a teacher endpoint's logprobs (+ rl_coef x GRPO)",
    )
