"""POST /predict: run a registered model's pipeline on inputs, with count/size limits and a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from hfport.errors import HfportError, ItemError

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError
from ..schemas import ERRORS, PredictRequest, PredictResponse
from ..settings import SettingsDep
from .models import lookup

router = APIRouter(tags=["predict"], responses=ERRORS)


def _chars(item: Any) -> int:
    if isinstance(item, str):
        return len(item)
    if isinstance(item, dict):
        return sum(_chars(v) for v in item.values())
    if isinstance(item, list):
        return sum(_chars(v) for v in item)
    return 0


@router.post("/predict", response_model=PredictResponse, summary="Run a model on one input or a list")
async def predict(body: PredictRequest, store: StoreDep, service: ModelServiceDep,
                  settings: SettingsDep) -> PredictResponse:
    entry = await asyncio.to_thread(lookup, store, body.model)
    task = body.task or entry["task"]
    if task is None:
        raise ApiError(422, f"model {body.model!r} has no default task; give \"task\"", "ValidationError")
    single = not isinstance(body.inputs, list)
    items = [body.inputs] if single else list(body.inputs)
    if not items:
        raise ApiError(422, "inputs: empty list", "ValidationError")
    if len(items) > settings.predict_max_inputs:
        raise ApiError(413, f"inputs: {len(items)} inputs, the limit is {settings.predict_max_inputs} a request",
                       "TooManyInputs")
    for i, item in enumerate(items):
        if _chars(item) > settings.predict_max_chars:
            raise ApiError(413, f"inputs[{i}]: {_chars(item)} characters, the limit is {settings.predict_max_chars}",
                           "InputTooLong")
    if service.pending >= settings.predict_max_pending:
        raise ApiError(429, f"{service.pending} predict requests are waiting; retry shortly", "TooManyRequests",
                       headers={"Retry-After": "1"})
    service.pending += 1
    try:
        results = await asyncio.wait_for(service.predict(entry["name"], entry["path"], task, items, body.parameters,
                                                         base=entry.get("base")),
                                         settings.predict_timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise ApiError(504, f"predict took longer than {settings.predict_timeout_s} s; send fewer or shorter "
                            "inputs", "Timeout") from e
    except HfportError as e:
        raise ApiError(400, f"model {body.model!r}: {e}", type(e).__name__) from e
    except (ValueError, TypeError) as e:  # unknown or bad pipeline options
        raise ApiError(422, str(e), "InvalidParameters") from e
    finally:
        service.pending -= 1
    outputs = ItemError.render(results)  # a failed item: {"error": "input i: ...", "error_type", "index": i}
    if single:
        if isinstance(results[0], ItemError):
            raise ApiError(422, outputs[0]["error"], results[0].error_type)
        return PredictResponse(model=body.model, task=task, outputs=outputs[0])
    return PredictResponse(model=body.model, task=task, outputs=outputs)
