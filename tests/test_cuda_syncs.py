"""At most one wait for the GPU per optimizer step, counted on the CPU: every read of a tensor's value into Python
(item, tolist, bool/int/float of a tensor, nonzero, unique, boolean-mask indexing, .cpu(), .numpy()) is a host
sync on CUDA, so a TorchFunctionMode counts them while Trainer.step and Trainer.log_step run, attributed to the
code that asked (the training loop, its AMP helpers, the tasks, accelerate's wrappers, and the model's code).

Not counted: the micro-batch's collate (it builds the batch on the host, before the copy to the device), torch's own
internals (an optimizer's step counter lives on the host), and packed attention's plan (nn/layout.py, groups.py,
band.py, varlen.py): a GPU batch's is built by Packed.on_host from one read-back of the mask and then from host
tensors only, so its reads fold into one per micro-batch here ("layout").

What stands: bf16/fp32 read nothing on a step that logs nothing and one copy (loss and grad norm together) on a
logging step, besides the layout's one read per micro-batch; the GPU test (tests/test_cuda.py) counts the same
with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hfport.train import amp, loop
from hfport.train.config import FinetuneConfig
from tests.data import DATA
from tests.finetuning import base_config, embedding_config
from tests.tiny import save_with_tokenizer

REPO = Path(__file__).resolve().parents[1]
TORCH = str(Path(torch.__file__).parent)
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.unique,
         torch.Tensor.unique, torch.Tensor.cpu, torch.Tensor.numpy, torch.masked_select, torch.Tensor.masked_select,
         torch.Tensor.any, torch.Tensor.all}
WATCHED = (str(REPO / "hfport"), "accelerate")
# a packed batch's attention plan: on a GPU built on the host from one read-back of the mask (Packed.on_host), its
# groups, masks and cu_seqlens from host tensors (Packed.attend_cuda); on the CPU these files read CPU tensors
PLANNING = tuple(str(REPO / "hfport" / "nn" / f) for f in ("layout.py", "groups.py", "band.py", "varlen.py"))


def _reads_value(func, args) -> bool:
    if func in (torch.Tensor.any, torch.Tensor.all):
        return False  # a tensor result: only its bool() reads it
    if func in READS:
        return True
    if func is torch.Tensor.__getitem__ and len(args) > 1:  # a boolean mask's size is read from the device
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class HostReads(TorchFunctionMode):
    """Counts value reads asked for by watched code (the frame that called the read, not torch's own)."""

    def __init__(self):
        super().__init__()
        self.on, self.where = False, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.on and _reads_value(func, args):
            frame = sys._getframe(1)
            name = frame.f_code.co_filename
            if not name.startswith(TORCH) and any(w in name for w in WATCHED):
                self.where.append("layout" if name in PLANNING else f"{Path(name).name}:{frame.f_code.co_name}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """Reads per optimizer step: a list of lists, the attention plan's reads folded to one entry per step."""
    reads = HostReads()
    steps: list[list[str]] = []
    step, log_step, micro_batch = loop.Trainer.step, loop.Trainer.log_step, loop.Trainer.micro_batch

    def counting(fn, new_step: bool = False):
        def run(self, *args):
            if new_step:
                steps.append([])
            reads.on, reads.where = True, []
            try:
                return fn(self, *args)
            finally:
                reads.on = False
                seen = reads.where
                planned = [w for w in seen if w == "layout"]
                steps[-1].extend([w for w in seen if w != "layout"] + (["layout"] if planned else []))
        return run

    def host_side(self, indices):  # collate builds the batch on the host: nothing there is on a GPU yet
        was, reads.on = reads.on, False
        try:
            return micro_batch(self, indices)
        finally:
            reads.on = was

    # the CPU's reads are free (amp.FREE_READS): clipping there reads its norm to skip a no-op multiply; counted as
    # a GPU would run it
    monkeypatch.setattr(amp, "FREE_READS", frozenset(), raising=False)
    monkeypatch.setattr(loop.Trainer, "step", counting(step, new_step=True))
    monkeypatch.setattr(loop.Trainer, "log_step", counting(log_step))
    monkeypatch.setattr(loop.Trainer, "micro_batch", host_side)
    with reads:
        yield steps


def _logging(config: FinetuneConfig, steps: int) -> list[bool]:
    return [s % config.logging_steps == 0 or s == 1 for s in range(1, steps + 1)]


@pytest.mark.parametrize("precision, grad_accum", [("fp32", 1), ("bf16", 2)])
def test_classification_steps_read_nothing_between_logging_steps(workdir, tmp_path, counted, precision,
                                                                  grad_accum):
    config = base_config(workdir, tmp_path / "run", max_steps=6, logging_steps=3, eval_strategy="no", eval=None,
                         eval_fraction=0.0, save_strategy="no", precision=precision, grad_accum=grad_accum,
                         batch_size=8, max_grad_norm=1.0)
    loop.finetune(config, progress=False)
    assert len(counted) == 6
    for reads, logs in zip(counted, _logging(config, 6)):
        assert reads.count("layout") == 1, reads  # the model's planned read (folded: one entry per step)
        assert [r for r in reads if r != "layout"] == (["loop.py:read"] if logs else []), reads
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["type"] == "train"]
    assert [x["step"] for x in train] == [1, 3, 6] and all(x["grad_norm"] > 0 for x in train)


def test_listwise_ranking_loss_reads_nothing(tmp_path, counted, minilm_path):
    save_with_tokenizer("bert", "base", tmp_path / "model", minilm_path, vocab_size=30522)
    config = FinetuneConfig(model=str(tmp_path / "model"), task="text-ranking", train=str(DATA / "rerank_train.jsonl"),
                            eval=None, eval_fraction=0.0, output_dir=str(tmp_path / "run"), batch_size=4, lr=1e-3,
                            logging_steps=100, seed=5, max_length=64, precision="fp32", loss="listwise",
                            max_steps=3, save_strategy="no", eval_strategy="no")
    loop.finetune(config, progress=False)
    assert [[r for r in reads if r != "layout"] for reads in counted] == [["loop.py:read"], [], []]


def test_embedding_mnrl_loss_reads_nothing(tmp_path, counted, tiny_bert):
    """MultipleNegativesRankingLoss scores every text of the batch (non-candidates at -inf): no unique(), no
    nonzero(), no boolean index whose size the GPU would report."""
    config = embedding_config(tiny_bert, tmp_path, eval=None, eval_fraction=0.0, max_steps=3, logging_steps=100,
                              save_strategy="no", eval_strategy="no")
    loop.finetune(config, progress=False)
    assert [[r for r in reads if r != "layout"] for reads in counted] == [["loop.py:read"], [], []]
