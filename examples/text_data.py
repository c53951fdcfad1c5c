"""Training text for the example: real text that ships with Python, tokenised at the byte level.

With no options the corpus is the reference documentation that every CPython carries in
``pydoc_data.topics`` (~470 KB of English prose and code), so the example needs no download.
``--data PATH`` reads a local ``.txt`` file (or a folder of them) or a ``.jsonl`` file with a
``"text"`` field; ``--tokenizer PATH`` uses a local Hugging Face tokenizer instead of bytes.

Every sample is a window of ``seq_len`` tokens at a position drawn from a generator seeded
with ``(seed, sample index)``, so the same seed gives the same data whatever the parallel
degrees, and a resumed run continues the same stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BYTE_VOCAB = 256


def _builtin_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))


def _read_texts(path: Path) -> str:
    if path.is_dir():
        return "\n\n".join(p.read_text(errors="replace") for p in sorted(path.rglob("*.txt")))
    if path.suffix == ".jsonl":
        texts = []
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    texts.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path} line {number} is not a JSON object with a 'text' field") from None
        return "\n\n".join(texts)
    return path.read_text(errors="replace")


def load_corpus(data: str | None) -> str:
    """The training text: the built-in documentation, or a local file/folder."""
    if data is not None and not Path(data).exists():
        raise ValueError(f"--data {data} does not exist")
    text = _builtin_text() if data is None else _read_texts(Path(data))
    if not text:
        raise ValueError(f"no text found in --data {data} (a .txt file, a folder of .txt files or a .jsonl file)")
    return text


def tokenize(text: str, tokenizer: str | None) -> tuple[torch.Tensor, int]:
    """(token ids [N] int64, vocabulary size): raw UTF-8 bytes, or a local HF tokenizer."""
    if tokenizer is None:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), BYTE_VOCAB
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    return torch.tensor(hf_tokenizer(text)["input_ids"], dtype=torch.long), len(hf_tokenizer)


class TokenWindows:
    """Deterministic random windows of ``seq_len`` tokens from one long token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        if tokens.numel() <= seq_len:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, but a window needs more than --seq-len "
                f"{seq_len}: give a longer --data file or a smaller --seq-len"
            )
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def sample(self, index: int) -> torch.Tensor:
        """Window number ``index`` of the stream: [seq_len] int64."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.tokens.numel() - self.seq_len, (1,), generator=generator))
        return self.tokens[start : start + self.seq_len]

    def batch(self, first_index: int, size: int) -> torch.Tensor:
        """Windows ``first_index .. first_index + size - 1`` stacked: [size, seq_len]."""
        return torch.stack([self.sample(first_index + i) for i in range(size)])
