#!/usr/bin/env python3
"""sentence-transformers' MultipleNegativesRankingLoss with its `directions`, on fixed
embeddings, for tests/switches/loss_directions.rs (run by a developer, never by CI).

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_loss_fixtures.py
    # writes tests/fixtures/losses/directions.safetensors and directions.json

Random queries `[6, 8]` and passages `[12, 8]` in gradcache's layout (each query's
positive, then its hard negative: passage `i * 2 + k`) go through
`MultipleNegativesRankingLoss(scale=1/temperature, directions=..., partition_mode="joint")`
(`compute_loss_from_embeddings`, cosine similarity) for every combination of the four
directions that holds `query_to_doc`; the file keeps the inputs and, per combination, the
loss and its gradients with respect to the queries and the passages.
"""

import itertools
import json
import os

import safetensors.torch
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer, models
from sentence_transformers.losses import MultipleNegativesRankingLoss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "losses")
TEMPERATURE = 0.1
GROUP = 2


def main():
    torch.manual_seed(7)
    q0 = torch.randn(6, 8, dtype=torch.float64)
    p0 = torch.randn(12, 8, dtype=torch.float64)
    # A near-duplicate query and passage, so the in-batch terms matter.
    q0[3] = q0[1] + 0.05 * torch.randn(8, dtype=torch.float64)
    p0[8] = p0[2] + 0.05 * torch.randn(8, dtype=torch.float64)
    # The loss's model is not used by compute_loss_from_embeddings; a tiny stand-in.
    model = SentenceTransformer(modules=[models.Pooling(8)])
    out = {"queries": q0.float(), "passages": p0.float()}
    combos = []
    extra = ["query_to_query", "doc_to_query", "doc_to_doc"]
    for n in range(len(extra) + 1):
        for more in itertools.combinations(extra, n):
            directions = ("query_to_doc",) + more
            loss_fn = MultipleNegativesRankingLoss(
                model, scale=1.0 / TEMPERATURE, directions=directions, partition_mode="joint"
            )
            q = q0.clone().requires_grad_(True)
            p = p0.clone().requires_grad_(True)
            docs = [p[k::GROUP] for k in range(GROUP)]
            loss = loss_fn.compute_loss_from_embeddings([q] + docs, None)
            loss.backward()
            key = "+".join(directions)
            out[f"{key}.loss"] = loss.detach().float().reshape(1)
            out[f"{key}.grad_queries"] = q.grad.float()
            out[f"{key}.grad_passages"] = p.grad.float()
            combos.append(key)
            print(key, float(loss))
    os.makedirs(OUT, exist_ok=True)
    safetensors.torch.save_file(out, os.path.join(OUT, "directions.safetensors"))
    with open(os.path.join(OUT, "directions.json"), "w") as f:
        json.dump(
            {
                "temperature": TEMPERATURE,
                "group": GROUP,
                "similarity": "cosine",
                "partition_mode": "joint",
                "combinations": combos,
                "versions": {
                    "torch": torch.__version__,
                    "sentence_transformers": sentence_transformers.__version__,
                },
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
