"""The other three fine-tuning tasks: token classification, extractive QA, masked LM.

Each trains a tiny random BERT (with the real MiniLM WordPiece tokenizer) on data generated here to a clear
improvement; the unit tests pin down what is easy to get subtly wrong: sub-token label alignment, answer
positions across doc_stride windows, the 80/10/10 masking, CoNLL parsing, and errors naming file/line/field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hfport import AutoTokenizer, tasks
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError, EncodedData, LabelSpace
from hfport.train.loop import finetune
from hfport.train.tasks import get_task
from hfport.train.tasks.mlm import mask_tokens
from hfport.train.tasks.qa import answer_positions, best_answer
from hfport.train.tasks.tokens import align_labels, read_conll
from tests.data import mlm_lines, ner_rows, qa_rows, squad_v2, write_jsonl
from tests.finetuning import model_lines
from tests.tiny import save_with_tokenizer

torch.set_num_threads(1)  # the tiny model gains nothing from threads on shared cores; avoid oversubscription


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT (no task head: the loop adds it) with the real MiniLM tokenizer beside it."""
    root = tmp_path_factory.mktemp("tasks") / "model"
    save_with_tokenizer("bert", "base", root, minilm_path, vocab_size=30522)
    return root


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def config(model_dir: Path, tmp_path: Path, task: str, train: Path, eval: Path | None, **kw) -> FinetuneConfig:
    values = dict(model=str(model_dir), task=task, train=str(train), eval=str(eval) if eval else None,
                  output_dir=str(tmp_path / "run"), batch_size=16, lr=3e-3, warmup_ratio=0.1, logging_steps=1,
                  seed=7, max_length=64, precision="fp32")
    return FinetuneConfig(**{**values, **kw})


def curves(out: Path) -> tuple[list[float], list[dict]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["type"] == "train"], [x for x in lines if x["type"] == "eval"]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# --- token classification -----------------------------------------------------------------------------------------

def test_token_classification_learns(model_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(160, 0))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", ner_rows(48, 1))
    cfg = config(model_dir, tmp_path, "token-classification", train, evaluation, epochs=4,
                 eval_strategy="steps", eval_steps=1000)
    first_eval = _first_eval(cfg)
    summary = finetune(cfg, progress=False)
    losses, evals = curves(tmp_path / "run")
    print(f"token-classification: loss {mean(losses[:5]):.3f} -> {mean(losses[-5:]):.3f}, "
          f"eval {first_eval} -> {evals[-1]}")
    assert mean(losses[-5:]) < 0.3 * mean(losses[:5]), losses
    assert summary["labels"] == {0: "B-LOC", 1: "B-PER", 2: "I-LOC", 3: "I-PER", 4: "O"}
    assert evals[-1]["eval_f1"] >= 0.8 and evals[-1]["eval_f1"] > first_eval["f1"] + 0.5, (first_eval, evals[-1])


@pytest.mark.parametrize("task", ["token-classification", "question-answering", "masked-lm"])
def test_metric_names_are_what_evaluation_reports(model_dir, tmp_path, task):
    """The names a config's metric may take are the task's evaluation's own (a one-step run reports them; every tag's
    entity type may report its f1, this eval's rows name only some); another is refused by the preflight."""
    from hfport import ConfigError
    from hfport.train.preflight import preflight

    if task == "masked-lm":
        (tmp_path / "train.txt").write_text(mlm_lines(32, 0))
        train, evaluation = tmp_path / "train.txt", None
    else:
        rows = ner_rows if task == "token-classification" else qa_rows
        train, evaluation = write_jsonl(tmp_path / "train.jsonl", rows(32, 0)), write_jsonl(tmp_path / "e.jsonl",
                                                                                             rows(8, 1))
    cfg = config(model_dir, tmp_path, task, train, evaluation, max_steps=1, max_length=32, doc_stride=8,
                 save_strategy="no")
    checked = preflight(cfg)
    names = {"loss", *checked.task.metric_names(checked.data)}
    reported = {k.removeprefix("eval_") for k in _first_eval(cfg)}
    assert reported <= names and {n for n in names if "/" not in n} == {n for n in reported if "/" not in n}
    with pytest.raises(ConfigError, match=r"metric 'bogus' \(the config field metric; transformers: "
                                          r"metric_for_best_model\): evaluation of " + task.replace("masked-lm",
                                                                                              "fill-mask")):
        preflight(cfg.model_copy(update={"metric": "bogus"}))


