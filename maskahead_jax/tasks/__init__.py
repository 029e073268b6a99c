"""Synthetic long-context retrieval task suite and the testbed tokenizer."""
from .suite import (GENERATORS, TASKS, Example, docqa_first_word, first_number, generate,
                    longanswer_score, make_docqa, make_longanswer, make_multikey, MULTIKEY_PHRASE,
                    multikey_fact, multikey_keys, multikey_question, make_passkey, make_suite,
                    make_twohop, score, filler_sentence, twohop_completion, twohop_first_hop,
                    twohop_question)
from .tokenizer import (BOS_ID, EOS_ID, MASK_ID, PAD_ID, TOKENIZER_PATH, build_tokenizer,
                        count_tokens, get_tokenizer, save_tokenizer)
