"""The byte-level BPE: round trips, special tokens only from explicit use, AutoTokenizer parity, corpus reading."""

import gzip
import hashlib
import json
import os
import unicodedata

import pytest

from minilm_az import tokenizer as tk
from minilm_az.prep import readers
from minilm_az.prep.fertility import fertility, format_fertility

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TRAIN = [os.path.join(ROOT, "data", "az", f) for f in ("mediawiki.txt", "kde.txt", "django.txt")]
FIREFOX = os.path.join(ROOT, "data", "az", "firefox.txt")

AZ_TEXTS = [
    "Azərbaycan dili türk dilləri ailəsinin oğuz qrupuna daxildir.",
    "ƏLİYEV İSMAYIL, ığdır, İstanbul, IŞIQ: ə ğ ı İ ö ü ç ş Ə Ğ I Ö Ü Ç Ş",
    "Кириллица: Азәрбајҹан дили; mixed Latin/Кирил in one line",
    "Emoji 🇦🇿 👍🏽 ❤️ and 漢字, ქართული, العربية",
    "  leading and trailing spaces  \n\nnew paragraph\ttab\r\nCRLF\n",
    "Rəqəmlər 1234567 və 3.14159, 2024-ci il",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return tk.train_tokenizer(readers.iter_documents(DEMO_TRAIN), vocab_size=1000, progress=False)


@pytest.fixture(scope="module")
def tok_dir(tok, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    tk.write_tokenizer_files(tok, d)
    return d


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


# --- round trips and the byte alphabet ---------------------------------------------------------------


def test_decode_encode_round_trips_azerbaijani_cyrillic_emoji(tok):
    for text, ids in zip(AZ_TEXTS, tk.encode_plain(tok, AZ_TEXTS)):
        assert decode(tok, ids) == text


def test_nfd_input_decodes_to_nfc(tok):
    nfc = "Şəki, Gəncə, Göyçay, Ağdaş, İsmayıllı"
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfd != nfc
    [ids_nfd, ids_nfc] = tk.encode_plain(tok, [nfd, nfc])
    assert ids_nfd == ids_nfc
    assert decode(tok, ids_nfd) == nfc


def test_all_256_bytes_are_tokens_so_unseen_scripts_encode(tok):
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = tok.get_vocab()
    assert all(ch in vocab for ch in ByteLevel.alphabet())
    # letters, digits, symbols of many scripts (no combining marks: their order is up to NFC tables)
    chars = (chr(c) for c in range(0x20, 0x30000, 13))
    text = "".join(c for c in chars if unicodedata.category(c)[0] in "LNPS" and unicodedata.normalize("NFC", c) == c)
    [ids] = tk.encode_plain(tok, [text + "\x00\x01\x7f"])
    assert decode(tok, ids) == text + "\x00\x01\x7f"


def test_no_lowercasing_dotted_and_dotless_i_stay_distinct(tok):
    ids = tk.encode_plain(tok, ["I", "ı", "İ", "i"])
    assert len({tuple(x) for x in ids}) == 4
    assert [decode(tok, x) for x in ids] == ["I", "ı", "İ", "i"]


# --- special tokens -----------------------------------------------------------------------------------


def test_special_tokens_take_the_first_ids_in_order(tok):
    assert [tok.token_to_id(s) for s in tk.SPECIAL_TOKENS] == list(range(len(tk.SPECIAL_TOKENS)))
    assert tok.get_vocab_size() == 1000
    assert len(set(tk.SPECIAL_TOKENS)) == len(tk.SPECIAL_TOKENS)
    assert {tk.BOS, tk.EOS, tk.START_HEADER, tk.END_HEADER, tk.EOT, tk.PAD} <= set(tk.SPECIAL_TOKENS)


def test_special_token_strings_in_text_encode_as_plain_text(tok):
    n = len(tk.SPECIAL_TOKENS)
    texts = [f"Salam {s} dünya{s}" for s in tk.SPECIAL_TOKENS]
    for text, ids in zip(texts, tk.encode_plain(tok, texts)):
        assert min(ids) >= n, text
        assert decode(tok, ids) == text
    assert tok.encode_special_tokens is False  # encode_plain restored the flag


def test_special_tokens_come_only_from_explicit_use(tok):
    assert tok.encode(tk.EOT).ids == [tok.token_to_id(tk.BOS), tok.token_to_id(tk.EOT)]
    assert tok.encode("Salam").ids[0] == tok.token_to_id(tk.BOS)  # BOS prepended, as Llama 3's
    assert tk.encode_plain(tok, ["Salam"])[0][0] != tok.token_to_id(tk.BOS)


# --- files and AutoTokenizer parity -------------------------------------------------------------------


def test_autotokenizer_gives_the_same_ids(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    texts = [t for t in AZ_TEXTS if t]
    for text, plain in zip(texts, tk.encode_plain(tok, texts)):
        assert hf(text)["input_ids"] == tok.encode(text).ids
        assert hf(text, add_special_tokens=False)["input_ids"] == plain
        assert hf.decode(plain) == text
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (tk.BOS, tk.EOS, tk.PAD)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == tuple(
        tok.token_to_id(s) for s in (tk.BOS, tk.EOS, tk.PAD)
    )
    assert len(hf) == tok.get_vocab_size()


def test_chat_template_equals_hand_built_ids(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    messages = [
        {"role": "system", "content": "Sən köməkçisən."},
        {"role": "user", "content": "  Salam!\nNecəsən? "},
        {"role": "assistant", "content": "Yaxşıyam, sağ ol.\n"},
    ]
    got = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    got = got["input_ids"] if not isinstance(got, list) else got
    sid = tok.token_to_id
    want = [sid(tk.BOS)]
    for m in messages + [{"role": "assistant", "content": None}]:
        [role, body] = tk.encode_plain(tok, [m["role"], "\n\n" + (m["content"] or "")])
        want += [sid(tk.START_HEADER)] + role + [sid(tk.END_HEADER)] + body
        if m["content"] is not None:
            want.append(sid(tk.EOT))
    assert got == want
    text = hf.apply_chat_template(messages[:1], tokenize=False)
    assert text == f"{tk.BOS}{tk.START_HEADER}system{tk.END_HEADER}\n\nSən köməkçisən.{tk.EOT}"


def test_tokenizer_hash_is_sha256_of_tokenizer_json(tok_dir):
    path = os.path.join(tok_dir, "tokenizer.json")
    with open(path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    assert tk.tokenizer_hash(tok_dir) == tk.tokenizer_hash(path) == want


def test_load_tokenizer_accepts_dir_or_file_and_names_missing_path(tok, tok_dir, tmp_path):
    a = tk.load_tokenizer(tok_dir)
    b = tk.load_tokenizer(os.path.join(tok_dir, "tokenizer.json"))
    assert a.encode("Salam").ids == b.encode("Salam").ids == tok.encode("Salam").ids
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        tk.load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        tk.load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        tk.load_tokenizer(str(tmp_path))


def test_copy_tokenizer_files_keeps_the_bytes(tok_dir, tmp_path):
    dst = str(tmp_path / "export")
    assert tk.copy_tokenizer_files(tok_dir, dst) == list(tk.TOKENIZER_FILES)
    for name in tk.TOKENIZER_FILES:
        with open(os.path.join(tok_dir, name), "rb") as a, open(os.path.join(dst, name), "rb") as b:
            assert a.read() == b.read()
    # a bare tokenizer.json gets the two config files written for it
    only = tmp_path / "only"
    only.mkdir()
    os.link(os.path.join(tok_dir, "tokenizer.json"), only / "tokenizer.json")
    tk.copy_tokenizer_files(str(only / "tokenizer.json"), str(tmp_path / "export2"))
    with open(tmp_path / "export2" / "tokenizer_config.json") as f:
        assert json.load(f)["chat_template"] == tk.CHAT_TEMPLATE


def test_token_byte_lengths_sum_to_utf8_bytes(tok):
    lengths = tk.token_byte_lengths(tok)
    texts = [unicodedata.normalize("NFC", t) for t in AZ_TEXTS]
    for text, ids in zip(texts, tk.encode_plain(tok, texts)):
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[: len(tk.SPECIAL_TOKENS)].sum() == 0


# --- training input checks ----------------------------------------------------------------------------


def test_vocab_smaller_than_bytes_plus_specials_is_rejected():
    with pytest.raises(ValueError, match=f"at least {tk.MIN_VOCAB_SIZE}"):
        tk.train_tokenizer(["salam"], vocab_size=tk.MIN_VOCAB_SIZE - 1, progress=False)
    smallest = tk.train_tokenizer(["salam dünya"], vocab_size=tk.MIN_VOCAB_SIZE, progress=False)
    assert smallest.get_vocab_size() == tk.MIN_VOCAB_SIZE


def test_empty_corpus_is_rejected(tmp_path):
    (tmp_path / "empty.txt").write_text("\n  \n\n")
    with pytest.raises(readers.CorpusError, match="corpus is empty.*empty.txt"):
        tk.train_tokenizer(readers.iter_documents([str(tmp_path / "empty.txt")]), 1000, progress=False)
    with pytest.raises(ValueError, match="corpus is empty"):
        tk.train_tokenizer([], 1000, progress=False)


# --- corpus reading -----------------------------------------------------------------------------------


def docs(paths, **kw):
    return list(readers.iter_documents(readers.corpus_files(paths), **kw))


def test_txt_is_a_document_a_line_or_blank_separated(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes("\ufeffbir\r\niki üç\n\n  \ndörd\nbeş\n\n\naltı".encode())
    assert docs([str(p)]) == ["bir", "iki üç", "dörd", "beş", "altı"]
    assert docs([str(p)], doc_sep="blank") == ["bir\niki üç", "dörd\nbeş", "altı"]


def test_jsonl_and_gz_and_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.jsonl").write_text('{"text": "ikinci"}\n\n{"text": "üçüncü", "id": 3}\n')
    with gzip.open(tmp_path / "sub" / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write("dördüncü\nbeşinci\n")
    with gzip.open(tmp_path / "sub" / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"body": "altıncı"}) + "\n")
    (tmp_path / "a.txt").write_text("birinci\n")
    (tmp_path / "README.md").write_text("not corpus\n")
    (tmp_path / "build.py").write_text("print()\n")
    files = readers.corpus_files([str(tmp_path)])
    assert [os.path.relpath(f, tmp_path) for f in files] == ["a.txt", "b.jsonl", "sub/c.txt.gz", "sub/d.jsonl.gz"]
    with pytest.raises(readers.CorpusError, match=r"d\.jsonl\.gz:1: expected an object with a string 'text' field"):
        docs([str(tmp_path)])
    assert docs(files[:3]) == ["birinci", "ikinci", "üçüncü", "dördüncü", "beşinci"]
    assert docs(files[3:], text_field="body") == ["altıncı"]


def test_non_utf8_names_file_and_byte_offset(tmp_path):
    p = tmp_path / "bad.txt"
    raw = "sağ\n".encode() + b"sol \xff\n"
    p.write_bytes(raw)
    at = raw.index(b"\xff")
    with pytest.raises(readers.CorpusError, match=rf"bad\.txt: not valid UTF-8 at byte offset {at} \(line 2\)"):
        docs([str(p)])
    assert docs([str(p)], errors="replace") == ["sağ", "sol \ufffd"]
    g = tmp_path / "bad.txt.gz"
    g.write_bytes(gzip.compress(raw))
    with pytest.raises(readers.CorpusError, match=rf"bad\.txt\.gz: not valid UTF-8 at byte offset {at}"):
        docs([str(g)])


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "yaxşı"}\n{"text": "pis"\n')
    with pytest.raises(readers.CorpusError, match=r"x\.jsonl:2: malformed JSON line"):
        docs([str(p)])
    p.write_text('{"text": 5}\n')
    with pytest.raises(readers.CorpusError, match=r"x\.jsonl:1: .*'text' field \(got int\)"):
        docs([str(p)])


def test_missing_path_unsupported_file_and_empty_directory(tmp_path):
    with pytest.raises(readers.CorpusError, match="corpus path not found: .*nope"):
        readers.corpus_files([str(tmp_path / "nope")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(readers.CorpusError, match=r"x\.csv: unsupported corpus file"):
        readers.corpus_files([str(tmp_path / "x.csv")])
    with pytest.raises(readers.CorpusError, match="no corpus files"):
        readers.corpus_files([str(tmp_path)])


# --- fertility ----------------------------------------------------------------------------------------


def test_fertility_counts_words_bytes_and_tokens_on_the_same_text(tok):
    texts = [line.rstrip("\n") for line in open(FIREFOX, encoding="utf-8")][:200]
    r = fertility({"a": tok, "b": tok}, texts, batch_docs=64)
    assert r["a"] == r["b"]
    assert r["a"]["documents"] == 200
    assert r["a"]["words"] == sum(len(t.split()) for t in texts)
    assert r["a"]["bytes"] == sum(len(t.encode()) for t in texts)
    assert r["a"]["tokens"] == sum(map(len, tk.encode_plain(tok, texts)))
    assert r["a"]["tokens_per_word"] == pytest.approx(r["a"]["tokens"] / r["a"]["words"])
    assert "tok/word" in format_fertility({"firefox": r})
