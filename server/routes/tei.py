"""text-embeddings-inference's HTTP API, so TEI clients (RAG stacks, huggingface_hub's InferenceClient) work
unchanged: POST /embed, /embed_all, /embed_sparse (a SPLADE model's sparse vectors), /rerank, /similarity,
/predict, /tokenize, /decode, GET /info, and POST / routed by the model's kind. POST /predict, TEI's path, also takes
hfport's native body {model, inputs, parameters, task} (any registered model and task, answered {model, task,
outputs}, a failed item rendered at its index). The model work is server/serving.

The model: the request's `x-model` header names a registered model, else the first `serve --model` (the default).
Its kind follows TEI: a bare encoder is an embedding model (pooled as its sentence-transformers files say), a
sequence classifier with one label is a reranker, any other classifier is a classifier; a masked-LM folder in
SparseEncoder's layout is a sparse-embedding model (/embed_sparse only).

Errors are TEI's {"error", "error_type"} with TEI's codes: 400 Empty (no inputs), 413 Validation (too many inputs,
an input longer than the model takes without truncate), 422 Validation (a malformed body or option), 422 Tokenizer,
424 Backend (a model that cannot load, or cannot do what the route asks: rerank on a non-reranker, embed on a
classifier, embed_sparse on a dense embedding model and embed on a sparse one),
429 Overloaded, 503 Unhealthy. A missing model is 404 ModelNotFound (TEI serves one model, so it has no such code).
Every inference response carries TEI's timing headers in milliseconds: x-compute-time, x-tokenization-time,
x-queue-time, x-inference-time (serving.set_timing)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

import hfport
from hfport import ItemError, token_listing
from hfport.pipelines import InputTooLongError, device_name

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError, ShapedErrorRoute, error_response, validation_message
from ..schemas import ErrorBody, PredictRequest, PredictResponse
from ..serving import (Answer, Answers, ModelRecord, ModelService, Served, Timing, check_inputs, infer, lookup, served,
                       set_timing)
from ..settings import Settings, SettingsDep, get_settings
from ..store import BaseStore

TEI_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 413, 422, 424, 429, 503, 504)}
TEI_ANSWERS = Answers(
    empty=Answer(400, "Empty", "`{field}` cannot be empty"),
    too_many=Answer(413, "Validation", "batch size {count} > maximum allowed batch size {limit}"),
    too_long=Answer(413, "Validation", "{field}[{index}]: {chars} characters, the limit is {limit} "
                                       "(HFPORT_PREDICT_MAX_CHARS)"),
    blank=Answer(400, "Empty", "{field}[{index}]{part} is empty"),
    overloaded=Answer(429, "Overloaded", "{pending} requests are waiting; retry shortly"),
    timeout=Answer(504, "Timeout", "took longer than {seconds} s; send fewer or shorter inputs"),
    backend=Answer(424, "Backend", "model {model!r}: {error}"),
    options=Answer(422, "Validation", "{error}"))
# a per-input failure of the pipeline, by its error type -> TEI's status and error_type (others: 422 Validation)
FAILED_ITEM = {"PipelineInputError": (413, "Validation"), InputTooLongError.__name__: (413, "Validation"),
               "TokenizerError": (422, "Tokenizer")}
CUT_BY_TRUNCATION = ("classifier", "reranker")  # the kinds whose pipelines name their cut transformers' truncation=
# hfport's own words, for the native body of POST /predict
NATIVE_ANSWERS = Answers(
    empty=Answer(422, "ValidationError", "{field}: empty list"),
    too_many=Answer(413, "TooManyInputs", "{field}: {count} inputs, the limit is {limit} a request"),
    too_long=Answer(413, "InputTooLong", "{field}[{index}]: {chars} characters, the limit is {limit} "
                                         "(HFPORT_PREDICT_MAX_CHARS)"),
    overloaded=Answer(429, "TooManyRequests", "{pending} predict requests are waiting; retry shortly"),
    timeout=Answer(504, "Timeout", "predict took longer than {seconds} s; send fewer or shorter inputs"),
    backend=Answer(400, "{error_kind}", "model {model!r}: {error}"),
    options=Answer(422, "InvalidParameters", "{error}"))  # unknown or bad pipeline options


class TeiRoute(ShapedErrorRoute):
    """A malformed body answers as TEI does: 422 with error_type "Validation"."""

    shaped = (RequestValidationError,)

    def shape(self, exc: Exception) -> Response:
        return error_response(422, validation_message(exc), "Validation")


router = APIRouter(tags=["tei"], route_class=TeiRoute, responses=TEI_ERRORS)


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
    inputs: str | list[str | list[str]] = Field(  # TEI's PredictInput: a batch may mix texts and pairs
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


# --- steps the routes share ---------------------------------------------------------------------------------------

async def tei_infer(model: Served, service: ModelService, items: list[Any], params: dict[str, Any],
                    field: str = "inputs", tei_body: bool = True) -> tuple[list[Any], Timing]:
    """The serving core's infer in TEI's words: the first failed item fails the request, as in TEI. An input longer
    than a classifier or reranker takes is refused naming the TEI body's `truncate` (the pipeline's own words name
    transformers' truncation=, which that body refuses); `tei_body` False: the request's options are the pipeline's
    own (the Inference API's parameters), so are its words."""
    results, timing = await infer(service, model.record, items, params, TEI_ANSWERS, field)
    for i, r in enumerate(results):
        if isinstance(r, ItemError):
            status, kind = FAILED_ITEM.get(r.error_type, (422, "Validation"))
            message = r.message
            if r.error_type == InputTooLongError.__name__ and tei_body and model.kind in CUT_BY_TRUNCATION:
                message = (f"longer than the {model.pipe.max_positions} tokens the model takes; send truncate: true "
                           "to cut it")
            raise ApiError(status, f"{field}[{i}]: {message}", kind)
    return results, timing


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


# --- routes -------------------------------------------------------------------------------------------------------

async def _embed(request: Request, response: Response, body: EmbedRequest | EmbedAllRequest, store: BaseStore,
                 service: ModelService, output: str, settings: Settings) -> list:
    started = time.perf_counter()
    model = await served(request, store, service, TEI_ANSWERS)
    model.need("embedding", route=request.url.path)
    if isinstance(body, EmbedRequest):
        model.check_dimensions(body.dimensions, settings.strict_dimensions)
    items, _ = listify(body.inputs)
    params = {"output": output, "prompt_name": body.prompt_name,
              **truncation(body.truncate, body.truncation_direction, model, settings.auto_truncate)}
    if output == "sentence":
        params |= {"normalize": body.normalize, "dimensions": body.dimensions}
    results, timing = await tei_infer(model, service, items, params)
    set_timing(response, started, timing, model)
    return results


@router.post("/embed", response_model=list[list[float]], summary="Sentence embeddings (TEI)")
async def embed(body: EmbedRequest, request: Request, response: Response, store: StoreDep,
                service: ModelServiceDep, settings: SettingsDep) -> list:
    return await _embed(request, response, body, store, service, "sentence", settings)


@router.post("/embed_all", response_model=list[list[list[float]]], summary="Per-token hidden states (TEI)")
async def embed_all(body: EmbedAllRequest, request: Request, response: Response, store: StoreDep,
                    service: ModelServiceDep, settings: SettingsDep) -> list:
    return await _embed(request, response, body, store, service, "tokens", settings)


@router.post("/embed_sparse", response_model=list[list[SparseValue]],
             summary="Sparse (SPLADE) embeddings: each text's nonzero vocabulary weights (TEI)")
async def embed_sparse(body: EmbedSparseRequest, request: Request, response: Response, store: StoreDep,
                       service: ModelServiceDep, settings: SettingsDep) -> list:
    """Each input's nonzero SPLADE weights, [{"index", "value"}] in index order. A dense model answers 424 Backend
    naming the model and its kind (as /embed does for a sparse one)."""
    started = time.perf_counter()
    model = await served(request, store, service, TEI_ANSWERS)
    model.need("sparse-embedding", route="/embed_sparse")
    items, _ = listify(body.inputs)
    params = {"prompt_name": body.prompt_name,
              **truncation(body.truncate, body.truncation_direction, model, settings.auto_truncate)}
    results, timing = await tei_infer(model, service, items, params)
    set_timing(response, started, timing, model)
    return results


@router.post("/rerank", response_model=list[Rank], response_model_exclude_none=True,
             summary="Score texts against a query with a reranker (TEI)")
async def rerank(body: RerankRequest, request: Request, response: Response, store: StoreDep,
                 service: ModelServiceDep, settings: SettingsDep) -> list:
    started = time.perf_counter()
    model = await served(request, store, service, TEI_ANSWERS)
    model.need("reranker", route="/rerank")
    if not body.query.strip():
        raise ApiError(400, "`query` cannot be empty", "Empty")
    items = [{"text": body.query, "text_pair": t} for t in body.texts]
    check_inputs(body.texts, settings, TEI_ANSWERS, "texts")
    params = {"top_k": None, "function_to_apply": "none" if body.raw_scores else "sigmoid",
              **truncation(body.truncate, body.truncation_direction, model, settings.auto_truncate)}
    results, timing = await tei_infer(model, service, items, params, field="texts")
    ranks = [{"index": i, "score": r[0]["score"], "text": body.texts[i] if body.return_text else None}
             for i, r in enumerate(results)]
    ranks.sort(key=lambda r: r["score"], reverse=True)
    set_timing(response, started, timing, model)
    return ranks


@router.post("/similarity", response_model=list[float], summary="Cosine similarity of sentences to one (TEI)")
async def similarity(body: SimilarityRequest, request: Request, response: Response, store: StoreDep,
                     service: ModelServiceDep, settings: SettingsDep) -> list:
    started = time.perf_counter()
    model = await served(request, store, service, TEI_ANSWERS)
    model.need("embedding", route="/similarity")
    check_inputs(body.inputs.sentences, settings, TEI_ANSWERS, "inputs.sentences")
    items = [body.inputs.source_sentence, *body.inputs.sentences]
    params = {"normalize": True, "prompt_name": body.prompt_name,
              **truncation(body.truncate, body.truncation_direction, model, settings.auto_truncate)}
    vectors, timing = await tei_infer(model, service, items, params)
    source = vectors[0]
    set_timing(response, started, timing, model)
    return [float(sum(a * b for a, b in zip(source, v))) for v in vectors[1:]]


async def tei_predict(body: TeiPredictRequest, request: Request, response: Response, store: BaseStore,
                      service: ModelService) -> list:
    """TEI's /predict: a classifier's or reranker's scores for a text, a pair, or a list of them."""
    started = time.perf_counter()
    model = await served(request, store, service, TEI_ANSWERS)
    model.need("classifier", "reranker", route="/predict")
    inputs = body.inputs
    single = isinstance(inputs, str) or (len(inputs) == 2 and all(isinstance(x, str) for x in inputs))
    items = [pair_item(inputs)] if single else [pair_item(x) for x in inputs]
    params = {"top_k": None, "function_to_apply": "none" if body.raw_scores else None,
              **truncation(body.truncate, body.truncation_direction, model, get_settings(request).auto_truncate)}
    results, timing = await tei_infer(model, service, items, params)
    set_timing(response, started, timing, model)
    return results[0] if single else results


async def native_predict(body: PredictRequest, store: BaseStore, service: ModelService) -> PredictResponse:
    """hfport's native /predict: any registered model and task, in hfport's words."""
    entry = await asyncio.to_thread(lookup, store, body.model, NATIVE_ANSWERS.unknown_model)
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


async def predict(body: PredictBody, request: Request, response: Response, store: StoreDep,
                  service: ModelServiceDep) -> Any:
    """One path, two shapes, told apart by the body: a `model`, `task` or `parameters` field means hfport's native
    request (answered {model, task, outputs}); otherwise it is TEI's, for the default model (or `x-model`)."""
    if isinstance(body, PredictRequest):
        request.state.model_name = body.model
        return await native_predict(body, store, service)
    return await tei_predict(body, request, response, store, service)


# hfport's native body came first on this path: a malformed body answers in hfport's shape (422 ValidationError), not
# TeiRoute's
router.add_api_route("/predict", predict, methods=["POST"], route_class_override=APIRoute, tags=["predict"],
                     response_model=PredictResponse | list[Prediction] | list[list[Prediction]],
                     summary="Run a model: hfport's {model, inputs, parameters, task} or TEI's {inputs, raw_scores}")


@router.post("/tokenize", response_model=list[list[SimpleToken]], summary="Tokens with offsets (TEI)")
async def tokenize(body: TokenizeRequest, request: Request, store: StoreDep, service: ModelServiceDep,
                   settings: SettingsDep) -> list:
    model = await served(request, store, service, TEI_ANSWERS)
    items, _ = listify(body.inputs)
    check_inputs(items, settings, TEI_ANSWERS)
    prompt = ""
    if body.prompt_name is not None:
        model.need("embedding", "sparse-embedding", route="/tokenize with prompt_name")
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
    model = await served(request, store, service, TEI_ANSWERS)
    rows = [body.ids] if body.ids and isinstance(body.ids[0], int) else list(body.ids)
    check_inputs(rows, settings, TEI_ANSWERS, "ids")
    vocab = len(model.pipe.tokenizer)
    for i, row in enumerate(rows):
        bad = [x for x in row if not 0 <= x < vocab]
        if bad:
            raise ApiError(422, f"ids[{i}]: {bad[:3]} are not token ids (the vocabulary has {vocab})", "Tokenizer")
    return [model.pipe.tokenizer.decode(row, skip_special_tokens=body.skip_special_tokens) for row in rows]


@router.get("/info", response_model=Info, summary="The default (or x-model) model and the server's limits (TEI)")
async def info(request: Request, store: StoreDep, service: ModelServiceDep, settings: SettingsDep) -> Info:
    model = await served(request, store, service, TEI_ANSWERS)
    config = model.pipe.model.config
    if model.kind in EMBEDDING_KINDS:  # TEI names a SPLADE model's pooling "splade"
        kind = {"embedding": {"pooling": model.pipe.sentence.pooling}}
        max_len = model.pipe.max_input_length
    else:
        labels = {"id2label": {str(k): v for k, v in config.id2label.items()},
                  "label2id": {v: k for k, v in config.id2label.items()}}
        kind = {model.kind: labels}
        max_len = model.pipe.max_positions
    return Info(model_id=model.name, model_dtype=model.pipe.model.dtype_name,
                model_device=device_name(model.pipe.model.device),
                model_type=kind, max_concurrent_requests=settings.predict_max_pending, max_input_length=max_len,
                max_batch_tokens=model.pipe.max_batch_tokens, max_client_batch_size=settings.predict_max_inputs,
                auto_truncate=settings.auto_truncate, tokenization_workers=settings.predict_threads,
                version=hfport.__version__)


@router.post("/", summary="TEI's default route: by the model's kind (and huggingface_hub's InferenceClient)")
async def root(request: Request, response: Response, store: StoreDep, service: ModelServiceDep,
               settings: SettingsDep, body: Annotated[dict[str, Any], Body()]) -> Any:
    """An embedding model: {inputs: {source_sentence, sentences}} is /similarity, anything else /embed. A classifier
    or reranker: TEI's /predict; with a `parameters` object, the Inference API's shape instead (transformers'
    option names; one input answers [[{label, score}, ...]], every label by default). Other tasks (token
    classification, question answering, fill-mask): the pipeline with `parameters`, answering its own shape."""
    model = await served(request, store, service, TEI_ANSWERS)

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
        return await tei_predict(parse(TeiPredictRequest, body), request, response, store, service)
    return await _inference_api(model, body, parameters or {}, response, service)


async def _inference_api(model: Served, body: dict[str, Any], parameters: dict[str, Any], response: Response,
                         service: ModelService) -> Any:
    """The Inference API's {inputs, parameters}: the pipeline with transformers' option names, in its own shape."""
    unknown = sorted(set(body) - {"inputs", "parameters"})
    if unknown or "inputs" not in body:
        raise ApiError(422, f"body: expected {{inputs, parameters}}; unknown fields {unknown}" if unknown
                       else "inputs: field required", "Validation")
    started = time.perf_counter()
    params = dict(parameters)
    if model.kind in ("classifier", "reranker"):
        params.setdefault("top_k", None)  # the Inference API lists every label unless top_k says otherwise
    single = not isinstance(body["inputs"], list)
    items = [body["inputs"]] if single else list(body["inputs"])
    results, timing = await tei_infer(model, service, items, params, tei_body=False)
    set_timing(response, started, timing, model)
    if model.kind in ("classifier", "reranker"):
        return results  # a list a input, single or not: what InferenceClient.text_classification reads
    return results[0] if single else results
