"""The Batch API's durable state: files on disk, and batches and their lines in one SQLite database.

Layout under the data directory:  `batches.sqlite3` (WAL), `files/<file id>` (each file's bytes), `lock`.

One thread owns the one connection: every read and write is a function `fn(connection, ...)` handed to it,
run in a transaction of its own (a savepoint inside the thread's commit group), and answered only after the
commit, so a caller that was told "recorded" is told the truth after a SIGKILL. The thread takes whatever
calls are waiting and commits them together (group commit): a batch finishing hundreds of lines a second
costs a handful of commits, not hundreds. WAL with `synchronous=NORMAL` keeps every committed transaction
across a crash of the process (an operating-system crash may lose the last ones, never corrupt the file).

A file's bytes are written to `files/<id>.part`, flushed to disk and renamed before its row is committed, so
a row never points at a partial file; a file on disk without a row (a crash between the two) is removed
when the store opens."""
from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import logging
import os
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

log = logging.getLogger("ktserve.batches")
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    created_at INTEGER NOT NULL, expires_at INTEGER, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
-- one row per input line; `result` is its finished output or error-file line, written once (done = 1)
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0, ok INTEGER, result TEXT,
    PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done, line);
"""
GROUP_COMMIT = 256  # calls committed together at most


class DataDirInUse(RuntimeError):
    """Another process holds the data directory."""


class BatchStore:
    """The database thread and the files folder. Build it with `open()` (it creates the directory)."""

    def __init__(self, root: Path):
        self.root = root
        self.files_dir = root / "files"
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock_file: Any = None

    @classmethod
    def open(cls, root: str | Path) -> "BatchStore":
        store = cls(Path(root))
        store._start()
        return store

    @staticmethod
    def exists(root: str | Path) -> bool:
        return (Path(root) / "batches.sqlite3").exists()

    def _start(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "lock", "a")
        try:  # two servers on one data directory would run each batch twice
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise DataDirInUse(f"data_dir {self.root} is in use by another ktserve process") from None
        connection = sqlite3.connect(self.root / "batches.sqlite3", isolation_level=None, check_same_thread=False)
        connection.row_factory = sqlite3.Row
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(SCHEMA)
        self._remove_orphans(connection)
        self._thread = threading.Thread(target=self._serve, args=(connection,), name="ktserve-batch-store",
                                        daemon=True)
        self._thread.start()

    def _remove_orphans(self, connection: sqlite3.Connection) -> None:
        known = {row[0] for row in connection.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(connection, *args)` in a transaction on the store's thread; its result once committed."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, future))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Commit what is queued, checkpoint the WAL into the database file, release the directory."""
        if self._thread is not None:
            self._calls.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _serve(self, connection: sqlite3.Connection) -> None:
        stopping = False
        while not stopping:
            group = [self._calls.get()]
            while len(group) < GROUP_COMMIT:
                try:
                    group.append(self._calls.get_nowait())
                except queue.Empty:
                    break
            stopping = None in group
            # a call whose caller was cancelled before it ran is dropped; once running it can no longer be
            live = [call for call in group if call is not None and call[2].set_running_or_notify_cancel()]
            for future, result, error in self._commit(live, connection):
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        connection.close()

    @staticmethod
    def _commit(group: list, connection: sqlite3.Connection) -> list:
        answers = []
        connection.execute("BEGIN IMMEDIATE")
        try:
            for fn, args, future in group:
                connection.execute("SAVEPOINT call")
                try:
                    answers.append((future, fn(connection, *args), None))
                    connection.execute("RELEASE call")
                except Exception as exc:  # this call's writes undone, the group's others kept
                    connection.execute("ROLLBACK TO call")
                    connection.execute("RELEASE call")
                    answers.append((future, None, exc))
            connection.execute("COMMIT")
        except Exception as exc:  # the commit itself failed (disk full): nothing of the group was kept
            log.exception("the batch database could not commit")
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            return [(future, None, exc) for _, _, future in group]
        return answers

    # ------------------------------------------------------------------------------------------- files
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def write_file(self, file_id: str, chunks: Any) -> int:
        """Write `chunks` (bytes) as file `file_id`, durably; its size. Blocking: call it off the loop."""
        part = self.files_dir / f"{file_id}.part"
        size = 0
        with open(part, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, self.file_path(file_id))
        return size


def rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    return [dict(row) for row in cursor]


def row(cursor: sqlite3.Cursor) -> dict[str, Any] | None:
    found = cursor.fetchone()
    return None if found is None else dict(found)
