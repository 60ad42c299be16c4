"""Which chat template renders the prompt: the model directory's own, or the built-in one `template` names
(LLaMA-Factory's names). A scripted model writes its prompt back, so the test sees exactly what was rendered."""
from __future__ import annotations

import pytest

from engines.templates import builtin_template
from tests.scripted_engine import ECHO, scripted_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ECHO}]


def rendered(tokenizer, template: str | None, messages=MESSAGES) -> str:
    """What the server should send the model, as the reply shows it (without the special BOS)."""
    text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)


def echoed(server, messages=MESSAGES) -> str:
    return server.openai().chat.completions.create(model="scripted", messages=messages, temperature=0,
                                                   max_tokens=200).choices[0].message.content


def test_the_model_directorys_own_template_is_used_by_default(demo_model_dir, tokenizer):
    with scripted_server(demo_model_dir) as server:
        assert echoed(server) == rendered(tokenizer, None) == "Be brief.<｜User｜>" + ECHO + "<｜Assistant｜>"


@pytest.mark.parametrize("name,expected_end", [
    ("deepseekr1", "<｜User｜>" + ECHO + "<｜Assistant｜><think>\n"),
    ("deepseek", "User: " + ECHO + "\n\nAssistant:"),
])
def test_the_template_setting_overrides_the_models_own(demo_model_dir, tokenizer, name, expected_end):
    with scripted_server(demo_model_dir, template=name) as server:
        text = echoed(server)
    assert text == rendered(tokenizer, builtin_template(name)) and text.endswith(expected_end)
