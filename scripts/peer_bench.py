#!/usr/bin/env python3
"""The sentence-transformers side of scripts/peer-bench (not in CI).

    peer_bench.py train MODEL_DIR PAIRS.jsonl BATCH MINI_BATCH MAX_LEN SYMMETRIC STEPS
    peer_bench.py encode MODEL_DIR TEXTS.txt BATCH MAX_LEN
    peer_bench.py sgemm
    peer_bench.py make FAMILY DIR
    peer_bench.py memory LAYERS BATCH

memory: the step of benches/decoder_memory.rs on sentence-transformers: the shape of
Qwen3-Embedding-0.6B (LAYERS layers of hidden 1,024, 16 query and 8 KV heads of 128,
feed-forward 3,072, vocabulary 151,669; random weights), BATCH pairs of 128 random token
ids, CachedMultipleNegativesRankingLoss in mini-batches of 8 with gradient checkpointing
(transformers' recompute of every layer), then AdamW; prints the step's seconds and the
process's peak RSS.

make: a randomly initialised base-size model of FAMILY (bert, roberta, xlm-roberta,
mpnet, modernbert: the sizes of bert-base / roberta-base / xlm-roberta-base /
mpnet-base / ModernBERT-base; nomic_bert, gte, jina_embeddings_v3, eurobert, deberta-v2:
768 wide, 12 layers of 12 heads, feed-forward 3,072, as nomic-embed-text-v1.5,
gte-base-en-v1.5, EuroBERT-210m and DeBERTa-v3-base (256 position buckets) (Jina v3 at that
base size, not its 1,024-wide release); qwen3: four layers of Qwen3-Embedding-0.6B's shape) with the
tokenizer of its fixture in tests/fixtures/families (a vocabulary of a few hundred tokens
on both sides), saved as a sentence-transformers directory (mean pooling; qwen3 last-token
pooling and Normalize, left padding, as Qwen3-Embedding) that both sides load.

train: CachedMultipleNegativesRankingLoss (or its symmetric variant) with AdamW, dropout
on (train mode), one optimizer step per batch of BATCH pairs in mini-batches of
MINI_BATCH; prints the mean pairs/s of the steps after the first. encode:
SentenceTransformer.encode; prints texts/s. sgemm: torch's f32 2048^3 matmul, GFLOP/s.
Threads: torch.set_num_threads from OMP_NUM_THREADS (the caller sets 2).
"""
import json
import os
import sys
import time

import torch


def threads():
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def train(model_dir, pairs_path, batch, mini, max_len, symmetric, steps, lora=0):
    from sentence_transformers import SentenceTransformer, losses

    pairs = [json.loads(line) for line in open(pairs_path)]
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = max_len
    if lora:
        # PEFT LoRA (r, alpha 2r, dropout $LORA_DROPOUT or none) on every attention and
        # feed-forward projection, the base frozen: what `[model.lora]` builds.
        import os

        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        dropout = float(os.environ.get("LORA_DROPOUT", "0"))
        config = peft.LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=dropout,
                                 target_modules=targets)
        model[0].auto_model = peft.get_peft_model(model[0].auto_model, config)
    model.train()
    cls = (losses.CachedMultipleNegativesSymmetricRankingLoss if symmetric
           else losses.CachedMultipleNegativesRankingLoss)
    loss = cls(model, scale=20.0, mini_batch_size=mini)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rates = []
    for step in range(steps + 1):
        b = pairs[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        q = model.tokenize([p["query"] for p in b])
        d = model.tokenize([p["positive"] for p in b])
        value = loss([q, d], None)
        value.backward()
        opt.step()
        opt.zero_grad()
        if step:
            rates.append(batch / (time.perf_counter() - start))
    print(f"{sum(rates) / len(rates):.2f}")


def encode(model_dir, texts_path, batch, max_len):
    from sentence_transformers import SentenceTransformer

    texts = [line.rstrip("\n") for line in open(texts_path) if line.strip()]
    model = SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = max_len
    model.encode(texts[:batch], batch_size=batch)  # warm up
    start = time.perf_counter()
    model.encode(texts, batch_size=batch)
    print(f"{len(texts) / (time.perf_counter() - start):.2f}")


def make(family, out):
    import shutil
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "families", family)
    small = transformers.AutoConfig.from_pretrained(fixture)
    if family == "qwen3":
        save_decoder(qwen3_0_6b(4, small.vocab_size), fixture, out)
        return
    base = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072)
    if family == "modernbert":
        base.update(num_hidden_layers=22, intermediate_size=1152, local_attention=128,
                    max_position_embeddings=8192)
        base["layer_types"] = None
        cfg = transformers.ModernBertConfig(
            vocab_size=small.vocab_size, pad_token_id=small.pad_token_id,
            bos_token_id=small.bos_token_id, eos_token_id=small.eos_token_id,
            cls_token_id=small.cls_token_id, sep_token_id=small.sep_token_id,
            global_attn_every_n_layers=3, **{k: v for k, v in base.items() if k != "layer_types"})
    else:
        if family in ("nomic_bert", "eurobert"):
            base["head_dim"] = 64  # the fixtures' explicit head width, at base size
        if family == "eurobert":
            base["num_key_value_heads"] = 12  # EuroBERT-210m's
        if family == "deberta-v2":
            base["position_buckets"] = 256  # DeBERTa-v3-base's
        cfg = type(small)(**{**small.to_dict(), **base, "max_position_embeddings": small.max_position_embeddings + 512})
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg)
    raw = out + ".raw"
    shutil.rmtree(raw, ignore_errors=True)
    model.save_pretrained(raw)
    tok = transformers.AutoTokenizer.from_pretrained(fixture)
    tok.model_max_length = 512
    tok.save_pretrained(raw)
    st = SentenceTransformer(modules=[modules.Transformer(raw, max_seq_length=512),
                                      modules.Pooling(cfg.hidden_size, pooling_mode="mean")], device="cpu")
    st.save(out)
    shutil.rmtree(raw)


