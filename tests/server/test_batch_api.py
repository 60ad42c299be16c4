"""OpenAI's Batch API (/v1/files, /v1/batches) against real servers: the openai SDK's whole flow on the demo
model, each line answered as its route answers it; malformed files failing validation line by line; cancel
mid-way; the limits and the API key. Engine-indifferent cases run on the scripted engine."""
from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.helpers import assert_error
from tests.lora_helpers import write_value_head
from tests.scripted_engine import scripted_server

FINISHED = ("completed", "failed", "cancelled", "expired")
KEY = "sk-batch-5e1f0a"


def jsonl(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def chat_line(custom_id: str, content: str, model: str | None = None, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body}}


def submit(client, data: bytes, endpoint: str = "/v1/chat/completions", **extra):
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **extra)


def wait_for(client, batch_id: str, until=FINISHED, timeout: float = 120.0, check=None):
    """The batch once its status is one of `until` (and `check(batch)` holds), polled for at most `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until and (check is None or check(batch)):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout}s: {batch.request_counts}")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def demo(demo_model_dir, tmp_path_factory):
    """The demo model (a value head beside it, so the score route answers) on the huggingface engine."""
    model_dir = tmp_path_factory.mktemp("batch-model")
    for f in Path(demo_model_dir).iterdir():
        (model_dir / f.name).symlink_to(f)
    write_value_head(model_dir, json.loads((demo_model_dir / "config.json").read_text())["hidden_size"])
    server = start_server(model_dir, data_dir=str(tmp_path_factory.mktemp("batch-data")), max_concurrent=4)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted(demo_model_dir, tmp_path_factory):
    with scripted_server(demo_model_dir, data_dir=str(tmp_path_factory.mktemp("scripted-data")),
                         max_body_bytes=4096, batch_max_in_flight=1) as server:
        yield server


@pytest.fixture(scope="module")
def limited(demo_model_dir, tmp_path_factory):
    """Small limits, and an API key."""
    with scripted_server(demo_model_dir, data_dir=str(tmp_path_factory.mktemp("limited-data")), api_key=KEY,
                         batch_max_file_bytes=2000, batch_max_lines=3, batch_max_open=1,
                         batch_max_storage_bytes=6000, batch_max_in_flight=1) as server:
        yield server


def test_the_openai_sdk_flow_answers_every_line_as_its_route_does(demo):
    client = demo.openai()
    model = demo.engine.info.id
    records = [chat_line(f"chat-{i}", f"question {i}", model, max_tokens=6, temperature=0) for i in range(4)]
    records.append({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": "The river", "max_tokens": 5, "temperature": 0}})
    batch = submit(client, jsonl(records), metadata={"run": "sdk"})
    assert batch.status == "validating" and batch.metadata == {"run": "sdk"} and batch.completion_window == "24h"
    done = wait_for(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == done.request_counts.completed == 5 and done.request_counts.failed == 0
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.error_file_id is None
    output = {line["custom_id"]: line for line in lines_of(client, done.output_file_id)}
    assert sorted(output) == sorted(r["custom_id"] for r in records)
    direct = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "question 2"}],
                                            max_tokens=6, temperature=0)
    line = output["chat-2"]
    assert line["error"] is None and line["response"]["status_code"] == 200 and line["response"]["request_id"]
    assert line["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    text = client.completions.create(model=model, prompt="The river", max_tokens=5, temperature=0)
    assert output["text"]["response"]["body"]["choices"][0]["text"] == text.choices[0].text
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_embedding_and_score_lines_answer_as_their_routes_do(demo):
    client = demo.openai()
    records = [{"custom_id": "vector", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello"}},
               {"custom_id": "reward", "method": "POST", "url": "/v1/score/evaluation",
                "body": {"messages": ["The answer is 42."]}}]
    done = wait_for(client, submit(client, jsonl(records), endpoint="/v1/embeddings").id)
    output = {line["custom_id"]: line["response"]["body"] for line in lines_of(client, done.output_file_id)}
    direct = client.embeddings.create(model=demo.engine.info.id, input="hello").data[0].embedding
    assert output["vector"]["data"][0]["embedding"] == pytest.approx(direct, abs=1e-5)
    with demo.http() as http:
        scores = http.post("/v1/score/evaluation", json={"messages": ["The answer is 42."]}).json()["scores"]
    assert output["reward"]["scores"] == pytest.approx(scores, abs=1e-5)


def test_a_line_naming_an_unknown_model_lands_in_the_error_file_and_the_others_run(scripted):
    client = scripted.openai()
    records = [chat_line("good", "fine", max_tokens=4), chat_line("lost", "x", model="no-such-adapter")]
    done = wait_for(client, submit(client, jsonl(records)).id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert [line["custom_id"] for line in lines_of(client, done.output_file_id)] == ["good"]
    [error] = lines_of(client, done.error_file_id)
    assert error["custom_id"] == "lost" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["param"] == "model"


def test_a_malformed_file_fails_validation_naming_each_bad_line(scripted):
    client = scripted.openai()
    data = b"\n".join([
        json.dumps(chat_line("a", "ok")).encode(),
        b'{"custom_id": "b", "url": ',  # not JSON
        json.dumps({**chat_line("c", "ok"), "url": "/v1/images/generations"}).encode(),
        json.dumps(chat_line("a", "again")).encode(),  # the custom_id of line 1
        json.dumps(chat_line("d", "x" * 5000)).encode(),  # over max_body_bytes (4096)
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}).encode(),
        json.dumps(chat_line("e", "ok", stream=True)).encode(),
    ])
    done = wait_for(client, submit(client, data).id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    found = {(e.line, e.code) for e in done.errors.data}
    assert found == {(2, "invalid_json_line"), (3, "invalid_url"), (4, "duplicate_custom_id"),
                     (5, "line_too_large"), (6, "missing_custom_id"), (7, "invalid_request")}
    assert "max_body_bytes" in next(e.message for e in done.errors.data if e.code == "line_too_large")


def test_a_file_of_no_requests_fails_validation(scripted):
    done = wait_for(scripted.openai(), submit(scripted.openai(), b"\n\n").id)
    assert done.status == "failed" and done.errors.data[0].code == "empty_file"


def test_batch_creation_refuses_what_cannot_run_with_a_400_or_404(scripted):
    with scripted.http() as http:
        assert_error(http.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/completions"}),
                     404, "input_file_id")
        assert_error(http.post("/v1/batches", json={"input_file_id": "x", "endpoint": "/v1/images"}), 400, "endpoint")
        assert_error(http.post("/v1/batches", json={"input_file_id": "x", "endpoint": "/v1/completions",
                                                    "completion_window": "soon"}), 400, "completion_window")
        assert_error(http.post("/v1/batches", content=b"{", headers={"content-type": "application/json"}), 400)
        assert_error(http.get("/v1/batches/batch_nope"), 404, "batch_id")
        assert_error(http.post("/v1/batches/batch_nope/cancel"), 404, "batch_id")


def test_uploads_need_a_file_and_the_batch_purpose(scripted):
    with scripted.http() as http:
        assert_error(http.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "fine-tune"}),
                     400, "purpose")
        assert_error(http.post("/v1/files", data={"purpose": "batch"}), 400, "file")
        assert_error(http.post("/v1/files", json={}), 400, "file")
        assert_error(http.post("/v1/files", content=b"--x\r\nbroken", headers={
            "content-type": "multipart/form-data; boundary=x"}), 400)


def test_files_are_listed_retrieved_read_and_deleted(scripted):
    client = scripted.openai()
    uploaded = client.files.create(file=("mine.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("mine.jsonl", 9, "batch")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).read() == b'{"a": 1}\n'
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted
    with scripted.http() as http:
        assert_error(http.get(f"/v1/files/{uploaded.id}/content"), 404, "file_id")
        assert_error(http.delete(f"/v1/files/{uploaded.id}"), 404, "file_id")
    assert uploaded.id not in [f.id for f in client.files.list()]


def test_the_batch_list_pages_newest_first(scripted):
    client = scripted.openai()
    ids = [submit(client, jsonl([chat_line("one", "a", max_tokens=1)])).id for _ in range(3)]
    for batch_id in ids:
        wait_for(client, batch_id)
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert client.batches.list(limit=2, after=ids[1]).data[0].id == ids[0]


def test_cancelling_mid_way_keeps_what_finished_and_runs_nothing_more(scripted):
    client = scripted.openai()
    long = " ".join(f"word{i}" for i in range(300))  # the scripted model writes it back, token by token
    records = [chat_line(f"line-{i}", long, max_tokens=600) for i in range(40)]
    batch = submit(client, jsonl(records))
    wait_for(client, batch.id, until=("in_progress",), check=lambda b: b.request_counts.completed >= 1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert 1 <= counts.completed < counts.total == 40
    output = lines_of(client, done.output_file_id)
    assert len(output) == counts.completed and len({line["custom_id"] for line in output}) == counts.completed
    scripted.wait_idle()
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes


def test_a_finished_batch_cannot_be_cancelled(scripted):
    client = scripted.openai()
    done = wait_for(client, submit(client, jsonl([chat_line("one", "a", max_tokens=1)])).id)
    with scripted.http() as http:
        error = assert_error(http.post(f"/v1/batches/{done.id}/cancel"), 409, "batch_id")
    assert "completed" in error["message"]


def test_each_limit_is_refused_with_an_error_naming_it(limited):
    client = limited.openai()
    with limited.http(headers={"Authorization": f"Bearer {KEY}"}) as http:
        big = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * 2001)}, data={"purpose": "batch"})
        assert "batch_max_file_bytes" in assert_error(big, 413, "file")["message"]
        four = client.files.create(file=("four.jsonl", io.BytesIO(jsonl([chat_line(str(i), "a") for i in range(4)]))),
                                   purpose="batch")
        lines = http.post("/v1/batches", json={"input_file_id": four.id, "endpoint": "/v1/chat/completions"})
        assert assert_error(lines, 400, "input_file_id")["code"] == "too_many_lines"
        long = " ".join(f"w{i}" for i in range(300))
        first = submit(client, jsonl([chat_line("slow", long, max_tokens=600)]))
        second = http.post("/v1/batches", json={"input_file_id": first.input_file_id,
                                                "endpoint": "/v1/chat/completions"})
        if second.status_code == 200:  # rarely, the first was done already
            wait_for(client, second.json()["id"])
        else:
            error = assert_error(second, 429)
            assert error["code"] == "too_many_open_batches" and "batch_max_open" in error["message"]
        wait_for(client, first.id)
        fillers = []
        for _ in range(5):  # 6,000 bytes of storage hold at most three more of these
            full = http.post("/v1/files", files={"file": ("fill.jsonl", b"y" * 1900)}, data={"purpose": "batch"})
            if full.status_code != 200:
                break
            fillers.append(full.json()["id"])
        error = assert_error(full, 400)
        assert error["code"] == "storage_limit_exceeded" and "batch_max_storage_bytes" in error["message"]
        for file_id in fillers:
            client.files.delete(file_id)


def test_with_an_api_key_the_routes_need_it_and_lines_still_run(limited):
    with httpx.Client(base_url=limited.base_url, timeout=30) as http:
        for method, path in (("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/batches"),
                             ("POST", "/v1/batches"), ("GET", "/v1/files/x/content"), ("POST", "/v1/batches/x/cancel")):
            assert assert_error(http.request(method, path), 401)["type"] == "authentication_error"
    client = limited.openai()
    done = wait_for(client, submit(client, jsonl([chat_line("keyed", "hello there", max_tokens=8)])).id)
    assert done.status == "completed", done
    [line] = lines_of(client, done.output_file_id)
    assert line["response"]["body"]["choices"][0]["message"]["content"] == "hello there"


def test_an_interactive_request_is_answered_while_a_batch_runs(scripted):
    client = scripted.openai()
    long = " ".join(f"word{i}" for i in range(300))
    batch = submit(client, jsonl([chat_line(f"line-{i}", long, max_tokens=600) for i in range(40)]))
    wait_for(client, batch.id, until=("in_progress",), check=lambda b: b.request_counts.completed >= 1)
    reply = client.chat.completions.create(model=scripted.engine.info.id, max_tokens=8,
                                           messages=[{"role": "user", "content": "right away"}])
    assert reply.choices[0].message.content == "right away"
    during = client.batches.retrieve(batch.id)
    assert during.status == "in_progress" and during.request_counts.completed < 40
    client.batches.cancel(batch.id)
    wait_for(client, batch.id)
    scripted.wait_idle()
