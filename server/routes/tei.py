"""text-embeddings-inference's HTTP API, so TEI clients (RAG stacks, huggingface_hub's InferenceClient) work
unchanged: POST /embed, /embed_all, /embed_sparse (a SPLADE model's sparse vectors), /rerank, /similarity,
/tokenize, /decode, GET /info, and POST / routed by the model's kind (TEI's /predict shares POST /predict with
hfport's native shape: routes/predict.py).

The model: the request's `x-model` header names a registered model, else the first `serve --model` (the default).
Its kind follows TEI: a bare encoder is an embedding model (pooled as its sentence-transformers files say), a
sequence classifier with one label is a reranker, any other classifier is a classifier; a masked-LM folder in
SparseEncoder's layout is a sparse-embedding model (/embed_sparse only). Bodies, error words and
timing headers: server/tei_api.py; the model work: server/serving."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from pydantic import BaseModel, ValidationError

import hfport
from hfport import token_listing
from hfport.pipelines import device_name

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError, validation_message
from ..serving import ModelService, Served, check_inputs, served
from ..settings import Settings, SettingsDep
from ..store import BaseStore
from ..tei_api import (TEI_ANSWERS, TEI_ERRORS, DecodeRequest, EmbedAllRequest, EmbedRequest, EmbedSparseRequest,
                       Info, Rank, RerankRequest, SimilarityRequest, SimpleToken, SparseValue, TeiPredictRequest,
                       TeiRoute, TokenizeRequest, check_dimensions, listify, set_timing, tei_embed_sparse, tei_infer,
                       tei_predict, truncation)

router = APIRouter(tags=["tei"], route_class=TeiRoute, responses=TEI_ERRORS)


async def _embed(request: Request, response: Response, body: EmbedRequest | EmbedAllRequest, store: BaseStore,
                 service: ModelService, output: str, settings: Settings) -> list:
    started = time.perf_counter()
    model = await served(request, store, service)
    model.need("embedding", route=request.url.path)
    if isinstance(body, EmbedRequest):
        check_dimensions(model, body.dimensions, settings.strict_dimensions)
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
                       service: ModelServiceDep) -> list:
    return await tei_embed_sparse(body, request, response, store, service)


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
    model = await served(request, store, service)
    model.need("embedding", route="/similarity")
    check_inputs(body.inputs.sentences, settings, TEI_ANSWERS, "inputs.sentences")
    items = [body.inputs.source_sentence, *body.inputs.sentences]
    params = {"normalize": True, "prompt_name": body.prompt_name,
              **truncation(body.truncate, body.truncation_direction, model, settings.auto_truncate)}
    vectors, timing = await tei_infer(model, service, items, params)
    source = vectors[0]
    set_timing(response, started, timing, model)
    return [float(sum(a * b for a, b in zip(source, v))) for v in vectors[1:]]


@router.post("/tokenize", response_model=list[list[SimpleToken]], summary="Tokens with offsets (TEI)")
async def tokenize(body: TokenizeRequest, request: Request, store: StoreDep, service: ModelServiceDep,
                   settings: SettingsDep) -> list:
    model = await served(request, store, service)
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
    model = await served(request, store, service)
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
    model = await served(request, store, service)
    config = model.pipe.model.config
    if model.kind in ("embedding", "sparse-embedding"):  # TEI names a SPLADE model's pooling "splade"
        kind = {"embedding": {"pooling": model.pipe.sentence.pooling}}
        max_len = model.pipe.max_input_length
    else:
        labels = {"id2label": {str(k): v for k, v in config.id2label.items()},
                  "label2id": {v: k for k, v in config.id2label.items()}}
        kind = {model.kind: labels}
        max_len = model.pipe.max_positions
    return Info(model_id=model.name, model_dtype=str(model.pipe.model.dtype).removeprefix("torch."),
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
    results, timing = await tei_infer(model, service, items, params)
    set_timing(response, started, timing, model)
    if model.kind in ("classifier", "reranker"):
        return results  # a list a input, single or not: what InferenceClient.text_classification reads
    return results[0] if single else results
