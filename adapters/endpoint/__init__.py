"""The capture endpoint: an OpenAI-compatible HTTP server that records every call.

    endpoint = create_app(backend, store=TraceStore("runs/traces"),
                          policy_map=PolicyMap({"tool": "tool_lora"}))
    with EndpointServer(endpoint) as server:      # uvicorn on 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.rollout_url("r-17"), api_key="-")
        client.chat.completions.create(model="tool", messages=[...])

`/r/{rollout_id}/v1/...` attributes calls to a rollout; plain `/v1/...` serves a policy
(calls are still traced, with `rollout_id=None`). The request's `model` names the agent;
the policy map picks the adapter. Each call's record is written to the store before its
response (or its stream's final chunk) is sent.

One idea per module: `routes` (the ASGI app: routing, API keys, the OpenAI handlers),
`wire` (request bodies in, JSON and errors out), `streaming` (server-sent events),
`tools` (tool calls parsed from text, held back while they stream), `recording` (the trace
record of a call), `vllm_routes` (vLLM's adapter and weight routes for an engine server),
`server` (uvicorn in a background thread).
"""

from masenvs.adapters.endpoint.routes import (
    GATE_HEADER,
    MAX_ENDED_ROLLOUTS,
    STEP_HEADER,
    Endpoint,
    agent_and_step,
    create_app,
)
from masenvs.adapters.endpoint.server import EndpointServer
from masenvs.adapters.endpoint.wire import (
    MAX_BODY_BYTES,
    MAX_BUFFERED_BYTES,
    error_response,
    json_body,
    read_body,
)

__all__ = [
    "GATE_HEADER",
    "MAX_BODY_BYTES",
    "MAX_BUFFERED_BYTES",
    "MAX_ENDED_ROLLOUTS",
    "STEP_HEADER",
    "Endpoint",
    "EndpointServer",
    "agent_and_step",
    "create_app",
    "error_response",
    "json_body",
    "read_body",
]
