"""The learner on torch.distributed: `world_size` rank processes, one training step together.

    trainer process                        rank processes (spawned, one per GPU or CPU slot)
    DistributedLearner (the facade)  --->  RankLearner: a Learner + a process group
      step / logprobs / weights / save       policy models sharded with FSDP2 ('fsdp') or
      every call has learner.timeout         replicated with one gradient all-reduce ('ddp')

Every rank gets the whole batch and takes its share of each optimizer step's samples (whole
prompt units, balanced by tokens). The loss stays the token mean over the *global* batch, and
gradients are summed over ranks, so the update equals the one-process `Learner`'s on the same
batch up to float summation order. Checkpoints: `save_sharded` writes each rank's shards
(trainable weights, AdamW state) with torch.distributed.checkpoint (DCP), which reshards on
load, so a run resumes on another world size; `load_sharded_optimizers` reads such a
checkpoint into a one-process `Learner` (both in `masenvs.trainer.learner.rank_learner`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from masenvs.trainer.config import TrainConfig
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.learner.policies import load_base_model, resolve_device
from masenvs.trainer.learner.rank_learner import SHARDED_META, PolicyInfo, rank_main
from masenvs.trainer.samples import Sample


class LearnerRankError(RuntimeError):
    """A learner rank died, raised, or did not answer within `distributed.learner.timeout`."""


def make_learner(cfg: TrainConfig, agents: Sequence[str]) -> Learner | DistributedLearner:
    """The run's learner: in this process, or on `distributed.learner.world_size` ranks."""
    if cfg.distributed.learner.world_size > 1:
        return DistributedLearner(cfg, agents)
    return Learner(cfg, agents)


# ---------------------------------------------------------------------------------------------
# The facade, in the trainer process
# ---------------------------------------------------------------------------------------------


