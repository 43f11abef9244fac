"""Stage 1: raw text -> a clean corpus -> byte-level BPE tokenizer -> token shards for train.py.

    python tokenize.py clean  --corpus dumps/az.parquet dumps/oscar.jsonl.zst --out runs/clean
    python tokenize.py train  --corpus data/az --vocab-size 100000 --out runs/tokenizer
    python tokenize.py report --tokenizer runs/tokenizer --baseline BASE/tokenizer.json --corpus data/az/firefox.txt
    python tokenize.py encode --tokenizer runs/tokenizer --corpus data/az --out runs/shards

Without --corpus the demo corpus in data/az/ is used: clean all four files, train on mediawiki + kde +
django, report on firefox (held out), encode the three with firefox as the val split.
"""

from __future__ import annotations

import os
import sys

if __name__ == "tokenize":  # Python is importing this file as its standard `tokenize`: see launch/stdlib_tokenize.py.
    from minilm_az.launch.stdlib_tokenize import become_stdlib_tokenize

    become_stdlib_tokenize(__file__)
else:
    import dataclasses
    import functools
    import json
    import time

    from tqdm import tqdm

    from minilm_az import outputs, shards
    from minilm_az import tokenizer as tk
    from minilm_az.config import TOKENIZE_CONFIGS
    from minilm_az.launch.flags import HelpFormatter, Parser, add_dataclass_args, parse_config
    from minilm_az.logs import format_line
    from minilm_az.outputs import atomic_write_json, claim, inside, staged_output
    from minilm_az.prep import clean, fertility, readers

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "az")
DEMO_TRAIN = [os.path.join(DATA_DIR, f) for f in ("mediawiki.txt", "kde.txt", "django.txt")]
DEMO_VAL = [os.path.join(DATA_DIR, "firefox.txt")]


def claim_out(args, stage: str) -> None:
    """--out under the one ownership rule (outputs.claim; its lock is held until the process ends), and never
    inside a corpus directory: a rerun would read the first run's output as more corpus."""
    for d in [*(args.corpus or []), *(getattr(args, "val_corpus", None) or [])]:
        if os.path.isdir(d) and inside(d, args.out):
            raise FileExistsError(f"--out {args.out} is inside the corpus directory {d}; choose a path outside it")
    claim(args.out, stage, args.overwrite)


def progress_bar(files: list[str], desc: str, enabled: bool) -> tqdm:
    return tqdm(total=readers.corpus_bytes(files), unit="B", unit_scale=True, desc=desc, disable=not enabled)


def read(files: list[str], args, bar: tqdm | None = None):
    on_bytes = bar.update if bar is not None else None
    return readers.iter_documents(files, args.doc_sep, args.errors, args.text_field, on_bytes)


# --- subcommands -------------------------------------------------------------------------------------


def cmd_clean(args) -> None:
    files = readers.corpus_files(args.corpus or DEMO_TRAIN + DEMO_VAL)
    claim_out(args, "tokenize clean")
    rules = clean.Rules(**{f.name: getattr(args, f.name) for f in dataclasses.fields(clean.Rules)})
    t0 = time.time()
    with (
        progress_bar(files, "clean", args.progress) as bar,
        staged_output(args.out, stage="tokenize clean") as tmp,
    ):
        workers = args.workers or os.cpu_count() or 1
        report = clean.clean_corpus(read(files, args, bar), tmp, rules, workers, args.shard_mb << 20, args.samples)
        seconds = time.time() - t0
        head = {
            "created_by": "tokenize.py clean",
            "corpus": [outputs.shown(os.path.abspath(f)) for f in files],
            "workers": workers,
        }
        atomic_write_json(os.path.join(tmp, "clean_report.json"), {**head, **report, "seconds": round(seconds, 1)})
    for s in report["steps"]:
        counts = {k: s[k] for k in ("documents_in", "documents_out", "bytes_in", "bytes_out")}
        print(format_line("tokenize_clean_step", step=s["step"], enabled=s["enabled"], **counts))
    docs_in, docs_out = report["documents_in"], report["documents_out"]
    rate = round(docs_in / max(seconds, 1e-9))
    print(
        format_line(
            "tokenize_clean", documents_in=docs_in, documents_out=docs_out, seconds=round(seconds, 1), docs_per_s=rate
        )
    )
    if docs_out == 0:
        print(f"warning: no document survived cleaning; see {args.out}/clean_report.json", file=sys.stderr)
    print(f"wrote {args.out}")


