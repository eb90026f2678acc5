"""Characters of the repository's own documentation as a training text: nothing is downloaded.

The text is README.md and docs/*.md (docs/design/ included), joined; its vocabulary is the characters it uses.
The first 90% trains, the rest validates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


class Text:
    def __init__(self, text: str | None = None):
        if text is None:
            files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
            text = "\n\n".join(path.read_text(encoding="utf-8") for path in files)
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        tokens = self.encode(text)
        split = int(0.9 * len(tokens))
        self.splits = {"train": tokens[:split], "val": tokens[split:]}

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[c] for c in text], dtype=np.int32)

    def decode(self, tokens) -> str:
        return "".join(self.chars[int(t)] for t in tokens)

    def batch(self, rng: np.random.Generator, split: str, batch: int, length: int):
        """(tokens, targets), both (batch, length) int32 host arrays: random windows of the split and the same
        windows one character on."""
        data = self.splits[split]
        starts = rng.integers(0, len(data) - length - 1, size=batch)
        rows = starts[:, None] + np.arange(length + 1)
        windows = data[rows]
        return windows[:, :-1], windows[:, 1:]
