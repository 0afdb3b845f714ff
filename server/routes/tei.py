"""text-embeddings-inference's HTTP API, so TEI clients (RAG stacks, huggingface_hub's InferenceClient) work
unchanged: POST /embed, /embed_all, /predict (shared with hfport's native shape), /rerank, /similarity, /tokenize,
/decode, GET /info, and POST / routed by the model's kind.

The model: the request's `x-model` header names a registered model, else the first `serve --model` (the default).
Its kind follows TEI: a bare encoder is an embedding model (pooled as its sentence-transformers files say), a
sequence classifier with one label is a reranker, any other classifier is a classifier.

Errors are TEI's {"error", "error_type"} with TEI's codes: 400 Empty (no inputs), 413 Validation (too many inputs,
an input longer than the model takes without truncate), 422 Validation (a malformed body or option), 422 Tokenizer,
424 Backend (a model that cannot do what the route asks: rerank on a non-reranker, embed on a classifier),
429 Overloaded, 503 Unhealthy. A missing model is 404 ModelNotFound (TEI serves one model, so it has no such code).
Every inference response carries TEI's timing headers in milliseconds: x-compute-time, x-tokenization-time,
x-queue-time, x-inference-time."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

import hfport
from hfport import SentenceEmbeddingPipeline, TextClassificationPipeline, token_listing
from hfport.errors import HfportError, ItemError

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError, ShapedErrorRoute, error_response, validation_message
from ..preload import SERVED_TASK
from ..schemas import ErrorBody, PredictRequest, PredictResponse
from ..serving import ModelService, Timing
from ..settings import Settings, SettingsDep
from . import predict as native
from .models import lookup

TEI_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 413, 422, 424, 429, 503, 504)}
# a per-input failure of the pipeline, by its error type -> TEI's status and error_type
ITEM_ERRORS = {"PipelineInputError": (413, "Validation"), "TokenizerError": (422, "Tokenizer")}
TIMING_HEADERS = ("x-compute-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


class TeiRoute(ShapedErrorRoute):
    """A malformed body answers as TEI does: 422 with error_type "Validation"."""

    shaped = (RequestValidationError,)

    def shape(self, exc: Exception) -> Response:
        return error_response(422, validation_message(exc), "Validation")


router = APIRouter(tags=["tei"], route_class=TeiRoute, responses=TEI_ERRORS)
predict_router = APIRouter(tags=["predict"], responses=TEI_ERRORS)  # hfport's error types for the native shape


# --- bodies -------------------------------------------------------------------------------------------------------

Direction = Literal["Right", "Left", "right", "left"]
Texts = str | list[str]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedRequest(_Body):
    inputs: str | list[str] | list[int] | list[list[int]] = Field(description="a text, texts, or token ids")
    normalize: bool = True
    truncate: bool | None = Field(None, description="cut inputs longer than max_input_length (default false)")
    truncation_direction: Direction = "Right"
    prompt_name: str | None = Field(None, description="a prompt of the model's sentence-transformers config")
    dimensions: int | None = Field(None, ge=1, description="keep the first n values (Matryoshka), then normalize")


class EmbedAllRequest(_Body):
    inputs: str | list[str] | list[int] | list[list[int]]
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class TeiPredictRequest(_Body):
    inputs: str | list[str] | list[list[str]] = Field(
        description="a text, a [text, text_pair] pair, or a list of texts or pairs (as TEI: a list of exactly two "
                    "texts is one pair)")
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class RerankRequest(_Body):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class SimilarityInput(_Body):
    source_sentence: str
    sentences: list[str]


class SimilarityRequest(_Body):
    inputs: SimilarityInput
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="accepted and ignored (huggingface_hub sends {})")


class TokenizeRequest(_Body):
    inputs: Texts
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(_Body):
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
    model_type: dict[str, Any] = Field(description="{'embedding': {'pooling'}} | {'classifier': {'id2label', "
                                                   "'label2id'}} | {'reranker': {...}}")
    max_concurrent_requests: int
    max_input_length: int | None
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    auto_truncate: bool = False
    tokenization_workers: int
    version: str


# --- shared steps ---------------------------------------------------------------------------------------------------

class Served:
    """The model a request goes to: its registry entry, the pipeline task it is served with, the pipeline, kind."""

    def __init__(self, entry: dict[str, Any], task: str, pipe: Any):
        self.entry, self.task, self.pipe = entry, task, pipe
        self.name = entry["name"]
        if isinstance(pipe, SentenceEmbeddingPipeline):
            self.kind = "embedding"
        elif isinstance(pipe, TextClassificationPipeline):
            self.kind = "reranker" if pipe.model.config.num_labels == 1 else "classifier"
        else:
            self.kind = task

    def need(self, *kinds: str, route: str) -> None:
        if self.kind not in kinds:
            raise ApiError(424, f"model {self.name!r} is not a {' or '.join(kinds)} model (it is: {self.kind}); "
                                f"{route} needs one", "Backend")


async def served(request: Request, store: Any, service: ModelService, name: str | None = None) -> Served:
    name = name or request.headers.get("x-model")
    startup = getattr(request.app.state, "startup", None)
    if not name:
        name = startup.default if startup is not None else None
    if not name:
        raise ApiError(400, "no model: name one with the x-model header, or start the server with --model",
                       "Validation")
    request.state.model_name = name
    entry = await asyncio.to_thread(lookup, store, name)
    task = SERVED_TASK.get(entry["task"], entry["task"])
    if task is None:
        raise ApiError(424, f"model {name!r} has no task the server can serve", "Backend")
    try:
        pipe = await service.get(name, entry["path"], task)
    except HfportError as e:
        raise ApiError(424, f"model {name!r} failed to load: {e}", "Backend") from e
    return Served(entry, task, pipe)


def check_inputs(items: list[Any], settings: Settings, field: str = "inputs") -> None:
    if not items:
        raise ApiError(400, f"`{field}` cannot be empty", "Empty")
    if len(items) > settings.predict_max_inputs:
        raise ApiError(413, f"batch size {len(items)} > maximum allowed batch size {settings.predict_max_inputs}",
                       "Validation")
    for i, item in enumerate(items):
        chars = native._chars(item)
        if chars > settings.predict_max_chars:
            raise ApiError(413, f"{field}[{i}]: {chars} characters, the limit is {settings.predict_max_chars}",
                           "Validation")
        if isinstance(item, str) and not item.strip():
            raise ApiError(400, f"{field}[{i}] is empty", "Empty")


async def infer(model: Served, service: ModelService, settings: Settings, items: list[Any],
                params: dict[str, Any], field: str = "inputs") -> tuple[list[Any], Timing]:
    """Run items through the model's micro-batched pipeline; any failed item fails the request, as in TEI."""
    check_inputs(items, settings, field)
    if service.pending >= settings.predict_max_pending:
        raise ApiError(429, f"{service.pending} requests are waiting; retry shortly", "Overloaded",
                       headers={"Retry-After": "1"})
    service.pending += 1
    try:
        results, timing = await asyncio.wait_for(
            service.predict_timed(model.name, model.entry["path"], model.task, items, params),
            settings.predict_timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise ApiError(504, f"took longer than {settings.predict_timeout_s} s; send fewer or shorter inputs",
                       "Timeout") from e
    except HfportError as e:
        raise ApiError(424, f"model {model.name!r}: {e}", "Backend") from e
    except (ValueError, TypeError) as e:  # options the pipeline refuses (dimensions, prompt_name, ...)
        raise ApiError(422, str(e), "Validation") from e
    finally:
        service.pending -= 1
    for i, r in enumerate(results):
        if isinstance(r, ItemError):  # TEI answers the whole request with the first failed input's error
            status, kind = ITEM_ERRORS.get(r.error_type, (422, "Validation"))
            raise ApiError(status, f"{field}[{i}]: {r.message}", kind)
    return results, timing


def set_timing(response: Response, started: float, timing: Timing, model: Served) -> None:
    ms = {"x-compute-time": (time.perf_counter() - started), "x-tokenization-time": timing.tokenization,
          "x-queue-time": timing.queue, "x-inference-time": timing.inference}
    for header, seconds in ms.items():
        response.headers[header] = str(round(seconds * 1000))
    response.headers["x-model-id"] = model.name


def _truncation(truncate: bool | None, direction: str, kind: str) -> dict[str, Any]:
    if direction.lower() == "left" and kind != "embedding":
        raise ApiError(422, "truncation_direction=Left: only embedding models cut on the left", "Validation")
    return {"truncate": bool(truncate), "truncation_direction": direction.lower()} if kind == "embedding" else (
        {"truncation": True} if truncate else {})


def _listify(inputs: Any) -> tuple[list[Any], bool]:
    """(items, single): a text or one token-id list is a single input."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        return [inputs], True
    return list(inputs), False


# --- routes ---------------------------------------------------------------------------------------------------------

async def _embed(request: Request, response: Response, body: EmbedRequest | EmbedAllRequest, store: Any,
                 service: ModelService, settings: Settings, output: str) -> list:
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("embedding", route=request.url.path)
    items, _ = _listify(body.inputs)
    params = {"output": output, "prompt_name": body.prompt_name,
              **_truncation(body.truncate, body.truncation_direction, model.kind)}
    if output == "sentence":
        params |= {"normalize": body.normalize, "dimensions": body.dimensions}
    results, timing = await infer(model, service, settings, items, params)
    set_timing(response, started, timing, model)
    return results


@router.post("/embed", response_model=list[list[float]], summary="Sentence embeddings (TEI)")
async def embed(body: EmbedRequest, request: Request, response: Response, store: StoreDep, service: ModelServiceDep,
                settings: SettingsDep) -> list:
    return await _embed(request, response, body, store, service, settings, "sentence")


@router.post("/embed_all", response_model=list[list[list[float]]], summary="Per-token hidden states (TEI)")
async def embed_all(body: EmbedAllRequest, request: Request, response: Response, store: StoreDep,
                    service: ModelServiceDep, settings: SettingsDep) -> list:
    return await _embed(request, response, body, store, service, settings, "tokens")


def _pair_item(x: Any) -> Any:
    if isinstance(x, list):
        if len(x) != 2 or not all(isinstance(t, str) for t in x):
            raise ApiError(422, f"a pair must be [text, text_pair], got {len(x)} texts", "Validation")
        return {"text": x[0], "text_pair": x[1]}
    return x


async def tei_predict(body: TeiPredictRequest, request: Request, response: Response, store: Any,
                      service: ModelService, settings: Settings) -> list:
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("classifier", "reranker", route="/predict")
    inputs = body.inputs
    single = isinstance(inputs, str) or (len(inputs) == 2 and all(isinstance(x, str) for x in inputs))
    items = [_pair_item(inputs)] if single else [_pair_item(x) for x in inputs]
    params = {"top_k": None, "function_to_apply": "none" if body.raw_scores else None,
              **_truncation(body.truncate, body.truncation_direction, model.kind)}
    results, timing = await infer(model, service, settings, items, params)
    set_timing(response, started, timing, model)
    return results[0] if single else results


def _predict_shape(body: Any) -> str:
    """hfport's native body names its model (and may carry task/parameters); TEI's never does."""
    return "native" if isinstance(body, dict) and {"model", "task", "parameters"} & set(body) else "tei"


PredictBody = Annotated[Annotated[PredictRequest, Tag("native")] | Annotated[TeiPredictRequest, Tag("tei")],
                        Discriminator(_predict_shape)]


@predict_router.post("/predict", response_model=PredictResponse | list[Prediction] | list[list[Prediction]],
                     summary="Run a model: hfport's {model, inputs, parameters, task} or TEI's {inputs, raw_scores}")
async def predict(body: PredictBody, request: Request, response: Response, store: StoreDep, service: ModelServiceDep,
                  settings: SettingsDep) -> Any:
    """One path, two shapes, told apart by the body: a `model`, `task` or `parameters` field means hfport's native
    request (answered {model, task, outputs}); otherwise it is TEI's, for the default model (or `x-model`)."""
    if isinstance(body, PredictRequest):
        request.state.model_name = body.model
        return await native.predict(body, store, service, settings)
    return await tei_predict(body, request, response, store, service, settings)


@router.post("/rerank", response_model=list[Rank], response_model_exclude_none=True,
             summary="Score texts against a query with a reranker (TEI)")
async def rerank(body: RerankRequest, request: Request, response: Response, store: StoreDep,
                 service: ModelServiceDep, settings: SettingsDep) -> list:
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("reranker", route="/rerank")
    if not body.query.strip():
        raise ApiError(400, "`query` cannot be empty", "Empty")
    items = [{"text": body.query, "text_pair": t} for t in body.texts]
    check_inputs(body.texts, settings, "texts")
    params = {"top_k": None, "function_to_apply": "none" if body.raw_scores else "sigmoid",
              **_truncation(body.truncate, body.truncation_direction, model.kind)}
    results, timing = await infer(model, service, settings, items, params, field="texts")
    ranks = [{"index": i, "score": r[0]["score"], "text": body.texts[i] if body.return_text else None}
             for i, r in enumerate(results)]
    ranks.sort(key=lambda r: r["score"], reverse=True)
    set_timing(response, started, timing, model)
    return ranks


@router.post("/similarity", response_model=list[float], summary="Cosine similarity of sentences to one (TEI)")
async def similarity(body: SimilarityRequest, request: Request, response: Response, store: StoreDep,
                     service: ModelServiceDep, settings: SettingsDep) -> list:
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("embedding", route="/similarity")
    check_inputs(body.inputs.sentences, settings, "inputs.sentences")
    items = [body.inputs.source_sentence, *body.inputs.sentences]
    params = {"normalize": True, "prompt_name": body.prompt_name,
              **_truncation(body.truncate, body.truncation_direction, model.kind)}
    vectors, timing = await infer(model, service, settings, items, params)
    source = vectors[0]
    set_timing(response, started, timing, model)
    return [float(sum(a * b for a, b in zip(source, v))) for v in vectors[1:]]


@router.post("/tokenize", response_model=list[list[SimpleToken]], summary="Tokens with offsets (TEI)")
async def tokenize(body: TokenizeRequest, request: Request, store: StoreDep, service: ModelServiceDep,
                   settings: SettingsDep) -> list:

    model = await served(request, store, service)
    items, _ = _listify(body.inputs)
    check_inputs(items, settings)
    prompt = ""
    if body.prompt_name is not None:
        model.need("embedding", route="/tokenize with prompt_name")
        prompts = model.pipe.sentence.prompts
        if body.prompt_name not in prompts:
            raise ApiError(422, f"prompt_name={body.prompt_name!r}: the model's prompts are {sorted(prompts)}",
                           "Validation")
        prompt = prompts[body.prompt_name]
    return await asyncio.to_thread(lambda: [token_listing(model.pipe.tokenizer, prompt + t,
                                                          add_special_tokens=body.add_special_tokens)
                                            for t in items])


@router.post("/decode", response_model=list[str], summary="Token ids back to text (TEI)")
async def decode(body: DecodeRequest, request: Request, store: StoreDep, service: ModelServiceDep,
                 settings: SettingsDep) -> list:
    model = await served(request, store, service)
    rows = [body.ids] if body.ids and isinstance(body.ids[0], int) else list(body.ids)
    check_inputs(rows, settings, "ids")
    vocab = len(model.pipe.tokenizer)
    for i, row in enumerate(rows):
        bad = [x for x in row if not 0 <= x < vocab]
        if bad:
            raise ApiError(422, f"ids[{i}]: {bad[:3]} are not token ids (the vocabulary has {vocab})", "Tokenizer")
    return [model.pipe.tokenizer.decode(row, skip_special_tokens=body.skip_special_tokens) for row in rows]


@router.get("/info", response_model=Info, summary="The default (or x-model) model and the server's limits (TEI)")
async def info(request: Request, store: StoreDep, service: ModelServiceDep, settings: SettingsDep) -> Info:
    model = await served(request, store, service)
    config = model.pipe.model.config
    if model.kind == "embedding":
        kind = {"embedding": {"pooling": model.pipe.sentence.pooling}}
        max_len = model.pipe.max_input_length
    else:
        labels = {"id2label": {str(k): v for k, v in config.id2label.items()},
                  "label2id": {v: k for k, v in config.id2label.items()}}
        kind = {model.kind: labels}
        max_len = model.pipe.max_positions
    return Info(model_id=model.name, model_dtype=str(model.pipe.model.dtype).removeprefix("torch."),
                model_type=kind, max_concurrent_requests=settings.predict_max_pending, max_input_length=max_len,
                max_batch_tokens=model.pipe.max_batch_tokens, max_client_batch_size=settings.predict_max_inputs,
                tokenization_workers=settings.predict_threads, version=hfport.__version__)


@router.post("/", summary="TEI's default route: by the model's kind (and huggingface_hub's InferenceClient)")
async def root(request: Request, response: Response, store: StoreDep, service: ModelServiceDep,
               settings: SettingsDep, body: Annotated[dict[str, Any], Body()]) -> Any:
    """An embedding model: {inputs: {source_sentence, sentences}} is /similarity, anything else /embed. A classifier
    or reranker: TEI's /predict; with a `parameters` object, the Inference API's shape instead (transformers'
    option names; one input answers [[{label, score}, ...]], every label by default). Other tasks (token
    classification, question answering, fill-mask): the pipeline with `parameters`, answering its own shape."""
    model = await served(request, store, service)

    def parse(cls: type[BaseModel], data: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ApiError(422, validation_message(e), "Validation") from e

    if model.kind == "embedding":
        if isinstance(body.get("inputs"), dict):
            return await similarity(parse(SimilarityRequest, body), request, response, store, service, settings)
        return await embed(parse(EmbedRequest, body), request, response, store, service, settings)
    parameters = body.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(422, "parameters: must be an object", "Validation")
    if model.kind in ("classifier", "reranker") and parameters is None:
        return await tei_predict(parse(TeiPredictRequest, body), request, response, store, service, settings)
    unknown = sorted(set(body) - {"inputs", "parameters"})
    if unknown or "inputs" not in body:
        raise ApiError(422, f"body: expected {{inputs, parameters}}; unknown fields {unknown}" if unknown
                       else "inputs: field required", "Validation")
    started = time.perf_counter()
    params = dict(parameters or {})
    if model.kind in ("classifier", "reranker"):
        params.setdefault("top_k", None)  # the Inference API lists every label unless top_k says otherwise
    items, single = ([body["inputs"]], True) if not isinstance(body["inputs"], list) else (list(body["inputs"]),
                                                                                          False)
    results, timing = await infer(model, service, settings, items, params)
    set_timing(response, started, timing, model)
    if model.kind in ("classifier", "reranker"):
        return results  # a list a input, single or not: what InferenceClient.text_classification reads
    return results[0] if single else results
