#!/usr/bin/env python3
"""A tiny inference-free SPLADE model (sentence-transformers' `Router` with a
`SparseStaticEmbedding` query route and a masked-language-model document route) with
reference outputs, for tests/it/sparse_static.rs (run by a developer, never by CI; the venv of
scripts/peer-bench has what it needs):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_inference_free_fixture.py
                                         # writes tests/fixtures/sparse/inference_free/

The document route is the DistilBERT model of scripts/make_sparse_fixtures.py
(`Transformer(fill-mask)` + `SpladePooling(max, relu)`); the query route a
`SparseStaticEmbedding` over the same tokenizer whose weights (one per vocabulary entry,
trainable) are drawn from U(0.25, 1.75), saved by `Router.for_query_document`.

`reference.safetensors` holds:

- `queries`: `encode_query` of every text, `documents`: `encode_document` of every text,
  `embeddings`: `encode` of every text (the router's default route);
- `grad.{name}`: the gradient of every parameter (the document model's by its
  transformers name, `grad.static.weight` for the query weights) under
  `SpladeLoss(SparseMultipleNegativesRankingLoss)` with document weight 3e-3 and query
  weight 5e-3 over the four (query, passage) pairs, queries through the query route, and
  its value in reference.json with each part.
"""

import json
import os
import shutil
import sys

import safetensors.torch
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SparseEncoder
from sentence_transformers.base.modules import Router
from sentence_transformers.sparse_encoder import losses
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_family_fixtures import MAX_LEN, PASSAGES, QUERIES, SEED, TEXTS, sample_text  # noqa: E402
from make_sparse_fixtures import DOC_WEIGHT, QUERY_WEIGHT, build  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "sparse", "inference_free")


def model():
    mlm = build("distilbert", sample_text())
    transformer, pooling = mlm[0], mlm[1]
    tokenizer = transformer.tokenizer
    g = torch.Generator().manual_seed(SEED + 7)
    weight = torch.rand(len(tokenizer.get_vocab()), generator=g) * 1.5 + 0.25
    static = SparseStaticEmbedding(tokenizer, weight=weight, frozen=False)
    router = Router.for_query_document(
        query_modules=[static], document_modules=[transformer, pooling]
    )
    st = SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu")
    st.eval()
    return st, static, transformer, pooling


def grads(st, static, transformer, pooling):
    st.zero_grad()
    st.eval()
    pooling.train()  # its evaluation mode works in place (see make_sparse_fixtures.py)
    q = st(st.preprocess(QUERIES, task="query"))["sentence_embedding"]
    p = st(st.preprocess(PASSAGES, task="document"))["sentence_embedding"]
    base = losses.SparseMultipleNegativesRankingLoss(st)
    splade = losses.SpladeLoss(
        st, loss=base, document_regularizer_weight=DOC_WEIGHT,
        query_regularizer_weight=QUERY_WEIGHT,
    )
    parts = {"base_loss": base.compute_loss_from_embeddings([q, p], None)}
    parts["document_regularizer_loss"] = (
        splade.document_regularizer.compute_loss_from_embeddings(p) * DOC_WEIGHT
    )
    parts["query_regularizer_loss"] = (
        splade.query_regularizer.compute_loss_from_embeddings(q) * QUERY_WEIGHT
    )
    loss = sum(parts.values())
    loss.backward()
    st.eval()
    out = {"grad.static.weight": static.weight.grad.detach().clone()}
    for name, param in transformer.auto_model.named_parameters():
        if param.grad is not None:
            out[f"grad.{name}"] = param.grad.detach().clone()
    return float(loss), {k: float(v) for k, v in parts.items()}, out


def main():
    torch.set_default_dtype(torch.float32)
    st, static, transformer, pooling = model()
    kw = dict(convert_to_tensor=True, convert_to_sparse_tensor=False, batch_size=len(TEXTS))
    with torch.no_grad():
        tensors = {
            "queries": st.encode_query(TEXTS, **kw).contiguous(),
            "documents": st.encode_document(TEXTS, **kw).contiguous(),
            "embeddings": st.encode(TEXTS, **kw).contiguous(),
        }
    loss, parts, g = grads(st, static, transformer, pooling)
    tensors.update(g)
    shutil.rmtree(OUT, ignore_errors=True)
    st.save(OUT)
    readme = os.path.join(OUT, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    safetensors.torch.save_file(tensors, os.path.join(OUT, "reference.safetensors"))
    meta = {
        "texts": TEXTS, "queries": QUERIES, "passages": PASSAGES, "max_len": MAX_LEN,
        "loss": loss, "parts": parts,
        "loss_fn": "SpladeLoss(SparseMultipleNegativesRankingLoss(scale 1, dot), "
                   f"document_regularizer_weight={DOC_WEIGHT}, "
                   f"query_regularizer_weight={QUERY_WEIGHT}), queries task='query'",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(OUT) for x in fs)
    print(f"inference_free: {size / 1024:.0f} KB, loss {loss:.6f} {parts}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
