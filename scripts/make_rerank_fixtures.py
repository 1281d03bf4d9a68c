#!/usr/bin/env python3
"""Tiny cross-encoders saved by sentence-transformers' `CrossEncoder`, their scores and
its cross-encoder losses' gradients, for tests/it/rerank.rs (run by a developer, never by
CI; the venv of scripts/peer-bench has what it needs):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_rerank_fixtures.py
                                                   # writes tests/fixtures/rerank/

For each encoder family (bert, roberta, xlm-roberta, mpnet, distilbert, modernbert,
deberta-v2) the
tiny model of tests/fixtures/families/<family> gets its family's classification head
(`AutoModelForSequenceClassification`, one label; ModernBERT's with mean pooling), every
head weight drawn away from its initialisation, and is saved by `CrossEncoder.save` as
`tests/fixtures/rerank/<family>/`. `reference.json` keeps each family's raw logits
(`predict(activation_fn=Identity())`) and scores (`predict()`, the saved activation) of
the same (query, document) pairs, one of them longer than the 32-token limit.

On the BERT one, in evaluation mode (no dropout) and in float64 (the losses' own float32
casts lifted), one step of each loss:

- `cmnrl`: `CachedMultipleNegativesRankingLoss(num_negatives=2, mini_batch_size=3)`
  over 4 (query, positive, hard negative) rows, the in-batch negatives fixed (written in
  `groups`: each row's positive, its two in-batch negatives, its hard negative);
- `bce`: `BinaryCrossEntropyLoss` on 8 labelled pairs;
- `listnet` and `lambda`: `ListNetLoss` and `LambdaLoss` (defaults) on 4 queries with 3
  graded documents each;
- `margin_mse`: `MarginMSELoss` on 4 (query, positive, 2 negatives) rows with teacher
  scores.

`reference.safetensors` keeps each case's parameter gradients (`{case}.grad.{name}`,
names as the `*ForSequenceClassification` module has them).
"""

import json
import os
import shutil
import sys
import tempfile

import safetensors.torch
import sentence_transformers
import torch
import transformers
from sentence_transformers.cross_encoder import CrossEncoder, losses
from transformers import AutoModelForSequenceClassification, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "rerank")
FAMILIES = ["bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "modernbert",
            "deberta-v2"]
BASE = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "mpnet": "mpnet",
        "distilbert": "distilbert", "modernbert": "model", "deberta-v2": "deberta"}

QUERIES = [
    "Who created the heaven and the earth?",
    "light",
    "the waters under the firmament",
    "And the earth was without form, and void; and darkness was upon the face of the deep, "
    "and the Spirit of God moved upon the face of the waters.",
]
DOCUMENTS = [
    "In the beginning God created the heaven and the earth.",
    "And God said, Let there be light: and there was light.",
    "And God made the firmament, and divided the waters which were under the firmament.",
    "And God called the light Day, and the darkness he called Night.",
    "void",
    "And God said, Let the earth bring forth grass, the herb yielding seed, and the fruit "
    "tree yielding fruit after his kind, whose seed is in itself, upon the earth: and it "
    "was so.",
]


def pairs():
    return [[QUERIES[i % 4], DOCUMENTS[(i * 5 + 1) % 6]] for i in range(10)] + [
        [QUERIES[3], DOCUMENTS[5]], ["", DOCUMENTS[0]]]


def build(family, seed):
    src = os.path.join(ROOT, "tests", "fixtures", "families", family)
    kwargs = {"num_labels": 1}
    if family == "modernbert":
        kwargs["classifier_pooling"] = "mean"
    model = AutoModelForSequenceClassification.from_pretrained(src, **kwargs)
    torch.manual_seed(seed)
    base = BASE[family] + "."
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(base):
                continue
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    tok = AutoTokenizer.from_pretrained(src)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        ce = CrossEncoder(tmp)
        out = os.path.join(OUT, family)
        shutil.rmtree(out, ignore_errors=True)
        ce.save(out)
    os.remove(os.path.join(out, "README.md"))
    return CrossEncoder(out)


