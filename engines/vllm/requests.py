"""Our request and output types <-> vLLM's: sampling parameters, structured output, LoRA requests, and the
deltas vLLM streams back turned into `GenerationOutput`s.

Pure functions over vLLM's own classes, so they are tested against the installed vLLM without running it."""
from __future__ import annotations

import json
from typing import Any

from engines.base import (
    GenerationOutput, GenerationRequest, InvalidRequestError, TokenLogprob, TopLogprob, UnsupportedError,
)
from engines.runtime.sampler import TokenText


def sampling_params(request: GenerationRequest, max_logprobs: int) -> Any:
    """vLLM `SamplingParams` for one request, streaming deltas. `max_tokens: 0` (prompt scoring) asks vLLM
    for one token, which `OutputStream` then drops: vLLM insists on generating at least one."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    p = request.sampling
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(p, name)
        if asked is not None and asked > max_logprobs:
            raise InvalidRequestError(f"{name}: at most {max_logprobs} alternatives per token can be returned by "
                                      f"this server (vllm_config.max_logprobs), {asked} were asked for", param=name)
    return VLLMSamplingParams(
        n=1, max_tokens=max(p.max_tokens, 1), temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        min_p=p.min_p, seed=p.seed, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
        min_tokens=min(p.min_tokens, max(p.max_tokens, 1)), logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
        skip_special_tokens=p.skip_special_tokens, structured_outputs=structured_outputs(request),
        output_kind=RequestOutputKind.DELTA)


def structured_outputs(request: GenerationRequest) -> Any:
    """vLLM's structured-output parameters for the request's grammar (vLLM's llguidance backend runs it)."""
    grammar = request.sampling.grammar
    if grammar is None:
        return None
    check_grammar_supported(grammar)
    from vllm.sampling_params import StructuredOutputsParams

    if grammar.kind == "json_schema":
        return StructuredOutputsParams(json=json.loads(grammar.source))
    return StructuredOutputsParams(grammar=grammar.source)


def check_grammar_supported(grammar: Any) -> None:
    if grammar.start_after is not None:
        raise UnsupportedError(f"the vllm engine cannot start constraining {grammar.param} after the reasoning "
                               f"part: serve without --reasoning-parser, or use another engine")


class OutputStream:
    """Turns the `RequestOutput` deltas of one vLLM request into our `GenerationOutput` deltas.

    Token strings and bytes in logprobs come from our tokenizer, as every other engine reports them."""

    def __init__(self, request: GenerationRequest, token_text: TokenText):
        self.request = request
        self._text = token_text
        self._completion_tokens = 0
        self._prompt_logprobs_sent = False
        self._scoring_only = request.sampling.max_tokens == 0

    def convert(self, out: Any) -> GenerationOutput:
        choice = out.outputs[0] if out.outputs else None
        p = self.request.sampling
        result = GenerationOutput(request_id=self.request.request_id,
                                  prompt_tokens=len(self.request.prompt_token_ids))
        if not self._prompt_logprobs_sent and p.prompt_logprobs is not None and out.prompt_logprobs is not None:
            result.prompt_logprobs = self.prompt_logprobs(out.prompt_logprobs)
            self._prompt_logprobs_sent = True
        if choice is not None and not self._scoring_only:
            result.text = choice.text
            result.token_ids = list(choice.token_ids)
            if p.logprobs is not None and choice.logprobs is not None:
                result.logprobs = [self.entry(tid, alternatives, p.logprobs)
                                   for tid, alternatives in zip(result.token_ids, choice.logprobs)]
            self._completion_tokens += len(result.token_ids)
        result.completion_tokens = self._completion_tokens
        if out.finished:
            result.finish_reason, result.stop_reason = self._finish(choice)
        return result

    def aborted(self, error: str | None = None, *, server_shutdown: bool = False) -> GenerationOutput:
        """The last delta of a request that ended before vLLM finished it: cancelled, the engine failed, or the
        server is shutting down."""
        return GenerationOutput(request_id=self.request.request_id, finish_reason="error" if error else "abort",
                                error=error, prompt_tokens=len(self.request.prompt_token_ids),
                                completion_tokens=self._completion_tokens, server_shutdown=server_shutdown)

    def _finish(self, choice: Any) -> tuple[str, str | int | None]:
        if self._scoring_only:
            return "length", None
        reason = (choice.finish_reason if choice is not None else None) or "abort"
        return reason, choice.stop_reason if choice is not None else None

    def prompt_logprobs(self, rows: list[dict[int, Any] | None]) -> list[TokenLogprob | None]:
        top = self.request.sampling.prompt_logprobs or 0
        ids = self.request.prompt_token_ids
        return [None] + [self.entry(ids[i], rows[i], top) for i in range(1, min(len(rows), len(ids)))]

    def entry(self, token_id: int, alternatives: dict[int, Any], top: int) -> TokenLogprob:
        """One position: the chosen token's logprob and the `top` most likely (vLLM's rank 1..top)."""
        text, raw = self._text.lookup(token_id)
        entry = TokenLogprob(token_id=token_id, token=text, logprob=float(alternatives[token_id].logprob),
                             bytes=raw)
        ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in alternatives.items()
                         if lp.rank is not None and lp.rank <= top))
        for _, tid, logprob in ranked:
            t_text, t_raw = self._text.lookup(tid)
            entry.top.append(TopLogprob(token_id=tid, token=t_text, logprob=float(logprob), bytes=t_raw))
        return entry


def lora_request(name: str, lora_id: int, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)

