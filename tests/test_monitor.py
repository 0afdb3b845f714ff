"""The training monitor: the adaptive ETA (evaluations counted), resource sampling (with and without psutil, GPU
fields absent without CUDA), metrics.jsonl read tolerantly and exported as CSV, background checkpoints (CPU
snapshots, the wait-for-the-one-in-flight rule, a SIGKILL mid-write never becomes `latest`), verbosity from
HFPORT_VERBOSITY with rank prefixes, and report.html's charts rendered in headless Chromium (axes, one panel per
metric family, a corrupt line named, 100k points downsampled, no metrics at all)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import hfport.settings
from hfport import verbosity
from hfport.errors import SettingsError
from hfport.rundir import RunDir, RunSummary
from hfport.train.checkpoint import CheckpointWriter, _cpu_copy
from hfport.train.monitor import (Pace, ResourceSampler, evals_left, fmt_resources, gpu_stats,
                                  metrics_csv, read_metrics)
from hfport.train.report import render_report
from tests.finetuning import model_lines, sentiment_run
from tests.forked import run_cli, start_cli

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("HFPORT_TEST_ARTIFACTS", "")) if os.environ.get("HFPORT_TEST_ARTIFACTS") else None


# --- ETA and throughput ---------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_eta_adapts_and_counts_evaluations():
    clock = FakeClock()
    pace = Pace(alpha=0.5, clock=clock)
    assert pace.report(10, 1) == {} and pace.eta(10, 1) is None  # nothing measured yet
    for _ in range(5):
        clock.t += 1.0
        pace.step(tokens=100, examples=4)
    assert pace.eta(10, 0) == pytest.approx(10.0)
    started = clock.t
    clock.t += 6.0  # an evaluation
    pace.eval_done(clock.t - started)
    clock.t += 1.0
    pace.step(tokens=100, examples=4)  # the eval's 6 s are not step time
    assert pace.step_s.value == pytest.approx(1.0)
    assert pace.eta(10, 2) == pytest.approx(10 * 1.0 + 2 * 6.0)
    for _ in range(8):  # the machine gets twice as fast: the EMA follows
        clock.t += 0.5
        pace.step(tokens=100, examples=4)
    assert pace.step_s.value < 0.51
    report = pace.report(4, 0)
    assert report["steps_per_s"] == pytest.approx(1 / pace.step_s.value, rel=1e-3)
    assert report["tokens_per_s"] == pytest.approx(100 / pace.step_s.value, rel=1e-3)
    assert report["eval_s"] == pytest.approx(6.0)


@pytest.mark.parametrize("step,total,strategy,every,per_epoch,expected", [
    (0, 10, "steps", 5, 0, 2), (5, 10, "steps", 5, 0, 1), (0, 12, "steps", 5, 0, 3),  # 5, 10 and the final at 12
    (10, 10, "steps", 5, 0, 0), (0, 9, "epoch", 0, 3, 3), (4, 9, "epoch", 0, 3, 2), (0, 10, "no", 0, 5, 1)])
def test_evals_left(step, total, strategy, every, per_epoch, expected):
    assert evals_left(step, total, strategy=strategy, every=every, steps_per_epoch=per_epoch,
                      has_eval=True) == expected
    assert evals_left(step, total, strategy=strategy, every=every, steps_per_epoch=per_epoch, has_eval=False) == 0


# --- resources ------------------------------------------------------------------------------------------------


def test_resource_sampler_runs_off_the_loop_and_omits_absent_gpus():
    with ResourceSampler(interval=0.05, gpu=lambda: {}) as sampler:
        deadline = time.time() + 10
        while "cpu_percent" not in sampler.latest and time.time() < deadline:
            time.sleep(0.01)
        sample = sampler.latest
        thread = sampler._thread
    assert {"cpu_percent", "rss_gb", "mem_used_gb", "mem_total_gb"} <= set(sample), sample
    assert 0 < sample["rss_gb"] < sample["mem_total_gb"]
    assert not any(k.startswith("gpu") for k in sample)
    # this sampler's own thread: the server's health route keeps a process-wide one running (server/routes/health.py),
    # so "no thread of that name alive" failed whenever a server test ran earlier in the same process
    assert thread is not None and not thread.is_alive()
    if not torch.cuda.is_available():
        assert gpu_stats() == {}  # no CUDA: no GPU fields, and no error


def test_resource_sampler_without_psutil(monkeypatch):
    import hfport.train.monitor as monitor

    monkeypatch.setattr(monitor, "psutil", None)  # as if `import psutil` had raised ImportError
    sampler = ResourceSampler(gpu=lambda: {})
    assert sampler._proc is None
    sum(i * i for i in range(200_000))  # some CPU time between the two readings
    sample = sampler.sample()
    assert sample["rss_gb"] > 0 and sample["mem_total_gb"] > sample["mem_used_gb"] > 0, sample
    assert sample["cpu_percent"] >= 0


def test_a_failing_gpu_probe_never_stops_the_sampler():
    def broken() -> dict[str, float]:
        raise RuntimeError("NVML went away")

    with ResourceSampler(interval=0.02, gpu=broken) as sampler:
        time.sleep(0.2)
        assert sampler._thread is not None and sampler._thread.is_alive()


def test_progress_line_resources():
    assert fmt_resources({"rss_gb": 1.23, "mem_total_gb": 23.5}) == "RSS 1.2/23.5 GB"
    line = fmt_resources({"rss_gb": 1.2, "mem_total_gb": 23.5, "gpu0_mem_used_gb": 2.1, "gpu0_mem_total_gb": 80.0})
    assert line == "RSS 1.2/23.5 GB  VRAM 2.1/80 GB (3%)"
    assert fmt_resources({}) == ""


# --- metrics.jsonl read back, CSV ------------------------------------------------------------------------------


def test_corrupt_lines_are_skipped_and_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "train", "step": 1, "loss": 0.7}\n{"type": "tra\n\n[1, 2]\n'
                    '{"type": "eval", "step": 2, "eval_accuracy": 0.5}\n')
    entries, problems = read_metrics(path)
    assert [e["step"] for e in entries] == [1, 2]
    assert len(problems) == 2 and problems[0].startswith("metrics.jsonl:2: not JSON") and "metrics.jsonl:4:" in problems[1]
    assert read_metrics(tmp_path / "missing.jsonl") == ([], [])


def test_metrics_csv_keeps_every_point():
    entries = [{"type": "train", "step": i, "epoch": i / 10, "loss": 1 / (i + 1)} for i in range(100_000)]
    entries.append({"type": "eval", "step": 100_000, "epoch": 1.0, "eval_f1": 0.9, "eval_report": {"x": 1}})
    rows = metrics_csv(entries).splitlines()
    assert rows[0] == "type,step,epoch,eval_f1,loss" and len(rows) == 100_002
    assert rows[-1] == "eval,100000,1.0,0.9,"


# --- background checkpoints -------------------------------------------------------------------------------------


def test_snapshot_copies_are_independent_of_the_live_tensors():
    live = {"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1}]}
    snap = _cpu_copy(live)
    live["state"][0]["exp_avg"].add_(1)  # the next optimizer step, in place
    live["param_groups"][0]["lr"] = 0.2
    assert torch.equal(snap["state"][0]["exp_avg"], torch.ones(3)) and snap["param_groups"][0]["lr"] == 0.1


def test_a_save_due_while_one_is_in_flight_waits_for_it():
    writer, order, release = CheckpointWriter(), [], threading.Event()

    def slow() -> None:
        release.wait(5)
        order.append("first")

    writer.submit(slow)
    assert writer.busy
    threading.Timer(0.2, release.set).start()
    writer.submit(lambda: order.append("second"))  # blocks until `slow` finished
    assert order[0] == "first"  # submit returned only after the first save completed
    writer.wait()
    assert order == ["first", "second"] and not writer.busy


def test_a_failed_background_save_is_raised_by_wait():
    writer = CheckpointWriter()

    def broken() -> None:
        raise OSError("disk full")

    writer.submit(broken)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # raised once, then clear
    writer.submit(broken)
    writer.close()  # the way out after another error: logs, does not raise


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, minilm_path) -> Path:
    return sentiment_run(tmp_path_factory.mktemp("monitor"), minilm_path, 96, 24)


def _cli(root: Path, out: Path, *extra: str, env: dict[str, str] | None = None):
    """`hfport finetune` on ROOT's run into OUT, started in its own process (tests/forked.py: the CLI as `python -m
    hfport` runs it; with a fault to inject, HFPORT_TESTS_FAULT, through tests/faults.py, which installs it). Its
    stderr goes to OUT's sibling `<name>.stderr` (`_stderr`)."""
    args = ["finetune", "-q", "--model", str(root / "model"), "--train", str(root / "train.jsonl"), "--eval",
            str(root / "eval.jsonl"), "--batch-size", "8", "--max-steps", "6", "--save-steps", "2", "--eval-steps",
            "3", "--set", "eval_strategy=steps", "--set", "logging_steps=1", "--lr", "3e-3", "--seed", "7",
            "--output-dir", str(out), *extra]
    return start_cli(*args, env={**os.environ, **(env or {})}, cwd=Path(__file__).resolve().parents[1],
                     stdout=os.devnull, stderr=_stderr(out))


def _stderr(out: Path) -> Path:
    return out.with_name(f"{out.name}.stderr")


def _ended(child) -> int | None:
    """CHILD's exit status once it ended (None: still running after 300 s)."""
    child.join(300)
    return child.exitcode


def _model_lines(out: Path) -> list[str]:
    return model_lines((out / "metrics.jsonl").read_text())


def test_sigkill_during_a_background_write_never_becomes_latest(tiny_run, tmp_path):
    from safetensors.torch import load_file

    ref = _cli(tiny_run, tmp_path / "ref")
    assert _ended(ref) == 0, _stderr(tmp_path / "ref").read_text()
    out = tmp_path / "killed"
    # the writer stalls half-way through step 4's checkpoint (weights written, optimizer not yet)
    child = _cli(tiny_run, out, env={"HFPORT_TESTS_FAULT": "after-weights:4:stall=120"})
    deadline = time.time() + 300
    while time.time() < deadline and child.is_alive():
        if any((p / "model.safetensors").exists() for p in (out / "checkpoints").glob(".tmp-step-4-*")):
            break
        time.sleep(0.02)
    assert child.is_alive(), "the run ended before the stalled checkpoint: " + _stderr(out).read_text()
    # training went on while the writer slept: step 5 or 6 can be logged before the kill
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    run = RunDir(out)
    assert run.latest_checkpoint() == run.checkpoint(2), "a half-written checkpoint became latest"
    assert not run.checkpoint(4).exists()
    again = _cli(tiny_run, out, "--resume", "latest")
    assert _ended(again) == 0, _stderr(out).read_text()
    assert _model_lines(out) == _model_lines(tmp_path / "ref")
    a, b = load_file(str(out / "final" / "model.safetensors")), load_file(str(tmp_path / "ref" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((out / "checkpoints").glob(".tmp-*")), "the half-written folder was left behind"
    perf = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines() if '"perf"' in x]
    assert [p["step"] for p in perf] == [1, 2, 3, 4, 5, 6]
    assert all({"eta_s", "steps_per_s", "tokens_per_s", "rss_gb"} <= set(p) for p in perf), perf[-1]
    assert perf[-1]["eta_s"] == 0 and "eval_s" in perf[-1]


# --- verbosity ----------------------------------------------------------------------------------------------------


def test_verbosity_env_flags_win_and_rank_prefix(monkeypatch, capsys):
    monkeypatch.setenv("HFPORT_VERBOSITY", "debug")  # the settings are read once a process: reset() reads again
    assert verbosity.resolve() == "debug"
    assert verbosity.resolve(quiet=True) == "quiet" and verbosity.resolve(verbose=1) == "verbose"
    monkeypatch.setenv("HFPORT_VERBOSITY", "loud")
    hfport.settings.reset()
    with pytest.raises(SettingsError, match="HFPORT_VERBOSITY='loud': input should be 'quiet', 'normal'"):
        verbosity.resolve()
    monkeypatch.setenv("HFPORT_VERBOSITY", "trace")
    hfport.settings.reset()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    try:
        verbosity.configure(verbosity.resolve())
        logging.getLogger("hfport.train").log(verbosity.TRACE, "step 3")
        logging.getLogger("hfport.train").debug("detail")
        err = capsys.readouterr().err
        assert "[rank 1] TRACE hfport.train: step 3" in err and "[rank 1] DEBUG hfport.train: detail" in err
        monkeypatch.setenv("WORLD_SIZE", "1")
        verbosity.configure("quiet")
        logging.getLogger("hfport.train").warning("hidden")
        assert "hidden" not in capsys.readouterr().err
    finally:
        logging.basicConfig(force=True, handlers=[logging.NullHandler()])
        verbosity._configured = None  # as before configure(): later tests call finetune from Python
        logging.getLogger("hfport").setLevel(logging.NOTSET)


def test_cli_reads_hfport_verbosity(tiny_run, tmp_path):
    """HFPORT_VERBOSITY=verbose reaches `hfport finetune` (no flag given): INFO records; -q still wins."""
    env = {**os.environ, "HFPORT_VERBOSITY": "verbose"}
    args = ["finetune", "--model", str(tiny_run / "model"), "--train", str(tiny_run / "train.jsonl"), "--max-steps",
            "2", "--save-steps", "2", "--batch-size", "8"]
    loud = run_cli(*args, "--output-dir", str(tmp_path / "a"), env=env, timeout=300)  # tests/forked.py
    quiet = run_cli(*args, "--output-dir", str(tmp_path / "b"), "-q", env=env, timeout=300)
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    assert "INFO hfport.train: checkpoint step 2" in loud.stderr, loud.stderr
    assert "INFO" not in quiet.stderr and "WARNING" not in quiet.stderr, quiet.stderr


# --- report.html in headless Chromium ------------------------------------------------------------------------------


def _summary() -> RunSummary:
    return RunSummary(steps=10, epochs=1, best_metric={"accuracy": 0.9}, best_step=10, stopped_early=False,
                      metric_mode="max", frozen=0, train_examples=100, eval_examples=20, labels=None,
                      problem_type=None, config={"lr": 3e-5})


def _entries(n: int) -> list[dict]:
    out: list[dict] = []
    for s in range(1, n + 1):
        out.append({"type": "train", "step": s, "epoch": s / n, "loss": 2.0 / s ** 0.5, "lr": 3e-5 * (1 - s / n),
                    "grad_norm": 1.0 + (s % 7) / 7})
        if s % max(1, n // 5) == 0:
            out.append({"type": "eval", "step": s, "epoch": s / n, "eval_loss": 1.0 / s ** 0.3,
                        "eval_accuracy": 0.5 + 0.4 * s / n, "eval_f1_macro": 0.4 + 0.4 * s / n,
                        "eval_precision_macro": 0.45 + 0.3 * s / n, "eval_recall_macro": 0.42 + 0.35 * s / n})
            out.append({"type": "perf", "step": s, "epoch": s / n, "eta_s": 3.0 * (n - s), "steps_per_s": 3.1,
                        "tokens_per_s": 1234.0, "rss_gb": 1.2, "mem_total_gb": 23.5, "cpu_percent": 95.0})
    return out


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


def _open(browser, html_text: str, tmp_path: Path):
    path = tmp_path / "report.html"
    path.write_text(html_text)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors, requests = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_selector("#charts .hc-panel, #charts .hc-empty")
    return page, errors, requests


def test_report_panels_axes_and_hover(browser, tmp_path):
    entries = _entries(200)
    page, errors, requests = _open(browser, render_report(entries, _summary(), ["metrics.jsonl:7: not JSON"]), tmp_path)
    panels = page.eval_on_selector_all("#charts .hc-panel", "els => els.map(e => e.dataset.panel)")
    assert panels[:3] == ["loss", "lr", "grad_norm"], panels
    for family in ("accuracy", "f1", "precision", "recall"):  # each eval family readable on its own axes
        assert f"eval:{family}" in panels, panels
    assert {"tokens", "memory"} <= set(panels), panels
    ticks = page.eval_on_selector_all("[data-panel='eval:accuracy'] .hc-tick", "els => els.map(e => e.textContent)")
    assert "0.6" in ticks and "0.8" in ticks, ticks  # real values on the y axis
    labels = page.eval_on_selector_all("[data-panel='loss'] path.hc-line", "els => els.map(e => e.dataset.label)")
    assert labels == ["train loss", "eval loss"], labels
    page.click("[data-panel='loss'] input.hc-log")  # log scale: decade ticks
    ticks = page.eval_on_selector_all("[data-panel='loss'] .hc-tick", "els => els.map(e => e.textContent)")
    assert "1" in ticks and "0.2" in ticks, ticks
    hover = page.locator("[data-panel='eval:f1'] rect.hc-hover")
    hover.scroll_into_view_if_needed()
    box = hover.bounding_box()
    hover.hover(position={"x": box["width"] * 0.995, "y": box["height"] / 2})
    tip = page.inner_text("[data-panel='eval:f1'] .hc-tip")
    assert "step 200" in tip and "f1_macro: 0.8" in tip, tip
    assert "metrics.jsonl:7: not JSON" in page.inner_text("body")
    assert not errors, errors
    assert all(u.startswith("file:") for u in requests), requests  # self-contained: no network
    if ARTIFACTS:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    page.close()


def test_report_with_100k_points_draws_a_downsampled_line(browser, tmp_path):
    entries = [{"type": "train", "step": s, "epoch": 1.0, "loss": 1 / s, "lr": 1e-5, "grad_norm": 1.0}
               for s in range(1, 100_001)]
    page, errors, _ = _open(browser, render_report(entries, _summary()), tmp_path)
    drawn = page.eval_on_selector("[data-panel='loss'] path.hc-line",
                                  "e => [e.getAttribute('d').split(/[ML]/).length - 1, +e.dataset.points]")
    assert drawn[1] == 100_000 and 50 <= drawn[0] <= 2000, drawn  # every point kept, a pixel's worth drawn
    assert not errors, errors
    page.close()


def test_report_without_metrics(browser, tmp_path):
    page, errors, _ = _open(browser, render_report([], _summary()), tmp_path)
    assert "no metrics yet" in page.inner_text("#charts")
    assert not errors, errors
    page.close()
