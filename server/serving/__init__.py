"""The serving core every protocol (native /predict, TEI, OpenAI) runs through: admission (input limits, the
pending bound, the deadline), batching (the micro-batcher), the model cache keyed by a typed record (a LoRA
adapter's base inside it: requests for a base and its adapters share one batcher and one forward pass), the model a
request names (`served`) and `infer`. Routes parse their protocol's body, call `served` and `infer` with their
protocol's Answers (how it words a refusal) and shape the results."""

from .admission import Answer, Answers, characters, check_inputs
from .batching import Batcher, Timing
from .cache import ModelCache, ModelLoadError, total_weight_bytes, weight_bytes
from .records import PROTOCOL_TASK, ModelRecord, lookup, named_folder, registered
from .served import Served, served, set_timing
from .service import ModelService, infer

__all__ = ["Answer", "Answers", "Batcher", "ModelCache", "ModelLoadError", "ModelRecord", "ModelService",
           "PROTOCOL_TASK", "Served", "Timing", "characters", "check_inputs", "infer", "lookup", "named_folder",
           "registered", "served", "set_timing", "total_weight_bytes", "weight_bytes"]
