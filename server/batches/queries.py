"""Every read and write of the batch database: functions of a connection, run by the store's thread
(`BatchStore.call`), each in a transaction of its own."""
from __future__ import annotations

import json
import sqlite3
from typing import Any

from server.batches.protocol import OPEN_STATUSES
from server.batches.store import row, rows
from server.batches.validate import Line


class LimitReached(Exception):
    """A limit a write would pass; the message names it."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


_OPEN = f"status IN ({', '.join(repr(s) for s in OPEN_STATUSES)})"


# ------------------------------------------------------------------------------------------------ files
def insert_file(db: sqlite3.Connection, file: dict[str, Any], storage_limit: int | None) -> None:
    """Insert a file's row, unless the files stored would then take more than `storage_limit` bytes."""
    if storage_limit is not None:
        used = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]
        if used + file["bytes"] > storage_limit:
            raise LimitReached(f"storing this file ({file['bytes']} bytes) would pass the storage limit: "
                               f"{used} of batch_max_storage_bytes {storage_limit} are in use; delete files "
                               "to make room", "storage_limit_exceeded")
    db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at) VALUES "
               "(:id, :purpose, :filename, :bytes, :created_at)", file)


def get_file(db: sqlite3.Connection, file_id: str) -> dict[str, Any] | None:
    return row(db.execute("SELECT * FROM files WHERE id = ?", (file_id,)))


def list_files(db: sqlite3.Connection, purpose: str | None, after: str | None, limit: int, order: str
               ) -> list[dict[str, Any]]:
    """Up to `limit` + 1 files (the extra one says there are more), newest first unless `order` is asc."""
    sign, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
    where, args = [], []
    if purpose is not None:
        where.append("purpose = ?")
        args.append(purpose)
    cursor = _rowid(db, "files", after)
    if cursor is not None:
        where.append(f"rowid {sign} ?")
        args.append(cursor)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    return rows(db.execute(f"SELECT * FROM files {clause} ORDER BY rowid {direction} LIMIT ?", (*args, limit + 1)))


def delete_file(db: sqlite3.Connection, file_id: str) -> bool:
    return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0


# ---------------------------------------------------------------------------------------------- batches
def insert_batch(db: sqlite3.Connection, batch: dict[str, Any], open_limit: int) -> None:
    """Insert a new batch (status validating), unless `open_limit` batches are unfinished already."""
    open_now = db.execute(f"SELECT COUNT(*) FROM batches WHERE {_OPEN}").fetchone()[0]
    if open_now >= open_limit:
        raise LimitReached(f"{open_now} batches are not finished yet, the most batch_max_open ({open_limit}) "
                           "allows; wait for one to finish or cancel one", "too_many_open_batches")
    db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, created_at,"
               " expires_at) VALUES (:id, :endpoint, :input_file_id, :completion_window, 'validating', :metadata, "
               ":created_at, :expires_at)", batch)


def get_batch(db: sqlite3.Connection, batch_id: str) -> dict[str, Any] | None:
    return row(db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)))


def list_batches(db: sqlite3.Connection, after: str | None, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` + 1 batches, newest first, after the batch `after`."""
    cursor = _rowid(db, "batches", after)
    if cursor is None:
        return rows(db.execute("SELECT * FROM batches ORDER BY rowid DESC LIMIT ?", (limit + 1,)))
    return rows(db.execute("SELECT * FROM batches WHERE rowid < ? ORDER BY rowid DESC LIMIT ?", (cursor, limit + 1)))


def _rowid(db: sqlite3.Connection, table: str, item_id: str | None) -> int | None:
    """Where the list cursor `item_id` sits (None: no cursor, or one this store does not know)."""
    if item_id is None:
        return None
    found = db.execute(f"SELECT rowid FROM {table} WHERE id = ?", (item_id,)).fetchone()
    return None if found is None else found[0]


def open_batches(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """The unfinished batches, oldest first: the order the runner serves them in."""
    return rows(db.execute(f"SELECT * FROM batches WHERE {_OPEN} ORDER BY rowid"))


def cancel(db: sqlite3.Connection, batch_id: str, now: int) -> dict[str, Any] | None:
    db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND status IN "
               "('validating', 'in_progress')", (now, batch_id))
    return get_batch(db, batch_id)


def start_lines(db: sqlite3.Connection, batch_id: str, lines: list[Line], now: int) -> None:
    """A validated batch's lines, all pending, and its status in_progress (unless it was cancelled meanwhile)."""
    db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
    db.executemany("INSERT INTO lines (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                   [(batch_id, ln.number, ln.custom_id, ln.url, ln.body) for ln in lines])
    db.execute("UPDATE batches SET total = ?, in_progress_at = ? WHERE id = ?", (len(lines), now, batch_id))
    db.execute("UPDATE batches SET status = 'in_progress' WHERE id = ? AND status = 'validating'", (batch_id,))


def fail_validation(db: sqlite3.Connection, batch_id: str, errors: list[dict[str, Any]], now: int) -> None:
    db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND status IN "
               "('validating', 'cancelling')", (now, json.dumps({"object": "list", "data": errors}), batch_id))


def set_finalizing(db: sqlite3.Connection, batch_id: str, now: int) -> None:
    db.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND status = "
               "'in_progress'", (now, batch_id))


# ------------------------------------------------------------------------------------------------ lines
def pending_lines(db: sqlite3.Connection, batch_id: str, after_line: int, limit: int) -> list[dict[str, Any]]:
    return rows(db.execute("SELECT line, custom_id, url, body FROM lines WHERE batch_id = ? AND done = 0 AND "
                           "line > ? ORDER BY line LIMIT ?", (batch_id, after_line, limit)))


def record_line(db: sqlite3.Connection, batch_id: str, line: int, ok: bool, result: str) -> bool:
    """A line's result and the batch's counts, once: a line already recorded keeps its first result."""
    changed = db.execute("UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND line = ? AND "
                         "done = 0", (int(ok), result, batch_id, line)).rowcount
    if changed:
        db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ? WHERE id = ?",
                   (int(ok), int(not ok), batch_id))
    return bool(changed)


def results_page(db: sqlite3.Connection, batch_id: str, after_line: int, limit: int) -> list[dict[str, Any]]:
    """Lines in input order, done or not, with what was recorded for them."""
    return rows(db.execute("SELECT line, custom_id, done, ok, result FROM lines WHERE batch_id = ? AND line > ? "
                           "ORDER BY line LIMIT ?", (batch_id, after_line, limit)))


def finish(db: sqlite3.Connection, batch_id: str, status: str, now: int, files: list[dict[str, Any]],
           output_file_id: str | None, error_file_id: str | None, failed_more: int) -> None:
    """The batch's end in one transaction: its result files' rows, its final status, and its lines dropped."""
    for file in files:
        insert_file(db, file, None)
    db.execute(f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ?, "
               "failed = failed + ? WHERE id = ?", (status, now, output_file_id, error_file_id, failed_more, batch_id))
    db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
