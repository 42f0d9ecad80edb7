"""The embedded engine on the tiny model: sampling, batching, stops, logprobs, adapters."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from masenvs.engine.engine import EmbeddedBackend
from masenvs.engine.loading import load_model
from masenvs.engine.protocol import (
    Backend,
    BackendError,
    GenerateRequest,
    Generation,
    SamplingParams,
    StreamDelta,
)

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedBackend]:
    # float32: these tests compare log-probs with the transformers model to 1e-4.
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=16, dtype="float32")
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(coro)


def chat(model: str = "", messages=CHAT, **params) -> GenerateRequest:
    return GenerateRequest(model=model, params=SamplingParams(**params), messages=messages)


def raw_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Log-probabilities of `completion_ids` from one plain forward pass of `model`."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def test_implements_backend_protocol(backend: EmbeddedBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.model_names()[0] == "tiny"
    assert backend.tokenizer_id().startswith("sha256:")


def test_same_seed_same_output_and_text_matches_ids(backend: EmbeddedBackend) -> None:
    first = run(backend.generate(chat(max_tokens=24, seed=7)))
    again = run(backend.generate(chat(max_tokens=24, seed=7)))
    other = run(backend.generate(chat(max_tokens=24, seed=8)))
    completion = first.completions[0]
    assert completion.token_ids == again.completions[0].token_ids
    assert completion.token_ids != other.completions[0].token_ids
    assert len(completion.token_ids) == 24 and completion.finish_reason == "length"
    assert backend.decode(completion.token_ids) == completion.text
    rendered = backend.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=False
    )
    assert first.prompt_token_ids == list(rendered)


def test_logprobs_are_raw_model_logprobs(backend: EmbeddedBackend) -> None:
    # Sampled with temperature and top-k, scored at temperature 1 without filtering.
    generation = run(
        backend.generate(chat(max_tokens=16, seed=3, temperature=0.7, top_k=50, top_logprobs=3))
    )
    completion = generation.completions[0]
    expected = raw_logprobs(backend.model, generation.prompt_token_ids, completion.token_ids)
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    assert len(completion.top_logprobs) == 16
    for top, chosen in zip(completion.top_logprobs, completion.logprobs):
        assert len(top) == 3 and max(top.values()) >= chosen - 1e-6


def test_top_p_and_top_k_restrict_the_choice(backend: EmbeddedBackend) -> None:
    greedy = run(backend.generate(chat(max_tokens=8, temperature=0.0))).completions[0]
    top_k_1 = run(
        backend.generate(chat(max_tokens=8, temperature=1.5, top_k=1, seed=1))
    ).completions[0]
    tiny_p = run(
        backend.generate(chat(max_tokens=8, temperature=1.5, top_p=1e-6, seed=2))
    ).completions[0]
    assert greedy.token_ids == top_k_1.token_ids == tiny_p.token_ids


def test_n_choices_share_the_prompt_and_differ(backend: EmbeddedBackend) -> None:
    generation = run(backend.generate(chat(max_tokens=12, seed=11, n=4)))
    assert len(generation.completions) == 4
    assert len({tuple(c.token_ids) for c in generation.completions}) == 4
    again = run(backend.generate(chat(max_tokens=12, seed=11, n=4)))
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in generation.completions]


def test_stop_string_trims_text_and_ids_consistently(backend: EmbeddedBackend) -> None:
    free = run(backend.generate(chat(max_tokens=40, seed=5))).completions[0]
    stop = free.text[10:13]  # a string the unconstrained run produces
    stopped = run(backend.generate(chat(max_tokens=40, seed=5, stop=[stop]))).completions[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text) and len(stopped.text) <= 10
    assert backend.decode(stopped.token_ids) == stopped.text
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert len(stopped.logprobs) == len(stopped.token_ids)


def test_stop_token_is_kept_in_ids_but_not_in_text(backend: EmbeddedBackend) -> None:
    free = run(backend.generate(chat(max_tokens=10, temperature=0.0))).completions[0]
    stop_id = free.token_ids[4]
    stopped = run(
        backend.generate(chat(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))
    ).completions[0]
    first = free.token_ids.index(stop_id)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.text == backend.decode(stopped.token_ids[:-1])
    assert len(stopped.logprobs) == len(stopped.token_ids)


def test_streaming_deltas_add_up_to_the_final_generation(backend: EmbeddedBackend) -> None:
    async def collect(request: GenerateRequest) -> list[StreamDelta | Generation]:
        return [item async for item in backend.stream(request)]

    free = run(backend.generate(chat(max_tokens=30, seed=9, n=2))).completions
    for stop in ([], [free[0].text[20:24]]):
        items = run(collect(chat(max_tokens=30, seed=9, n=2, stop=stop)))
        final = items[-1]
        assert isinstance(final, Generation)
        for index, completion in enumerate(final.completions):
            deltas = [d for d in items[:-1] if d.index == index]
            assert "".join(d.text for d in deltas) == completion.text
            assert sum((d.token_ids for d in deltas), []) == completion.token_ids
            assert sum((d.logprobs for d in deltas), []) == completion.logprobs
            assert deltas[-1].finish_reason == completion.finish_reason
            assert all(d.finish_reason is None for d in deltas[:-1])
        if not stop:
            assert len(items) > 10  # tokens arrive one by one, not in one lump


def test_concurrent_requests_are_batched_and_each_correct(backend: EmbeddedBackend) -> None:
    prompts = [f"Count to {i}:" for i in range(12)]

    # Greedy, so the comparison is exact: the random tiny model's next-token distribution
    # is nearly flat, where float noise of a different batch shape can move a seeded draw.
    def request(i: int) -> GenerateRequest:
        return GenerateRequest(
            model="", params=SamplingParams(max_tokens=10 + i, temperature=0.0), prompt=prompts[i]
        )

    alone = [run(backend.generate(request(i))) for i in range(12)]
    peak_before = backend.stats.peak_batch

    async def together() -> list[Generation]:
        return await asyncio.gather(*(backend.generate(request(i)) for i in range(12)))

    batched = run(together())
    assert backend.stats.peak_batch > max(peak_before, 4)
    for solo, mixed in zip(alone, batched):
        assert mixed.prompt_token_ids == solo.prompt_token_ids
        assert mixed.completions[0].token_ids == solo.completions[0].token_ids
        assert torch.allclose(
            torch.tensor(mixed.completions[0].logprobs),
            torch.tensor(solo.completions[0].logprobs),
            atol=1e-4,
        )


def test_token_id_prompt_and_context_window(backend: EmbeddedBackend) -> None:
    window = backend.max_model_len
    ids = backend.tokenizer("Hello world")["input_ids"]
    generation = run(
        backend.generate(GenerateRequest(model="", params=SamplingParams(max_tokens=3), prompt=ids))
    )
    assert generation.prompt_token_ids == ids
    with pytest.raises(BackendError) as too_long:
        run(
            backend.generate(
                GenerateRequest(model="", params=SamplingParams(), prompt=[5] * window)
            )
        )
    assert too_long.value.status == 400 and "context window" in str(too_long.value)
    # prompt + max_tokens beyond the window: max_tokens is clamped, the choice ends by length
    near = run(
        backend.generate(
            GenerateRequest(
                model="", params=SamplingParams(max_tokens=100), prompt=[5] * (window - 3)
            )
        )
    )
    assert len(near.completions[0].token_ids) == 3 and near.completions[0].finish_reason == "length"


def test_bad_requests_fail_with_clear_errors(backend: EmbeddedBackend) -> None:
    with pytest.raises(BackendError) as unknown:
        run(backend.generate(chat(model="nobody")))
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
    with pytest.raises(BackendError, match="temperature"):
        run(backend.generate(chat(temperature=-1.0)))
    with pytest.raises(BackendError, match="token ids must be integers"):
        run(backend.generate(GenerateRequest(model="", params=SamplingParams(), prompt=[10**9])))


def test_closing_a_stream_early_frees_its_slot(backend: EmbeddedBackend) -> None:
    async def read_one() -> None:
        stream = backend.stream(chat(max_tokens=500, seed=1))
        async for _ in stream:
            break
        await stream.aclose()

    run(read_one())
    run(asyncio.sleep(0.2))
    assert backend._running == []
    assert run(backend.generate(chat(max_tokens=2))).completions[0].token_ids


# ---- LoRA adapters ---------------------------------------------------------------------------


def make_adapter(directory: Path, seed: int) -> Path:
    """A peft LoRA adapter for the tiny model with random (non-zero) B matrices."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_model("tiny").model
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]
    )
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return make_adapter(root / "a1", 1), make_adapter(root / "a2", 2)


