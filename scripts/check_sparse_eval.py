"""Checks `gradcache eval --beir` on a sparse (SPLADE) model against sentence-transformers'
SparseInformationRetrievalEvaluator on the same model and data (manual; the peer venv of
scripts/peer-bench):

    gradcache eval --model MODEL --beir data/bible-beir --split test --output SUMMARY.json
    python scripts/check_sparse_eval.py MODEL data/bible-beir test SUMMARY.json

Both encode with the model itself (sentence-transformers loads our export as a
SparseEncoder) and rank the whole corpus by sparse dot products: ours through an inverted
index, sentence-transformers' through torch's sparse products. The measures, the mean
active dimensions of queries and documents and the average FLOPS should agree to float
rounding.
"""
import gzip
import json
import sys
import time

from sentence_transformers import SparseEncoder
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

model_dir, beir, split, summary = sys.argv[1:5]
summary = json.load(open(summary))
ours, sparsity = summary["metrics"], summary["sparsity"]


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
model = SparseEncoder(model_dir, device="cpu")
ev = SparseInformationRetrievalEvaluator(
    queries, corpus, qrels,
    mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100], map_at_k=[100],
    batch_size=64, show_progress_bar=False, name="x",
)
start = time.time()
st = ev(model)
seconds = time.time() - start
key = lambda suffix: next(k for k in st if k.endswith(suffix))
rows = [
    ("ndcg_at_10", ours["ndcg_at_10"], st[key("ndcg@10")]),
    ("mrr_at_10", ours["mrr_at_10"], st[key("mrr@10")]),
    ("recall_at_1", ours["recall_at_1"], st[key("recall@1")]),
    ("recall_at_10", ours["recall_at_10"], st[key("recall@10")]),
    ("recall_at_100", ours["recall_at_100"], st[key("recall@100")]),
    ("map_at_100", ours["map_at_100"], st[key("map@100")]),
]
counts = [
    ("query_active_dims", sparsity["query_active_dims"], st[key("query_active_dims")]),
    ("corpus_active_dims", sparsity["corpus_active_dims"], st[key("corpus_active_dims")]),
    ("avg_flops", sparsity["avg_flops"], st[key("avg_flops")]),
]
worst = 0.0
print("measure              gradcache   sentence-transformers")
for name, a, b in rows:
    worst = max(worst, abs(a - b))
    print(f"{name:19} {a:10.6f}   {b:10.6f}")
worst_count = 0.0
for name, a, b in counts:
    worst_count = max(worst_count, abs(a - b) / max(abs(b), 1e-12))
    print(f"{name:19} {a:10.3f}   {b:10.3f}")
print(f"largest difference: measures {worst:.2e}, counts {worst_count:.2e} relative "
      f"({len(queries)} queries, {len(corpus)} documents; sentence-transformers' evaluator {seconds:.1f} s)")
