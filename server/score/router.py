"""POST /v1/score/evaluation (LLaMA-Factory's API)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from server.json_body import CheckedJSONRoute
from server.score.protocol import ScoreEvaluationRequest

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/score/evaluation")
async def create_score_evaluation(body: ScoreEvaluationRequest, request: Request):
    return await request.app.state.score.create(body)
