"""Devices as a first-class choice, checked on the CPU: what `device=` accepts (auto, cpu, cuda, cuda:N) and what it
refuses, `auto` resolving to the CPU on a machine without CUDA (and to cuda:0 where CUDA is reported), the bf16
default of dtype="auto" on a CUDA device with bf16, and every place that takes or reports a device: from_pretrained,
pipeline(), the CLI's --device and `hfport info`, the server's HFPORT_DEVICE with /health, TEI's /info and the model
cache placing every served model, adapters included, on it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import hfport
from hfport import hardware
from hfport.cli import app
from tests.tiny import save_random_adapter

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA resolves")


def _fake_cuda(monkeypatch, count: int) -> None:
    """torch.cuda reporting `count` devices (only the resolution logic reads it; nothing is allocated there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@NO_CUDA
def test_auto_is_the_cpu_without_cuda():
    assert hardware.resolve_device("auto") == torch.device("cpu")
    assert hardware.resolve_device(" AUTO ") == torch.device("cpu")
    assert hardware.resolve_device("cpu") == torch.device("cpu")
    assert hardware.resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert hardware.device_name("auto") == "cpu"


def test_auto_is_the_first_cuda_device_where_there_is_one(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert hardware.resolve_device("auto") == torch.device("cuda", 0)
    assert hardware.resolve_device("cuda") == torch.device("cuda", 0)  # an index, so reports name it
    assert hardware.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2': this process sees CUDA devices 0\.\.1"):
        hardware.resolve_device("cuda:2")


@pytest.mark.parametrize("bad, fragment", [("gpu", "is not one of auto, cpu, cuda, cuda:N"),
                                           ("mps", "hfport runs on auto, cpu, cuda, cuda:N"),
                                           ("meta", "hfport runs on auto, cpu, cuda, cuda:N")])
def test_bad_device_names_the_choices(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        hardware.resolve_device(bad)


def test_cuda_without_a_gpu_is_an_error_naming_the_choices(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"'cuda': this process sees no CUDA device .*auto, cpu, cuda, cuda:N"):
        hardware.resolve_device("cuda")


def test_auto_dtype_is_bf16_on_a_cuda_device_with_bf16(monkeypatch):
    """An fp32 checkpoint served on a GPU with bf16 runs in bf16 (HFPORT_PREDICT_DTYPE's default, auto); a GPU
    without it keeps fp32, and a checkpoint stored in another dtype keeps it."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert hardware.auto_dtype(torch.float32, torch.device("cuda", 0)) == torch.bfloat16
    assert hardware.auto_dtype(torch.float16, torch.device("cuda", 0)) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert hardware.auto_dtype(torch.float32, torch.device("cuda", 0)) == torch.float32


@NO_CUDA
def test_from_pretrained_and_pipeline_take_device(tiny_bert):
    model = hfport.AutoModel.from_pretrained(tiny_bert, device="auto")
    assert model.device == torch.device("cpu")
    with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N"):
        hfport.AutoModel.from_pretrained(tiny_bert, device="cuda")
    pipe = hfport.pipeline("feature-extraction", model=tiny_bert, device="auto")
    assert pipe.model.device == torch.device("cpu")
    again = hfport.pipeline("feature-extraction", model=model, tokenizer=tiny_bert, device="auto")
    assert again.model.device == torch.device("cpu")
    with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N"):
        hfport.pipeline("feature-extraction", model=model, tokenizer=tiny_bert, device="gpu")


@NO_CUDA
def test_cli_device_and_info(tiny_bert):
    runner = CliRunner()
    out = runner.invoke(app, ["info", str(tiny_bert), "--device", "auto", "--json"])
    assert out.exit_code == 0, out.output
    facts = json.loads(out.output)
    assert facts["device"] == "cpu" and facts["dtype"] == "float32"
    out = runner.invoke(app, ["info", str(tiny_bert), "--dtype", "bfloat16"])
    assert out.exit_code == 0 and "device" in out.output and "bfloat16" in out.output, out.output
    out = runner.invoke(app, ["predict", str(tiny_bert), "hello", "-t", "feature-extraction", "--device", "auto"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["predict", str(tiny_bert), "hello", "-t", "feature-extraction", "--device", "gpu"])
    assert out.exit_code == 1 and "auto, cpu, cuda, cuda:N" in out.output


def test_server_device_setting_is_checked(tmp_path, monkeypatch):
    from hfport.errors import SettingsError
    from server.settings import Settings

    _fake_cuda(monkeypatch, 0)
    assert Settings(data_dir=tmp_path).device == "auto"  # a GPU box serves on its GPU without being told
    monkeypatch.setenv("HFPORT_DEVICE", "cpu")
    assert Settings(data_dir=tmp_path).device == "cpu"
    with pytest.raises(SettingsError, match="device='cuda:1': .*no CUDA device"):
        Settings(data_dir=tmp_path, device="cuda:1")


@NO_CUDA
def test_served_models_and_adapters_run_on_the_device(tiny_bert, tmp_path, monkeypatch):
    """The model cache loads every leader with HFPORT_DEVICE and HFPORT_PREDICT_DTYPE; an adapter joins its base's
    leader, on the same device; /health and TEI's /info name the device and dtype."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.serving import cache as cache_module
    from server.settings import Settings

    adapter = tmp_path / "adapter"
    head = hfport.AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=2)
    save_random_adapter(head, adapter, base=tiny_bert, seed=1, r=2, alpha=4, targets=["q", "v"])
    calls = []
    real = cache_module.pipeline
    monkeypatch.setattr(cache_module, "pipeline", lambda *a, **k: calls.append(k) or real(*a, **k))
    app = create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[tiny_bert.parent, tmp_path],
                              batch_token_budgets=[64], device="auto", predict_dtype="bfloat16"), run_worker=False)
    with TestClient(app) as c:
        assert c.post("/models", json={"name": "base", "path": str(tiny_bert),
                                       "task": "text-classification"}).status_code == 201
        r = c.post("/models", json={"name": "tuned", "path": str(adapter), "base": "base"})
        assert r.status_code == 201, r.text
        assert c.post("/predict", json={"model": "tuned", "inputs": ["a short text"]}).status_code == 200
        health = c.get("/health").json()
        assert health["device"] == "cpu" and health["dtype"] == "bfloat16"
        info = c.get("/info", headers={"x-model": "tuned"}).json()
        assert info["model_device"] == "cpu" and info["model_dtype"] == "bfloat16"
        pipes = app.state.model_service.cache
        served = [pipes.get(record) for record in pipes.records()]
    assert calls and all(k["device"] == "auto" and k["dtype"] == "bfloat16" for k in calls)
    assert {p.model.device for p in served} == {torch.device("cpu")}
    assert {p.model.dtype for p in served} == {torch.bfloat16}
