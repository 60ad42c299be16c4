"""The Batch API's durability: a server killed with SIGKILL mid-batch, restarted on the same data directory,
finishes the batch with every line in the output exactly once, and the lines recorded before the kill are
not run again; a SIGTERM lets the lines in flight finish, checkpoints the database and resumes the same way.
Also the scheduler's side: interactive requests are admitted before waiting batch lines."""
from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import openai

from .test_batch_api import submit, wait_for
from tests.load.server import ServerOptions, ServerProcess

LINES = 30


def records() -> list[dict]:
    return [{"custom_id": f"sample-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Sample {i}:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}}
            for i in range(LINES)]


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def recorded(data_dir: Path) -> dict[str, str]:
    """custom_id -> the output line recorded for it, read from the database of a stopped server."""
    with sqlite3.connect(data_dir / "batches.sqlite3") as db:
        return {custom_id: json.loads(result)["id"] for custom_id, result in
                db.execute("SELECT custom_id, result FROM lines WHERE done = 1")}


def stop_when(server: ServerProcess, batch_id: str, completed: int, how: signal.Signals) -> int:
    """Signal the server once `completed` lines are recorded; its exit status."""
    wait_for(client_of(server), batch_id, until=("in_progress",), check=lambda b: b.request_counts.completed >= completed)
    assert server.process is not None
    server.process.send_signal(how)
    return server.process.wait(timeout=60)


def test_a_batch_killed_and_then_stopped_mid_way_finishes_with_every_line_exactly_once(tmp_path):
    data = tmp_path / "data"
    options = ServerOptions(max_concurrent=4, extra_args=("--data-dir", str(data), "--batch-max-in-flight", "2"))
    payload = b"".join(json.dumps(r).encode() + b"\n" for r in records())

    with ServerProcess(options, tmp_path / "first.log") as server:
        batch = submit(client_of(server), payload, endpoint="/v1/completions")
        assert stop_when(server, batch.id, 3, signal.SIGKILL) == -signal.SIGKILL
    after_kill = recorded(data)
    assert 3 <= len(after_kill) < LINES

    with ServerProcess(options, tmp_path / "second.log") as server:
        assert stop_when(server, batch.id, len(after_kill) + 3, signal.SIGTERM) == 0
    wal = data / "batches.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # checkpointed into the database on the way out
    after_stop = recorded(data)
    assert len(after_kill) < len(after_stop) < LINES
    assert {k: after_stop[k] for k in after_kill} == after_kill

    with ServerProcess(options, tmp_path / "third.log") as server:
        client = client_of(server)
        done = wait_for(client, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (LINES, LINES, 0)
        output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    ids = [line["custom_id"] for line in output]
    assert sorted(ids) == sorted(r["custom_id"] for r in records()) and len(set(ids)) == LINES
    first_ids = {line["custom_id"]: line["id"] for line in output}
    assert {k: first_ids[k] for k in after_stop} == after_stop  # recorded lines were never run again
    for name in ("first.log", "second.log", "third.log"):
        assert "Traceback" not in (tmp_path / name).read_text(errors="replace"), name


def test_interactive_requests_are_admitted_before_waiting_batch_lines():
    from engines.base import BACKGROUND, INTERACTIVE, GenerationRequest
    from engines.runtime.scheduler import Scheduler
    from engines.runtime.sequence import Sequence

    def seq(name: str, priority: int) -> Sequence:
        return Sequence(request=GenerationRequest([1, 2], request_id=name, priority=priority), handle=None,
                        detokenizer=None)  # type: ignore[arg-type]

    scheduler = Scheduler(None, max_running=1, max_queue=8, chunk_size=16)  # type: ignore[arg-type]
    for s in (seq("line-1", BACKGROUND), seq("chat-1", INTERACTIVE), seq("line-2", BACKGROUND),
              seq("chat-2", INTERACTIVE)):
        scheduler.add(s)
    assert [s.id for s in scheduler.waiting] == ["chat-1", "chat-2", "line-1", "line-2"]


def test_a_stored_line_keeps_its_first_result():
    from server.batches import queries
    from server.batches.store import SCHEMA

    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    db.executescript(SCHEMA)
    db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, total) "
               "VALUES ('b', '/v1/completions', 'f', '24h', 'in_progress', 0, 1)")
    db.execute("INSERT INTO lines (batch_id, line, custom_id, url, body) VALUES ('b', 1, 'c', '/v1/completions', '{}')")
    assert queries.record_line(db, "b", 1, True, "first")
    assert not queries.record_line(db, "b", 1, False, "second")
    assert db.execute("SELECT result FROM lines").fetchone()[0] == "first"
    assert tuple(db.execute("SELECT completed, failed FROM batches").fetchone()) == (1, 0)
