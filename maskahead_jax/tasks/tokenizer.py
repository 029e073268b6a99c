"""A small word-level tokenizer for the testbed, built locally with the `tokenizers` library.

WordPiece model over the closed task lexicon: every lexicon word is one token; digits are single
tokens ("0".."9" at a word start, "##0".."##9" inside a word) so a number is a sequence of digit
tokens and decodes back without spaces ("4 ##8 ##2" -> "482"); letters a-z / ##a-z are a fallback
for words outside the lexicon. Text is lower-cased. Special tokens: [PAD] 0, [BOS] 1, [EOS] 2,
[MASK] 3, [UNK] 4. `encode()` prepends [BOS] (post-processor); pass add_special_tokens=False to
skip it.
"""
from __future__ import annotations

import functools
import os
import string

from .lexicon import ALL_WORDS, PUNCT

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]"]
PAD_ID, BOS_ID, EOS_ID, MASK_ID, UNK_ID = range(5)
TESTBED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testbed")
TOKENIZER_PATH = os.path.join(TESTBED_DIR, "tokenizer.json")


def vocab_list() -> list[str]:
    digits = list(string.digits)
    letters = list(string.ascii_lowercase)
    toks = SPECIALS + digits + ["##" + d for d in digits] + PUNCT + letters + ["##" + c for c in letters]
    seen = set(toks)
    toks += [w for w in ALL_WORDS if w not in seen]
    return toks


def build_tokenizer():
    """Build the tokenizer from the lexicon (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(vocab_list())}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", pair="[BOS] $A $B", special_tokens=[("[BOS]", BOS_ID)])
    tok.add_special_tokens(SPECIALS)
    return tok


def save_tokenizer(path: str = TOKENIZER_PATH) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    build_tokenizer().save(path)
    return path


@functools.lru_cache(maxsize=None)
def get_tokenizer(path: str | None = None):
    """The shipped tokenizer.json when present (else the one built from the lexicon)."""
    from tokenizers import Tokenizer

    path = path or TOKENIZER_PATH
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    return build_tokenizer()


def count_tokens(text: str, tokenizer=None) -> int:
    """Tokens of `text` without [BOS]."""
    tok = tokenizer or get_tokenizer()
    return len(tok.encode(text, add_special_tokens=False).ids)
