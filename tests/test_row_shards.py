"""Row shards (hfport/nn/shards.py): an inference call on a padded batch run as contiguous row groups on worker
threads with one intra-op thread each. Sharded outputs against the same model unsharded (families, heads, pairs,
multiple choice, the real MiniLM in fp32 and int8), every output field merged in row order, the calls that must
never shard (training, gradients, labels, a shard's own forward, modes, a mixed-adapter replay), the workers' thread
counts leaving the process's as they were, and HFPORT_ROW_SHARDS."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hfport
from hfport.errors import ConfigError
from hfport.int8 import quantize
from hfport.nn import shards
from hfport.nn.int8 import InputPeaks, body_linears
from hfport.nn.lora import replaying
from tests.parity import AUTO_CLASSES, MINILM_MIN_COSINE
from tests.tiny import batch, save_hf

LENGTHS = (70, 41, 9, 30, 12, 50)  # mixed lengths, padded to 70; one row over 64 tokens
# fp32: the same weights and rows give the same values, but a matmul's blocking depends on its M (here the shard's
# real token count, not the batch's), so sums may round differently: 1e-5 as every parity test (measured 0 to ~1e-6)
TOL = 1e-5


def _load(family: str, task: str, folder) -> hfport.PreTrainedEncoder:
    save_hf(family, task, folder)
    return getattr(hfport, AUTO_CLASSES[task]).from_pretrained(folder).eval()


def _record_calls(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(thread name, rows) of every call of `model` (the merged call itself is not one: shards are)."""
    calls: list[tuple[str, int]] = []

    def record(module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        calls.append((threading.current_thread().name, ids.shape[0]))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return calls


def _fields(out: Any) -> dict[str, torch.Tensor]:
    return {k: out[k] for k in out.keys()}


def _sharded_and_not(model, inputs, monkeypatch, shards_env: str = "3") -> tuple[Any, Any, list]:
    calls = _record_calls(model)
    with torch.inference_mode():
        monkeypatch.setenv(shards.ENV, "off")
        ref = model(**inputs)
        assert len(calls) == 1
        monkeypatch.setenv(shards.ENV, shards_env)
        got = model(**inputs)
    return ref, got, calls[1:]


def _assert_same(ref, got) -> float:
    assert type(got) is type(ref) and got.keys() == ref.keys()
    worst = 0.0
    for name, want in _fields(ref).items():
        have = got[name]
        assert have.shape == want.shape and have.dtype == want.dtype, name
        worst = max(worst, (have - want).abs().max().item())
    assert worst <= TOL, worst
    return worst


# --- outputs: sharded == unsharded -------------------------------------------------------------------------------


@pytest.mark.parametrize("family,task", [
    ("bert", "base"), ("bert", "token-classification"), ("bert", "sequence-classification"),
    ("bert", "question-answering"), ("bert", "masked-lm"), ("roberta", "sequence-classification"),
    ("distilbert", "token-classification"), ("modernbert", "base"), ("deberta-v2", "sequence-classification"),
])
def test_sharded_equals_unsharded(family, task, tmp_path, monkeypatch):
    model = _load(family, task, tmp_path)
    inputs = batch(family, lengths=LENGTHS, pairs=True)  # token types (pairs) where the family has them
    ref, got, calls = _sharded_and_not(model, inputs, monkeypatch)
    # three shards of contiguous rows balanced by real tokens (70 | 41+9+30 | 12+50 of 212: test_split_rows), on
    # the workers (which worker takes which, in which order, is theirs to race for)
    assert sorted(rows for _, rows in calls) == [1, 2, 3], calls
    assert all(name.startswith("hfport-shard-") for name, _ in calls), calls
    _assert_same(ref, got)
    assert got.keys() == ref.keys()  # e.g. BERT's pooler_output merged beside last_hidden_state


def test_multiple_choice_splits_questions(tmp_path, monkeypatch):
    model = _load("bert", "multiple-choice", tmp_path)
    inputs = {k: v.view(3, 2, v.shape[-1]) for k, v in batch("bert", lengths=LENGTHS).items()}  # (B=3, C=2, T)
    ref, got, calls = _sharded_and_not(model, inputs, monkeypatch, "2")
    assert sorted(rows for _, rows in calls) == [1, 2], calls  # questions (70+41 | 9+30, 12+50): whole questions
    assert got.logits.shape == (3, 2)
    _assert_same(ref, got)


def test_logits_follow_row_order_and_ranges_balance(tmp_path, monkeypatch):
    """Each row's logits are its own (as a one-row call gives them), whatever shard it ran in."""
    model = _load("bert", "token-classification", tmp_path)
    inputs = batch("bert", lengths=LENGTHS)
    monkeypatch.setenv(shards.ENV, "4")
    with torch.no_grad():
        got = model(**inputs).logits  # (B, T, L)
        for row in range(len(LENGTHS)):
            alone = model(**{k: v[row:row + 1] for k, v in inputs.items()}).logits  # (1, T, L)
            assert (got[row] - alone[0]).abs().max().item() <= TOL, row


def test_split_rows():
    assert shards.split_rows(list(LENGTHS), 2) == [(0, 2), (2, 6)]  # 111 | 101
    assert shards.split_rows(list(LENGTHS), 3) == [(0, 1), (1, 4), (4, 6)]  # 70 | 80 | 62 (of 212)
    assert shards.split_rows([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]  # every part gets a row
    assert shards.split_rows([1, 1, 1, 1, 1, 1, 1, 1], 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="3 rows into 4"):
        shards.split_rows([1, 2, 3], 4)


@dataclass
class _Out:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    loss: torch.Tensor | None = None


def test_merge_fields_tuples_and_refusals():
    parts = [_Out(torch.full((n, 2), float(i)), tuple(torch.full((n, 3, 4), float(i + 10 * k)) for k in range(3)))
             for i, n in enumerate((2, 1, 3))]
    merged = shards.merge(parts, [2, 1, 3])
    assert isinstance(merged, _Out) and merged.loss is None
    assert merged.logits[:, 0].tolist() == [0, 0, 1, 2, 2, 2]
    assert isinstance(merged.hidden_states, tuple) and len(merged.hidden_states) == 3
    for k, layer in enumerate(merged.hidden_states):
        assert layer.shape == (6, 3, 4) and layer[:, 0, 0].tolist() == [10 * k, 10 * k, 1 + 10 * k] + [2 + 10 * k] * 3
    # a field that is not batch-first would be merged wrong: refused, naming it
    bad = [_Out(torch.zeros(n, 2), loss=torch.tensor(1.0)) for n in (2, 1)]
    with pytest.raises(RuntimeError, match=r"output\.loss is not batch-first"):
        shards.merge(bad, [2, 1])
    with pytest.raises(RuntimeError, match="is not batch-first"):
        shards.merge([torch.zeros(2, 2), torch.zeros(2, 2)], [2, 1])


# --- calls that never shard --------------------------------------------------------------------------------------


def test_training_gradients_and_labels_never_shard(tmp_path, monkeypatch):
    model = _load("bert", "sequence-classification", tmp_path)
    inputs = batch("bert", lengths=LENGTHS)
    calls = _record_calls(model)
    monkeypatch.setenv(shards.ENV, "3")
    model.train()
    with torch.no_grad():
        model(**inputs)  # training mode (dropout draws over the whole batch)
    model.eval()
    out = model(**inputs)  # gradients on: a graph over the worker threads' ops is not what a caller expects
    assert out.logits.requires_grad
    with torch.no_grad():
        out = model(**inputs, labels=torch.tensor([0, 1, 2, 0, 1, 2]))  # a loss over the whole batch
    assert out.loss is not None
    assert calls == [("MainThread", 6)] * 3, calls
    with torch.no_grad():
        model(**inputs)  # and the same call in eval, no_grad, no labels does shard
    assert sorted(rows for _, rows in calls[3:]) == [1, 2, 3]


def test_no_shard_inside_a_worker_nor_under_a_mode_or_replay(tmp_path, monkeypatch):
    model = _load("bert", "base", tmp_path)
    inputs = batch("bert", lengths=LENGTHS)
    calls = _record_calls(model)
    monkeypatch.setenv(shards.ENV, "2")
    pool = shards.pool()
    pool.ensure(2)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs).last_hidden_state

    # both workers busy with a call each: a call that sharded there would wait on the pool it occupies (a deadlock;
    # the timeout turns it into a failure)
    futures = [pool.submit(call) for _ in range(2)]
    outs = [f.result(timeout=120) for f in futures]
    assert [rows for _, rows in calls] == [6, 6] and all(n.startswith("hfport-shard-") for n, _ in calls), calls
    assert torch.equal(outs[0], outs[1])
    calls.clear()
    with torch.no_grad():
        with torch.device("cpu"):  # a torch function mode: per thread, it would not follow the rows
            model(**inputs)
        hidden = model(**inputs).last_hidden_state
        with replaying(inputs["input_ids"], (hidden, None)):  # a mixed-adapter batch's head on this thread
            model(**inputs)
    assert [rows for _, rows in calls[:1]] == [6] and sorted(r for _, r in calls[1:3]) == [2, 4], calls
    assert [rows for _, rows in calls[3:]] == [6], calls


def test_modes_follow_into_the_workers(tmp_path, monkeypatch):
    """inference_mode and no_grad, and CPU autocast, are per thread: the shards run in the caller's."""
    model = _load("bert", "base", tmp_path)
    inputs = batch("bert", lengths=LENGTHS)
    monkeypatch.setenv(shards.ENV, "2")
    with torch.inference_mode():
        assert model(**inputs).last_hidden_state.is_inference()
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
        assert not out.is_inference() and not out.requires_grad
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = model(**inputs).last_hidden_state
            monkeypatch.setenv(shards.ENV, "off")
            ref = model(**inputs).last_hidden_state
    assert cast.dtype == ref.dtype
    assert (cast.float() - ref.float()).abs().max().item() < 0.05  # bf16 rounding only


def test_concurrent_callers_share_the_pool(tmp_path, monkeypatch):
    """Several threads (the server's predict threads) each shard into the same workers and get their own rows."""
    model = _load("bert", "token-classification", tmp_path)
    monkeypatch.setenv(shards.ENV, "2")
    batches = [batch("bert", seed=s, lengths=LENGTHS[s:] + LENGTHS[:s]) for s in range(4)]
    with torch.no_grad():
        want = [model(**b).logits for b in batches]
    got: dict[int, torch.Tensor] = {}

    def caller(i: int) -> None:
        with torch.no_grad():
            for _ in range(2):
                got[i] = model(**batches[i]).logits

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert sorted(got) == [0, 1, 2, 3]
    for i in range(4):
        assert torch.equal(got[i], want[i]), i


def test_calibration_hooks_see_every_shard(tmp_path, monkeypatch):
    """int8's calibration (InputPeaks: forward pre-hooks keeping a running max per Linear) runs sharded when the
    gate calls the model: hooks on several worker threads at once must not lose a shard's peak."""
    model = _load("bert", "base", tmp_path)
    batches = [batch("bert", seed=s, lengths=LENGTHS) for s in range(8)]
    peaks = {}
    for env in ("off", "4"):
        monkeypatch.setenv(shards.ENV, env)
        with InputPeaks(body_linears(model.body.encoder)) as recorder, torch.no_grad():
            for b in batches:
                model(**b)
        peaks[env] = recorder.peaks
    assert peaks["4"].keys() == peaks["off"].keys() and len(peaks["off"]) > 0
    for name, want in peaks["off"].items():
        assert (peaks["4"][name] - want).abs().max().item() <= TOL, name


# --- thread counts -----------------------------------------------------------------------------------------------


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


# --- the switch --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("", "auto"), (" OFF ", "off"), ("3", 3), ("1", 1)])
def test_switch_values(value, want):
    assert shards.parse(value) == want


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "on"])
def test_switch_refuses_bad_values(value, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=rf"HFPORT_ROW_SHARDS='{value}': expected 'auto', 'off' or a shard count"):
        shards.parse(value)
    model = _load("bert", "base", tmp_path)
    monkeypatch.setenv(shards.ENV, value)
    with torch.no_grad(), pytest.raises(ConfigError, match="HFPORT_ROW_SHARDS"):  # named where it is read: a call
        model(**batch("bert", lengths=LENGTHS))


