"""transformers' TrainingArguments options in a fine-tune config mean what transformers makes of them. Each family is
resolved twice on the same options, by hfport (resolve_config, build_scheduler, build_optimizer) and by transformers
itself (TrainingArguments' __post_init__, get_scheduler, the Trainer's optimizer choice), and the results compared:
the metric that picks the best model and its direction, the learning rate at every step, the plateau cuts at every
evaluation, and the values transformers derives from others."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.optimization import get_scheduler

import hfport
from hfport.errors import ConfigError
from hfport.train.aliases import ALIASES, ANY
from hfport.train.config import resolve_config
from hfport.train.optim import build_optimizer, build_scheduler, warmup_steps
from tests.tiny import ALL_FAMILIES, build_hf, save_hf

BASE = {"model": "m", "train": "t.jsonl"}


def hf_args(tmp_path, **options: Any) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, **options)


def hfport_config(file_values: dict[str, Any], flags: dict[str, Any] | None = None):
    return resolve_config({**BASE, **file_values}, flags or {}, "run.yaml")[0]


def hf_metric(args: TrainingArguments) -> tuple[str, str]:
    return args.metric_for_best_model.removeprefix("eval_"), "max" if args.greater_is_better else "min"


EPOCHS = {"eval_strategy": "epoch", "save_strategy": "epoch"}  # what load_best_model_at_end asks of transformers


@pytest.mark.parametrize("options", [
    {"load_best_model_at_end": True},
    {"load_best_model_at_end": True, "greater_is_better": False},  # the issue: loss minimised, not accuracy
    {"load_best_model_at_end": True, "greater_is_better": True},
    {"load_best_model_at_end": True, "metric_for_best_model": "accuracy"},
    {"load_best_model_at_end": True, "metric_for_best_model": "eval_f1", "greater_is_better": False},
    {"metric_for_best_model": "eval_loss"},
    {"metric_for_best_model": "accuracy"},
    {"lr_scheduler_type": "reduce_lr_on_plateau"},
    {"lr_scheduler_type": "reduce_lr_on_plateau", "greater_is_better": True},
    {"lr_scheduler_type": "reduce_lr_on_plateau", "metric_for_best_model": "accuracy"},
])
def test_the_best_models_metric_is_transformers(tmp_path, options):
    config = hfport_config({**EPOCHS, **options})
    assert config.default_metric("single_label_classification") == hf_metric(hf_args(tmp_path, **EPOCHS, **options))


def test_a_named_metric_wins_over_the_derived_one_from_any_origin(tmp_path):
    """load_best_model_at_end's "loss" is transformers' default: a metric named in the file or by a flag wins, as it
    does when both are TrainingArguments."""
    want = hf_metric(hf_args(tmp_path, **EPOCHS, load_best_model_at_end=True, metric_for_best_model="f1"))
    assert hfport_config({**EPOCHS, "metric": "f1"}, {"load_best_model_at_end": True}).default_metric() == want
    assert hfport_config({**EPOCHS, "load_best_model_at_end": True}, {"metric": "f1"}).default_metric() == want
    config, sources = resolve_config({**BASE, **EPOCHS, "load_best_model_at_end": True}, {}, "run.yaml")
    assert config.metric == "loss" and sources["metric"] == "transformers' default"


def test_a_direction_without_a_metric_is_refused():
    """transformers ignores greater_is_better when nothing picks a best model; hfport, which always keeps one, would
    apply it to the task's default metric (accuracy minimised: the worst checkpoint): refused."""
    with pytest.raises(ConfigError, match=r"metric_mode 'min' \(transformers: greater_is_better\) without a metric"):
        hfport_config({"greater_is_better": False})
    with pytest.raises(ConfigError, match=r"metric_mode 'max' .* without a metric"):
        hfport_config({"metric_mode": "max"})


def test_an_error_metric_is_minimised_where_transformers_would_maximise_it(tmp_path):
    """The one deliberate difference: transformers' greater_is_better defaults to True for every name not ending in
    "loss", mse included, which keeps the worst regression model; hfport minimises mse, mae and perplexity."""
    assert hf_args(tmp_path, metric_for_best_model="mse").greater_is_better is True
    assert hfport_config({"metric_for_best_model": "eval_mse"}).default_metric() == ("mse", "min")


