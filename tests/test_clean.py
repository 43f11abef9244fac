"""`tokenize.py clean` and minilm_az/prep/clean.py: the issue's targets on a planted set built from real text
(data/az, data/lid), each step on its own, the MinHash estimate against exact Jaccard, language ID on real
Azerbaijani/Turkish/Russian/English lines, Parquet and zstd input, and the command line as a user runs it."""

import gzip
import io
import json
import os
import random
import sys

import numpy as np
import prefork  # tests/prefork.py (pytest puts this folder on sys.path too)
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from bench.clean_throughput import FOREIGN, planted_set, scores
from minilm_az.prep import clean, dedup, readers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "az")


@pytest.fixture(scope="module")
def planted():
    return planted_set(n_unique=400, n_foreign=40, seed=1)


def tokenize(*args, check=True):
    """`python tokenize.py ARGS --no-progress` in the repository root, as a fork of an interpreter that imported its
    modules once (tests/prefork.py)."""
    cmd = [sys.executable, "tokenize.py", *args, "--no-progress"]
    p = prefork.run(cmd, ROOT, prefork.PLAIN_ENV, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def error_line(p) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr  # one line, no traceback
    return lines[0]


def read_out(out_dir) -> list[str]:
    texts = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("clean-"):
            with gzip.open(os.path.join(out_dir, name), "rt", encoding="utf-8") as f:
                texts += [json.loads(line)["text"] for line in f]
    return texts


# ---------------------------------------------------------------- the targets


def test_planted_set_meets_the_targets(planted):
    counts = {label: sum(d[1] == label for d in planted) for label in ("unique", "exact", "near", "en", "tr", "ru")}
    assert counts == {"unique": 400, "exact": 40, "near": 40, "en": 40, "tr": 40, "ru": 40}
    steps = [d.step for d in clean.clean_documents((t for t, _, _ in planted), clean.Rules(), workers=2)]
    s = scores(planted, steps)
    assert s["exact_removed"] == 1.0
    assert s["near_recall"] >= 0.95 and s["near_precision"] >= 0.99, s
    assert s["foreign_removed"] >= 0.95, s
    assert s["unique_kept"] >= 0.97, s
    # an exact duplicate is removed by the exact step when its original survived to it
    assert all(steps[i] == "exact" for i, d in enumerate(planted) if d[1] == "exact" and steps[d[2]] is None)


def test_output_and_report_are_the_same_for_any_number_of_workers(planted, tmp_path):
    texts = [t for t, _, _ in planted]
    one = clean.clean_corpus(texts, str(tmp_path / "w1"), clean.Rules(), workers=1, shard_bytes=100_000)
    two = clean.clean_corpus(texts, str(tmp_path / "w2"), clean.Rules(), workers=2, shard_bytes=100_000)
    assert one == two and len(one["files"]) > 1  # several shards
    assert read_out(tmp_path / "w1") == read_out(tmp_path / "w2")


def test_report_counts_chain_and_name_the_near_duplicate_kept(planted, tmp_path):
    r = clean.clean_corpus([t for t, _, _ in planted], str(tmp_path / "a"), clean.Rules(), samples=3)
    steps = r["steps"]
    assert [s["step"] for s in steps] == list(clean.STEPS)
    assert steps[0]["documents_in"] == len(planted) and steps[-1]["documents_out"] == r["documents_out"]
    for prev, s in zip(steps, steps[1:]):
        assert (s["documents_in"], s["bytes_in"]) == (prev["documents_out"], prev["bytes_out"])
    for s in steps:
        assert s["documents_in"] - s["documents_out"] == sum(s["removed"].values())
    out = read_out(tmp_path / "a")
    assert len(out) == r["documents_out"] and sum(len(t.encode()) for t in out) == r["bytes_out"]
    near = r["samples"]["near: near duplicate"]
    assert len(near) == 3
    for sample in near:  # "similar_to" names the kept document: it really is similar
        shard, line = sample["similar_to"].split(":")
        with gzip.open(tmp_path / "a" / shard, "rt", encoding="utf-8") as f:
            kept = [json.loads(x)["text"] for x in f][int(line) - 1]
        assert jaccard(kept, sample["text"]) > 0.5
    assert {k.split(":")[0] for k in r["samples"]} >= {"lang", "exact", "near"}


def test_each_step_switches_off(planted):
    texts = [t for t, _, _ in planted]
    labels = [d[1] for d in planted]

    def kept(**kw):
        return [d.step is None for d in clean.clean_documents(texts, clean.Rules(**kw))]

    off = kept(normalize=False, lang="none", quality=False, dedup="none")
    assert all(off)  # nothing removed with every step off
    no_lang = kept(lang="none")
    assert sum(k for k, lab in zip(no_lang, labels) if lab in ("en", "tr", "ru")) >= 100  # foreign text stays
    exact_only = kept(dedup="exact")
    assert not any(k for k, lab in zip(exact_only, labels) if lab == "exact")
    assert sum(k for k, lab in zip(exact_only, labels) if lab == "near") >= 35  # near duplicates stay
    # without normalisation the whitespace-noised copies are not exact duplicates any more
    raw = kept(normalize=False, quality=False, lang="none", dedup="exact")
    assert 0 < sum(k for k, lab in zip(raw, labels) if lab == "exact") < 40


def test_input_is_streamed_a_bounded_window_at_a_time():
    lines = open(os.path.join(DATA, "kde.txt"), encoding="utf-8").read().splitlines()
    consumed = 0

    def endless():  # far more documents than the window; never materialised
        nonlocal consumed
        while True:
            for line in lines:
                consumed += 1
                yield line

    decisions = clean.clean_documents(endless(), clean.Rules(dedup="exact"), workers=2)
    for _ in range(6000):
        next(decisions)
    # 2 batches per worker in flight plus the one being filled: the rest of the input is never read ahead
    assert consumed <= 6000 + 5 * 512, consumed
    decisions.close()


def test_dedup_indexes_give_the_same_result_once_their_keys_are_frozen_into_sorted_runs(planted, monkeypatch):
    texts = [t for t, _, _ in planted]
    before = [(d.step, d.detail) for d in clean.clean_documents(texts, clean.Rules())]
    monkeypatch.setattr(dedup, "KEY_BUFFER", 50)  # runs after every batch, merged as they pile up
    assert [(d.step, d.detail) for d in clean.clean_documents(texts, clean.Rules())] == before


@pytest.mark.parametrize("budget", [1 << 30, 1 << 14])  # all in RAM; every run spilled to disk
def test_key_table_answers_like_a_dict_of_first_values(budget, tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "KEY_BUFFER", 100)
    rng = np.random.default_rng(0)
    spill = dedup.SpillDir(str(tmp_path))
    table, ref = dedup.KeyTable(budget, spill), {}
    for batch in range(40):
        keys = rng.integers(0, 3000, 64, dtype=np.uint64) * np.uint64(2**52)  # repeats, and keys past 2^63
        frozen = table.frozen(keys)
        for key, hit in zip(keys.tolist(), frozen.tolist()):
            got = hit if hit >= 0 else table.recent.get(key)
            assert got == ref.get(key)
            ref.setdefault(key, batch)
            if hit < 0:
                table.recent.setdefault(key, batch)
        table.freeze()
    on_disk = [isinstance(r, dedup._DiskRun) for r in table.runs]
    assert len(table.runs) > 1 and all(on_disk) == (budget < 1 << 20) and any(on_disk) == all(on_disk)
    stored = {key for r in table.runs for part in r.chunks(100) for key in part["key"].tolist()} | set(table.recent)
    assert stored == set(ref)
    table.close()
    spill.remove()
    assert os.listdir(tmp_path) == []


def test_dedup_spilled_to_disk_decides_as_in_ram_and_removes_its_files(planted, tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "KEY_BUFFER", 200)  # runs freeze every few batches, and merge
    texts = [t for t, _, _ in planted]
    in_ram = [(d.step, d.detail) for d in clean.clean_documents(texts, clean.Rules())]
    tiny = clean.Rules(dedup_memory_mb=0.1)  # every run and most signatures on disk
    spilled, got = set(), []
    for d in clean.clean_documents(texts, tiny, workers=2, spill_parent=str(tmp_path)):
        got.append((d.step, d.detail))
        spilled |= {f.split("-")[0] for sub in os.listdir(tmp_path) for f in os.listdir(tmp_path / sub)}
    assert got == in_ram and spilled == {"keys", "signatures"}
    assert os.listdir(tmp_path) == []  # the spill folder went with the generator's end
    decisions = clean.clean_documents(texts, tiny, spill_parent=str(tmp_path))
    for _ in range(300):
        next(decisions)
    assert os.listdir(tmp_path) != []
    decisions.close()  # stopped early: removed too
    assert os.listdir(tmp_path) == []
    r = clean.clean_corpus(texts, str(tmp_path / "out"), tiny)
    assert sorted(os.listdir(tmp_path / "out")) == r["files"]  # shards only, no spill folder
    assert read_out(tmp_path / "out") == [t for t, (step, _) in zip(texts, in_ram) if step is None]


def test_dedup_index_ram_stays_under_its_budget_however_many_documents_it_holds(tmp_path, monkeypatch):
    """40,000 kept documents hold 19 MB of band keys and signatures: the index keeps <= 6 MB of it in RAM, by
    its own count after every batch and by tracemalloc (every allocation it made, numpy's included)."""
    import tracemalloc

    monkeypatch.setattr(dedup, "KEY_BUFFER", 4096)  # the dict of recent keys, fixed: 1.4 MB with a batch's
    budget, rng = 6 << 20, np.random.default_rng(0)
    spill = dedup.SpillDir(str(tmp_path))
    tracemalloc.start()
    index, traced = dedup.NearIndex(0.7, budget, spill), []
    first = rng.integers(0, 2**32, (8, dedup.NUM_PERM), dtype=np.uint32)
    for batch in range(40_000 // dedup.BATCH_DOCS + 1):
        sigs = rng.integers(0, 2**32, (dedup.BATCH_DOCS, dedup.NUM_PERM), dtype=np.uint32)
        sigs[:8] = first  # 8 documents of the first batch again in every later one: found on disk
        bands = dedup.band_keys(sigs)
        frozen = index.candidates(bands)
        matched = [index.match_or_add(s, b, f) for s, b, f in zip(sigs, bands, frozen)]
        assert sum(m is not None for m in matched) == (8 if batch else 0)
        index.bands.freeze()
        assert index.ram_bytes <= budget
        full = index.bands.bloom is not None and index.bands.bloom.nbytes == index.bands.bloom_bytes
        traced.append((*tracemalloc.get_traced_memory(), full))
    tracemalloc.stop()
    assert len(index.bands) * 12 + index.n * 240 > 3 * budget  # what it holds
    assert index.bands.disk_bytes + index.sigs.first * index.sigs.rows * 240 > 2 * budget  # on disk
    assert max(peak for _, peak, _ in traced) <= budget, traced  # the peak: merges and lookups included
    # the Bloom filter grows (2x at a time) up to its share; from then on the RAM is flat
    after = [current for current, _, full in traced if full]
    assert len(after) >= 10 and max(after) <= after[0] + budget // 16, after
    index.close()
    spill.remove()


# ---------------------------------------------------------------- the parts


def test_normalize_nfc_whitespace_and_invisible_characters():
    decomposed = "Bu gu\u0308n ha\u0306va cho\u0308x go\u0308zəldir"  # ü, ö as base letter + combining mark
    assert clean.normalize(decomposed) == "Bu gün hăva chöx gözəldir"
    assert clean.normalize("  a\u200b b\u00a0\u00a0c \r\n\r\n\r\n\r\n d\t\te\r f\x00 ") == "a b c\n\nd e\nf"
    assert clean.normalize(" \u200b\ufeff \n ") == ""


def shingles(text: str) -> set[str]:
    s = " ".join(dedup._NOT_WORD.sub(" ", text.lower()).split())
    return {s[i : i + dedup.SHINGLE] for i in range(max(len(s) - dedup.SHINGLE + 1, 1))}


def jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def test_minhash_agreement_estimates_the_exact_jaccard_of_character_5grams():
    rng = random.Random(0)
    lines = open(os.path.join(DATA, "kde.txt"), encoding="utf-8").read().splitlines()
    errors = []
    for _ in range(60):
        a = " ".join(rng.sample(lines, 4))
        words = a.split()
        for i in rng.sample(range(len(words)), rng.randint(1, len(words) // 2)):
            words[i] = rng.choice(lines).split()[0]
        b = " ".join(words)
        est = np.mean(dedup.minhash(a) == dedup.minhash(b))
        errors.append(est - jaccard(a, b))
    errors = np.abs(errors)
    assert errors.max() < 0.16 and errors.mean() < 0.05, errors  # std of a 120-value estimate is <= 0.046


def test_language_id_on_real_lines_keeps_azerbaijani_and_drops_turkish_russian_english():
    rng = random.Random(0)
    worker = clean.Worker(clean.Rules())
    az = rng.sample(open(os.path.join(DATA, "kde.txt"), encoding="utf-8").read().splitlines(), 600)
    kept = np.mean([clean.language(worker.identifier, t, 0.5) is None for t in az])
    assert kept >= 0.98, kept
    for lang, path in FOREIGN.items():
        lines = rng.sample(open(path, encoding="utf-8").read().splitlines(), 300)
        wrongly = np.mean([clean.language(worker.identifier, t, 0.5) is None for t in lines])
        assert wrongly <= 0.01, (lang, wrongly)
    assert clean.language(worker.identifier, "Бу ҝүн һава чох ҝөзәлдир вә биз паркa ҝедирик.", 0.5) is not None


def test_quality_rules_remove_junk_and_keep_sentences():
    r = clean.Rules()
    good = "Bu parametr pəncərənin fokusunun qorunması üstünlüyünü təyin edir."
    assert clean.quality(good, r) is None
    assert clean.quality("Fayl silinsin?", r) == "too few words"
    assert clean.quality("# # # # # # başlıq #", r) is not None
    assert clean.quality("\n".join([good] * 4 + ["Başqa bir cümlə burada yazılıb, tamam."]), r) == "repeated lines"
    spam = " ".join(["ucuz telefon satılır"] * 30)
    assert clean.quality(spam, r).startswith(("top", "repeated"))
    assert (
        clean.quality("Bu səhifədə belə bir kod var: function f() { return 1; } və daha nələr", r)
        == "boilerplate or code"
    )


# ---------------------------------------------------------------- Parquet and zstd input


def az_lines(n: int) -> list[str]:
    return open(os.path.join(DATA, "django.txt"), encoding="utf-8").read().splitlines()[:n]


def test_parquet_is_read_by_row_group_with_the_text_field(tmp_path):
    lines = az_lines(50)
    table = pa.table({"id": list(range(52)), "content": lines[:25] + [None, "  "] + lines[25:]})
    path = str(tmp_path / "fw.parquet")
    pq.write_table(table, path, row_group_size=10)
    assert pq.ParquetFile(path).num_row_groups == 6
    seen = []
    docs = list(readers.iter_documents([path], text_field="content", on_bytes=seen.append))
    assert docs == lines and sum(seen) == os.path.getsize(path) and len(seen) == 6
    with pytest.raises(readers.CorpusError, match=r"fw\.parquet: no column 'text' \(columns: id, content\)"):
        list(readers.iter_documents([path]))
    with pytest.raises(readers.CorpusError, match="column 'id' holds int64, not strings"):
        list(readers.iter_documents([path], text_field="id"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(readers.CorpusError, match=r"bad\.parquet: not a readable Parquet file"):
        list(readers.iter_documents([str(tmp_path / "bad.parquet")]))


def test_jsonl_zst_and_txt_zst_are_read_including_several_frames(tmp_path):
    lines = az_lines(40)
    jsonl = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines).encode()
    c = zstandard.ZstdCompressor()
    (tmp_path / "oscar.jsonl.zst").write_bytes(c.compress(jsonl[:1000]) + c.compress(jsonl[1000:]))  # two frames
    buf = io.BytesIO()
    with c.stream_writer(buf, closefd=False) as w:
        w.write(("\n".join(lines) + "\n").encode())
    (tmp_path / "wiki.txt.zst").write_bytes(buf.getvalue())
    files = readers.corpus_files([str(tmp_path)])
    assert [os.path.basename(f) for f in files] == ["oscar.jsonl.zst", "wiki.txt.zst"]
    assert list(readers.iter_documents(files)) == lines + lines
    bad_line = c.compress(jsonl[:200] + b"{not json\n")
    (tmp_path / "bad.jsonl.zst").write_bytes(bad_line)
    with pytest.raises(readers.CorpusError, match=r"bad\.jsonl\.zst:3: malformed JSON line"):
        list(readers.iter_documents([str(tmp_path / "bad.jsonl.zst")]))
    (tmp_path / "cut.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    with pytest.raises(readers.CorpusError, match=r"cut\.jsonl\.zst: cannot read"):
        list(readers.iter_documents([str(tmp_path / "cut.jsonl.zst")]))


# ---------------------------------------------------------------- the command line


def write_raw_dump(d) -> list[str]:
    """A Parquet and a jsonl.zst file: real Azerbaijani lines, duplicates, and Turkish lines."""
    lines = open(os.path.join(DATA, "firefox.txt"), encoding="utf-8").read().splitlines()[:300]
    tr = open(FOREIGN["tr"], encoding="utf-8").read().splitlines()[:60]
    os.makedirs(d)
    pq.write_table(
        pa.table({"text": lines[:150] + lines[:20] + tr[:30]}), os.path.join(d, "a.parquet"), row_group_size=64
    )
    jsonl = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines[150:] + tr[30:])
    with open(os.path.join(d, "b.jsonl.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(jsonl.encode()))
    return lines


def test_clean_then_train_and_encode_take_the_clean_dir_as_corpus(tmp_path):
    dump, out = tmp_path / "dump", tmp_path / "clean"
    lines = write_raw_dump(dump)
    p = tokenize("clean", "--corpus", str(dump), "--out", str(out), "--workers", "2")
    assert "tokenize_clean documents_in=380 " in p.stdout, p.stdout
    report, kept = json.load(open(out / "clean_report.json")), read_out(out)
    assert set(kept) <= set(lines) and len(kept) == len(set(kept)) >= 0.9 * 300
    # the 20 lines the Parquet file holds twice: each that reached the exact step (kept, or later a near
    # duplicate) took its copy out there
    exact = report["steps"][3]["removed"]["exact duplicate"]
    assert sum(t in kept for t in lines[:20]) <= exact <= 20
    assert report["steps"][1]["documents_in"] - report["steps"][1]["documents_out"] >= 57  # of the 60 Turkish
    marker = json.load(open(out / "minilm-az-output.json"))["outputs"][0]
    assert marker["stage"] == "tokenize clean"
    assert sorted(marker["files"]) == sorted(f for f in os.listdir(out) if f != "minilm-az-output.json")
    tokenize("train", "--corpus", str(out), "--vocab-size", "400", "--out", str(tmp_path / "tok"))
    p = tokenize("encode", "--tokenizer", str(tmp_path / "tok"), "--corpus", str(out), "--out", str(tmp_path / "sh"))
    index = json.load(open(tmp_path / "sh" / "index.json"))
    assert sum(s["documents"] for s in index["splits"].values()) == len(kept)


def test_bad_input_is_one_error_line_and_the_users_files_stay(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "Salam dünya necəsən bu gün"}\n{"body": "x"}\n', encoding="utf-8")
    e = error_line(tokenize("clean", "--corpus", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"), check=False))
    assert "in.jsonl:2: expected an object with a string 'text' field" in e
    assert not os.path.exists(tmp_path / "o")  # a failed first run leaves nothing
    pq.write_table(pa.table({"body": ["a b c d e f"]}), str(tmp_path / "x.parquet"))
    e = error_line(
        tokenize("clean", "--corpus", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "o"), check=False)
    )
    assert "x.parquet: no column 'text' (columns: body)" in e
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes", encoding="utf-8")
    for extra in ([], ["--overwrite"]):
        e = error_line(
            tokenize("clean", "--corpus", os.path.join(DATA, "django.txt"), "--out", str(mine), *extra, check=False)
        )
        assert str(mine) in e
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text(encoding="utf-8") == "my notes"
    e = error_line(
        tokenize(
            "clean",
            "--corpus",
            os.path.join(DATA, "django.txt"),
            "--out",
            str(tmp_path / "o"),
            "--dedup",
            "fuzzy",
            check=False,
        )
    )
    assert "--dedup" in e


def test_overwrite_replaces_only_its_own_previous_output(tmp_path):
    out = tmp_path / "o"
    kde = os.path.join(DATA, "kde.txt")
    tokenize("clean", "--corpus", kde, "--out", str(out), "--shard-mb", "1")
    first = sorted(os.listdir(out))
    assert error_line(tokenize("clean", "--corpus", kde, "--out", str(out), check=False)).endswith(
        "pass --overwrite to replace it"
    )
    tokenize("clean", "--corpus", os.path.join(DATA, "django.txt"), "--out", str(out), "--overwrite")
    assert sorted(os.listdir(out)) == first  # the same files, with the new run's content
    assert json.load(open(out / "clean_report.json"))["documents_in"] == 109


def test_the_demo_report_shows_what_clean_removed(planted, tmp_path):
    from demo.report import Run, section_clean

    texts = [t for t, _, _ in planted]
    rep = clean.clean_corpus(texts, str(tmp_path / "clean"), clean.Rules(), samples=2)
    (tmp_path / "clean" / "clean_report.json").write_text(json.dumps(rep), encoding="utf-8")
    text = "\n".join(section_clean(Run(str(tmp_path), {}, "x", None)))
    assert f"kept {rep['documents_out']:,} of {len(texts):,} train documents" in text
    for s in rep["steps"]:
        for reason, n in s["removed"].items():
            assert f"{reason} {n:,}" in text
    assert "- near: near duplicate (similar_to clean-00000.jsonl.gz:" in text
    assert section_clean(Run(str(tmp_path / "none"), {}, "x", None)) == []  # a run from before clean existed
