"""Make the question-answering reference outputs with transformers 4.57, whose QuestionAnsweringPipeline
transformers 5 removed; hfport follows its semantics and tests/test_pipelines.py compares against these files.

Run once, in a separate environment that has transformers 4.57:
    python3 -m venv /tmp/v457 && /tmp/v457/bin/pip install torch==2.13.0 transformers==4.57.6
    /tmp/v457/bin/python scripts/make_qa_fixtures.py

Writes (deterministically: seeded weights, a tokenizer trained on a fixed corpus):
    tests/fixtures/qa_tiny_bert/      a tiny random BertForQuestionAnswering + a WordPiece tokenizer (~110 KB)
    tests/fixtures/qa_tiny_roberta/   a tiny random RobertaForQuestionAnswering + a byte-level BPE tokenizer
    tests/fixtures/qa_reference.json  the 4.57 pipeline's outputs for each case below, on each model
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
OUTPUT = ROOT / "tests" / "fixtures" / "qa_reference.json"

CORPUS = ["Herman Melville wrote Moby-Dick in 1851, a novel about the whale and Captain Ahab.",
          "Paris is the capital of France; Berlin is the capital of Germany.",
          "The quick brown fox jumps over the lazy dog near the river bank.",
          "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
          "Who wrote the book? Where is the capital? When did she win the prize?",
          "Straße, café, naïve: accents and ümlauts appear in European names."] * 20
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MODEL_MAX_LENGTH = 64  # the pipeline's default max_seq_len is min(model_max_length, 384): long contexts get windows

LONG = " ".join(CORPUS[:6] * 3)
CASES = [
    ("single", {"question": "Who wrote Moby-Dick?", "context": CORPUS[0]}, {}),
    ("top_k", {"question": "What is the capital of France?", "context": CORPUS[1]}, {"top_k": 3}),
    ("batch", [{"question": "Who won the Nobel Prize?", "context": CORPUS[3]},
               {"question": "Where does the fox jump?", "context": CORPUS[2]},
               {"question": "Who wrote the novel about the whale?", "context": LONG}], {}),
    ("long context windows", {"question": "When did Marie Curie win?", "context": LONG}, {"top_k": 4}),
    ("doc_stride and max_seq_len", {"question": "Who is the captain?", "context": LONG},
     {"doc_stride": 10, "max_seq_len": 40, "top_k": 2}),
    ("max_answer_len", {"question": "What did the fox do?", "context": CORPUS[2]}, {"max_answer_len": 3, "top_k": 5}),
    ("handle_impossible_answer", {"question": "What is the name of the dog?", "context": CORPUS[2]},
     {"handle_impossible_answer": True, "top_k": 2}),
    ("align_to_words off", {"question": "Which names have accents?", "context": CORPUS[5]},
     {"align_to_words": False, "top_k": 3}),
    ("shared context", {"question": ["Who wrote it?", "When was it written?"], "context": CORPUS[0]}, {"top_k": 2}),
    ("max_question_len", {"question": "Which capital is in Germany?", "context": CORPUS[1]},
     {"max_question_len": 3}),
]


def _write_tokenizer(tok: Tokenizer, folder: Path, config: dict, special: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {**config, "model_max_length": MODEL_MAX_LENGTH, "clean_up_tokenization_spaces": False, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def _save_model(model_cls: type, config: transformers.PretrainedConfig, folder: Path) -> None:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
        model.qa_outputs.weight.normal_(0.0, 1.0)  # spread the logits: candidate scores far apart, stable order
    model.save_pretrained(folder, safe_serialization=True)


def build_bert(folder: Path) -> None:
    """WordPiece, BERT's template: [CLS] question [SEP] context [SEP], with token types."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=220, special_tokens=SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece(prefix="##")
    _write_tokenizer(tok, folder, {"tokenizer_class": "BertTokenizer", "do_lower_case": True},
                     {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                      "mask_token": "[MASK]"})
    _save_model(transformers.BertForQuestionAnswering, transformers.BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0), folder)


def build_roberta(folder: Path) -> None:
    """Byte-level BPE, RoBERTa's template: <s> question </s></s> context </s>, no token types, trimmed offsets."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")), trim_offsets=True,
                                                      add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _write_tokenizer(tok, folder, {"tokenizer_class": "RobertaTokenizer", "add_prefix_space": False,
                                   "trim_offsets": True, "errors": "replace"},
                     {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
                      "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<mask>"})
    _save_model(transformers.RobertaForQuestionAnswering, transformers.RobertaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1), folder)


MODELS = {"qa_tiny_bert": build_bert, "qa_tiny_roberta": build_roberta}


def main() -> None:
    if not transformers.__version__.startswith("4.57."):
        sys.exit(f"needs transformers 4.57.x (its QuestionAnsweringPipeline), found {transformers.__version__}")
    runs = {}
    for name, build in MODELS.items():
        folder = FIXTURES / name
        build(folder)
        qa = transformers.pipeline("question-answering", model=str(folder), tokenizer=str(folder), device="cpu")
        records = []
        for case, inputs, kwargs in CASES:
            if isinstance(inputs, dict):
                output = qa(question=inputs["question"], context=inputs["context"], **kwargs)
            else:
                output = qa(inputs, **kwargs)
            records.append({"name": case, "inputs": inputs, "kwargs": kwargs, "output": output})
        runs[name] = records
    reference = {"made_by": "scripts/make_qa_fixtures.py", "transformers": transformers.__version__,
                 "torch": torch.__version__, "models": runs}
    OUTPUT.write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUTPUT} ({len(CASES)} cases x {len(MODELS)} models) and {', '.join(MODELS)} in {FIXTURES}")


if __name__ == "__main__":
    main()