def make_beir(ce):
    """A BEIR folder of 12 test queries of data/bible-beir, a corpus of their relevant
    verses and 48 others, and a first-stage run of 8 documents a query (its positive at
    rank 1-8, or missing for every fourth query; one run line names a document not in the
    corpus); the evaluator's measures of it, its positives reranked or not."""
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
    import gzip
    import random
    src = os.path.join(ROOT, "data", "bible-beir")
    queries = [json.loads(l) for l in open(os.path.join(src, "queries.jsonl"))]
    qrels = [l.split("\t") for l in open(os.path.join(src, "qrels", "test.tsv")).read().splitlines()[1:]]
    qrels = qrels[:12]
    corpus = {d["_id"]: d for d in map(json.loads, gzip.open(os.path.join(src, "corpus.jsonl.gz"), "rt"))}
    rng = random.Random(7)
    relevant = [d for _, d, _ in qrels]
    others = [i for i in sorted(corpus) if i.startswith("31") and i not in relevant][:48]
    docs = relevant + others
    out = os.path.join(OUT, "beir")
    os.makedirs(os.path.join(out, "qrels"), exist_ok=True)
    with open(os.path.join(out, "corpus.jsonl"), "w") as f:
        for i in docs:
            f.write(json.dumps(corpus[i]) + "\n")
    by_id = {q["_id"]: q for q in queries}
    with open(os.path.join(out, "queries.jsonl"), "w") as f:
        for q, _, _ in qrels:
            f.write(json.dumps(by_id[q]) + "\n")
    with open(os.path.join(out, "qrels", "test.tsv"), "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for q, d, g in qrels:
            f.write(f"{q}\t{d}\t{g}\n")
    run = []
    samples = []
    text = lambda i: corpus[i]["title"] + " " + corpus[i]["text"]
    for n, (q, d, _) in enumerate(qrels):
        ranked = rng.sample(others, 8)
        if n % 4 != 3:
            ranked[n % 8] = d
        for r, i in enumerate(ranked):
            run.append(f"{q} Q0 {i} {r + 1} {20 - r} first")
        samples.append({"query": by_id[q]["text"], "positive": [text(d)],
                        "documents": [text(i) for i in ranked]})
    run.insert(3, f"{qrels[0][0]} Q0 nowhere 99 0.5 first")
    with open(os.path.join(out, "run.trec"), "w") as f:
        f.write("\n".join(run) + "\n")
    result = {}
    for always in [False, True]:
        ev = CrossEncoderRerankingEvaluator(samples, at_k=10, always_rerank_positives=always,
                                            write_csv=False)
        result["always" if always else "retrieved"] = {k: float(v) for k, v in ev(ce).items()}
    print("rerank", result)
    return result


def grads(ce, case, tensors, meta, loss, inputs, labels, extra):
    ce.model.zero_grad()
    # ListNetLoss and LambdaLoss cast the logits to float32 (`.float()`) and build their
    # matrices in the default dtype: lifted here, so the whole step is in float64.
    cast = torch.Tensor.float
    torch.Tensor.float = torch.Tensor.double
    torch.set_default_dtype(torch.float64)
    try:
        value = loss(inputs, labels)
    finally:
        torch.Tensor.float = cast
        torch.set_default_dtype(torch.float32)
    value.backward()
    n = 0
    for name, p in ce.model.named_parameters():
        if p.grad is not None:
            tensors[f"{case}.grad.{name}"] = p.grad.detach().float().clone()
            n += 1
    meta["losses"][case] = {"loss": float(value), **extra}
    print(f"{case}: loss {float(value):.6f}, {n} gradients")


def main():
    torch.set_default_dtype(torch.float32)
    meta = {"pairs": pairs(), "families": {}, "losses": {}}
    tensors = {}
    models = {}
    for i, family in enumerate(FAMILIES):
        ce = build(family, 100 + i)
        ce.model.eval()
        logits = ce.predict(pairs(), activation_fn=torch.nn.Identity(), convert_to_numpy=True)
        scores = ce.predict(pairs(), convert_to_numpy=True)
        meta["families"][family] = {"logits": logits.tolist(), "scores": scores.tolist()}
        models[family] = ce
        print(family, logits[:3])

    # The losses in float64: a cross-encoder's ranking gradient is a sum over a query's
    # documents of terms that nearly cancel (exactly, for the bias, before the sigmoid's
    # slopes), so float32 rounding shows in it at 1e-4 (5.9e-4 of the classifier's bias,
    # measured); the gradients are kept as float32.
    ce_f32 = CrossEncoder(os.path.join(OUT, "bert"))
    ce_f32.model.eval()
    ce = models["bert"]
    ce.model.eval()
    ce.model.double()
    q, pos, hard = QUERIES, DOCUMENTS[:4], [DOCUMENTS[(i + 2) % 6] for i in range(4)]
    # In-batch negatives: two other rows' documents (positives or hard negatives) per row.
    candidates = pos + hard
    pick = [[1, 6], [7, 0], [3, 4], [2, 5]]
    columns = [[candidates[pick[r][c]] for r in range(4)] for c in range(2)]
    cmnrl = losses.CachedMultipleNegativesRankingLoss(ce, num_negatives=2, mini_batch_size=3)
    cmnrl.get_in_batch_negatives = lambda anchors, cands: iter(columns)
    groups = [[pos[r], columns[0][r], columns[1][r], hard[r]] for r in range(4)]
    grads(ce, "cmnrl", tensors, meta, cmnrl, [list(q), list(pos), list(hard)], None,
          {"queries": q, "groups": groups, "scale": 10.0})

    bce_pairs = pairs()[:8]
    bce_labels = [1.0, 0.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.25]
    grads(ce, "bce", tensors, meta, losses.BinaryCrossEntropyLoss(ce),
          [[p[0] for p in bce_pairs], [p[1] for p in bce_pairs]], torch.tensor(bce_labels),
          {"queries": [p[0] for p in bce_pairs], "groups": [[p[1]] for p in bce_pairs],
           "labels": [[x] for x in bce_labels]})

    docs = [[DOCUMENTS[(r + k) % 6] for k in range(3)] for r in range(4)]
    graded = [[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 2.0]]
    for case, loss in [("listnet", losses.ListNetLoss(ce)), ("lambda", losses.LambdaLoss(ce))]:
        grads(ce, case, tensors, meta, loss, [list(q), docs],
              [torch.tensor(g) for g in graded],
              {"queries": q, "groups": docs, "labels": graded})

    teacher = [[9.0, 4.5, 1.0], [7.5, 6.0, -2.0], [8.0, 1.5, 3.0], [6.5, 5.5, 0.5]]
    grads(ce, "margin_mse", tensors, meta, losses.MarginMSELoss(ce),
          [list(q)] + [[docs[r][k] for r in range(4)] for k in range(3)],
          torch.tensor(teacher), {"queries": q, "groups": docs, "labels": teacher})

    meta["rerank"] = make_beir(ce_f32)

    meta["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
    }
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                os.path.join(OUT, "reference.safetensors"))
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
