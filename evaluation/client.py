"""The HTTP side of evaluation: the OpenAI wire format and nothing else, so any compatible server works.

- `chat`: POST {base}/chat/completions, non-streaming.
- `continuation_logprob`: POST {base}/completions with `echo: true, logprobs: 1, max_tokens: 0`, which
  returns the log-probability of every prompt token. This needs a server that returns prompt logprobs
  when echoing (ktserve and vLLM do; many hosted APIs and llama.cpp's server do not).

Every request is retried on 408/429/5xx, timeouts and connection errors, with exponential backoff and
full jitter, honouring Retry-After; other errors fail at once.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx


class RequestFailed(Exception):
    """A request that did not produce a usable answer, after `attempts` tries."""

    def __init__(self, message: str, attempts: int):
        super().__init__(message)
        self.attempts = attempts


@dataclass(slots=True)
class RetryPolicy:
    retries: int = 3            # attempts = retries + 1
    base_delay_s: float = 0.5
    max_delay_s: float = 60.0

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        if retry_after is not None:
            return min(retry_after, self.max_delay_s)
        # Full jitter: clients that failed together do not come back together.
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** retry))


@dataclass(slots=True)
class ChatAnswer:
    text: str
    completion_tokens: int | None
    attempts: int


@dataclass(slots=True)
class Loglik:
    logprob: float
    attempts: int


_RETRYABLE_STATUS = {408, 429}


def api_base(url: str) -> str:
    """`url` as an OpenAI API base: a bare host gets `/v1`, a URL with a path is kept as given."""
    url = url.rstrip("/")
    if urlsplit(url).path in ("", "/"):
        url += "/v1"
    return url


class OpenAIClient:
    """Async client for the two endpoints evaluation needs."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, timeout_s: float = 120.0,
                 retry: RetryPolicy | None = None, max_connections: int = 8,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.model = model
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=api_base(base_url), headers=headers, timeout=timeout_s, transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def chat(self, messages: list[dict[str, str]], *, max_tokens: int, temperature: float) -> ChatAnswer:
        """Generate one answer to `messages`."""
        body, attempts = await self._post("chat/completions", chat_payload(self.model, messages, max_tokens,
                                                                           temperature))
        return chat_answer(body, attempts)

    async def continuation_logprob(self, context: str, continuation: str) -> Loglik:
        """Summed log-probability of `continuation` following `context`, from the echoed prompt logprobs."""
        body, attempts = await self._post("completions", loglik_payload(self.model, context, continuation))
        return continuation_loglik(body, continuation, attempts)

    async def _post(self, path: str, payload: dict) -> tuple[dict, int]:
        """POST with retries; returns (JSON body, attempts used)."""
        attempts = self.retry.retries + 1
        for attempt in range(1, attempts + 1):
            retry_after = None
            try:
                response = await self._http.post(path, json=payload)
            except httpx.TransportError as err:  # timeouts, refused and dropped connections
                error = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    try:
                        return response.json(), attempt
                    except ValueError:
                        raise RequestFailed("response body is not JSON", attempt) from None
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code not in _RETRYABLE_STATUS and response.status_code < 500:
                    raise RequestFailed(error, attempt)
                retry_after = parse_retry_after(response.headers.get("retry-after"))
            if attempt < attempts:
                await asyncio.sleep(self.retry.delay(attempt - 1, retry_after))
        raise RequestFailed(error, attempts)


def chat_payload(model: str, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> dict:
    """The /chat/completions request for one answer (also a batch line's body: evaluation/batch.py)."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": False}


def chat_answer(body: dict, attempts: int) -> ChatAnswer:
    try:
        text = body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise RequestFailed("response has no choices[0].message.content", attempts) from None
    usage = body.get("usage") or {}
    return ChatAnswer(text=text, completion_tokens=usage.get("completion_tokens"), attempts=attempts)


def loglik_payload(model: str, context: str, continuation: str) -> dict:
    """The /completions request that echoes `context + continuation` with its prompt logprobs."""
    return {"model": model, "prompt": context + continuation, "max_tokens": 0, "echo": True, "logprobs": 1,
            "temperature": 0.0}


def continuation_loglik(body: dict, continuation: str, attempts: int) -> Loglik:
    try:
        choice = body["choices"][0]
        generated = (body.get("usage") or {}).get("completion_tokens") or 0
        return Loglik(sum_continuation_logprobs(choice["logprobs"], continuation, generated), attempts)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise RequestFailed(
            f"no prompt logprobs in the /completions response ({err}); --mc-mode loglik needs a server "
            "that returns prompt logprobs with echo", attempts) from None


def sum_continuation_logprobs(logprobs: dict, continuation: str, generated_tokens: int = 0) -> float:
    """Sum the logprobs of the tokens that spell `continuation` at the end of an echoed prompt.

    `logprobs` is an OpenAI completions `logprobs` object (`tokens`, `token_logprobs`, `text_offset`).
    Offsets are measured back from the end of the prompt: servers detokenize single tokens of multi-byte
    text differently ("\\ufffd", "bytes:..."), which shifts offsets inside a Chinese question, while the
    continuation is short ASCII at the very end. A token straddling the boundary counts as continuation.
    `generated_tokens` trailing tokens (a server that generated despite max_tokens 0) are ignored.
    """
    tokens, values, offsets = logprobs["tokens"], logprobs["token_logprobs"], logprobs["text_offset"]
    end = len(tokens) - generated_tokens
    if end <= 0 or not (len(values) == len(offsets) == len(tokens)):
        raise ValueError("tokens, token_logprobs and text_offset must be parallel and non-empty")
    prompt_end = offsets[end - 1] + len(tokens[end - 1])
    start = prompt_end - len(continuation)
    picked = [values[i] for i in range(end) if offsets[i] + len(tokens[i]) > start]
    if any(value is None for value in picked):
        raise ValueError("a continuation token has no logprob")
    return float(sum(picked))


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds to wait: either delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