@pytest.mark.parametrize("task, problem, extra, names", [
    ("text-ranking", None, {}, ["mrr@10", "ndcg@10", "recall@1", "recall@10"]),
    ("sparse-embedding", "pairs", {}, ["corpus_active_dims", "mrr@10", "ndcg@10", "query_active_dims", "recall@1",
                                      "recall@10"]),
    ("multiple-choice", None, {}, ["accuracy"]),
    ("sentence-embedding", "scored-pairs", {"matryoshka_dims": [4, 2]},
     ["dim_2_pearson", "dim_2_spearman", "dim_4_pearson", "dim_4_spearman", "pearson", "spearman"]),
])
def test_metric_names_of_the_other_tasks(task, problem, extra, names):
    """Each task's metric_names runs its own metrics (sample rows of its eval_rows' shape) for its kind of data."""
    assert get_task(task).metric_names(EncodedData([], [], None, 0, extra, problem_type=problem)) == names


@pytest.mark.parametrize("task, space, problem", [
    ("text-classification", LabelSpace("single_label_classification", {0: "a", 1: "b"}), None),
    ("text-classification", LabelSpace("multi_label_classification", {0: "a", 1: "b"}), None),
    ("text-classification", LabelSpace("regression", {0: "LABEL_0"}), None),
    ("token-classification", LabelSpace(None, {0: "O", 1: "B-X", 2: "I-X"}), None),
    ("question-answering", None, None), ("fill-mask", None, None), ("multiple-choice", None, None),
    ("text-ranking", None, None), ("sentence-embedding", None, "pairs"), ("sentence-embedding", None, "scored-pairs"),
    ("sparse-embedding", None, "triplets"),
])
def test_every_default_metric_is_one_evaluation_computes(task, space, problem):
    """The preflight checks the default metric too (the task record's, by problem type): a record naming a metric its
    evaluation never computes would refuse every run of that kind."""
    data = EncodedData([], [], space, 0, {}, problem_type=problem)
    metric, _ = tasks.get(task).default_metric(space.problem_type if space else problem)
    assert metric in get_task(task).metric_names(data)


def _first_eval(cfg: FinetuneConfig) -> dict:
    """The untrained model's eval metrics (the loop's own evaluation, run with one step at lr ~ 0)."""
    probe = cfg.model_copy(update={"output_dir": cfg.output_dir + "-probe", "max_steps": 1, "lr": 1e-12,
                                   "warmup_ratio": 0.0})
    return {k.removeprefix("eval_"): v for k, v in finetune(probe, progress=False)["final_eval"].items()}


def test_label_alignment_first_vs_all_subtokens(tokenizer):
    words = ["zanzibarville", "is", "cold"]
    enc = tokenizer([words], is_split_into_words=True)
    word_ids = enc.word_ids(0)
    assert word_ids.count(0) > 1, "the test needs a word of several sub-tokens"
    b_loc, i_loc, o = 0, 1, 2
    first, firsts = align_labels(word_ids, [b_loc, o, o])
    n0 = word_ids.count(0)
    assert first == [-100, b_loc] + [-100] * (n0 - 1) + [o, o, -100]
    assert firsts == [1, 1 + n0, 2 + n0]
    every, _ = align_labels(word_ids, [b_loc, o, o], label_all_subtokens=True, b_to_i={b_loc: i_loc})
    assert every == [-100, b_loc] + [i_loc] * (n0 - 1) + [o, o, -100]


def test_all_subtokens_option_trains_and_scores_words(model_dir, tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(40, 2))
    cfg = config(model_dir, tmp_path, "token-classification", train, None, label_all_subtokens=True)
    data = get_task("token-classification").read(cfg, tokenizer, None)
    x = next(f for f in data.train + data.eval if "zanzibarville" in tokenizer.decode(f.input_ids))
    labelled = [t for t in x.target if t != -100]
    assert len(labelled) > len(x.meta["first"]), "all sub-tokens should carry labels"
    assert len(data.eval) == 4  # eval_fraction 0.1 of 40, split off seeded


