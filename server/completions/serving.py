"""POST /v1/completions: prompt(s) -> engine -> OpenAI legacy JSON, with echo and legacy logprobs.

`max_tokens: 0` with `echo: true` and `logprobs` returns the prompt's own token logprobs: the way
evaluation harnesses score multiple-choice options by log-likelihood.

A text prompt's tokens are the client's: the BOS the tokenizer puts before the text is the model's, seen by
it but neither echoed nor counted in `usage.prompt_tokens` (nor in `cached_tokens`), so the echoed tokens
and the usage always agree, and lm-eval's `token_logprobs[len(context tokens):-1]` is the continuation."""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request

from engines.base import Engine, GenerationOutput, InvalidRequestError, TokenLogprob
from server.completions.protocol import CompletionRequest
from server.errors import APIError
from server.protocol import check_max_tokens, usage
from server.serving import (
    SSE, ChoiceHandle, Deadline, Event, StreamError, cancel_all, check_capacity, collect, encode_all, merged, new_id,
    resolve_adapter, stream_response, submit_choices, with_deadline,
)
from server.tracking import tracker_of


def legacy_logprobs(entries: list[TokenLogprob | None], special: set[int], start_offset: int = 0) -> dict:
    """OpenAI's legacy shape: parallel lists of tokens, their logprobs, top alternatives and the character
    offset where each token's text starts in the returned text (special tokens add no characters)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = start_offset
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        assert e is not None
        tokens.append(e.token)
        offsets.append(offset)
        if e.token_id not in special:
            offset += len(decoder.decode(bytes(e.bytes or [])))
        token_logprobs.append(e.logprob if e.logprob is not None else None)
        top_logprobs.append({t.token: t.logprob for t in e.top} if e.top or e.logprob is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def check_best_of(req: CompletionRequest) -> int:
    """How many candidates to generate per prompt: `best_of` (vLLM's semantics), else `n`."""
    if req.best_of is None:
        return req.n
    if req.best_of < req.n:
        raise InvalidRequestError(f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
    if req.stream and req.best_of > req.n:
        raise InvalidRequestError("best_of cannot be used with stream: the best candidates are known only at "
                                  "the end", param="best_of")
    return req.best_of


def cumulative_logprob(out: GenerationOutput) -> float:
    return sum(e.logprob for e in out.logprobs or [])


def best_candidates(outputs: list[GenerationOutput], plans: list, candidates: int, n: int
                    ) -> tuple[list[GenerationOutput], list]:
    """Per prompt, the `n` of its `candidates` outputs with the highest cumulative logprob, best first."""
    kept_outputs, kept_plans = [], []
    for start in range(0, len(outputs), candidates):
        group = sorted(range(start, start + candidates), key=lambda i: cumulative_logprob(outputs[i]), reverse=True)
        kept_outputs += [outputs[i] for i in group[:n]]
        kept_plans += [plans[i] for i in group[:n]]
    return kept_outputs, kept_plans


@dataclass(frozen=True, slots=True)
class PromptIds:
    """A prompt's token ids, of which the first `added` are what the server put before the client's text
    (the tokenizer's BOS): the model sees them; an echo does not show them and usage does not count them."""

    ids: list[int]
    added: int = 0

    @property
    def shown(self) -> list[int]:
        return self.ids[self.added:]

    def shown_cached(self, cached: int) -> int:
        """Of the `cached` leading positions the prefix cache held, how many are shown tokens."""
        return max(0, cached - self.added)


def prompt_usage(plans: list[PromptIds], cached: list[int], completion_tokens: int, n: int) -> dict[str, Any]:
    """Usage of a request whose choices (`n` per prompt, in order) had these plans and cached positions: each
    prompt counted once, by its shown tokens."""
    firsts = list(zip(plans[::n], cached[::n]))
    return usage(sum(len(p.shown) for p, _ in firsts), completion_tokens,
                 sum(p.shown_cached(c) for p, c in firsts))


class CompletionServing:
    def __init__(self, engine: Engine, request_timeout: float | None = None):
        self.engine = engine
        self.request_timeout = request_timeout
        self._prefix: list[int] | None = None

    async def _tokenize(self, prompts: list[str | list[int]]) -> list[PromptIds]:
        """Each prompt's ids: the texts encoded together (off the loop when many or long), id lists checked."""
        tokenizer = self.engine.tokenizer
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str) and not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            if not isinstance(prompt, str):
                self.engine.check_token_ids(prompt, "prompt", f"prompt {index}")
        encoded = iter(await encode_all(tokenizer, [p for p in prompts if isinstance(p, str)]))
        added = self._added_before_text()
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = next(encoded)
                out.append(PromptIds(ids, len(added) if ids[:len(added)] == added else 0))
            else:
                out.append(PromptIds(prompt))
        return out

    def _added_before_text(self) -> list[int]:
        """The special tokens the tokenizer puts before a text (DeepSeek's BOS), found once."""
        if self._prefix is None:
            tokenizer = self.engine.tokenizer
            full, bare = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
            start = next((k for k in range(len(full)) if full[k:k + len(bare)] == bare), 0)
            self._prefix = full[:start]
        return self._prefix

    async def create(self, req: CompletionRequest, raw: Request):
        engine = self.engine
        tracker = tracker_of(raw)
        adapter = resolve_adapter(engine, req.model)
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequestError("max_tokens 0 is only meaningful with echo (to score the prompt)",
                                      param="max_tokens")
        if req.suffix:
            raise InvalidRequestError("'suffix' is not supported by this server", param="suffix")
        candidates = check_best_of(req)
        prompts = await self._tokenize(req.prompts())
        check_capacity(engine, candidates * len(prompts), "best_of" if req.best_of else "n")
        limit = engine.info.max_model_len
        vocab = len(engine.tokenizer)
        request_id = new_id("cmpl")
        # ranking best_of candidates needs each sampled token's logprob, shown only when asked for
        logprobs = 0 if candidates != req.n and req.logprobs is None else req.logprobs
        handles: list[ChoiceHandle] = []
        plans: list[PromptIds] = []
        try:
            for p_index, prompt in enumerate(prompts):
                ids = prompt.ids
                max_tokens = check_max_tokens(req.max_tokens, 16, len(ids), limit, "prompt")
                prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
                params = [req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                              prompt_logprobs=prompt_lp, vocab_size=vocab, choice=c)
                          for c in range(candidates)]
                handles += submit_choices(engine, tracker, ids, params, adapter, f"{request_id}-{p_index}")
                plans += [prompt] * candidates
        except Exception:
            cancel_all(handles)
            raise
        model = req.model or engine.info.id
        if req.stream:
            return stream_response(tracker, self._stream(req, request_id, model, handles, plans), handles, SSE)
        outputs = await collect(raw, tracker, handles, self.request_timeout)
        generated = sum(o.completion_tokens for o in outputs)
        if candidates != req.n:
            outputs, plans = best_candidates(outputs, plans, candidates, req.n)
        return self._response(req, request_id, model, outputs, plans, generated)

    def _echo_text(self, prompt: PromptIds) -> str:
        return self.engine.tokenizer.decode(prompt.shown, skip_special_tokens=True)

    def _special(self) -> set[int]:
        return set(self.engine.tokenizer.all_special_ids)

    def _choice(self, req: CompletionRequest, index: int, out: GenerationOutput, prompt: PromptIds) -> dict:
        text = out.text
        logprobs = None
        if req.echo:
            text = self._echo_text(prompt) + text
        if req.logprobs is not None:
            entries: list[Any] = []
            if req.echo:
                entries = self._prompt_entries(prompt, out)
            entries += out.logprobs or []
            logprobs = legacy_logprobs(entries, self._special())
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}

    def _prompt_entries(self, prompt: PromptIds, out: GenerationOutput) -> list[TokenLogprob]:
        """The logprob entries of the prompt the client sent. Its first token has no context (logprob null)
        unless the server put a BOS before it: that one is not echoed, and the first token's logprob is
        the model's given the BOS — so `token_logprobs` lines up with the client's own tokenization of its
        text (what lm-eval slices by)."""
        if prompt.added:
            return list((out.prompt_logprobs or [])[prompt.added:])  # type: ignore[arg-type]
        text = self._token(prompt.ids[0])
        first = TokenLogprob(token_id=prompt.ids[0], token=text, logprob=None, bytes=list(text.encode()))  # type: ignore[arg-type]
        return [first] + list((out.prompt_logprobs or [None])[1:])  # type: ignore[list-item]

    def _token(self, token_id: int) -> str:
        return self.engine.tokenizer.convert_ids_to_tokens(token_id) if token_id in self._special() else \
            self.engine.tokenizer.decode([token_id])

    def _response(self, req, request_id, model, outputs: list[GenerationOutput], plans, generated: int) -> dict:
        for out in outputs:
            if out.finish_reason == "error":
                raise APIError(500, out.error or "generation failed", type="internal_error")
        choices = [self._choice(req, i, out, plans[i]) for i, out in enumerate(outputs)]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices,
                "usage": prompt_usage(plans, [o.cached_tokens for o in outputs], generated, req.n)}

    async def _stream(self, req, request_id, model, handles, plans) -> AsyncIterator[Event]:
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        include_usage = req.include_usage
        offsets = [0] * len(handles)  # characters of text sent so far, per choice
        echoed = [False] * len(handles)
        completion_tokens = [0] * len(handles)
        cached_tokens = [0] * len(handles)

        def chunk(choices, usage_value=None):
            body = {**base, "choices": choices}
            if include_usage:
                body["usage"] = usage_value
            return body

        try:
            async for i, out in with_deadline(merged(handles), Deadline(self.request_timeout)):
                completion_tokens[i] = out.completion_tokens
                cached_tokens[i] = out.cached_tokens
                if out.finish_reason == "error":
                    yield StreamError.of(out)
                    return
                text, entries = out.text, list(out.logprobs or [])
                if req.echo and not echoed[i]:
                    echoed[i] = True
                    text = self._echo_text(plans[i]) + text
                    if req.logprobs is not None:
                        entries = self._prompt_entries(plans[i], out) + entries
                logprobs = legacy_logprobs(entries, self._special(), offsets[i]) if req.logprobs is not None else None
                offsets[i] += len(text)
                yield chunk([{"index": i, "text": text, "logprobs": logprobs,
                              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}])
        except TimeoutError:
            yield StreamError(f"the request did not finish within {self.request_timeout:g} seconds",
                              "timeout_error", "request_timeout")
            return
        if include_usage:
            yield chunk([], prompt_usage(plans, cached_tokens, sum(completion_tokens), req.n))