def lr_curve(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


TOTAL = 23  # optimizer steps of the run


@pytest.mark.parametrize("name, warmup", [
    ("linear", 0), ("linear", 5), ("linear", 0.2), ("cosine", 0), ("cosine", 4), ("cosine", 0.15),
    ("constant", 0), ("constant_with_warmup", 0), ("constant_with_warmup", 6), ("constant_with_warmup", 0.3),
])
def test_the_learning_rate_is_transformers_at_every_step(tmp_path, name, warmup):
    options = {"lr_scheduler_type": name, "warmup_steps": warmup, "learning_rate": 1e-3}
    args = hf_args(tmp_path, **options)
    hf_opt = optimizer()
    want = lr_curve(get_scheduler(args.lr_scheduler_type, hf_opt, num_warmup_steps=args.get_warmup_steps(TOTAL),
                                  num_training_steps=TOTAL, scheduler_specific_kwargs=args.lr_scheduler_kwargs),
                    hf_opt, TOTAL)
    config = hfport_config(options)
    assert warmup_steps(config, TOTAL) == args.get_warmup_steps(TOTAL)
    ours = optimizer()
    assert lr_curve(build_scheduler(ours, config, TOTAL, "min"), ours, TOTAL) == want


def test_warmup_ratio_is_transformers_warmup_fraction(tmp_path):
    """hfport keeps transformers 4's warmup_ratio; transformers 5 writes the fraction as warmup_steps < 1."""
    for ratio in (0.1, 0.25, 0.5):
        config = hfport_config({"warmup_ratio": ratio})
        assert warmup_steps(config, TOTAL) == hf_args(tmp_path, warmup_steps=ratio).get_warmup_steps(TOTAL)


@pytest.mark.parametrize("name", ["constant", "reduce_lr_on_plateau"])
def test_a_warmup_transformers_would_drop_is_refused(name):
    """transformers' constant and reduce_lr_on_plateau schedules ignore warmup_steps; hfport refuses rather than
    drop it silently (and hfport's constant, which used to warm up, does not change meaning unnoticed)."""
    with pytest.raises(ConfigError, match=rf"scheduler '{name}' has no warmup"):
        hfport_config({"lr_scheduler_type": name, "warmup_steps": 3})
    with pytest.raises(ConfigError, match=rf"scheduler '{name}' has no warmup"):
        hfport_config({"scheduler": name, "warmup_ratio": 0.1})


# evaluations' losses: improvements, stalls, and improvements smaller than the relative threshold (1e-4) that count
# as stalls
LOSSES = [1.0, 0.9, 0.9, 0.89995, 0.9, 0.95, 0.85, 0.85, 0.85, 0.849999, 0.86, 0.87, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8,
          0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]


@pytest.mark.parametrize("kwargs", [None, {"factor": 0.5, "patience": 2}, {"patience": 0}])
def test_reduce_lr_on_plateau_cuts_as_transformers(tmp_path, kwargs):
    """transformers' reduce_lr_on_plateau (torch's ReduceLROnPlateau: factor 0.1, patience 10, no warmup, on the eval
    loss) against hfport's on the same options and the same evaluations, lr after every one."""
    options = {"lr_scheduler_type": "reduce_lr_on_plateau", "learning_rate": 1e-3, **EPOCHS,
               **({"lr_scheduler_kwargs": kwargs} if kwargs else {})}
    args = hf_args(tmp_path, **options)
    hf_opt = optimizer()
    theirs = get_scheduler(args.lr_scheduler_type, hf_opt, num_warmup_steps=args.get_warmup_steps(TOTAL),
                           num_training_steps=TOTAL, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    config = hfport_config(options)
    metric, mode = config.default_metric()
    assert (metric, mode) == hf_metric(args)
    ours_opt = optimizer()
    ours = build_scheduler(ours_opt, config, TOTAL, mode)
    want, got = [], []
    for loss in LOSSES:
        ours.step()  # a training step between evaluations: no change (transformers does not step it per step)
        theirs.step(loss)
        ours.on_eval(loss)
        want.append(hf_opt.param_groups[0]["lr"])
        got.append(ours_opt.param_groups[0]["lr"])
    assert got == want
    assert len(set(want)) > 1  # the sequence does cut the lr


def test_lr_scheduler_kwargs_other_than_factor_and_patience_are_refused():
    with pytest.raises(ConfigError, match=r"lr_scheduler_kwargs: \['num_cycles'\] have no hfport equivalent"):
        hfport_config({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1.0}})


def test_plateau_without_evaluations_is_refused(tmp_path):
    with pytest.raises(ValueError, match="requires an eval strategy"):
        hf_args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau")  # transformers' own default is "no"
    with pytest.raises(ConfigError, match=r"scheduler 'reduce_lr_on_plateau' cuts the lr .* eval_strategy"):
        hfport_config({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "no"})


def test_early_stopping_without_evaluations_is_refused():
    """Patience (or hfport's convergence window) with eval_strategy 'no' would never stop the run: refused, as
    transformers' EarlyStoppingCallback refuses it, instead of training on silently."""
    for option in ({"early_stopping_patience": 2}, {"converged_window": 3}):
        with pytest.raises(ConfigError, match=rf"{next(iter(option))}: stops the run by the evaluated metric, but "
                                              "eval_strategy 'no' never evaluates"):
            hfport_config({**option, "eval_strategy": "no"})
        hfport_config({**option, "eval_strategy": "steps"})


def test_derived_steps_are_transformers(tmp_path):
    """max_steps -1 (TrainingArguments' default) leaves the epochs in charge; max_grad_norm 0 turns clipping off;
    eval_strategy steps without eval_steps evaluates every logging_steps; save_strategy steps without save_steps
    saves every 500 steps."""
    options = {"max_steps": -1, "max_grad_norm": 0, "eval_strategy": "steps", "logging_steps": 7,
               "save_strategy": "steps"}
    args, config = hf_args(tmp_path, **options), hfport_config(options)
    assert args.max_steps <= 0 and config.max_steps is None
    assert args.max_grad_norm == 0 and config.max_grad_norm is None
    assert (config.eval_steps, config.save_steps) == (args.eval_steps, args.save_steps) == (7, 500)


def test_optimizer_options_are_transformers(tmp_path):
    """optim sgd is torch's SGD without momentum (hfport's own sgd has 0.9 unless told); adamw's betas and epsilon."""
    model = torch.nn.Linear(3, 2)
    options = {"optim": "sgd", "learning_rate": 0.1, "weight_decay": 0.0}
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(hf_args(tmp_path, **options), model)
    ours = build_optimizer(model, hfport_config(options))
    assert isinstance(ours, cls) and ours.param_groups[0]["momentum"] == kwargs.get("momentum", 0.0) == 0.0
    assert ours.param_groups[0]["lr"] == kwargs["lr"]
    assert hfport_config({**options, "momentum": 0.9}).momentum == 0.9  # named: kept
    options = {"optim": "adamw_torch", "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6}
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(hf_args(tmp_path, **options), model)
    ours = build_optimizer(model, hfport_config(options))
    assert isinstance(ours, cls)
    assert (ours.defaults["betas"], ours.defaults["eps"]) == (kwargs["betas"], kwargs["eps"])


def test_training_arguments_defaults_that_are_hfports_behaviour_are_accepted(tmp_path):
    """What TrainingArguments.to_dict() writes for options hfport has no switch for, where the value is what hfport
    does anyway; another value is still refused, naming why. load_best_model_at_end false (hand back the last
    model, where a server job registers best/) stays refused."""
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none").to_dict()
    given = {name: args[name] for name, alias in ALIASES.items()
             if alias.only is not ANY and name in args and name != "load_best_model_at_end"}
    assert len(given) >= 9, sorted(given)
    assert hfport_config(given).metric is None
    with pytest.raises(ConfigError, match=r"load_best_model_at_end=False: not possible"):
        hfport_config({"load_best_model_at_end": args["load_best_model_at_end"]})
    with pytest.raises(ConfigError, match=r"push_to_hub=True: not possible, hfport uploads nothing"):
        hfport_config({"push_to_hub": True})
    assert hfport_config({"activation_checkpointing": True}).gradient_checkpointing is True


@pytest.mark.parametrize("family", [*ALL_FAMILIES, "eurobert"])
def test_weight_decay_spares_what_transformers_spares(tmp_path, family):
    """weight_decay: the parameters decayed are transformers' Trainer.get_decay_parameter_names on the same model
    (biases and norms spared: EuroBERT's RMSNorm weights and MPNet's relative_attention_bias too). The rotary families
    whose checkpoints name their weights otherwise than transformers' classes (fused qkv) are left out."""
    save_hf(family, "sequence-classification", tmp_path / "m")
    want = set(Trainer.get_decay_parameter_names(None, build_hf(family, "sequence-classification")))
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m")
    optimizer = build_optimizer(ours, hfport_config({"weight_decay": 0.1}))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    hf_names = ours.hf_names()
    assert {hf_names[n] for n, p in ours.named_parameters() if id(p) in decayed} == want
