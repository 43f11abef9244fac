"""Byte-level BPE for Azerbaijani: training, the special tokens, tokenizer files (fertility: prep/fertility.py).

The tokenizer is a Hugging Face `tokenizers` BPE over bytes, set up like Llama 3's:

- normaliser NFC only (no lowercasing, because Azerbaijani I/ı and İ/i are not ASCII casing);
- the Llama-3 (GPT-4 style) split regex, then the byte-level alphabet (all 256 bytes are tokens,
  so any input encodes and there is no unknown token);
- the special tokens at the START of the vocabulary, ids 0..len(SPECIAL_TOKENS)-1 in the order of
  `SPECIAL_TOKENS` (BOS=0, EOS=1, ...), then the 256 bytes, then the merges;
- `encode(text)` with special tokens on prepends `<|begin_of_text|>`, as Llama 3's does.

User text is encoded with `encode_plain`: special-token strings in it (a literal `<|eot_id|>`)
become ordinary text tokens, never control tokens, and no BOS/EOS is added.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterable

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from minilm_az.outputs import atomic_write_json, atomic_write_text, describe, file_sha256, same_file, staged_output

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|finetune_right_pad_id|>"
NUM_RESERVED = 10
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT, PAD] + [
    f"<|reserved_special_token_{i}|>" for i in range(NUM_RESERVED)
]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Llama 3's pre-tokenizer regex (tiktoken cl100k-style): contractions, letter runs with one optional
# leading non-letter, numbers in groups of up to 3 digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3's chat format. Content is not stripped, so hand-built ids (specials + encode_plain of the
# text between them) equal `AutoTokenizer.apply_chat_template(..., tokenize=True)` exactly.
CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --- the tokenizer ----------------------------------------------------------------------------------


def _special(content: str) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def new_tokenizer() -> Tokenizer:
    """An untrained tokenizer with our normaliser, pre-tokeniser, decoder and BOS post-processor."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _set_post_processor(tok: Tokenizer) -> None:
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )


def train_tokenizer(
    documents: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    max_token_length: int | None = None,
    progress: bool = True,
) -> Tokenizer:
    """Train the byte-level BPE on a stream of documents; `vocab_size` counts specials and bytes.

    Raises ValueError for a vocab size below bytes + specials, and for an empty corpus.
    The result can be smaller than `vocab_size` when the corpus runs out of pairs to merge.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab size {vocab_size} is too small: it must hold the 256 bytes and "
            f"{len(SPECIAL_TOKENS)} special tokens (at least {MIN_VOCAB_SIZE})"
        )
    if vocab_size >= 2**31:  # past this, the trainer's own integers overflow (a Rust panic, not an error)
        raise ValueError(f"vocab size {vocab_size} is too large: ids must fit 31 bits (below {2**31:,})")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    tok = new_tokenizer()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[_special(s) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=progress,
    )
    documents = iter(documents)
    first = next(documents, None)
    if first is None:
        raise ValueError("corpus is empty: no documents to train on")
    tok.train_from_iterator(itertools.chain([first], documents), trainer)
    _set_post_processor(tok)
    return tok


def _tokenizer_json(path: str) -> str:
    json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if os.path.isfile(json_path):
        return json_path
    if os.path.lexists(json_path):  # a directory, a dangling link, a FIFO: say what is there, not that nothing is
        raise ValueError(f"{json_path}: {describe(json_path)}, where a tokenizer.json file belongs")
    message = f"no tokenizer.json in {path}" if os.path.isdir(path) else f"tokenizer not found: {path}"
    raise FileNotFoundError(message)


def load_tokenizer(path: str) -> Tokenizer:
    """Load `tokenizer.json` from a directory holding it, or from the file itself."""
    json_path = _tokenizer_json(path)
    try:
        return Tokenizer.from_file(json_path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{json_path}: not a valid tokenizer.json ({e})") from None


def tokenizer_hash(path: str) -> str:
    """The sha256 of `tokenizer.json` (dir or file), which token shards store to name their tokenizer."""
    return file_sha256(_tokenizer_json(path))


def check_model_tokenizer(model_dir: str, tokenizer: str | None, flag: str) -> None:
    """Raise ValueError if `tokenizer` is not the one saved in `model_dir` (compared by hash), or if `model_dir` has
    no tokenizer.json to compare it with: a model is known by its own tokenizer, and any other would be taken
    silently (a BPB of the wrong ids, a merged model shipped with the wrong tokenizer). The caller checks the vocab."""
    own = os.path.join(model_dir, "tokenizer.json")
    if not tokenizer:
        return
    if not os.path.isfile(own):
        if os.path.isdir(tokenizer) and same_file(tokenizer, model_dir):
            return  # the model dir is its own tokenizer dir: loading it says what is missing
        raise ValueError(
            f"{model_dir} has no tokenizer.json, so {flag} {tokenizer} cannot be checked against it; put the "
            "model's own tokenizer files (tokenizer.json, tokenizer_config.json) into it"
        )
    model_hash = tokenizer_hash(own)
    given_hash = tokenizer_hash(tokenizer)
    if model_hash != given_hash:
        raise ValueError(
            f"{flag} {tokenizer} is not the tokenizer of {model_dir} (tokenizer.json {given_hash[:12]} vs "
            f"the model's {model_hash[:12]}): pass the model's own tokenizer"
        )


def model_tokenizer(model_dir: str, tokenizer: str, flag: str) -> Tokenizer:
    """The tokenizer at `tokenizer`, loaded once check_model_tokenizer has found it is `model_dir`'s own."""
    check_model_tokenizer(model_dir, tokenizer, flag)
    return load_tokenizer(tokenizer)


