"""Tiny random transformers models, built with transformers' own config classes and saved with
save_pretrained: the exact HF layouts hfport must read. Seeded, so every run sees the same weights. Also
random LoRA adapters over such models (save_random_adapter, make_adapter), in PEFT's layout, and heads adjusted to
behave like trained ones (mlm_folder: sparse SPLADE logits; decisive_qa: spans fp32 decides)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

HEADS = {
    "base": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "masked-lm": "AutoModelForMaskedLM",
}
# heads whose inputs differ from the grid's (B, T) batch, with tests of their own (multiple-choice: (B, C, T))
OTHER_HEADS = {"multiple-choice": "AutoModelForMultipleChoice"}
# heads only some families have, with labels of their own (tests/test_pretraining.py): BERT, ALBERT, ELECTRA
PRETRAINING_HEADS = {"pretraining": "AutoModelForPreTraining",
                     "next-sentence-prediction": "AutoModelForNextSentencePrediction"}
# build_hf also takes the canonical task names (transformers' pipeline tags) of the heads above
OLD_NAMES = {"feature-extraction": "base", "text-classification": "sequence-classification", "fill-mask": "masked-lm"}

VOCAB = 99
# Each family's smallest interesting shape; max_position_embeddings leaves room for a > 64-token sequence.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("BertConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=37, max_position_embeddings=128, type_vocab_size=3)),
    "roberta": ("RobertaConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=130, type_vocab_size=1)),
    "xlm-roberta": ("XLMRobertaConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=37, max_position_embeddings=130,
                                             type_vocab_size=1, hidden_act="gelu_new")),
    "distilbert": ("DistilBertConfig", dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                            max_position_embeddings=128, activation="relu")),
    "albert": ("AlbertConfig", dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                    num_hidden_groups=2, inner_group_num=2, num_attention_heads=4,
                                    intermediate_size=37, max_position_embeddings=128)),
    # 3 layers: global, sliding, sliding (global_attn_every_n_layers 3); a 16-token window, so the 70- and 41-token
    # sequences of the batches exceed it. Biases are ModernBERT-base's (off but the decoder's); test_modernbert.py
    # turns each on.
    "modernbert": ("ModernBertConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                            num_attention_heads=4, intermediate_size=37, max_position_embeddings=128,
                                            local_attention=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                            cls_token_id=1, sep_token_id=2)),
}
# issue 33's families, a block of their own. MPNet: the default 32-row bucket table, so the 70-token sequence reaches
# the log-spaced buckets; ELECTRA: a factorised embedding (embeddings_project) like its small checkpoints.
FAMILY_CONFIGS.update({
    "mpnet": ("MPNetConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=130)),
    "electra": ("ElectraConfig", dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=37, max_position_embeddings=128,
                                      type_vocab_size=3)),
    "camembert": ("CamembertConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=37, max_position_embeddings=130, type_vocab_size=1)),
})
# families whose padding id is 1 (RoBERTa's positions count from it) and families with token types in the batches
PAD_ONE = ("roberta", "xlm-roberta", "camembert", "mpnet")
TOKEN_TYPES = ("bert", "albert", "electra")
# DeBERTa-v3's layout (bucketed relative positions: a 70-token sequence exceeds 8 buckets) plus v2-xlarge's
# convolution, so the packed path's relative bias and conv round trip are both exercised. Its parity against
# transformers has its own, wider grid in test_deberta_parity.py.
DEBERTA_CONFIG = ("DebertaV2Config", dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=128, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
    share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0,
    conv_kernel_size=3, conv_act="gelu"))
ALL_FAMILIES = {**FAMILY_CONFIGS, "deberta-v2": DEBERTA_CONFIG}
# The rotary families (issue 33), with a grid of their own in test_rotary_families.py: transformers has only their
# base, sequence-classification, token-classification and masked-lm classes (ROTARY_HEADS). Rotary positions, no
# position table: the 70-token row exceeds NomicBERT's 32 max_position_embeddings, so its dynamic scaling acts.
ROTARY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gte": ("GteConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=37, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "nomic_bert": ("NomicBertConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=37, max_position_embeddings=32,
                                           type_vocab_size=2, pad_token_id=0,
                                           rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                            "rope_theta": 1000.0})),
    # grouped-query attention (4 query heads on 2 key/value heads), biases on, the default "late" classifier
    "eurobert": ("EuroBertConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=37, max_position_embeddings=128,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3,
                                        attention_bias=True, mlp_bias=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "jina_embeddings_v3": ("JinaEmbeddingsV3Config", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=37,
                                                          max_position_embeddings=128, type_vocab_size=2,
                                                          pad_token_id=0, hidden_act="gelu_new")),
}
ROTARY_HEADS = ("base", "sequence-classification", "token-classification", "masked-lm")
# a family's heads beyond ROTARY_HEADS (transformers has question answering for jina-embeddings-v3 only)
ROTARY_EXTRA_HEADS = {"jina_embeddings_v3": ("question-answering",)}
NUM_LABELS = 3


def hf_config(family: str, **overrides: Any):
    import transformers

    cls_name, kwargs = {**ALL_FAMILIES, **ROTARY_CONFIGS}[family]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def build_hf(family: str, task: str, seed: int = 0, **overrides: Any):
    """A seeded random transformers model of `family` with the `task` head, in eval mode."""
    import transformers

    config = hf_config(family, **overrides)
    if task in ("sequence-classification", "token-classification") and "num_labels" not in overrides \
            and "id2label" not in overrides:
        config.id2label = {i: f"L{i}" for i in range(NUM_LABELS)}
        config.label2id = {f"L{i}": i for i in range(NUM_LABELS)}
    torch.manual_seed(seed)
    head = OLD_NAMES.get(task, task)
    model = getattr(transformers, {**HEADS, **OTHER_HEADS, **PRETRAINING_HEADS}[head]).from_config(config)
    # transformers zero-initialises some biases; random values make the parity check see every term
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model.eval()


def save_hf(family: str, task: str, folder: Path, seed: int = 0, **overrides: Any):
    model = build_hf(family, task, seed=seed, **overrides)
    model.save_pretrained(folder)
    return model


# a WordPiece tokenizer folder's files (the real MiniLM's, copied beside tiny models that need text in)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def save_with_tokenizer(family: str, task: str, folder: Path, tokenizer: Path, seed: int = 0, **overrides: Any):
    """save_hf, then the tokenizer files of the folder `tokenizer` beside the model (MiniLM's vocabulary has 30522
    tokens: pass vocab_size=30522 with it)."""
    model = save_hf(family, task, folder, seed=seed, **overrides)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer) / name, Path(folder) / name)
    return model


def save_random_adapter(model: torch.nn.Module, out: Path, *, base: Path, seed: int, scale: float = 0.05,
                        **lora_kwargs: Any):
    """LoRA on the hfport `model` (lora_kwargs: apply_lora's r, alpha, targets, ...), every trainable tensor (A, B,
    the head) moved off its init by seeded noise of std `scale` (B = 0 would hide errors), saved in PEFT's layout
    at `out` naming `base` as its base model. Returns the model."""
    from hfport import lora

    lora.apply_lora(model, base=str(base), **lora_kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    lora.save_adapter(model, out)
    return model


def make_adapter(base: Path, out: Path, task: str, r: int, targets: list[str], seed: int, **labels) -> Path:
    """An adapter in PEFT's layout whose A, B and head are moved off their init (B = 0 would hide errors)."""
    import hfport

    model = hfport.tasks.get(task).model_class.from_pretrained(base, ignore_mismatched_sizes=True, **labels)
    save_random_adapter(model, out, base=base, seed=seed, scale=0.1, r=r, alpha=2 * r, targets=targets)
    return out


