"""Builds data/bible-beir/: a small BEIR-layout retrieval set from the shared verse-aligned
KJV -> WEB pairs (public domain), for the worked example of docs/retrieval.md.

    python scripts/make_bible_beir.py ../shared/data/bible-kjv-web/pairs.jsonl data/bible-beir

- corpus.jsonl.gz: WEB verses (`_id` = verse id, `title` = book name, `text` = verse);
- queries.jsonl: KJV verses (`_id` = "q" + verse id);
- qrels/train.tsv: 3,000 verses of books other than Ruth and 31-39 (Obadiah to Malachi);
- qrels/dev.tsv: 200 more verses of those books (for evaluation during training);
- qrels/test.tsv: 500 verses of Ruth and books 31-39 (books never trained on).
The corpus holds every WEB verse of the shared set (23,145 documents): the relevant verse
of each query and some 19,000 more to retrieve it from.
"""
import gzip
import json
import os
import random
import sys

BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi",
]

source, out = sys.argv[1], sys.argv[2]
pairs = [json.loads(line) for line in open(source)]
book = lambda p: int(p["id"]) // 1_000_000
held_out_books = {8} | set(range(31, 40))
rng = random.Random(20261125)
test = rng.sample([p for p in pairs if book(p) in held_out_books], 500)
rest = [p for p in pairs if book(p) not in held_out_books]
picked = rng.sample(rest, 3200)
train, dev = picked[:3000], picked[3000:]

os.makedirs(os.path.join(out, "qrels"), exist_ok=True)
asked = sorted(train + dev + test, key=lambda p: int(p["id"]))
docs = sorted(pairs, key=lambda p: int(p["id"]))
with gzip.GzipFile(os.path.join(out, "corpus.jsonl.gz"), "wb", mtime=0) as f:
    for p in docs:
        line = {"_id": p["id"], "title": BOOKS[book(p) - 1], "text": p["positive"]}
        f.write((json.dumps(line) + "\n").encode())
with open(os.path.join(out, "queries.jsonl"), "w") as f:
    for p in asked:
        f.write(json.dumps({"_id": "q" + p["id"], "text": p["query"]}) + "\n")
for name, split in [("train", train), ("dev", dev), ("test", test)]:
    with open(os.path.join(out, "qrels", f"{name}.tsv"), "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for p in sorted(split, key=lambda p: int(p["id"])):
            f.write(f"q{p['id']}\t{p['id']}\t1\n")
print(len(docs), "documents;", len(train), "train,", len(dev), "dev,", len(test), "test queries")
