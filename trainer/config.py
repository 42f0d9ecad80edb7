"""One training configuration: `TrainConfig`, read from YAML with `--set a.b.c=value` overrides.

Every field is documented where it is declared; unknown keys fail (a typo is an error, not a
silently ignored setting). `load_config("run.yaml", ["optim.lr=1e-5"])` is the entry point.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, create_model, model_validator

from masenvs.adapters.frameworks.workflow import WorkflowSpec
from masenvs.cache import DEFAULT_MODEL
from masenvs.engine.args import EngineArgs
from masenvs.overrides import ConfigError, Section, apply_override, explain
from masenvs.sampling_args import SamplingArgs
from masenvs.trainer import foreign_names
from masenvs.trainer.distributed_config import DistributedConfig
from masenvs.trainer.update_config import AlgorithmConfig, LoRAParams, OptimConfig, PolicyConfig


class ModelConfig(Section):
    """The base model every adapter is trained on."""

    name: str = Field(
        DEFAULT_MODEL,
        description=f"Base model: {DEFAULT_MODEL!r}, 'tiny' (tests), a local Hugging Face model "
        "directory or a hub id ('Qwen/Qwen3-1.7B': read from the HF cache, $HF_HOME, or "
        "downloaded into it), as `masenvs.engine.loading.load_model` accepts.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the learner runs; 'auto' picks CUDA when available."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Base weights dtype; 'auto' is float32 on CPU and bfloat16 on GPU. "
        "LoRA weights and optimizer state stay float32 either way; full fine-tuning with "
        "'auto' on a GPU keeps float32 weights and computes in bfloat16 (autocast).",
    )


class EnvSpec(Section):
    """Which environment to train in and which task seeds training draws."""

    name: str = Field("plan_path", description="A registered env (`masenvs list`).")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for `masenvs.make(name, **options)` (the env's own config).",
    )
    seed_start: int = Field(
        0,
        ge=0,
        description="First training task seed; every task uses the next seed, so training draws "
        "seeds [seed_start, seed_start + steps * rollout.tasks_per_step).",
    )


class _RolloutFields(Section):
    """How training episodes are sampled (AT-GRPO tree sampling, or independent trajectories)."""

    mode: Literal["tree", "trajectory", "no_tree"] = Field(
        "tree",
        description="'tree': AT-GRPO tree sampling (K candidates per agent per turn from one "
        "state, the best continues; with env.options.single_agent, the authors' single-agent "
        "GRPO); 'trajectory': K independent episodes per task, one answer per turn, every "
        "turn trains, grouped by group_by (masenvs' GRPO without a tree); 'no_tree': the "
        "authors' +rollout_mode=no_tree: K independent episodes per task, only the samples "
        "of the task's last turn (the largest any episode reached) train, one group per task "
        "and policy.",
    )
    group_by: Literal["turn_agent", "agent", "turn", "task"] = Field(
        "turn_agent",
        description="Advantage groups (the grouping ablation), within one policy: "
        "'turn_agent' = (task, turn, agent), the paper's; 'agent' = (task, agent); 'turn' = "
        "(task, turn): a turn's agents share a baseline; 'task' = (task): no grouping. Tree "
        "mode: each sample keeps its turn's mixed reward; trajectory mode: with 'agent' and "
        "'task' every call of an agent gets its episode return. 'no_tree' groups by task.",
    )

    @model_validator(mode="after")
    def _no_tree_groups_by_task(self) -> _RolloutFields:
        if self.mode == "no_tree" and self.group_by not in ("turn_agent", "task"):
            raise ValueError(
                f"rollout.mode 'no_tree' groups by task (the authors' group is the problem), "
                f"not by {self.group_by!r}: leave rollout.group_by out, or use rollout.mode "
                "'trajectory' for the other groupings"
            )
        return self

    branches: int = Field(
        4,
        ge=1,
        description="K: candidates each agent samples from the same state at every round; "
        "they form one advantage group (paper: 4 to 8). Trajectory mode: episodes per task.",
    )
    tasks_per_step: int = Field(8, ge=1, description="B: tasks (env seeds) per training step.")
    max_rounds: int | None = Field(
        None, ge=1, description="Round limit per episode; None keeps the env's own max_rounds."
    )
    select_by: Literal["team", "agent"] = Field(
        "agent",
        description="Which reward picks the candidate that continues: the acting agent's own "
        "mixed reward (default, as in the paper) or the team reward (ties: own reward).",
    )
    team_credit: Literal["committed", "paired"] = Field(
        "committed",
        description="Tree mode: the team term of an agent that acts before the round's last "
        "actor (plan-path's tool). 'committed': the committed path's, one constant for all K "
        "candidates (it moves no advantage); 'paired': each candidate's own, from one "
        "continuation of the round on its branch (every later agent answers once, n=1; not "
        "training samples), as the paper-time PettingLLMs paired tool k with plan k. Costs "
        "one call per later agent per candidate (train/paired_calls).",
    )
    concurrency: int = Field(
        8,
        ge=1,
        description="Tasks (or workflow runs) in flight at once; the backend batches their calls.",
    )
    seeded: bool = Field(
        True,
        description="Seed every training call from the run's seed, the step, the task, the "
        "round and the agent, so a rerun or a resumed run asks for the same candidates (the "
        "whole run repeats bit for bit with backend.batch_invariant on the embedded engine). "
        "False: each call draws its own. Tree sampling only; workflow programs make their own "
        "calls. A backend that does not honour seeds (vLLM's CPU build) gets none, said once.",
    )
    turn_order: Literal["sequential", "simultaneous"] = Field(
        "sequential",
        description="'sequential' (the paper's): within a round agents act in the env's turn "
        "order and a later agent sees what earlier agents did this round; tree sampling "
        "branches each agent in that order. 'simultaneous': every agent acts on the same "
        "observation and sees the others' actions only next round.",
    )

    @model_validator(mode="after")
    def _paired_credit_needs_a_tree(self) -> _RolloutFields:
        if self.team_credit == "paired" and self.mode != "tree":
            raise ValueError(
                "rollout.team_credit 'paired' pairs the branches of a tree: set rollout.mode "
                "to 'tree' (independent trajectories already credit each episode's own team term)"
            )
        return self


# Sampling (temperature, top_p, top_k, max_tokens, repetition_penalty) is SamplingArgs':
# declared once there, with its defaults, bounds and descriptions. Training samples above 0:
# K greedy candidates would be one answer.
RolloutConfig = create_model(
    "RolloutConfig",
    __base__=_RolloutFields,
    __module__=__name__,
    __doc__=_RolloutFields.__doc__,
    **SamplingArgs.config_fields(bounds={"temperature": {"gt": 0.0}}),
)


class _BackendClients(Section):
    """Which inference backend samples the rollouts (behind the capture endpoint)."""

    kind: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="'embedded': the in-process PyTorch engine (CPU or GPU, nothing to start); "
        "'vllm': a running `vllm serve --enable-lora` at vllm_url.",
    )
    vllm_url: str | dict[str, str] | None = Field(
        None,
        description="Root URL of a running vLLM server (kind 'vllm'), or a mapping {policy or "
        "base model name: URL} when the policies need several servers (different bases, or "
        "full fine-tuning of several policies); None: the trainer starts one server per "
        "served model (see vllm_python) and stops them at the end.",
    )
    vllm_python: str | None = Field(
        None,
        description="Python of the environment vLLM is installed in, used when the trainer "
        "starts vLLM; None: $MASENVS_VLLM_PYTHON, then $MASENVS_VLLM_BIN, then the env that "
        "scripts/vllm_cpu_env.sh builds, then `vllm` on PATH.",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments for a vLLM server the trainer starts, e.g. "
        "['--gpu-memory-utilization', '0.5'] (each server the trainer starts gets them).",
    )
    request_timeout: float = Field(
        600.0,
        gt=0.0,
        description="Seconds any one request may take: each policy call of a rollout (all K "
        "answers of a tree turn) and each request to a vLLM server.",
    )

    def engine_args(self, **run: Any) -> EngineArgs:
        """The embedded engine's options from this section, with `run` (device, threads)."""
        return EngineArgs.from_config(self, **run)


