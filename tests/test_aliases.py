"""transformers' TrainingArguments names in a fine-tune config: stored under hfport's names from a file, --set and
the HTTP job body; refused by name where hfport has no such option; an unknown key gets the closest valid names."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hfport.cli import app
from hfport.errors import ConfigError
from hfport.train.aliases import ALIASES
from hfport.train.config import FinetuneConfig, read_config_file, resolve_config
from server.routes.jobs import config_error
from server.schemas import FinetuneJobRequest

BASE = {"model": "m", "train": "t.jsonl"}


def test_training_arguments_names_are_stored_under_hfports():
    config, sources = resolve_config({**BASE, "learning_rate": 1e-3, "num_train_epochs": 2,
                                      "per_device_train_batch_size": 4, "gradient_accumulation_steps": 3,
                                      "lr_scheduler_type": "constant_with_warmup", "warmup_ratio": 0.2,
                                      "max_grad_norm": 0.5, "weight_decay": 0.1, "metric_for_best_model": "eval_f1",
                                      "greater_is_better": True, "load_best_model_at_end": True, "fp16": False,
                                      "bf16": True, "adam_beta2": 0.98, "seed": 3, "logging_steps": 5,
                                      "eval_steps": 7, "save_steps": 9, "save_total_limit": 4, "max_steps": 11,
                                      "early_stopping_patience": 2}, {"learning_rate": 2e-3}, "run.yaml")
    assert (config.lr, config.epochs, config.batch_size, config.grad_accum, config.scheduler) == \
        (2e-3, 2.0, 4, 3, "constant_with_warmup")
    assert (config.warmup_ratio, config.max_grad_norm, config.weight_decay) == (0.2, 0.5, 0.1)
    assert (config.metric, config.metric_mode, config.precision, config.adam_betas) == ("f1", "max", "bf16",
                                                                                          (0.9, 0.98))
    assert (config.seed, config.logging_steps, config.eval_steps, config.save_steps, config.save_total_limit,
            config.max_steps, config.early_stopping_patience) == (3, 5, 7, 9, 4, 11, 2)
    assert sources["lr"] == "flag" and sources["epochs"] == "run.yaml"  # the flag's alias overrides the file's
    assert FinetuneConfig(**BASE, bf16=False, fp16=False).precision == "fp32"  # transformers' default: fp32


@pytest.mark.parametrize("values, message", [
    ({"learning_rat": 1}, r"unknown option 'learning_rat'; did you mean lr \(transformers: learning_rate\)\?"),
    ({"warmup_step": 1}, r"unknown option .warmup_step.; did you mean warmup_steps, warmup_ratio, max_steps\?"),
    # the field matched under its own name and an alias of it: offered once
    ({"schedular": "cosine"}, r"unknown option .schedular.; did you mean scheduler\?"),
    ({"per_device_eval_batch_size": 8}, r"per_device_eval_batch_size: transformers' option has no hfport "
                                        r"equivalent \(hfport evaluates in batches of batch_size"),
    ({"load_best_model_at_end": False}, r"load_best_model_at_end=False: not possible, hfport always keeps the best"),
    ({"lr": 1e-3, "learning_rate": 1e-3}, r"learning_rate and lr are the same option"),
    ({"bf16": True, "fp16": True}, r"bf16 and fp16 are both true"),
])
def test_bad_keys_are_named(values, message):
    with pytest.raises(ConfigError, match=r"run.yaml: " + message):
        resolve_config({**BASE, **values}, {}, "run.yaml")


def test_a_bad_value_names_the_key_as_given():
    with pytest.raises(ConfigError, match=r"lr \(given as learning_rate\): Input should be a valid number"):
        resolve_config({**BASE, "learning_rate": "fast"}, {})
    with pytest.raises(ConfigError, match=r"scheduler \(given as lr_scheduler_type\): Input should be 'linear'"):
        resolve_config({**BASE, "lr_scheduler_type": "polynomial"}, {})
    with pytest.raises(ConfigError, match=r"lr \(from the flags\): Input should be a valid number"):
        resolve_config({**BASE, "learning_rate": 1e-3}, {"lr": "fast"})


def test_a_bad_value_names_the_file_or_the_flags_that_gave_it():
    """With a config file and flags both given, a value the config refuses names where it came from."""
    flags = {"model": "m"}
    with pytest.raises(ConfigError, match=r"invalid fine-tune config: scheduler \(from run.yaml\): Input should be "):
        resolve_config({**BASE, "scheduler": "cosin"}, flags, "run.yaml")
    with pytest.raises(ConfigError, match=r"lr \(given as learning_rate, from run.yaml\): Input should be a valid"):
        resolve_config({**BASE, "learning_rate": "fast"}, flags, "run.yaml")
    with pytest.raises(ConfigError, match=r"epochs \(from the flags\): Input should be a valid number"):
        resolve_config(BASE, {**flags, "epochs": "many"}, "run.yaml")
    with pytest.raises(ConfigError, match=r"lora.rr \(from run.yaml and the flags\): Extra inputs"):
        resolve_config({**BASE, "lora": {"rr": 8}}, {**flags, "lora": {"r": 4}}, "run.yaml")


def test_an_unknown_key_lists_only_the_closest_names():
    with pytest.raises(ConfigError) as e:
        resolve_config(BASE, {"learning_rat": 1})
    assert str(e.value).startswith("flags: ") and "max_length" not in str(e.value)  # not all 70 options


def test_every_alias_names_a_real_field_or_says_why_not():
    for name, alias in ALIASES.items():
        assert alias.field in FinetuneConfig.model_fields if alias.field else alias.why, name
        assert name not in FinetuneConfig.model_fields, name  # an alias never shadows an hfport name


def test_http_job_body_takes_the_aliases():
    body = FinetuneJobRequest.model_validate({"config": {**BASE, "learning_rate": 1e-4, "num_train_epochs": 1,
                                                         "report_to": "none"}})
    assert body.config.model_dump(exclude_unset=True) == {**BASE, "lr": 1e-4, "epochs": 1.0, "report_to": []}
    with pytest.raises(ValueError, match=r"logging_dir\n.*Input should be None"):  # a job's trackers stay in its run
        FinetuneJobRequest.model_validate({"config": {**BASE, "report_to": "tensorboard", "logging_dir": "/etc"}})
    with pytest.raises(ValueError, match=r"run_name\n.*no path separators"):
        FinetuneJobRequest.model_validate({"config": {**BASE, "run_name": "../../x"}})
    with pytest.raises(ValueError, match=r"learning_rat\n.*Extra inputs are not permitted"):
        FinetuneJobRequest.model_validate({"config": {**BASE, "learning_rat": 1e-4}})
    error = config_error([{"type": "extra_forbidden", "loc": ("learning_rat",), "msg": "Extra inputs"}])
    assert error.message == "config: unknown option(s) ['learning_rat']; learning_rat: did you mean lr " \
        "(transformers: learning_rate)?"


def test_a_config_file_that_does_not_parse_says_how_it_was_read(tmp_path):
    """A YAML file named run.cfg (or a TOML file) is read as JSON: the error says so, and why."""
    for name, text in (("run.cfg", "lr: 0.001\n"), ("run.toml", "lr = 1e-3\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name}: not valid JSON \(a config file is read as YAML when its "
                                              rf"name ends in \.yaml or \.yml, else as JSON; this one ends in "
                                              rf"\{name[3:]}\): Expecting value"):
            read_config_file(tmp_path / name)
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(ConfigError, match=r"run.json: not valid JSON: Expecting"):
        read_config_file(tmp_path / "run.json")


def test_every_list_field_takes_a_comma_list_from_set():
    """`--set KEY=a,b` is a list for every list or tuple field, whatever its item type (ints, floats, names), as
    `freeze` and `report_to` always took it; a value the field takes whole (class_weights' "balanced") stays whole."""
    run = CliRunner().invoke(app, ["finetune", "--model", "m", "--train", "t.jsonl", "--task", "sentence-embedding",
                                   "--set", "matryoshka_dims=32,16", "--set", "matryoshka_weights=1,0.5",
                                   "--set", "adam_betas=0.8,0.99", "--set", "freeze=embeddings.,pooler.",
                                   "--print-config"])
    assert run.exit_code == 0, run.output
    shown = {line.split()[0]: " ".join(line.split()[1:-1]) for line in run.stdout.splitlines()}
    assert (shown["matryoshka_dims"], shown["matryoshka_weights"], shown["adam_betas"], shown["freeze"]) == \
        ("[32, 16]", "[1.0, 0.5]", "[0.8, 0.99]", '["embeddings.", "pooler."]')
    for value, expected in (("1,2", [1.0, 2.0]), ("balanced", "balanced")):
        assert resolve_config(BASE, {"class_weights": value})[0].class_weights == expected
    with pytest.raises(ConfigError, match=r"matryoshka_dims.1 \(from the flags\): Input should be a valid integer"):
        resolve_config(BASE, {"matryoshka_dims": "32,x", "task": "sentence-embedding"})
