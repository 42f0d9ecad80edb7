"""`masenvs sft CONFIG DATA.jsonl ...`: supervised fine-tuning on chat traces (a cold start).

MetaAgent-X starts RL from a model fine-tuned on designer and executor traces written by a
stronger model. This trains the run's policies (the same LoRA adapters or models as
`masenvs train CONFIG` builds) on such traces, then writes them as checkpoint 0 of the
run, so that `masenvs train CONFIG --resume` starts RL from the fine-tuned weights (with
fresh optimizer states and the learning-rate schedule at its start).

Data: JSONL, one conversation per line, in the chat format
    {"agent": "designer", "messages": [{"role": "system", "content": ...}, ...]}
or ShareGPT's (as the published traces are written)
    {"agent": "executor", "conversations": [{"from": "human", "value": ...}, ...]}
Every assistant turn is a target: its tokens given everything before it, rendered with the
agent's chat template settings exactly as a rollout prompts it. `agent` names the env agent
(and so the policy) a line trains; `--agent` gives a default.

`--init-from RUN` starts from the weights of another run's newest checkpoint (or of one
`checkpoints/step_*` directory) instead of the base model: SFT continued, with a fresh AdamW.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from masenvs.trainer.config import ConfigError, TrainConfig, load_config

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}
ROLES |= {"assistant": "assistant", "tool": "tool", "observation": "user", "function": "user"}
# a progress line between epoch lines at most this often (an epoch takes minutes on a CPU)
PROGRESS_EVERY_S = 30.0


class DataError(ValueError):
    """A trace file that cannot be used; the message names the file, the line and the fix."""


@dataclass
class Conversation:
    agent: str
    messages: list[dict[str, str]]
    where: str  # file:line, for error messages


@dataclass
class Target:
    """One assistant turn to learn: prompt tokens (as a rollout renders them) and reply."""

    agent: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]


def read_traces(paths: list[str | Path], default_agent: str | None = None) -> list[Conversation]:
    """Every conversation of the JSONL files, in the chat or the ShareGPT format."""
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"{path} does not exist (a JSONL file of chat traces)")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{path} cannot be read as UTF-8 text: {exc}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{where} is not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where} must be a JSON object with messages or conversations")
            out.append(_conversation(row, where, default_agent))
    if not out:
        raise DataError(f"no conversation in {', '.join(map(str, paths))}")
    return out


def _conversation(row: dict[str, Any], where: str, default_agent: str | None) -> Conversation:
    agent = row.get("agent", default_agent)
    if not isinstance(agent, str) or not agent:
        raise DataError(f'{where} names no agent: add "agent": "<name>" or pass --agent')
    turns = row.get("messages", row.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise DataError(f'{where} needs a non-empty "messages" (or "conversations") list')
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise DataError(f"{where}: every turn must be an object, got {turn!r:.60}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLES or not isinstance(content, str):
            raise DataError(
                f"{where}: a turn needs a role ({', '.join(sorted(ROLES))}) and text content, "
                f"got {turn!r:.80}"
            )
        messages.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where} has no assistant turn to learn")
    return Conversation(agent, messages, where)


def targets(
    conversation: Conversation,
    tokenizer: Any,
    template_kwargs: dict[str, Any],
    max_tokens: int,
    loss_on: str = "completion",
) -> tuple[list[Target], int]:
    """The conversation's assistant turns as token targets, and how many were cut short.
    `loss_on="all"`: one target, the whole conversation (every token after the first), as
    the published MetaAgent-X SFT trains (labels = input_ids, sft_train/train_sft.py:145-176
    of pettingllms-ai/PettingLLMs), cut to its first `max_tokens` tokens."""
    out, cut = [], 0
    eos = tokenizer.eos_token_id
    messages = conversation.messages
    markers = _control_strings(tokenizer)
    if loss_on == "all":
        whole = _render(tokenizer, messages, False, template_kwargs, markers)
        kept = whole[:max_tokens]
        if len(kept) < 2:
            return [], 1
        return [Target(conversation.agent, kept[:1], kept[1:])], int(len(kept) < len(whole))
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], True, template_kwargs, markers)
        full = _render(tokenizer, messages[: i + 1], False, template_kwargs, markers)
        if full[: len(prompt)] == prompt and len(full) > len(prompt):
            reply = full[len(prompt) :]
            if eos in reply:  # what a model emits: up to its end-of-turn token
                reply = reply[: reply.index(eos) + 1]
        else:  # a template that rewrites earlier turns: the reply's own tokens
            reply = _text_ids(tokenizer, message["content"]) + [eos]
        room = max_tokens - len(prompt)
        if room <= 0:
            cut += 1
            continue
        if len(reply) > room:
            reply, cut = reply[:room], cut + 1
        out.append(Target(conversation.agent, list(prompt), list(reply)))
    return out, cut


def _render(
    tokenizer: Any,
    messages: list[dict[str, str]],
    gen: bool,
    kw: dict[str, Any],
    markers: list[str],
) -> list[int]:
    """The chat template's tokens for `messages`, its own markers as control tokens and every
    message's content as the text it is: a trace whose content spells `<|im_end|>` or
    `<|im_start|>assistant` gets the tokens of those characters, not a forged turn."""
    if not any(marker in m["content"] for m in messages for marker in markers):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=gen, tokenize=True, return_dict=False, **kw
        )
        return list(ids)
    # The markers in the content stand in as private-use characters while the template
    # renders; the rendered text is then cut at the template's markers, and each piece
    # between them, content put back, is tokenized with special-token strings as text.
    stand_in = f"\ue000{secrets.token_hex(8)}."  # no trace can spell it
    pattern = re.compile("|".join(map(re.escape, markers)))

    def hide(content: str) -> str:
        return pattern.sub(lambda x: f"{stand_in}{markers.index(x[0])}\ue001", content)

    masked = [dict(m, content=hide(m["content"])) for m in messages]
    text = tokenizer.apply_chat_template(masked, add_generation_prompt=gen, tokenize=False, **kw)
    put_back = re.compile(re.escape(stand_in) + "(\\d+)\ue001")
    ids, start = [], 0
    for marker in [*pattern.finditer(text), None]:
        piece = text[start : marker.start() if marker else len(text)]
        ids += _text_ids(tokenizer, put_back.sub(lambda x: markers[int(x[1])], piece))
        if marker:
            ids.append(tokenizer.convert_tokens_to_ids(marker[0]))
            start = marker.end()
    return ids


def _control_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens (role markers, end of turn, ...), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    strings = {t.content for t in added if t.special} | set(tokenizer.all_special_tokens)
    return sorted(filter(None, strings), key=len, reverse=True)


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    """`text`'s tokens with any special-token string in it split as ordinary text."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


