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
import json
import os
import sys
import time

from sentence_transformers import SparseEncoder
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from beir_check import EVALUATOR_MEASURES, compare, read_beir, relevant, st_value  # noqa: E402

model_dir, beir, split, summary = sys.argv[1:5]
summary = json.load(open(summary))
ours, sparsity = summary["metrics"], summary["sparsity"]
corpus, queries, qrels = read_beir(beir, split)
qrels = relevant(qrels)
queries = {q: queries[q] for q in qrels}
model = SparseEncoder(model_dir, device="cpu")
ev = SparseInformationRetrievalEvaluator(
    queries, corpus, qrels, **EVALUATOR_MEASURES, batch_size=64, show_progress_bar=False, name="x",
)
start = time.time()
st = ev(model)
seconds = time.time() - start
worst = compare(ours, st)
worst_count = 0.0
for name in ("query_active_dims", "corpus_active_dims", "avg_flops"):
    a, b = sparsity[name], st_value(st, name)
    worst_count = max(worst_count, abs(a - b) / max(abs(b), 1e-12))
    print(f"{name:19} {a:10.3f}   {b:10.3f}")
print(f"largest difference: measures {worst:.2e}, counts {worst_count:.2e} relative "
      f"({len(queries)} queries, {len(corpus)} documents; sentence-transformers' evaluator {seconds:.1f} s)")