# The embedded engine's fields (max_batch_size, dtype, quantize, batch_invariant) are
# EngineArgs' own: declared once there, with their defaults, checks and descriptions.
BackendConfig = create_model(
    "BackendConfig",
    __base__=_BackendClients,
    __module__=__name__,
    __doc__=_BackendClients.__doc__,
    **EngineArgs.config_fields(),
)


class _AgentFields(Section):
    """Per-agent settings under `agents.<name>`; unset fields fall back to the run's."""

    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template of this agent's prompts, e.g. "
        "{enable_thinking: false} for Qwen3; the embedded engine and vLLM both honour them.",
    )
    lr: float | None = Field(
        None, gt=0.0, description="Peak learning rate of this agent's policy (optim.lr)."
    )
    freeze: bool = Field(
        False, description="Serve this agent but never train it (its samples are dropped)."
    )


# An agent's sampling knobs are SamplingArgs' too, each unset (None): a partial update of
# the rollout section's.
AgentConfig = create_model(
    "AgentConfig",
    __base__=_AgentFields,
    __module__=__name__,
    __doc__=_AgentFields.__doc__,
    **SamplingArgs.config_fields(optional=True, bounds={"temperature": {"gt": 0.0}}),
)


class CheckpointConfig(Section):
    """Atomic checkpoints under `<run_dir>/checkpoints`."""

    every: int = Field(10, ge=1, description="Save every N training steps (and at the end).")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept; older ones are deleted.")
    resume: bool = Field(True, description="Resume from the latest checkpoint in run_dir if any.")


