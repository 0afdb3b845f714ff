"""text-embeddings-inference's protocol: its request and response bodies, how it words errors (TEI_ANSWERS, the
Validation shape of a malformed body), its timing headers, and the TEI-shaped predict that POST /predict and POST /
share. The routes are in routes/tei.py (and POST /predict in routes/predict.py); the model work is server/serving.

Errors are TEI's {"error", "error_type"} with TEI's codes: 400 Empty (no inputs), 413 Validation (too many inputs,
an input longer than the model takes without truncate), 422 Validation (a malformed body or option), 422 Tokenizer,
424 Backend (a model that cannot do what the route asks: rerank on a non-reranker, embed on a classifier,
embed_sparse on a dense embedding model and embed on a sparse one),
429 Overloaded, 503 Unhealthy. A missing model is 404 ModelNotFound (TEI serves one model, so it has no such code).
Every inference response carries TEI's timing headers in milliseconds: x-compute-time, x-tokenization-time,
x-queue-time, x-inference-time."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError, ShapedErrorRoute, error_response, validation_message
from .schemas import ErrorBody
from .serving import Answer, Answers, ModelService, Served, Timing, infer, served
from .settings import get_settings
from .store import BaseStore

TEI_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 413, 422, 424, 429, 503, 504)}
TEI_ANSWERS = Answers(
    empty=Answer(400, "Empty", "`{field}` cannot be empty"),
    too_many=Answer(413, "Validation", "batch size {count} > maximum allowed batch size {limit}"),
    too_long=Answer(413, "Validation", "{field}[{index}]: {chars} characters, the limit is {limit} "
                                       "(HFPORT_PREDICT_MAX_CHARS)"),
    blank=Answer(400, "Empty", "{field}[{index}] is empty"),
    overloaded=Answer(429, "Overloaded", "{pending} requests are waiting; retry shortly"),
    timeout=Answer(504, "Timeout", "took longer than {seconds} s; send fewer or shorter inputs"),
    backend=Answer(424, "Backend", "model {model!r}: {error}"),
    options=Answer(422, "Validation", "{error}"),
    # a per-input failure of the pipeline, by its error type -> TEI's status and error_type
    failed_item={"PipelineInputError": (413, "Validation"), "InputTooLongError": (413, "Validation"),
                 "TokenizerError": (422, "Tokenizer")})


class TeiRoute(ShapedErrorRoute):
    """A malformed body answers as TEI does: 422 with error_type "Validation"."""

    shaped = (RequestValidationError,)

    def shape(self, exc: Exception) -> Response:
        return error_response(422, validation_message(exc), "Validation")


# --- bodies -------------------------------------------------------------------------------------------------------

Direction = Literal["Right", "Left", "right", "left"]
TRUNCATE = "cut inputs longer than max_input_length (default: the server's HFPORT_AUTO_TRUNCATE, on by default)"
Texts = str | list[str]


class TeiBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
class EmbedRequest(TeiBody):
    inputs: str | list[str] | list[int] | list[list[int]] = Field(description="a text, texts, or token ids")
    normalize: bool = True
    truncate: bool | None = Field(None, description=TRUNCATE)
    truncation_direction: Direction = "Right"
    prompt_name: str | None = Field(None, description="a prompt of the model's sentence-transformers config")
    dimensions: int | None = Field(None, ge=1, description="keep the first n values (Matryoshka), then normalize")


class EmbedAllRequest(TeiBody):
    inputs: str | list[str] | list[int] | list[list[int]]
    truncate: bool | None = Field(None, description=TRUNCATE)
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class EmbedSparseRequest(TeiBody):
    """TEI's /embed_sparse body: a SPLADE model's sparse vectors."""

    inputs: str | list[str] | list[int] | list[list[int]] = Field(description="a text, texts, or token ids")
    truncate: bool | None = Field(None, description=TRUNCATE)
    truncation_direction: Direction = "Right"
    prompt_name: str | None = Field(None, description="a prompt of the model's sentence-transformers config")


class SparseValue(BaseModel):
    """One nonzero entry of a sparse vector (TEI's shape): a vocabulary index and its weight."""

    index: int
    value: float


class TeiPredictRequest(TeiBody):
    inputs: str | list[str] | list[list[str]] = Field(
        description="a text, a [text, text_pair] pair, or a list of texts or pairs (as TEI: a list of exactly two "
                    "texts is one pair)")
    raw_scores: bool = False
    truncate: bool | None = Field(None, description=TRUNCATE)
    truncation_direction: Direction = "Right"


class RerankRequest(TeiBody):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = Field(None, description=TRUNCATE)
    truncation_direction: Direction = "Right"


class SimilarityInput(TeiBody):
    source_sentence: str
    sentences: list[str]


class SimilarityRequest(TeiBody):
    inputs: SimilarityInput
    truncate: bool | None = Field(None, description=TRUNCATE)
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="accepted and ignored (huggingface_hub sends {})")


class TokenizeRequest(TeiBody):
    inputs: Texts
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(TeiBody):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class Prediction(BaseModel):
    score: float
    label: str


