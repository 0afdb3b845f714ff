"""Row shards (hfport/pipelines/shards.py): a pipeline's batch run as contiguous row groups on worker threads with one
intra-op thread each, each group a batch of its own. Sharded pipeline outputs against the same pipeline unsharded
(tasks, families, pairs, multiple choice, the real MiniLM in fp32 and int8), the batches that never shard (mixed
adapters, a mode on the caller's thread, an ONNX graph), a model call that never shards (the model is not the
pipeline's engine), the workers' thread counts leaving the process's as they were, and the row_shards argument."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

import hfport
from hfport.pipelines import shards
from tests.parity import MINILM_MIN_COSINE
from tests.tiny import batch, make_adapter, save_hf
from tests.tiny_tokenizers import make_folder

# fp32: the same weights and rows give the same values, but a matmul's blocking depends on its M (here the shard's
# real token count, not the batch's), so sums may round differently: 1e-5 as every parity test (measured 0 to ~1e-6)
TOL = 1e-5
TEXTS = ["the plot was great and the acting even better, said everyone who saw it", "awful", "a b c d e f g h",
         "the ending was lovely overall, I think", "not bad at all", "the last one is the longest of all the texts here",
         "short", "one more text of middling length"]
LENGTHS = (70, 41, 9, 30, 12, 50)  # mixed lengths, padded to 70; one row over 64 tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return {(family, task): make_folder(root, family, task) for family, task in [
        ("bert", "base"), ("bert", "sequence-classification"), ("bert", "token-classification"),
        ("bert", "question-answering"), ("bert", "masked-lm"), ("bert", "multiple-choice"),
        ("roberta", "sequence-classification"), ("distilbert", "token-classification"), ("albert", "base")]}


def _record_calls(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(thread name, rows) of every call of `model`."""
    calls: list[tuple[str, int]] = []

    def record(module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        calls.append((threading.current_thread().name, ids.shape[-2] if ids.dim() == 3 else ids.shape[0]))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return calls


def _strings(result) -> list[str]:
    """Every string a pipeline result holds, in order (labels, answers, tokens)."""
    if isinstance(result, dict):
        return [x for k, v in sorted(result.items()) for x in _strings(v)]
    if isinstance(result, (list, tuple)):
        return [x for v in result for x in _strings(v)]
    return [result] if isinstance(result, str) else []


def _floats(result) -> torch.Tensor:
    """Every number a pipeline result holds, in order."""
    if isinstance(result, dict):
        return torch.cat([_floats(v) for k, v in sorted(result.items()) if not isinstance(v, str)] or [torch.zeros(0)])
    if isinstance(result, (list, tuple)):
        return torch.cat([_floats(v) for v in result] or [torch.zeros(0)])
    return torch.tensor([float(result)])


CASES = {
    ("bert", "base"): ("feature-extraction", TEXTS, {"pooling": "mean"}),
    ("bert", "sequence-classification"): ("text-classification", [{"text": t, "text_pair": "and a pair"} for t in TEXTS],
                                          {"top_k": None, "function_to_apply": "none"}),
    ("bert", "token-classification"): ("token-classification", TEXTS, {"ignore_labels": []}),
    ("bert", "question-answering"): ("question-answering",
                                     [{"question": "why?", "context": t} for t in TEXTS], {"top_k": 2}),
    ("bert", "masked-lm"): ("fill-mask", [t + " [MASK]." for t in TEXTS], {"top_k": 3}),
    ("roberta", "sequence-classification"): ("text-classification", TEXTS,
                                             {"top_k": None, "function_to_apply": "none"}),
    ("distilbert", "token-classification"): ("token-classification", TEXTS, {"ignore_labels": []}),
    ("albert", "base"): ("feature-extraction", TEXTS, {"pooling": "mean"}),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(c))
def test_sharded_pipeline_equals_unsharded(case, folders):
    task, inputs, options = CASES[case]
    if task == "fill-mask":
        mask = hfport.AutoTokenizer.from_pretrained(folders[case]).mask_token
        inputs = [t.replace("[MASK]", mask) for t in inputs]
    want = hfport.pipeline(task, model=folders[case], row_shards="off")(inputs, **options)
    pipe = hfport.pipeline(task, model=folders[case], row_shards=3)
    calls = _record_calls(pipe.model)
    got = pipe(inputs, **options)
    # three shards of contiguous rows (the batch sorted longest first), on the workers (which worker takes which,
    # in which order, is theirs to race for)
    assert len(calls) == 3 and sum(rows for _, rows in calls) >= len(TEXTS), calls
    assert all(name.startswith("hfport-shard-") for name, _ in calls), calls
    assert _strings(got) == _strings(want)  # labels, answers, tokens
    diff = (_floats(got) - _floats(want)).abs().max().item()
    assert diff <= TOL, diff


def test_multiple_choice_rows_shard(folders):
    pipe = hfport.pipeline("multiple-choice", model=folders["bert", "multiple-choice"], row_shards=2)
    items = [{"question": "which one?", "choices": ["the first choice", "b", "a third, longer choice here"]},
             {"question": "and now?", "choices": ["yes", "no, never again"]}]
    want = hfport.pipeline("multiple-choice", model=folders["bert", "multiple-choice"], row_shards="off")(items)
    calls = _record_calls(pipe.model)
    got = pipe(items)
    assert sorted(rows for _, rows in calls) == [2, 3], calls  # five choice rows, balanced by tokens
    assert _strings(got) == _strings(want)
    assert (_floats(got) - _floats(want)).abs().max().item() <= TOL


def test_each_row_keeps_its_own_outputs(folders):
    """Each text's logits are its own (as a one-text call gives them), whatever shard it ran in."""
    pipe = hfport.pipeline("token-classification", model=folders["bert", "token-classification"], row_shards=4)
    got = pipe(TEXTS, ignore_labels=[])
    for text, result in zip(TEXTS, got):
        alone = pipe([text], ignore_labels=[])[0]
        assert [d["word"] for d in result] == [d["word"] for d in alone]
        assert (_floats(result) - _floats(alone)).abs().max().item() <= TOL


def test_split_rows():
    assert shards.split_rows(list(LENGTHS), 2) == [(0, 2), (2, 6)]  # 111 | 101
    assert shards.split_rows(list(LENGTHS), 3) == [(0, 1), (1, 4), (4, 6)]  # 70 | 80 | 62 (of 212)
    assert shards.split_rows([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]  # every part gets a row
    assert shards.split_rows([1, 1, 1, 1, 1, 1, 1, 1], 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="3 rows into 4"):
        shards.split_rows([1, 2, 3], 4)


# --- what never shards ---------------------------------------------------------------------------------------------


def test_a_model_call_never_shards(tmp_path, monkeypatch):
    """The model is not the engine: model(**inputs) at inference runs whole on the calling thread, whatever the
    environment says (HFPORT_ROW_SHARDS made main's models split their own calls)."""
    save_hf("bert", "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    monkeypatch.setenv("HFPORT_ROW_SHARDS", "3")
    calls = _record_calls(model)
    with torch.inference_mode():
        model(**batch("bert", lengths=LENGTHS))
    assert calls == [("MainThread", len(LENGTHS))], calls


def test_mixed_adapter_batches_and_modes_never_shard(folders, tmp_path):
    base = folders["bert", "sequence-classification"]
    adapter = make_adapter(base, tmp_path / "a", "text-classification", 2, ["q", "v"], 1)
    pipe = hfport.pipeline("text-classification", model=base, adapters={"a": adapter}, row_shards=2)
    calls: list[tuple[str, int]] = []
    pipe.model.body.register_forward_hook(
        lambda module, args, out: calls.append((threading.current_thread().name, args[0].shape[0])))
    pipe(TEXTS, adapter=["a", None] * 4)  # one pass of the shared body over every row
    assert calls == [("MainThread", len(TEXTS))], calls
    calls.clear()
    pipe(TEXTS)  # the base alone: sharded
    assert len(calls) == 2 and sum(r for _, r in calls) == len(TEXTS), calls
    assert all(n.startswith("hfport-shard-") for n, _ in calls), calls
    calls.clear()
    with torch.device("cpu"):  # a torch function mode: per thread, it would not follow the rows
        pipe(TEXTS)
    assert calls == [("MainThread", len(TEXTS))], calls


def test_modes_follow_into_the_workers(folders):
    """inference_mode and CPU autocast are per thread: the shards run in the caller's."""
    pipe = hfport.pipeline("feature-extraction", model=folders["bert", "base"], row_shards=2)
    seen: list[tuple[bool, bool]] = []
    pipe.model.register_forward_hook(lambda module, args, out: seen.append(
        (torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"))))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        pipe(TEXTS)
    pipe(TEXTS)
    assert seen == [(True, True)] * 2 + [(False, False)] * 2, seen


def test_concurrent_callers_share_the_pool(folders):
    """Several threads (the server's predict threads) each shard into the same workers and get their own rows."""
    pipe = hfport.pipeline("token-classification", model=folders["bert", "token-classification"], row_shards=2)
    inputs = [TEXTS[s:] + TEXTS[:s] for s in range(4)]
    want = [pipe(texts, ignore_labels=[]) for texts in inputs]
    got: dict[int, list] = {}

    def caller(i: int) -> None:
        for _ in range(2):
            got[i] = pipe(inputs[i], ignore_labels=[])

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert sorted(got) == [0, 1, 2, 3]
    for i in range(4):
        assert got[i] == want[i], i


# --- thread counts -----------------------------------------------------------------------------------------------


def test_an_interrupted_caller_leaves_no_shard_running(monkeypatch):
    """Ctrl-C while the caller waits on its shards (KeyboardInterrupt in its wait): run() raises it only once no job
    runs any more. A daemon worker still inside a torch op when the interpreter exits aborts the process (`hfport mine`
    interrupted while embedding: SIGABRT, "terminate called without an active exception", instead of exit code 130)."""
    started, finished = [threading.Event(), threading.Event()], []

    def job(i: int) -> None:
        started[i].set()
        time.sleep(0.3)  # a forward pass under way when the interrupt comes
        finished.append(i)

    real_wait, calls = shards.wait, []

    def interrupted(futures, *args, **kwargs):
        calls.append(len(futures))
        if len(calls) == 1:
            assert all(e.wait(timeout=60) for e in started)  # both shards running: then the interrupt
            raise KeyboardInterrupt
        return real_wait(futures, *args, **kwargs)

    monkeypatch.setattr(shards, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shards.run([lambda i=i: job(i) for i in range(2)])
    assert sorted(finished) == [0, 1]


def _fresh_count() -> int:
    return shards._in_fresh_thread(torch.get_num_threads)


def test_workers_leave_the_process_thread_counts_alone():
    main, fresh = torch.get_num_threads(), _fresh_count()
    pool = shards.ShardPool()  # its own, so its workers start here whatever the shared pool did before
    pool.ensure(3)
    assert pool.size == 3
    assert [pool.submit(torch.get_num_threads).result(timeout=60) for _ in range(6)] == [1] * 6  # ONE each
    assert torch.get_num_threads() == main  # the caller's own count
    assert _fresh_count() == fresh  # what ATen's process-global count gives a thread started now
    torch.set_num_threads(main)  # and later settings elsewhere do not reach the running workers
    assert pool.submit(torch.get_num_threads).result(timeout=60) == 1


def test_set_num_threads_here_sets_only_the_calling_thread():
    """What a server's predict threads run at start (hfport.set_num_threads_here): their own count, the process's
    and other threads' left alone; share= divides the process's count (at least 1)."""
    from concurrent.futures import ThreadPoolExecutor

    main, fresh = torch.get_num_threads(), _fresh_count()
    with ThreadPoolExecutor(2, initializer=hfport.set_num_threads_here, initargs=(None, 2)) as pool:
        counts = [pool.submit(torch.get_num_threads).result(timeout=60) for _ in range(4)]
    assert counts == [max(1, fresh // 2)] * 4
    with ThreadPoolExecutor(1, initializer=hfport.set_num_threads_here, initargs=(3,)) as pool:
        assert pool.submit(torch.get_num_threads).result(timeout=60) == 3
    assert torch.get_num_threads() == main and _fresh_count() == fresh
    # initializers running at once (a pool's threads start together under load): the process's count survives
    for _ in range(5):
        start = threading.Barrier(8)
        with ThreadPoolExecutor(8, initializer=hfport.set_num_threads_here, initargs=(1,)) as pool:
            assert [f.result(timeout=60) for f in [pool.submit(start.wait) for _ in range(8)]]
        assert _fresh_count() == fresh


# --- the argument --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,want", [("auto", "auto"), (" OFF ", "off"), (3, 3), (1, 1)])
def test_row_shards_values(value, want):
    assert shards.check_row_shards(value) == want


@pytest.mark.parametrize("value", [0, -2, "two", 1.5, "on", True, None])
def test_row_shards_refuses_bad_values(value, folders):
    with pytest.raises(ValueError, match=r"row_shards=.*: expected 'auto', 'off' or a shard count"):
        hfport.pipeline("feature-extraction", model=folders["bert", "base"], row_shards=value)


def test_shard_counts(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert shards.shard_count("auto", rows=6, tokens=212) == 2  # the intra-op threads
    assert shards.shard_count("auto", rows=6, tokens=2 * shards.MIN_SHARD_TOKENS - 1) == 1  # too few tokens
    assert shards.shard_count("auto", rows=1, tokens=500) == 1
    # auto shards fp32 models only (bf16 and int8's bf16 float parts measured no gain); a count shards any dtype
    assert shards.shard_count("auto", rows=6, tokens=5000, dtype=torch.bfloat16) == 1
    assert shards.shard_count(2, rows=6, tokens=5000, dtype=torch.bfloat16) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert shards.shard_count("auto", rows=6, tokens=5000) == 1  # one thread: nothing to share
    assert shards.shard_count(4, rows=6, tokens=10) == 4 and shards.shard_count(4, rows=3, tokens=10) == 3
    assert shards.shard_count("off", rows=6, tokens=5000) == 1


def test_auto_leaves_bf16_pipelines_unsharded(folders, monkeypatch):
    """The auto rule by dtype reaches the pipeline: a bf16 model's batch runs whole, an fp32 one's sharded."""
    monkeypatch.setattr(shards, "MIN_SHARD_TOKENS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for dtype, want in ((torch.float32, 2), (torch.bfloat16, 1)):
        pipe = hfport.pipeline("feature-extraction", model=folders["bert", "base"], dtype=dtype)
        calls = _record_calls(pipe.model)
        pipe(TEXTS)
        assert len(calls) == want, (dtype, calls)


# --- the real MiniLM: fp32 and int8 ------------------------------------------------------------------------------


def test_minilm_fp32_and_int8(minilm_path):
    texts = [" ".join(["word"] * n) + f" number {n}" for n in (120, 7, 64, 33, 90, 12, 48, 5)]
    pipes = {("float32", s): hfport.pipeline("sentence-embedding", model=minilm_path, dtype="float32", row_shards=s)
             for s in ("off", 2)}
    # int8 loaded once (its gate, which judges MiniLM on hundreds of rows, is this test's dearest step), then run
    # unsharded and in 2 row shards: the same int8 model a second load from the folder gives
    pipes["int8", "off"] = hfport.pipeline("sentence-embedding", model=minilm_path, dtype="int8", row_shards="off")
    pipes["int8", 2] = hfport.pipeline("sentence-embedding", model=pipes["int8", "off"].model, tokenizer=minilm_path,
                                       row_shards=2)
    out = {key: torch.tensor(pipe(texts)) for key, pipe in pipes.items()}
    diff = (out["float32", 2] - out["float32", "off"]).abs().max().item()
    print(f"MiniLM fp32 sharded vs not: max |diff| {diff:.2e}")
    assert diff <= TOL
    # int8's per-tensor activation scale spans the rows that share a call: a shard's scale is its own rows', so int8
    # outputs move with the sharding (within int8's error); both stay at the quality bar against fp32
    base = out["float32", "off"]
    cos = {s: F.cosine_similarity(out["int8", s], base).min().item() for s in ("off", 2)}
    between = F.cosine_similarity(out["int8", 2], out["int8", "off"]).min().item()
    print(f"MiniLM int8 min cosine vs fp32: {cos}; sharded vs unsharded int8: {between:.5f}")
    assert min(cos.values()) >= MINILM_MIN_COSINE and between >= MINILM_MIN_COSINE, (cos, between)

