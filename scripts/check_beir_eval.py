"""Checks `gradcache eval --beir` against the standard tools on the same model and data
(manual; needs the peer venv with sentence-transformers and pytrec-eval-terrier):

1. pytrec_eval on gradcache's own TREC run file: the same ndcg_cut_10, recall_1/10/100 and
   map_cut_100 (the run is the same, so these must agree to rounding);
2. sentence-transformers' InformationRetrievalEvaluator encoding with the model itself
   (its own embeddings and ranking, with the model's prompts): close, not bit-equal.

    python scripts/check_beir_eval.py MODEL_DIR data/bible-beir test RUN.trec SUMMARY.json
"""
import json
import os
import sys

import pytrec_eval
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from beir_check import EVALUATOR_MEASURES, read_beir  # noqa: E402

model_dir, beir, split, run_file, summary = sys.argv[1:6]
ours = json.load(open(summary))["metrics"]
corpus, queries, qrels = read_beir(beir, split)

run = {}
for line in open(run_file):
    q, _, d, _, s, _ = line.split()
    run.setdefault(q, {})[d] = float(s)
scores = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.1,10,100", "map_cut.100"}).evaluate(run)
mean = lambda m: sum(s[m] for s in scores.values()) / len(qrels)
print("measure          gradcache   pytrec_eval(run)   sentence-transformers")
model = SentenceTransformer(model_dir, device="cpu")
prompts = model.prompts
ev = InformationRetrievalEvaluator(
    queries, corpus, {q: {d for d, g in ds.items() if g > 0} for q, ds in qrels.items()},
    **EVALUATOR_MEASURES,
    query_prompt=prompts.get("query"), corpus_prompt=prompts.get("passage"),
    batch_size=64, show_progress_bar=False, name="x",
)
import time
start = time.time()
st = ev(model)
st_seconds = time.time() - start
sim = model.similarity_fn_name
rows = [
    ("ndcg_at_10", mean("ndcg_cut_10"), st[f"x_{sim}_ndcg@10"]),
    ("mrr_at_10", None, st[f"x_{sim}_mrr@10"]),
    ("recall_at_1", mean("recall_1"), st[f"x_{sim}_recall@1"]),
    ("recall_at_10", mean("recall_10"), st[f"x_{sim}_recall@10"]),
    ("recall_at_100", mean("recall_100"), st[f"x_{sim}_recall@100"]),
    ("map_at_100", mean("map_cut_100"), st[f"x_{sim}_map@100"]),
]
worst_run, worst_st = 0.0, 0.0
for name, trec, s in rows:
    g = ours[name]
    if trec is not None:
        worst_run = max(worst_run, abs(g - trec))
    worst_st = max(worst_st, abs(g - s))
    print(f"{name:15} {g:10.6f}   {'' if trec is None else f'{trec:10.6f}':>16}   {s:10.6f}")
print(f"largest difference: against pytrec_eval on the run {worst_run:.2e}, against sentence-transformers {worst_st:.2e}")
print(f"sentence-transformers' evaluator: {st_seconds:.1f} s (encode and search, torch threads {__import__('torch').get_num_threads()})")
