"""`finetune(config)`: the training loop on accelerate, meant to be read top to bottom.

finetune() sets a run up (accelerator, checks, model, optimizer and schedule, state fresh or resumed); the Trainer
below runs it. One optimizer step (Trainer.step) is the sequence the annotated training loops teach:

    zero_grad(set_to_none) -> [forward under autocast -> loss (fp32) -> backward] x grad_accum
    -> unscale + clip by the global norm (logged) -> optimizer step (with fp16's loss scaler: the scaler's step, which
    skips the update on inf/nan gradients, and its update) -> scheduler step (only if the optimizer stepped) -> log

After it (Trainer.after_step): evaluation every epoch or every N steps, checkpoints every N steps and at epoch ends.
At the end (Trainer.finish): final/, best/, summary.json, report.html. `resume` continues bit-exactly on CPU.

Data order is a pure function of (seed, epoch) and the examples' lengths, the position inside the epoch is
checkpointed, and RNG states are restored just before training continues; that is what makes a resumed run
identical to an unbroken one. Every process builds the same global batches and trains on its stride of each
(`batch[rank::world]`), so all take the same number of steps; each process's loss is rescaled to its share of the
global batch's mean (Trainer.global_mean), so N processes with batch B train as one process with batch N*B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import TorchDynamoPlugin, gather_object, set_seed
from safetensors.torch import load_file

from .. import lora, verbosity
from ..errors import ConfigError
from ..hardware import HeapPolicy
from ..hub import SAFE_WEIGHTS
from ..rundir import TRAINER_STATE, RunDir, RunSummary
from ..tasks import get as task_record
from .amp import LossScale, clip_grad_norm, float32_outputs, mixed_precision
from .checkpoint import (NUM_PROCESSES, CheckpointWriter, capture_rng, load_checkpoint, prune, restore_rng, rewind,
                         rng_tensors, snapshot, sweep, write_checkpoint)
from .config import FinetuneConfig, resume_changes, resume_record
from .data import EncodedData, epoch_batches, eval_batches, example_lengths, planned_steps
from .distill import keep_layers
from .metrics import EarlyStopping, MetricHistory
from .monitor import PERF, Pace, ResourceSampler, evals_left, read_metrics
from .optim import PlateauWithWarmup, build_optimizer, build_scheduler, freeze
from .preflight import Preflight, as_config, fit_max_length, preflight
from .progress import Progress
from .report import write_report
from .runfiles import (MetricsLog, check_output_dir, lora_base, prepare_output_dir, resume_checkpoint,
                       save_model_folder)
from .trackers import Trackers, accelerator_options

__all__ = ["Trainer", "TrainState", "clip_grad_norm", "finetune", "float32_outputs", "mixed_precision"]

log = logging.getLogger("hfport.train")
COMPANION = "companion."  # a checkpoint's weights of the modules trained beside the model (TrainTask.companion)


def finetune(config: FinetuneConfig | dict[str, Any], *, progress: bool = True,
             on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train, evaluate and save. Returns the run summary as a dict (RunSummary.to_dict(); also summary.json)."""
    config = as_config(config)
    if verbosity.apply_env() == "quiet":  # HFPORT_VERBOSITY, for a finetune called from Python or a job process
        progress = False
    run = RunDir(Path(config.output_dir))
    accelerator = build_accelerator(config)

    # 1. data and model: every data error surfaces here, before the output folder is touched (the server runs the
    # same checks before it queues a job); the folder is made once the trainer is built
    set_seed(config.seed)
    config = fit_max_length(config)  # reads config.json alone: before a resume compares configs
    check_output_dir(run, config)  # an earlier run in the way, or a resume with nothing (or another run) to
    resume = resume_checkpoint(run, config, accelerator.num_processes)  # continue: before any load
    checked = preflight(config, world=accelerator.num_processes)
    checked.task.before_training(checked.data, accelerator.device)  # a teacher's outputs (distillation), once
    model, frozen = build_model(config, checked)

    # 2. the epochs' batches and the optimisation
    plan = EpochPlan(config, example_lengths(checked.data.train), accelerator.num_processes)
    total_steps = plan.total_steps()
    metric_name, metric_mode = config.default_metric(_problem(checked.data))  # e.g. regression: mse, not accuracy
    model.to(accelerator.device)  # before the optimizer: a fused AdamW is chosen by where the parameters live
    optimizer = build_optimizer(model, config)
    companion = checked.task.companion  # trained beside the model at the head's lr (distillation's projection)
    if companion is not None:
        companion.to(accelerator.device)
        optimizer.add_param_group({"params": list(companion.parameters()), "weight_decay": config.weight_decay})
    scheduler = build_scheduler(optimizer, config, total_steps, metric_mode)
    model, optimizer = accelerator.prepare(model, optimizer)
    if companion is not None:
        checked.task.companion = accelerator.prepare(companion)  # DDP synchronises its gradients too

    # 3. state, fresh or resumed; 4. the steps; 5. final/, best/, summary, report
    trainer = Trainer(config, accelerator, run, checked, model, optimizer, scheduler, plan, total_steps,
                      EarlyStopping(metric_name, metric_mode, patience=config.early_stopping_patience or 2**31,
                                    threshold=config.early_stopping_threshold),
                      emit=on_event if (on_event and accelerator.is_main_process) else None)
    if accelerator.is_main_process:  # every setup check passed: only now is the output folder made
        prepare_output_dir(run, config)
    accelerator.wait_for_everyone()
    trainer.start(resume)
    with Trackers(accelerator, config, trainer):  # report_to: the config, and every metrics.jsonl line as it comes
        trainer.train(progress=progress)
        summary = trainer.finish(frozen=len(frozen)) if accelerator.is_main_process else {}
    accelerator.wait_for_everyone()
    return summary