class LoggingConfig(Section):
    """Where metrics go; `metrics.jsonl` in run_dir is always written."""

    tensorboard: bool = Field(True, description="Also write TensorBoard events to run_dir/tb.")
    wandb: bool = Field(False, description="Also log to Weights & Biases (if installed).")
    wandb_project: str = Field("masenvs", description="W&B project name.")
    plot_every: int = Field(
        10, ge=0, description="Redraw run_dir/curves.png every N steps; 0 only at the end."
    )
    entropy: bool = Field(
        True,
        description="Log the policy entropy of completion tokens (one extra pass over logits).",
    )
    mfu: bool = Field(
        False,
        description="After each update, time a 2048^3 fp32 matmul (~17 GFLOP) and log the "
        "update's model FLOP/s as a share of it (learner/mfu).",
    )


class ValidationConfig(Section):
    """Held-out episodes with independent chains (no branching)."""

    every: int = Field(10, ge=0, description="Validate every N training steps; 0 turns it off.")
    episodes: int = Field(32, ge=1, description="Validation episodes (one task seed each).")
    seed_start: int = Field(
        1_000_000,
        ge=0,
        description="First validation task seed; seeds [seed_start, seed_start + episodes) "
        "must not overlap the training seeds.",
    )
    temperature: float = Field(
        0.0,
        description="Sampling temperature (0 is greedy).",
        **SamplingArgs.bounds("temperature"),
    )
    env_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Env options for the validation episodes, over `env.options`: e.g. train "
        "on a curriculum of near goals (`env.options.max_distance: 2`) and validate on every "
        "task (`max_distance: null`). Env rollouts in this process only.",
    )


