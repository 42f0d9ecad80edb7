"""TrainConfig: YAML plus `a.b.c=value` overrides, typed, with typos and overlaps rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from masenvs.trainer.config import ConfigError, TrainConfig, load_config, save_config

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_run_as_they_are() -> None:
    cfg = load_config()
    assert cfg == TrainConfig()
    assert cfg.algorithm.clip_low == 0.2 and cfg.policy.mode == "per_agent"


def test_yaml_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "steps: 50\n"
        "rollout:\n  branches: 8\n"
        "algorithm:\n  clip_high: 0.28\n"
        "policy:\n  mode: shared\n"
    )
    cfg = load_config(
        path, ["optim.lr=3e-6", "lora.target_modules=[q_proj, v_proj]", "algorithm.clip_c=null"]
    )
    assert cfg.steps == 50 and cfg.rollout.branches == 8 and cfg.algorithm.clip_high == 0.28
    assert cfg.optim.lr == 3e-6 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.algorithm.clip_c is None
    assert cfg.policy.policy_of("coder") == "shared"


def test_saved_config_loads_back_identical(tmp_path: Path) -> None:
    cfg = load_config(None, ["env.options={size: 4}", "policy.models={coder: tiny}", "seed=3"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.clip_lwo=0.1", "algorithm.clip_lwo: unknown field (did you mean 'clip_low'?)"),
        ("optim.lr=fast", "optim.lr: Input should be a valid number"),
        ("rollout.branches=0", "rollout.branches: Input should be greater than or equal to 1"),
        (
            "policy.mode=every_agent",
            "policy.mode: Input should be 'shared', 'per_agent' or 'separate'",
        ),
        ("algorithm.clip_c=1.1", "must exceed 1 + clip_high"),
        ("lr=1", "lr: unknown field"),
        ("optim.lr", "must look like section.field=value"),
        ("steps.max=3", "steps is a value, not a section"),
    ],
)
def test_bad_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_training_and_validation_seeds_must_not_overlap() -> None:
    with pytest.raises(ConfigError, match=r"training seeds \[0, 1600\) overlap validation seeds"):
        load_config(None, ["validation.seed_start=1500"])
    cfg = load_config(None, ["validation.seed_start=1600"])  # adjacent is fine
    assert cfg.train_seeds().stop == cfg.validation_seeds().start


def test_missing_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad)


def test_per_agent_policies_follow_agent_order() -> None:
    cfg = load_config(None, ["policy.mode=per_agent"])
    assert cfg.policy.policies(["tool", "plan"]) == ["tool", "plan"]
    assert load_config(None, ["policy.mode=shared"]).policy.policies(["tool", "plan"]) == ["shared"]


# What a run's peak memory grows with, and the default each setting has, with the reason.
# A run on defaults (plan_path, 2 tasks, SmolLM2) peaked at 5.4-6.2 GB with 4096-token
# micro-batches; the main job (examples/quickstart.yaml) at 2.9 GB (docs/memory.md).
MEMORY_DEFAULTS = {
    # ~1.4 MB of fp32 activations per fed token (SmolLM2-135M): ~0.7 GB at 512, ~5.7 at 4096.
    "optim.max_tokens_per_microbatch": 512,
    # a chunk's fp32 logits (49k vocab: 0.2 MB per token), their log-softmax and softmax.
    # 128, not 256: ~95 MB less in a checkpointed update of 512-token answers, at no
    # measured cost, which puts a run on defaults under the main job (docs/memory.md).
    "optim.logprob_chunk_tokens": 128,
    # recomputed in the backward: a 512-token answer goes whole into a micro-batch, whose
    # kept activations (~0.9 GB) put a run on defaults over the main job (issue 44).
    "optim.gradient_checkpointing": True,
    # float32 on CPU, as the main job; bfloat16 on a GPU.
    "model.dtype": "auto",
    # KV rows grow on demand with the sequences in flight; the main job's limit.
    "backend.max_batch_size": 32,
    # tasks in flight: 8 x K=4 sequences in the engine (the main job: 32 x 4 in validation).
    "rollout.concurrency": 8,
    # 2 adapters x 4.9 M parameters x 4 fp32 copies: 150 MB (rank 8: 75 MB).
    "lora.rank": 16,
    # long answers cost update time and KV rows, not the peak: micro-batches bound that.
    "rollout.max_tokens": 512,
}


def _field(cfg: object, path: str) -> object:
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


@pytest.mark.parametrize("path", MEMORY_DEFAULTS)
def test_memory_defaults_are_the_bounded_ones(path: str) -> None:
    assert _field(TrainConfig(), path) == MEMORY_DEFAULTS[path]


def test_defaults_feed_no_more_per_step_than_the_main_job() -> None:
    """The update's bounds are no larger on defaults than in the main job, so a run on
    defaults stays near its memory (one sequence longer than the budget still goes whole)."""
    defaults, main = TrainConfig(), load_config(ROOT / "examples" / "quickstart.yaml")
    budget = "optim.max_tokens_per_microbatch"
    assert _field(defaults, budget) <= _field(main, budget)
    for path in ("optim.logprob_chunk_tokens", "backend.max_batch_size", "rollout.concurrency"):
        assert _field(defaults, path) <= _field(main, path), path
    assert _field(defaults, "model.dtype") == _field(main, "model.dtype")
