#!/usr/bin/env python3
"""sentence-transformers' distillation losses on the tiny fixture models, for
tests/it/distillation.rs (run by a developer, never by CI; the venv of scripts/peer-bench
has what it needs):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_distill_fixtures.py
                                                   # writes tests/fixtures/distill/

Four queries, each with its positive and two hard negatives (passage `i * 3 + k`, as
gradcache lays a group out), and fixed teacher scores (the positive's highest), go
through, in evaluation mode (no dropout):

- the dense BERT of tests/fixtures/families/bert: `MarginMSELoss` and `DistillKLDivLoss`
  (the KL once with its defaults, once with `student_temperature=2, teacher_temperature=0.5`),
  each with dot products (the losses' default) and cosine similarity;
- the SPLADE BERT of tests/fixtures/sparse/bert: `SpladeLoss(SparseMarginMSELoss)` and
  `SpladeLoss(SparseDistillKLDivLoss)` with the FLOPS regularisers (document weight 3e-3,
  query weight 5e-3).

`reference.safetensors` keeps each case's parameter gradients (`{case}.grad.{name}`);
`reference.json` the texts, the teacher scores and each case's loss.
"""

import json
import os
import sys

import safetensors.torch
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer, SparseEncoder, util
from sentence_transformers.sentence_transformer import losses
from sentence_transformers.sparse_encoder import losses as sparse_losses

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_family_fixtures import PASSAGES, QUERIES, TEXTS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "distill")
DOC_WEIGHT, QUERY_WEIGHT = 3e-3, 5e-3
NEGATIVES = 2
# Each query's hard negatives: two texts that are not its positive.
OTHERS = [t for t in TEXTS if t] + PASSAGES
TEACHER = [
    [9.0, 4.5, 1.0],
    [7.5, 6.0, -2.0],
    [8.0, 1.5, 3.0],
    [6.5, 5.5, 0.5],
]


def groups():
    docs = []
    for i, positive in enumerate(PASSAGES):
        negatives = [t for t in OTHERS if t != positive][i : i + NEGATIVES]
        docs.append([positive] + negatives)
    return docs


def cosine(a, b):
    return util.pairwise_cos_sim(a, b)


def run(model, loss_fn, case, tensors, meta, regularised=False):
    model.eval()
    if regularised:
        # The SPLADE pooling in training mode (its evaluation mode works in place, which
        # autograd cannot go back through); the transformer in evaluation mode.
        model[1].train()
    model.zero_grad()
    docs = groups()
    q = model(model.tokenize(QUERIES))["sentence_embedding"]
    columns = [
        model(model.tokenize([g[k] for g in docs]))["sentence_embedding"]
        for k in range(NEGATIVES + 1)
    ]
    labels = torch.tensor(TEACHER)
    if regularised:
        loss = loss_fn.loss.compute_loss_from_embeddings([q] + columns, labels)
        loss = loss + DOC_WEIGHT * loss_fn.document_regularizer.compute_loss_from_embeddings(
            torch.cat(columns)
        )
        loss = loss + QUERY_WEIGHT * loss_fn.query_regularizer.compute_loss_from_embeddings(q)
    else:
        loss = loss_fn.compute_loss_from_embeddings([q] + columns, labels)
    loss.backward()
    n = 0
    for name, param in model[0].auto_model.named_parameters():
        if param.grad is not None:
            tensors[f"{case}.grad.{name}"] = param.grad.detach().clone()
            n += 1
    meta["cases"][case] = float(loss)
    print(f"{case}: loss {float(loss):.6f}, {n} gradients")


def main():
    torch.set_default_dtype(torch.float32)
    tensors = {}
    meta = {
        "queries": QUERIES,
        "passages": [t for g in groups() for t in g],
        "teacher": TEACHER,
        "cases": {},
    }
    dense = SentenceTransformer(os.path.join(ROOT, "tests", "fixtures", "families", "bert"))
    for sim_name, sim in [("dot", util.pairwise_dot_score), ("cosine", cosine)]:
        run(dense, losses.MarginMSELoss(dense, similarity_fct=sim), f"dense.margin_mse.{sim_name}",
            tensors, meta)
        run(dense, losses.DistillKLDivLoss(dense, similarity_fct=sim), f"dense.kl.{sim_name}",
            tensors, meta)
        run(dense, losses.DistillKLDivLoss(dense, similarity_fct=sim, student_temperature=2.0,
                                           teacher_temperature=0.5),
            f"dense.kl_t.{sim_name}", tensors, meta)
    sparse = SparseEncoder(os.path.join(ROOT, "tests", "fixtures", "sparse", "bert"))
    for kind, base in [
        ("margin_mse", sparse_losses.SparseMarginMSELoss(sparse)),
        ("kl", sparse_losses.SparseDistillKLDivLoss(sparse)),
    ]:
        splade = sparse_losses.SpladeLoss(
            sparse, loss=base, document_regularizer_weight=DOC_WEIGHT,
            query_regularizer_weight=QUERY_WEIGHT,
        )
        run(sparse, splade, f"sparse.{kind}.dot", tensors, meta, regularised=True)
    meta["versions"] = {
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
    }
    os.makedirs(OUT, exist_ok=True)
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(OUT, "reference.safetensors"),
    )
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
