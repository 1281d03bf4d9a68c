#!/usr/bin/env python3
"""How `transformers` tokenizes (query, document) pairs for a cross-encoder, on the
family fixtures' tokenizers, for tests/it/pair_tokens.rs (run by a developer, never by
CI; the venv of scripts/peer-bench has what it needs):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_pair_fixtures.py
    # writes tests/fixtures/rerank/pairs.json

Each tokenizer (BERT's `[CLS] q [SEP] d [SEP]` with token types, XLM-R's and RoBERTa's
`<s> q </s></s> d </s>`, ModernBERT's) encodes the pairs with `truncation=True`
(longest first) at 16 and at 512 tokens, padded to the longest: the ids, attention mask and
token types.
"""

import json
import os

import transformers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["bert", "xlm-roberta", "roberta", "modernbert"]
QUERIES = [
    "Who created the heaven and the earth?",
    "light",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
]
DOCUMENTS = [
    "In the beginning God created the heaven and the earth.",
    "And God said, Let there be light: and there was light. And God saw the light, that it "
    "was good: and God divided the light from the darkness.",
    "void",
]


def main():
    out = {"queries": QUERIES, "documents": DOCUMENTS, "cases": [],
           "transformers": transformers.__version__}
    for family in FAMILIES:
        path = os.path.join(ROOT, "tests", "fixtures", "families", family)
        tok = AutoTokenizer.from_pretrained(path)
        for max_len in [16, 512]:
            enc = tok(QUERIES, DOCUMENTS, truncation=True, max_length=max_len, padding=True,
                      return_token_type_ids=True)
            out["cases"].append({
                "family": family,
                "max_len": max_len,
                "input_ids": enc["input_ids"],
                "attention_mask": enc["attention_mask"],
                "token_type_ids": enc["token_type_ids"],
            })
    with open(os.path.join(ROOT, "tests", "fixtures", "rerank", "pairs.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
