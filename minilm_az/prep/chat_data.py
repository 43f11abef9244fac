"""Chat data files for finetune.py: JSONL conversations, and which files of a directory train or validate.

A data file is JSONL, one `{"messages": [{"role": ..., "content": ...}, ...]}` a line. A bad line is a
ChatFormatError that names the file and line, unless the user asks to skip such lines. chat.py turns the
conversations into token ids and labels; `encode_all` does it for a whole file's.
"""

from __future__ import annotations

import json
import os
import re

from minilm_az.chat import ChatFormatError, NothingToTrain, encode_chat, validate_messages
from minilm_az.outputs import describe

# What a user who gave another kind of file needs to see once: the layout a line must have.
LAYOUT = 'chat JSONL has one {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]} a line'


def read_chat_jsonl(path: str, on_bad_line: str = "fail") -> tuple[list[list[dict]], list[str]]:
    """Conversations of a chat JSONL file, and the problems of the lines skipped (`on_bad_line="skip"`).

    With "fail" the first bad line raises ChatFormatError naming the file and line. Blank lines are ignored.
    Lines are decoded one by one, so invalid UTF-8 is reported on its own line (and can be skipped).
    """
    if on_bad_line not in ("fail", "skip"):
        raise ValueError(f"on_bad_line must be 'fail' or 'skip', got {on_bad_line!r}")
    convs, skipped = [], []
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"chat data not found: {path}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ChatFormatError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ChatFormatError(f"malformed JSON ({e.msg} at column {e.colno}); {LAYOUT}") from None
                if not isinstance(obj, dict) or "messages" not in obj:
                    raise ChatFormatError(f'expected an object with a "messages" list; {LAYOUT}')
                convs.append(validate_messages(obj["messages"]))
            except ChatFormatError as e:
                msg = f"{path}:{lineno}: {e}"
                if on_bad_line == "fail":
                    raise ChatFormatError(msg + " (use --on-bad-line skip to skip such lines)") from None
                skipped.append(msg)
    if not convs:
        raise ChatFormatError(f"{path}: no usable conversations" + (f" ({len(skipped)} bad lines)" if skipped else ""))
    return convs, skipped


_VAL_WORD = re.compile(r"(val|valid|validation)(set)?\d*")


def is_val_file(name: str) -> bool:
    """`val.jsonl`, `val1.jsonl`, `valid_b.jsonl`, `az_chat_val.jsonl`: "val" as the first or last word of the name.

    A word, not a prefix: `values.jsonl` and `part_b_values.jsonl` are training data.
    """
    words = re.split(r"[-_.]", os.path.basename(name).removesuffix(".jsonl").lower())
    return bool(_VAL_WORD.fullmatch(words[0]) or _VAL_WORD.fullmatch(words[-1]))


def chat_files(data: str, val_data: str | None) -> tuple[list[str], list[str]]:
    """Train and val JSONL files. A --data directory: `val*.jsonl` / `*_val.jsonl` validate, `train*.jsonl`
    (or, without any, every other `*.jsonl`) train. A --val-data directory: all its `*.jsonl` validate."""

    def listing(d: str) -> list[str]:
        return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".jsonl"))

    if not os.path.exists(data):
        raise FileNotFoundError(f"chat data not found: {data}")
    if os.path.isdir(data):
        names = listing(data)
        val = [f for f in names if is_val_file(f)]
        train = [f for f in names if os.path.basename(f).startswith("train")] or [f for f in names if f not in val]
        if not train:
            raise FileNotFoundError(f"no training .jsonl files in {data} (expected train*.jsonl or *.jsonl)")
    else:
        train, val = [data], []
    if val_data:
        if not os.path.exists(val_data):
            raise FileNotFoundError(f"val data not found: {val_data}")
        val = listing(val_data) if os.path.isdir(val_data) else [val_data]
        if not val:
            raise FileNotFoundError(f"no .jsonl files in {val_data}")
    for f in train + val:  # a FIFO would be read once (or block until written to), a directory not at all
        if not os.path.isfile(f):
            raise ValueError(f"{f}: {describe(f)}, where a chat .jsonl file belongs")
    return train, val


def read_chat_files(files: list[str], on_bad_line: str) -> tuple[list[list[dict]], list[str]]:
    convs, skipped = [], []
    for f in files:
        c, s = read_chat_jsonl(f, on_bad_line)
        convs += c
        skipped += s
    return convs, skipped


def encode_all(convs: list[list[dict]], tok, max_len: int, last_turn_only: bool) -> tuple[list, int]:
    """Each conversation as (ids, labels), and how many were dropped for leaving no assistant token to train."""
    out, dropped = [], 0
    for messages in convs:
        try:
            out.append(encode_chat(messages, tok, max_len=max_len, last_turn_only=last_turn_only))
        except NothingToTrain:
            dropped += 1
    return out, dropped
