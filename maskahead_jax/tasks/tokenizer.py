"""A small word-level tokenizer for the testbed, built locally with the `tokenizers` library.

WordPiece model over the closed task lexicon: every lexicon word is one token; every number below
1000 is one token ("7", "48", "482"), so a task value (a 3-digit number) is a single token; longer
numbers fall back to the longest whole-number prefix plus digit pieces ("4821" -> "482 ##1",
decoded back without spaces); letters a-z / ##a-z are a fallback for words outside the lexicon.
(Why whole-number tokens: a from-scratch model this small learns to find the right number long
before it learns to copy a digit sequence in order under parallel decoding; see docs/testbed_history.md.)
Text is lower-cased. Special tokens: [PAD] 0, [BOS] 1, [EOS] 2, [MASK] 3, [UNK] 4. `encode()`
prepends [BOS] (post-processor); pass add_special_tokens=False to skip it.
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
    numbers = [str(i) for i in range(10, 1000)]  # whole-word numbers: a task value is one token
    toks = (SPECIALS + digits + ["##" + d for d in digits] + PUNCT + letters + ["##" + c for c in letters]
            + numbers)
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
        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ValueError(f"cannot read the tokenizer {path}: {first} (a truncated or corrupt "
                             f"tokenizer.json?)") from None
    return build_tokenizer()


def count_tokens(text: str, tokenizer=None) -> int:
    """Tokens of `text` without [BOS]."""
    tok = tokenizer or get_tokenizer()
    return len(tok.encode(text, add_special_tokens=False).ids)