def test_adapters_route_by_name_and_batch_together(backend: EmbeddedBackend, adapter_dirs) -> None:
    from peft import PeftModel

    run(backend.load_adapter("a1", str(adapter_dirs[0])))
    run(backend.load_adapter("a2", str(adapter_dirs[1])))
    assert {"a1", "a2"} <= set(backend.model_names())

    solo = {
        name: run(backend.generate(chat(model=name, max_tokens=12, temperature=0.0)))
        for name in ("", "a1", "a2")
    }
    outputs = {name: solo[name].completions[0].token_ids for name in solo}
    assert len({tuple(ids) for ids in outputs.values()}) == 3

    # The adapter's logprobs are those of peft's own forward pass.
    reference = PeftModel.from_pretrained(load_model("tiny").model, str(adapter_dirs[0])).eval()
    expected = raw_logprobs(reference, solo["a1"].prompt_token_ids, outputs["a1"])
    assert torch.allclose(torch.tensor(solo["a1"].completions[0].logprobs), expected, atol=1e-4)

    async def mixed() -> list[Generation]:
        return await asyncio.gather(
            *(
                backend.generate(chat(model=name, max_tokens=12, temperature=0.0))
                for name in ("a2", "", "a1", "a2", "")
            )
        )

    for name, generation in zip(("a2", "", "a1", "a2", ""), run(mixed())):
        assert generation.completions[0].token_ids == outputs[name]


