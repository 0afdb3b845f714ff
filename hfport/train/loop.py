"""`finetune(config)`: the training loop on accelerate, meant to be read top to bottom.

Per optimizer step: zero_grad(set_to_none) -> [forward -> loss -> backward] x grad_accum -> unscale + clip by
global norm (the norm is logged) -> optimizer step -> scheduler step. Evaluation every epoch or every N steps;
checkpoints every N steps and at epoch ends; `resume` continues bit-exactly on CPU.

Data order is a pure function of (seed, epoch) and the examples' lengths, the position inside the epoch is
checkpointed, and RNG states are restored just before training continues; that is what makes a resumed run
identical to an unbroken one. Every process builds the same global batches and trains on its stride of each
(`batch[rank::world]`), so all take the same number of steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .. import lora, verbosity
from ..errors import ConfigError
from ..tasks import get as task_record
from ..rundir import TRAINER_STATE, RunDir, RunSummary
from ..tokenizer import copy_tokenizer_files
from .checkpoint import (CheckpointWriter, load_checkpoint, prune, restore_rng, rewind, snapshot,
                         write_checkpoint)
from .config import FinetuneConfig
from .data import EncodedData, epoch_batches, eval_batches, planned_steps
from .monitor import PERF, Pace, ResourceSampler, evals_left, fmt_duration, fmt_resources, read_metrics
from .optim import PlateauWithWarmup, build_optimizer, build_scheduler, freeze
from .preflight import as_config, preflight

log = logging.getLogger("hfport.train")


def finetune(config: FinetuneConfig | dict[str, Any], *, progress: bool = True,
             on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train, evaluate and save. Returns the run summary as a dict (RunSummary.to_dict(); also summary.json)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin, gather_object, set_seed

    from .metrics import EarlyStopping, MetricHistory

    config = as_config(config)
    if verbosity.apply_env() == "quiet":  # HFPORT_VERBOSITY, for a finetune called from Python or a job process
        progress = False
    run = RunDir(Path(config.output_dir))
    # accelerate keeps one precision and compile setting per process; a process that ran an earlier fine-tune
    # (tests, a job worker) would otherwise refuse another precision and silently keep the old compile choice
    AcceleratorState._reset_state()
    # compile=True: accelerate compiles last in prepare (after any DDP wrapper), the order torch recommends;
    # dynamic shapes, since every batch has its own length. Left alone, accelerate's launch config decides.
    dynamo = TorchDynamoPlugin(backend="inductor", dynamic=True) if config.compile else None
    # cpu=True on a machine without CUDA lets `accelerate launch --multi_gpu --num_processes N` run N CPU
    # processes over gloo (accelerate only picks MULTI_CPU when told the run is on the CPU)
    accelerator = Accelerator(mixed_precision=mixed_precision(config.precision), cpu=not torch.cuda.is_available(),
                              dynamo_plugin=dynamo)
    main = accelerator.is_main_process
    rank, world = accelerator.process_index, accelerator.num_processes
    emit = on_event if (on_event and main) else (lambda event: None)

    # 1. data and model: every data error surfaces here, before the output folder is touched (the server runs the
    # same checks before it queues a job)
    set_seed(config.seed)
    checked = preflight(config, world=world)
    source, task, data = checked.source, checked.task, checked.data
    if main:
        prepare_output_dir(run, config)
    accelerator.wait_for_everyone()
    model_cls = task_record(config.task).model_class  # the task record's model class
    label_kwargs = {}
    if data.space is not None:
        label_kwargs = {"id2label": data.space.id2label}
        if data.space.problem_type:
            label_kwargs["problem_type"] = data.space.problem_type
    model = model_cls.from_pretrained(source, ignore_mismatched_sizes=True, **label_kwargs)
    frozen = freeze(model, config.freeze)
    if config.lora is not None:  # base frozen, LoRA layers and the head trained; best/ and final/ hold the adapter
        lora.apply_lora(model, config.lora.r, config.lora.alpha, config.lora.dropout, config.lora.target_modules,
                        use_rslora=config.lora.use_rslora, base=lora_base(config.model, source))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    metric_name, metric_mode = config.default_metric(_problem(data))  # e.g. regression: mse, not accuracy
    class_weights = _class_weights(config, data)

    # 2. the epochs' batches and the optimisation
    lengths = [len(x.input_ids) for x in data.train]

    def batches_of(epoch: int) -> list[list[int]]:
        return epoch_batches(lengths, config.batch_size, config.seed, epoch, group_by_length=config.group_by_length,
                             max_tokens=config.max_batch_tokens, world=world, grad_accum=config.grad_accum)

    def steps_in(epoch: int) -> int:
        return math.ceil(len(batches_of(epoch)) / config.grad_accum)

    # without a token budget every epoch has the same number of batches; with one, each is counted
    n_steps_epoch = steps_in(0)
    total_steps = config.max_steps or planned_steps(
        config.epochs, steps_in if config.max_batch_tokens else (lambda epoch: n_steps_epoch))
    model.to(accelerator.device)  # before the optimizer: a fused AdamW is chosen by where the parameters live
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, total_steps, metric_mode)
    model, optimizer = accelerator.prepare(model, optimizer)
    # the bare model (no DDP, no torch.compile wrapper): its names are the checkpoint's, without `_orig_mod.`
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    scaler = accelerator.scaler

    # 3. state, fresh or resumed
    # the best model and early stopping share one tracker; without a patience it never says stop
    tracker = EarlyStopping(metric_name, metric_mode, patience=config.early_stopping_patience or 2**31,
                            threshold=config.early_stopping_threshold)
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "history": [], "examples_seen": 0,
                             "tracker": tracker.state_dict()}
    if config.resume:
        ckpt = run.latest_checkpoint() if config.resume == "latest" else Path(config.resume)
        if ckpt is None or not (ckpt / TRAINER_STATE).is_file():
            raise ConfigError(f"resume: no checkpoint found ({config.resume!r} in {run.checkpoints})")
        state = load_checkpoint(ckpt, unwrapped, optimizer, scheduler, scaler)
        tracker.load_state_dict(state["tracker"])
        log.info("resuming from %s (step %d)", ckpt, state["step"])
        if main and (dropped := rewind(run, ckpt)):
            log.warning("resumed from step %d: the newer checkpoints %s are dropped (the run continues from here)",
                        state["step"], ", ".join(f"step-{s}" for s in dropped))
    metrics_file = MetricsLog(run.metrics, keep_through_step=state["step"] if config.resume else None,
                              enabled=main)
    if config.resume:
        restore_rng(state.pop("rng"), state.pop("rng_tensors"))  # last: nothing may draw after this but training

    batches = batches_of(state["epoch"])  # the loop renews it each epoch; log_event reads its length

    def log_event(kind: str, values: dict[str, Any]) -> None:
        entry = {"type": kind, "step": state["step"], "epoch": round(state["epoch"] + state["batch_in_epoch"]
                                                                     / max(1, len(batches)), 4), **values}
        metrics_file.write(entry)
        emit(entry)

    def evaluate() -> dict[str, float]:
        """Loss weighted by example count, then the task metrics; model.eval() + inference_mode, then back."""
        model.eval()
        mine = eval_batches(list(range(rank, len(data.eval), world)), [len(x.input_ids) for x in data.eval],
                            config.batch_size, config.max_batch_tokens, config.group_by_length)
        rows: list[tuple[int, float, Any]] = []  # (example index, its batch's mean loss, task row)
        start = 0  # examples before this batch: the batch's corruption seed, as before batches were sorted
        with torch.inference_mode():
            for idx in mine:
                items = [data.eval[i] for i in idx]
                batch = to_device(task.collate(items, data, seed=config.seed + start), accelerator.device)
                start += len(idx)
                with accelerator.autocast():
                    outputs = float32_outputs(task.forward(model, batch, data))
                loss = task.loss(outputs, batch, data, None, 0.0).item()
                rows += [(i, loss, row) for i, row in zip(idx, task.eval_rows(outputs, batch, items, data))]
        # every process's rows, concatenated (accelerate's gather_object flattens one level), back in file order
        everything = sorted(gather_object(rows) if world > 1 else rows, key=lambda r: r[0])
        model.train()
        mean_loss = sum(r[1] for r in everything) / len(everything)
        return {"loss": mean_loss, **task.metrics([r[2] for r in everything], data, unwrapped.config.id2label)}

    writer = CheckpointWriter()  # saves run in the background; the rule for overlaps is in its docstring

    def checkpoint() -> None:
        """Snapshot to the CPU now (the next step mutates the live tensors), write and prune on the writer."""
        if main:
            snap = snapshot(state["step"], unwrapped, optimizer, scheduler, scaler, state)
            protect = {tracker.best_step} if tracker.best_step is not None else set()
            writer.submit(lambda: (write_checkpoint(run, snap), prune(run, config.save_total_limit, protect)))
            log.info("checkpoint step %d: snapshot taken, writing in the background", state["step"])
        accelerator.wait_for_everyone()

    def timed_evaluate() -> dict[str, float]:
        started = time.perf_counter()
        metrics = evaluate()
        pace.eval_done(time.perf_counter() - started)  # the ETA counts the evaluations still to come
        return metrics

    def after_eval(metrics: dict[str, float]) -> bool:
        """Record, keep the best model, step plateau schedules; True when early stopping says stop."""
        value = metrics.get(metric_name)
        if value is None:
            raise ConfigError(f"metric {metric_name!r} is not computed for this task; available: {sorted(metrics)}")
        state["history"].append([state["step"], value])
        log_event("eval", {f"eval_{k}": v for k, v in metrics.items()})
        if tracker.update(value, state["step"]) and main:
            save_model_folder(unwrapped, source, run.best, task, data)
        state["tracker"] = tracker.state_dict()
        if isinstance(scheduler, PlateauWithWarmup):
            scheduler.on_eval(value)
        history = MetricHistory([tuple(p) for p in state["history"]])
        converged = bool(config.converged_window and history.converged(config.converged_window,
                                                                       config.converged_tolerance))
        return tracker.should_stop or converged

    # 4. the loop (sampler and writer are joined on every way out: no save is ever left in flight)
    bar = Progress(total_steps, state["step"], enabled=progress and main)
    stop = False
    pace, sampler = Pace(), ResourceSampler().start() if main else None
    heap = HeapPolicy().keep_large_blocks()  # per-step big tensors reuse memory; restored on every way out

    def remaining_evals() -> int:
        return evals_left(state["step"], total_steps, strategy=config.eval_strategy, every=config.eval_steps or 0,
                          steps_per_epoch=n_steps_epoch, has_eval=bool(data.eval))

    try:
        while state["step"] < total_steps and not stop:
            batches = batches_of(state["epoch"])
            while state["batch_in_epoch"] < len(batches) and state["step"] < total_steps and not stop:
                group = batches[state["batch_in_epoch"]:state["batch_in_epoch"] + config.grad_accum]
                optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), device=accelerator.device)
                step_tokens = 0
                for k, global_idx in enumerate(group):
                    mine = global_idx[rank::world]  # this process's share of the global batch
                    # the seed names the micro-batch (and rank), so masking repeats exactly after a resume
                    seed = ((config.seed * 1_000_003 + state["step"]) * 1009 + k) * 1009 + rank
                    batch = to_device(task.collate([data.train[i] for i in mine], data, seed), accelerator.device)
                    sync = k == len(group) - 1
                    with (accelerator.no_sync(model) if not sync and world > 1 else contextlib.nullcontext()):
                        with accelerator.autocast():
                            outputs = float32_outputs(task.forward(model, batch, data))
                        loss = task.loss(outputs, batch, data, class_weights, config.label_smoothing)  # fp32
                        accelerator.backward(loss / len(group))
                    step_loss += loss.detach().float() / len(group)
                    step_tokens += int(batch["attention_mask"].sum()) * world
                    state["examples_seen"] += len(global_idx)
                params = [p for p in model.parameters() if p.requires_grad]
                grad_norm = clip_grad_norm(accelerator, params, config.max_grad_norm or float("inf"))
                optimizer.step()
                scheduler.step()
                step_loss = accelerator.reduce(step_loss, "mean").item()  # the global batch's loss, every process
                state["step"] += 1
                state["batch_in_epoch"] += len(group)
                lr = scheduler.get_last_lr()[-1]
                pace.step(step_tokens, sum(len(g) for g in group))
                perf = {**pace.report(total_steps - state["step"], remaining_evals()),
                        **(sampler.latest if sampler else {})}
                if state["step"] % config.logging_steps == 0 or state["step"] == 1:
                    log_event("train", {"loss": round(step_loss, 6), "lr": lr, "grad_norm": float(grad_norm)})
                    # speed, ETA and memory on a line of their own: train/eval lines stay identical across resumes
                    log_event(PERF, {**perf, "checkpoint_wait_s": round(writer.waited_s, 3)})
                if log.isEnabledFor(verbosity.TRACE):  # float(grad_norm) waits for a GPU: only when it is shown
                    log.log(verbosity.TRACE, "step %d loss %.6f lr %.3e grad_norm %.4f", state["step"], step_loss, lr,
                            float(grad_norm))
                bar.update(1, loss=step_loss, lr=lr, perf=perf)
                epoch_done = state["batch_in_epoch"] >= len(batches)
                if epoch_done:
                    state["epoch"], state["batch_in_epoch"] = state["epoch"] + 1, 0
                due_eval = data.eval and ((config.eval_strategy == "steps" and state["step"] % config.eval_steps == 0)
                                          or (config.eval_strategy == "epoch" and epoch_done))
                if due_eval:
                    stop = after_eval(timed_evaluate())
                due_save = config.save_strategy != "no" and (
                    (config.save_steps and state["step"] % config.save_steps == 0)
                    or (config.save_strategy == "epoch" and epoch_done))
                if due_save:
                    checkpoint()
                if epoch_done:
                    break  # the next epoch has its own order (the position was reset to 0, so `while` alone would not)
        bar.close()

        # 5. the end: final eval if the last step had none; no save in flight; final/ and best/, summary, report
        if data.eval and (not state["history"] or state["history"][-1][0] != state["step"]):
            after_eval(timed_evaluate())
        writer.wait()  # re-raises a failed background save
    finally:
        heap.restore()
        bar.close()
        if sampler is not None:
            sampler.stop()
        writer.close()  # on an error too: the save in flight completes (it is a consistent snapshot) before we leave
    summary: dict[str, Any] = {}
    if main:
        save_model_folder(unwrapped, source, run.final, task, data)
        if not run.best.exists():
            save_model_folder(unwrapped, source, run.final, task, data, copy_to=run.best)
        entries, problems = read_metrics(run.metrics)
        last_eval = [e for e in entries if e["type"] == "eval"]
        result = RunSummary(
            steps=state["step"], epochs=state["epoch"], best_metric={metric_name: tracker.best},
            best_step=tracker.best_step, stopped_early=stop, metric_mode=metric_mode, frozen=len(frozen),
            train_examples=len(data.train), eval_examples=len(data.eval),
            labels=unwrapped.config.id2label if data.space else None, problem_type=_problem(data),
            config=config.model_dump(),
            final_eval={k: v for k, v in last_eval[-1].items() if k.startswith("eval_")} if last_eval else None)
        result.write(run.summary_path)
        summary = result.to_dict()
        from .report import write_report

        write_report(run, entries, result, problems)
        emit({"type": "done", **summary})
    accelerator.wait_for_everyone()
    return summary


# --- helpers, in the order the loop uses them ---------------------------------------------------------------


def mixed_precision(choice: str) -> str:
    """accelerate's mixed_precision for the run. auto: bf16 where the GPU supports it, fp16 (with loss scaling) on
    older GPUs; on the CPU bf16 autocast where bf16 is native (a measured matmul speed-up, hardware.py), else fp32.
    Weights and optimizer state stay fp32 either way; autocast covers the forward pass only."""
    if torch.cuda.is_available():
        if choice == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[choice]
    if choice == "fp16":
        # accelerate would quietly run fp32: no CPU autocast to fp16 and no loss scaler there
        raise ConfigError("precision: 'fp16' needs a CUDA GPU; on the CPU use 'bf16', 'fp32' or 'auto'")
    if choice == "fp32":
        return "no"
    from ..hardware import cpu_capabilities

    cpu = cpu_capabilities()
    if choice == "auto":
        return "bf16" if cpu.bf16_native else "no"
    if not cpu.bf16_native:
        log.warning("precision: 'bf16' on a CPU without native bf16: its matmul measured %.2fx fp32's speed here "
                    "(%.0f vs %.0f GFLOP/s), so this run will be slower than fp32; 'auto' picks fp32 on this CPU",
                    cpu.bf16_speedup, cpu.peaks["bfloat16"], cpu.peaks["float32"])
    return "bf16"


def float32_outputs(outputs: Any) -> Any:
    """The model's outputs with every floating tensor in fp32, so the loss is computed in fp32 whatever autocast
    produced (a no-op for fp32 outputs: .float() returns the same tensor). A task's forward may return a bare tensor
    (sentence embeddings)."""
    if torch.is_tensor(outputs):
        return outputs.float() if outputs.is_floating_point() else outputs
    return dataclasses.replace(outputs, **{f.name: v.float() for f in dataclasses.fields(outputs)
                                           if torch.is_tensor(v := getattr(outputs, f.name)) and v.is_floating_point()})


def prepare_output_dir(run: RunDir, config: FinetuneConfig) -> None:
    """Refuse to overwrite an earlier run unless asked to (--overwrite) or continuing it (--resume)."""
    existing = run.existing()
    if existing and not config.resume:
        if not config.overwrite:
            raise ConfigError(f"{run.root}: already holds a run ({', '.join(existing)}); pass --overwrite to "
                              "replace it or --resume to continue it")
        run.clear()
    run.root.mkdir(parents=True, exist_ok=True)


def _problem(data: EncodedData) -> str | None:
    return data.space.problem_type if data.space else data.problem_type


def _class_weights(config: FinetuneConfig, data: EncodedData) -> torch.Tensor | None:
    if config.class_weights is None or data.space is None:
        return None
    n = len(data.space.id2label)
    if config.class_weights == "balanced":  # n_examples / (n_classes * count), as sklearn defines it
        counts = torch.zeros(n)
        for x in data.train:
            counts[x.target] += 1
        return len(data.train) / (n * counts.clamp(min=1))
    if len(config.class_weights) != n:
        raise ConfigError(f"class_weights has {len(config.class_weights)} values for {n} labels "
                          f"({list(data.space.id2label.values())})")
    return torch.tensor(config.class_weights, dtype=torch.float)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def clip_grad_norm(accelerator: Any, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """accelerate's clip_grad_norm_ (unscale, global norm, scale by min(1, max_norm / (norm + 1e-6))), without the
    scaling pass when that factor is exactly 1.0: multiplying by 1.0 changes no bit, and skipping it saves a read and a
    write of every gradient (~90 MB for MiniLM) on each step whose norm is under the limit. torch's own arithmetic
    decides, so the gradients are identical either way. FSDP, DeepSpeed and XLA keep accelerate's own path."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return accelerator.clip_grad_norm_(params, max_norm)
    accelerator.unscale_gradients()  # fp16 loss scaling; a no-op otherwise
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])  # () fp32
    coef = (max_norm / (total + 1e-6)).item()  # torch's clip_coef: clamped to 1.0, the multiply is a no-op
    if not coef >= 1.0:  # a NaN norm scales too, as torch does (every gradient becomes NaN)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class HeapPolicy:
    """glibc serves every allocation above 32 MiB with a fresh mmap and unmaps it on free, so a tensor that size made
    on every step pays page faults on every step. The word-embedding gradient is one (vocab x hidden fp32: 47 MB for
    MiniLM, 94 MB for BERT-base; autograd builds it dense each backward), and so are a long batch's attention scores.
    Measured for MiniLM on 16 short sentences (one thread, a shared 2-core EPYC): 12.6k page faults a backward before,
    none after; backward 0.45 -> 0.41 s. While a loop runs, the heap serves blocks up to 1 GiB and keeps freed ones
    for the next step; when the last loop of the process ends, restore() sets glibc's steady state (mmap threshold
    32 MiB, trim threshold 64 MiB: where its dynamic thresholds settle in any process that has freed a block that
    size) and returns the kept memory to the system. Only the allocator's bookkeeping changes: no value does.
    Elsewhere than glibc (macOS, musl) it does nothing."""

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    KEEP, STEADY_MMAP, STEADY_TRIM = 1 << 30, 32 << 20, 64 << 20
    _lock, _holders = threading.Lock(), 0  # the setting is the process's: fine-tunes in threads share it

    def __init__(self) -> None:
        self.libc, self.held = None, False
        import platform

        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            import ctypes

            libc = ctypes.CDLL(None)  # the process's own C library
            if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
                self.libc = libc

    def keep_large_blocks(self) -> HeapPolicy:
        if self.libc is not None and not self.held:
            with HeapPolicy._lock:
                if HeapPolicy._holders == 0:
                    self.libc.mallopt(self.M_MMAP_THRESHOLD, self.KEEP)
                    self.libc.mallopt(self.M_TRIM_THRESHOLD, self.KEEP)
                HeapPolicy._holders += 1
                self.held = True
        return self

    def restore(self) -> None:
        """Undo this holder's keep_large_blocks (a second call does nothing); the last holder restores glibc."""
        if not self.held:
            return
        with HeapPolicy._lock:
            HeapPolicy._holders -= 1
            self.held = False
            if HeapPolicy._holders == 0:
                self.libc.mallopt(self.M_MMAP_THRESHOLD, self.STEADY_MMAP)
                self.libc.mallopt(self.M_TRIM_THRESHOLD, self.STEADY_TRIM)
                self.libc.malloc_trim(0)




