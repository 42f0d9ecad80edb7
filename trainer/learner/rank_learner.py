"""One learner rank on torch.distributed: a `Learner` that shares every batch with the other
ranks (`RankParallel` in rank_parallel.py: its share of the prompt units, gradients and loss
sums summed over ranks), its models sharded with FSDP2 ('fsdp') or replicated ('ddp');
weights out and in as whole tensors, optimizer states in the one-process format or as DCP
shards.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from masenvs.trainer.config import TrainConfig
from masenvs.trainer.learner import weights
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.learner.policies import (
    causal_lm_of,
    make_optimizer,
    resolve_device,
    trainable_params,
)
from masenvs.trainer.learner.rank_parallel import RankParallel
from masenvs.trainer.samples import Sample

SHARDED_META = "learner.json"  # steps_done, world size, which optimizers hold state


@dataclass
class PolicyInfo:
    """What the trainer needs to know of a policy held by the ranks."""

    name: str
    base_name: str
    lora: bool
    frozen: bool


def rank_main(
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


class RankLearner:
    """One rank's learner: a `Learner` with sharded (or replicated) models and `RankParallel`,
    and the `Learner` methods the trainer process calls, on whole tensors."""

    def __init__(self, cfg: TrainConfig, agents: Sequence[str], load_base: Any) -> None:
        self.cfg = cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.fsdp = cfg.distributed.learner.sharding == "fsdp"
        parallel = RankParallel(
            self.rank, self.world_size, self.fsdp, resolve_device(cfg.model.device)
        )
        self.learner = Learner(cfg, agents, load_base, parallel=parallel)
        self.policies = self.learner.policies
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.learner.device.type, (self.world_size,))
            done: set[int] = set()
            for policy in self.policies.values():
                causal_lm = causal_lm_of(policy.model)
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
                policy.params = trainable_params(policy.model, name, self.learner.full)
                policy.optimizer = make_optimizer(policy.params, policy.lr, cfg.optim)
        else:  # replicas must start equal: the init is seeded, the broadcast makes sure
            for policy in self.policies.values():
                for tensor in policy.model.state_dict().values():
                    dist.broadcast(tensor, src=0)

    # -- a training step and scoring: the learner's, sharing the batch over ranks ---------------

    def step(
        self, samples: list[Sample], lr_scale: dict[str, float] | None = None
    ) -> dict[str, float]:
        return self.learner.step(samples, lr_scale)

    def logprobs(
        self, policy: str, samples: Sequence[Sample], base: bool = False
    ) -> list[torch.Tensor]:
        return self.learner.logprobs(policy, samples, base)

    # -- weights out and in: whole tensors from shards ------------------------------------------

    def adapter_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        p = self.learner.lora_policy(policy)
        return {k: _whole(v) for k, v in _adapter_params(p.model, policy).items()}

    def full_state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        p = weights.require_full(self.learner.policy(policy))
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
            p = self.learner.lora_policy(policy)
            Path(directory).mkdir(parents=True, exist_ok=True)
            state = self.adapter_state_dict(policy)
            return weights.write_adapter(p, state, directory, self.cfg.lora.target_modules)
        self.adapter_state_dict(policy)  # the gather is collective
        return Path(directory)

    def save_model(self, policy: str, directory: str | Path) -> Path:
        if self.rank == 0:
            p = self.learner.policy(policy)
            Path(directory).mkdir(parents=True, exist_ok=True)
            return weights.write_model(p, self.full_state_dict(policy), directory)
        self.full_state_dict(policy)
        return Path(directory)

    def load_adapter(self, policy: str, directory: str | Path) -> None:
        p = self.learner.lora_policy(policy)
        state = weights.read_adapter(directory, "cpu")
        _copy_into(_adapter_params(p.model, policy), state, f"adapter at {directory}", policy)

    def load_model(self, policy: str, directory: str | Path) -> None:
        self.learner.policy(policy)  # a clear error for an unknown name
        state = weights.read_model(directory, self.learner.device)
        self.set_full_state_dict(policy, state, where=str(directory))

    def set_full_state_dict(
        self, policy: str, state: dict[str, torch.Tensor], where: str = "state dict"
    ) -> None:
        p = self.learner.policy(policy)
        if p.lora:
            self.learner.set_full_state_dict(policy, state, where)  # raises the one-process error
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
        return {"steps_done": self.learner.steps_done, "optimizers": optimizers}

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
        self.learner.steps_done = int(state["steps_done"])
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
                "steps_done": self.learner.steps_done,
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
        for model_key, shards in state["weights"].items():
            p = self.policies[model_key]
            set_model_state_dict(p.model, shards, options=_partial())
        for name, opt_state in state["optimizers"].items():
            p = self.policies[name]
            self._activate(name)
            set_optimizer_state_dict(p.model, p.optimizer, opt_state)
        self.learner.steps_done = int(meta["steps_done"])
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

        trained: dict[str, Any] = {}
        optimizers: dict[str, Any] = {}
        for name, p in self.policies.items():
            if p.frozen:
                continue
            names = set(_param_names(p.model, p.params))
            trained[name] = {
                k: v for k, v in get_model_state_dict(p.model, options=_partial()).items()
                if k in names
            }  # fmt: skip
            if p.optimizer.state if saving else name in stepped:
                self._activate(name)  # peft: only the active adapter's params need grads
                optimizers[name] = get_optimizer_state_dict(p.model, p.optimizer)
        return {"weights": trained, "optimizers": optimizers}, sorted(optimizers)

    def _activate(self, policy: str) -> None:
        p = self.policies[policy]
        if p.lora:
            p.model.set_adapter(policy)


def _decoder_layers(causal_lm: Any) -> list[torch.nn.Module]:
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, causal_lm)
    layers = getattr(backbone, "layers", None) or getattr(backbone, "h", None)
    if layers is None:
        raise ValueError(
            f"{type(causal_lm).__name__} has no decoder layer list (model.layers or "
            "transformer.h) to shard; use distributed.learner.sharding: ddp"
        )
    return list(layers)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor (gathered from the ranks when it is a shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True).contiguous()


def _adapter_params(model: Any, policy: str) -> dict[str, torch.Tensor]:
    """The adapter's parameters themselves (each rank's shard), keyed as in its adapter file
    (the adapter name dropped): what saving gathers and loading copies into. Not
    `get_peft_model_state_dict`: since peft 0.22 it returns whole CPU copies of sharded
    tensors (gathered once more by `_whole`), and a copy into those loads nothing."""
    own = re.compile(rf"\.(lora_[A-Za-z_]+)\.{re.escape(policy)}\.")
    return {
        own.sub(r".\1.", name, count=1): tensor
        for name, tensor in model.state_dict(keep_vars=True).items()
        if own.search(name)
    }


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
