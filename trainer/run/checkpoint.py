"""Atomic checkpoints: a run killed at any moment resumes with no lost or repeated step.

    <run_dir>/checkpoints/
        step_00000012/
            adapters/<policy>/adapter_config.json, adapter_model.safetensors   (peft / vLLM)
            models/<policy>/config.json, model.safetensors, tokenizer   (full fine-tuning)
            learner.pt     optimizer states per policy + LR schedule position
            sharded/       instead of learner.pt, from a distributed learner: each rank's
                           shards of trainable weights and AdamW states (torch DCP), the
                           schedule position (learner.json) and each rank's RNG
            rng.pt         torch CPU (and CUDA) generator states
            rng.json       python and numpy generator states
            state.json     step, next task seed, extra loop state
            config.yaml    the run's TrainConfig
        latest             name of the newest complete checkpoint

A checkpoint is written into a hidden temp directory, every file fsynced, then renamed into
place (rename is atomic), so a `step_*` directory is always complete. `latest` is replaced
atomically afterwards. Saving a step that exists (a resumed run saving it again) swaps the
two directories in one `renameat2(RENAME_EXCHANGE)`; where the OS has no such call, the old
one is moved aside first and `list_checkpoints` finds it there until the new one is in place,
so a kill at any moment leaves the step loadable.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import shutil
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from masenvs.trainer.config import TrainConfig, config_yaml

if TYPE_CHECKING:  # torch is imported on use: `masenvs train` checks run_dir before it loads
    from masenvs.trainer.learner.learner import Learner

CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters"  # LoRA: one peft directory per policy
MODELS = "models"  # full fine-tuning: one Hugging Face model directory per trained policy
LATEST = "latest"
SHARDED = "sharded"  # a distributed learner's DCP shards (any world size reads them)
_PREFIX = "step_"
_ASIDE = ".old-"  # a step directory moved aside while a save of the same step replaces it


@dataclass
class TrainState:
    """Where the training loop is: what a resumed run needs besides weights and RNG."""

    step: int  # training steps completed; the resumed run continues with step + 1
    next_task_seed: int  # data position: the first task seed the next step draws
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable loop state


@dataclass
class Checkpoint:
    """A complete checkpoint directory; `restore(learner)` puts its contents back."""

    path: Path
    state: TrainState

    def restore(self, learner: Learner) -> TrainState:
        """Load weights, optimizer states, LR schedule position and RNG states."""
        import torch

        load_policy_weights(learner, self.path)
        if (self.path / SHARDED).is_dir():  # written by a distributed learner
            if getattr(learner, "sharded", False):
                learner.load_sharded(self.path / SHARDED)  # type: ignore[attr-defined]
            else:
                from masenvs.trainer.learner.rank_learner import load_sharded_optimizers

                load_sharded_optimizers(learner, self.path / SHARDED)
        else:
            learner.load_state_dict(torch.load(self.path / "learner.pt", weights_only=True))
        _set_rng(self.path)
        return self.state

    def config(self) -> TrainConfig:
        from masenvs.trainer.config import load_config

        return load_config(self.path / "config.yaml")


def save_checkpoint(
    run_dir: str | Path,
    learner: Learner,
    state: TrainState,
    config: TrainConfig | None = None,
    keep_last: int = 3,
) -> Path:
    """Write a checkpoint of `state.step` atomically and keep only the newest `keep_last`."""
    import torch

    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"{_PREFIX}{state.step:08d}"
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for policy in learner.policies:
            if learner.full:
                if learner.trains(policy):
                    learner.save_model(policy, tmp / MODELS / policy)
            else:
                learner.save_adapter(policy, tmp / ADAPTERS / policy)
        if getattr(learner, "sharded", False):  # each rank writes its own shards
            learner.save_sharded(tmp / SHARDED)  # type: ignore[attr-defined]
        else:
            torch.save(learner.state_dict(), tmp / "learner.pt")
        _save_rng(tmp)
        if config is not None:
            (tmp / "config.yaml").write_text(config_yaml(config))
        # state.json last: its presence marks the content complete (checked on load).
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    final = root / name
    _restore_moved_aside(root)
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):  # the same step saved before: one atomic swap, old now at tmp
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # no atomic swap here: `list_checkpoints` finds the old one aside until the rename
        old = root / f"{_ASIDE}{name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _fsync(root)
    _write_atomic(root / LATEST, name + "\n")
    _prune(root, keep_last, keep=final)
    return final


def load_latest(run_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint of a run, or None if it has none.

    The newest `step_*` directory wins even when `latest` lags behind it (a crash between
    the rename and the pointer update): a renamed directory is complete by construction.
    """
    steps = list_checkpoints(run_dir)
    if not steps:
        return None
    path = steps[-1]
    state = json.loads((path / "state.json").read_text())
    return Checkpoint(path=path, state=TrainState(**state))


