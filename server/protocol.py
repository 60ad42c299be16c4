"""Wire models shared by the OpenAI endpoints. Pydantic lives here, at the edge, and nowhere below.

Requests ignore unknown fields (clients send vendor extensions) but reject NaN/inf and out-of-range values
with a 400 naming the field. Integer fields are strict (`Int`, `TokenId`): OpenAI refuses `"n": true` and
`"max_tokens": 69.0`, where pydantic's lax mode would read 1 and 69. Each request converts itself into the
engine's `SamplingParams`."""
from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, ValidationError,
                      ValidatorFunctionWrapHandler, WrapValidator, field_validator)

from engines.base import InvalidRequestError, SamplingParams

MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
MAX_LOGIT_BIAS = 1024


# An integer field of a request: a JSON integer only, never a boolean, a float (even 69.0) or a string.
Int = StrictInt
TokenId = Annotated[StrictInt, Field(ge=0)]


# The most ids validated in one call: pydantic validates a list in one piece of native code that holds the
# interpreter lock (a million ids: 0.15-0.2 s on two loaded cores), and nothing else in the process runs.
ID_SLICE = 16_384


def _in_slices(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`handler(value)` (which checks the length limit too), a slice at a time within the limit."""
    if not isinstance(value, list) or len(value) <= ID_SLICE or len(value) > MAX_TOKEN_IDS:
        return handler(value)
    out: list[int] = []
    for start in range(0, len(value), ID_SLICE):
        try:
            out += handler(value[start:start + ID_SLICE])
        except ValidationError as exc:  # the error's index counted from the list's start, not the slice's
            raise ValidationError.from_exception_data(exc.title, [
                {"type": e["type"], "loc": (e["loc"][0] + start, *e["loc"][1:]) if e["loc"] else (), "input": e["input"],
                 **({"ctx": e["ctx"]} if "ctx" in e else {})} for e in exc.errors()]) from None
    return out


MAX_TOKEN_IDS = 1_000_000
# A long list of token ids (what /detokenize takes): list[TokenId] of at most MAX_TOKEN_IDS, checked a
# slice at a time.
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS), WrapValidator(_in_slices)]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class SamplingRequest(OpenAIRequest):
    """The sampling fields chat and completions share (OpenAI's, plus vLLM's common extensions)."""

    model: str | None = None
    n: Int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_STRINGS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"each stop string must be at most {MAX_STOP_LENGTH} characters")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed")
        for key, bias in v.items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0 or math.isnan(bias):
                raise ValueError(f"bias for token {key} must be between -100 and 100")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        vocab_size: int, choice: int = 0) -> SamplingParams:
        """The engine's view of this request, for choice number `choice` (seeds differ per choice)."""
        bias = {int(k): float(b) for k, b in (self.logit_bias or {}).items()}
        for token in list(bias) + list(self.stop_token_ids or []):
            if token >= vocab_size:
                field = "logit_bias" if token in bias else "stop_token_ids"
                raise InvalidRequestError(f"token id {token} in '{field}' is outside the vocabulary "
                                          f"(size {vocab_size})", param=field)
        if self.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) is more than the {max_tokens} tokens this "
                                      "request may generate", param="min_tokens")
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0, seed=seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=bias or None,
            stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens)


def _non_integer_id(value: Any) -> Any:
    """The first boolean or float among a token-id list's items (or a list of such lists'), else None."""
    for item in value if isinstance(value, list) else ():
        for x in item if isinstance(item, list) else (item,):
            if isinstance(x, (bool, float)):
                return x
    return None


def _ids_are_integers(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`handler(value)`; when it fails on a token id that is a boolean or a float, say so (the union's first
    complaint would be "should be a valid string"). Looked for only on failure: a valid list costs nothing."""
    try:
        return handler(value)
    except ValidationError:
        bad = _non_integer_id(value)
        if bad is None:
            raise
        raise ValueError(f"token ids must be integers, got {json.dumps(bad)}") from None


PromptBatch = Annotated[str | list[str] | list[Int] | list[list[Int]], WrapValidator(_ids_are_integers)]


def check_prompt_batch(value: PromptBatch, what: str, limit: int) -> PromptBatch:
    """A text, a token-id list, or a list of either (completions' `prompt`, embeddings' `input`): never an
    empty list or an empty token-id list, at most `limit` items, token ids non-negative."""
    if isinstance(value, list):
        if not value:
            raise ValueError(f"the {what} list is empty")
        if len(value) > limit and not isinstance(value[0], int):
            raise ValueError(f"at most {limit} {what}s per request")
        if isinstance(value[0], list) and any(not p for p in value):
            raise ValueError(f"a token-id {what} is empty")
        token_lists = [value] if isinstance(value[0], int) else [p for p in value if isinstance(p, list)]
        if any(t < 0 for p in token_lists for t in p):
            raise ValueError("token ids must be non-negative")
    return value


def split_prompt_batch(value: PromptBatch) -> list[str | list[int]]:
    """Each item of a batch checked by check_prompt_batch: a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens the prefix cache already held (for n > 1,
    those of each prompt's first choice, as prompt tokens are counted once per prompt)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def check_max_tokens(requested: int | None, default: int, prompt_len: int, limit: int, param: str) -> int:
    """The completion budget: what was asked, or what the context has left; a prompt that leaves no room
    is an error naming the prompt."""
    room = limit - prompt_len
    if room <= 0 or (requested is not None and requested > room and prompt_len >= limit):
        raise InvalidRequestError(f"this model's maximum context length is {limit} tokens, but the prompt has "
                                  f"{prompt_len} tokens", param=param)
    if requested is None:
        return min(default, room)
    if requested > room:
        raise InvalidRequestError(f"this model's maximum context length is {limit} tokens; the prompt has "
                                  f"{prompt_len} tokens and max_tokens asks for {requested} more (at most "
                                  f"{room} fit)", param="max_tokens")
    return requested


