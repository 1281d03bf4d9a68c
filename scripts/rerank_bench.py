#!/usr/bin/env python3
"""sentence-transformers' side of scripts/rerank-bench (run by a developer, never by CI):

    rerank_bench.py make MINILM OUT      # all-MiniLM-L6-v2 with a fresh one-label head
                                         # (seeded), saved by CrossEncoder.save
    rerank_bench.py train MODEL ROWS BATCH NEGATIVES MINI MAX_LEN STEPS
                                         # CachedMultipleNegativesRankingLoss training;
                                         # prints (query, document) pairs/s

    rerank_bench.py predict MODEL PAIRS BATCH
                                         # CrossEncoder.predict; prints pairs/s

ROWS is JSONL (gzip) with `query`, `positive` and `negatives` (the hard negatives); each
query is scored against its positive, its hard negatives and NEGATIVES documents of other
rows (the loss's num_negatives), MINI pairs at a time (mini_batch_size), in training mode
(dropout on), AdamW. The first step is a warm-up and not counted.
"""

import gzip
import json
import os
import sys
import time

import torch


def make(minilm, out):
    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    import tempfile

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=1)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(minilm).save_pretrained(tmp)
        CrossEncoder(tmp).save(out)


def train(model_dir, rows, batch, negatives, mini, max_len, steps):
    from sentence_transformers.cross_encoder import CrossEncoder, losses

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    data = [json.loads(l) for l in gzip.open(rows, "rt")]
    model = CrossEncoder(model_dir, device="cpu", max_length=max_len)
    model.train()
    loss = losses.CachedMultipleNegativesRankingLoss(model, num_negatives=negatives,
                                                     mini_batch_size=mini)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    hard = len(data[0]["negatives"])
    group = 1 + hard + negatives
    rates = []
    for step in range(steps + 1):
        b = data[step * batch:(step + 1) * batch]
        inputs = [[r["query"] for r in b], [r["positive"] for r in b]]
        inputs += [[r["negatives"][k] for r in b] for k in range(hard)]
        start = time.perf_counter()
        value = loss(inputs, None)
        value.backward()
        opt.step()
        opt.zero_grad()
        if step:
            rates.append(batch * group / (time.perf_counter() - start))
    print(f"{sum(rates) / len(rates):.2f}")


def predict(model_dir, pairs_path, batch):
    """CrossEncoder.predict over JSONL {"query", "document"} rows; prints pairs/s."""
    from sentence_transformers.cross_encoder import CrossEncoder

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rows = [json.loads(l) for l in open(pairs_path)]
    pairs = [(r["query"], r["document"]) for r in rows]
    model = CrossEncoder(model_dir, device="cpu")
    model.predict(pairs[:batch], batch_size=batch)
    start = time.perf_counter()
    model.predict(pairs, batch_size=batch)
    print(f"{len(pairs) / (time.perf_counter() - start):.2f}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2], sys.argv[3])
    elif cmd == "predict":
        predict(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        a = sys.argv[2:]
        train(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]))
