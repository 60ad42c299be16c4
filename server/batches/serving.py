"""/v1/files and /v1/batches: OpenAI's Batch API over the durable store, with its limits.

The store opens on first use: at start when the data directory already holds a database (batches left
unfinished resume), else at the first upload. Reads before then answer as an empty store does, so a server
that never sees a batch never writes a data directory."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse

from engines.base import Engine
from server.batches import queries
from server.batches.protocol import BatchCreateRequest, ListQuery, batch_object, file_object, page
from server.batches.runner import BatchRunner
from server.batches.store import BatchStore, DataDirInUse
from server.batches.validate import count_lines
from server.errors import APIError
from server.settings import Settings

log = logging.getLogger("ktserve.batches")
UPLOAD_PURPOSES = ("batch",)
COPY_CHUNK = 1024 * 1024
# multipart framing around the file: the body limit of POST /v1/files is the file limit plus this
UPLOAD_OVERHEAD = 64 * 1024


def not_found(what: str, item_id: str, param: str) -> APIError:
    return APIError(404, f"no {what} with id {item_id!r}", type="not_found_error", param=param, code="not_found")


def limit_error(exc: queries.LimitReached) -> APIError:
    status = 429 if exc.code == "too_many_open_batches" else 400
    return APIError(status, str(exc), type="rate_limit_error" if status == 429 else "invalid_request_error",
                    code=exc.code)


class BatchServing:
    def __init__(self, settings: Settings, engine: Engine):
        self.settings = settings
        self.engine = engine
        self.app: Any = None  # the ASGI app lines are posted to; set by start()
        self._store: BatchStore | None = None
        in_flight = settings.batch_max_in_flight or max(1, settings.max_concurrent // 2)
        self.runner = BatchRunner(self, in_flight)

    # ------------------------------------------------------------------------------------- lifetime
    async def start(self, app: Any) -> None:
        self.app = app
        if BatchStore.exists(self.settings.data_dir):
            try:
                self.store(create=True)
            except APIError as exc:  # the server serves on; the Batch API answers 503 saying why
                log.error("the Batch API's store did not open: %s", exc.message)
        self.runner.start()

    async def stop(self) -> None:
        """Let go of the lines in flight (they run again at the next start) and close the database."""
        await self.runner.stop()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
            self._store = None

    @property
    def draining(self) -> bool:
        return self.app is not None and self.app.state.drain.draining

    def store(self, create: bool) -> BatchStore | None:
        if self._store is None and create:
            try:
                self._store = BatchStore.open(self.settings.data_dir)
            except DataDirInUse as exc:
                raise APIError(503, str(exc), type="service_unavailable", code="data_dir_in_use") from None
            except OSError as exc:
                raise APIError(503, f"data_dir {self.settings.data_dir} cannot be used: {exc.strerror or exc}",
                               type="service_unavailable", code="data_dir_unusable") from None
        return self._store

    async def _call(self, fn: Any, *args: Any, empty: Any = None) -> Any:
        """`fn` on the store; `empty` when there is no store yet (nothing was ever uploaded)."""
        store = self.store(create=False)
        return empty if store is None else await store.call(fn, *args)

    # ---------------------------------------------------------------------------------------- files
    async def upload(self, request: Request) -> dict[str, Any]:
        form = await request.form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "'file' is required: send the JSONL file as multipart/form-data", param="file")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"'purpose' must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                           param="purpose")
        if upload.size is not None:
            self._check_size(upload.size)
        store = self.store(create=True)
        assert store is not None
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        size = await asyncio.to_thread(store.write_file, file_id, iter(lambda: upload.file.read(COPY_CHUNK), b""))
        try:
            self._check_size(size)
        except APIError:
            store.file_path(file_id).unlink(missing_ok=True)
            raise
        record = {"id": file_id, "purpose": purpose, "filename": Path(upload.filename or "upload.jsonl").name,
                  "bytes": size, "created_at": int(time.time())}
        try:
            await store.call(queries.insert_file, record, self.settings.batch_max_storage_bytes)
        except queries.LimitReached as exc:
            store.file_path(file_id).unlink(missing_ok=True)
            raise limit_error(exc) from None
        return file_object(record)

    def _check_size(self, size: int) -> None:
        limit = self.settings.batch_max_file_bytes
        if size > limit:
            raise APIError(413, f"the file is {size} bytes; batch_max_file_bytes allows {limit}", param="file",
                           code="file_too_large")

    async def list_files(self, query: ListQuery) -> dict[str, Any]:
        found = await self._call(queries.list_files, query.purpose, query.after, query.limit, query.order, empty=[])
        return page([file_object(f) for f in found[:query.limit]], len(found) > query.limit)

    async def retrieve_file(self, file_id: str) -> dict[str, Any]:
        return file_object(await self._file(file_id))

    async def file_content(self, file_id: str) -> FileResponse:
        await self._file(file_id)
        store = self.store(create=False)
        assert store is not None
        return FileResponse(store.file_path(file_id), media_type="application/octet-stream")

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        if not await self._call(queries.delete_file, file_id, empty=False):
            raise not_found("file", file_id, "file_id")
        store = self.store(create=False)
        assert store is not None
        store.file_path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    async def _file(self, file_id: str) -> dict[str, Any]:
        found = await self._call(queries.get_file, file_id)
        if found is None:
            raise not_found("file", file_id, "file_id")
        return found

    # -------------------------------------------------------------------------------------- batches
    async def create_batch(self, req: BatchCreateRequest) -> dict[str, Any]:
        source = await self._call(queries.get_file, req.input_file_id)
        if source is None:
            raise not_found("file", req.input_file_id, "input_file_id")
        if source["purpose"] != "batch":
            raise APIError(400, f"file {req.input_file_id} has purpose {source['purpose']!r}; a batch's input "
                                "file is uploaded with purpose 'batch'", param="input_file_id")
        store = self.store(create=False)
        assert store is not None
        data = await asyncio.to_thread(store.file_path(req.input_file_id).read_bytes)
        lines = await asyncio.to_thread(count_lines, data)
        if lines > self.settings.batch_max_lines:
            raise APIError(400, f"the input file holds {lines} requests; batch_max_lines allows "
                                f"{self.settings.batch_max_lines} in one batch", param="input_file_id",
                           code="too_many_lines")
        now = int(time.time())
        record = {"id": f"batch_{uuid.uuid4().hex[:24]}", "endpoint": req.endpoint,
                  "input_file_id": req.input_file_id, "completion_window": req.completion_window,
                  "metadata": json.dumps(req.metadata) if req.metadata is not None else None,
                  "created_at": now, "expires_at": now + req.window_seconds()}
        try:
            await store.call(queries.insert_batch, record, self.settings.batch_max_open)
        except queries.LimitReached as exc:
            raise limit_error(exc) from None
        self.runner.wake.set()
        return await self.retrieve_batch(record["id"])

    async def retrieve_batch(self, batch_id: str) -> dict[str, Any]:
        found = await self._call(queries.get_batch, batch_id)
        if found is None:
            raise not_found("batch", batch_id, "batch_id")
        return batch_object(found)

    async def list_batches(self, query: ListQuery) -> dict[str, Any]:
        found = await self._call(queries.list_batches, query.after, query.limit, empty=[])
        return page([batch_object(b) for b in found[:query.limit]], len(found) > query.limit)

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        found = await self._call(queries.cancel, batch_id, int(time.time()))
        if found is None:
            raise not_found("batch", batch_id, "batch_id")
        if found["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"batch {batch_id} is {found['status']}; only a validating or in-progress batch "
                                "can be cancelled", param="batch_id", code="batch_not_cancellable")
        self.runner.wake.set()
        return batch_object(found)