def test_set_adapter_weights_replaces_in_place(backend: EmbeddedBackend, adapter_dirs) -> None:
    from safetensors.torch import load_file

    run(backend.load_adapter("live", str(adapter_dirs[0])))
    before = (
        run(backend.generate(chat(model="live", max_tokens=12, seed=4))).completions[0].token_ids
    )
    tensors = backend._adapters["live"].weights
    other = load_file(str(adapter_dirs[1] / "adapter_model.safetensors"))
    backend.set_adapter_weights("live", other)
    assert backend._adapters["live"].weights is tensors  # same tensors, new values
    after = (
        run(backend.generate(chat(model="live", max_tokens=12, seed=4))).completions[0].token_ids
    )
    assert after != before
    run(backend.load_adapter("a2", str(adapter_dirs[1])))
    assert (
        after
        == run(backend.generate(chat(model="a2", max_tokens=12, seed=4))).completions[0].token_ids
    )
    with pytest.raises(BackendError) as missing:
        backend.set_adapter_weights("nobody", other)
    assert missing.value.status == 404


def test_long_prompts_prefill_in_chunks(backend: EmbeddedBackend, monkeypatch) -> None:
    import masenvs.engine.scheduler as embedded

    request = GenerateRequest(
        model="", params=SamplingParams(max_tokens=8, seed=2, top_logprobs=2), prompt="word " * 60
    )
    whole = run(backend.generate(request)).completions[0]
    monkeypatch.setattr(embedded, "PREFILL_TOKENS", 16)
    chunked = run(backend.generate(request)).completions[0]
    assert chunked.token_ids == whole.token_ids
    assert torch.allclose(torch.tensor(chunked.logprobs), torch.tensor(whole.logprobs), atol=1e-4)


