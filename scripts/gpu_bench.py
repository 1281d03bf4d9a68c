#!/usr/bin/env python3
"""Throughput of gradcache against sentence-transformers on one GPU (part of the GPU
bundle, `./run bench`; not in CI).

    gpu_bench.py --gradcache BIN --out DIR [--steps 3] [--batch 4096] [--mini 256]
                 [--max-len 128] [--device cuda] [--models minilm,bert-base]

For each model shape (all-MiniLM-L6-v2's: hidden 384 x 6 layers; BERT-base's: 768 x 12;
fresh weights, one WordPiece vocabulary trained on the quickstart data, saved as a
`transformers` directory both sides load), both sides train the same work: global batch
BATCH pairs in mini-batches (chunks) of MINI, max_len tokens, in-batch negatives at scale
20, AdamW, dropout on, bf16 compute over f32 weights (torch.autocast for
sentence-transformers' CachedMultipleNegativesRankingLoss; `precision = "bf16"` for
gradcache). Prints pairs/s (mean of the steps after the first) and the peak GPU memory
the run took (nvidia-smi's memory.used sampled every 0.1 s, minus the idle reading), as a
Markdown table; writes it to OUT/gpu-table.md. Memory is read two ways on each side:
nvidia-smi as above, and the most memory the framework's tensors held at once (gradcache:
the CUDA memory pool's used-memory high mark, `gpu_memory.used_high` in metrics.jsonl;
sentence-transformers: `torch.cuda.max_memory_allocated()`).

`--profile` runs only the gradcache side of each shape for one step after a warm-up with
`GRADCACHE_PROFILE=cupti` (or the environment's `GRADCACHE_PROFILE`) and prints where the
step's time went (the device synchronised at each span: the phases, the replay's forward
and backward, each layer's forward, the layer nodes' forward and backward) and what it
asked of the driver (launches, allocations, copies each way, the host's waits) from
metrics.jsonl's `"profile"` line.

The decoder row (`--models qwen3-0.6b`): Qwen3-Embedding-0.6B's shape (28 layers, hidden
1,024, 16 query and 8 KV heads of 128, feed-forward 3,072, vocabulary 151,669; random
weights) with the qwen3 fixture's tokenizer, last-token pooling and Normalize, global batch
DECODER_BATCH in mini-batches of DECODER_MINI, recompute off on both sides. The model has
no dropout, so both sides' first loss (same weights, same pairs, scale 20) must agree
within bf16's tolerance: the table prints them.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# In the bundle data/ and configs/ sit beside this file; in the repository, one level up.
ROOT = HERE if os.path.isdir(os.path.join(HERE, "data")) else os.path.dirname(HERE)
SHAPES = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                   intermediate_size=1536),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072),
    "qwen3-0.6b": None,  # a decoder: make_decoder
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64),
}


def pairs_file(out, n):
    """n pairs, cycling the quickstart's training pairs."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data/quickstart/train.jsonl"))]
    path = os.path.join(out, f"pairs-{n}.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            r = rows[i % len(rows)]
            f.write(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n")
    return path, rows


DECODER_LAYERS = 28  # --decoder-layers (fewer for a quick check on a CPU)


def fixture_dir(family):
    for d in (os.path.join(ROOT, "fixtures", family),
              os.path.join(ROOT, "tests", "fixtures", "families", family)):
        if os.path.isdir(d):
            return d
    raise SystemExit(f"no {family} fixture beside {ROOT}")


def make_decoder(out, layers):
    """Qwen3-Embedding-0.6B's shape, random weights, as a sentence-transformers directory
    (peer_bench.py's, which the bundle carries beside this file)."""
    sys.path.insert(0, HERE)
    from peer_bench import qwen3_0_6b, save_decoder

    d = os.path.join(out, "model-qwen3-0.6b")
    if not os.path.exists(os.path.join(d, "modules.json")):
        save_decoder(qwen3_0_6b(layers), fixture_dir("qwen3"), d)
    return d


def make_model(out, shape, rows):
    """A fresh BERT of `shape` with a WordPiece vocabulary, as a transformers directory."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    if SHAPES[shape] is None:
        return make_decoder(out, DECODER_LAYERS)
    d = os.path.join(out, f"model-{shape}")
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    os.makedirs(d, exist_ok=True)
    tok = BertWordPieceTokenizer(lowercase=True)
    texts = [r[k] for r in rows for k in ("query", "positive")]
    tok.train_from_iterator(texts, vocab_size=30522 if shape != "tiny" else 500)
    tok.save(os.path.join(d, "tokenizer.json"))
    BertTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json")).save_pretrained(d)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=512,
                     **SHAPES[shape])
    BertModel(cfg).save_pretrained(d, safe_serialization=True)
    return d


class GpuMemory:
    """Peak of nvidia-smi's memory.used (MiB) while running, minus the reading before."""

    def __init__(self):
        self.peak, self.base, self.stop = None, None, False

    @staticmethod
    def read():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def __enter__(self):
        self.base = self.read()
        self.peak = self.base

        def poll():
            while not self.stop:
                v = self.read()
                if v is not None and self.peak is not None:
                    self.peak = max(self.peak, v)
                time.sleep(0.1)
        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.stop = True
        self.thread.join()

    def used(self):
        if self.base is None:
            return "n/a"
        return f"{(self.peak - self.base) / 1024:.1f} GiB"


def st_side(model_dir, pairs, batch, mini, max_len, steps, device):
    """Runs in its own process: prints pairs/s and the first step's loss."""
    import torch
    from sentence_transformers import SentenceTransformer, losses

    rows = [json.loads(line) for line in open(pairs)]
    model = SentenceTransformer(model_dir, device=device)
    model.max_seq_length = max_len
    model.train()
    loss = losses.CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    rates, first = [], None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):
        at = step * batch % len(rows)
        b = rows[at:at + batch]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            q = model.tokenize([p["query"] for p in b])
            d = model.tokenize([p["positive"] for p in b])
            q = {k: v.to(device) if hasattr(v, "to") else v for k, v in q.items()}
            d = {k: v.to(device) if hasattr(v, "to") else v for k, v in d.items()}
            value = loss([q, d], None)
            value.backward()
        if first is None:
            first = float(value)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if step:
            rates.append(len(b) / (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    print(f"{sum(rates) / len(rates):.2f} {first:.6f} {peak}")


def gradcache_side(binary, model_dir, pairs, eval_file, out, batch, mini, max_len, steps, device,
                   profile=False):
    """Trains; returns pairs/s (mean after the first step), the first loss, the pool's
    peak bytes over the steps and (with `profile`) the last step's profile spans."""
    run = os.path.join(out, ("gradcache-profile-" if profile else "gradcache-")
                       + os.path.basename(model_dir))
    sets = {
        "model.pretrained": model_dir, "model.query_max_len": max_len,
        "model.passage_max_len": max_len, "model.recompute": "off",
        "data.train_file": pairs, "data.eval_file": eval_file, "output_dir": run,
        "train.steps": steps + 1, "train.batch_size": batch, "train.query_chunk": mini,
        "train.passage_chunk": mini, "train.eval_every": 0, "train.checkpoint_every": 0,
        "optim.lr": 2e-5, "optim.warmup_ratio": 0, "loss.symmetric": "false",
        "device": device,
        "precision": "bf16",
    }
    config = "configs/minilm.toml"
    if os.path.basename(model_dir) == "model-qwen3-0.6b":
        config = "configs/qwen3.toml"
        sets.update({"model.query_prompt": '""', "model.passage_prompt": '""',
                     "model.dropout": "false", "loss.temperature": 0.05})
    args = [binary, "train", "--config", os.path.join(ROOT, config)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    env = dict(os.environ)
    if profile:
        env["GRADCACHE_PROFILE"] = os.environ.get("GRADCACHE_PROFILE", "cupti")
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, env=env)
    lines = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in lines if r.get("type") == "step"]
    rates = [r["pairs_per_sec"] for r in steps[1:]]
    peak = max((r.get("gpu_memory") or {}).get("used_high", 0) for r in steps)
    spans = [r["spans"] for r in lines if r.get("type") == "profile"]
    return sum(rates) / len(rates), steps[0]["loss"], peak, (spans[-1] if spans else [])


def gib(n):
    return f"{n / 2**30:.1f} GiB"


def profile_table(shape, spans):
    rows = [f"## {shape}: one step's spans (GRADCACHE_PROFILE, device synchronised at each)",
            "| span | count | total ms | mean ms | GPU pool peak | MiB moved |",
            "|---|---:|---:|---:|---:|---:|"]
    for e in spans:
        rows.append(f"| {e['name']} | {e['count']} | {e['total_ms']:.1f} "
                    f"| {e['total_ms'] / max(e['count'], 1):.3f} | {gib(e['gpu_peak_bytes'])} "
                    f"| {e.get('bytes', 0) / 2**20:.1f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gradcache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--mini", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="minilm,bert-base")
    ap.add_argument("--decoder-batch", type=int, default=512)
    ap.add_argument("--decoder-mini", type=int, default=64)
    ap.add_argument("--decoder-layers", type=int, default=28, help=argparse.SUPPRESS)
    ap.add_argument("--st-side", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true",
                    help="gradcache only, one profiled step after a warm-up per shape")
    a = ap.parse_args()
    global DECODER_LAYERS
    DECODER_LAYERS = a.decoder_layers
    if a.st_side:
        model_dir, pairs, _, _ = a.st_side
        st_side(model_dir, pairs, a.batch, a.mini, a.max_len, a.steps, a.device)
        return
    os.makedirs(a.out, exist_ok=True)
    pairs, rows = pairs_file(a.out, a.batch * (a.steps + 1))
    eval_file = os.path.join(a.out, "eval.jsonl")
    with open(eval_file, "w") as f:
        for r in rows[:64]:
            f.write(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n")
    lines = [f"# {a.device}, max_len {a.max_len}, bf16, {a.steps} timed steps after one warm-up",
             "| model | batch / mini | gradcache pairs/s | sentence-transformers pairs/s | ratio "
             "| peak GPU memory (nvidia-smi): gradcache / ST "
             "| tensors' peak (pool high mark / max_memory_allocated): gradcache / ST "
             "| first loss: gradcache / sentence-transformers |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for shape in a.models.split(","):
        model_dir = make_model(a.out, shape, rows)
        decoder = SHAPES[shape] is None
        batch, mini = (a.decoder_batch, a.decoder_mini) if decoder else (a.batch, a.mini)
        # The decoder trains one batch of distinct pairs over and over: the first step then
        # sees the same pairs on both sides whatever order each draws them in.
        train = pairs_file(a.out, batch)[0] if decoder else pairs
        if a.profile:
            _, _, peak, spans = gradcache_side(a.gradcache, model_dir, train, eval_file, a.out,
                                               batch, mini, a.max_len, 1, a.device, profile=True)
            lines.append(profile_table(f"{shape}, batch {batch} / mini {mini}", spans))
            lines.append(f"pool peak over the two steps: {gib(peak)}\n")
            print("\n".join(lines[-2:]), flush=True)
            continue
        # A failed gradcache side still leaves the sentence-transformers row to read.
        with GpuMemory() as mem_gc:
            try:
                gc, gc_loss, gc_peak, _ = gradcache_side(a.gradcache, model_dir, train,
                                                         eval_file, a.out, batch, mini,
                                                         a.max_len, a.steps, a.device)
            except (subprocess.CalledProcessError, OSError, ValueError, KeyError,
                    ZeroDivisionError) as e:
                print(f"{shape}: the gradcache side failed: {e}", flush=True)
                gc, gc_loss, gc_peak = float("nan"), float("nan"), 0
        with GpuMemory() as mem_st:
            res = subprocess.run([sys.executable, __file__, "--gradcache", a.gradcache,
                                  "--out", a.out, "--steps", str(a.steps), "--batch",
                                  str(batch), "--mini", str(mini), "--max-len",
                                  str(a.max_len), "--device", a.device,
                                  "--st-side", model_dir, train, "-", "-"],
                                 check=True, capture_output=True, text=True)
        st, st_loss, st_peak = map(float, res.stdout.strip().splitlines()[-1].split())
        lines.append(f"| {shape} (fresh) | {batch} / {mini} | {gc:.1f} | {st:.1f} | {gc / st:.2f}x "
                     f"| {mem_gc.used()} / {mem_st.used()} | {gib(gc_peak)} / {gib(st_peak)} "
                     + (f"| {gc_loss:.5f} / {st_loss:.5f} |" if decoder else "| (dropout) |"))
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    name = "gpu-profile.md" if a.profile else "gpu-table.md"
    with open(os.path.join(a.out, name), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
