"""One LLM call's page: messages, rendered prompt and each token with the sampler's and the
learner's log-probs."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

from masenvs.ui.diagnosis import reward_terms
from masenvs.ui.runs import Run


class Tokens:
    """Token id -> text with the run's tokenizer (loaded once, in the background); ids alone
    when it cannot be loaded (a model this machine does not have)."""

    _cache: dict[str, Any] = {}
    _lock = threading.Lock()

    @classmethod
    def warm(cls, model: str) -> None:
        if model and model not in cls._cache:
            threading.Thread(target=cls.get, args=(model,), daemon=True).start()

    @classmethod
    def get(cls, model: str) -> Any:
        with cls._lock:
            if model not in cls._cache:
                try:
                    from masenvs.engine.loading import load_tokenizer

                    cls._cache[model] = load_tokenizer(model)
                except Exception:  # noqa: BLE001 (no tokenizer: ids are shown instead)
                    cls._cache[model] = None
            return cls._cache[model]

    @classmethod
    def pieces(cls, model: str, ids: list[int]) -> list[str] | None:
        tok = cls.get(model) if model else None
        if tok is None:
            return None
        return [tok.decode([i]) for i in ids]

    @classmethod
    def text(cls, model: str, ids: list[int]) -> str | None:
        tok = cls.get(model) if model else None
        return None if tok is None else tok.decode(ids)


def conversation(run: Run, call_id: str, tolerance: float) -> dict[str, Any] | None:
    """A call's messages, rendered prompt and choices, each token with the sampler's and the
    learner's log-prob (when the learner scored it) and whether they disagree."""
    record = run.index.call(call_id)
    if record is None:
        return None
    samples = run.index.query("SELECT * FROM samples WHERE call_id = ? ORDER BY choice", (call_id,))
    by_choice: dict[int, dict[str, Any]] = {}
    for s in samples:
        full = run.index.record(s) or {}
        s["learner_logprobs"] = full.get("learner_logprobs")
        s["parts"] = json.loads(s["parts"] or "null") or {}
        s["group"] = json.loads(s["grp"] or "null")
        s["terms"] = reward_terms(run, s)
        by_choice[s["choice"]] = s
    model = run.model
    choices = []
    for c in record.get("choices") or []:
        ids = c.get("token_ids") or []
        sampler = c.get("logprobs") or []
        sample = by_choice.get(c.get("index"))
        learner = (sample or {}).get("learner_logprobs") or []
        pieces = Tokens.pieces(model, ids) or [f"⟨{i}⟩" for i in ids]
        tokens = []
        worst = 0.0
        for j, tid in enumerate(ids):
            lp = sampler[j] if j < len(sampler) else None
            lq = learner[j] if j < len(learner) and len(learner) == len(ids) else None
            diff = abs(lp - lq) if lp is not None and lq is not None else None
            worst = max(worst, diff or 0.0)
            tokens.append(
                {
                    "id": tid,
                    "text": pieces[j],
                    "lp": lp,
                    "learner": lq,
                    "diff": diff,
                    "mismatch": diff is not None and diff > tolerance,
                    "shade": _shade(lp),
                }
            )
        choices.append(
            {
                "index": c.get("index"),
                "text": c.get("text", ""),
                "finish_reason": c.get("finish_reason"),
                "tokens": tokens,
                "sample": sample,
                "has_learner": bool(learner) and len(learner) == len(ids),
                "max_diff": worst,
                "mismatches": sum(t["mismatch"] for t in tokens),
            }
        )
    prompt_ids = record.get("prompt_token_ids") or []
    return {
        "record": record,
        "choices": choices,
        "prompt_text": Tokens.text(model, prompt_ids),
        "prompt_tokens": len(prompt_ids),
        "tolerance": tolerance,
    }


def _shade(lp: float | None) -> str:
    """Background of a token: green when the model was sure (p near 1), red when not."""
    if lp is None or not math.isfinite(lp):
        return "transparent"
    p = math.exp(max(lp, -30.0))
    hue = int(120 * p)  # 0 red .. 120 green
    return f"hsl({hue} 70% 85%)"
