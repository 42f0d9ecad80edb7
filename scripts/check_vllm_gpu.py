"""Check `VLLMBackend` against a real vLLM server (a GPU machine, < 8 minutes; or the CPU build).

Starts vLLM on a small model with LoRA enabled, then checks what the CPU tests check
against the stand-in server: token ids and text agree, prompt ids are the chat template's,
logprobs are the raw model's (compared with a transformers forward pass), streaming adds
up, stop strings and tokens are handled, n/seed work, LoRA adapters load and are replaced
at run time (compared with peft), and the endpoint traces vLLM calls.

    scripts/check_vllm_gpu.sh                       # SmolLM2-135M, vLLM from $MASENVS_VLLM_BIN
    python scripts/check_vllm_gpu.py --model /models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from masenvs.adapters.backends.launch import launch_vllm, model_dir
from masenvs.adapters.backends.vllm import VLLMBackend
from masenvs.cache import DEFAULT_MODEL
from masenvs.engine.protocol import GenerateRequest, SamplingParams

MESSAGES = [{"role": "user", "content": "Name three colours, then stop."}]
TOLERANCE = 0.15  # nats: vLLM runs bf16 kernels, the reference fp32
DEVICE = "cuda"  # of the reference forward passes; --device cpu: the CPU build or fake_vllm

results: list[tuple[str, bool, str]] = []


def check(name: str) -> Callable[[Callable[[], str | None]], None]:
    def run(body: Callable[[], str | None]) -> None:
        start = time.monotonic()
        try:
            detail = body() or ""
            results.append((name, True, detail))
            print(f"PASS {name} ({time.monotonic() - start:.1f} s) {detail}", flush=True)
        except Exception as exc:  # report every check, then fail at the end
            results.append((name, False, repr(exc)))
            print(f"FAIL {name}: {exc!r}", flush=True)
            traceback.print_exc()

    return run


def chat(model: str = "", **params) -> GenerateRequest:
    return GenerateRequest(model=model, params=SamplingParams(**params), messages=MESSAGES)


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(out)
    return out


def reference_logprobs(
    base: Path, adapter: Path | None, prompt: list[int], ids: list[int]
) -> list[float]:
    """Log-probabilities of `ids` after `prompt` under transformers (and peft) in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(DEVICE).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    tokens = torch.tensor([prompt + ids], device=DEVICE)
    with torch.no_grad():
        logits = model(tokens).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(ids, device=DEVICE)[:, None])[:, 0].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    base = Path(model_dir(args.model))
    work = Path(tempfile.mkdtemp(prefix="masenvs-vllm-check-"))
    adapters = [make_adapter(base, work / f"adapter{seed}", seed) for seed in (1, 2)]
    print(f"model {base}; adapters in {work}", flush=True)
    started = time.monotonic()
    extra_args = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.4", "--enforce-eager"]
    if DEVICE == "cpu":
        # The CPU build in float32 computes what the float32 references do (|diff| ~ 0); in
        # its default bfloat16, n/seed and LoRA drift past the tolerance.
        extra_args += ["--dtype", "float32"]
    server = launch_vllm(
        str(base), max_lora_rank=8, timeout=args.startup_timeout, extra_args=extra_args
    )
    print(
        f"vllm serve healthy after {time.monotonic() - started:.0f} s at {server.url}", flush=True
    )
    try:
        run_checks(VLLMBackend(server.url, tokenizer=str(base)), base, adapters)
    finally:
        server.stop()
    failed = [name for name, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed", flush=True)
    if failed:
        print("failed: " + ", ".join(failed))
        print(f"vllm log: {server.log_path}")
    return 1 if failed else 0


def run_checks(backend: VLLMBackend, base: Path, adapters: list[Path]) -> None:
    def generate(request: GenerateRequest):
        return asyncio.run(backend.generate(request))

    greedy = {}

    @check("chat: ids, text and prompt ids agree")
    def _() -> str:
        out = generate(chat(max_tokens=32, temperature=0, top_logprobs=3))
        c = out.completions[0]
        visible = c.token_ids[:-1] if isinstance(c.stop_reason, int) else c.token_ids
        assert backend.decode(visible) == c.text
        rendered = backend.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(rendered) == out.prompt_token_ids, "prompt ids differ from the template"
        assert len(c.logprobs) == len(c.token_ids) and all(len(t) == 3 for t in c.top_logprobs)
        for chosen, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert abs(max(top.values()) - lp) < 1e-3 and top.get(chosen) is not None
        greedy.update(prompt=out.prompt_token_ids, completion=c)
        return f"{len(c.token_ids)} tokens, finish={c.finish_reason}, stop_reason={c.stop_reason}"

    @check("logprobs are the raw model's (vs transformers fp32)")
    def _() -> str:
        c = greedy["completion"]
        diff = max_diff(c.logprobs, reference_logprobs(base, None, greedy["prompt"], c.token_ids))
        assert diff < TOLERANCE, diff
        return f"max |diff| {diff:.4f}"

    @check("n and seed: same seed, same samples")
    def _() -> str:
        request = chat(max_tokens=16, n=4, seed=11, temperature=1.0)
        first, second = generate(request), generate(request)
        ids = [c.token_ids for c in first.completions]
        assert ids == [c.token_ids for c in second.completions]
        assert len({tuple(i) for i in ids}) > 1
        return "4 choices"

    @check("streaming adds up to the same greedy answer")
    def _() -> str:
        async def collect():
            return [e async for e in backend.stream(chat(max_tokens=32, temperature=0))]

        events = asyncio.run(collect())
        final = events[-1].completions[0]
        assert final.token_ids == greedy["completion"].token_ids
        assert "".join(e.text for e in events[:-1]) == final.text
        assert [t for e in events[:-1] for t in e.token_ids] == final.token_ids
        return f"{len(events) - 1} deltas"

    @check("stop string: ids cut to whole tokens before it")
    def _() -> str:
        text = greedy["completion"].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        c = generate(chat(max_tokens=32, temperature=0, stop=[stop])).completions[0]
        assert c.stop_reason == stop and stop not in c.text
        assert backend.decode(c.token_ids) == c.text and text.startswith(c.text)
        return f"stop {stop!r}"

    @check("completions with a token-id prompt")
    def _() -> str:
        prompt = greedy["prompt"]
        out = generate(
            GenerateRequest(
                model="", params=SamplingParams(max_tokens=8, temperature=0), prompt=prompt
            )
        )
        assert out.prompt_token_ids == prompt
        assert out.completions[0].token_ids == greedy["completion"].token_ids[:8]
        return ""

    @check("LoRA loaded at run time, then replaced in place (vs peft)")
    def _() -> str:
        diffs = []
        for adapter in adapters:
            asyncio.run(backend.load_adapter("agent", str(adapter)))
            c = generate(chat("agent", max_tokens=16, temperature=0)).completions[0]
            reference = reference_logprobs(base, adapter, greedy["prompt"], c.token_ids)
            diffs.append(max_diff(c.logprobs, reference))
        assert "agent" in backend.model_names()
        assert max(diffs) < TOLERANCE, diffs
        asyncio.run(backend.unload_adapter("agent"))
        assert "agent" not in backend.model_names()
        return "max |diff| " + ", ".join(f"{d:.4f}" for d in diffs)

    @check("endpoint traces vLLM calls (openai client)")
    def _() -> str:
        import openai

        from masenvs.adapters.endpoint import EndpointServer, create_app
        from masenvs.traces import TraceStore

        store = TraceStore(tempfile.mkdtemp())
        with EndpointServer(create_app(backend, store=store)) as server:
            api = openai.OpenAI(base_url=server.rollout_url("gpu"), api_key="-")
            answer = api.chat.completions.create(model="planner", messages=MESSAGES, max_tokens=16)
        (record,) = store.calls()
        assert (
            record.backend == "vllm" and answer.choices[0].message.content == record.choices[0].text
        )
        return f"record {record.id}"


if __name__ == "__main__":
    sys.exit(main())
