"""/v1/files and /v1/batches (OpenAI's Batch API); server/batches/serving.py does the work."""
from __future__ import annotations

from fastapi import APIRouter, Request

from server.batches.protocol import BatchCreateRequest, ListQuery
from server.errors import checked
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


def _query(request: Request) -> ListQuery:
    return checked(lambda: ListQuery.model_validate(dict(request.query_params)))


@router.post("/v1/files")
async def upload_file(request: Request):
    return await request.app.state.batches.upload(request)


@router.get("/v1/files")
async def list_files(request: Request):
    return await request.app.state.batches.list_files(_query(request))


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request):
    return await request.app.state.batches.retrieve_file(file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request):
    return await request.app.state.batches.file_content(file_id)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request):
    return await request.app.state.batches.delete_file(file_id)


@router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, request: Request):
    return await request.app.state.batches.create_batch(body)


@router.get("/v1/batches")
async def list_batches(request: Request):
    return await request.app.state.batches.list_batches(_query(request))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request):
    return await request.app.state.batches.retrieve_batch(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request):
    return await request.app.state.batches.cancel_batch(batch_id)
