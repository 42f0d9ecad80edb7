"""The engine's old import paths (adapters/backends/*, adapters/models) still work for one
release: each warns DeprecationWarning on import and hands out the very objects that now
live in masenvs.engine, so code written against the old paths keeps running unchanged."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest

# Moved whole: the old path is the new module object itself.
MOVED = {
    "masenvs.adapters.backends.base": "masenvs.engine.protocol",
    "masenvs.adapters.backends.cpu_kernels": "masenvs.engine.kernels",
    "masenvs.adapters.backends.omp": "masenvs.engine.omp",
    "masenvs.adapters.backends.sampling": "masenvs.engine.sampling",
}

# Split: every public name of the old module -> the module that holds it now.
SPLIT = {
    "masenvs.adapters.backends.llama": {
        "masenvs.engine.forward": ["SUPPORTED_MODEL_TYPES", "Prefill", "LlamaForward"],
        "masenvs.engine.quant": ["QUANTIZE_MODES", "INT4_GROUP", "QUANTIZED_MAX_ROWS"],
        "masenvs.engine.lora": ["LoraAdapter", "LoraRows", "lora_scale", "lora_from_state_dict"],
    },
    "masenvs.adapters.backends.embedded": {
        "masenvs.engine.engine": ["BASE_NAMES", "MAX_TOP_LOGPROBS", "EmbeddedBackend"],
        "masenvs.engine.scheduler": ["PREFILL_TOKENS", "SINGLE_THREAD_ROWS"],
        "masenvs.engine.prefix_cache": ["MIN_PREFIX_HIT"],
        "masenvs.engine.sequence": ["EngineStats"],
    },
    "masenvs.adapters.models": {
        "masenvs.engine.loading": [
            "DEFAULT_MODEL",
            "SMOLLM2_GGUF",
            "SMOLLM2_CHAT_TEMPLATE",
            "TINY_CONFIG",
            "TINY_SEED",
            "HUB_FILES",
            "ModelLoadError",
            "LoadedModel",
            "cache_dir",
            "default_dtype",
            "engine_dtype",
            "load_model",
            "model_reference",
            "load_tokenizer",
            "smollm2_gguf_path",
            "is_hub_id",
            "hf_hub_cache",
            "hub_offline",
            "hub_snapshot",
        ],
        "masenvs.engine.kernels": ["cpu_has_native_bf16", "cpu_flags"],
        "masenvs.cache": ["cache_root"],
    },
}

# Private names tests and callers used, some now public under a new name.
PRIVATE = [
    ("masenvs.adapters.backends.llama", "_quantize_int8", "masenvs.engine.quant", "_quantize_int8"),
    ("masenvs.adapters.backends.llama", "_int4_grid", "masenvs.engine.quant", "_int4_grid"),
    ("masenvs.adapters.backends.llama", "_int4_levels", "masenvs.engine.quant", "_int4_levels"),
    ("masenvs.adapters.backends.llama", "_Projection", "masenvs.engine.quant", "Projection"),
    ("masenvs.adapters.backends.llama", "_group_rows", "masenvs.engine.lora", "group_rows"),
    ("masenvs.adapters.backends.embedded", "_Request", "masenvs.engine.sequence", "Request"),
    (
        "masenvs.adapters.backends.embedded",
        "_read_peft_dir",
        "masenvs.engine.lora",
        "read_peft_dir",
    ),
    (
        "masenvs.adapters.backends.embedded",
        "_choice_seeds",
        "masenvs.engine.scheduler",
        "_choice_seeds",
    ),
    ("masenvs.adapters.models", "_resolve_dtype", "masenvs.engine.loading", "_resolve_dtype"),
]


@pytest.fixture
def fresh() -> Iterator[None]:
    """Forget the old paths so each import runs (and warns) again; restore them after."""
    old = [*MOVED, *SPLIT]
    importlib.import_module("masenvs.adapters.backends")
    saved = {name: sys.modules.get(name) for name in old}
    parents = {}
    for name in old:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        # `from parent import child` skips the import while parent has the attribute.
        parents[name] = sys.modules[parent].__dict__.pop(child, None)
    yield
    for name, module in saved.items():
        parent, _, child = name.rpartition(".")
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
        if parents[name] is not None:
            setattr(sys.modules[parent], child, parents[name])


def import_old(name: str) -> ModuleType:
    with pytest.warns(DeprecationWarning, match=r"moved to masenvs\.(engine|cache)"):
        return importlib.import_module(name)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_module_warns_and_is_the_new_module(fresh, old: str, new: str) -> None:
    assert import_old(old) is importlib.import_module(new)


def test_from_imports_of_a_moved_module_give_the_new_objects(fresh) -> None:
    from masenvs.engine import kernels, protocol

    with pytest.warns(DeprecationWarning, match="masenvs.engine.kernels"):
        from masenvs.adapters.backends import cpu_kernels
    with pytest.warns(DeprecationWarning, match="masenvs.engine.protocol"):
        from masenvs.adapters.backends.base import BackendError, GenerateRequest
    assert cpu_kernels is kernels
    assert (BackendError, GenerateRequest) == (protocol.BackendError, protocol.GenerateRequest)


def test_patching_a_moved_module_reaches_the_engine(fresh, monkeypatch) -> None:
    from masenvs.engine import kernels

    old = import_old("masenvs.adapters.backends.cpu_kernels")
    monkeypatch.setattr(old, "cpu_flags", lambda: {"patched"})
    assert kernels.cpu_flags() == {"patched"}


@pytest.mark.parametrize("old", sorted(SPLIT))
def test_every_public_name_of_a_split_module_is_the_new_object(fresh, old: str) -> None:
    module = import_old(old)
    for new, names in SPLIT[old].items():
        home = importlib.import_module(new)
        for name in names:
            assert getattr(module, name) is getattr(home, name), f"{old}.{name}"


@pytest.mark.parametrize("old, name, new, new_name", PRIVATE)
def test_private_names_of_split_modules_still_resolve(
    fresh, old: str, name: str, new: str, new_name: str
) -> None:
    module = import_old(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), new_name)


def test_a_name_no_module_has_is_an_attribute_error(fresh) -> None:
    module = import_old("masenvs.adapters.backends.embedded")
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_from_import_of_a_split_module_works_with_one_warning(fresh) -> None:
    from masenvs.engine.engine import EmbeddedBackend as new

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from masenvs.adapters.backends.embedded import EmbeddedBackend
        from masenvs.adapters.models import load_model
    assert EmbeddedBackend is new
    assert load_model is importlib.import_module("masenvs.engine.loading").load_model
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 2, [str(w.message) for w in deprecations]


def test_the_new_paths_import_without_warnings() -> None:
    # A fresh interpreter: here the old paths have been imported already.
    code = (
        "from masenvs.engine import EmbeddedBackend, load_model\n"
        "import masenvs.engine.scheduler, masenvs.engine.kernels, masenvs.adapters.endpoint\n"
        "assert EmbeddedBackend.__module__ == 'masenvs.engine.engine'\n"
        "assert load_model.__module__ == 'masenvs.engine.loading'\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_package_imports_no_torch() -> None:
    code = "import sys, masenvs.engine\nassert 'torch' not in sys.modules, 'torch imported'\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
