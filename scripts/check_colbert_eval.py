"""Checks `gradcache eval --beir` on a multi-vector (ColBERT) model against
sentence-transformers 6's multi-vector InformationRetrievalEvaluator on the same model
and data (manual; the peer venv of scripts/peer-bench):

    gradcache eval --model MODEL --beir data/bible-beir --split test --output SUMMARY.json
    python scripts/check_colbert_eval.py MODEL data/bible-beir test SUMMARY.json

Both encode with the model itself (its prefixes, query expansion, skiplist) and rank the
whole corpus by MaxSim; the measures should agree to float rounding.
"""
import json
import os
import sys
import time

from sentence_transformers import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from beir_check import EVALUATOR_MEASURES, compare, read_beir, relevant  # noqa: E402

model_dir, beir, split, summary = sys.argv[1:5]
ours = json.load(open(summary))["metrics"]
corpus, queries, qrels = read_beir(beir, split)
qrels = relevant(qrels)
queries = {q: queries[q] for q in qrels}
model = MultiVectorEncoder(model_dir, device="cpu")
ev = MultiVectorInformationRetrievalEvaluator(
    queries, corpus, qrels, **EVALUATOR_MEASURES, batch_size=64, show_progress_bar=False, name="x",
)
start = time.time()
st = ev(model)
seconds = time.time() - start
worst = compare(ours, st)
print(f"largest difference {worst:.2e} ({len(queries)} queries, {len(corpus)} documents; "
      f"sentence-transformers' evaluator {seconds:.1f} s)")
