"""Vocabulary transfer: shared tokens keep their base rows exactly, new ones start at the mean of their base pieces."""

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from minilm_az.tokenizer import EOS, EOT, SPECIAL_TOKENS, new_tokenizer, train_tokenizer
from minilm_az.transfer import transfer_embedding

ALPHABET = pre_tokenizers.ByteLevel.alphabet()


def byte_level(text: str) -> str:
    return "".join(
        s for s, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    )


def hand_tokenizer(merges: list[tuple[str, str]], specials: list[str]) -> Tokenizer:
    """A byte-level BPE with exactly these merges: the 256 bytes, then one token per merge, then specials."""
    vocab = {c: i for i, c in enumerate(sorted(ALPHABET))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def test_hand_case_copies_shared_rows_and_averages_the_base_pieces():
    s = byte_level("ş")  # two bytes, two byte-level characters
    assert len(s) == 2
    base = hand_tokenizer([("Ġ", "b"), ("Ġb", "a"), ("q", "a")], [EOS])
    new = hand_tokenizer([("Ġ", "b"), ("Ġb", "a"), (s[0], s[1]), ("Ġba", s), ("q", "a"), ("Ġba" + s, "qa")], [EOS, EOT])
    rows = torch.randn(base.get_vocab_size(), 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out, stats = transfer_embedding(rows.to(torch.bfloat16), base, new, new_vocab_size=new.get_vocab_size() + 3)
    rows = rows.to(torch.bfloat16).float()  # what transfer sees: the base dtype, upcast
    b, n = base.token_to_id, new.token_to_id

    assert out.dtype == torch.float32 and out.shape == (new.get_vocab_size() + 3, 8)
    for t in sorted(ALPHABET) + ["Ġb", "Ġba", "qa", EOS]:  # in both: copied bit for bit
        assert torch.equal(out[n(t)], rows[b(t)]), t
    mean_of = lambda pieces: rows[[b(p) for p in pieces]].mean(0)
    assert torch.equal(out[n(s)], mean_of([s[0], s[1]]))
    assert torch.equal(out[n("Ġba" + s)], mean_of(["Ġba", s[0], s[1]]))
    assert torch.equal(out[n("Ġba" + s + "qa")], mean_of(["Ġba", s[0], s[1], "qa"]))  # " başqa"
    assert torch.equal(out[n(EOT)], rows.mean(0))  # a special the base lacks
    for pad in range(new.get_vocab_size(), new.get_vocab_size() + 3):  # rows past the tokenizer
        assert torch.equal(out[pad], rows.mean(0))
    assert (stats.copied, stats.averaged, stats.special_mean) == (256 + 3 + 1, 3, 1)
    assert str(stats) == "copied=260 averaged=3 special_mean=1"


DOCS_A = [
    "Azərbaycan Respublikası Cənubi Qafqazda yerləşir.",
    "Bakı şəhəri Xəzər dənizinin sahilindədir.",
    "Dil, tarix və mədəniyyət haqqında məqalələr.",
] * 20
DOCS_B = [
    "Faylı yadda saxla",
    "Pəncərəni bağla",
    "Səhifəni yenidən yüklə",
    "Parametrlər və seçimlər",
    "Başqa bir fayl seçin",
    "Qovluğu aç",
] * 20


def test_trained_tokenizers_every_row_matches_an_independent_computation():
    new = train_tokenizer(DOCS_A + DOCS_B, vocab_size=420, progress=False)
    base = new_tokenizer()  # same pre-tokenizer, other merges, only one of our specials
    base.train_from_iterator(
        DOCS_B,
        BpeTrainer(
            vocab_size=330,
            special_tokens=[AddedToken(EOS, special=True)],
            initial_alphabet=ALPHABET,
            show_progress=False,
        ),
    )
    rows = torch.randn(base.get_vocab_size(), 4, generator=torch.Generator().manual_seed(1))
    out, stats = transfer_embedding(rows, base, new)
    base_vocab = base.get_vocab(with_added_tokens=True)

    copied = averaged = checked = 0
    for token, i in new.get_vocab(with_added_tokens=True).items():
        if token in base_vocab:
            assert torch.equal(out[i], rows[base_vocab[token]]), token
            copied += 1
        elif token in SPECIAL_TOKENS:
            assert torch.equal(out[i], rows.mean(0)), token
        else:
            averaged += 1
            text = new.decode([i])
            if "\ufffd" in text:  # ends inside a character: no text to re-encode
                continue
            pieces = base.encode(text, add_special_tokens=False).ids  # the base tokenizer's own encoding
            assert len(pieces) > 1
            torch.testing.assert_close(out[i], rows[pieces].mean(0), rtol=0, atol=1e-6)
            checked += 1
    assert averaged > 20 and checked > averaged // 2
    assert (stats.copied, stats.averaged, stats.special_mean) == (copied, averaged, len(SPECIAL_TOKENS) - 1)


def test_a_model_vocab_smaller_than_the_tokenizer_is_refused():
    base = hand_tokenizer([], [EOS])
    new = hand_tokenizer([("a", "b")], [EOS])
    with pytest.raises(ValueError, match="outside the model's vocab of 257"):
        transfer_embedding(torch.zeros(base.get_vocab_size(), 2), base, new, new_vocab_size=257)
