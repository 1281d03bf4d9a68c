"""What the manual checks of `gradcache eval --beir` against sentence-transformers share
(scripts/check_beir_eval.py, check_colbert_eval.py, check_sparse_eval.py): the BEIR folder
read as the evaluators take it, the measures they are asked for, and the comparison
table."""
import gzip
import json

# The measures `gradcache eval` reports, as sentence-transformers' evaluators are asked.
EVALUATOR_MEASURES = dict(
    mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100], map_at_k=[100],
)
# Our summary's names and the suffix of sentence-transformers' keys.
MEASURES = [
    ("ndcg_at_10", "ndcg@10"),
    ("mrr_at_10", "mrr@10"),
    ("recall_at_1", "recall@1"),
    ("recall_at_10", "recall@10"),
    ("recall_at_100", "recall@100"),
    ("map_at_100", "map@100"),
]


def lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(l) for l in f if l.strip()]


def read_beir(beir, split):
    """The corpus (title and text joined by a space), the judged queries of `split` and
    its graded judgements {query: {document: grade}}."""
    corpus = {d["_id"]: ((d.get("title") or "") + " " + d["text"]).strip()
              for d in lines(f"{beir}/corpus.jsonl.gz")}
    queries = {q["_id"]: q["text"] for q in lines(f"{beir}/queries.jsonl")}
    qrels = {}
    for i, line in enumerate(open(f"{beir}/qrels/{split}.tsv")):
        if i == 0:
            continue
        q, d, g = line.split()
        qrels.setdefault(q, {})[d] = int(g)
    return corpus, {q: queries[q] for q in qrels}, qrels


def relevant(qrels):
    """The documents judged relevant (grade above 0) of each query that has one."""
    out = {q: {d for d, g in ds.items() if g > 0} for q, ds in qrels.items()}
    return {q: ds for q, ds in out.items() if ds}


def st_value(st, suffix):
    """The value of sentence-transformers' metric whose key ends with `suffix`."""
    return st[next(k for k in st if k.endswith(suffix))]


def compare(ours, st):
    """Prints our measures beside sentence-transformers'; returns the largest difference."""
    worst = 0.0
    print("measure              gradcache   sentence-transformers")
    for name, suffix in MEASURES:
        a, b = ours[name], st_value(st, suffix)
        worst = max(worst, abs(a - b))
        print(f"{name:19} {a:10.6f}   {b:10.6f}")
    return worst