def build_accelerator(config: FinetuneConfig) -> Accelerator:
    """One accelerate Accelerator for the run: its precision, compile setting and devices."""
    # accelerate keeps one precision and compile setting per process; a process that ran an earlier fine-tune
    # (tests, a job worker) would otherwise refuse another precision and silently keep the old compile choice
    AcceleratorState._reset_state()
    # compile=True: accelerate compiles last in prepare (after any DDP wrapper), the order torch recommends;
    # dynamic shapes, since every batch has its own length. Left alone, accelerate's launch config decides.
    dynamo = TorchDynamoPlugin(backend="inductor", dynamic=True) if config.compile else None
    # cpu=True on a machine without CUDA lets `accelerate launch --multi_gpu --num_processes N` run N CPU
    # processes over gloo (accelerate only picks MULTI_CPU when told the run is on the CPU)
    return Accelerator(mixed_precision=mixed_precision(config.precision), cpu=not torch.cuda.is_available(),
                       dynamo_plugin=dynamo, **accelerator_options(config))  # report_to: log_with, its folder


def build_model(config: FinetuneConfig, checked: Preflight) -> tuple[torch.nn.Module, list[str]]:
    """The task's model on the checked source, with the labels the data names, frozen prefixes, LoRA and gradient
    checkpointing as configured; returns it in train mode and the names frozen."""
    data = checked.data
    label_kwargs = {}
    if data.space is not None:
        label_kwargs = {"id2label": data.space.id2label}
        if data.space.problem_type:
            label_kwargs["problem_type"] = data.space.problem_type
    model = task_record(config.task).model_class.from_pretrained(checked.source, ignore_mismatched_sizes=True,
                                                                 **label_kwargs)
    if config.student_layers is not None:  # a student of some of the model's layers (distillation)
        model = keep_layers(model, config.student_layers)
    if lora.has_lora(model) and config.lora is None:
        # an adapter folder (a LoRA run's best/ or final/) loads frozen for inference: train its LoRA layers and head
        # on, as peft's PeftModel.from_pretrained(..., is_trainable=True); best/ and final/ hold the adapter
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("head.") or ".lora_A." in name or ".lora_B." in name)
    frozen = freeze(model, config.freeze)
    if config.lora is not None:  # base frozen, LoRA layers and the head trained; best/ and final/ hold the adapter
        lora.apply_lora(model, config.lora.r, config.lora.alpha, config.lora.dropout, config.lora.target_modules,
                        use_rslora=config.lora.use_rslora, base=lora_base(config.model, checked.source))
    # parameters the task's loss never reads (sentence-embedding's pooler): no gradient, so DDP (which skips
    # parameters that do not require one) does not wait for theirs; saved as loaded
    for name in checked.task.unused_modules(model):
        model.get_submodule(name).requires_grad_(False)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model, frozen


