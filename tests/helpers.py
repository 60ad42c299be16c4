"""Reference computations the end-to-end tests compare the server against."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`, run directly on the model."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def forward_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of one full forward pass: row i predicts token i + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


async def with_peak_running(engine, work, timeout: float = 240) -> tuple[object, int]:
    """Await `work` (bounded by `timeout`) while sampling `engine.stats().running` every 10 ms: (its result,
    the most requests seen generating at once)."""
    import asyncio

    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, engine.stats().running)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        return await asyncio.wait_for(work, timeout=timeout), peak
    finally:
        watcher.cancel()


# On the GPU the whole non-expert model runs in bf16, adding its rounding to kt-kernel's. Measured on an H200
# with demo-model-v3 against float32 transformers: median |dlogprob| 0.060, top-1 agreement 97.4% over 235
# positions, 32 of 32 greedy tokens identical.
GPU_MIN_TOP1_AGREEMENT = 0.95
GPU_MEDIAN_LOGPROB_DIFF = 0.1


RIVER_TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred "
              "small streams. They join in the valley, turn the old mills, pass the market towns and slow down in "
              "the plain, where farmers have dug canals for a thousand years. ") * 6


def prompt_of_length(tokenizer, text: str, length: int) -> tuple[str, list[int]]:
    """About the first `length` tokens of `text` as text, and its token ids as the server will see them."""
    cut = tokenizer.decode(tokenizer.encode(text)[1:length], skip_special_tokens=True)
    return cut, tokenizer.encode(cut)


def logprob_diffs(server, tokenizer, model, prompt: tuple[str, list[int]]) -> tuple[list[float], float]:
    """|served prompt logprob - `model`'s| at every position of `prompt` (text, ids), and the share of positions
    where both rank the same token first."""
    _, ids = prompt
    # the ids, BOS included, so the echoed logprobs line up with them (a text prompt's added BOS is not echoed)
    reply = server.openai().completions.create(model=server.engine.info.id, prompt=ids, max_tokens=0, echo=True,
                                               logprobs=1)
    served, expected = reply.choices[0].logprobs, forward_logprobs(model, ids)
    diffs = [abs(served.token_logprobs[i] - float(expected[i - 1, ids[i]])) for i in range(1, len(ids))]
    agree = sum(max(served.top_logprobs[i], key=served.top_logprobs[i].get)
                == tokenizer.decode([int(expected[i - 1].argmax())]) for i in range(1, len(ids)))
    return diffs, agree / (len(ids) - 1)


def completion_text(server, prompt: str, max_tokens: int = 16, stream: bool = False) -> str:
    """The greedy completion of a raw prompt, streamed or whole."""
    client = server.openai()
    kwargs = dict(model=server.engine.info.id, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def completions_together(server, prompts: list[str], max_tokens: int = 16, ignore_eos: bool = False) -> list[str]:
    """The greedy completions of `prompts`, all requested at once (bounded: two minutes in all)."""
    import asyncio

    client = server.async_openai()

    async def one(prompt: str) -> str:
        reply = await client.completions.create(model=server.engine.info.id, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0, extra_body={"ignore_eos": ignore_eos})
        return reply.choices[0].text

    async def together() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=120)

    return asyncio.run(together())


def logprob_tolerance(engine) -> float:
    """How closely served logprobs must match transformers' float32 forward pass: the HF engine computes the
    same float32 ops; the KT engine's kt-kernel experts round activations to bf16 (0.4% relative error)."""
    return 1e-3 if engine.name == "huggingface" else 0.05


def require_kt_kernel() -> None:
    """Skip unless kt-kernel loads here; loads it the way the engine does (IEEE floats kept in this thread)."""
    import pytest

    try:
        from engines.kt.experts.cpuinfer import load_ext
        load_ext()
    except ImportError as exc:
        pytest.skip(f"kt-kernel does not load on this CPU: {exc}", allow_module_level=True)


def assert_error(r, status: int, param: str | None = None) -> dict:
    """`r` is OpenAI error JSON with `status` (and `param`, when given); its error object."""
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


async def stream_chat(server, content: str, max_tokens: int, started: asyncio.Event | None = None
                      ) -> tuple[str, str | None]:
    """A greedy chat stream read to its end: (text, finish reason); `started` is set at the first delta."""
    stream = await server.async_openai().chat.completions.create(
        model=server.engine.info.id, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=max_tokens, stream=True)
    text, finish = [], None
    async for chunk in stream:
        if started is not None:
            started.set()
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def run_beside_a_stream(server, content: str, max_tokens: int, other) -> tuple[str, object]:
    """Stream `content`; once its first delta arrived, call `other()` in a thread. (the stream's text, what
    `other` returned)."""
    async def main():
        started = asyncio.Event()
        neighbour = asyncio.create_task(stream_chat(server, content, max_tokens, started))
        await asyncio.wait_for(started.wait(), timeout=120)
        result = await asyncio.to_thread(other)
        text, _ = await neighbour
        return text, result

    return asyncio.run(asyncio.wait_for(main(), timeout=240))


@contextmanager
def failing_steps(runner, poison: int) -> Iterator[list[bool]]:
    """While open, `runner.execute` fails every step that carries a request whose prompt holds token `poison`,
    after running the step's other chunks (so the engine's rerun of them must not compute their positions on top
    of the first run's: KV rows, cache growth). Yields, per such step, whether other requests shared it."""
    execute = runner.execute
    shared: list[bool] = []

    def faulty_execute(chunks):
        poisoned = [c for c in chunks if poison in c.seq.request.prompt_token_ids]
        if not poisoned:
            return execute(chunks)
        others = [c for c in chunks if c not in poisoned]
        shared.append(bool(others))
        if others:
            execute(others)
        raise RuntimeError("injected fault")

    runner.execute = faulty_execute
    try:
        yield shared
    finally:
        del runner.execute


def poisoned_request(server, poison: int) -> httpx.Response:
    """A completion whose prompt carries token `poison` (see failing_steps)."""
    with server.http() as http:
        return http.post("/v1/completions", json={"model": server.engine.info.id, "prompt": [poison, 100, 200],
                                                   "max_tokens": 4})


# the prompt the batch-invariance tests score and complete, alone and beside NEIGHBOUR_PROMPTS
INVARIANCE_PROMPT = "The quick brown fox jumps over the lazy dog because it was bored of the meadow."
NEIGHBOUR_PROMPTS = [f"Question: {i}+{i}=? Answer: {2 * i}. Then {i} more carts rolled into the village square, "
                     f"and the miller counted them twice. " * (1 + i % 3) for i in range(15)]


def alone_and_beside(server, request: dict, neighbours: int, timeout: float = 300) -> tuple[dict, dict]:
    """`request` (a /v1/completions body) answered alone, then again while `neighbours` other requests (greedy
    completions and echoed prompts of NEIGHBOUR_PROMPTS) run beside it: the two choices. It runs once before
    either, so both find the same pages of it in the prefix cache."""
    async def run(count: int) -> dict:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=timeout) as client:
            async def post(body: dict) -> dict:
                r = await client.post("/v1/completions", json={"model": server.engine.info.id, **body})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            others = [{"prompt": p, "max_tokens": 8, "temperature": 0} if i % 2 else
                      {"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}
                      for i, p in enumerate(NEIGHBOUR_PROMPTS[:count])]
            answers = await asyncio.wait_for(asyncio.gather(*[post(b) for b in others], post(request)), timeout)
            return answers[-1]
    asyncio.run(run(0))
    return asyncio.run(run(0)), asyncio.run(run(neighbours))
