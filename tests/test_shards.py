"""Token shards: index counts match, tokens decode back to the documents, the split is deterministic."""

import functools
import json
import os
import shutil
import unicodedata

import numpy as np
import pytest

from minilm_az import shards
from minilm_az import tokenizer as tk
from minilm_az.prep import readers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = [os.path.join(ROOT, "data", "az", f) for f in ("mediawiki.txt", "kde.txt", "django.txt", "firefox.txt")]


@pytest.fixture(scope="module")
def tok():
    return tk.train_tokenizer(readers.iter_documents(DEMO[:1]), vocab_size=600, progress=False)


@pytest.fixture(scope="module")
def docs():
    texts = list(readers.iter_documents(DEMO))
    # a literal special token, an NFD document and a duplicate: all must come back as text
    return texts + [f"Mətn {tk.EOS} və {tk.EOT} içində", unicodedata.normalize("NFD", "Şəki İsmayıllı"), texts[0]]


def write(tok, out, documents, **kw):
    return shards.write_shards(
        documents,
        str(out),
        encode=functools.partial(tk.encode_plain, tok),
        vocab_size=tok.get_vocab_size(),
        eos_id=tok.token_to_id(tk.EOS),
        tokenizer_hash="h" * 64,
        **kw,
    )


@pytest.fixture(scope="module")
def shard_dir(tok, docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "s"
    write(tok, out, docs, val_fraction=0.2, shard_tokens=10_000, batch_bytes=20_000)
    return str(out)


def split_docs(docs, split):
    nfc = [unicodedata.normalize("NFC", d) for d in docs]
    return [d for d in nfc if shards.split_of(d, 0.2) == split]


def test_index_counts_match_the_documents_and_files(shard_dir, docs):
    index = shards.load_index(shard_dir)
    assert index["format"] == 1 and index["dtype"] == "uint16" and index["vocab_size"] == 600
    assert index["eos_id"] == 1
    for split in ("train", "val"):
        info, want = index["splits"][split], split_docs(docs, split)
        assert info["documents"] == len(want)
        assert info["bytes"] == sum(len(d.encode("utf-8")) for d in want)
        assert info["tokens"] == sum(s["tokens"] for s in info["shards"])
        for s in info["shards"]:
            assert os.path.getsize(os.path.join(shard_dir, s["file"])) == 2 * s["tokens"]
    assert len(index["splits"]["train"]["shards"]) > 5  # rolled over every 10k tokens
    assert index["splits"]["val"]["documents"] / len(docs) == pytest.approx(0.2, abs=0.03)


def test_tokens_decode_back_to_the_documents_in_order(shard_dir, docs, tok):
    for split in ("train", "val"):
        stream = shards.TokenStream(shard_dir, split)
        spans = list(stream.documents(chunk_tokens=4096))
        got = [tok.decode(stream.get(a, b - a).tolist(), skip_special_tokens=False) for a, b in spans]
        assert got == split_docs(docs, split)
        assert len(spans) == stream.num_documents


def test_bytes_in_the_index_equal_the_bytes_the_tokens_stand_for(shard_dir, tok):
    lengths = tk.token_byte_lengths(tok)
    for split in ("train", "val"):
        stream = shards.TokenStream(shard_dir, split)
        assert int(lengths[stream.get(0, stream.num_tokens)].sum()) == stream.num_bytes


def test_get_reads_windows_across_shard_boundaries(shard_dir):
    stream = shards.TokenStream(shard_dir, "train")
    index = stream.index["splits"]["train"]
    whole = np.concatenate(
        [np.fromfile(os.path.join(shard_dir, s["file"]), dtype="<u2") for s in index["shards"]]
    ).astype(np.int64)
    assert stream.num_tokens == len(whole)
    boundary = index["shards"][0]["tokens"]
    for start, length in [(0, 5), (boundary - 3, 7), (boundary - 3, 3 * 10_000 + 9), (len(whole) - 4, 4), (7, 0)]:
        window = stream.get(start, length)
        assert window.dtype == np.int64 and window.flags["C_CONTIGUOUS"]
        assert np.array_equal(window, whole[start : start + length])
    with pytest.raises(IndexError, match="outside"):
        stream.get(len(whole) - 2, 3)
    with pytest.raises(IndexError):
        stream.get(-1, 2)


def test_split_is_deterministic_and_keeps_duplicates_together(tok, docs, shard_dir, tmp_path):
    write(tok, tmp_path / "again", docs, val_fraction=0.2, shard_tokens=10_000, batch_bytes=7_000)
    a, b = shards.load_index(shard_dir), shards.load_index(str(tmp_path / "again"))
    assert a == b  # different batch sizes, same shards
    for s in a["splits"]["train"]["shards"] + a["splits"]["val"]["shards"]:
        with open(os.path.join(shard_dir, s["file"]), "rb") as x, open(tmp_path / "again" / s["file"], "rb") as y:
            assert x.read() == y.read()
    assert shards.split_of(docs[0], 0.2) == shards.split_of(docs[-1], 0.2)
    assert shards.split_of("salam", 0.0) == "train"


def test_a_separate_val_corpus_takes_the_whole_val_split(tok, tmp_path):
    index = write(tok, tmp_path / "s", ["bir iki", "üç dörd"], val_documents=["beş altı"])
    assert index["splits"]["train"]["documents"] == 2
    assert index["splits"]["val"]["documents"] == 1
    stream = shards.TokenStream(str(tmp_path / "s"), "val")
    assert tok.decode(stream.get(0, stream.num_tokens).tolist(), skip_special_tokens=False) == f"beş altı{tk.EOS}"


def test_uint32_when_the_vocab_does_not_fit_uint16(tmp_path):
    assert shards.dtype_for(65536) == "uint16" and shards.dtype_for(65537) == "uint32"
    w = shards.ShardWriter(str(tmp_path / "s"), vocab_size=128_256, eos_id=128_001, tokenizer_hash="x")
    w.add("train", np.array([5, 128_000, 70_000, 128_001]), documents=1, nbytes=9)
    assert w.close()["dtype"] == "uint32"
    stream = shards.TokenStream(str(tmp_path / "s"), "train")
    assert stream.get(0, 4).tolist() == [5, 128_000, 70_000, 128_001]
    assert list(stream.documents()) == [(0, 3)]
    assert shards.TokenStream(str(tmp_path / "s"), "val").num_tokens == 0


def test_bad_shard_directories_are_named(tmp_path, shard_dir):
    with pytest.raises(FileNotFoundError, match="no index.json in"):
        shards.load_index(str(tmp_path))
    (tmp_path / "index.json").write_text('{"format": 1, "dtype"')
    with pytest.raises(ValueError, match="index.json: not valid JSON"):
        shards.load_index(str(tmp_path))
    (tmp_path / "index.json").write_text(json.dumps({"format": 2}))
    with pytest.raises(ValueError, match="format 2 is not a supported shard format"):
        shards.load_index(str(tmp_path))
    (tmp_path / "index.json").write_text(json.dumps({"format": 1, "dtype": "uint16"}))
    with pytest.raises(ValueError, match="vocab_size null is not a count"):
        shards.load_index(str(tmp_path))
    with pytest.raises(ValueError, match="no split 'test'"):
        shards.TokenStream(shard_dir, "test")
    # a truncated shard file
    index = shards.load_index(shard_dir)
    (tmp_path / "index.json").write_text(json.dumps(index))
    for split in index["splits"].values():
        for shard in split["shards"]:
            shutil.copyfile(os.path.join(shard_dir, shard["file"]), tmp_path / shard["file"])
    first = index["splits"]["val"]["shards"][0]["file"]
    os.truncate(tmp_path / first, os.path.getsize(tmp_path / first) - 2)
    with pytest.raises(ValueError, match=rf"splits\.val\.shards\[0\]\.file \"{first}\" is \d+ bytes, not"):
        shards.TokenStream(str(tmp_path), "val")


def test_writer_refuses_a_non_empty_directory_and_reading_errors_surface(tok, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        write(tok, tmp_path / "full", ["a"])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xc3(\n")
    with pytest.raises(readers.CorpusError, match=r"bad\.txt: not valid UTF-8 at byte offset 3"):
        write(tok, tmp_path / "out", readers.iter_documents([str(bad)]))


def test_check_tokenizer_rejects_shards_of_another_tokenizer(shard_dir):
    index = shards.load_index(shard_dir)
    shards.check_tokenizer(index, "h" * 64, vocab_size=600)
    with pytest.raises(ValueError, match="written with tokenizer hhhh"):
        shards.check_tokenizer(index, "0" * 64)
    with pytest.raises(ValueError, match="smaller than the shards' 600"):
        shards.check_tokenizer(index, "h" * 64, vocab_size=500)


# ---------------------------------------------------------------- index.json is checked at the boundary


def small_shards(path) -> str:
    """Two train shards and one val shard of a 600-id vocabulary (EOS 1), ids up to 599."""
    w = shards.ShardWriter(str(path), vocab_size=600, eos_id=1, tokenizer_hash="h" * 64, shard_tokens=4)
    w.add("train", np.array([5, 599, 7, 1, 8, 1]), documents=2, nbytes=10)
    w.add("val", np.array([9, 1]), documents=1, nbytes=3)
    w.close()
    return str(path)


def test_encode_records_the_max_token_id_of_each_shard_and_split(tmp_path):
    index = shards.load_index(small_shards(tmp_path / "s"))
    train = index["splits"]["train"]
    assert [s["max_id"] for s in train["shards"]] == [599, 8]
    assert train["max_id"] == 599 and index["splits"]["val"]["max_id"] == 9
    on_disk = json.loads((tmp_path / "s" / "index.json").read_text())
    assert on_disk["splits"]["train"]["shards"][1]["max_id"] == 8  # recorded in the file, not only checked


def set_field(index: dict, dotted: str, value) -> None:
    *parents, last = [int(key) if key.isdigit() else key for key in dotted.split(".")]
    for key in parents:
        index = index[key]
    index[last] = value


SHARD0 = "splits.train.shards.0"


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("format", "1", 'format "1" is not a supported shard format'),
        ("format", True, "format true is not a supported"),
        ("dtype", "int8", 'dtype "int8" is not'),
        ("vocab_size", 70_000, "vocab_size 70000 is not a count that uint16 holds"),
        ("vocab_size", "600", 'vocab_size "600" is not a count'),
        ("eos_id", 600, "eos_id 600 is not a token id below vocab_size 600"),
        ("tokenizer_hash", 5, "tokenizer_hash 5 is not a string"),
        ("splits", [], "splits [] is not an object"),
        ("splits.train", "x", 'splits.train "x" is not an object'),
        ("splits.train.documents", -1, "splits.train {"),
        (SHARD0, "train_00000.bin", 'splits.train.shards[0] "train_00000.bin" is not an object'),
        (f"{SHARD0}.tokens", "4", "splits.train.shards[0] {"),
        (f"{SHARD0}.tokens", 5, 'splits.train.shards[0].file "train_00000.bin" is 8 bytes, not 10 bytes'),
        (f"{SHARD0}.file", "train_00009.bin", 'splits.train.shards[0].file "train_00009.bin" is missing'),
        (f"{SHARD0}.file", "../outside.bin", 'splits.train.shards[0].file "../outside.bin" points outside'),
        (f"{SHARD0}.file", "link.bin", 'splits.train.shards[0].file "link.bin" points outside'),
        (f"{SHARD0}.file", "{outside}", "points outside"),
        ("splits.train.tokens", 7, "splits.train.tokens 7 is not its shards' total 6"),
        (f"{SHARD0}.max_id", 600, "splits.train.shards[0].max_id 600 is not a token id below vocab_size 600"),
        ("splits.train.max_id", 598, "splits.train.max_id 598 is not its shards' max 599"),
    ],
)
def test_index_json_is_checked_field_by_field_in_one_line(tmp_path, field, value, fragment):
    data = small_shards(tmp_path / "s")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 8)  # the size the index asks for: only confinement refuses it
    os.symlink(outside, tmp_path / "s" / "link.bin")
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    set_field(index, field, str(outside) if value == "{outside}" else value)
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    for load in (shards.load_index, shards.TokenStream):  # TokenStream reads through load_index
        with pytest.raises(shards.ShardIndexError) as e:
            load(data)
        message = str(e.value)
        assert message.startswith(f"{data}/index.json: ") and fragment in message and "\n" not in message, message
    assert isinstance(e.value, ValueError)  # what train.py and tokenize.py turn into one line and exit 2


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_shard_listed_twice_or_in_both_splits_is_refused(tmp_path, split):
    # issue 29's audit: a val split made of the train shard scored training data; a shard listed twice trained twice
    data = small_shards(tmp_path / "s")
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    train = index["splits"]["train"]
    index["splits"][split]["shards"].append(dict(train["shards"][0]))
    index["splits"][split]["tokens"] += train["shards"][0]["tokens"]
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(shards.ShardIndexError, match=r'shards\[\d\]\.file "train_00000\.bin" is listed twice'):
        shards.load_index(data)


