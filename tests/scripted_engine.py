"""A test engine whose "model" writes a script: the text of the last user message, token by token.

It is the real shared runtime (scheduler, sampler with its logits processors, detokenizer, stop handling)
around a runner that, instead of a network, puts all the probability on the script's next token and then
on EOS. Tests send the model output they want (a tool call, a `</think>` split across tokens) as the user
message and read back what the server makes of it. Registered as engine "scripted" by `scripted_server`."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from engines.base import ModelInfo
from engines.model_files import load_tokenizer
from engines.registry import BUILTIN_ENGINES
from engines.runtime.llm_engine import LLMEngine
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SCRIPT_LOGIT = 50.0


ECHO = "<echo the prompt>"  # a user message that makes the model write the whole prompt back


def script_of(prompt_text: str) -> str:
    """The last user message of a rendered prompt (the prompt itself when it has no chat turns, or when
    that message is ECHO)."""
    if USER not in prompt_text:
        return prompt_text
    message = prompt_text.rsplit(USER, 1)[1].split(ASSISTANT, 1)[0]
    return prompt_text if message == ECHO else message


class ScriptRunner(ModelRunner):
    def __init__(self, tokenizer: Any, eos: int, max_model_len: int = 4096):
        self.tokenizer, self.eos, self.max_model_len = tokenizer, eos, max_model_len

    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        return [self._logits(chunk) if chunk.samples or chunk.all_logits else None for chunk in chunks]

    def _logits(self, chunk: ScheduledChunk) -> torch.Tensor:
        seq = chunk.seq
        if seq.runner_state is None:
            text = self.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens], skip_special_tokens=True)
            seq.runner_state = self.tokenizer.encode(script_of(text), add_special_tokens=False)
        script: list[int] = seq.runner_state  # type: ignore[assignment]
        n = seq.num_output_tokens
        rows = torch.zeros(chunk.end - chunk.start if chunk.all_logits else 1, len(self.tokenizer))
        rows[-1, script[n] if n < len(script) else self.eos] = SCRIPT_LOGIT
        return rows

    def release(self, seq: Sequence) -> None:
        seq.runner_state = None


class ScriptedEngine(LLMEngine):
    name = "scripted"

    def _load(self):
        tokenizer = load_tokenizer(self.config.model_path, self.config.template)
        info = ModelInfo(id=self.config.model_name or "scripted", max_model_len=4096, architecture="Script",
                         engine=self.name, created=int(time.time()), eos_token_ids=(tokenizer.eos_token_id,))
        return ScriptRunner(tokenizer, tokenizer.eos_token_id), tokenizer, info


@contextmanager
def scripted_server(model_dir: Any, **settings: Any) -> Iterator[Any]:
    """A real server (conftest.start_server) around a ScriptedEngine reading `model_dir`'s tokenizer."""
    from tests.conftest import start_server

    BUILTIN_ENGINES["scripted"] = f"{__name__}:ScriptedEngine"
    try:
        server = start_server(model_dir, engine="scripted", **settings)
        try:
            yield server
        finally:
            server.stop()
    finally:
        BUILTIN_ENGINES.pop("scripted", None)