def test_integer_tags_take_the_models_names(model_dir, tmp_path, tokenizer):
    """A datasets export writes tag ids; the model's own id2label names them when it has as many labels."""
    path = write_jsonl(tmp_path / "ids.jsonl", [{"tokens": ["bob", "smith", "ran"], "tags": [1, 2, 0]}] * 4)
    task = get_task("token-classification")
    data = task.read(config(model_dir, tmp_path, "token-classification", path, None), tokenizer,
                     {0: "O", 1: "B-PER", 2: "I-PER"})
    assert data.space.id2label == {0: "O", 1: "B-PER", 2: "I-PER"}
    assert [t for t in data.train[0].target if t != -100] == [1, 2, 0]
    data = task.read(config(model_dir, tmp_path, "token-classification", path, None), tokenizer, None)
    assert data.space.id2label == {0: "0", 1: "1", 2: "2"}


def test_conll_parsing(tmp_path):
    path = tmp_path / "ner.conll"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n\nPeter NNP B-NP B-PER\n"
                    "Blackburn NNP I-NP I-PER\n")
    sentences = read_conll(path)
    assert [s.tokens for s in sentences] == [["EU", "rejects"], ["Peter", "Blackburn"]]
    assert [s.tags for s in sentences] == [["B-ORG", "O"], ["B-PER", "I-PER"]]
    assert [s.line for s in sentences] == [3, 7]
    bad = tmp_path / "bad.txt"
    bad.write_text("EU B-ORG\nrejects\n")
    with pytest.raises(DataError, match=r"bad.txt, line 2, field 'tag'"):
        read_conll(bad)


def test_conll_trains_end_to_end(model_dir, tmp_path):
    def conll(rows: list[dict]) -> str:
        return "-DOCSTART- O\n\n" + "\n".join("".join(f"{w} {t}\n" for w, t in zip(r["tokens"], r["tags"]))
                                               for r in rows)
    (tmp_path / "train.conll").write_text(conll(ner_rows(64, 3)))
    (tmp_path / "eval.txt").write_text(conll(ner_rows(16, 4)))
    summary = finetune(config(model_dir, tmp_path, "token-classification", tmp_path / "train.conll",
                              tmp_path / "eval.txt", max_steps=2), progress=False)
    assert summary["train_examples"] == 64 and summary["eval_examples"] == 16
    assert set(summary["final_eval"]) >= {"eval_f1", "eval_precision", "eval_recall", "eval_accuracy"}