class DistributedLearner:
    """`Learner`'s interface, run by `world_size` rank processes on torch.distributed."""

    sharded = True  # checkpoint.py: write DCP shards instead of learner.pt

    def __init__(
        self,
        cfg: TrainConfig,
        agents: Sequence[str],
        load_base: Any = load_base_model,
    ) -> None:
        self.cfg = cfg
        self.agents = list(agents)
        self.full = cfg.policy.finetune == "full"
        self.device = resolve_device(cfg.model.device)
        dcfg = cfg.distributed.learner
        self.world_size = dcfg.world_size
        self.timeout = dcfg.timeout
        backend = dcfg.backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(
                "distributed.learner.backend is nccl but model.device is cpu; use gloo or auto"
            )
        if self.device.type == "cuda" and torch.cuda.device_count() < self.world_size:
            raise ValueError(
                f"distributed.learner.world_size={self.world_size} needs one GPU per rank but "
                f"{torch.cuda.device_count()} are visible; lower world_size"
            )
        ctx = _rank_context()
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.processes: list[Any] = []
        self._conns: list[Any] = []
        self._closed = False
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(rank, self.world_size, backend, address, cfg, self.agents, load_base, child),
                name=f"learner-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.processes.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns)
        info = self._collect("start")  # model loading and sharding happen now
        self.policies: dict[str, PolicyInfo] = {p.name: p for p in info["policies"]}
        self.steps_done = 0

    # -- the Learner interface the trainer uses -----------------------------------------------

    def policy_of(self, agent: str) -> str:
        return self.cfg.policy.policy_of(agent)

    def trains(self, policy: str) -> bool:
        return not self._info(policy).frozen

    def step(
        self, samples: list[Sample], lr_scale: dict[str, float] | None = None
    ) -> dict[str, float]:
        metrics = self._call("step", samples, lr_scale)
        self.steps_done += 1
        return metrics

    def logprobs(
        self, policy: str, samples: Sequence[Sample], base: bool = False
    ) -> list[torch.Tensor]:
        return self._call("logprobs", policy, list(samples), base)

    def adapter_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        return self._call("adapter_state_dict", policy)

    def full_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        return self._call("full_state_dict", policy)

    def save_adapter(self, policy: str, directory: str | Path) -> Path:
        return self._call("save_adapter", policy, str(directory))

    def save_model(self, policy: str, directory: str | Path) -> Path:
        return self._call("save_model", policy, str(directory))

    def load_adapter(self, policy: str, directory: str | Path) -> None:
        self._call("load_adapter", policy, str(directory))

    def load_model(self, policy: str, directory: str | Path) -> None:
        self._call("load_model", policy, str(directory))

    def state_dict(self) -> dict[str, Any]:
        """The one-process format (`Learner.state_dict`), gathered on rank 0."""
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a one-process `Learner.state_dict` (a checkpoint of a world-size-1 run)."""
        self._call("load_state_dict", state)
        self.steps_done = int(state["steps_done"])

    def save_sharded(self, directory: str | Path) -> None:
        """Every rank writes its shards of the trainable weights and AdamW states (DCP)."""
        self._call("save_sharded", str(directory))

    def load_sharded(self, directory: str | Path) -> None:
        """Load a `save_sharded` checkpoint of any world size (DCP reshards)."""
        self._call("load_sharded", str(directory))
        self.steps_done = json.loads((Path(directory) / SHARDED_META).read_text())["steps_done"]

    def close(self) -> None:
        """Stop the ranks (also at exit and on garbage collection)."""
        self._closed = True
        self._finalizer()

    # -- talking to the ranks -------------------------------------------------------------------

    def _info(self, policy: str) -> PolicyInfo:
        if policy not in self.policies:
            raise KeyError(f"unknown policy {policy!r}; policies are {sorted(self.policies)}")
        return self.policies[policy]

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise LearnerRankError(
                "the distributed learner is closed (a rank failed before, or close() ran); "
                "start a new one"
            )
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"learner rank {rank} is gone ({exc}) before {method}")
        return self._collect(method)

    def _collect(self, method: str) -> Any:
        """Rank 0's answer once every rank answered; a dead, failing or silent rank raises."""
        deadline = time.monotonic() + self.timeout
        answers: dict[int, Any] = {}
        while len(answers) < self.world_size:
            for rank, (proc, conn) in enumerate(zip(self.processes, self._conns, strict=True)):
                if rank in answers:
                    continue
                if conn.poll(0.05):
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        kind, value = "dead", None
                    if kind == "error":
                        self._fail_dead(method)  # a peer's death is the cause to name
                        self._fail(f"learner rank {rank} failed in {method}: {value}")
                    if kind == "ok":
                        answers[rank] = value
                        continue
                if not proc.is_alive() and not conn.poll(0):
                    self._fail_dead(method)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(answers))
                self._fail(
                    f"learner ranks {missing} did not finish {method} within "
                    f"distributed.learner.timeout={self.timeout:g}s; raise it, or look for a "
                    "rank stuck in a collective"
                )
        return answers[0]

    def _fail_dead(self, method: str) -> None:
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                self._fail(
                    f"learner rank {rank} died (exit code {proc.exitcode}) during {method}; "
                    "see its output above (out of memory?), then resume from the last "
                    "checkpoint"
                )

    def _fail(self, message: str) -> None:
        self.close()  # the ranks may wait in a collective forever: stop all of them
        raise LearnerRankError(message)


def _stop(processes: list[Any], conns: list[Any]) -> None:
    for conn in conns:
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send(("close", ()))
    deadline = time.monotonic() + 5.0
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()


def _rank_context() -> Any:
    """Ranks start from a fork server that imported torch, transformers and peft once: a
    rank starts in about a second instead of re-importing them (and CUDA is never forked)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "transformers",
            "peft",
            "masenvs.trainer.learner.dist_learner",
            "masenvs.trainer.learner.rank_learner",
        ]
    )
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