class ScheduleConfig(Section):
    """Which roles train when: MetaAgent-X alternates the designer and the executor."""

    alternate: list[str] = Field(
        default_factory=list,
        description="Roles that take turns training, in order, e.g. [executor, designer]; "
        "empty: every role trains every step. Roles not listed always train.",
    )
    every: int = Field(
        30, ge=1, description="Steps per phase (30 in MetaAgent-X; switching every step collapses)."
    )
    mode: Literal["phase", "lr"] = Field(
        "phase",
        description="'phase': only the phase's role trains; 'lr': every role trains, the "
        "others at off_lr_scale times their learning rate.",
    )
    off_lr_scale: float = Field(
        0.1, ge=0.0, le=1.0, description="'lr' mode: learning-rate factor of the roles off phase."
    )

    def phase(self, step: int) -> str | None:
        """The role whose phase training step `step` (1-based) is in; None without a schedule."""
        if not self.alternate:
            return None
        return self.alternate[((step - 1) // self.every) % len(self.alternate)]

    def scale(self, step: int, agent: str) -> float:
        """How much `agent` trains at `step`: 1, 0 (off phase) or off_lr_scale ('lr' mode)."""
        phase = self.phase(step)
        if phase is None or agent == phase or agent not in self.alternate:
            return 1.0
        return 0.0 if self.mode == "phase" else self.off_lr_scale


class TrainConfig(Section):
    """Everything one AT-GRPO run needs; YAML sections map to the fields below."""

    run_dir: str = Field("runs/default", description="Checkpoints, metrics and plots go here.")
    seed: int = Field(
        0,
        description="Run seed: LoRA init and mini-batch shuffles derive from it; the loop "
        "seeds python, numpy and torch with it.",
    )
    steps: int = Field(200, ge=1, description="Training steps (one rollout batch + update each).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvSpec = Field(default_factory=EnvSpec)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    lora: LoRAParams = Field(default_factory=LoRAParams)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    agents: dict[str, AgentConfig] = Field(
        default_factory=dict,
        description="Per-agent overrides by agent (role) name: sampling, chat template "
        "variables, learning rate, freezing.",
    )
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    workflow: WorkflowSpec | None = Field(
        None,
        description="Train a framework program (LangGraph, AutoGen, LlamaIndex) instead of "
        "env roles: K runs per task, groups keyed (task, agent, call index).",
    )

    def agent(self, name: str) -> AgentConfig:
        """`agents.<name>` with its unset sampling fields taken from `rollout`."""
        own = self.agents.get(name) or AgentConfig()
        return own.model_copy(update=dataclasses.asdict(self.sampling(name)))

    def sampling(self, agent: str | None = None) -> SamplingArgs:
        """How `agent` samples in training: `agents.<name>`'s knobs over `rollout`'s (all of
        `rollout`'s without an agent)."""
        run = SamplingArgs.of(self.rollout)
        own = self.agents.get(agent) if agent is not None else None
        if own is None:
            return run
        return run.replace(**{n: v for n in run.names() if (v := getattr(own, n)) is not None})

    @property
    def sample_seed(self) -> int | None:
        """The seed tree sampling derives each call's from (rollout.call_seed); None: unseeded."""
        return self.seed if self.rollout.seeded else None

    def train_seeds(self) -> range:
        """Every task seed training will draw."""
        start = self.env.seed_start
        return range(start, start + self.steps * self.rollout.tasks_per_step)

    def validation_seeds(self) -> range:
        start = self.validation.seed_start
        return range(start, start + self.validation.episodes)

    @model_validator(mode="after")
    def _seeds_do_not_overlap(self) -> TrainConfig:
        train, val = self.train_seeds(), self.validation_seeds()
        if train.start < val.stop and val.start < train.stop:
            raise ValueError(
                f"training seeds [{train.start}, {train.stop}) overlap validation seeds "
                f"[{val.start}, {val.stop}); move validation.seed_start to {train.stop} or more"
            )
        return self


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file (or start from defaults when None) and apply `a.b.c=value` overrides.

    Override values are parsed as YAML (`3`, `1e-5`, `true`, `[q_proj, v_proj]`, `null`), then the
    whole config is validated, so a wrong type or an unknown key fails with the field's path.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        data = loaded or {}
    for item in overrides or []:
        apply_override(data, item, TrainConfig)
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc, source, TrainConfig, foreign_names.hint)) from None
    check_env(config, source)
    return config


def check_env(config: TrainConfig, source: str = "config") -> None:
    """`env.name`, `env.options` and `validation.env_options` as `masenvs.make` reads them,
    checked when the config is read (a typo fails in a second, not after the model loads)."""
    from masenvs.registry import check_options, list_envs

    where = "env.name" if config.env.name not in list_envs() else "env.options"
    options = dict(config.env.options)
    if config.workflow is not None:  # workflow mode plays the solo role, one answer
        options.update(single_agent=True, max_rounds=1)
    try:
        check_options(config.env.name, options)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"invalid config ({source}): {where}: {exc}") from None
    extra = config.validation.env_options  # validation's options over env.options
    if not extra:
        return
    if config.workflow is not None or config.distributed.rollout_workers:
        why = "needs env episodes here: a workflow or distributed.rollout_workers validate with env.options"
        raise ConfigError(f"invalid config ({source}): validation.env_options {why}")
    try:
        check_options(config.env.name, options | extra)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"invalid config ({source}): validation.env_options: {exc}") from None


def save_config(config: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(config))


def config_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
