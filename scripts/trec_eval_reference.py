"""Writes tests/fixtures/trec/: random graded qrels and a run with tied scores, and what
pytrec_eval (trec_eval's code) and BEIR's MRR@k report on them; tests/it/retrieval.rs checks
gradcache's measures against these numbers.

    pip install pytrec-eval-terrier
    python scripts/trec_eval_reference.py tests/fixtures/trec
"""
import json
import os
import random
import sys

import pytrec_eval

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = random.Random(7)
docs = [f"d{i}" for i in range(300)]
qrels, run = {}, {}
for q in range(40):
    qid = f"q{q}"
    judged = rng.sample(docs, rng.randint(1, 12))
    # grades 0 (judged non-relevant), 1, 2, 3; one query with no relevant document
    qrels[qid] = {d: (0 if q == 5 else rng.choice([0, 1, 1, 2, 3])) for d in judged}
    retrieved = rng.sample(docs, 120)
    # put some relevant documents high, and make ties (scores on a coarse grid)
    for d in judged:
        if rng.random() < 0.6 and d not in retrieved[:30]:
            retrieved.insert(rng.randint(0, 30), d)
    retrieved = retrieved[:110]
    run[qid] = {d: float(rng.randint(0, 40)) / 8.0 for d in retrieved}
    for d in judged:
        if d in run[qid] and rng.random() < 0.7:
            run[qid][d] = float(rng.randint(28, 40)) / 8.0
# a judged query the run does not hold
qrels["q_missing"] = {"d1": 1}

with open(os.path.join(out, "qrels.tsv"), "w") as f:
    f.write("query-id\tcorpus-id\tscore\n")
    for q, ds in qrels.items():
        for d, g in ds.items():
            f.write(f"{q}\t{d}\t{g}\n")
with open(os.path.join(out, "run.trec"), "w") as f:
    for q, ds in run.items():
        for rank, (d, s) in enumerate(sorted(ds.items(), key=lambda x: -x[1])):
            f.write(f"{q} Q0 {d} {rank + 1} {s} ref\n")

evaluator = pytrec_eval.RelevanceEvaluator(
    qrels, {"ndcg_cut.10", "recall.1,10,100", "map_cut.100"}
)
scores = evaluator.evaluate(run)


def mrr_at(k):
    # trec_eval's ordering (score desc, docid desc), first relevant within k
    total = 0.0
    for q in qrels:
        ranked = sorted(run.get(q, {}).items(), key=lambda x: x[0], reverse=True)
        ranked = sorted(ranked, key=lambda x: -x[1])
        for i, (d, _) in enumerate(ranked[:k]):
            if qrels[q].get(d, 0) >= 1:
                total += 1.0 / (i + 1)
                break
    return total / len(qrels)


n = len(qrels)  # pytrec_eval leaves out the query missing from the run: it scores 0
mean = lambda m: sum(s[m] for s in scores.values()) / n
expected = {
    "queries": n,
    "ndcg_at_10": mean("ndcg_cut_10"),
    "mrr_at_10": mrr_at(10),
    "recall_at_1": mean("recall_1"),
    "recall_at_10": mean("recall_10"),
    "recall_at_100": mean("recall_100"),
    "map_at_100": mean("map_cut_100"),
}
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump(expected, f, indent=1)
print(expected)
