"""The Llama-3 chat format: conversations to token ids and assistant-only labels, and micro-batches of them.

One conversation renders as

    <|begin_of_text|>
    <|start_header_id|>system<|end_header_id|>\\n\\n{content}<|eot_id|>      (optional, first only)
    <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{content}<|eot_id|>  ...

which is exactly what `AutoTokenizer.apply_chat_template` gives with our tokenizer's template, except
that message text is encoded with `encode_plain`: a literal "<|eot_id|>" typed by a user stays text,
so no one can inject a turn. Labels are -100 everywhere except each assistant turn's content tokens
and the <|eot_id|> that closes it (they are not shifted: the label at i is the id at i).

The data files (JSONL conversations) are read by prep/chat_data.py.

A step's encoded conversations become micro-batches in one of two layouts (inputs = ids[:-1], targets =
labels[1:], the pad id in and IGNORE out where nothing is):

    padded   `collate`: one conversation a row, right-padded to the longest of the micro-batch;
    packed   `pack_rows` + `collate_packed`: whole conversations packed into rows of up to `row_len` tokens,
             as many rows a micro-batch as a token budget allows (`micro_batches`), with a `doc_ids` tensor
             (0, 1, ... per conversation of the row, one more id for the padding at its end) that the model
             turns into a block-diagonal causal mask and per-conversation RoPE positions. No conversation
             is split: truncation to max_len stays `encode_chat`'s, so a row holds at least one whole one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from minilm_az.model import IGNORE
from minilm_az.tokenizer import BOS, END_HEADER, EOT, START_HEADER, encode_plain

ROLES = ("system", "user", "assistant")


class ChatFormatError(ValueError):
    """A conversation that cannot be trained on (bad role, empty content, no assistant turn, ...)."""


class NothingToTrain(ChatFormatError):
    """Truncation to max_len left no assistant token: the caller drops the conversation and counts it."""


def validate_messages(messages) -> list[dict]:
    """Check a conversation; returns it as a list of {"role", "content"} dicts or raises ChatFormatError."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"message {i} is a {type(m).__name__}, expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatFormatError(f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ChatFormatError(f"message {i} ({role}): content must be a string, got {type(content).__name__}")
        if not content.strip():
            raise ChatFormatError(f"message {i} ({role}): empty content")
        if role == "system" and i != 0:
            raise ChatFormatError(f"message {i}: a system message may only come first")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ChatFormatError("conversation has no assistant turn (nothing to train on)")
    return out


def _specials(tokenizer: Tokenizer) -> dict[str, int]:
    ids = {s: tokenizer.token_to_id(s) for s in (BOS, START_HEADER, END_HEADER, EOT)}
    missing = [s for s, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks the chat special tokens {missing}")
    return ids


def _render(messages: Sequence[dict], tokenizer: Tokenizer, add_generation_prompt: bool):
    """Ids plus, per message, (header_start, content_start, end) positions; end includes <|eot_id|>."""
    sp = _specials(tokenizer)
    # "\n\n" + content is encoded as one string, as the template's rendered text is.
    enc = encode_plain(tokenizer, [m["role"] for m in messages] + ["\n\n" + m["content"] for m in messages] + ["\n\n"])
    roles, bodies, sep = enc[: len(messages)], enc[len(messages) : 2 * len(messages)], enc[-1]
    ids, spans = [sp[BOS]], []
    for role_ids, body in zip(roles, bodies):
        start = len(ids)
        ids += [sp[START_HEADER], *role_ids, sp[END_HEADER]]
        # The "\n\n" belongs to the header; content begins where the body stops agreeing with "\n\n" alone.
        k = 0
        while k < len(sep) and k < len(body) and body[k] == sep[k]:
            k += 1
        content_start = len(ids) + k
        ids += body + [sp[EOT]]
        spans.append((start, content_start, len(ids)))
    if add_generation_prompt:
        role_ids = encode_plain(tokenizer, ["assistant"])[0]
        ids += [sp[START_HEADER], *role_ids, sp[END_HEADER], *sep]
    return ids, spans


def encode_chat(
    messages, tokenizer: Tokenizer, max_len: int = 1024, last_turn_only: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation; labels keep assistant content + its <|eot_id|>, else -100.

    Longer than `max_len`: cut to `max_len` tokens, backing off to the start of a header if the cut
    falls inside one; raises NothingToTrain if no trainable token is left.
    """
    messages = validate_messages(messages)
    ids, spans = _render(messages, tokenizer, add_generation_prompt=False)
    labels = [IGNORE] * len(ids)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        trained = trained[-1:]
    for i in trained:
        _, c, end = spans[i]
        labels[c:end] = ids[c:end]
    if len(ids) > max_len:
        cut = max_len
        for start, c, _ in spans:
            if start < cut < c:  # inside "<|start_header_id|>role<|end_header_id|>\n\n"
                cut = start
        ids, labels = ids[:cut], labels[:cut]
        if all(x == IGNORE for x in labels[1:]):  # labels[0] is never a target after the shift
            raise NothingToTrain(f"no assistant token left after truncation to max_len={max_len}")
    return ids, labels


def encode_prompt(messages, tokenizer: Tokenizer) -> list[int]:
    """Ids of a conversation so far plus the assistant header: the model's prompt for its next turn."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list")
    checked = validate_messages(messages + [{"role": "assistant", "content": "x"}])[:-1]
    return _render(checked, tokenizer, add_generation_prompt=True)[0]


# ---------------------------------------------------------------- micro-batches: padded and packed

Example = tuple[list[int], list[int]]  # (ids, labels) of one conversation, as encode_chat returns them


def collate(examples: Sequence[Example], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift (inputs = ids[:-1], targets = labels[1:]) and right-pad: pad id in, IGNORE out."""
    T = max(len(ids) - 1 for ids, _ in examples)
    x = torch.full((len(examples), T), pad_id, dtype=torch.long)
    y = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, (ids, labels) in enumerate(examples):
        n = len(ids) - 1
        x[i, :n] = torch.tensor(ids[:-1])
        y[i, :n] = torch.tensor(labels[1:])
    return x.to(device), y.to(device)


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """The indices of the items in each row of at most `row_len` tokens, as few rows as first-fit decreasing
    finds, the items then spread evenly over them (longest first, each to the emptiest row) when that fits.

    Even rows can all be cut to the longest one's length, so a row's padding is small (first-fit alone
    fills the first rows and leaves the last nearly empty). Deterministic (ties keep input order); every
    length must fit a row (encode_chat's truncation sees to it).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > row_len:
            raise ValueError(f"a conversation of {lengths[i]} tokens does not fit a row of {row_len}")
        r = next((r for r, f in enumerate(free) if lengths[i] <= f), None)
        if r is None:
            rows.append([])
            free.append(row_len)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    even: list[list[int]] = [[] for _ in rows]
    load = [0] * len(rows)
    for i in order:
        r = min(range(len(rows)), key=lambda r: load[r])
        if load[r] + lengths[i] > row_len:
            return rows
        even[r].append(i)
        load[r] += lengths[i]
    return even


def collate_packed(rows: Sequence[Sequence[Example]], row_len: int, pad_id: int, device):
    """(x, y, doc_ids), each (len(rows), row_len): the conversations of each row back to back, then padding."""
    x = torch.full((len(rows), row_len), pad_id, dtype=torch.long)
    y = torch.full((len(rows), row_len), IGNORE, dtype=torch.long)
    doc = torch.empty((len(rows), row_len), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for j, (ids, labels) in enumerate(row):
            n = len(ids) - 1
            x[r, at : at + n] = torch.tensor(ids[:-1])
            y[r, at : at + n] = torch.tensor(labels[1:])
            doc[r, at : at + n] = j
            at += n
        doc[r, at:] = len(row)  # the padding is a document of its own: it sees only itself, never a conversation
    return x.to(device), y.to(device), doc.to(device)


def micro_batches(
    batch: Sequence[Example], rank: int, world: int, micro: int, pad_id: int, device, row_len=None, max_tokens=None
):
    """This rank's micro-batches of a step: (x, y, doc_ids) tensors, doc_ids None when padded.

    Both layouts cut the step into micro-batches the same way on any number of processes and deal them
    out in turn (micro-batch k to rank k % world), so a 2-process run computes what a 1-process run does.
    Padded: `micro` conversations each. Packed: the whole step's conversations fill rows of at most
    `row_len` tokens (of `max_tokens` when that is less, but never less than the longest conversation),
    all cut to the longest row's length (rounded up to 64); a micro-batch takes as many rows as fit in
    `max_tokens` tokens (default `micro` x `row_len`, the most a padded micro-batch can hold), at least one.
    Every rank runs as many as the busiest (FSDP needs the same collectives everywhere), an extra one being
    a row of padding with no target.
    """
    if row_len is None:
        return [
            (*collate(batch[s : s + micro], pad_id, device), None)
            for s in range(rank * micro, len(batch), world * micro)
        ]
    lengths = [len(ids) - 1 for ids, _ in batch]
    budget = max_tokens or micro * row_len
    cap = min(row_len, max(budget, max(lengths)))
    rows = [[batch[i] for i in row] for row in pack_rows(lengths, cap)]
    longest = max(sum(len(ids) - 1 for ids, _ in row) for row in rows)
    width = min(cap, -(-longest // 64) * 64)  # few distinct shapes: compiled kernels are reused
    per = max(1, budget // width)
    groups = [rows[s : s + per] for s in range(0, len(rows), per)]
    mine = [collate_packed(g, width, pad_id, device) for g in groups[rank::world]]
    return mine + [collate_packed([[]], width, pad_id, device)] * (-(-len(groups) // world) - len(mine))
