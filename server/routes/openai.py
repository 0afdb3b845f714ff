"""OpenAI's embeddings API: POST /v1/embeddings (and GET /v1/models), so the `openai` client and everything built
on it embed with hfport. The `model` field names a registered model (else the x-model header, else the default
`serve --model`); embeddings are normalized, as OpenAI's are. encoding_format="base64" sends each vector as
base64 of its little-endian float32 bytes, as OpenAI does. Errors are OpenAI's {"error": {message, type, param,
code}}."""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hfport import ItemError
from hfport.pipelines import InputTooLongError

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError, ShapedErrorRoute, store_unavailable, validation_message
from ..serving import Answer, Answers, Served, infer, served, set_timing
from ..settings import SettingsDep
from ..store import StoreUnavailable

INVALID = "invalid_request_error"  # OpenAI's type for every request it refuses as invalid


class OpenAIError(ApiError):
    """An error in OpenAI's terms, worded where it is raised: OpenAI's error object, {"error": {"message", "type",
    "param", "code"}} (`error_type` holds its type)."""

    def __init__(self, status: int, message: str, type: str = INVALID, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(status, message, type, headers)
        self.code, self.param = code, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.error_type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class OpenAIAnswer(Answer):
    """A refusal of the serving core as OpenAI words it: its type (error_type), code and param (the request's field
    at fault; a template over the same facts as the message)."""

    code: str | None = None
    param: str | None = None

    def error(self, headers: dict[str, str] | None = None, **facts: Any) -> OpenAIError:
        return OpenAIError(self.status, self.message.format(**facts), self.error_type.format(**facts), self.code,
                           self.param.format(**facts) if self.param else None, headers)


# the statuses are the ones this route always answered (OpenAI's clients raise by status: 400 BadRequestError, 404
# NotFoundError, 429 RateLimitError, ...)
OPENAI_ANSWERS = Answers(
    empty=OpenAIAnswer(400, INVALID, "{field}: no inputs; send a text, a list of texts or token ids",
                       "invalid_value", "{field}"),
    too_many=OpenAIAnswer(413, INVALID, "{field}: {count} inputs, this server takes at most {limit} in one request "
                                        "(HFPORT_PREDICT_MAX_INPUTS)", "invalid_value", "{field}"),
    too_long=OpenAIAnswer(413, INVALID, "{field}[{index}]: {chars} characters, the limit is {limit} "
                                        "(HFPORT_PREDICT_MAX_CHARS)", "invalid_value", "{field}"),
    blank=OpenAIAnswer(400, INVALID, "{field}[{index}]: an empty text", "invalid_value", "{field}"),
    overloaded=OpenAIAnswer(429, "requests", "{pending} requests are waiting; retry shortly", "rate_limit_exceeded"),
    timeout=OpenAIAnswer(504, "server_error", "no answer within {seconds} s; send fewer or shorter inputs",
                         "timeout"),
    backend=OpenAIAnswer(424, INVALID, "model {model!r}: {error}", "model_not_supported", "model"),
    options=OpenAIAnswer(400, INVALID, "{error}", "invalid_value"),
    # failed_item None: a failed input comes back in its place and the route words it (_refusal)
    no_model=OpenAIAnswer(400, INVALID, "no model: name one in `model`, or start the server with --model",
                          "invalid_value", "model"),
    default_gone=OpenAIAnswer(400, INVALID, "no model: the default model {model!r} (the first --model) is no longer "
                                            "registered; name one in `model`; {known}", "invalid_value", "model"),
    unknown_model=OpenAIAnswer(404, INVALID, "the model {model!r} does not exist; {known}",
                               "model_not_found", "model"),
    unservable=OpenAIAnswer(424, INVALID, "model {model!r} {reason}", "model_not_supported", "model"),
    dimensions=OpenAIAnswer(400, INVALID, "dimensions={dimensions}: model {model!r} was trained for dimensions "
                                          "{allowed} (this server refuses others: HFPORT_STRICT_DIMENSIONS)",
                            "invalid_value", "dimensions"))


class OpenAIRoute(ShapedErrorRoute):
    """Every error of these routes leaves in OpenAI's shape: an OpenAIError as it was raised; FastAPI's refusal of
    a malformed body as OpenAI refuses one (400 invalid_request_error, the field as param); an error raised outside
    this protocol (the server's bearer-token check) keeps its status, its hfport error type as the code."""

    shaped = (RequestValidationError, ApiError, StarletteHTTPException,  # the third: a body that is not JSON
              StoreUnavailable)  # a model name is looked up in the registry, which the database holds

    def shape(self, exc: Exception) -> Response:
        if isinstance(exc, OpenAIError):
            return exc.response()
        if isinstance(exc, StoreUnavailable):
            exc = store_unavailable(exc)
        if isinstance(exc, ApiError):
            return OpenAIError(exc.status, exc.message, _type(exc.status), exc.error_type, None, exc.headers).response()
        if isinstance(exc, StarletteHTTPException):
            return OpenAIError(exc.status_code, str(exc.detail), _type(exc.status_code),
                               headers=getattr(exc, "headers", None)).response()
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = next((str(x) for x in first if x != "body"), None)
        return OpenAIError(400, validation_message(exc), INVALID, "invalid_value", param).response()


def _type(status: int) -> str:
    """OpenAI's error type for a status, for an error not raised in OpenAI's terms."""
    return {401: "authentication_error", 429: "requests"}.get(status, INVALID if status < 500 else "server_error")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute,
                   responses={code: {"model": OpenAIErrorBody}
                              for code in (400, 401, 403, 404, 413, 424, 429, 503, 504)})


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


def _refusal(index: int, error: ItemError, model: Served) -> OpenAIError:
    """A failed input as OpenAI refuses one (400): an input longer than the model takes names the model's context
    length and the one switch that would cut it, HFPORT_AUTO_TRUNCATE (OpenAI's body has no truncate field)."""
    if error.error_type == InputTooLongError.__name__:
        return OpenAIError(400, f"input[{index}]: longer than this model's maximum context length of "
                                f"{model.pipe.max_input_length} tokens; shorten it (this server cuts long inputs only "
                                "when started with HFPORT_AUTO_TRUNCATE=true, and it is off)",
                           code="context_length_exceeded", param="input")
    return OpenAIError(400, f"input[{index}]: {error.message}", code="invalid_value", param="input")


def _b64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/embeddings", response_model=EmbeddingsResponse, summary="OpenAI-compatible embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request, response: Response, store: StoreDep,
                     service: ModelServiceDep, settings: SettingsDep) -> EmbeddingsResponse:
    started = time.perf_counter()
    model = await served(request, store, service, OPENAI_ANSWERS, body.model)
    model.need("embedding", route="/v1/embeddings")
    model.check_dimensions(body.dimensions, settings.strict_dimensions)
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
