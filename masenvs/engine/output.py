"""From sampled tokens to what the caller sees: stop rules, streamed deltas, the result.

Token ids and text stay consistent: a stop string cuts at a token boundary, and a delta
only holds text that no later stop string can take back.
"""

from __future__ import annotations

from typing import Any

from masenvs.engine.protocol import Completion, Generation, StreamDelta
from masenvs.engine.sequence import Request, Sequence, send


def check_finished(seq: Sequence, tokenizer: Any) -> None:
    """Mark `seq` finished on a stop token, a stop string or its token budget."""
    job = seq.request
    token = seq.token_ids[-1]
    if token in job.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        return
    if job.stops:
        _check_stop_strings(seq, job, tokenizer)
        if seq.finish_reason:
            return
    if len(seq.token_ids) >= job.max_tokens:
        seq.finish_reason = "length"


def _check_stop_strings(seq: Sequence, job: Request, tokenizer: Any) -> None:
    """Finish `seq` at the first stop string in its text, keeping the whole tokens before it."""
    searched = len(seq.text)
    seq.text = tokenizer.decode(seq.token_ids)
    longest = max(len(s) for s in job.stops)
    begin = max(0, searched - longest + 1)
    hits = [(seq.text.find(s, begin), s) for s in job.stops]
    hits = [(pos, s) for pos, s in hits if pos >= 0]
    if not hits:
        return
    cut, stop = min(hits)
    # Keep the longest run of whole tokens whose text ends before the stop string, so
    # that token ids and text stay consistent (a token straddling it is dropped).
    keep = len(seq.token_ids) - 1
    while keep > 0:
        text = tokenizer.decode(seq.token_ids[:keep])
        if len(text) <= cut and seq.text.startswith(text) and not text.endswith("\ufffd"):
            break
        keep -= 1
    del seq.token_ids[keep:], seq.logprobs[keep:]
    del seq.top_logprobs[keep:]
    seq.text = tokenizer.decode(seq.token_ids)
    seq.finish_reason, seq.stop_reason = "stop", stop


def stream(seq: Sequence, tokenizer: Any) -> None:
    """Send the tokens that can no longer be cut by a stop string, as one delta."""
    if seq.finish_reason:
        ids, text = seq.token_ids, completion_text(seq, tokenizer)
        upto = len(ids)
    else:
        full = seq.text if seq.request.stops else tokenizer.decode(seq.token_ids)
        hold = max((len(s) for s in seq.request.stops), default=1) - 1
        safe = len(full) - hold
        upto, text = seq.sent_tokens, seq.sent_text
        for k in range(len(seq.token_ids), max(seq.sent_tokens, len(seq.token_ids) - 8), -1):
            candidate = full if k == len(seq.token_ids) else tokenizer.decode(seq.token_ids[:k])
            if (
                len(candidate) <= safe
                and not candidate.endswith("\ufffd")
                and candidate.startswith(seq.sent_text)
            ):
                upto, text = k, candidate
                break
        if upto == seq.sent_tokens:
            return
    delta = StreamDelta(
        index=seq.index,
        token_ids=seq.token_ids[seq.sent_tokens : upto],
        text=text[len(seq.sent_text) :],
        logprobs=seq.logprobs[seq.sent_tokens : upto],
        finish_reason=seq.finish_reason,
        top_logprobs=seq.top_logprobs[seq.sent_tokens : upto]
        if seq.sampling.top_logprobs
        else None,
    )
    seq.sent_tokens, seq.sent_text = upto, text
    send(seq.request, delta)


def completion_text(seq: Sequence, tokenizer: Any) -> str:
    """The completion text: the decoded ids, without a final stop token."""
    ids = seq.token_ids
    if isinstance(seq.stop_reason, int):
        ids = ids[:-1]
    return tokenizer.decode(ids)


def generation(job: Request, tokenizer: Any) -> Generation:
    """The request's result: every choice's tokens, text and log-probabilities."""
    completions = [
        Completion(
            token_ids=list(seq.token_ids),
            text=completion_text(seq, tokenizer),
            logprobs=list(seq.logprobs),
            finish_reason=seq.finish_reason or "length",
            top_logprobs=list(seq.top_logprobs) if seq.sampling.top_logprobs else None,
            stop_reason=seq.stop_reason,
        )
        for seq in job.sequences
    ]
    return Generation(list(job.prompt_ids), completions, job.model_name)