def load_policy_weights(learner: Learner, path: Path) -> None:
    """The weights a checkpoint directory holds for each policy (LoRA adapters, or trained full
    models), put into `learner`."""
    for policy in learner.policies:
        if learner.full:
            if learner.trains(policy):  # frozen models are the base: not saved
                learner.load_model(policy, path / MODELS / policy)
        else:
            learner.load_adapter(policy, path / ADAPTERS / policy)


def load_weights(learner: Learner, source: str | Path) -> None:
    """The policies' weights of `source` (a run, its newest checkpoint, or one `step_*`
    directory) put into `learner`, not its optimizer states (`masenvs sft --init-from`)."""
    from masenvs.trainer.config import ConfigError

    source = Path(source)
    latest = None if (source / "state.json").is_file() else load_latest(source)
    path = source if latest is None else latest.path
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"--init-from {source}: no checkpoint there (a run directory or a step_*)"
        )
    try:
        load_policy_weights(learner, path)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError(
            f"--init-from {path} does not fit this config ({exc}); use the same model, policies "
            "and lora settings as the run that wrote it"
        ) from exc


def rl_start(state: TrainState, cfg: TrainConfig) -> TrainState:
    """The state RL goes on from: an SFT checkpoint (step 0) holds no RL data position, so RL
    from it draws its tasks from this config's `env.seed_start`, not the SFT run's."""
    if state.step == 0 and "sft" in state.extra:
        return TrainState(step=0, next_task_seed=cfg.env.seed_start, extra=state.extra)
    return state


def resume_warning(state: TrainState, cfg: TrainConfig) -> str | None:
    """What resuming this state with cfg does that a user would not expect, if anything."""
    if "sft" in state.extra and cfg.algorithm.kl_coef > 0.0:
        return (
            f"warning: this run starts from an SFT checkpoint and algorithm.kl_coef="
            f"{cfg.algorithm.kl_coef:g}: the KL penalty's reference is the base model, not the SFT "
            "weights, so it pulls the policy back toward the base and undoes the fine-tune step "
            "by step; set algorithm.kl_coef=0 to keep what SFT taught (docs/learning.md, cold start)"
        )
    return None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (a step's directory moved aside by a
    save killed mid-replace stands in for it)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in root.iterdir():
        if not (p.is_dir() and (p / "state.json").is_file()):
            continue
        if p.name.startswith(_PREFIX):
            found[_step_of(p.name)] = p
        elif p.name.startswith(_ASIDE + _PREFIX):
            found.setdefault(_step_of(p.name[len(_ASIDE) :].split("-")[0]), p)
    return [found[step] for step in sorted(found)]


def _step_of(name: str) -> int:
    return int(name[len(_PREFIX) :])


def _restore_moved_aside(root: Path) -> None:
    """Put back a step directory that a killed save moved aside and never replaced."""
    for aside in root.glob(f"{_ASIDE}{_PREFIX}*"):
        final = root / aside.name[len(_ASIDE) :].split("-")[0]
        if (aside / "state.json").is_file() and not final.exists():
            os.rename(aside, final)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the OS or
    the file system cannot."""
    if sys.platform != "linux":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc before 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    for stale in root.glob(".tmp-*"):  # left by a crashed save
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    complete = list_checkpoints(root.parent)
    for path in complete[: max(0, len(complete) - keep_last)]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


# -- RNG ---------------------------------------------------------------------------------------


def _save_rng(directory: Path) -> None:
    import torch

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    (directory / "rng.json").write_text(
        json.dumps(
            {
                "python": [version, list(mt), gauss],
                "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            }
        )
    )
    torch_state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        torch_state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(torch_state, directory / "rng.pt")


def _set_rng(directory: Path) -> None:
    import torch

    saved = json.loads((directory / "rng.json").read_text())
    version, mt, gauss = saved["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch_state = torch.load(directory / "rng.pt", weights_only=True)
    torch.set_rng_state(torch_state["cpu"])
    if "cuda" in torch_state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(torch_state["cuda"])


# -- durability --------------------------------------------------------------------------------


def _fsync_tree(directory: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(directory):
        for filename in filenames:
            _fsync(Path(dirpath) / filename)
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)
