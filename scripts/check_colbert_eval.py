"""Checks `gradcache eval --beir` on a multi-vector (ColBERT) model against
sentence-transformers 6's multi-vector InformationRetrievalEvaluator on the same model
and data (manual; the peer venv of scripts/peer-bench):

    gradcache eval --model MODEL --beir data/bible-beir --split test --output SUMMARY.json
    python scripts/check_colbert_eval.py MODEL data/bible-beir test SUMMARY.json

Both encode with the model itself (its prefixes, query expansion, skiplist) and rank the
whole corpus by MaxSim; the measures should agree to float rounding.
"""
import gzip
import json
import sys
import time

from sentence_transformers import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator

model_dir, beir, split, summary = sys.argv[1:5]
ours = json.load(open(summary))["metrics"]


def lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(l) for l in f if l.strip()]


corpus = {d["_id"]: ((d.get("title") or "") + " " + d["text"]).strip() for d in lines(f"{beir}/corpus.jsonl.gz")}
queries = {q["_id"]: q["text"] for q in lines(f"{beir}/queries.jsonl")}
qrels = {}
for i, line in enumerate(open(f"{beir}/qrels/{split}.tsv")):
    if i == 0:
        continue
    q, d, g = line.split()
    if int(g) > 0:
        qrels.setdefault(q, set()).add(d)
queries = {q: queries[q] for q in qrels}
model = MultiVectorEncoder(model_dir, device="cpu")
ev = MultiVectorInformationRetrievalEvaluator(
    queries, corpus, qrels,
    mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100], map_at_k=[100],
    batch_size=64, show_progress_bar=False, name="x",
)
start = time.time()
st = ev(model)
seconds = time.time() - start
key = lambda suffix: next(k for k in st if k.endswith(suffix))
rows = [
    ("ndcg_at_10", key("ndcg@10")),
    ("mrr_at_10", key("mrr@10")),
    ("recall_at_1", key("recall@1")),
    ("recall_at_10", key("recall@10")),
    ("recall_at_100", key("recall@100")),
    ("map_at_100", key("map@100")),
]
worst = 0.0
print("measure          gradcache   sentence-transformers")
for name, k in rows:
    worst = max(worst, abs(ours[name] - st[k]))
    print(f"{name:15} {ours[name]:10.6f}   {st[k]:10.6f}")
print(f"largest difference {worst:.2e} ({len(queries)} queries, {len(corpus)} documents; "
      f"sentence-transformers' evaluator {seconds:.1f} s)")