def test_identical_prompts_arriving_together_prefill_once(backend: EmbeddedBackend) -> None:
    messages = [{"role": "user", "content": "A prompt four requests share."}]
    before = backend.stats.prefilled_tokens + backend.stats.prefix_hit_tokens

    async def together() -> list[Generation]:
        # Holding the engine's lock keeps it from admitting the first request before the
        # others are queued, as it would when they arrive within one decode step.
        with backend._wakeup:
            tasks = [
                asyncio.create_task(backend.generate(chat(messages=messages, max_tokens=6, seed=s)))
                for s in range(4)
            ]
            await asyncio.sleep(0.01)
            assert len(backend._waiting) == 4
        return await asyncio.gather(*tasks)

    group = run(together())
    run_once = backend.stats.prefilled_tokens + backend.stats.prefix_hit_tokens - before
    assert run_once == len(group[0].prompt_token_ids)
    assert len({tuple(g.completions[0].token_ids) for g in group}) == 4
    for generation in group:  # each copy of the shared prefill is the real prompt's KV
        completion = generation.completions[0]
        expected = raw_logprobs(backend.model, generation.prompt_token_ids, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_prompts_sharing_a_prefix_arriving_together_prefill_it_once(
    backend: EmbeddedBackend,
) -> None:
    # A later agent's K branches: one long shared context, then each branch's own answer.
    context = "The board: " + "wall, floor, " * 20 + "and the goal. The proposal was: "
    tails = ["up up left", "down right", "left left left down", "right"]
    before = backend.stats.prefilled_tokens, backend.stats.prefix_hit_tokens

    async def together() -> list[Generation]:
        with backend._wakeup:  # queued within one decode step, as a tree rollout sends them
            tasks = [
                asyncio.create_task(
                    backend.generate(
                        chat(
                            messages=[{"role": "user", "content": context + tail}],
                            max_tokens=6,
                            seed=s,
                            top_logprobs=1,
                        )
                    )
                )
                for s, tail in enumerate(tails)
            ]
            await asyncio.sleep(0.01)
            assert len(backend._waiting) == len(tails)
        return await asyncio.gather(*tasks)

    group = run(together())
    prompts = [g.prompt_token_ids for g in group]
    shared = min(
        next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:]
    )
    assert shared > 60
    ran = backend.stats.prefilled_tokens - before[0]
    reused = backend.stats.prefix_hit_tokens - before[1]
    assert ran + reused == sum(map(len, prompts))
    assert ran <= sum(map(len, prompts)) - (len(prompts) - 1) * shared
    for generation in group:  # each tail ran on the real prefix's KV
        completion = generation.completions[0]
        expected = raw_logprobs(backend.model, generation.prompt_token_ids, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_next_turn_reuses_the_cached_conversation(backend: EmbeddedBackend) -> None:
    turn1 = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    first = run(backend.generate(chat(messages=turn1, max_tokens=40, seed=3)))
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.completions[0].text},
        {"role": "user", "content": "Shorter, please."},
    ]
    hits = backend.stats.prefix_hit_tokens
    second = run(backend.generate(chat(messages=turn2, max_tokens=12, seed=4)))
    assert backend.stats.prefix_hit_tokens - hits >= len(first.prompt_token_ids)
    completion = second.completions[0]
    expected = raw_logprobs(backend.model, second.prompt_token_ids, completion.token_ids)
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6)]
)
def test_sampler_draws_from_the_requested_distribution(temperature, top_k, top_p) -> None:
    from masenvs.engine.sampling import RowSampling, sample

    vocab = 1000  # not a multiple of the sampler's 256-token blocks
    logits = torch.full((vocab,), -float("inf"))
    logits[[3, 300, 301, 700, 999]] = torch.tensor([2.0, 1.0, 0.5, 0.0, 1.5])
    expected = torch.softmax(logits / temperature, dim=-1)
    order = expected.argsort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    if top_k:
        keep[order[:top_k]] = True
    elif top_p < 1.0:
        before = expected[order].cumsum(0) - expected[order]
        keep[order[before < top_p]] = True
    else:
        keep[:] = True
    expected = torch.where(keep, expected, 0.0)
    expected /= expected.sum()

    rows = [
        RowSampling(temperature, top_p, top_k, 0, torch.Generator().manual_seed(i))
        for i in range(4000)
    ]
    counts = torch.zeros(vocab)
    for _ in range(5):
        drawn = sample(logits.expand(len(rows), -1).contiguous(), rows)
        counts += torch.bincount(torch.tensor(drawn.tokens), minlength=vocab)
        raw = torch.log_softmax(logits, -1)
        assert torch.allclose(torch.tensor(drawn.logprobs), raw[drawn.tokens], atol=1e-5)
    frequencies = counts / counts.sum()
    assert counts[expected == 0].sum() == 0
    assert torch.allclose(frequencies, expected, atol=0.015)