def test_unknown_eval_tag_names_file_line_field(model_dir, tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(20, 5))
    unknown = {"tokens": ["x", "y"], "tags": ["O", "B-MISC"]}
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [ner_rows(1, 6)[0], unknown])
    cfg = config(model_dir, tmp_path, "token-classification", train, evaluation)
    with pytest.raises(DataError, match=r"eval.jsonl, line 2, field 'tags': unknown tag 'B-MISC'"):
        finetune(cfg, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()
    (tmp_path / "eval.conll").write_text("x O\ny B-MISC\n")
    with pytest.raises(DataError, match=r"eval.conll, line 2, field 'tag': unknown tag 'B-MISC'"):
        get_task("token-classification").read(cfg.model_copy(update={"eval": str(tmp_path / "eval.conll")}),
                                               tokenizer, None)


@pytest.mark.parametrize("row, fragment", [
    ({"tokens": ["a", "b"], "tags": ["O"]}, "line 2, field 'tags': 1 tags for 2 tokens"),
    ({"tokens": ["a"]}, "line 2, field 'tags': missing"),
    ({"tokens": "a b", "tags": ["O", "O"]}, "line 2, field 'tokens': expected list"),
    ({"tokens": ["a", " "], "tags": ["O", "O"]}, "line 2, field 'tokens': token 1"),
])
def test_token_data_errors(model_dir, tmp_path, tokenizer, row, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", [ner_rows(1, 7)[0], row])
    with pytest.raises(DataError, match=fragment):
        get_task("token-classification").read(config(model_dir, tmp_path, "token-classification", path, None),
                                               tokenizer, None)


# --- question answering ---------------------------------------------------------------------------------------

def test_question_answering_learns(model_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", qa_rows(192, 0))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", qa_rows(48, 1))
    cfg = config(model_dir, tmp_path, "question-answering", train, evaluation, epochs=3, max_length=32,
                 doc_stride=8, eval_strategy="steps", eval_steps=1000)
    first_eval = _first_eval(cfg)
    summary = finetune(cfg, progress=False)
    losses, evals = curves(tmp_path / "run")
    print(f"question-answering: loss {mean(losses[:5]):.3f} -> {mean(losses[-5:]):.3f}, "
          f"eval {first_eval} -> {evals[-1]}")
    assert summary["train_examples"] > 192, "long contexts should have been split into several windows"
    assert mean(losses[-5:]) < 0.5 * mean(losses[:5]), losses
    assert evals[-1]["eval_exact_match"] >= 0.6, (first_eval, evals[-1])
    assert evals[-1]["eval_f1"] > first_eval["f1"] + 0.4, (first_eval, evals[-1])


def test_question_answering_v2_learns_to_abstain(model_dir, tmp_path):
    (tmp_path / "train.json").write_text(json.dumps(squad_v2(192, 2), indent=1))  # pretty-printed, many lines
    evaluation = squad_v2(64, 3)
    (tmp_path / "eval.json").write_text(json.dumps(evaluation))
    n_impossible = sum(not qa["answers"] for p in evaluation["data"][0]["paragraphs"] for qa in p["qas"])
    assert 8 <= n_impossible <= 28
    cfg = config(model_dir, tmp_path, "question-answering", tmp_path / "train.json", tmp_path / "eval.json",
                 epochs=4, max_length=32, doc_stride=8)
    finetune(cfg, progress=False)
    losses, evals = curves(tmp_path / "run")
    print(f"question-answering v2: loss {mean(losses[:5]):.3f} -> {mean(losses[-5:]):.3f}, eval {evals[-1]}")
    assert mean(losses[-5:]) < 0.5 * mean(losses[:5]), losses
    # above what always abstaining (n_impossible / 64) or never abstaining (the rest) could score
    assert evals[-1]["eval_exact_match"] >= max(n_impossible, 64 - n_impossible) / 64 + 0.1, evals[-1]


def _windows(tokenizer, question: str, context: str, max_length: int, stride: int):
    enc = tokenizer([question], [context], truncation="only_second", max_length=max_length, stride=stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True)
    return [(enc["input_ids"][i], enc["offset_mapping"][i], enc.sequence_ids(i)) for i in range(len(enc["input_ids"]))]


def test_answer_positions_across_windows(tokenizer):
    context = " ".join(f"w{i}" if i != 30 else "purple" for i in range(40))
    start = context.index("purple")
    windows = _windows(tokenizer, "which color?", context, 24, 6)
    assert len(windows) >= 3
    found = []
    for ids, offsets, seq in windows:
        s, e = answer_positions(offsets, seq, ("purple", start))
        if (s, e) == (0, 0):
            continue
        assert tokenizer.decode(ids[s:e + 1]) == "purple"
        assert offsets[s][0] == start and offsets[e][1] == start + len("purple")
        found.append(s)
    assert found, "no window holds the answer"
    first_with = next(i for i, (ids, offsets, seq) in enumerate(windows)
                      if answer_positions(offsets, seq, ("purple", start)) != (0, 0))
    assert first_with >= 1, "the answer should only be reachable from a later window"
    # a multi-token answer cut by a window edge maps to CLS in that window (run_qa's rule)
    ids, offsets, seq = windows[0]
    last_char = max(o[1] for o, s in zip(offsets, seq) if s == 1)
    straddling = (context[last_char - 2:last_char + 3], last_char - 2)
    assert answer_positions(offsets, seq, straddling) == (0, 0)


def test_impossible_answer_points_at_cls(tokenizer, model_dir, tmp_path):
    squad = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{
        "context": "the house stood near a river",
        "qas": [{"id": "a1", "question": "where was the house?", "answers": [{"text": "near a river",
                                                                                "answer_start": 16}],
                 "is_impossible": False},
                {"id": "a2", "question": "what color was it?", "answers": [], "is_impossible": True}]}]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(squad, indent=1))
    cfg = config(model_dir, tmp_path, "question-answering", path, path, doc_stride=16)
    data = get_task("question-answering").read(cfg, tokenizer, None)
    answerable, impossible = data.train
    assert impossible.target == (0, 0)
    s, e = answerable.target
    assert tokenizer.decode(answerable.input_ids[s:e + 1]) == "near a river"
    assert data.extra["with_null"] and data.extra["golds"] == [["near a river"], []]


