"""The embedded tokenizer: byte-level, built in code, so the default model needs no download.

Ids 0..255 are the bytes, then `<|endoftext|>` (EOS, also used as BOS) and `<|pad|>`. It is a real Hugging
Face fast tokenizer (save_pretrained / AutoTokenizer round-trip), so `hf/` exports carry it.
"""
from __future__ import annotations

from functools import lru_cache

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def _bytes_to_unicode():
    """The printable-character alias of each byte used by byte-level BPE (GPT-2's reversible mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


@lru_cache(maxsize=1)
def _backend_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alias = _bytes_to_unicode()
    vocab = {alias[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return tok.to_str()


def embedded_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_backend_json())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        unk_token=None, model_max_length=1 << 30,
    )
    return tokenizer
