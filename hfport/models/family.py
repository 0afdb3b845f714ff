"""The Family record: everything hfport knows about one config.json model_type, as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ..config import EncoderConfig
from ..keymap import KeyMap

# task -> a function of the config giving keyword options for that task's head factory (hfport/tasks/)
HeadOptions = dict[str, Callable[[EncoderConfig], dict[str, Any]]]


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers' base_model_prefix: head checkpoints store the body under "<prefix>."
    architectures: dict[str, str]  # task -> transformers class name written to config.json
    config_from_hf: Callable[[dict[str, Any], str], EncoderConfig]
    body_keys: KeyMap
    head_keys: dict[str, KeyMap]  # task -> table of the head's own keys
    build_body: Callable[[EncoderConfig, str], nn.Module]  # (config, task)
    # how this family's heads differ from the task's defaults (RoBERTa's dense layer before the classifier,
    # DeBERTa's ContextPooler, the MLM activation...); a task absent here uses the defaults
    head_options: HeadOptions = field(default_factory=dict)
    # the linear layers LoRA adapts when the user names none (hfport names): attention's query and value by default
    lora_targets: tuple[str, ...] = ("attn.q", "attn.v")
    ignored_keys: KeyMap = field(default_factory=lambda: KeyMap({}))  # pre-training heads hfport never loads
    after_init: Callable[[nn.Module, EncoderConfig], None] | None = None  # a family's own fresh-init values
    # a family whose head names depend on the config (DeBERTa's two MLM layouts) picks the head's table here
    select_head_keys: Callable[[EncoderConfig, str], KeyMap | None] | None = None

    def head_map(self, config: EncoderConfig, task: str) -> KeyMap | None:
        return self.select_head_keys(config, task) if self.select_head_keys else self.head_keys.get(task)

    def options_for(self, config: EncoderConfig, task: str) -> dict[str, Any]:
        """The keyword options this family gives `task`'s head factory."""
        options = self.head_options.get(task)
        return options(config) if options else {}