def test_best_answer_picks_across_windows_and_null():
    offsets = [None, None, (0, 3), (4, 9), (10, 14)]  # [CLS] q "the" "house" "fell"
    context = "the house fell"
    flat = torch.zeros(5).numpy()
    peaked = flat.copy()
    peaked[3] = 8.0
    assert best_answer([(flat, flat, offsets), (peaked, peaked, offsets)], context, False, 10) == "house"
    null = flat.copy()
    null[0] = 12.0  # [CLS] dominates: on v2 data the empty answer wins
    assert best_answer([(null, null, offsets)], context, True, 10) == ""
    assert best_answer([(null, null, offsets)], context, False, 10) != ""


def test_misaligned_answer_start_is_an_error(model_dir, tmp_path, tokenizer):
    row = qa_rows(1, 9)[0]
    text, start = row["answers"]["text"][0], row["answers"]["answer_start"][0]
    bad = dict(row, answers=[{"text": text, "answer_start": start + 1}])  # the list-of-answers form
    path = write_jsonl(tmp_path / "bad.jsonl", [row, bad])
    cfg = config(model_dir, tmp_path, "question-answering", path, None, max_length=32, doc_stride=8)
    with pytest.raises(DataError, match=r"bad.jsonl, line 2, field 'answers': answer_start \d+ does not match"):
        get_task("question-answering").read(cfg, tokenizer, None)
    squad = {"data": [{"paragraphs": [{"context": "abc def", "qas": [
        {"id": "z9", "question": "q?", "answers": [{"text": "def", "answer_start": 3}]}]}]}]}
    (tmp_path / "bad.json").write_text(json.dumps(squad))
    with pytest.raises(DataError, match=r"bad.json, question id 'z9', field 'answers': answer_start 3"):
        get_task("question-answering").read(cfg.model_copy(update={"train": str(tmp_path / "bad.json")}),
                                            tokenizer, None)
    tail = {"question": "q?", "context": "abc def", "answers": {"text": ["def"], "answer_start": [-3]}}
    path = write_jsonl(tmp_path / "negative.jsonl", [tail])  # context[-3:] == "def": must still be refused
    with pytest.raises(DataError, match=r"negative.jsonl, line 1, field 'answers': answer_start -3"):
        get_task("question-answering").read(cfg.model_copy(update={"train": str(path)}), tokenizer, None)
    path = write_jsonl(tmp_path / "missing.jsonl", [{"question": "q?", "answers": []}])
    with pytest.raises(DataError, match=r"missing.jsonl, line 1, field 'context': missing"):
        get_task("question-answering").read(cfg.model_copy(update={"train": str(path)}), tokenizer, None)


# --- masked LM ------------------------------------------------------------------------------------------------

def test_masked_lm_learns(model_dir, tmp_path):
    (tmp_path / "train.txt").write_text(mlm_lines(192, 0))
    (tmp_path / "eval.txt").write_text("\n" + mlm_lines(48, 1))  # blank lines are skipped
    cfg = config(model_dir, tmp_path, "masked-lm", tmp_path / "train.txt", tmp_path / "eval.txt", epochs=8,
                 eval_strategy="steps", eval_steps=1000)
    first_eval = _first_eval(cfg)
    summary = finetune(cfg, progress=False)
    losses, evals = curves(tmp_path / "run")
    print(f"masked-lm: loss {mean(losses[:5]):.3f} -> {mean(losses[-5:]):.3f}, eval {first_eval} -> {evals[-1]}")
    assert mean(losses[-5:]) < 0.5 * mean(losses[:5]), losses
    assert summary["eval_examples"] == 48
    assert first_eval["perplexity"] > 5000, first_eval  # random init over 30522 words
    assert evals[-1]["eval_perplexity"] < 0.01 * first_eval["perplexity"], (first_eval, evals[-1])
    assert evals[-1]["eval_accuracy"] > 0.2, evals[-1]


def test_masked_lm_resume_is_exact(model_dir, tmp_path):
    """The masks come from per-batch seeds: stopping at a checkpoint and resuming gives the same weights."""
    from safetensors.torch import load_file

    (tmp_path / "train.txt").write_text(mlm_lines(64, 5))
    common = dict(eval_strategy="no", eval_fraction=0.0, scheduler="constant_with_warmup", save_steps=3, batch_size=8)
    whole = config(model_dir, tmp_path, "masked-lm", tmp_path / "train.txt", None, max_steps=6,
                   output_dir=str(tmp_path / "whole"), **common)
    finetune(whole, progress=False)
    part = whole.model_copy(update={"output_dir": str(tmp_path / "part"), "max_steps": 3})
    finetune(part, progress=False)
    finetune(part.model_copy(update={"max_steps": 6, "resume": "latest"}), progress=False)
    a = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert model_lines((tmp_path / "whole" / "metrics.jsonl").read_text()) == \
        model_lines((tmp_path / "part" / "metrics.jsonl").read_text())