def save_decoder(cfg, fixture, out):
    """A model of decoder config `cfg` (random weights, seed 0) with the tokenizer of
    `fixture` (its pad and EOS tokens; a limit of 512), last-token pooling and Normalize,
    saved as a sentence-transformers directory `out`."""
    import shutil
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    small = transformers.AutoConfig.from_pretrained(fixture)
    cfg.pad_token_id, cfg.eos_token_id = small.pad_token_id, small.eos_token_id
    torch.manual_seed(0)
    raw = out + ".raw"
    shutil.rmtree(raw, ignore_errors=True)
    transformers.AutoModel.from_config(cfg).save_pretrained(raw)
    tok = transformers.AutoTokenizer.from_pretrained(fixture)
    tok.model_max_length = 512
    tok.save_pretrained(raw)
    st = SentenceTransformer(modules=[modules.Transformer(raw),
                                      modules.Pooling(cfg.hidden_size, pooling_mode="lasttoken"),
                                      modules.Normalize()], device="cpu")
    st.save(out)
    shutil.rmtree(raw)


def qwen3_0_6b(layers, vocab=151669):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_dropout=0.0)


def memory(layers, batch):
    import resource
    import shutil
    import tempfile
    import transformers
    from sentence_transformers import SentenceTransformer, losses
    from sentence_transformers.sentence_transformer import modules

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "families", "qwen3")
    cfg = qwen3_0_6b(layers)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg)
    raw = tempfile.mkdtemp()
    model.save_pretrained(raw)
    transformers.AutoTokenizer.from_pretrained(fixture).save_pretrained(raw)
    del model
    st = SentenceTransformer(modules=[modules.Transformer(raw),
                                      modules.Pooling(cfg.hidden_size, pooling_mode="lasttoken"),
                                      modules.Normalize()], device="cpu")
    shutil.rmtree(raw)
    st.train()
    st[0].auto_model.gradient_checkpointing_enable()
    loss = losses.CachedMultipleNegativesRankingLoss(st, scale=20.0, mini_batch_size=8)
    opt = torch.optim.AdamW(st.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    features = [
        {"input_ids": torch.randint(0, cfg.vocab_size - 1000, (batch, 128), generator=g),
         "attention_mask": torch.ones(batch, 128, dtype=torch.long)}
        for _ in range(2)
    ]
    start = time.perf_counter()
    value = loss(features, None)
    value.backward()
    opt.step()
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{seconds:.0f} {rss / 2 ** 30:.2f}")


def colbert_make(raw_out, out):
    """A base-size BERT with random weights (seed 0) as PyLate builds a ColBERT from it:
    a 128-d projection, query length 32 (expansion), document length 180, [Q] / [D]
    prefixes. Run with PyLate's venv; `raw_out` gets the plain model first."""
    import transformers
    from pylate import models

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "families", "bert")
    small = transformers.AutoConfig.from_pretrained(fixture)
    base = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072,
                max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**{**small.to_dict(), **base}))
    model.save_pretrained(raw_out)
    tok = transformers.AutoTokenizer.from_pretrained(fixture)
    tok.model_max_length = 512
    tok.save_pretrained(raw_out)
    colbert = models.ColBERT(raw_out, embedding_size=128, query_length=32, document_length=180,
                             device="cpu")
    colbert.save(out)