class Rank(BaseModel):
    index: int
    score: float
    text: str | None = None


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class Info(BaseModel):
    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_device: str = Field(description="where the model runs (not in TEI's schema): cpu or 'cuda:0 (NVIDIA H200)'")
    model_type: dict[str, Any] = Field(description="{'embedding': {'pooling'}} | {'classifier': {'id2label', "
                                                   "'label2id'}} | {'reranker': {...}}")
    max_concurrent_requests: int
    max_input_length: int | None
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    auto_truncate: bool = Field(description="inputs without `truncate` are cut at max_input_length "
                                            "(HFPORT_AUTO_TRUNCATE)")
    tokenization_workers: int
    version: str


# --- steps the TEI-shaped routes share --------------------------------------------------------------------------------

async def tei_infer(model: Served, service: ModelService, items: list[Any], params: dict[str, Any],
                    field: str = "inputs") -> tuple[list[Any], Timing]:
    """The serving core's infer in TEI's words: any failed item fails the request, as in TEI."""
    return await infer(service, model.record, items, params, TEI_ANSWERS, field)


def set_timing(response: Response, started: float, timing: Timing, model: Served) -> None:
    ms = {"x-compute-time": (time.perf_counter() - started), "x-tokenization-time": timing.tokenization,
          "x-queue-time": timing.queue, "x-inference-time": timing.inference}
    for header, seconds in ms.items():
        response.headers[header] = str(round(seconds * 1000))
    response.headers["x-model-id"] = model.name


EMBEDDING_KINDS = ("embedding", "sparse-embedding")  # the kinds whose pipelines take truncate + a direction


def truncation(truncate: bool | None, direction: str, model: Served, auto_truncate: bool) -> dict[str, Any]:
    """TEI's truncate options as the pipeline's. As TEI: a request's `truncate` wins, else the server's
    HFPORT_AUTO_TRUNCATE (TEI's `req.truncate.unwrap_or(info.auto_truncate)`); inputs are cut at the model's
    maximum length. Embedding pipelines take a direction; a classifier cuts on the right, at its position table."""
    if direction.lower() == "left" and model.kind not in EMBEDDING_KINDS:
        raise ApiError(422, "truncation_direction=Left: only embedding models cut on the left", "Validation")
    cut = auto_truncate if truncate is None else truncate
    if model.kind in EMBEDDING_KINDS:
        return {"truncate": cut, "truncation_direction": direction.lower()}
    if not cut:
        return {}
    # transformers' truncation=True cuts at the tokenizer's model_max_length, which a folder may not set: TEI cuts at
    # the model's own maximum (what /info reports as max_input_length)
    limit = model.pipe.max_positions
    return {"truncation": True, **({"max_length": limit} if limit is not None else {})}


def check_dimensions(model: Served, dimensions: int | None, strict: bool) -> None:
    """With HFPORT_STRICT_DIMENSIONS: a `dimensions` the model was not trained for (its Matryoshka dimensions, else
    its full size) is a 422 naming the model and the allowed sizes. Off (the default), any prefix is served."""
    if not strict or dimensions is None:
        return
    full = model.pipe.dimension
    allowed = sorted({*model.pipe.sentence.matryoshka_dims, full})
    if dimensions not in allowed:
        raise ApiError(422, f"dimensions={dimensions}: model {model.name!r} was trained for dimensions {allowed} "
                            "(the server refuses others: HFPORT_STRICT_DIMENSIONS)", "Validation")


def listify(inputs: Any) -> tuple[list[Any], bool]:
    """(items, single): a text or one token-id list is a single input."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        return [inputs], True
    return list(inputs), False


def pair_item(x: Any) -> Any:
    if isinstance(x, list):
        if len(x) != 2 or not all(isinstance(t, str) for t in x):
            raise ApiError(422, f"a pair must be [text, text_pair], got {len(x)} texts", "Validation")
        return {"text": x[0], "text_pair": x[1]}
    return x


async def tei_embed_sparse(body: EmbedSparseRequest, request: Request, response: Response, store: BaseStore,
                           service: ModelService) -> list:
    """TEI's /embed_sparse: each input's nonzero SPLADE weights, [{"index", "value"}] in index order. A dense
    model answers 424 Backend naming the model and its kind (as /embed does for a sparse one)."""
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("sparse-embedding", route="/embed_sparse")
    items, _ = listify(body.inputs)
    params = {"prompt_name": body.prompt_name,
              **truncation(body.truncate, body.truncation_direction, model, get_settings(request).auto_truncate)}
    results, timing = await tei_infer(model, service, items, params)
    set_timing(response, started, timing, model)
    return results


async def tei_predict(body: TeiPredictRequest, request: Request, response: Response, store: BaseStore,
                      service: ModelService) -> list:
    """TEI's /predict: a classifier's or reranker's scores for a text, a pair, or a list of them."""
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("classifier", "reranker", route="/predict")
    inputs = body.inputs
    single = isinstance(inputs, str) or (len(inputs) == 2 and all(isinstance(x, str) for x in inputs))
    items = [pair_item(inputs)] if single else [pair_item(x) for x in inputs]
    params = {"top_k": None, "function_to_apply": "none" if body.raw_scores else None,
              **truncation(body.truncate, body.truncation_direction, model, get_settings(request).auto_truncate)}
    results, timing = await tei_infer(model, service, items, params)
    set_timing(response, started, timing, model)
    return results[0] if single else results