def test_masking_rate_split_and_specials():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (64, 512), generator=g)  # (B, T)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, 0] = maskable[:, -1] = False  # [CLS] ... [SEP]
    maskable[::2, 400:] = False  # padding in half the rows
    corrupted, labels = mask_tokens(ids, maskable, torch.Generator().manual_seed(1), mask_token_id=103,
                                    vocab_size=30522)
    chosen = labels != -100
    assert not chosen[~maskable].any() and torch.equal(corrupted[~maskable], ids[~maskable])
    assert torch.equal(labels[chosen], ids[chosen])
    rate = chosen.sum() / maskable.sum()
    assert 0.14 < rate < 0.16, rate
    n = chosen.sum()
    masked = (corrupted == 103) & chosen
    kept = (corrupted == ids) & chosen
    randomized = chosen & ~masked & ~kept
    assert 0.77 < masked.sum() / n < 0.83 and 0.08 < kept.sum() / n < 0.12 and 0.08 < randomized.sum() / n < 0.12
    again, labels_again = mask_tokens(ids, maskable, torch.Generator().manual_seed(1), 103, 30522)
    assert torch.equal(again, corrupted) and torch.equal(labels_again, labels)
    other, _ = mask_tokens(ids, maskable, torch.Generator().manual_seed(2), 103, 30522)
    assert not torch.equal(other, corrupted)


def test_collate_masks_per_seed_and_never_specials(model_dir, tmp_path, tokenizer):
    (tmp_path / "train.txt").write_text(mlm_lines(32, 3) + "short\n")
    task = get_task("masked-lm")
    data = task.read(config(model_dir, tmp_path, "masked-lm", tmp_path / "train.txt", None), tokenizer, None)
    items = data.train[:8] + [next(x for x in data.train + data.eval if len(x.input_ids) == 3)]
    a, b = task.collate(items, data, seed=5), task.collate(items, data, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = task.collate(items, data, seed=6)
    assert not torch.equal(a["labels"], c["labels"])
    specials = torch.tensor(tokenizer.all_special_ids)
    original = task.collate(items, data, seed=5)["labels"]
    for i, x in enumerate(items):
        ids = torch.tensor(x.input_ids)
        assert (a["labels"][i, :len(ids)] != -100).any(), "every row has something to predict"
        assert (a["labels"][i, len(ids):] == -100).all(), "padding is never a target"
        chosen = a["labels"][i, :len(ids)] != -100
        assert not torch.isin(ids[chosen], specials).any(), "special tokens are never masked"
    assert torch.equal(original, a["labels"])
    # per example: the same example is masked the same way whichever batch (or process's share) it is in
    halves = [task.collate(items[:4], data, seed=5), task.collate(items[4:], data, seed=5)]
    for i, x in enumerate(items):
        half, j = (halves[0], i) if i < 4 else (halves[1], i - 4)
        n = len(x.input_ids)
        assert torch.equal(half["labels"][j, :n], a["labels"][i, :n]) and torch.equal(half["input_ids"][j, :n],
                                                                                     a["input_ids"][i, :n])


def test_mlm_data_errors(model_dir, tmp_path, tokenizer):
    (tmp_path / "bad.txt").write_bytes(b"fine line\ncaf\xe9 line\n")
    cfg = config(model_dir, tmp_path, "masked-lm", tmp_path / "bad.txt", None)
    with pytest.raises(DataError, match=r"bad.txt, line 2: not UTF-8"):
        get_task("masked-lm").read(cfg, tokenizer, None)
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"text": ""}])
    with pytest.raises(DataError, match=r"bad.jsonl, line 2, field 'text': expected non-empty text"):
        get_task("masked-lm").read(cfg.model_copy(update={"train": str(path)}), tokenizer, None)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.txt: the file has no examples"):
        get_task("masked-lm").read(cfg.model_copy(update={"train": str(tmp_path / "empty.txt")}), tokenizer, None)