def test_a_val_shard_that_is_a_hard_link_to_the_train_shard_is_refused(tmp_path):
    data = small_shards(tmp_path / "s")
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    train, val = index["splits"]["train"], index["splits"]["val"]
    os.remove(tmp_path / "s" / val["shards"][0]["file"])
    os.link(tmp_path / "s" / train["shards"][0]["file"], tmp_path / "s" / val["shards"][0]["file"])
    val["shards"][0].update(tokens=train["shards"][0]["tokens"], max_id=train["shards"][0]["max_id"])
    val.update(tokens=train["shards"][0]["tokens"], max_id=train["shards"][0]["max_id"])
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(shards.ShardIndexError, match="is listed twice"):
        shards.load_index(data)


def test_a_symlink_to_a_shard_inside_the_data_dir_is_read(tmp_path):
    data = small_shards(tmp_path / "s")
    os.rename(tmp_path / "s" / "val_00000.bin", tmp_path / "s" / "val.data")
    os.symlink("val.data", tmp_path / "s" / "val_00000.bin")
    assert shards.TokenStream(data, "val").get(0, 2).tolist() == [9, 1]


def test_an_older_index_without_max_ids_is_scanned_and_ids_beyond_the_vocab_refused(tmp_path):
    data = small_shards(tmp_path / "s")
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    for split in index["splits"].values():
        del split["max_id"]
        for shard in split["shards"]:
            del shard["max_id"]
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    loaded = shards.load_index(data)
    assert [s["max_id"] for s in loaded["splits"]["train"]["shards"]] == [599, 8]
    assert loaded["splits"]["train"]["max_id"] == 599
    # The second train shard gets id 650, beyond the 600 the tokenizer has: the scan finds it, the shard is named.
    (tmp_path / "s" / "train_00001.bin").write_bytes(np.array([650, 1], dtype="<u2").tobytes())
    with pytest.raises(shards.ShardIndexError, match=r"splits\.train\.shards\[1\]\.max_id 650 is not a token id below"):
        shards.load_index(data)