def test_in_place_base_weight_updates_are_served(backend: EmbeddedBackend) -> None:
    request = chat(max_tokens=8, temperature=0.0)
    before = run(backend.generate(request)).completions[0]
    weight = backend.model.model.layers[0].mlp.up_proj.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(25.0)  # as an optimizer step would, in place
        backend.reset_prefix_cache()
        generation = run(backend.generate(request))
        after = generation.completions[0]
        expected = raw_logprobs(backend.model, generation.prompt_token_ids, after.token_ids)
        assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4)
        assert not torch.allclose(
            torch.tensor(after.logprobs[:1]), torch.tensor(before.logprobs[:1])
        )
    finally:
        with torch.no_grad():
            weight.copy_(original)
        backend.reset_prefix_cache()


def test_bfloat16_int8_engine_samples_the_same_policy_closely() -> None:
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=4, dtype="bfloat16", quantize="int8")
    try:
        generation = run(engine.generate(chat(max_tokens=12, seed=5, n=2)))
        reference = load_model("tiny")  # float32
        for completion in generation.completions:
            assert len(completion.token_ids) == 12
            assert engine.decode(completion.token_ids) == completion.text
            expected = raw_logprobs(
                reference.model, generation.prompt_token_ids, completion.token_ids
            )
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=0.05)
    finally:
        engine.shutdown()
    with pytest.raises(BackendError, match="bfloat16"):
        EmbeddedBackend.from_spec("tiny", dtype="float32", quantize="int8")


def test_thread_local_thread_count_leaves_other_threads_alone() -> None:
    from masenvs.engine.omp import set_thread_local_threads

    before = torch.get_num_threads()
    seen: list[tuple[bool, int]] = []

    def engine_like() -> None:
        changed = set_thread_local_threads(1)
        seen.append((changed, torch.get_num_threads()))

    worker = threading.Thread(target=engine_like)
    worker.start()
    worker.join()
    changed, count = seen[0]
    assert torch.get_num_threads() == before  # the calling thread keeps its count
    if "OpenMP" in torch.__config__.parallel_info():  # Linux wheels are OpenMP builds
        assert changed and count == 1


def test_loading_off_thread_returns_or_raises_like_a_call() -> None:
    from masenvs.engine.omp import run_off_thread, wakeups_are_costly

    caller = threading.get_ident()
    assert run_off_thread(threading.get_ident) != caller
    with pytest.raises(KeyError, match="missing"):
        run_off_thread(lambda: {}["missing"])
    assert isinstance(wakeups_are_costly(2, repeats=5), bool)
    assert torch.get_num_threads() >= 1


def test_engine_decides_its_small_batch_threads_on_its_own_thread() -> None:
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=4)
    try:
        run(engine.generate(chat(max_tokens=2)))  # the engine thread has started and measured
        assert engine.single_thread_rows in (0, 4)
    finally:
        engine.shutdown()
    pinned = EmbeddedBackend.from_spec("tiny", max_batch_size=4, single_thread_rows=2)
    try:
        run(pinned.generate(chat(max_tokens=2)))
        assert pinned.single_thread_rows == 2
    finally:
        pinned.shutdown()
