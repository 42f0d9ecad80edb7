"""The prefix cache: KV-cache rows kept after their sequences finished.

An agent's next turn, or the next request of a GRPO group, usually starts with tokens an
earlier sequence already ran. The rows after the running ones (`rows`) keep the KV of
recently finished sequences; a new prompt that extends one copies that prefix and
prefills only the rest. Rows are evicted least recently used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from masenvs.engine.forward import LlamaForward, Prefill
from masenvs.engine.lora import LoraAdapter

MIN_PREFIX_HIT = 16  # shorter shared prefixes are cheaper to recompute than to copy


@dataclass(eq=False)
class _Prefix:
    """A cache row kept after its sequence finished: the KV of `tokens` under `adapter`."""

    tokens: list[int]
    adapter: LoraAdapter | None
    last_used: int  # decode step, for least-recently-used eviction


class PrefixCache:
    """Which cache rows (`rows`, after the running ones) hold which finished prefixes."""

    def __init__(self, forward: LlamaForward, rows: range) -> None:
        self.forward = forward
        self.rows = rows
        self.prefixes: dict[int, _Prefix] = {}  # cache row -> what it holds

    def reuse(self, row: int, prompt: list[int], adapter: LoraAdapter | None, step: int) -> Prefill:
        """The prefill of `prompt` into `row`, starting after the longest cached prefix of
        it (copied into `row` here); `step` marks that prefix as used now."""
        best_row, best = None, 0
        for prefix_row, prefix in self.prefixes.items():
            if prefix.adapter is not adapter:
                continue
            shared = common_prefix(prefix.tokens, prompt)
            if shared > best:
                best_row, best = prefix_row, shared
        best = min(best, len(prompt) - 1)  # the last prompt token must run to give logits
        if best_row is None or best < MIN_PREFIX_HIT:
            return Prefill(row, torch.tensor(prompt, dtype=torch.long), 0, adapter)
        self.forward.copy_slot(best_row, row, best)
        self.prefixes[best_row].last_used = step
        return Prefill(row, torch.tensor(prompt[best:], dtype=torch.long), best, adapter)

    def keep(self, row: int, tokens: list[int], adapter: LoraAdapter | None, step: int) -> None:
        """Copy the KV of `tokens` (cached in `row`) into a prefix row, evicting the least
        recently used."""
        if not self.rows:
            return
        if len(tokens) < MIN_PREFIX_HIT:
            return
        same = [r for r, p in self.prefixes.items() if p.adapter is adapter]
        if any(common_prefix(self.prefixes[r].tokens, tokens) == len(tokens) for r in same):
            return  # already cached (another choice of the same prompt, say)
        # A cached prefix of these tokens is now redundant: reuse its row.
        covered = [
            r
            for r in same
            if common_prefix(self.prefixes[r].tokens, tokens) == len(self.prefixes[r].tokens)
        ]
        free = [r for r in self.rows if r not in self.prefixes]
        if covered:
            target = covered[0]
        elif free:
            target = free[0]
        else:
            target = min(self.prefixes, key=lambda r: self.prefixes[r].last_used)
        self.forward.copy_slot(row, target, len(tokens))
        self.prefixes[target] = _Prefix(tokens, adapter, step)

    def forget(self, adapter_name: str | None) -> None:
        """Drop the prefixes computed under adapter `adapter_name`, or every prefix when it
        is None (the base weights changed): their KV is stale."""
        stale = [
            row
            for row, prefix in self.prefixes.items()
            if adapter_name is None
            or (prefix.adapter is not None and prefix.adapter.name == adapter_name)
        ]
        for row in stale:
            del self.prefixes[row]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
