#!/usr/bin/env python3
"""The data of configs/mixture.toml (run by a developer, never by CI), from the project's
shared verse-aligned pairs `../shared/data/bible-kjv-web/pairs.jsonl` (public domain, see
data/mixture/README.md):

    python3 scripts/make_mixture_data.py ../shared/data/bible-kjv-web/pairs.jsonl
    # then the teacher's hard negatives and scores of next-verse (see data/mixture/README.md)

Writes data/mixture/:

- `next-verse-pairs.jsonl`: 1,500 (verse, the verse that follows it) pairs in the KJV, of
  books 1-30 (the pairs hold the Old Testament); `next-verse-eval.jsonl`: 200 more, of
  books 31-39 (Obadiah to Malachi, never trained on). The training file is what `gradcache mine --output-scores` turns into
  `next-verse.jsonl.gz` (3 hard negatives each with a teacher's scores);
- `books.jsonl.gz`: 800 (WEB verse, "the book of <name>") pairs with three other books'
  names as hard negatives: a classification set (in-batch negatives would be false
  negatives: many verses share a book).
"""

import ast
import gzip
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "data", "mixture")
SEED = 2026
HELD_OUT = set(range(31, 40))


def books():
    # The book names of scripts/make_bible_beir.py, in canon order.
    with open(os.path.join(ROOT, "scripts", "make_bible_beir.py")) as f:
        text = f.read()
    start = text.index("BOOKS = [")
    end = text.index("]", start)
    return ast.literal_eval(text[start + len("BOOKS = "): end + 1])


def main(path):
    rng = random.Random(SEED)
    names = books()
    with open(path) as f:
        pairs = [json.loads(line) for line in f]
    by_id = {int(p["id"]): p for p in pairs}
    book = lambda p: int(p["id"]) // 1_000_000  # noqa: E731
    following = []
    for p in pairs:
        nxt = by_id.get(int(p["id"]) + 1)
        if nxt is not None and book(nxt) == book(p):
            following.append((p, nxt))
    train = [x for x in following if book(x[0]) not in HELD_OUT]
    held = [x for x in following if book(x[0]) in HELD_OUT]
    os.makedirs(OUT, exist_ok=True)

    def write(name, rows, zipped=False):
        opener = gzip.open if zipped else open
        with opener(os.path.join(OUT, name), "wt") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    write(
        "next-verse-pairs.jsonl",
        [{"query": a["query"], "positive": b["query"]} for a, b in rng.sample(train, 1500)],
    )
    write(
        "next-verse-eval.jsonl",
        [{"query": a["query"], "positive": b["query"]} for a, b in rng.sample(held, 200)],
    )
    chosen = rng.sample([p for p in pairs if book(p) not in HELD_OUT], 800)
    names = names[: max(book(p) for p in pairs)]
    rows = []
    for p in chosen:
        own = names[book(p) - 1]
        others = rng.sample([n for n in names if n != own], 3)
        rows.append({
            "query": p["positive"],
            "positive": f"the book of {own}",
            "negatives": [f"the book of {n}" for n in others],
        })
    write("books.jsonl.gz", rows, zipped=True)


if __name__ == "__main__":
    main(sys.argv[1])