# what the SPLADE tests (tests/test_sparse.py, test_sparse_onnx.py) encode with mlm_folder's model
SPARSE_TEXTS = ["Paris is the capital of France.", "The cat sat on the mat, and then it slept for a very long while.",
                "How do I reset my password?", "sparse",
                # a long row (~110 tokens, past 64: the padded batch's longest)
                " ".join(["Shops in Vietnam take the dong, the national currency, and the market opens early."] * 7)]


def mlm_folder(root: Path, minilm: Path, seed: int = 0) -> Path:
    """A tiny BERT masked-LM whose logits are mostly negative (decoder bias - 0.3, about 3 standard deviations of its
    logits): sparse SPLADE vectors."""
    model = build_hf("bert", "masked-lm", seed=seed, vocab_size=30522, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        model.cls.predictions.bias.sub_(0.3)
    model.save_pretrained(root)
    for f in TOKENIZER_FILES:
        shutil.copy(minilm / f, root / f)
    return root


def decisive_qa(model, folder: Path) -> None:
    """A random QA head's start/end logits are nearly flat over a row's tokens, so fp32 decides no span (its two
    most probable starts within NEAR_TIE of each other) and every row counts, a tie-break int8 may flip; scaled up,
    as training makes them, fp32 decides its spans and the gate judges them."""
    with torch.no_grad():
        model.qa_outputs.weight.mul_(40.0)
    model.save_pretrained(folder)


def batch(family: str, seed: int = 1, lengths: tuple[int, ...] = (70, 41, 9), pairs: bool = True,
          vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A padded batch: different lengths, one over 64 tokens, token types where the family has them."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    pad = 1 if family in PAD_ONE else 0
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    types = torch.zeros(len(lengths), t, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        if pairs:
            types[row, n // 2:n] = 1  # second segment
    ids = ids.masked_fill(mask == 0, pad)
    out = {"input_ids": ids, "attention_mask": mask}
    if family in TOKEN_TYPES:
        out["token_type_ids"] = types
    return out


def reference_qa_loss(out, start_positions: torch.Tensor, end_positions: torch.Tensor,
                      attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' QA loss (clamp to the ignored index T, mean of start and end cross-entropies) over real
    positions only. hfport scores padding positions as impossible answers; transformers' loss also sums over
    padding logits, whose values are not part of hfport's contract. With no padding the two are the same."""
    padding = ~attention_mask.bool()
    start = out.start_logits.masked_fill(padding, torch.finfo(out.start_logits.dtype).min)  # (B, T)
    end = out.end_logits.masked_fill(padding, torch.finfo(out.end_logits.dtype).min)  # (B, T)
    ignored = start.shape[1]
    start_loss = torch.nn.functional.cross_entropy(start, start_positions.clamp(0, ignored), ignore_index=ignored)
    end_loss = torch.nn.functional.cross_entropy(end, end_positions.clamp(0, ignored), ignore_index=ignored)
    return (start_loss + end_loss) / 2
