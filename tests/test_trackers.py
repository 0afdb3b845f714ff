"""report_to: the trackers hold what metrics.jsonl holds, read back with each tracker's own reader (TensorBoard's
EventAccumulator, MLflow's MlflowClient over the run's SQLite store, wandb's offline run files), and the config;
the option's names and errors are transformers'."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from hfport.errors import ConfigError
from hfport.train import trackers
from hfport.train.config import FinetuneConfig, resolve_config
from hfport.train.loop import finetune
from tests.finetuning import sentiment_run


@pytest.fixture(scope="module")
def data(tmp_path_factory, minilm_path) -> Path:
    return sentiment_run(tmp_path_factory.mktemp("trackers"), minilm_path, 48, 16)


def run(data: Path, out: Path, report_to: list[str], **extra) -> list[dict]:
    """A 6-step run (eval every 3) reporting to `report_to`; its metrics.jsonl lines."""
    values = dict(model=str(data / "model"), train=str(data / "train.jsonl"), eval=str(data / "eval.jsonl"),
                  output_dir=str(out), batch_size=8, max_steps=6, logging_steps=2, eval_strategy="steps",
                  eval_steps=3, save_strategy="no", precision="fp32", report_to=report_to)
    finetune(FinetuneConfig(**{**values, **extra}), progress=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def expected(lines: list[dict], kind: str, key: str) -> list[tuple[int, float]]:
    return [(e["step"], float(e[key])) for e in lines if e["type"] == kind]


def same(logged: list[tuple[int, float]], wanted: list[tuple[int, float]], rel: float = 1e-6) -> None:
    """The same steps, and values equal up to float32 rounding (TensorBoard stores float32)."""
    assert [s for s, _ in logged] == [s for s, _ in wanted]
    assert [v for _, v in logged] == pytest.approx([v for _, v in wanted], rel=rel)


def test_tensorboard_and_mlflow_hold_the_metrics_and_config(data, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    lines = run(data, out, ["tensorboard", "mlflow"], run_name="tiny")
    losses, evals = expected(lines, "train", "loss"), expected(lines, "eval", "eval_accuracy")
    assert len(losses) == 4 and len(evals) == 2  # steps 1, 2, 4, 6; evals at 3 and 6

    acc = EventAccumulator(str(out / "runs" / "tiny")).Reload()  # tensorboard's own reader
    tb = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    same(tb["train/loss"], losses)
    same(tb["eval/accuracy"], evals)
    same(tb["train/lr"], expected(lines, "train", "lr"))
    assert "perf/tokens_per_s" in tb

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")  # the run folder's store
    experiment = client.get_experiment_by_name("hfport")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "tiny"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    same([(m.step, m.value) for m in history], losses, rel=1e-12)
    same([(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval/accuracy")], evals, rel=1e-12)
    params = found.data.params
    assert params["batch_size"] == "8" and params["max_steps"] == "6" and params["report_to"] == \
        '["tensorboard", "mlflow"]'


def test_resumed_and_overwritten_runs_replace_the_events_they_repeat(data, tmp_path):
    """TensorBoard shows what metrics.jsonl holds after a resume (the events past the checkpoint hidden, not
    doubled) and after --overwrite with other settings (the earlier run's events hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def tensorboard(out: Path) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in EventAccumulator(str(out / "runs" / "run")).Reload().Scalars("train/loss")]

    out = tmp_path / "run"
    run(data, out, ["tensorboard"], logging_steps=1, save_strategy="steps", save_steps=2)  # keeps step-4, step-6
    lines = run(data, out, ["tensorboard"], logging_steps=1, save_strategy="steps", save_steps=2,
                resume=str(out / "checkpoints" / "step-4"))
    same(tensorboard(out), expected(lines, "train", "loss"))  # steps 1..6 once each
    lines = run(data, out, ["tensorboard"], logging_steps=1, max_steps=3, lr=1e-2, overwrite=True)
    same(tensorboard(out), expected(lines, "train", "loss"))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_run_is_written_under_the_run_folder(data, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    lines = run(data, out, ["wandb"])
    (run_dir,) = (out / "wandb").glob("offline-run-*")  # offline: nothing leaves the machine
    (records,) = run_dir.glob("*.wandb")
    from wandb.proto import wandb_internal_pb2

    logged = []
    for raw in wandb_records(records):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "train/loss" in row:
                logged.append((row["_step"], row["train/loss"]))
    same(logged, expected(lines, "train", "loss"), rel=1e-12)


def wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a run's .wandb file: wandb's header (":W&B", magic, version; 7 bytes), then LevelDB's
    log format, which wandb's own Go reader reads: 32 KiB blocks of (crc32 4, length 2, type 1, payload) chunks,
    a record in one FULL chunk or FIRST, MIDDLE..., LAST; a block's tail under 7 bytes is padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, out = 7, [], []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            out.append(b"".join(parts))
            parts = []
    return out


def test_report_to_names_as_transformers_accepts_them():
    base = dict(model="m", train="t.jsonl")
    assert FinetuneConfig(**base).report_to == []
    assert FinetuneConfig(**base, report_to="none").report_to == []
    assert FinetuneConfig(**base, report_to="tensorboard, mlflow").report_to == ["tensorboard", "mlflow"]
    assert FinetuneConfig(**base, report_to="all").report_to == [n for n in trackers.TRACKERS if trackers.installed(n)]
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) \['comet'\].*tensorboard"):
        resolve_config({**base, "report_to": ["comet"]}, {})


def test_a_missing_tracker_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(trackers, "installed", lambda name: name != "mlflow")
    with pytest.raises(ConfigError, match=r"report_to \['mlflow'\]: not installed; pip install 'hfport\[trackers\]'"):
        resolve_config({"model": "m", "train": "t.jsonl", "report_to": "tensorboard,mlflow"}, {})