@dataclass
class SFTResult:
    checkpoint: Path
    losses: list[float]  # mean loss of each epoch
    targets: int
    cut: int


def sft(
    cfg: TrainConfig,
    data: list[str | Path],
    *,
    epochs: int = 3,
    lr: float = 1e-4,
    batch_size: int = 8,
    max_tokens: int = 4096,
    default_agent: str | None = None,
    log: Any = print,
    loss_on: str = "completion",
    init_from: str | Path | None = None,
) -> SFTResult:
    """Fine-tune the run's policies on `data` and write them as checkpoint 0 of `cfg.run_dir`."""
    from masenvs.trainer.config import save_config
    from masenvs.trainer.learner.learner import Learner
    from masenvs.trainer.run.checkpoint import TrainState, load_weights, save_checkpoint
    from masenvs.trainer.run.train import seed_everything
    from masenvs.trainer.samples import Sample

    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    agents = _new_run_agents(cfg, run_dir)
    conversations = read_traces(data, default_agent)
    unknown = sorted({c.agent for c in conversations} - set(agents))
    if unknown:
        first = next(c for c in conversations if c.agent in unknown)
        raise DataError(
            f"{first.where} trains agent {first.agent!r}, not an agent of {cfg.env.name} "
            f"({', '.join(agents)})"
        )
    found, cut = _all_targets(cfg, conversations, max_tokens, loss_on)

    seed_everything(cfg.seed)
    learner = Learner(cfg, agents)
    if init_from is not None:
        load_weights(learner, init_from)
    by_policy: dict[str, list[Sample]] = {}
    for t in found:
        policy = learner.policy_of(t.agent)
        if not learner.trains(policy):
            continue  # a frozen agent's policy is the base: nothing to learn
        sample = Sample(t.prompt_token_ids, t.completion_token_ids, [], t.agent, policy, (), 0.0)
        by_policy.setdefault(policy, []).append(sample)
    if not found:
        raise DataError(f"no assistant turn fits in --max-length {max_tokens}: raise it")
    if not by_policy:
        raise DataError("no trainable target: every line trains a frozen agent")
    log(
        f"sft: {len(found)} assistant turns from {len(conversations)} conversations "
        f"({', '.join(f'{p}: {len(s)}' for p, s in by_policy.items())}); {cut} cut to "
        f"{max_tokens} tokens"
    )

    losses, metrics = _epochs(learner, by_policy, epochs, batch_size, lr, cfg.seed, log)

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "sft_metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)
    save_config(cfg, run_dir / "config.yaml")
    extra = {
        "sft": {
            "data": [str(p) for p in data],
            "epochs": epochs,
            "lr": lr,
            "loss_on": loss_on,
            "loss": losses,
            "seconds": round(time.perf_counter() - started, 1),  # model load included
            **({"init_from": str(init_from)} if init_from is not None else {}),
        }
    }
    state = TrainState(step=0, next_task_seed=cfg.env.seed_start, extra=extra)
    path = save_checkpoint(run_dir, learner, state, cfg, cfg.checkpoint.keep_last)
    return SFTResult(path, losses, len(found), cut)


