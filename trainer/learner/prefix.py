"""A prefix every prompt of an update starts with, fed once per policy and update.

The prompts of one policy's update usually start alike: the chat template, the system prompt
and the task's instructions (175 of the ~300 tokens of every plan-path prompt in the main
job). Fed again with every prompt unit, those tokens are most of the update's FLOPs. Here
they are fed once: one forward over the prefix alone (with grad) gives each layer's keys and
values; detached copies of them are the first keys every micro-batch attends to (as a cache,
through the mask's first columns, see `packing.build_microbatch`); each micro-batch's
backward sums its gradient into those copies, and after the last one the prefix's forward
runs again with grad and a single backward through it takes the sum in (so the prefix's
activations, ~1.4 MiB a token for SmolLM2, are never held beside a micro-batch's: one
extra prefix forward, a few % of what is saved). The loss and the gradients are those of
feeding the prefix with every unit, up to the order of float sums (tests/test_prefix.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from masenvs.trainer.learner.packing import common_prefix
from masenvs.trainer.samples import Sample

MIN_PREFIX = 16  # tokens: below this the extra pass costs more than it saves


@dataclass
class SharedPrefix:
    """The prefix's keys and values per layer, as leaves the micro-batches attend to and put
    their gradients in; `feed` runs the prefix's forward (with grad when asked)."""

    tokens: list[int]
    leaves: list[tuple[torch.Tensor, torch.Tensor]]
    feed: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]

    @property
    def length(self) -> int:
        return len(self.tokens)

    def cache(self, rows: int) -> DynamicCache:
        """A fresh cache holding the prefix for `rows` rows (the model appends to it)."""
        return DynamicCache(
            ddp_cache_data=[
                (k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.leaves
            ]
        )

    def backward(self) -> None:
        """Backpropagate the micro-batches' summed gradients through the prefix's forward,
        run again here with grad: its activations then never sit beside a micro-batch's."""
        if all(leaf.grad is None for pair in self.leaves for leaf in pair):
            return
        with torch.enable_grad():
            computed = self.feed()
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for pair, leaves in zip(computed, self.leaves, strict=True):
            for tensor, leaf in zip(pair, leaves, strict=True):
                if leaf.grad is not None and tensor.requires_grad:
                    outputs.append(tensor)
                    grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)


def prefix_tokens(batch: list[Sample]) -> list[int]:
    """The tokens every prompt of `batch` starts with, short of each prompt's last token;
    empty when they are too few to pay for a pass of their own or only one unit would use them.
    """
    if len({tuple(s.prompt_token_ids) for s in batch}) < 2:
        return []
    n = common_prefix(batch)
    return list(batch[0].prompt_token_ids[:n]) if n >= MIN_PREFIX else []


def cache_argument(backbone: Any) -> str:
    """The name the model's forward takes its KV cache by (`cache` from transformers 5.x on,
    `past_key_values` before)."""
    params = inspect.signature(backbone.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def feed_prefix(
    backbone: Any, tokens: list[int], device: torch.device, autocast: torch.dtype | None = None
) -> SharedPrefix:
    """The prefix's keys and values from a forward without grad (the decoder alone: nothing
    is scored); `SharedPrefix.backward` runs it again with grad once the micro-batches are
    done. Deterministic (no dropout: the learner checks), so both runs give the same keys."""
    ids = torch.tensor([tokens], device=device)
    positions = torch.arange(len(tokens), device=device)[None]

    def feed() -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.autocast(device.type, autocast, enabled=autocast is not None):
            out = backbone(input_ids=ids, position_ids=positions, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        return [(layer.keys, layer.values) for layer in cache.layers]

    with torch.no_grad():
        leaves = [(k.requires_grad_(), v.requires_grad_()) for k, v in feed()]
    return SharedPrefix(list(tokens), leaves, feed)
