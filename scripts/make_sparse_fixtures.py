#!/usr/bin/env python3
"""Tiny SPLADE models (sentence-transformers' SparseEncoder) with reference outputs, for
tests/it/sparse.rs (run by a developer, never by CI; the venv of scripts/peer-bench has
what it needs):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_sparse_fixtures.py
                                                   # writes tests/fixtures/sparse/

Two models, each a masked-language model of a family (weights perturbed away from their
initialisation, a WordPiece vocabulary of 400 trained on the repo's sample text) under
`Transformer(transformer_task="fill-mask")` + `SpladePooling`, saved by the installed
sentence-transformers:

- `distilbert`: DistilBertForMaskedLM (vocab_transform, vocab_layer_norm, vocab_projector
  tied to the word embeddings plus its bias), max pooling, relu;
- `bert`: BertForMaskedLM (cls.predictions.transform + the tied decoder and its bias),
  sum pooling, log1p_relu.

`reference.safetensors` holds:

- `logits.{i}`: the MLM logits of text i's real tokens `[len, vocab]`;
- `embeddings`: `encode` of every text `[texts, vocab]` (the model's own pooling), and
  `pooled.{strategy}.{activation}` under each of the four poolings, from the same logits;
- `grad.{name}`: the gradient of every parameter under sentence-transformers'
  `SparseMultipleNegativesRankingLoss` (dot products, scale 1) plus the FLOPS
  regularisers of `SpladeLoss` (document weight 3e-3, query weight 5e-3) over four
  (query, passage) pairs, evaluation mode (no dropout), and its value in reference.json
  with each part.
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
from sentence_transformers.sparse_encoder import losses
from sentence_transformers.sparse_encoder.modules import SpladePooling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_family_fixtures import (  # noqa: E402
    MAX_LEN, PASSAGES, QUERIES, SEED, TEXTS, perturb, sample_text, wordpiece,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "sparse")
DOC_WEIGHT, QUERY_WEIGHT = 3e-3, 5e-3
MODELS = {
    "distilbert": ("max", "relu"),
    "bert": ("sum", "log1p_relu"),
}


def mlm(kind, tokenizer):
    vocab = len(tokenizer)
    if kind == "distilbert":
        cfg = transformers.DistilBertConfig(
            vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
            activation="gelu", max_position_embeddings=40,
            pad_token_id=tokenizer.pad_token_id,
        )
        return transformers.DistilBertForMaskedLM(cfg)
    cfg = transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=40, pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.BertForMaskedLM(cfg)


def build(kind, texts):
    torch.manual_seed(SEED)
    tokenizer = wordpiece(texts)
    if kind == "distilbert":
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    model = mlm(kind, tokenizer)
    perturb(model, SEED + 1)
    model.eval()
    raw = os.path.join(OUT, f"_{kind}_raw")
    shutil.rmtree(raw, ignore_errors=True)
    model.save_pretrained(raw, safe_serialization=True)
    tokenizer.save_pretrained(raw)
    transformer = sentence_transformers.base.modules.Transformer(
        raw, transformer_task="fill-mask", max_seq_length=MAX_LEN
    )
    strategy, activation = MODELS[kind]
    pooling = SpladePooling(pooling_strategy=strategy, activation_function=activation)
    st = SparseEncoder(modules=[transformer, pooling], device="cpu")
    st.eval()
    shutil.rmtree(raw)
    return st


def pool(logits, mask, strategy, activation):
    x = torch.log1p(torch.relu(logits * mask.unsqueeze(-1)))
    if activation == "log1p_relu":
        x = torch.log1p(x)
    return x.max(dim=1).values if strategy == "max" else x.sum(dim=1)


def references(st, texts):
    out = {}
    features = st.tokenize(texts)
    with torch.no_grad():
        logits = st[0](dict(features))["token_embeddings"]
        mask = features["attention_mask"]
        for i, row in enumerate(mask):
            out[f"logits.{i}"] = logits[i, : int(row.sum())].contiguous()
        for strategy in ("max", "sum"):
            for activation in ("relu", "log1p_relu"):
                out[f"pooled.{strategy}.{activation}"] = pool(logits, mask, strategy, activation)
        out["embeddings"] = st.encode(
            texts, convert_to_tensor=True, convert_to_sparse_tensor=False, batch_size=len(texts)
        ).contiguous()
    return out


def grads(st):
    st.zero_grad()
    # The transformer in evaluation mode (DistilBERT's attention drops out whenever its
    # module is training, whatever its Dropout's mode), the pooling in training mode (its
    # evaluation mode works in place, which autograd cannot go back through).
    st.eval()
    st[1].train()
    q = st(st.tokenize(QUERIES))["sentence_embedding"]
    p = st(st.tokenize(PASSAGES))["sentence_embedding"]
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
    out = {}
    for name, param in st[0].auto_model.named_parameters():
        if param.grad is not None:
            out[f"grad.{name}"] = param.grad.detach().clone()
    return float(loss), {k: float(v) for k, v in parts.items()}, out


def main():
    torch.set_default_dtype(torch.float32)
    texts = sample_text()
    for kind in MODELS:
        st = build(kind, texts)
        tensors = references(st, TEXTS)
        loss, parts, g = grads(st)
        tensors.update(g)
        d = os.path.join(OUT, kind)
        shutil.rmtree(d, ignore_errors=True)
        st.save(d)
        readme = os.path.join(d, "README.md")
        if os.path.exists(readme):
            os.remove(readme)
        safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"))
        strategy, activation = MODELS[kind]
        meta = {
            "texts": TEXTS, "queries": QUERIES, "passages": PASSAGES, "max_len": MAX_LEN,
            "pooling": {"strategy": strategy, "activation": activation},
            "loss": loss, "parts": parts,
            "loss_fn": "SpladeLoss(SparseMultipleNegativesRankingLoss(scale 1, dot), "
                       f"document_regularizer_weight={DOC_WEIGHT}, "
                       f"query_regularizer_weight={QUERY_WEIGHT})",
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "sentence_transformers": sentence_transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
        }
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        size = sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(d) for x in fs)
        print(f"{kind}: {size / 1024:.0f} KB, loss {loss:.6f} {parts}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
