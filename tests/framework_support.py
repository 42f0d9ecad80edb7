"""Shared pieces of the framework tests: a served tiny model with per-agent LoRA adapters,
and a tiny model that really emits tool calls (trained here once, then cached).

The tiny test model is random, so it writes gibberish, and the SmolLM2 chat template has no
tool syntax. To see a framework's tool call go through the endpoint, `tool_model_dir()`
trains a copy of it, with a Hermes-style template that renders `tools`, to answer a user
turn with `<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>` and a
turn ending in a tool result with `The answer is 5.` (greedy decoding).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from masenvs.adapters.endpoint import Endpoint, EndpointServer, create_app
from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import cache_dir, load_model
from masenvs.traces import TraceStore


def random_lora(backend: EmbeddedBackend, name: str, seed: int, rank: int = 4) -> None:
    """Add adapter `name` with random (non-zero) A and B to the tiny model's attention."""
    generator = torch.Generator().manual_seed(seed)
    config = backend.model.config
    hidden = config.hidden_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    state = {}
    for layer in range(config.num_hidden_layers):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            state[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.5
    backend.add_adapter(name, state, rank=rank, alpha=2 * rank)


@dataclass
class Served:
    """A running endpoint over a backend, with its trace store."""

    server: EndpointServer
    endpoint: Endpoint
    store: TraceStore

    @property
    def url(self) -> str:
        return self.server.url


@contextmanager
def serve(backend: Any, traces: Path, **options: Any):
    store = TraceStore(traces)
    endpoint = create_app(backend, store=store, **options)
    server = EndpointServer(endpoint)
    server.start()
    try:
        yield Served(server, endpoint, store)
    finally:
        server.stop()
        store.close()


# -- a tiny model that calls tools ------------------------------------------------------

HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nFunction signatures are within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}{%- set f = call['function'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + "
    "(f['arguments'] if f['arguments'] is string else f['arguments'] | tojson) + "
    "'}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
FINAL_ANSWER = "The answer is 5."
TOOL_MODEL_NAME = "tiny-toolcall-v1"


def tool_model_dir() -> Path:
    """The trained tool-calling tiny model (built on first use, ~1-2 CPU minutes)."""
    final = cache_dir() / TOOL_MODEL_NAME
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TOOL_MODEL_NAME}-", dir=final.parent))
    try:
        _train_tool_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _random_text(rng: random.Random, tokenizer: Any, low: int, high: int) -> str:
    return tokenizer.decode(
        [rng.randrange(100, len(tokenizer)) for _ in range(rng.randint(low, high))]
    )


def _add_schema(rng: random.Random) -> dict:
    description = rng.choice(["Add two integers.", "add(a, b) -> int", "", "Return a + b."])
    return {
        "type": "function",
        "function": {
            "name": "add",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


def _example(rng: random.Random, tokenizer: Any) -> tuple[list[dict], list[dict], str]:
    """A conversation the frameworks could send, and what the model must answer."""
    system = rng.choice(
        [
            None,
            "You are a helpful AI assistant. Solve tasks using your tools. Reply with "
            "TERMINATE when the task has been completed.",
            "You are a helpful assistant.",
            _random_text(rng, tokenizer, 3, 40),
        ]
    )
    messages = [] if system is None else [{"role": "system", "content": system}]
    user = rng.choice(["What is 2 + 3?", "Add 2 and 3.", _random_text(rng, tokenizer, 2, 60)])
    messages.append({"role": "user", "content": user})
    tools = [_add_schema(rng)]
    if rng.random() < 0.3:
        name = _random_text(rng, tokenizer, 1, 3).strip() or "f"
        tools.append({"type": "function", "function": {"name": name, "parameters": {}}})
    if rng.random() < 0.5:
        return messages, tools, TOOL_CALL
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        }
    )
    result = rng.choice(["5", "[FunctionCall(...)] 5", _random_text(rng, tokenizer, 1, 8)])
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": result})
    return messages, tools, FINAL_ANSWER


def _render(tokenizer: Any, rng: random.Random, eos: int) -> tuple[list[int], list[int]]:
    messages, tools, target = _example(rng, tokenizer)
    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(prompt), tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]


def _train_tool_model(out: Path, max_steps: int = 400, seed: int = 0) -> None:
    loaded = load_model("tiny")
    tokenizer, model = loaded.tokenizer, loaded.model
    tokenizer.chat_template = HERMES_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    perfect = 0
    for _ in range(max_steps):
        batch = [_render(tokenizer, rng, eos) for _ in range(8)]
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        rows, cols, targets = [], [], []
        for i, (prompt, completion) in enumerate(batch):
            sequence = prompt + completion
            ids[i, : len(sequence)] = torch.tensor(sequence)
            mask[i, : len(sequence)] = 1
            for j, token in enumerate(completion):
                rows.append(i)
                cols.append(len(prompt) - 1 + j)
                targets.append(token)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[rows, cols])  # only the completion positions
        target = torch.tensor(targets)
        loss = torch.nn.functional.cross_entropy(logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # Done once fresh batches are decoded right, token for token, several times running.
        perfect = perfect + 1 if bool((logits.argmax(-1) == target).all()) else 0
        if perfect >= 20:
            break
    else:
        raise RuntimeError("the tool-calling test model did not learn its two answers")
    model.eval()
    model.config.name_or_path = TOOL_MODEL_NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
