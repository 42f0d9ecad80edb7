"""Chat template variables (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`): per agent
from the policy map, per request from the client, honoured by the embedded engine and vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fake_vllm import FakeVLLM

from masenvs.adapters.backends.launch import model_dir
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.adapters.endpoint import EndpointServer, create_app
from masenvs.adapters.policy_map import PolicyMap
from masenvs.engine.engine import EmbeddedBackend
from masenvs.traces import TraceStore

# What Qwen3's template does with `enable_thinking`, on ChatML: with false the generation
# prompt ends in an empty think block, so the model answers without thinking.
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
HELLO = [{"role": "user", "content": "Say hello."}]
PROMPT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING = PROMPT + "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[EmbeddedBackend]:
    backend = EmbeddedBackend.from_spec("tiny", max_model_len=256, dtype="float32")
    backend.tokenizer.chat_template = QWEN3_STYLE
    yield backend
    backend.shutdown()


def ids(engine: EmbeddedBackend, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(url: str, agent: str, **extra_body) -> list[int]:
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
    response = client.chat.completions.create(
        model=agent,
        messages=HELLO,
        max_tokens=2,
        extra_body={"return_token_ids": True, **extra_body},
    )
    return response.prompt_token_ids  # type: ignore[attr-defined]


POLICY_MAP = PolicyMap(chat_template_kwargs={"plan": {"enable_thinking": False}})


def check_agents(url: str, engine: EmbeddedBackend) -> None:
    thinking_off, plain = ids(engine, NO_THINKING), ids(engine, PROMPT)
    assert thinking_off != plain
    # The plan agent's default applies to calls that do not send it (framework programs).
    assert prompt_ids(url, "plan") == thinking_off
    assert prompt_ids(url, "tool") == plain
    # A request's own variables win over the agent's defaults.
    assert prompt_ids(url, "plan", chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt_ids(url, "tool", chat_template_kwargs={"enable_thinking": False}) == thinking_off


def test_the_embedded_engine_renders_each_agents_template_variables(
    engine: EmbeddedBackend, tmp_path: Path
) -> None:
    store = TraceStore(tmp_path / "traces")
    with EndpointServer(create_app(engine, store=store, policy_map=POLICY_MAP)) as server:
        check_agents(server.rollout_url("r1"), engine)
    store.close()
    calls = TraceStore(tmp_path / "traces").calls()
    # The trace says which variables rendered each prompt.
    used = [c.params.get("chat_template_kwargs") for c in calls]
    assert used == [
        {"enable_thinking": False},
        None,
        {"enable_thinking": True},
        {"enable_thinking": False},
    ]


def test_vllm_receives_each_agents_template_variables(engine: EmbeddedBackend) -> None:
    # vLLM renders the template itself: the variables must reach it in the request body.
    path = model_dir("tiny")
    with EndpointServer(FakeVLLM(engine, served_model=path, root=path)) as vllm:
        backend = VLLMBackend(vllm.url)
        with EndpointServer(create_app(backend, policy_map=POLICY_MAP)) as server:
            check_agents(server.base_url, engine)
