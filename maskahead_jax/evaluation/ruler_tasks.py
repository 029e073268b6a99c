"""RULER's task definitions (NVIDIA/RULER, verbatim where it has them): the 13 tasks of
scripts/synthetic.yaml with their arguments, each family's template, answer prefix and
tokens_to_generate, and the fixed sentences of the haystacks. No code but `tokens_to_generate`:
the generators (ruler_generators.py), the local sources (ruler_sources.py) and the sizing
(ruler.py) read it."""
from __future__ import annotations

# Bumped whenever a prompt would change: it is part of the eval run fingerprint.
GENERATOR_VERSION = 1

# NVIDIA/RULER scripts/data/synthetic/constants.py, verbatim (tokens_to_generate, template,
# answer_prefix of each task family).
TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        "answer_prefix": " Answer:",
    },
}

# NVIDIA/RULER scripts/synthetic.yaml: the 13 tasks and their default arguments.
TASKS = {
    "niah_single_1": ("niah", dict(type_haystack="noise", type_needle_k="words", type_needle_v="numbers",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_2": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_3": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_1": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=4, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_2": ("niah", dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_3": ("niah", dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multivalue": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=4, num_needle_q=1)),
    "niah_multiquery": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=4)),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
TASK_NAMES = tuple(TASKS)
ESSAY_TASKS = tuple(t for t, (_, a) in TASKS.items() if a.get("type_haystack") == "essay")
QA_TASKS = {"qa_1": "squad", "qa_2": "hotpotqa"}
OFFLINE_TASKS = tuple(t for t in TASKS if t not in ESSAY_TASKS and t not in QA_TASKS)

# niah.py / variable_tracking.py: the "noise" haystack sentence and the needle sentence.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# qa.py: how each document is shown.
DOCUMENT_PROMPT = "Document {i}:\n{document}"
# niah.py: the 40 insertion depths (percent) of essay haystacks.
DEPTHS = [int(round(100 * i / 39)) for i in range(40)]


def tokens_to_generate(task: str) -> int:
    """RULER's generation length of a task (its template family's tokens_to_generate)."""
    return TEMPLATES[TASKS[task][0]]["tokens_to_generate"]
