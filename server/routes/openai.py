"""OpenAI's embeddings API: POST /v1/embeddings (and GET /v1/models), so the `openai` client and everything built
on it embed with hfport. The `model` field names a registered model (else the x-model header, else the default
`serve --model`); embeddings are normalized, as OpenAI's are. encoding_format="base64" sends each vector as
base64 of its little-endian float32 bytes, as OpenAI does. Errors are OpenAI's {"error": {message, type, param,
code}}."""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hfport import ItemError
from hfport.pipelines import InputTooLongError

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError, ShapedErrorRoute, validation_message
from ..serving import Served, infer, served
from ..settings import SettingsDep
from ..tei_api import TEI_ANSWERS, check_dimensions, set_timing

# hfport's error types -> OpenAI's (type, code)
OPENAI_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_exceeded",
                503: "server_error", 504: "server_error", 424: "invalid_request_error"}
CODES = {"ModelNotFound": "model_not_found", "Overloaded": "rate_limit_exceeded", "Validation": "invalid_value",
         "Empty": "invalid_value", "Backend": "model_not_supported"}


def openai_error(status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class OpenAIRoute(ShapedErrorRoute):
    """Every error of these routes leaves in OpenAI's shape (validation: 400 invalid_request_error, as OpenAI)."""

    shaped = (RequestValidationError, ApiError, StarletteHTTPException)  # the last: a body that is not JSON

    def shape(self, exc: Exception) -> Response:
        if isinstance(exc, StarletteHTTPException):
            return openai_error(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))
        if isinstance(exc, ApiError):
            status = 400 if exc.status == 422 else exc.status  # OpenAI answers every invalid request 400
            return openai_error(status, exc.message, CODES.get(exc.error_type, exc.error_type), None, exc.headers)
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = next((str(x) for x in first if x != "body"), None)
        return openai_error(400, validation_message(exc), "invalid_value", param)


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute,
                   responses={code: {"model": OpenAIError} for code in (400, 401, 403, 404, 413, 424, 429, 503, 504)})


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str | list[str] | list[int] | list[list[int]] = Field(description="a text, texts, or token ids")
    model: str | None = Field(None, description="a registered model name (default: the server's first --model)")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first n values (Matryoshka), renormalized")
    user: str | None = Field(None, description="accepted and ignored")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


# TEI's words for the checks before the model (empty, too many, too long, overloaded); a failed input comes back in
# its place and _refusal words it in OpenAI's terms
OPENAI_ANSWERS = replace(TEI_ANSWERS, failed_item=None)


def _refusal(index: int, error: ItemError, model: Served) -> ApiError:
    """A failed input as OpenAI refuses one (400): an input longer than the model takes names the model's context
    length and the one switch that would cut it, HFPORT_AUTO_TRUNCATE (OpenAI's body has no truncate field)."""
    if error.error_type == InputTooLongError.__name__:
        return ApiError(400, f"input[{index}]: longer than this model's maximum context length of "
                             f"{model.pipe.max_input_length} tokens; shorten it (this server cuts long inputs only "
                             "when started with HFPORT_AUTO_TRUNCATE=true, and it is off)", "context_length_exceeded")
    return ApiError(400, f"input[{index}]: {error.message}", "Validation")


def _b64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/embeddings", response_model=EmbeddingsResponse, summary="OpenAI-compatible embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request, response: Response, store: StoreDep,
                     service: ModelServiceDep, settings: SettingsDep) -> EmbeddingsResponse:
    started = time.perf_counter()
    model = await served(request, store, service, body.model)
    model.need("embedding", route="/v1/embeddings")
    check_dimensions(model, body.dimensions, settings.strict_dimensions)
    single = isinstance(body.input, str) or (bool(body.input) and isinstance(body.input[0], int))
    items: list[Any] = [body.input] if single else list(body.input)
    # OpenAI's body has no truncate field: the server's HFPORT_AUTO_TRUNCATE decides (TEI's /v1/embeddings too)
    params = {"normalize": True, "dimensions": body.dimensions, "with_token_count": True,
              "truncate": settings.auto_truncate}
    results, timing = await infer(service, model.record, items, params, OPENAI_ANSWERS, field="input")
    for i, r in enumerate(results):  # the first failed input fails the request, in OpenAI's words
        if isinstance(r, ItemError):
            raise _refusal(i, r, model)
    tokens = sum(r["tokens"] for r in results)
    data = [Embedding(index=i, embedding=_b64(r["embedding"]) if body.encoding_format == "base64" else r["embedding"])
            for i, r in enumerate(results)]
    set_timing(response, started, timing, model)
    return EmbeddingsResponse(data=data, model=model.name, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hfport"


class ModelCards(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@router.get("/models", response_model=ModelCards, summary="Registered models, as OpenAI lists them")
def models(store: StoreDep) -> ModelCards:
    return ModelCards(data=[ModelCard(id=m["name"], created=int(m["created_at"])) for m in store.list_models()])
