"""POST /predict, the one route for two bodies: hfport's native {model, inputs, parameters, task} (any registered
model and task, answered {model, task, outputs}, a failed item rendered at its index) and TEI's {inputs, raw_scores,
...} (the default or x-model classifier or reranker; server/tei_api.py). Both run through server/serving."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import Discriminator, Tag

from hfport import ItemError

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError
from ..schemas import PredictRequest, PredictResponse
from ..serving import Answer, Answers, ModelRecord, ModelService, infer, lookup
from ..store import BaseStore
from ..tei_api import TEI_ERRORS, Prediction, TeiPredictRequest, tei_predict

router = APIRouter(tags=["predict"], responses=TEI_ERRORS)  # hfport's error types for the native shape
NATIVE_ANSWERS = Answers(
    empty=Answer(422, "ValidationError", "{field}: empty list"),
    too_many=Answer(413, "TooManyInputs", "{field}: {count} inputs, the limit is {limit} a request"),
    too_long=Answer(413, "InputTooLong", "{field}[{index}]: {chars} characters, the limit is {limit} "
                                         "(HFPORT_PREDICT_MAX_CHARS)"),
    overloaded=Answer(429, "TooManyRequests", "{pending} predict requests are waiting; retry shortly"),
    timeout=Answer(504, "Timeout", "predict took longer than {seconds} s; send fewer or shorter inputs"),
    backend=Answer(400, "{error_kind}", "model {model!r}: {error}"),
    options=Answer(422, "InvalidParameters", "{error}"))  # unknown or bad pipeline options


async def native_predict(body: PredictRequest, store: BaseStore, service: ModelService) -> PredictResponse:
    entry = await asyncio.to_thread(lookup, store, body.model)
    task = body.task or entry["task"]
    if task is None:
        raise ApiError(422, f"model {body.model!r} has no default task; give \"task\"", "ValidationError")
    if "adapter" in body.parameters:  # the model named is the adapter (its base's batches mix adapters by name)
        raise ApiError(422, "parameters.adapter: name the adapter as \"model\" (a registered adapter)",
                       "InvalidParameters")
    single = not isinstance(body.inputs, list)
    items = [body.inputs] if single else list(body.inputs)
    results, _ = await infer(service, ModelRecord.of(entry, task), items, body.parameters, NATIVE_ANSWERS)
    outputs = ItemError.render(results)  # a failed item: {"error": "input i: ...", "error_type", "index": i}
    if single:
        if isinstance(results[0], ItemError):
            raise ApiError(422, outputs[0]["error"], results[0].error_type)
        return PredictResponse(model=body.model, task=task, outputs=outputs[0])
    return PredictResponse(model=body.model, task=task, outputs=outputs)


def _predict_shape(body: Any) -> str:
    """hfport's native body names its model (and may carry task/parameters); TEI's never does."""
    return "native" if isinstance(body, dict) and {"model", "task", "parameters"} & set(body) else "tei"


PredictBody = Annotated[Annotated[PredictRequest, Tag("native")] | Annotated[TeiPredictRequest, Tag("tei")],
                        Discriminator(_predict_shape)]


@router.post("/predict", response_model=PredictResponse | list[Prediction] | list[list[Prediction]],
             summary="Run a model: hfport's {model, inputs, parameters, task} or TEI's {inputs, raw_scores}")
async def predict(body: PredictBody, request: Request, response: Response, store: StoreDep,
                  service: ModelServiceDep) -> Any:
    """One path, two shapes, told apart by the body: a `model`, `task` or `parameters` field means hfport's native
    request (answered {model, task, outputs}); otherwise it is TEI's, for the default model (or `x-model`)."""
    if isinstance(body, PredictRequest):
        request.state.model_name = body.model
        return await native_predict(body, store, service)
    return await tei_predict(body, request, response, store, service)