def eos_id(tok: Tokenizer) -> int:
    """The id of the end-of-text token, spelled as ours, GPT-2's or SentencePiece's."""
    for name in (EOS, "<|endoftext|>", "</s>"):
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise ValueError("the tokenizer has no end-of-text token (<|end_of_text|>, <|endoftext|> or </s>)")


def encode_plain(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Batch-encode user text with special-token matching off and no BOS/EOS added.

    Flips `tok.encode_special_tokens` for the call (restored after), so do not share one Tokenizer
    object between threads that encode at the same time.
    """
    before = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # the fast one skips offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    finally:
        tok.encode_special_tokens = before


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """The number of UTF-8 bytes each id stands for (int64, 0 for special tokens). BPB sums them.

    Valid for byte-level BPE (ours, Llama 3's), where each character of a token is one byte.
    """
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i not in special:
            lengths[i] = len(token)
    return lengths


# --- tokenizer files --------------------------------------------------------------------------------


def _tokenizer_config(tok: Tokenizer, model_max_length: int | None) -> dict:
    added = tok.get_added_tokens_decoder()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD if tok.token_to_id(PAD) is not None else None,  # AutoTokenizer adds a missing PAD
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length if model_max_length is not None else int(1e30),
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(added.items())
        },
    }


def write_tokenizer_files(tok: Tokenizer, out_dir: str, model_max_length: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json.

    `AutoTokenizer.from_pretrained(out_dir)` then gives the same ids as `tok`. Existing files are replaced.
    """
    missing = [s for s in (BOS, EOS, PAD, START_HEADER, END_HEADER, EOT) if tok.token_to_id(s) is None]
    if missing:
        raise ValueError(f"tokenizer lacks the special tokens {missing}; use copy_tokenizer_files for others")
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_text(os.path.join(out_dir, "tokenizer.json"), tok.to_str(pretty=True))
    atomic_write_json(os.path.join(out_dir, "tokenizer_config.json"), _tokenizer_config(tok, model_max_length))
    atomic_write_json(
        os.path.join(out_dir, "special_tokens_map.json"), {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    )


def check_unchanged(src: str, tok: Tokenizer, copy: str | None = None) -> None:
    """Raise ValueError if the tokenizer at `src` (or its `copy`) is no longer `tok`, the one the run read at its
    start: an export would ship one retrained or replaced there meanwhile beside weights trained on `tok`'s ids."""
    if load_tokenizer(copy or src).to_str() != tok.to_str():
        msg = "changed since this run read it: the export would ship another tokenizer with this model"
        raise ValueError(f"{_tokenizer_json(src)} {msg}; restore it and rerun with --resume to export")


def copy_tokenizer_files(src: str, dst_dir: str, same_as: Tokenizer | None = None) -> list[str]:
    """Copy the tokenizer files of `src` (a dir, or a tokenizer.json) into `dst_dir`, bytes unchanged.

    tokenizer.json must exist; a missing tokenizer_config.json or special_tokens_map.json is written
    from ours (which needs our special tokens). With `same_as`, the copy must be that tokenizer (check_unchanged),
    else nothing is written. Returns the file names written.
    """
    src_json = _tokenizer_json(src)
    src_dir = os.path.dirname(os.path.abspath(src_json))
    with staged_output(dst_dir, stage="tokenizer") as tmp:  # like every output: staged, recorded in the marker
        for name in TOKENIZER_FILES:
            src_file = src_json if name == "tokenizer.json" else os.path.join(src_dir, name)
            if os.path.isfile(src_file):
                shutil.copyfile(src_file, os.path.join(tmp, name))
                if name == "tokenizer.json" and same_as is not None:  # the bytes shipped, not a second read
                    check_unchanged(src, same_as, os.path.join(tmp, name))
            else:
                config = _tokenizer_config(load_tokenizer(src_json), None)
                if name == "special_tokens_map.json":
                    config = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
                atomic_write_json(os.path.join(tmp, name), config)
    return list(TOKENIZER_FILES)
