"""Dataset files for `ktserve eval`: the three record forms, detected per file, and errors that point at
the offending file and line."""

import json
from pathlib import Path

import pytest

from evaluation.datasets import load_dataset

DATA = Path(__file__).parents[1] / "data" / "eval"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("name, form", [("alpaca.jsonl", "alpaca"), ("sharegpt.json", "sharegpt"),
                                        ("choice.jsonl", "choice")])
def test_shipped_sample_datasets_are_detected(name, form):
    dataset = load_dataset(DATA / name)
    assert dataset.form == form
    assert [s.index for s in dataset.samples] == list(range(6))


def test_alpaca_prompt_is_instruction_and_input_after_system_and_history(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{
        "system": "Be brief.", "instruction": "Translate.", "input": "你好", "output": "Hello",
        "history": [["Hi", "Hello!"]]}])
    sample = load_dataset(path).samples[0]
    assert sample.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Translate.\n你好"}]
    assert sample.reference == "Hello"


def test_sharegpt_last_gpt_turn_is_the_reference(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}])
    sample = load_dataset(path).samples[0]
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "user"]
    assert sample.messages[-1]["content"] == "Q2"
    assert sample.reference == "A2"


def test_openai_messages_are_sharegpt_form(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}])
    dataset = load_dataset(path)
    assert dataset.form == "sharegpt"
    assert dataset.samples[0].messages == [{"role": "user", "content": "Q"}]
    assert dataset.samples[0].reference == "A"


def test_choice_options_list_is_lettered_and_prompted(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "2+2?", "options": ["3", "4"], "answer": "b"}])
    sample = load_dataset(path).samples[0]
    assert sample.options == {"A": "3", "B": "4"}
    assert sample.reference == "B"
    assert sample.choice_prompt == "2+2?\nA. 3\nB. 4\nAnswer:"
    assert sample.messages == [{"role": "user", "content": sample.choice_prompt}]


def test_choice_options_dict_keeps_its_letters(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "Q", "options": {"A": "x", "B": "y"}, "answer": "A"}])
    assert load_dataset(path).samples[0].options == {"A": "x", "B": "y"}


def test_json_list_and_jsonl_hold_the_same_records(tmp_path):
    records = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    as_list = tmp_path / "d.json"
    as_list.write_text(json.dumps(records, indent=2))
    assert load_dataset(jsonl).samples == load_dataset(as_list).samples


def test_record_fitting_no_form_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "q", "output": "a"}\n\n{"prompt": "q", "completion": "a"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: record fits no dataset form"):
        load_dataset(path)


def test_record_fitting_no_form_in_a_json_list_names_its_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"instruction": "q", "output": "a"},\n  {"text": "q"}\n]\n')
    with pytest.raises(ValueError, match=r"bad\.json, line 3: record fits no dataset form"):
        load_dataset(path)


def test_file_mixing_forms_is_rejected_at_the_first_odd_record(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"instruction": "q", "output": "a"}, {"question": "q", "options": ["x", "y"], "answer": "A"}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl, line 2: record is choice but .* first record is alpaca"):
        load_dataset(path)


def test_choice_answer_outside_the_options_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "Q", "options": ["x", "y"], "answer": "C"}])
    with pytest.raises(ValueError, match=r"c\.jsonl, line 1: field 'answer' is 'C'"):
        load_dataset(path)


def test_conversation_without_assistant_turn_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "Q"}]}])
    with pytest.raises(ValueError, match=r"field 'conversations' has no assistant turn"):
        load_dataset(path)


def test_unknown_role_names_the_turn(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]}])
    with pytest.raises(ValueError, match=r"field 'conversations\[1\]\.from' is 'bot'"):
        load_dataset(path)


def test_invalid_json_line_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"instruction": "q", "output": "a"}\n{"instruction": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: not valid JSON"):
        load_dataset(path)