def _all_targets(
    cfg: TrainConfig, conversations: list[Conversation], max_tokens: int, loss_on: str
) -> tuple[list[Target], int]:
    """Every conversation's targets, rendered as its agent's rollouts are; how many were cut."""
    from masenvs.engine.loading import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.name)
    found: list[Target] = []
    cut = 0
    for c in conversations:
        kwargs = dict(cfg.agent(c.agent).chat_template_kwargs)
        new, n = targets(c, tokenizer, kwargs, max_tokens, loss_on)
        found += new
        cut += n
    return found, cut


def _new_run_agents(cfg: TrainConfig, run_dir: Path) -> list[str]:
    """The agents of the run `sft` starts; a run that cannot start here stops with the fix."""
    from masenvs.registry import make
    from masenvs.trainer.rollout.sources import env_factory
    from masenvs.trainer.run.checkpoint import list_checkpoints

    if cfg.distributed.learner.world_size > 1:
        raise ConfigError(
            "sft runs the learner in this process: --set distributed.learner.world_size=1"
        )
    if list_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir} already holds checkpoints: sft writes the first one of a new run; "
            "pass --set run_dir=... for a fresh directory"
        )
    if cfg.workflow is not None:
        make(cfg.env.name, **cfg.env.options)
        return list(cfg.workflow.agents)
    env = env_factory(cfg)()
    return list(dict.fromkeys([*env.possible_agents, *env.callers]))


def _epochs(
    learner: Any,
    by_policy: dict[str, list[Any]],
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    log: Any,
) -> tuple[list[float], list[dict[str, Any]]]:
    """`epochs` passes over each policy's samples in shuffled batches: each epoch's mean loss
    per token, and a metrics row per batch."""
    rng = random.Random(seed)
    optimizers = {name: _optimizer(learner, name, lr) for name in by_policy}
    losses: list[float] = []
    metrics = []
    batches = epochs * sum(math.ceil(len(s) / batch_size) for s in by_policy.values())
    done, started = 0, time.perf_counter()
    said = started
    for epoch in range(epochs):
        total, tokens = 0.0, 0
        for name, samples in by_policy.items():
            order = list(range(len(samples)))
            rng.shuffle(order)
            for start in range(0, len(order), batch_size):
                batch = [samples[i] for i in order[start : start + batch_size]]
                loss, n = _step(learner, name, batch, lr, optimizers[name])
                total, tokens = total + loss * n, tokens + n
                metrics.append({"epoch": epoch + 1, "policy": name, "loss": loss, "tokens": n})
                done, now = done + 1, time.perf_counter()
                if now - said >= PROGRESS_EVERY_S and done < batches:
                    said, eta = now, (now - started) / done * (batches - done)
                    log(
                        f"sft: epoch {epoch + 1}/{epochs}, batch {done}/{batches}, loss "
                        f"{total / max(tokens, 1):.4f} so far, ETA {eta:.0f} s"
                    )
        losses.append(total / max(tokens, 1))
        log(f"sft: epoch {epoch + 1}/{epochs} loss {losses[-1]:.4f} ({tokens} tokens)")
    return losses, metrics