def cmd_train(args) -> None:
    files = readers.corpus_files(args.corpus or DEMO_TRAIN)
    claim_out(args, "tokenize train")
    t0 = time.time()
    with progress_bar(files, "read corpus", args.progress) as bar:
        tok = tk.train_tokenizer(
            read(files, args, bar), args.vocab_size, args.min_frequency, args.max_token_length, args.progress
        )
    vocab = tok.get_vocab_size()
    if vocab < args.vocab_size:
        print(f"warning: corpus too small for {args.vocab_size} ids; trained {vocab}", file=sys.stderr)
    with staged_output(args.out, stage="tokenize train") as tmp:
        tk.write_tokenizer_files(tok, tmp, args.model_max_length)
        record = {
            "vocab_size": vocab,
            "requested_vocab_size": args.vocab_size,
            "min_frequency": args.min_frequency,
            "max_token_length": args.max_token_length,
            "corpus": [outputs.shown(os.path.abspath(f)) for f in files],
            "doc_sep": args.doc_sep,
            "special_tokens": tk.SPECIAL_TOKENS,
        }
        with open(os.path.join(tmp, "tokenizer_train.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, ensure_ascii=False)
    print(format_line("tokenize_train", vocab_size=vocab, files=len(files), seconds=round(time.time() - t0, 1)))
    print(f"wrote {args.out}")


def _combine(parts: list[dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for name in parts[0]:
        r = {k: sum(p[name][k] for p in parts) for k in ("documents", "words", "chars", "bytes", "tokens")}
        r["tokens_per_word"] = r["tokens"] / max(r["words"], 1)
        r["bytes_per_token"] = r["bytes"] / max(r["tokens"], 1)
        r["chars_per_token"] = r["chars"] / max(r["tokens"], 1)
        out[name] = r
    return out


def cmd_report(args) -> None:
    if args.json:  # checked before the work: the report must not replace a file the user had
        inputs = [args.tokenizer, args.baseline, *readers.corpus_files(args.corpus or DEMO_VAL)]  # the default too
        if any(p and (inside(p, args.json) or inside(tk_json(p), args.json)) for p in inputs):
            raise FileExistsError(f"--json {args.json} is one of the inputs, or inside one")
        if above := outputs.output_above(os.path.dirname(os.path.abspath(args.json))):
            raise FileExistsError(f"--json {args.json} is inside {above}, a stage's output; choose a path outside it")
        if os.path.exists(args.json) and not args.overwrite:
            raise FileExistsError(f"--json {args.json} exists (pass --overwrite to replace it)")
    toks = {"ours": tk.load_tokenizer(args.tokenizer)}
    paths = {"ours": args.tokenizer}
    if args.baseline:
        toks["baseline"] = tk.load_tokenizer(args.baseline)
        paths["baseline"] = args.baseline
    files = readers.corpus_files(args.corpus or DEMO_VAL)
    per_file = {}
    with progress_bar(files, "report", args.progress) as bar:
        for f in files:
            per_file[f] = fertility.fertility(toks, read([f], args, bar))
    rows = dict(per_file) if len(files) > 1 else {}
    rows["all"] = _combine(list(per_file.values()))
    for by_tok in rows.values():
        for name, r in by_tok.items():
            r["vocab_size"] = toks[name].get_vocab_size()
    print(fertility.format_fertility(rows))
    if "baseline" in toks:
        a = rows["all"]
        print(f"fertility ours/baseline: {a['ours']['tokens_per_word'] / a['baseline']['tokens_per_word']:.3f}")
    report = {
        "tokenizers": {
            n: {"path": os.path.abspath(p), "vocab_size": toks[n].get_vocab_size()} for n, p in paths.items()
        },
        "corpora": rows,
    }
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.json:
        try:
            outputs.atomic_write_text(args.json, text + "\n")
        except OSError as e:  # a full disk: the path and the free space, in one line
            raise outputs.write_error(args.json, e) from None
        print(f"wrote {args.json}")
    else:
        print(text)


def cmd_encode(args) -> None:
    tok = tk.load_tokenizer(args.tokenizer)
    eos_id = tok.token_to_id(tk.EOS)
    if eos_id is None:
        raise ValueError(f"{args.tokenizer}: tokenizer has no {tk.EOS} token to end documents with")
    corpus, val_corpus = args.corpus, args.val_corpus
    if not corpus:
        corpus, val_corpus = DEMO_TRAIN, val_corpus or DEMO_VAL
    files = readers.corpus_files(corpus)
    val_files = readers.corpus_files(val_corpus) if val_corpus else None
    claim_out(args, "tokenize encode")
    meta = {
        "created_by": "tokenize.py encode",
        "tokenizer": os.path.abspath(args.tokenizer),
        "corpus": [outputs.shown(os.path.abspath(f)) for f in files],
        "val_corpus": [outputs.shown(os.path.abspath(f)) for f in val_files] if val_files else None,
        "val_fraction": 0.0 if val_files else args.val_fraction,
        "doc_sep": args.doc_sep,
        "normalization": "NFC",
    }
    t0 = time.time()
    with (
        progress_bar(files + (val_files or []), "encode", args.progress) as bar,
        staged_output(args.out, stage="tokenize encode") as tmp,
    ):
        index = shards.write_shards(
            read(files, args, bar),
            tmp,
            encode=functools.partial(tk.encode_plain, tok),
            vocab_size=tok.get_vocab_size(),
            eos_id=eos_id,
            tokenizer_hash=tk.tokenizer_hash(args.tokenizer),
            val_documents=read(val_files, args, bar) if val_files else None,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            batch_bytes=(args.batch_mb or max(1, (os.cpu_count() or 1) // 4)) << 20,
            meta=meta,
        )
    seconds = time.time() - t0
    for name, s in index["splits"].items():
        counts = {k: s[k] for k in ("tokens", "documents", "bytes")}
        print(format_line(f"tokenize_encode_{name}", **counts, shards=len(s["shards"])))
    mb_per_s = sum(s["bytes"] for s in index["splits"].values()) / 1e6 / max(seconds, 1e-9)
    print(format_line("tokenize_encode", dtype=index["dtype"], seconds=round(seconds, 1), mb_per_s=round(mb_per_s, 2)))
    print(f"wrote {args.out}")


# --- command line ------------------------------------------------------------------------------------


def tk_json(path: str) -> str:
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


COMMANDS = {
    "clean": (cmd_clean, "raw dumps -> normalised, Azerbaijani-only, deduplicated jsonl.gz (+ clean_report.json)"),
    "train": (cmd_train, "train the byte-level BPE tokenizer"),
    "report": (cmd_report, "fertility, bytes/token, chars/token: ours vs a baseline"),
    "encode": (cmd_encode, "corpus -> token shards (+ index.json) for train.py"),
}


def parse_args(argv: list[str] | None = None):
    """The subcommand's config (config.py), with `func` and `command` attached."""
    argv = list(sys.argv[1:] if argv is None else argv)
    head, _, examples = __doc__.partition("\n\n")
    p = Parser(prog="tokenize.py", description=head, epilog=examples.split("\n\n")[0], formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, help_) in COMMANDS.items():
        add_dataclass_args(
            sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter, allow_abbrev=False),
            TOKENIZE_CONFIGS[name],
        )
    if not argv or argv[0] not in COMMANDS:
        p.parse_args(argv)  # prints usage and exits
    try:  # an empty value, a flag that does nothing here: one line naming the flag (config.check_values)
        cfg = parse_config(TOKENIZE_CONFIGS[argv[0]], p, argv)
    except ValueError as e:
        p.error(f"{argv[0]}: {e}")
    if argv[0] in ("report", "encode") and not cfg.tokenizer:
        p.error(f"{argv[0]}: --tokenizer is required")
    if argv[0] in ("clean", "train", "encode") and not cfg.out:
        p.error(f"{argv[0]}: --out is required")
    cfg.command, cfg.func = argv[0], COMMANDS[argv[0]][0]
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as e:  # CorpusError is a ValueError; OSError: a full or read-only disk
        print(f"tokenize.py {args.command}: error: {outputs.shown(str(e))}", file=sys.stderr)  # names not UTF-8
        return 2
    except KeyboardInterrupt:
        print(f"tokenize.py {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
