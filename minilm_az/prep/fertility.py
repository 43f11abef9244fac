"""Fertility: how many tokens each tokenizer spends on the same text (tokenize.py report).

Tokens per whitespace word is the recipe's headline number (3.22 -> 1.59 for Azerbaijani with a 100k
vocabulary); bytes per token is what bits per byte (bpb.py) converts through, so both are reported.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

from tokenizers import Tokenizer

from minilm_az.tokenizer import encode_plain


def fertility(tokenizers_: dict[str, Tokenizer], documents: Iterable[str], batch_docs: int = 1024) -> dict[str, dict]:
    """Tokens per whitespace word, bytes/token, chars/token of each tokenizer on the same text.

    Text is NFC-normalised once before counting words, chars and bytes (UTF-8) and before encoding,
    so every tokenizer sees identical input; tokens are counted with `encode_plain` (no BOS/EOS).
    """
    totals = {"documents": 0, "words": 0, "chars": 0, "bytes": 0}
    tokens = dict.fromkeys(tokenizers_, 0)  # tokenizer name -> tokens so far
    batch: list[str] = []

    def flush():
        for name, tok in tokenizers_.items():
            tokens[name] += sum(len(ids) for ids in encode_plain(tok, batch))
        batch.clear()

    for doc in documents:
        doc = unicodedata.normalize("NFC", doc)
        totals["documents"] += 1
        totals["words"] += len(doc.split())
        totals["chars"] += len(doc)
        totals["bytes"] += len(doc.encode("utf-8"))
        batch.append(doc)
        if len(batch) >= batch_docs:
            flush()
    if batch:
        flush()
    out = {}
    for name, count in tokens.items():
        out[name] = dict(
            totals,
            tokens=count,
            tokens_per_word=count / max(totals["words"], 1),
            bytes_per_token=totals["bytes"] / max(count, 1),
            chars_per_token=totals["chars"] / max(count, 1),
        )
    return out


def format_fertility(rows: dict[str, dict[str, dict]]) -> str:
    """A plain-text table of `{corpus_name: fertility(...)}`."""
    header = ("corpus", "tokenizer", "vocab", "docs", "words", "tokens", "tok/word", "bytes/tok", "chars/tok")
    table = []
    for corpus, by_tok in rows.items():
        for name, stats in by_tok.items():
            counts = [stats.get("vocab_size", ""), stats["documents"], stats["words"], stats["tokens"]]
            ratios = [stats["tokens_per_word"], stats["bytes_per_token"], stats["chars_per_token"]]
            table.append([corpus, name, *map(str, counts), *(f"{r:.3f}" for r in ratios)])
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]

    def fmt(row) -> str:  # the two name columns align left, the numbers right
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(row) for row in table])