def test_bad_switch_stops_the_import():
    env = {**os.environ, shards.ENV: "many"}
    done = subprocess.run([sys.executable, "-c", "import hfport"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "ConfigError: HFPORT_ROW_SHARDS='many'" in done.stderr, done.stderr[-2000:]


def test_shard_counts(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv(shards.ENV, "auto")
    assert shards.shard_count(rows=6, tokens=212) == 2  # the intra-op threads
    assert shards.shard_count(rows=6, tokens=2 * shards.MIN_SHARD_TOKENS - 1) == 1  # too few tokens to be worth it
    assert shards.shard_count(rows=1, tokens=500) == 1
    # auto shards fp32 models only (bf16 and int8's bf16 float parts measured no gain); a count shards any dtype
    assert shards.shard_count(rows=6, tokens=5000, dtype=torch.bfloat16) == 1
    monkeypatch.setenv(shards.ENV, "2")
    assert shards.shard_count(rows=6, tokens=5000, dtype=torch.bfloat16) == 2
    monkeypatch.setenv(shards.ENV, "auto")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert shards.shard_count(rows=6, tokens=5000) == 1  # one thread: nothing to share
    monkeypatch.setenv(shards.ENV, "4")
    assert shards.shard_count(rows=6, tokens=10) == 4 and shards.shard_count(rows=3, tokens=10) == 3
    monkeypatch.setenv(shards.ENV, "off")
    assert shards.shard_count(rows=6, tokens=5000) == 1


# --- the real MiniLM: fp32 and int8 ------------------------------------------------------------------------------


def _minilm_batch(n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 129, (n,), generator=g)  # (B,)
    t = int(lens.max())
    mask = (torch.arange(t)[None] < lens[:, None]).long()  # (B, T)
    ids = torch.randint(1000, 30000, (n, t), generator=g) * mask
    ids[:, 0] = 101  # [CLS]
    return {"input_ids": ids, "attention_mask": mask}


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask[..., None].to(hidden.dtype)  # (B, T, 1)
    return ((hidden * m).sum(1) / m.sum(1)).float()  # (B, C)


def test_minilm_fp32_and_int8(minilm_path, monkeypatch):
    fp32 = hfport.AutoModel.from_pretrained(minilm_path).eval()
    inputs = _minilm_batch()
    ref, got, calls = _sharded_and_not(fp32, inputs, monkeypatch, "2")
    assert len(calls) == 2
    print(f"MiniLM fp32 sharded vs not: max |diff| {_assert_same(ref, got):.2e}")
    q = copy.deepcopy(fp32)
    quantize(q, minilm_path)
    q.eval()
    # int8's per-tensor activation scale spans the rows that share a call: a shard's scale is its own rows', so int8
    # outputs move with the sharding (within int8's error); both stay at the quality bar against fp32
    ref8, got8, _ = _sharded_and_not(q, inputs, monkeypatch, "2")
    base = _mean(ref.last_hidden_state, inputs["attention_mask"])
    pooled = {name: _mean(out.last_hidden_state, inputs["attention_mask"]) for name, out in
              (("unsharded", ref8), ("sharded", got8))}
    cos = {name: F.cosine_similarity(p, base).min().item() for name, p in pooled.items()}
    between = F.cosine_similarity(pooled["sharded"], pooled["unsharded"]).min().item()
    print(f"MiniLM int8 min cosine vs fp32: {cos}; sharded vs unsharded int8: {between:.5f}")
    assert min(cos.values()) >= MINILM_MIN_COSINE and between >= MINILM_MIN_COSINE, (cos, between)


def test_auto_leaves_bf16_models_unsharded(tmp_path, monkeypatch):
    """The auto rule by dtype reaches the model call: a bf16 model's call runs whole, its fp32 copy's sharded."""
    model = _load("bert", "base", tmp_path)
    inputs = batch("bert", lengths=LENGTHS)
    monkeypatch.setenv(shards.ENV, "auto")
    monkeypatch.setattr(shards, "MIN_SHARD_TOKENS", 1)
    seen = []
    real = shards.split_rows
    monkeypatch.setattr(shards, "split_rows", lambda w, parts: seen.append(parts) or real(w, parts))
    with torch.inference_mode():
        model(**inputs)
        assert seen == [min(torch.get_num_threads(), len(LENGTHS))] or torch.get_num_threads() < 2
        seen.clear()
        model.to(torch.bfloat16)(**inputs)
    assert seen == []