@dataclass
class EpochPlan:
    """Every epoch's global batches (a pure function of the seed, the epoch and the examples' lengths; each
    batch_size x world examples, or up to a token budget) and the optimizer steps they make."""

    config: FinetuneConfig
    lengths: list[int]  # tokens per training example
    world: int

    def batches(self, epoch: int) -> list[list[int]]:
        c = self.config
        return epoch_batches(self.lengths, c.batch_size, c.seed, epoch, group_by_length=c.group_by_length,
                             max_tokens=c.max_batch_tokens, world=self.world, grad_accum=c.grad_accum)

    def steps_in(self, epoch: int) -> int:
        return math.ceil(len(self.batches(epoch)) / self.config.grad_accum)

    @functools.cached_property
    def first_epoch_steps(self) -> int:
        return self.steps_in(0)

    def total_steps(self) -> int:
        """max_steps, else every epoch's steps: without a token budget each epoch has as many as the first; with
        one, each is counted."""
        first = self.first_epoch_steps
        return self.config.max_steps or planned_steps(
            self.config.epochs, self.steps_in if self.config.max_batch_tokens else (lambda epoch: first))


@dataclass
class TrainState:
    """Where the run stands: what trainer_state.json holds (checkpoint.snapshot adds the RNG states)."""

    step: int = 0  # optimizer steps taken; one the loss scaler skipped counts too, as in transformers' Trainer
    epoch: int = 0
    batch_in_epoch: int = 0  # global batches of this epoch's order already trained on
    history: list[list[float]] = field(default_factory=list)  # [step, selection metric] per evaluation
    examples_seen: int = 0
    tracker: dict[str, Any] = field(default_factory=dict)  # EarlyStopping.state_dict()
    skipped_steps: int = 0  # optimizer steps the loss scaler skipped (inf/nan gradients): the schedule stood still

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        """A checkpoint's trainer_state (its RNG states taken out); one written before a field existed gets its
        default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepResult:
    """What one optimizer step reports to the log. The loss and the norm stay on the device: reading them waits
    for the GPU, so only a step that shows them reads them (read: both in one copy)."""

    loss: torch.Tensor  # () fp32, the global batch's mean loss, the same on every process
    grad_norm: torch.Tensor  # () before clipping
    tokens: int  # real tokens in the global batches, every process's
    examples: int

    def read(self) -> tuple[float, float]:
        """(loss, grad norm) as Python floats: one copy from the device, one wait."""
        loss, norm = torch.stack((self.loss.float(), self.grad_norm.float().to(self.loss.device))).tolist()
        return loss, norm


class Trainer:
    """One run's training: the prepared model, optimizer and schedule, the typed state, and the phases that move
    it (start, step, after_step, evaluate, checkpoint, finish). Everything that asks "which task?" goes through the
    task's TrainTask (checked.task): the loop never names a task."""

    def __init__(self, config: FinetuneConfig, accelerator: Accelerator, run: RunDir, checked: Preflight,
                 model: Any, optimizer: Any, scheduler: Any, plan: EpochPlan, total_steps: int,
                 tracker: EarlyStopping, emit: Callable[[dict[str, Any]], None] | None):
        self.config, self.accelerator, self.run = config, accelerator, run
        self.plan, self.total_steps = plan, total_steps
        self.main, self.rank, self.world = (accelerator.is_main_process, accelerator.process_index,
                                            accelerator.num_processes)
        self.source, self.task, self.data = checked.source, checked.task, checked.data
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, accelerator.scaler
        self.loss_scale = LossScale(self.scaler)  # did the scaler skip a step (fp16 only)
        # the bare model (no DDP, no torch.compile wrapper): its names are the checkpoint's, without `_orig_mod.`
        self.unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        self.companion = checked.task.companion  # modules the loss trains beside the model, or None
        self.params = [p for m in (model, self.companion) if m is not None for p in m.parameters()
                       if p.requires_grad]  # what clipping sees
        weights = _class_weights(config, self.data)  # on the device once, not copied there every micro-batch
        self.class_weights = weights.to(accelerator.device) if weights is not None else None
        # the best model and early stopping share one tracker; without a patience it never says stop
        self.tracker, self.metric_name = tracker, tracker.metric
        self.emit = emit or (lambda event: None)
        self.state = TrainState(tracker=tracker.state_dict())
        self.writer = CheckpointWriter()  # saves run in the background; the rule for overlaps is in its docstring
        self.metrics_file: MetricsLog | None = None
        self.batches: list[list[int]] = []  # the current epoch's global batches (log lines read their count)
        self.stop = False  # early stopping or convergence said so
        self.pace, self.sampler, self.bar = Pace(), None, Progress(0, 0, enabled=False)
        self.shown_loss = math.nan  # the loss last read back (logging steps): what the bar shows between them

    # --- 3. state, fresh or resumed ---------------------------------------------------------------------------

    def start(self, ckpt: Path | None) -> None:
        """Load CKPT, the checkpoint `config.resume` continues (resume_checkpoint's, found and checked before
        anything loaded; None: a fresh run): model, optimizer, scheduler, scaler, tracker, state. Open metrics.jsonl
        (cut back to the checkpoint's step on resume), and restore the RNG states last: nothing may draw after this
        but training."""
        saved_rng = None
        if ckpt is not None:
            self.warn_resume_length(ckpt)
            saved = load_checkpoint(ckpt, self.unwrapped, self.optimizer, self.scheduler, self.scaler)
            if self.companion is not None:
                weights = load_file(str(ckpt / SAFE_WEIGHTS))
                self.accelerator.unwrap_model(self.companion).load_state_dict(
                    {k.removeprefix(COMPANION): v for k, v in weights.items() if k.startswith(COMPANION)})
            saved_rng = saved.pop("rng"), saved.pop("rng_tensors")
            self.state = TrainState.from_dict(saved)
            self.tracker.load_state_dict(self.state.tracker)
            log.info("resuming from %s (step %d)", ckpt, self.state.step)
            if self.main and (dropped := rewind(self.run, ckpt)):
                log.warning("resumed from step %d: the newer checkpoints %s are dropped (the run continues from "
                            "here)", self.state.step, ", ".join(f"step-{s}" for s in dropped))
            if self.main and (stale := sweep(self.run)):  # the killed attempt's half-written files, before any save
                log.info("resume: removed %s, left in %s by the interrupted run", ", ".join(stale),
                         self.run.checkpoints)
        self.metrics_file = MetricsLog(self.run.metrics, keep_through_step=self.state.step if self.config.resume
                                       else None, enabled=self.main)
        if self.config.eval_before and self.state.step == 0 and self.data.eval:
            self.evaluate_before()
        if saved_rng is not None:
            restore_rng(*saved_rng)
        self.batches = self.plan.batches(self.state.epoch)

    def warn_resume_length(self, ckpt: Path) -> None:
        """Say what a longer or shorter run changes (resume_checkpoint refused every other change already)."""
        state = json.loads((ckpt / TRAINER_STATE).read_text())
        saved = state.get("run_config")
        if saved is None:
            return
        length = resume_changes(saved, self.config)[1]
        if length:
            log.warning("resume: %s; the schedule now runs over %d steps, and the %d steps taken followed the "
                        "old length's", "; ".join(length), self.total_steps, state["step"])

    # --- 4. the steps ---------------------------------------------------------------------------------------------

    def train(self, progress: bool) -> None:
        """Optimizer steps until total_steps or a stop, then a final evaluation if the last step had none. The bar,
        resource sampler, heap policy and checkpoint writer are released on every way out: no save is ever left in
        flight."""
        self.bar = Progress(self.total_steps, self.state.step, enabled=progress and self.main)
        self.pace, self.sampler = Pace(), ResourceSampler().start() if self.main else None
        heap = HeapPolicy().keep_large_blocks()  # per-step big tensors reuse memory; restored on every way out
        try:
            for group in self.step_groups():
                self.log_step(self.step(group))
                self.after_step()
            self.bar.close()
            if self.data.eval and (not self.state.history or self.state.history[-1][0] != self.state.step):
                self.record_eval(self.timed_evaluate())
            self.writer.wait()  # re-raises a failed background save
        finally:
            heap.restore()
            self.bar.close()
            if self.sampler is not None:
                self.sampler.stop()
            self.writer.close()  # on an error too: the save in flight completes (a consistent snapshot) first

    def step_groups(self) -> Iterator[list[list[int]]]:
        """Each optimizer step's global batches (grad_accum of them), from where the state stands; every epoch's
        order is rebuilt when it begins (after_step resets the position to 0 at an epoch's end)."""
        while self.state.step < self.total_steps and not self.stop:
            epoch = self.state.epoch
            self.batches = self.plan.batches(epoch)
            while (self.state.epoch == epoch and self.state.batch_in_epoch < len(self.batches)
                   and self.state.step < self.total_steps and not self.stop):
                start = self.state.batch_in_epoch
                yield self.batches[start:start + self.config.grad_accum]

    def step(self, group: list[list[int]]) -> StepResult:
        """One optimizer step over `group`: each global batch's stride on this process, forward, loss, backward
        (gradients summed over the group, synchronised across processes on the last), then one update.

        Nothing here waits for a GPU but the loss scaler's skip check (fp16 only): token counts come from the host
        batch, the loss and the gradient norm stay on the device (log_step reads them on logging steps), and
        clipping scales on the device. The model's forward reads its batch's mask back once (nn/layout.py's
        Packed.on_host)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.accelerator.device)
        tokens = 0
        for k, global_idx in enumerate(group):
            batch, real = self.micro_batch(global_idx[self.rank::self.world])  # this process's share, its tokens
            with self.no_sync(last=k == len(group) - 1):
                with self.accelerator.autocast():
                    outputs = float32_outputs(self.task.forward(self.model, batch, self.data))
                loss = self.global_mean(self.task.loss(outputs, batch, self.data, self.class_weights,
                                                       self.config.label_smoothing), batch)  # fp32
                self.accelerator.backward(loss / len(group))  # fp16: the loss scaler scales it first
            step_loss += loss.detach().float() / len(group)
            tokens += real * self.world
            self.state.examples_seen += len(global_idx)
        # unscale (fp16) and clip by the global norm
        grad_norm = clip_grad_norm(self.accelerator, self.params, self.config.max_grad_norm or float("inf"))
        # the update; with a loss scaler, accelerate's step is the scaler's step (no update when a gradient is inf or
        # nan) and then its update (the scale halves after a skip, grows after a run of good steps)
        self.loss_scale.read()
        self.optimizer.step()
        if self.loss_scale.skipped():
            self.state.skipped_steps += 1  # the schedule stands still: it counts the updates the weights received
        else:
            self.scheduler.step()
        loss = self.accelerator.reduce(step_loss, "mean")  # () the global batch's loss, every process
        self.state.step += 1
        self.state.batch_in_epoch += len(group)
        return StepResult(loss, grad_norm, tokens, sum(len(g) for g in group))

    def global_mean(self, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This process's mean loss rescaled so that DDP's average of the processes' gradients is the gradient of
        the mean over the whole global batch: loss * local_count * world / global_count, the counts being the units
        the task's mean is over (examples, tokens, pairs, masked positions; see TrainTask.loss_count), summed
        across processes. One process: the loss as it is (bit-identical to a run without DDP)."""
        if self.world == 1:
            return loss
        count = torch.as_tensor(self.task.loss_count(batch, self.data, self.class_weights),
                                dtype=torch.float32, device=loss.device)  # ()
        total = self.accelerator.reduce(count.clone(), "sum")  # (): one small all-reduce per micro-batch
        # a process whose share has no unit (every token ignored) has a 0/0 mean: it contributes nothing
        loss = torch.where(count > 0, loss, torch.zeros_like(loss))
        return loss * (count * self.world / total.clamp(min=torch.finfo(torch.float32).tiny))

    def micro_batch(self, indices: list[int]) -> tuple[dict[str, torch.Tensor], int]:
        """The collated batch on the device, and its real tokens (counted on the host, before the copy)."""
        # the seed names the step, not the micro-batch or the process: a task that draws at random (fill-mask's
        # masks) draws per example from it and the example's identity, so the draw repeats after a resume and does
        # not depend on how the global batch is split across micro-batches and processes
        seed = self.config.seed * 1_000_003 + self.state.step
        batch = self.task.collate([self.data.train[i] for i in indices], self.data, seed)
        return to_device(batch, self.accelerator.device), int(batch["attention_mask"].sum())

    def no_sync(self, last: bool) -> Any:
        """DDP all-reduces gradients on the group's last backward only."""
        return self.accelerator.no_sync(self.model) if not last and self.world > 1 else contextlib.nullcontext()

    def log_step(self, result: StepResult) -> None:
        """The train line and the perf line every logging_steps (and on step 1), the TRACE line, the bar. The loss
        and the norm are read back (one wait for a GPU) only on a step that shows them; the bar shows the loss
        last read."""
        lr = self.scheduler.get_last_lr()[-1]
        self.pace.step(result.tokens, result.examples)
        perf = {**self.pace.report(self.total_steps - self.state.step, self.remaining_evals()),
                **(self.sampler.latest if self.sampler else {})}
        logging_step = self.state.step % self.config.logging_steps == 0 or self.state.step == 1
        trace = log.isEnabledFor(verbosity.TRACE)
        if logging_step or trace or math.isnan(self.shown_loss):
            self.shown_loss, grad_norm = result.read()
        if logging_step:
            train = {"loss": round(self.shown_loss, 6), "lr": lr, "grad_norm": grad_norm}
            if self.scaler is not None:  # only a loss scaler skips steps; fp32 and bf16 lines stay as they were
                train["skipped_steps"] = self.state.skipped_steps
            self.log_event("train", train)
            # speed, ETA and memory on a line of their own: train/eval lines stay identical across resumes
            self.log_event(PERF, {**perf, "checkpoint_wait_s": round(self.writer.waited_s, 3)})
        if trace:
            log.log(verbosity.TRACE, "step %d loss %.6f lr %.3e grad_norm %.4f", self.state.step, self.shown_loss,
                    lr, grad_norm)
        self.bar.update(1, loss=self.shown_loss, lr=lr, perf=perf)

    def after_step(self) -> None:
        """An epoch's end moves the position to the next epoch; then the evaluation and the checkpoint due now."""
        c, step = self.config, self.state.step
        epoch_done = self.state.batch_in_epoch >= len(self.batches)
        if epoch_done:
            self.state.epoch, self.state.batch_in_epoch = self.state.epoch + 1, 0
        if self.data.eval and ((c.eval_strategy == "steps" and step % c.eval_steps == 0)
                               or (c.eval_strategy == "epoch" and epoch_done)):
            self.stop = self.record_eval(self.timed_evaluate())
        if c.save_strategy != "no" and ((c.save_steps and step % c.save_steps == 0)
                                        or (c.save_strategy == "epoch" and epoch_done)):
            self.checkpoint()

    def log_event(self, kind: str, values: dict[str, Any]) -> None:
        epoch = round(self.state.epoch + self.state.batch_in_epoch / max(1, len(self.batches)), 4)
        entry = {"type": kind, "step": self.state.step, "epoch": epoch, **values}
        self.metrics_file.write(entry)
        self.emit(entry)

    def remaining_evals(self) -> int:
        c = self.config
        return evals_left(self.state.step, self.total_steps, strategy=c.eval_strategy, every=c.eval_steps or 0,
                          steps_per_epoch=self.plan.first_epoch_steps, has_eval=bool(self.data.eval))

    # --- evaluation and checkpoints -------------------------------------------------------------------------

    def timed_evaluate(self) -> dict[str, float]:
        started = time.perf_counter()
        metrics = self.evaluate()
        self.pace.eval_done(time.perf_counter() - started)  # the ETA counts the evaluations still to come
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Loss weighted by example count, then the task metrics; model.eval() + inference_mode, then back."""
        c, data = self.config, self.data
        self.model.eval()
        mine = eval_batches(list(range(self.rank, len(data.eval), self.world)), example_lengths(data.eval),
                            c.batch_size, c.max_batch_tokens, c.group_by_length)
        rows: list[tuple[int, float, Any]] = []  # (example index, its batch's mean loss, task row)
        start = 0  # examples before this batch: the batch's corruption seed, as before batches were sorted
        with torch.inference_mode():
            for idx in mine:
                items = [data.eval[i] for i in idx]
                batch = to_device(self.task.collate(items, data, seed=c.seed + start), self.accelerator.device)
                start += len(idx)
                with self.accelerator.autocast():
                    outputs = float32_outputs(self.task.forward(self.model, batch, data))
                loss = self.task.loss(outputs, batch, data, None, 0.0).item()
                rows += [(i, loss, row) for i, row in zip(idx, self.task.eval_rows(outputs, batch, items, data))]
        # every process's rows, concatenated (accelerate's gather_object flattens one level), back in file order
        everything = sorted(gather_object(rows) if self.world > 1 else rows, key=lambda r: r[0])
        self.model.train()
        mean_loss = sum(r[1] for r in everything) / len(everything)
        return {"loss": mean_loss, **self.task.metrics([r[2] for r in everything], data,
                                                       self.unwrapped.config.id2label)}

    def evaluate_before(self) -> None:
        """--eval-before: the base model's evaluation, logged as the eval line of step 0. It picks no best model and
        leaves every RNG as it found it, so the run trains exactly as it would without it."""
        states = capture_rng(), rng_tensors()
        metrics = self.evaluate()
        restore_rng(*states)
        self.log_event("eval", {f"eval_{k}": v for k, v in metrics.items()})

    def record_eval(self, metrics: dict[str, float]) -> bool:
        """Log, keep the best model, step plateau schedules; True when early stopping or convergence says stop."""
        value = metrics.get(self.metric_name)
        if value is None:
            raise ConfigError(f"metric {self.metric_name!r} is not computed for this task; available: "
                              f"{sorted(metrics)}")
        self.state.history.append([self.state.step, value])
        self.log_event("eval", {f"eval_{k}": v for k, v in metrics.items()})
        if self.tracker.update(value, self.state.step) and self.main:
            save_model_folder(self.unwrapped, self.source, self.run.best, self.task, self.data)
        self.state.tracker = self.tracker.state_dict()
        if isinstance(self.scheduler, PlateauWithWarmup):
            self.scheduler.on_eval(value)
        history = MetricHistory([tuple(p) for p in self.state.history])
        window, tolerance = self.config.converged_window, self.config.converged_tolerance
        return self.tracker.should_stop or bool(window and history.converged(window, tolerance))

    def checkpoint(self) -> None:
        """Snapshot to the CPU now (the next step mutates the live tensors), write and prune on the writer."""
        if self.main:
            snap = snapshot(self.state.step, self.unwrapped, self.optimizer, self.scheduler, self.scaler,
                            {**self.state.to_dict(), "run_config": resume_record(self.config),
                             NUM_PROCESSES: self.world})
            if self.companion is not None:  # in the checkpoint beside the model's weights, never in best/ or final/
                snap.weights |= {COMPANION + k: v.detach().to("cpu", copy=True) for k, v in
                                 self.accelerator.unwrap_model(self.companion).state_dict().items()}
            protect = {self.tracker.best_step} if self.tracker.best_step is not None else set()
            run, keep = self.run, self.config.save_total_limit
            self.writer.submit(lambda: (write_checkpoint(run, snap), prune(run, keep, protect)))
            log.info("checkpoint step %d: snapshot taken, writing in the background", self.state.step)
        self.accelerator.wait_for_everyone()

    # --- 5. the end -----------------------------------------------------------------------------------------------

    def finish(self, frozen: int) -> dict[str, Any]:
        """final/ (and best/ when no evaluation chose one), summary.json, report.html, the `done` event; the main
        process's job. Returns the summary."""
        unwrapped, data, run = self.unwrapped, self.data, self.run
        save_model_folder(unwrapped, self.source, run.final, self.task, data)
        if not run.best.exists():
            save_model_folder(unwrapped, self.source, run.final, self.task, data, copy_to=run.best)
        entries, problems = read_metrics(run.metrics)
        last_eval = [e for e in entries if e["type"] == "eval"]
        result = RunSummary(
            steps=self.state.step, epochs=self.state.epoch, best_metric={self.metric_name: self.tracker.best},
            best_step=self.tracker.best_step, stopped_early=self.stop, metric_mode=self.tracker.mode, frozen=frozen,
            train_examples=len(data.train), eval_examples=len(data.eval),
            labels=unwrapped.config.id2label if data.space else None, problem_type=_problem(data),
            config=self.config.model_dump(), num_processes=self.world,
            final_eval={k: v for k, v in last_eval[-1].items() if k.startswith("eval_")} if last_eval else None)
        result.write(run.summary_path)
        summary = result.to_dict()
        write_report(run, entries, result, problems)
        self.emit({"type": "done", **summary})
        return summary


# --- helpers ----------------------------------------------------------------------------------------------------


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


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
