"""Sampling from a model to try it: the chat template, a KV cache, temperature / top-p, stop at <|eot_id|>."""

from __future__ import annotations

from typing import TextIO

import torch
from tokenizers import Tokenizer

from minilm_az.chat import encode_prompt
from minilm_az.model import KVCache, Llama
from minilm_az.tokenizer import EOS, EOT


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> int:
    """One token id from (V,) logits: argmax at temperature 0, else nucleus sampling."""
    if not torch.isfinite(logits).all():  # Argmax would pick a NaN without a word, and sampling would crash.
        raise FloatingPointError("generate: the model's logits are NaN or inf (are its weights finite?)")
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(0) - sorted_p >= top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """New ids after `prompt`, up to `max_new_tokens` or a stop id (not returned)."""
    if not prompt:
        raise ValueError("generate: empty prompt")
    dev = model.inv_freq.device
    limit = min(len(prompt) + max_new_tokens, model.config.max_seq_len)
    if len(prompt) >= limit:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room (max_seq_len={model.config.max_seq_len})")
    gen = None if seed is None else torch.Generator(device=dev).manual_seed(seed)
    cache = KVCache(model.config, 1, limit, dev, next(model.parameters()).dtype)
    seq, out, pos = list(prompt), [], 0
    while len(seq) < limit:
        logits = model(torch.tensor([seq[pos:]], device=dev), cache=cache, pos=pos)
        pos = len(seq)
        nxt = sample_next(logits[0, -1], temperature, top_p, gen)
        if nxt in stop_ids:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


def generate(
    model: Llama,
    tok: Tokenizer,
    messages: list[dict],
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int | None = 0,
) -> str:
    """The assistant's reply to a conversation (greedy when temperature is 0)."""
    was_training = model.training
    model.eval()
    try:
        stop = tuple(i for i in (tok.token_to_id(EOT), tok.token_to_id(EOS)) if i is not None)
        ids = generate_ids(model, encode_prompt(messages, tok), max_new_tokens, temperature, top_p, seed, stop)
    finally:
        model.train(was_training)
    return tok.decode(ids, skip_special_tokens=True)


HELP = "type a message; /reset clears the conversation, /help shows this, /exit or Ctrl-D quits"


def talk(model: Llama, tok: Tokenizer, system: str | None, stdin: TextIO, out: TextIO, err: TextIO, **kw) -> None:
    """A chat loop on `stdin`: each line is a user turn, each reply printed to `out`; `kw` go to `generate`."""
    history = [{"role": "system", "content": system}] if system else []
    interactive = stdin.isatty()
    print(f"# {HELP}", file=err)
    while True:
        if interactive:
            print("> ", end="", file=err, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            break
        command = line.strip()
        if command == "/reset":
            history = history[:1] if system else []
            print("# conversation cleared", file=err, flush=True)
        elif command == "/help":
            print(f"# {HELP}", file=err, flush=True)
        elif line.encode("utf-8", "surrogateescape") != line.encode("utf-8", "replace"):  # bytes that are no text
            print("# that line is not valid UTF-8: not sent", file=err, flush=True)
        elif command:
            history.append({"role": "user", "content": line.rstrip("\n")})
            reply = generate(model, tok, history, **kw)
            print(reply, file=out, flush=True)
            history.append({"role": "assistant", "content": reply or " "})
