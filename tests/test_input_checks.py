"""Corpus inputs are checked at the boundary: a truncated compressed file is an error that names it, a corpus
directory names the files it skips, and a .json file is read as JSON lines or refused by name before any work.

(index.json's checks are in test_shards.py, beside the format they check.)"""

import gzip
import io
import json
import os

import pytest

from minilm_az.outputs import MARKER
from minilm_az.prep import readers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDE = os.path.join(ROOT, "data", "az", "kde.txt")


def kde_bytes() -> bytes:
    with open(KDE, "rb") as f:
        return f.read()


def read(path) -> list[str]:
    return list(readers.iter_documents(readers.corpus_files([str(path)])))


# ---------------------------------------------------------------- compressed files are read to their end


def zst_files() -> dict[str, bytes]:
    """kde.txt as one zstd frame, as two frames, and as zstd's streaming writer makes it (many blocks, one frame)."""
    zstandard = pytest.importorskip("zstandard")
    data, c = kde_bytes(), zstandard.ZstdCompressor()
    buf = io.BytesIO()
    with c.stream_writer(buf, closefd=False) as w:
        for i in range(0, len(data), 5000):
            w.write(data[i : i + 5000])
    return {
        "one_frame": c.compress(data),
        "two_frames": c.compress(data[:100_000]) + c.compress(data[100_000:]),
        "streamed": buf.getvalue(),
    }


@pytest.mark.parametrize("kind", ["one_frame", "two_frames", "streamed"])
def test_a_truncated_zst_is_an_error_naming_the_file_and_a_whole_one_reads_whole(tmp_path, kind):
    packed = zst_files()[kind]
    whole = tmp_path / "whole.txt.zst"
    whole.write_bytes(packed)
    assert read(whole) == read(KDE)
    for cut in (len(packed) // 2, len(packed) - 1, len(packed) - 4):  # a copy that stopped halfway, or just short
        half = tmp_path / f"cut{cut}.txt.zst"
        half.write_bytes(packed[:cut])
        with pytest.raises(readers.CorpusError, match=rf"cut{cut}\.txt\.zst: cannot read .*truncated"):
            read(half)


def test_trailing_garbage_after_a_zst_frame_is_an_error(tmp_path):
    (tmp_path / "x.jsonl.zst").write_bytes(zst_files()["one_frame"] + b"not a frame")
    with pytest.raises(readers.CorpusError, match=r"x\.jsonl\.zst: cannot read"):
        read(tmp_path / "x.jsonl.zst")


def test_a_truncated_gz_is_an_error_naming_the_file(tmp_path):
    packed = gzip.compress(kde_bytes())
    for cut in (len(packed) // 2, len(packed) - 1):  # inside the deflate stream, inside the trailer
        (tmp_path / "cut.txt.gz").write_bytes(packed[:cut])
        with pytest.raises(readers.CorpusError, match=r"cut\.txt\.gz: cannot read"):
            read(tmp_path / "cut.txt.gz")


def test_a_truncated_parquet_is_an_error_naming_the_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = kde_bytes().decode().splitlines()
    pq.write_table(pa.table({"text": lines}), tmp_path / "whole.parquet", row_group_size=500)
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(readers.CorpusError, match=r"cut\.parquet: not a readable Parquet file"):
        read(tmp_path / "cut.parquet")


# ---------------------------------------------------------------- a corpus directory names what it skips


def test_a_pipe_named_like_a_corpus_file_is_skipped_and_named_not_read(tmp_path, capsys):
    # issue 29's audit: a FIFO `pipe.txt` in a corpus dir made encode wait forever for a writer
    (tmp_path / "a.txt").write_text("birinci\n")
    os.mkfifo(tmp_path / "pipe.txt")
    assert readers.corpus_files([str(tmp_path)]) == [str(tmp_path / "a.txt")]
    assert "skipped 1 files that are not corpus files: pipe.txt" in capsys.readouterr().err


def test_a_corpus_directory_names_the_files_it_skips_on_stderr(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("birinci\n")
    (tmp_path / "notes.md").write_text("not corpus\n")
    (tmp_path / "sub" / "data.csv").write_text("a,b\n")
    (tmp_path / "sub" / "b.json.gz").write_bytes(gzip.compress(b'{"text": "x"}\n'))  # not a kind we read
    # tokenize.py clean's own report and marker, and hidden files, are not corpus and not worth a warning
    (tmp_path / "clean_report.json").write_text(json.dumps({"documents_in": 1}, indent=2))
    (tmp_path / MARKER).write_text(json.dumps({"outputs": []}, indent=2))
    (tmp_path / ".lock").write_text("")
    assert readers.corpus_files([str(tmp_path)]) == [str(tmp_path / "a.txt")]
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        f"warning: {tmp_path}: skipped 3 files that are not corpus files: notes.md, sub/b.json.gz, sub/data.csv"
    ]


def test_a_directory_of_only_corpus_files_warns_nothing(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("birinci\n")
    readers.corpus_files([str(tmp_path)])
    assert capsys.readouterr().err == ""


def test_a_json_file_of_json_lines_is_read_like_jsonl(tmp_path):
    (tmp_path / "docs.json").write_text('\ufeff{"text": "bir"}\n\n{"text": "iki", "id": 2}\n', encoding="utf-8")
    (tmp_path / "z.txt").write_text("üç\n")
    assert read(tmp_path) == ["bir", "iki", "üç"]
    assert read(tmp_path / "docs.json") == ["bir", "iki"]


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"text": "bir"}, indent=2),  # one pretty-printed object: its first line is "{"
        json.dumps([{"text": "bir"}, {"text": "iki"}]),  # an array on one line
        '"just a string"\n',
    ],
    ids=["pretty_object", "array", "string"],
)
def test_a_json_file_that_is_not_json_lines_is_refused_by_name_before_reading(tmp_path, text):
    (tmp_path / "a.txt").write_text("birinci\n")
    (tmp_path / "meta.json").write_text(text)
    for path in (tmp_path, tmp_path / "meta.json"):
        with pytest.raises(readers.CorpusError, match=r"meta\.json: a \.json corpus file must be JSON lines"):
            readers.corpus_files([str(path)])  # refused while listing, before any file is read


def test_a_json_lines_file_with_a_bad_later_line_names_the_line(tmp_path):
    (tmp_path / "x.json").write_text('{"text": "bir"}\n{"text": 5}\n')
    with pytest.raises(readers.CorpusError, match=r"x\.json:2: expected an object with a string 'text' field"):
        read(tmp_path / "x.json")
