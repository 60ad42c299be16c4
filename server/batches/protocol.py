"""Wire shapes of /v1/files and /v1/batches, as OpenAI's API (and the openai SDK's types) has them."""
from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field, field_validator

from server.protocol import OpenAIRequest

# Where a batch's lines may go: the routes whose answers are one JSON body.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score/evaluation")
# Statuses of a batch that is not finished: what the open-batch limit counts and the runner works on.
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
_WINDOW = re.compile(r"^([1-9][0-9]*)h$")


class BatchCreateRequest(OpenAIRequest):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None

    @field_validator("endpoint")
    @classmethod
    def _served_endpoint(cls, v: str) -> str:
        if v not in BATCH_ENDPOINTS:
            raise ValueError(f"{v!r} is not an endpoint batches can target; these are: {', '.join(BATCH_ENDPOINTS)}")
        return v

    @field_validator("completion_window")
    @classmethod
    def _hours(cls, v: str) -> str:
        if not _WINDOW.match(v):
            raise ValueError(f"expected a number of hours such as '24h', got {v!r}")
        return v

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}")
        return v

    def window_seconds(self) -> int:
        return int(_WINDOW.match(self.completion_window).group(1)) * 3600  # type: ignore[union-attr]


class ListQuery(OpenAIRequest):
    """`?after=<id>&limit=<n>` of the list routes (and `purpose`, `order` for files)."""

    after: str | None = None
    limit: int = Field(20, ge=1, le=10_000)
    purpose: str | None = None
    order: str = Field("desc", pattern="^(asc|desc)$")


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


TIMESTAMPS = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        **{name: row[name] for name in TIMESTAMPS},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def page(objects: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": objects, "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None, "has_more": has_more}
