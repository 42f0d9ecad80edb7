"""The learner on torch.distributed: `world_size` rank processes, one training step together.

    trainer process                        rank processes (spawned, one per GPU or CPU slot)
    DistributedLearner (the facade)  --->  RankLearner = Learner + a process group
      step / logprobs / weights / save       policy models sharded with FSDP2 ('fsdp') or
      every call has learner.timeout         replicated with one gradient all-reduce ('ddp')

Every rank gets the whole batch and takes its share of each optimizer step's samples (whole
prompt units, balanced by tokens). The loss stays the token mean over the *global* batch, and
gradients are summed over ranks, so the update equals the one-process `Learner`'s on the same
batch up to float summation order. Checkpoints: `save_sharded` writes each rank's shards
(trainable weights, AdamW state) with torch.distributed.checkpoint (DCP), which reshards on
load, so a run resumes on another world size; `load_sharded_optimizers` reads such a
checkpoint into a one-process `Learner`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_map

from masenvs.trainer.atgrpo import _SUMMED, LossSums
from masenvs.trainer.config import TrainConfig
from masenvs.trainer.learner import (
    Learner,
    _causal_lm,
    _Mismatch,
    _resolve_device,
    _Scored,
    _split,
    load_base_model,
    prompt_units,
    token_logprobs,
    unit_length,
)
from masenvs.trainer.samples import Sample

SHARDED_META = "learner.json"  # steps_done, world size, which optimizers hold state


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


@dataclass
class PolicyInfo:
    """What the trainer needs to know of a policy held by the ranks."""

    name: str
    base_name: str
    lora: bool
    frozen: bool


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
        self.device = _resolve_device(cfg.model.device)
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
                target=_rank_main,
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
    ctx.set_forkserver_preload(["torch", "transformers", "peft", "masenvs.trainer.dist_learner"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# A rank
# ---------------------------------------------------------------------------------------------


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    address: str,
    cfg: TrainConfig,
    agents: list[str],
    load_base: Any,
    conn: Any,
) -> None:
    """A rank's life: join the process group, build the learner, serve calls until 'close'."""
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        torch.manual_seed(cfg.seed * 1_000 + rank)  # dropout masks: seeded, and per rank
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=cfg.distributed.learner.timeout)
        dist.init_process_group(
            backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout
        )
        learner = RankLearner(cfg, agents, load_base)
        infos = [PolicyInfo(n, p.base_name, p.lora, p.frozen) for n, p in learner.policies.items()]
        conn.send(("ok", {"policies": infos}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            method, args = conn.recv()
            if method == "close":
                break
            # Tensors come through the pipe in shared memory, one storage for every rank: own
            # copies, or a rank's in-place update (AdamW's step count) is every rank's.
            args = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args)
            try:
                value = getattr(learner, method)(*args)
                conn.send(("ok", value if rank == 0 else None))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                break
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the trainer went away
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankLearner(Learner):
    """One rank's `Learner`: sharded (or replicated) models, its share of every batch."""

    def __init__(self, cfg: TrainConfig, agents: Sequence[str], load_base: Any) -> None:
        super().__init__(cfg, agents, load_base)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.fsdp = cfg.distributed.learner.sharding == "fsdp"
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            done: set[int] = set()
            for policy in self.policies.values():
                causal_lm = _causal_lm(policy.model)
                if id(causal_lm) in done:
                    continue
                done.add(id(causal_lm))
                # Each decoder layer is one unit (its weights exist whole only while it runs),
                # the rest (embeddings, a tied head, the final norm) is the root unit.
                for layer in _decoder_layers(causal_lm):
                    fully_shard(layer, mesh=mesh)
                fully_shard(causal_lm, mesh=mesh)
            # fully_shard replaced the parameters by DTensors: new optimizers over them.
            for name, policy in self.policies.items():
                policy.params = self._trainable_params(policy.model, name)
                policy.optimizer = self._optimizer(policy.params, policy.lr)
        else:  # replicas must start equal: the init is seeded, the broadcast makes sure
            for policy in self.policies.values():
                for tensor in policy.model.state_dict().values():
                    dist.broadcast(tensor, src=0)

    # -- the batch, split over ranks ------------------------------------------------------------

    def _accumulate_gradients(
        self,
        model: Any,
        batch: list[Sample],
        part: list[int],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
        sums: LossSums,
        mismatch: _Mismatch | None,
        share: bool,
    ) -> None:
        """This rank's prompt units of `batch[part]`, with the global token mean's N."""
        sub = [batch[i] for i in part]
        units = prompt_units(sub, share, self.cfg.optim.max_tokens_per_microbatch)
        mine = [part[i] for u in _balance(units, sub, self.world_size)[self.rank] for i in u]
        num_tokens = sum(len(s.completion_token_ids) for s in sub)  # every rank's tokens
        local, local_mismatch = LossSums(), _Mismatch()
        microbatches = list(self._microbatches([batch[i] for i in mine], share))
        causal_lm = _causal_lm(model)
        if self.fsdp:
            # Every FSDP forward and backward is a collective: all ranks run as many micro-
            # batches, padded with zero-weight ones; gradients are reduced on the last.
            count = torch.tensor([len(microbatches)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            padding = int(count) - len(microbatches)
            dummy = next(self._microbatches([batch[part[0]]], share))
            plan = [(mb, True) for mb in microbatches] + [(dummy, False)] * padding
        else:
            plan = [(mb, True) for mb in microbatches]
        for k, (mb, real) in enumerate(plan):
            if self.fsdp:
                causal_lm.set_requires_gradient_sync(k == len(plan) - 1)
            scored = self._forward(model, mb, with_entropy=self.cfg.logging.entropy)
            if not real:
                (scored.logprobs.sum() * 0.0).backward()
                continue
            idx = [mine[i] for i in mb.samples]
            _microbatch_loss(self, batch, idx, scored, old, ref, num_tokens, local, local_mismatch)
        if self.fsdp:
            causal_lm.set_requires_gradient_sync(True)
        else:
            _all_reduce_gradients(model)
        _reduce_sums(local)
        sums.add(local)
        if mismatch is not None:
            _reduce_mismatch(local_mismatch)
            mismatch.total += local_mismatch.total
            mismatch.count += local_mismatch.count
            mismatch.max = max(mismatch.max, local_mismatch.max)

    @torch.no_grad()
    def _score(
        self, policy: Any, batch: list[Sample], base: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each rank scores its prompt units; every rank gets every sample's log-probs."""
        todo = [i for i, s in enumerate(batch) if s.completion_token_ids]
        if not todo or (base and self.full and policy.reference is None):
            return super()._score(policy, batch, base)  # nothing to do, or its error
        sub = [batch[i] for i in todo]
        share = policy.share_prompts
        units = prompt_units(sub, share, self.cfg.optim.max_tokens_per_microbatch)
        mine = [todo[i] for u in _balance(units, sub, self.world_size)[self.rank] for i in u]
        plan = [(mb, True) for mb in self._microbatches([batch[i] for i in mine], share)]
        if self.fsdp:  # as many forwards on every rank: each one is a collective
            count = torch.tensor([len(plan)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            dummy = next(self._microbatches([batch[todo[0]]], share))
            plan += [(dummy, False)] * (int(count) - len(plan))
        model = policy.reference if base and self.full else policy.model
        if policy.lora:
            model.set_adapter(policy.name)
        model.eval()
        own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for mb, real in plan:
            if base and policy.lora:
                with model.disable_adapter():
                    out = self._forward(model, mb, with_entropy=False)
            else:
                out = self._forward(model, mb, with_entropy=False)
            if not real:
                continue
            idx = [mine[j] for j in mb.samples]
            lps = _split(out.logprobs, batch, idx)
            raws = _split(out.raw_logprobs, batch, idx)
            for i, lp, r in zip(idx, lps, raws, strict=True):
                own[i] = (lp.cpu(), r.cpu())
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, own)
        empty = torch.zeros(0, device=self.device)
        scored, raw = [empty] * len(batch), [empty] * len(batch)
        for part in gathered:
            for i, (lp, r) in part.items():
                scored[i], raw[i] = lp.to(self.device), r.to(self.device)
        return scored, raw

    def _score_tokens(
        self,
        causal_lm: Any,
        inputs: dict[str, Any],
        index: torch.Tensor,
        targets: torch.Tensor,
        temperature: float | torch.Tensor,
        with_entropy: bool,
    ) -> _Scored:
        if not self.fsdp:
            return super()._score_tokens(
                causal_lm, inputs, index, targets, temperature, with_entropy
            )
        # Through the root module's forward: FSDP unshards the root unit (embeddings, head)
        # only there, so the backbone-then-head shortcut of the one-process learner is out.
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(self.device)
        logits = causal_lm(**inputs, use_cache=False).logits
        hidden = logits.reshape(-1, logits.shape[-1])[index]
        return token_logprobs(
            None,
            hidden,
            targets,
            temperature,
            self.cfg.optim.logprob_chunk_tokens,
            with_entropy=with_entropy,
        )

    # -- weights out and in: whole tensors from shards ------------------------------------------

    def adapter_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        p = self._lora_policy(policy)
        state = get_peft_model_state_dict(p.model, adapter_name=policy)
        return {k: _whole(v) for k, v in state.items()}

    def full_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        p = self._policy(policy)
        if p.lora:
            return super().full_state_dict(policy)  # raises the one-process error
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in p.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a tied weight: once, under its first name
                continue
            seen.add(id(tensor))
            out[name] = _whole(tensor)
        return out

    def save_adapter(self, policy: str, directory: str | Path) -> Path:
        if self.rank == 0:
            return super().save_adapter(policy, directory)
        self.adapter_state_dict(policy)  # the gather is collective
        return Path(directory)

    def save_model(self, policy: str, directory: str | Path) -> Path:
        if self.rank == 0:
            return super().save_model(policy, directory)
        self.full_state_dict(policy)
        return Path(directory)

    def load_adapter(self, policy: str, directory: str | Path) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import load_file

        p = self._lora_policy(policy)
        path = Path(directory) / "adapter_model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; expected an adapter written by save_adapter"
            )
        state = load_file(str(path))
        own = get_peft_model_state_dict(p.model, adapter_name=policy)  # views of the params
        _copy_into(own, state, f"adapter at {directory}", policy)

    def set_full_state_dict(
        self, policy: str, state: dict[str, torch.Tensor], where: str = "state dict"
    ) -> None:
        p = self._policy(policy)
        if p.lora:
            super().set_full_state_dict(policy, state, where)  # raises the one-process error
        keys = _untied_names(p.model)
        own = {k: v for k, v in p.model.state_dict().items() if k in keys}
        _copy_into(own, {k: v.cpu() for k, v in state.items()}, where, policy)

    # -- optimizer state: one-process format and DCP shards -------------------------------------

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizers = {}
        for name, p in self.policies.items():
            if not p.optimizer.state:  # never stepped (reading it would initialise it)
                optimizers[name] = p.optimizer.state_dict()
                continue
            self._activate(name)
            by_name = get_optimizer_state_dict(p.model, p.optimizer, options=options)
            if self.rank == 0:  # cpu_offload gathers on rank 0 only
                optimizers[name] = _by_index(by_name, _param_names(p.model, p.params))
        return {"steps_done": self.steps_done, "optimizers": optimizers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        if set(state["optimizers"]) != set(self.policies):
            raise ValueError(
                f"checkpoint has policies {sorted(state['optimizers'])}, "
                f"this learner has {sorted(self.policies)}"
            )
        self.steps_done = int(state["steps_done"])
        options = StateDictOptions(full_state_dict=True)
        for name, opt_state in state["optimizers"].items():
            p = self.policies[name]
            if not opt_state["state"]:
                continue
            self._activate(name)
            by_name = _by_name(opt_state, _param_names(p.model, p.params))
            set_optimizer_state_dict(p.model, p.optimizer, by_name, options=options)

    def save_sharded(self, directory: str | Path) -> None:
        import torch.distributed.checkpoint as dcp

        directory = Path(directory)
        state, stepped = self._sharded_state(saving=True)
        dcp.save(state, checkpoint_id=str(directory))
        torch.save(torch.get_rng_state(), directory / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            meta = {
                "steps_done": self.steps_done,
                "world_size": self.world_size,
                "sharding": self.cfg.distributed.learner.sharding,
                "stepped": stepped,
            }
            (directory / SHARDED_META).write_text(json.dumps(meta, indent=1))
        dist.barrier()

    def load_sharded(self, directory: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        directory = Path(directory)
        meta = json.loads((directory / SHARDED_META).read_text())
        state, _ = self._sharded_state(saving=False, stepped=meta["stepped"])
        dcp.load(state, checkpoint_id=str(directory))
        for model_key, weights in state["weights"].items():
            p = self.policies[model_key]
            set_model_state_dict(p.model, weights, options=_partial())
        for name, opt_state in state["optimizers"].items():
            p = self.policies[name]
            self._activate(name)
            set_optimizer_state_dict(p.model, p.optimizer, opt_state)
        self.steps_done = int(meta["steps_done"])
        rng = directory / f"rng_rank{self.rank}.pt"
        if meta["world_size"] == self.world_size and rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))

    def _sharded_state(
        self, saving: bool, stepped: Sequence[str] = ()
    ) -> tuple[dict[str, Any], list[str]]:
        """{"weights": {policy: trainable shards}, "optimizers": {policy: AdamW shards}}."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        weights: dict[str, Any] = {}
        optimizers: dict[str, Any] = {}
        for name, p in self.policies.items():
            if p.frozen:
                continue
            names = set(_param_names(p.model, p.params))
            weights[name] = {
                k: v for k, v in get_model_state_dict(p.model, options=_partial()).items()
                if k in names
            }  # fmt: skip
            if p.optimizer.state if saving else name in stepped:
                self._activate(name)  # peft: only the active adapter's params need grads
                optimizers[name] = get_optimizer_state_dict(p.model, p.optimizer)
        return {"weights": weights, "optimizers": optimizers}, sorted(optimizers)

    def _activate(self, policy: str) -> None:
        p = self.policies[policy]
        if p.lora:
            p.model.set_adapter(policy)


def _microbatch_loss(
    learner: Learner,
    batch: list[Sample],
    idx: list[int],
    scored: _Scored,
    old: list[torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    num_tokens: int,
    sums: LossSums,
    mismatch: _Mismatch,
) -> None:
    """The one-process micro-batch loss, its gradient scaled so that the mean over ranks
    FSDP's reduce-scatter takes is the sum over ranks the global token mean needs."""
    from masenvs.trainer.atgrpo import policy_loss
    from masenvs.trainer.learner import _gather

    old_lp = _gather(old, idx) if old is not None else scored.logprobs.detach()
    ref_lp = _gather(ref, idx) if ref is not None else None
    adv = torch.cat(
        [torch.full((len(batch[i].completion_token_ids),), batch[i].advantage) for i in idx]
    ).to(learner.device)
    loss, mb_sums = policy_loss(
        scored.logprobs, old_lp, adv, num_tokens, learner.cfg.algorithm, ref_logprobs=ref_lp
    )
    scale = dist.get_world_size() if getattr(learner, "fsdp", False) else 1
    (loss * scale).backward()
    mb_sums.extra["entropy"] = scored.entropy_sum
    sums.add(mb_sums)
    mismatch.add(batch, idx, _split(scored.raw_logprobs, batch, idx))


def _balance(units: list[list[int]], batch: Sequence[Sample], ranks: int) -> list[list[list[int]]]:
    """Prompt units dealt to ranks, longest first to the least loaded (same on every rank)."""
    load = [0] * ranks
    out: list[list[list[int]]] = [[] for _ in range(ranks)]
    for u in sorted(range(len(units)), key=lambda u: (-unit_length(batch, units[u]), u)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(units[u])
        load[r] += unit_length(batch, units[u])
    return out


def _decoder_layers(causal_lm: Any) -> list[torch.nn.Module]:
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, causal_lm)
    layers = getattr(backbone, "layers", None) or getattr(backbone, "h", None)
    if layers is None:
        raise ValueError(
            f"{type(causal_lm).__name__} has no decoder layer list (model.layers or "
            "transformer.h) to shard; use distributed.learner.sharding: ddp"
        )
    return list(layers)


def _all_reduce_gradients(model: Any) -> None:
    """'ddp': sum the replicas' gradients in one flat buffer (ranks ran unequal micro-batch
    counts, so per-backward hooks as in DistributedDataParallel would not line up)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def _reduce_sums(sums: LossSums) -> None:
    names = ["tokens", *_SUMMED]
    extra = sorted(sums.extra)
    values = torch.tensor(
        [float(getattr(sums, n)) for n in names] + [sums.extra[k] for k in extra],
        dtype=torch.float64,
    )
    dist.all_reduce(values)
    top = torch.tensor([sums.ratio_max], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    for n, v in zip(names, values[: len(names)].tolist(), strict=True):
        setattr(sums, n, int(v) if n == "tokens" else v)
    for k, v in zip(extra, values[len(names) :].tolist(), strict=True):
        sums.extra[k] = v
    sums.ratio_max = float(top)


def _reduce_mismatch(m: _Mismatch) -> None:
    values = torch.tensor([m.total, float(m.count)], dtype=torch.float64)
    dist.all_reduce(values)
    top = torch.tensor([m.max], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    m.total, m.count, m.max = float(values[0]), int(values[1]), float(top)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor (gathered from the ranks when it is a shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True).contiguous()


def _copy_into(
    own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], where: str, policy: str
) -> None:
    """Copy whole tensors into parameters (views), each rank keeping its own shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(
            f"{where} does not fit policy {policy!r}: missing {missing[:3]}..., "
            f"unexpected {extra[:3]}... (a different base model or LoRA targets?)"
        )
    with torch.no_grad():
        for name, target in own.items():
            value = state[name].to(dtype=target.dtype)
            if isinstance(target, DTensor):
                value = value.to(target.device_mesh.device_type)
                local = distribute_tensor(value, target.device_mesh, target.placements)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(value)


def _untied_names(model: Any) -> set[str]:
    """State-dict names with a tied weight once, under its first name (as full_state_dict)."""
    seen: set[int] = set()
    names = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.add(name)
    return names


def _partial() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)


def _param_names(model: Any, params: Sequence[torch.nn.Parameter]) -> list[str]:
    """Each parameter's name in `model` (FSDP keeps the names), in `params` order."""
    by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    return [by_id[id(p)] for p in params]


def _by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name -> `Optimizer.state_dict()` format."""
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def _by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`Optimizer.state_dict()` format -> keyed by parameter name."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


# ---------------------------------------------------------------------------------------------
# A sharded checkpoint into a one-process learner
# ---------------------------------------------------------------------------------------------


def load_sharded_optimizers(learner: Learner, directory: str | Path) -> None:
    """Load the AdamW states and schedule position of a `save_sharded` checkpoint (any world
    size) into a one-process `Learner`; the weights come from the checkpoint's adapters or
    models as for any checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = Path(directory)
    meta = json.loads((directory / SHARDED_META).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(directory), str(whole))  # no process group needed
        state = torch.load(whole, weights_only=False)
    saved = state.get("optimizers", {})
    unknown = sorted(set(saved) - set(learner.policies))
    if unknown:
        raise ValueError(
            f"checkpoint has policies {unknown} that this learner lacks ({sorted(learner.policies)})"
        )
    learner.steps_done = int(meta["steps_done"])
    for name, by_name in saved.items():
        p = learner.policies[name]
        names = _param_names(p.model, p.params)
        plain = _by_index(by_name, names)
        # DCP flattens each group's hyper-parameters; AdamW wants them as it made them
        for group, own in zip(plain["param_groups"], p.optimizer.param_groups, strict=True):
            for key, value in own.items():
                if key != "params" and isinstance(value, tuple):
                    group[key] = tuple(group[key])
        p.optimizer.load_state_dict(plain)