class MetricsLog:
    """metrics.jsonl: one JSON line per logged step and per eval. On resume, lines past the checkpoint's step
    are dropped first so the file ends exactly as an unbroken run's would."""

    def __init__(self, path: Path, keep_through_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and keep_through_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= keep_through_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, entry: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def read(self) -> list[dict[str, Any]]:
        entries, problems = read_metrics(self.path)
        for problem in problems:
            log.warning("%s", problem)
        return entries


def _step_of(line: str) -> int:
    """A metrics.jsonl line's step; a line that cannot be read (cut off by a kill) counts as past every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62


def save_model_folder(model: Any, source: Path, target: Path, task: Any, data: EncodedData,
                      copy_to: Path | None = None) -> None:
    """An HF model folder (weights + config) with the source's tokenizer files beside it, and the task's own files
    (a sentence-transformers layout, say)."""
    if copy_to is not None:
        import shutil

        if copy_to.exists():
            shutil.rmtree(copy_to)
        shutil.copytree(target, copy_to)
        return
    if lora.has_lora(model):  # the adapter in PEFT's format (+ config.json with the labels)
        lora.save_adapter(model, target)
    else:
        model.save_pretrained(target)
    copy_tokenizer_files(source, target)
    task.write_model_files(target, data)


def lora_base(model: str, source: Path) -> str:
    """base_model_name_or_path: a local folder as an absolute path (the adapter is read from anywhere), a repo id
    as given."""
    return str(source.resolve()) if Path(model).expanduser().exists() else model


class Progress:
    """A tqdm bar: loss, lr, then the adaptive ETA (Pace's, evaluations included: tqdm's own assumes every step
    costs the average), throughput and memory. Silent when disabled."""

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="fine-tune", unit="step", dynamic_ncols=True,
                            bar_format=self.FORMAT)

    def update(self, n: int, loss: float, lr: float, perf: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self.line(loss, lr, perf), refresh=False)
            self.bar.update(n)

    @staticmethod
    def line(loss: float, lr: float, perf: dict[str, Any]) -> str:
        """`ETA 2:13, 3.10 step/s, 12,345 tok/s, loss=0.3817, lr=2.00e-05, RSS 1.2/23.5 GB  VRAM 2.1/80 GB (3%)`
        (tqdm puts it after the elapsed time, behind a comma)."""
        parts = [f"ETA {fmt_duration(perf['eta_s'])}", f"{perf['steps_per_s']:.2f} step/s",
                 f"{perf['tokens_per_s']:,.0f} tok/s"] if "eta_s" in perf else []
        parts += [f"loss={loss:.4f}", f"lr={lr:.2e}"]
        resources = fmt_resources(perf)
        return ", ".join(parts + ([resources] if resources else []))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
