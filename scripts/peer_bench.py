#!/usr/bin/env python3
"""The sentence-transformers side of scripts/peer-bench (not in CI).

    peer_bench.py train MODEL_DIR PAIRS.jsonl BATCH MINI_BATCH MAX_LEN SYMMETRIC STEPS
    peer_bench.py encode MODEL_DIR TEXTS.txt BATCH MAX_LEN
    peer_bench.py sgemm

train: CachedMultipleNegativesRankingLoss (or its symmetric variant) with AdamW, dropout
on (train mode), one optimizer step per batch of BATCH pairs in mini-batches of
MINI_BATCH; prints the mean pairs/s of the steps after the first. encode:
SentenceTransformer.encode; prints texts/s. sgemm: torch's f32 2048^3 matmul, GFLOP/s.
Threads: torch.set_num_threads from OMP_NUM_THREADS (the caller sets 2).
"""
import json
import os
import sys
import time

import torch


def threads():
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def train(model_dir, pairs_path, batch, mini, max_len, symmetric, steps):
    from sentence_transformers import SentenceTransformer, losses

    pairs = [json.loads(line) for line in open(pairs_path)]
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = max_len
    model.train()
    cls = (losses.CachedMultipleNegativesSymmetricRankingLoss if symmetric
           else losses.CachedMultipleNegativesRankingLoss)
    loss = cls(model, scale=20.0, mini_batch_size=mini)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rates = []
    for step in range(steps + 1):
        b = pairs[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        q = model.tokenize([p["query"] for p in b])
        d = model.tokenize([p["positive"] for p in b])
        value = loss([q, d], None)
        value.backward()
        opt.step()
        opt.zero_grad()
        if step:
            rates.append(batch / (time.perf_counter() - start))
    print(f"{sum(rates) / len(rates):.2f}")


def encode(model_dir, texts_path, batch, max_len):
    from sentence_transformers import SentenceTransformer

    texts = [line.rstrip("\n") for line in open(texts_path) if line.strip()]
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = max_len
    model.encode(texts[:batch], batch_size=batch)  # warm up
    start = time.perf_counter()
    model.encode(texts, batch_size=batch)
    print(f"{len(texts) / (time.perf_counter() - start):.2f}")


def sgemm():
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    print(f"{2 * 2048 ** 3 / best / 1e9:.1f}")


if __name__ == "__main__":
    threads()
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "train":
        train(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), args[5] == "1", int(args[6]))
    elif cmd == "encode":
        encode(args[0], args[1], int(args[2]), int(args[3]))
    else:
        sgemm()