def colbert_train(model_dir, pairs_path, batch, mini, steps):
    """sentence-transformers 6's cached multi-vector loss on the PyLate directory
    `model_dir`: one AdamW step per batch of (query, positive) pairs, MaxSim InfoNCE over
    the in-batch documents in mini-batches of `mini`, dropout on; prints pairs/s (the
    steps after the first)."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
    )

    pairs = [json.loads(line) for line in open(pairs_path)]
    model = MultiVectorEncoder(model_dir, device="cpu")
    model.train()
    loss = CachedMultiVectorMultipleNegativesRankingLoss(model, scale=1.0, mini_batch_size=mini)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prompt = lambda task, texts: [model.prompts.get(task, "") + t for t in texts]
    rates = []
    for step in range(steps + 1):
        b = pairs[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        q = model.preprocess(prompt("query", [p["query"] for p in b]), task="query")
        d = model.preprocess(prompt("document", [p["positive"] for p in b]), task="document")
        q["task"], d["task"] = "query", "document"
        value = loss([q, d], None)
        value.backward()
        opt.step()
        opt.zero_grad()
        if step:
            rates.append(batch / (time.perf_counter() - start))
    print(f"{sum(rates) / len(rates):.2f}")


def splade_make(out, hidden, layers, heads, ffn, vocab=30522):
    """A DistilBERT masked-language model with random weights (seed 0) of the given shape
    (DistilBERT-base: 768, 6 layers, 12 heads, 3,072; vocabulary 30,522 as BERT's, so the
    MLM head and the vectors are as wide as a real SPLADE's), the sparse DistilBERT
    fixture's tokenizer, as a sentence-transformers SparseEncoder (fill-mask Transformer,
    max pooling of log1p_relu, SPLADE's defaults) saved to `out`."""
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "sparse",
                           "distilbert")
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads,
                                        hidden_dim=ffn, max_position_embeddings=512)
    raw = out + "-raw"
    transformers.DistilBertForMaskedLM(cfg).save_pretrained(raw, safe_serialization=True)
    tok = transformers.AutoTokenizer.from_pretrained(fixture)
    tok.model_max_length = 512
    tok.model_input_names = ["input_ids", "attention_mask"]
    tok.save_pretrained(raw)
    model = SparseEncoder(modules=[Transformer(raw, transformer_task="fill-mask", max_seq_length=128),
                                   SpladePooling(pooling_strategy="max", activation_function="log1p_relu")],
                          device="cpu")
    model.save(out)


def splade_train(model_dir, pairs_path, batch, mini, max_len, steps):
    """sentence-transformers' CachedSpladeLoss over SparseMultipleNegativesRankingLoss
    (dot products, scale 1, in-batch documents) with FLOPS weights 5e-5 (queries) and 3e-5
    (documents), mini-batches of `mini`, dropout on: one AdamW step per batch of (query,
    positive) pairs; prints pairs/s (the steps after the first) and the process's peak
    resident memory in GiB."""
    import resource

    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder import losses

    pairs = [json.loads(line) for line in open(pairs_path)]
    model = SparseEncoder(model_dir, device="cpu")
    model.max_seq_length = max_len
    model.train()
    loss = losses.CachedSpladeLoss(
        model, losses.SparseMultipleNegativesRankingLoss(model, scale=1.0),
        document_regularizer_weight=3e-5, query_regularizer_weight=5e-5, mini_batch_size=mini)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    rates = []
    for step in range(steps + 1):
        b = pairs[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        q = model.tokenize([p["query"] for p in b])
        d = model.tokenize([p["positive"] for p in b])
        value = loss([q, d], None)
        # The loss and its regularisers as parts, summed as sentence-transformers' trainer does.
        if isinstance(value, dict):
            value = sum(value.values())
        value.backward()
        opt.step()
        opt.zero_grad()
        if step:
            rates.append(batch / (time.perf_counter() - start))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{sum(rates) / len(rates):.2f} {rss / 2 ** 30:.2f}")


def sgemm_at(m, k, n):
    """torch's f32 product [m, k] x [k, n], best of 5 after a warm-up, in GFLOP/s."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def sgemm():
    print(f"{sgemm_at(2048, 2048, 2048):.1f}")


# The shapes of `cargo bench --bench train_step -- --sgemm-shapes`, in its order.
SHAPES = [(2048, 2048, 2048), (8192, 384, 384), (2048, 384, 1536), (4096, 768, 3072),
          (2048, 1024, 3072)]


def sgemm_shapes():
    for m, k, n in SHAPES:
        print(f"{m} {k} {n} {sgemm_at(m, k, n):.1f}")


if __name__ == "__main__":
    threads()
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "train":
        lora = int(args[7]) if len(args) > 7 else 0
        train(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), args[5] == "1", int(args[6]), lora)
    elif cmd == "encode":
        encode(args[0], args[1], int(args[2]), int(args[3]))
    elif cmd == "make":
        make(args[0], args[1])
    elif cmd == "colbert-make":
        colbert_make(args[0], args[1])
    elif cmd == "colbert-train":
        colbert_train(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    elif cmd == "splade-make":
        splade_make(args[0], *(int(a) for a in args[1:5]))
    elif cmd == "splade-train":
        splade_train(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), int(args[5]))
    elif cmd == "memory":
        memory(int(args[0]), int(args[1]))
    elif cmd == "sgemm-shapes":
        sgemm_shapes()
    else:
        sgemm()
