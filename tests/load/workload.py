"""What the load generator sends and how it judges each answer.

A pool of request specs (chat and completions, varied prompt lengths, sampling settings, logprobs, stop
strings, n) is built from a seed. Each spec is run once alone before the load: that reference run fixes
its prompt token count and, for greedy and seeded specs, its exact text. Under load every answer is
checked for framing (JSON, SSE, `[DONE]`), usage arithmetic, and agreement with the reference, so that
cross-talk between concurrent requests shows up as a mismatch."""
from __future__ import annotations

import codecs
import json
import random
from dataclasses import dataclass, field
from typing import Any

# Engines that batch (ktransformers) do not compute a row bit-identically in every batch, so where the top
# two tokens are within a rounding error the greedy choice can flip with the batch's composition. A greedy
# answer may leave the reference only at such a near tie (measured gaps: 0.005-0.015 nats in BF16); a
# divergence anywhere else is cross-talk.
NEAR_TIE_NATS = 0.05
PROBE_TOP_LOGPROBS = 5

WORDS = ("alpha river stone cloud seven orange market quiet signal winter lantern copper garden "
         "binary north thunder velvet harbor maple circuit 你好 世界 模型 专家 😀 café naïve").split()
PROMPT_WORDS = (1, 3, 8, 20, 60, 150, 300)
MAX_TOKENS = (1, 2, 8, 16, 24, 32, 48, 64)
STOPS = (["\n"], ["the", "。"], ["stone"])
SAMPLING = (  # (profile, settings, kind)
    ("greedy", {"temperature": 0}, "greedy"),
    ("greedy-penalties", {"temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                          "repetition_penalty": 1.1}, "greedy"),
    ("seeded", {"temperature": 0.8, "top_p": 0.9, "top_k": 40}, "seeded"),
    ("seeded-min-p", {"temperature": 1.2, "min_p": 0.05}, "seeded"),
    ("random", {"temperature": 1.0}, "random"),
    ("random-top-k", {"temperature": 0.7, "top_k": 20}, "random"),
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the pool. `kind`: greedy and seeded answers are reproducible, random ones are not."""

    name: str
    endpoint: str  # "chat" | "completions"
    body: dict[str, Any]
    kind: str  # "greedy" | "seeded" | "random"
    choices: int  # choices in the answer: n, times the prompts of a batched completion
    max_tokens: int
    logprobs: bool
    stops: tuple[str, ...]
    exact_length: bool  # every choice must run to max_tokens (ignore_eos and no stop strings)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    @property
    def deterministic(self) -> bool:
        return self.kind != "random"

    def request_body(self, stream: bool) -> dict[str, Any]:
        body = dict(self.body, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def probe(self) -> "RequestSpec":
        """The same request asking for the top alternatives of every token (sampling is unchanged)."""
        body = dict(self.body)
        if self.endpoint == "chat":
            body.update(logprobs=True, top_logprobs=PROBE_TOP_LOGPROBS)
        else:
            body["logprobs"] = PROBE_TOP_LOGPROBS
        return RequestSpec(self.name + "-probe", self.endpoint, body, self.kind, self.choices, self.max_tokens,
                           True, self.stops, self.exact_length)


@dataclass
class Answer:
    """What came back for one request, reduced to what the checks compare."""

    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    logprob_counts: list[int] | None = None
    # per choice, the character spans of the tokens whose best two candidates were a near tie (probes only)
    near_ties: list[list[tuple[int, int]]] | None = None


@dataclass
class Reference:
    answers: dict[str, Answer] = field(default_factory=dict)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS)))


def build_specs(count: int, seed: int = 0, max_tokens_cap: int | None = None) -> list[RequestSpec]:
    """`count` specs, the same for the same seed; every sampling profile and both endpoints appear.
    `max_tokens_cap` shortens every answer (CI)."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        profile, sampling, kind = SAMPLING[i % len(SAMPLING)]
        endpoint = "chat" if (i // len(SAMPLING)) % 2 == 0 else "completions"
        body: dict[str, Any] = dict(sampling)
        if profile.startswith("seeded"):
            body["seed"] = rng.randrange(2**31)
        max_tokens = rng.choice(MAX_TOKENS)
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        body["max_tokens"] = max_tokens
        n = 2 if rng.random() < 0.2 else 1
        if n > 1:
            body["n"] = n
        stops: tuple[str, ...] = ()
        if rng.random() < 0.25:
            stops = tuple(rng.choice(STOPS))
            body["stop"] = list(stops)
        if rng.random() < 0.5:
            body["ignore_eos"] = True
        logprobs = rng.random() < 0.35
        prompts = 1
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
            if rng.random() < 0.3:
                body["messages"].insert(0, {"role": "system", "content": _prompt(rng)})
            if logprobs:
                body.update(logprobs=True, top_logprobs=rng.randrange(4))
        else:
            if rng.random() < 0.2:
                prompts = 2
                body["prompt"] = [_prompt(rng), _prompt(rng)]
            else:
                body["prompt"] = _prompt(rng)
            if logprobs:
                body["logprobs"] = rng.randrange(4)
        specs.append(RequestSpec(
            name=f"{i:02d}-{endpoint}-{profile}", endpoint=endpoint, body=body, kind=kind,
            choices=n * prompts, max_tokens=max_tokens, logprobs=logprobs, stops=stops,
            exact_length=bool(body.get("ignore_eos")) and not stops))
    return specs


# ------------------------------------------------------------------------------------------ parsing
class Problem(Exception):
    """An answer that breaks the contract; the message says how. `status`: the HTTP status it came with."""

    def __init__(self, message: str, status: int = 200):
        super().__init__(message)
        self.status = status


def parse_json_answer(spec: RequestSpec, raw: bytes) -> Answer:
    try:
        body = json.loads(raw)
    except ValueError:
        raise Problem(f"{spec.name}: the body is not JSON: {raw[:120]!r}") from None
    expected = "chat.completion" if spec.endpoint == "chat" else "text_completion"
    if body.get("object") != expected:
        raise Problem(f"{spec.name}: object is {body.get('object')!r}, expected {expected!r}")
    choices = sorted(body.get("choices") or [], key=lambda c: c.get("index", -1))
    if [c.get("index") for c in choices] != list(range(spec.choices)):
        raise Problem(f"{spec.name}: choice indexes {[c.get('index') for c in choices]}")
    texts, reasons, counts, ties = [], [], [], []
    for c in choices:
        lp = c.get("logprobs")
        if spec.endpoint == "chat":
            texts.append(c["message"]["content"])
            counts.append(len(lp["content"]) if lp else 0)
            ties.append(_chat_near_ties(lp["content"]) if lp else [])
        else:
            texts.append(c["text"])
            counts.append(len(lp["tokens"]) if lp else 0)
            ties.append(_legacy_near_ties(lp, len(c["text"])) if lp else [])
        reasons.append(c.get("finish_reason"))
    usage = body.get("usage") or {}
    answer = _answer(spec, texts, reasons, usage, counts)
    answer.near_ties = ties
    return answer


def _is_near_tie(top: list[float]) -> bool:
    best = sorted(top, reverse=True)[:2]
    return len(best) == 2 and best[0] - best[1] <= NEAR_TIE_NATS


def _chat_near_ties(entries: list[dict]) -> list[tuple[int, int]]:
    """Character spans of near-tie tokens; offsets from the tokens' bytes, decoded as the server does."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    spans, offset = [], 0
    for e in entries:
        end = offset + len(decoder.decode(bytes(e.get("bytes") or [])))
        if _is_near_tie([t["logprob"] for t in e.get("top_logprobs") or []]):
            spans.append((offset, end))
        offset = end
    return spans


def _legacy_near_ties(lp: dict, text_length: int) -> list[tuple[int, int]]:
    offsets = list(lp["text_offset"]) + [text_length]
    return [(offsets[k], offsets[k + 1]) for k, top in enumerate(lp["top_logprobs"])
            if top and _is_near_tie(list(top.values()))]


def parse_sse_answer(spec: RequestSpec, lines: list[str]) -> Answer:
    """Check the event-stream framing and rebuild the answer from its chunks."""
    payloads, done_at = [], None
    for number, line in enumerate(lines):
        if line == "" or line.startswith(":"):
            continue  # event boundary or comment (keep-alive ping)
        if not line.startswith("data: "):
            raise Problem(f"{spec.name}: line {number} is not an SSE data line: {line[:80]!r}")
        if done_at is not None:
            raise Problem(f"{spec.name}: data after [DONE]: {line[:80]!r}")
        data = line[len("data: "):]
        if data == "[DONE]":
            done_at = number
            continue
        try:
            payloads.append(json.loads(data))
        except ValueError:
            raise Problem(f"{spec.name}: an SSE event is not JSON: {data[:80]!r}") from None
    if done_at is None:
        raise Problem(f"{spec.name}: the stream ended without [DONE]")
    texts = [""] * spec.choices
    reasons: list[str | None] = [None] * spec.choices
    counts = [0] * spec.choices
    usage = None
    ids = set()
    expected = "chat.completion.chunk" if spec.endpoint == "chat" else "text_completion"
    for chunk in payloads:
        if "error" in chunk:
            raise Problem(f"{spec.name}: error event in the stream: {chunk['error']}")
        if chunk.get("object") != expected:
            raise Problem(f"{spec.name}: chunk object {chunk.get('object')!r}")
        ids.add(chunk.get("id"))
        if not chunk["choices"]:
            if usage is not None:
                raise Problem(f"{spec.name}: two usage chunks")
            usage = chunk.get("usage")
            continue
        if usage is not None:
            raise Problem(f"{spec.name}: a choice chunk after the usage chunk")
        for c in chunk["choices"]:
            i = c["index"]
            if not 0 <= i < spec.choices:
                raise Problem(f"{spec.name}: choice index {i} out of range")
            if reasons[i] is not None:
                raise Problem(f"{spec.name}: choice {i} continued after its finish_reason")
            if spec.endpoint == "chat":
                texts[i] += c["delta"].get("content") or ""
                lp = c.get("logprobs")
                counts[i] += len(lp["content"]) if lp else 0
            else:
                texts[i] += c["text"]
                lp = c.get("logprobs")
                counts[i] += len(lp["tokens"]) if lp else 0
            reasons[i] = c.get("finish_reason")
    if len(ids) != 1:
        raise Problem(f"{spec.name}: chunks carry {len(ids)} different ids")
    if usage is None:
        raise Problem(f"{spec.name}: no usage chunk although include_usage was asked")
    return _answer(spec, texts, reasons, usage, counts)


def _answer(spec: RequestSpec, texts, reasons, usage: dict, counts: list[int]) -> Answer:
    try:
        prompt, completion, total = usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]
    except (KeyError, TypeError):
        raise Problem(f"{spec.name}: usage missing or incomplete: {usage!r}") from None
    answer = Answer(texts, reasons, prompt, completion, counts if spec.logprobs else None)
    _check_usage(spec, answer, total)
    return answer


def _check_usage(spec: RequestSpec, a: Answer, total: int) -> None:
    name = spec.name
    if total != a.prompt_tokens + a.completion_tokens:
        raise Problem(f"{name}: total_tokens {total} != {a.prompt_tokens} + {a.completion_tokens}")
    if any(r not in ("stop", "length") for r in a.finish_reasons):
        raise Problem(f"{name}: finish reasons {a.finish_reasons}")
    if a.logprob_counts is not None:
        if sum(a.logprob_counts) != a.completion_tokens:
            raise Problem(f"{name}: completion_tokens {a.completion_tokens} but {sum(a.logprob_counts)} "
                          f"logprob entries {a.logprob_counts}")
        for count, reason in zip(a.logprob_counts, a.finish_reasons):
            if count > spec.max_tokens or (reason == "length" and count != spec.max_tokens):
                raise Problem(f"{name}: a choice of {count} tokens finished with {reason!r} "
                              f"(max_tokens {spec.max_tokens})")
    n_length = sum(r == "length" for r in a.finish_reasons)
    if not n_length * spec.max_tokens <= a.completion_tokens <= spec.choices * spec.max_tokens:
        raise Problem(f"{name}: completion_tokens {a.completion_tokens} impossible with finish reasons "
                      f"{a.finish_reasons} and max_tokens {spec.max_tokens}")
    if spec.exact_length and (n_length != spec.choices or a.completion_tokens != spec.choices * spec.max_tokens):
        raise Problem(f"{name}: ignore_eos without stop strings must run every choice to max_tokens "
                      f"{spec.max_tokens}; got {a.finish_reasons}, {a.completion_tokens} tokens")
    for text in a.texts:
        for stop in spec.stops:
            if stop in text:
                raise Problem(f"{name}: the stop string {stop!r} appears in the text")


@dataclass(frozen=True)
class Policy:
    """How strictly answers are held to the reference. Seeded sampling reproduces exactly only on an engine
    that computes each request alone (huggingface); under a batching engine a rounding difference can move
    a sampled token anywhere, so seeded answers are then checked like random ones."""

    exact_seeded: bool = True


def compare_with_reference(spec: RequestSpec, answer: Answer, reference: Answer, policy: Policy = Policy()
                           ) -> str | None:
    """Raise Problem if the answer contradicts the reference; return a note when a greedy answer left the
    reference at a near tie (allowed, counted). Every answer must have the reference's prompt length."""
    if answer.prompt_tokens != reference.prompt_tokens:
        raise Problem(f"{spec.name}: prompt_tokens {answer.prompt_tokens}, reference {reference.prompt_tokens}")
    if spec.kind == "random" or (spec.kind == "seeded" and not policy.exact_seeded):
        return None
    if answer.texts == reference.texts:
        if answer.finish_reasons != reference.finish_reasons or answer.completion_tokens != reference.completion_tokens:
            raise Problem(f"{spec.name}: same text as the reference but finish {answer.finish_reasons} / "
                          f"{answer.completion_tokens} tokens vs {reference.finish_reasons} / "
                          f"{reference.completion_tokens}")
        return None
    for i, (got, want) in enumerate(zip(answer.texts, reference.texts)):
        if got == want:
            continue
        at = _common_prefix(got, want)
        ties = (reference.near_ties or [[]] * len(reference.texts))[i]
        if spec.kind == "greedy" and any(start - 2 <= at <= end for start, end in ties):
            continue
        raise Problem(f"{spec.name}: choice {i} leaves the reference at character {at} where the reference "
                      f"had no near tie (cross-talk?): {got!r} vs {want!r}")
    return f"{spec.name}: left the reference at a near tie"


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