def _optimizer(learner: Any, policy: str, lr: float) -> Any:
    """SFT's own AdamW for a policy: the learner's optimizers stay fresh for RL."""
    import torch

    opt = learner.cfg.optim
    return torch.optim.AdamW(
        learner.policies[policy].params,
        lr=lr,
        betas=opt.betas,
        eps=opt.adam_eps,
        weight_decay=opt.weight_decay,
    )


def _step(
    learner: Any, name: str, batch: list[Any], lr: float, optimizer: Any
) -> tuple[float, int]:
    """One optimizer step on the token-mean negative log-likelihood of `batch`'s replies."""
    import torch

    policy = learner.policies[name]
    model = policy.model
    if policy.lora:
        model.set_adapter(name)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n = sum(len(s.completion_token_ids) for s in batch)
    total = 0.0
    for mb in learner.microbatches(batch, policy.share_prompts):
        mb.temperature = 1.0  # the data's distribution, not the sampling temperature's
        scored = learner.forward(model, mb, with_entropy=False)
        loss = -scored.logprobs.sum() / n
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(policy.params, learner.cfg.optim.grad_clip or math.inf)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    model.eval()
    return total, n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs sft",
        description="Supervised fine-tuning on chat traces (JSONL), written as checkpoint 0 "
        "of the run: `masenvs train CONFIG --resume` then starts RL from it.",
    )
    parser.add_argument("config", help="the training YAML (the policies to fine-tune)")
    parser.add_argument("data", nargs="+", help="JSONL files of chat or ShareGPT conversations")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--agent", help="agent of lines that name none (e.g. designer)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=8, help="replies per optimizer step")
    parser.add_argument(
        "--max-length",
        type=int,
        default=4096,
        help="tokens of prompt + reply; longer replies are cut",
    )
    parser.add_argument(
        "--loss-on",
        choices=("completion", "all"),
        default="completion",
        help="completion: each assistant reply given its prompt; all: every token of the "
        "conversation, prompt included (the published MetaAgent-X SFT)",
    )
    parser.add_argument(
        "--init-from",
        metavar="RUN",
        help="start from the weights of this run's newest checkpoint (or of one step_* "
        "directory) instead of the base model: SFT continued, with a fresh optimizer",
    )
    parser.add_argument("--lora-rank", type=int, help="LoRA rank r (sets lora.rank)")
    parser.add_argument("--lora-alpha", type=int, help="LoRA alpha (sets lora.alpha)")
    return parser


def overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides the LoRA flags stand for (`--set lora.rank=...`)."""
    flags = (("lora.rank", args.lora_rank), ("lora.alpha", args.lora_alpha))
    return [f"{key}={value}" for key, value in flags if value is not None]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console

    console = Console()
    for name, value in (("--epochs", args.epochs), ("--batch-size", args.batch_size)):
        if value < 1:
            console.print(f"[red]{name} must be at least 1, got {value}[/red]")
            return 2
    if not (math.isfinite(args.lr) and args.lr > 0) or args.max_length < 2:
        console.print("[red]--lr must be a positive number and --max-length at least 2[/red]")
        return 2
    args.set += overrides(args)
    try:
        cfg = load_config(args.config, args.set)
        started = time.perf_counter()
        result = sft(
            cfg,
            args.data,
            epochs=args.epochs,
            lr=args.lr,
            batch_size=args.batch_size,
            max_tokens=args.max_length,
            default_agent=args.agent,
            log=console.print,
            loss_on=args.loss_on,
            init_from=args.init_from,
        )
    except (ConfigError, DataError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    console.print(
        f"sft: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} in "
        f"{time.perf_counter() - started:.0f} s; wrote {result.checkpoint}\n"
        f"continue with RL: masenvs train {args.config} --resume"
        + "".join(f" --set {s}" for s in args.set)
    )
    return 0
