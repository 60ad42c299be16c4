"""The batch runner: one task on the server's event loop that validates new batches, runs their lines as
background work, and writes their output and error files.

Scheduling. At most `in_flight` lines run at once, and a new one is submitted only while the engine has no
request waiting: an interactive request that arrives finds a free slot (`in_flight` is below the engine's
`max_concurrent`) and is admitted ahead of any batch line still in the queue (its engine requests carry
`BACKGROUND` priority). Batches are served oldest first, each line in input order.

Exactly once. A line's result is committed with the batch's counts in one transaction, guarded by the line
being still pending, and the output files are built from those records at the end. A line whose answer was
not recorded (the process was killed, the server is shutting down, the queue was full) is still pending and
is run again: on restart, every pending line runs once more and nothing recorded runs again.

Each line is a POST through the app itself (server/batches/inprocess.py), so it is served by the very code
its HTTP route runs."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from typing import Any

from server.batches import queries
from server.batches.inprocess import Answer, post
from server.batches.store import BatchStore
from server.batches.validate import read_lines

log = logging.getLogger("ktserve.batches")

IDLE_POLL_SECONDS = 1.0  # with nothing to do, look again this often (a new batch wakes the runner at once)
BUSY_POLL_SECONDS = 0.02  # while lines wait for the engine to have room
RETRY_SECONDS = 1.0  # after an answer that says "later" (429, 503)
PAGE = 256  # pending lines read from the database at a time
# Answers that say nothing about the line: it stays pending and runs again (499: the runner itself let go).
NOT_AN_ANSWER = frozenset({429, 499, 503})
FULL, WAITING, EMPTY = "full", "waiting", "empty"  # what `_fill` found


class BatchRunner:
    def __init__(self, service: Any, in_flight: int):
        self.service = service  # server.batches.serving.BatchServing: the store, the settings, the app
        self.in_flight_limit = in_flight
        self.wake = asyncio.Event()
        self._lines: dict[str, deque[dict[str, Any]]] = {}  # fetched, not yet submitted, per batch
        self._cursor: dict[str, int] = {}  # the last line fetched, per batch
        self._running: dict[asyncio.Task, str] = {}  # line tasks -> their batch
        self._gone: dict[str, asyncio.Event] = {}  # set: the batch's lines in flight are let go
        self._retry_at = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ktserve-batch-runner")

    async def stop(self) -> None:
        """Let go of the lines in flight (they stay pending and run after a restart) and stop."""
        for task in [self._task, *self._running]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._running] if t is not None), return_exceptions=True)
        self._running.clear()

    @property
    def store(self) -> BatchStore | None:
        return self.service.store(create=False)

    async def _run(self) -> None:
        while True:
            self.wake.clear()
            try:
                busy = await self._tick() if self.store is not None else False
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a full disk: logged, and tried again rather than ending batch work
                log.exception("the batch runner failed; retrying")
                busy = False
                await asyncio.sleep(RETRY_SECONDS)
            try:
                await asyncio.wait_for(self.wake.wait(), BUSY_POLL_SECONDS if busy else IDLE_POLL_SECONDS)
            except TimeoutError:
                pass

    async def _tick(self) -> bool:
        """One look at every unfinished batch; True while lines wait for room in the engine."""
        store = self.store
        assert store is not None
        now = int(time.time())
        waiting = False
        for batch in await store.call(queries.open_batches):
            batch_id, status = batch["id"], batch["status"]
            if status in ("validating", "in_progress") and batch["expires_at"] and now >= batch["expires_at"]:
                status = "expired"
            if status == "validating":
                await self._validate(batch)
            elif status in ("cancelling", "expired"):
                await self._end(batch_id, "cancelled" if status == "cancelling" else "expired")
            elif status == "finalizing":
                await self._finalize(batch_id, "completed")
            else:
                state = await self._fill(batch_id)
                waiting = waiting or state == WAITING
                if state == EMPTY and batch_id not in self._running.values():
                    await self._finalize(batch_id, "completed")
        return waiting

    # -------------------------------------------------------------------------------------- validation
    async def _validate(self, batch: dict[str, Any]) -> None:
        store = self.store
        assert store is not None
        path = store.file_path(batch["input_file_id"])
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            errors = [{"code": "file_not_found", "message": f"the input file {batch['input_file_id']} was deleted "
                       "before the batch was validated", "param": "input_file_id", "line": None}]
        else:
            lines, errors = await asyncio.to_thread(read_lines, data, self.service.settings.max_body_bytes)
        now = int(time.time())
        if errors:
            await store.call(queries.fail_validation, batch["id"], errors, now)
        else:
            await store.call(queries.start_lines, batch["id"], lines, now)
        self.wake.set()

    # ---------------------------------------------------------------------------------------- running
    async def _fill(self, batch_id: str) -> str:
        """Submit this batch's next lines while there is room: FULL (as many lines run as may), WAITING (a line
        waits for the engine to have room) or EMPTY (no line of the batch is left to submit)."""
        store = self.store
        assert store is not None
        queued = self._lines.setdefault(batch_id, deque())
        while True:
            if not queued:
                page = await store.call(queries.pending_lines, batch_id, self._cursor.get(batch_id, 0), PAGE)
                if not page:
                    return EMPTY
                self._cursor[batch_id] = page[-1]["line"]
                queued.extend(page)
            if len(self._running) >= self.in_flight_limit:
                return FULL
            if not self._engine_has_room():
                return WAITING
            line = queued.popleft()
            task = asyncio.create_task(self._run_line(batch_id, line))
            self._running[task] = batch_id
            task.add_done_callback(self._line_ended)

    def _engine_has_room(self) -> bool:
        if time.monotonic() < self._retry_at or self.service.draining:
            return False
        engine = self.service.engine
        return engine.ready and engine.stats().waiting == 0

    def _line_ended(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        self.wake.set()

    async def _run_line(self, batch_id: str, line: dict[str, Any]) -> None:
        request_id = f"batch_req_{uuid.uuid4().hex}"
        headers = {"x-request-id": request_id}
        if self.service.settings.api_key:
            headers["authorization"] = f"Bearer {self.service.settings.api_key}"
        gone = self._gone.setdefault(batch_id, asyncio.Event())
        store = self.store
        assert store is not None
        try:
            answer = await post(self.service.app, line["url"], line["body"].encode(), headers, gone)
            if answer.status not in NOT_AN_ANSWER:
                await store.call(queries.record_line, batch_id, line["line"], 200 <= answer.status < 300,
                                 result_line(request_id, line["custom_id"], answer))
                return
            if answer.status == 499:  # let go of by the runner: the batch is ending
                return
        except Exception:  # e.g. the database could not commit: the line is still pending
            log.exception("batch %s line %d failed; it will run again", batch_id, line["line"])
        self._retry_at = time.monotonic() + RETRY_SECONDS
        if not gone.is_set():
            self._lines.setdefault(batch_id, deque()).appendleft(line)

    # ------------------------------------------------------------------------------------------ the end
    async def _end(self, batch_id: str, status: str) -> None:
        """A cancelled or expired batch: let go of its lines in flight, then finalize with what was recorded."""
        self._gone.setdefault(batch_id, asyncio.Event()).set()
        self._lines.pop(batch_id, None)
        if batch_id not in self._running.values():
            await self._finalize(batch_id, status)

    async def _finalize(self, batch_id: str, status: str) -> None:
        store = self.store
        assert store is not None
        if status == "completed":
            await store.call(queries.set_finalizing, batch_id, int(time.time()))
        files, ids, unfinished = await self._write_results(store, batch_id, expired=status == "expired")
        await store.call(queries.finish, batch_id, status, int(time.time()), files, ids["output"], ids["error"],
                         unfinished)
        for table in (self._lines, self._cursor, self._gone):
            table.pop(batch_id, None)
        log.info("batch %s %s", batch_id, status)

    async def _write_results(self, store: BatchStore, batch_id: str, expired: bool
                             ) -> tuple[list[dict[str, Any]], dict[str, str | None], int]:
        """The output and error files (those with lines), their ids, and how many lines expired unfinished."""
        outputs: dict[str, list[bytes]] = {"output": [], "error": []}
        after, unfinished = 0, 0
        while page := await store.call(queries.results_page, batch_id, after, 1000):
            for record in page:
                if record["done"]:
                    outputs["output" if record["ok"] else "error"].append(record["result"].encode() + b"\n")
                elif expired:
                    unfinished += 1
                    outputs["error"].append(expired_line(record["custom_id"]).encode() + b"\n")
            after = page[-1]["line"]
        files, ids = [], {"output": None, "error": None}
        for kind, chunks in outputs.items():
            if not chunks:
                continue
            file_id = f"file-{uuid.uuid4().hex[:24]}"
            size = await asyncio.to_thread(store.write_file, file_id, chunks)
            files.append({"id": file_id, "purpose": "batch_output", "filename": f"{batch_id}_{kind}.jsonl",
                          "bytes": size, "created_at": int(time.time())})
            ids[kind] = file_id
        return files, ids, unfinished


def result_line(request_id: str, custom_id: str, answer: Answer) -> str:
    """A line of the output (2xx) or error file: the route's answer, in OpenAI's batch output shape."""
    response = {"status_code": answer.status, "request_id": answer.headers.get("x-request-id", request_id),
                "body": answer.json()}
    return json.dumps({"id": request_id, "custom_id": custom_id, "response": response, "error": None},
                      ensure_ascii=False)


def expired_line(custom_id: str) -> str:
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                       "error": {"code": "batch_expired", "message": "this request was not run before the batch's "
                                 "completion_window ended"}}, ensure_ascii=False)
