#!/usr/bin/env python3
"""Tiny random models of each supported family, with reference outputs from transformers
and sentence-transformers, for tests/switches/families.rs (run by a developer, never by CI).

    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install torch transformers \
        sentence-transformers safetensors
    /tmp/fx/bin/python scripts/make_family_fixtures.py    # writes tests/fixtures/families/

For each family the script trains a small tokenizer of the family's kind on the repo's
sample text (data/quickstart/train.jsonl), builds a tiny model from a config of that
family with every weight perturbed away from its initialisation (no LayerNorm is an
identity, no bias zero), wraps it as a sentence-transformers model (Transformer + mean
Pooling) and saves it with the installed sentence-transformers (so the files have the
current package's layout). Then it writes `reference.safetensors` and `reference.json`:

- `hidden.{i}`: the last hidden state of text i, its real tokens only `[len, h]`;
- `pooled.{mode}`: the sentence embeddings of every text under each pooling mode
  (cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken) `[texts, h]`;
- `grad.{name}`: the gradient of every transformer parameter of a fixed contrastive loss
  (MultipleNegativesRankingLoss: cosine similarity times 20, cross-entropy over the
  in-batch passages) over four (query, passage) pairs, evaluation mode (no dropout);
- `reference.json`: the texts, the pairs, the loss value, the versions used.

The texts include an empty string and one longer than the model's max length (32 tokens:
it is truncated). BERT also gets `bert-dense/`: the same model with a Dense (tanh) and a
Normalize module after the pooling, and its embeddings.

The decoder families (qwen3, qwen2, llama, mistral, gemma3_text) are saved as their embedding
models are: a byte-level BPE tokenizer whose post-processor appends the EOS (and a BOS for
llama, mistral and gemma), the padding side of the model card (left for the Qwen models and
llama, right for mistral and gemma), an instruction prompt for queries and a document prompt
from `config_sentence_transformers.json`, last-token pooling (qwen3, qwen2, mistral), mean
pooling with the prompt left out (llama), mean pooling with two Dense modules (EmbeddingGemma's
head, bidirectional attention) and Normalize. Each config exercises what its family adds:
qwen3 an explicit head_dim (16 with hidden 32 and 4 heads), grouped KV heads and a
sliding-window layer; qwen2 one KV head and q/k/v biases; llama attention and MLP biases
and llama3 rope scaling; mistral a sliding window of 5; gemma3_text bidirectional
attention with sliding and global layers of their own rotary bases, query_pre_attn_scalar,
GELU-tanh and the sandwich norms. The references of a decoder add
`embeddings.query` / `embeddings.document` (`encode` with the prompts, the whole head) and
its gradients are those of the loss on the prompted queries (`preprocess(prompt=...)`).
"""

import json
import os
import random
import shutil
import sys

import numpy as np
import safetensors.torch
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "families")
MAX_LEN = 32
SEED = 1234

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
    "",
    "Jesus wept.",
    "And God said, Let there be light: and there was light. And God saw the light, that it "
    "was good: and God divided the light from the darkness, and God called the light Day, "
    "and the darkness he called Night.",
    "Naomi, Mahlon and Chilion came into the country of Moab!",
]
QUERIES = [
    "Who created the heaven and the earth?",
    "the earth without form",
    "Let there be light",
    "the country of Moab",
]
PASSAGES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And they came into the country of Moab, and continued there.",
]
MODES = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]


def sample_text():
    lines = []
    with open(os.path.join(ROOT, "data", "quickstart", "train.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            lines += [row["query"], row["positive"]]
    return lines[:2000]


def wordpiece(texts):
    tok = tokenizers.BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(texts, vocab_size=400, min_frequency=2)
    tok._tokenizer.post_processor = tokenizers.processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=MAX_LEN,
    )
    return fast


def distilbert_wordpiece(texts):
    """DistilBERT's tokenizer: BERT's WordPiece without token types in its inputs."""
    fast = wordpiece(texts)
    fast.model_input_names = ["input_ids", "attention_mask"]
    return fast


def mpnet_wordpiece(texts):
    """MPNet's tokenizer: BERT's WordPiece with RoBERTa's special tokens and template."""
    tok = tokenizers.BertWordPieceTokenizer(
        lowercase=True, unk_token="<unk>", sep_token="</s>", cls_token="<s>",
        pad_token="<pad>", mask_token="<mask>",
    )
    tok.train_from_iterator(
        texts, vocab_size=400, min_frequency=2,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    tok._tokenizer.post_processor = tokenizers.processors.RobertaProcessing(
        ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
        model_max_length=MAX_LEN,
    )


def byte_level_bpe(texts):
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(
        texts,
        vocab_size=500,
        min_frequency=2,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    tok._tokenizer.post_processor = tokenizers.processors.RobertaProcessing(
        ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
        model_max_length=MAX_LEN,
    )


def modernbert_bpe(texts):
    """ModernBERT's tokenizer: byte-level BPE with BERT's special tokens and template."""
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(
        texts, vocab_size=500, min_frequency=2,
        special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
    )
    tok._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        model_max_length=MAX_LEN,
    )


def unigram(texts):
    tok = tokenizers.SentencePieceUnigramTokenizer()
    tok.train_from_iterator(
        texts,
        vocab_size=500,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        unk_token="<unk>",
    )
    tok._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
        model_max_length=MAX_LEN,
    )


def tiny(kind, vocab, tokenizer):
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_act="gelu",
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "bert":
        return transformers.BertConfig(max_position_embeddings=40, **common)
    if kind == "roberta":
        return transformers.RobertaConfig(
            max_position_embeddings=MAX_LEN + 2 + 6, type_vocab_size=1,
            bos_token_id=0, eos_token_id=2, **common,
        )
    if kind == "xlm-roberta":
        return transformers.XLMRobertaConfig(
            max_position_embeddings=MAX_LEN + 2 + 6, type_vocab_size=1,
            bos_token_id=0, eos_token_id=2, **common,
        )
    if kind == "modernbert":
        # Three layers: global, sliding (a window of 4 tokens each side), global; small
        # rotary bases so the rotation matters over 32 tokens.
        return transformers.ModernBertConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=48, hidden_activation="gelu", max_position_embeddings=64,
            local_attention=8, global_attn_every_n_layers=2, global_rope_theta=1000.0,
            local_rope_theta=100.0, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
            cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
        )
    if kind == "distilbert":
        # DistilBERT's own names (dim, n_layers, n_heads, hidden_dim, activation, dropout,
        # attention_dropout); learned positions, as the distilled checkpoints have.
        return transformers.DistilBertConfig(
            vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
            activation="gelu", max_position_embeddings=40,
            pad_token_id=tokenizer.pad_token_id,
        )
    if kind == "mpnet":
        return transformers.MPNetConfig(
            max_position_embeddings=MAX_LEN + 2 + 6, relative_attention_num_buckets=32,
            bos_token_id=0, eos_token_id=2, **common,
        )
    raise ValueError(kind)


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def build(kind, make_tokenizer, texts):
    torch.manual_seed(SEED)
    tokenizer = make_tokenizer(texts)
    cfg = tiny(kind, len(tokenizer), tokenizer)
    model = transformers.AutoModel.from_config(cfg)
    perturb(model, SEED + 1)
    model.eval()
    return tokenizer, model


def save_sentence_transformer(kind, tokenizer, model, extra=()):
    raw = os.path.join(OUT, f"_{kind}_raw")
    shutil.rmtree(raw, ignore_errors=True)
    model.save_pretrained(raw, safe_serialization=True)
    tokenizer.save_pretrained(raw)
    transformer = st_modules.Transformer(raw, max_seq_length=MAX_LEN)
    pooling = st_modules.Pooling(model.config.hidden_size, pooling_mode="mean")
    st = SentenceTransformer(modules=[transformer, pooling, *extra], device="cpu")
    st.eval()
    shutil.rmtree(raw)
    return st


def references(st, texts):
    out = {}
    features = st.tokenize(texts)
    with torch.no_grad():
        tokens = st[0](dict(features))["token_embeddings"]
    for i, row in enumerate(features["attention_mask"]):
        n = int(row.sum())
        out[f"hidden.{i}"] = tokens[i, :n].contiguous()
    for mode in MODES:
        pool = st_modules.Pooling(tokens.shape[-1], pooling_mode=mode)
        f = {"token_embeddings": tokens, "attention_mask": features["attention_mask"]}
        out[f"pooled.{mode}"] = pool(f)["sentence_embedding"].contiguous()
    return out


def contrastive_grads(st):
    st.zero_grad()
    q = st(st.tokenize(QUERIES))["sentence_embedding"]
    p = st(st.tokenize(PASSAGES))["sentence_embedding"]
    scores = 20.0 * torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(p, dim=-1).T
    loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(QUERIES)))
    loss.backward()
    grads = {}
    for name, param in st[0].auto_model.named_parameters():
        if param.grad is not None:
            grads[f"grad.{name}"] = param.grad.detach().clone()
    # Dense modules after the pooling, named after the directory `st.save` gives them.
    for idx, module in enumerate(st):
        if isinstance(module, st_modules.Dense):
            for name, param in module.named_parameters():
                grads[f"grad.{idx}_Dense.{name}"] = param.grad.detach().clone()
    return float(loss), grads


def write(kind, st, tensors, loss):
    d = os.path.join(OUT, kind)
    shutil.rmtree(d, ignore_errors=True)
    st.save(d)
    os.remove(os.path.join(d, "README.md"))  # the model card: not needed by the tests
    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"))
    meta = {
        "texts": TEXTS,
        "queries": QUERIES,
        "passages": PASSAGES,
        "max_len": MAX_LEN,
        "modes": MODES,
        "loss": loss,
        "loss_fn": "cross_entropy(20 * cos(q, p), arange)",
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
    print(f"{kind}: {size / 1024:.0f} KB, loss {loss:.6f}, {len(tensors)} tensors")


# --- decoder embedders -------------------------------------------------------------------

QUERY_PROMPT = "Instruct: Given a question, retrieve the verse that answers it\nQuery:"
DECODERS = ["qwen3", "qwen2", "llama", "mistral", "gemma3_text"]


def decoder_tokenizer(kind, texts):
    """Byte-level BPE whose post-processor appends the EOS (BOS first where the family has
    one), with the family's special tokens and padding side."""
    if kind in ("qwen3", "qwen2"):
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        bos, eos, pad, side = None, "<|endoftext|>", "<|endoftext|>", "left"
    elif kind == "llama":
        specials = ["<unk>", "<s>", "</s>", "<pad>"]
        bos, eos, pad, side = "<s>", "</s>", "<pad>", "left"
    elif kind == "mistral":
        specials = ["<unk>", "<s>", "</s>"]
        bos, eos, pad, side = "<s>", "</s>", "</s>", "right"
    else:
        specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
        bos, eos, pad, side = "<bos>", "<eos>", "<pad>", "right"
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=500, min_frequency=2, special_tokens=specials)
    ids = {t: tok.token_to_id(t) for t in specials}
    single = (f"{bos} " if bos else "") + "$A " + eos
    pair = (f"{bos} " if bos else "") + "$A " + eos + " $B " + eos
    tok._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(t, ids[t]) for t in [bos, eos] if t],
    )
    kwargs = dict(eos_token=eos, pad_token=pad, model_max_length=MAX_LEN, padding_side=side)
    if bos:
        kwargs["bos_token"] = bos
    if "<unk>" in ids:
        kwargs["unk_token"] = "<unk>"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, **kwargs)


def tiny_decoder(kind, tokenizer):
    ids = dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    vocab = len(tokenizer)
    if kind == "qwen3":
        # head_dim 16 with hidden 32 and 4 heads; 2 KV heads; the last layer windowed.
        return transformers.Qwen3Config(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=48, hidden_act="silu",
            max_position_embeddings=64, rope_theta=100.0, rms_norm_eps=1e-6,
            use_sliding_window=True, sliding_window=6, max_window_layers=2,
            tie_word_embeddings=True, **ids,
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, intermediate_size=48, hidden_act="silu",
            max_position_embeddings=64, rope_theta=100.0, rms_norm_eps=1e-6, **ids,
        )
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, hidden_act="silu",
            max_position_embeddings=64, rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            **ids,
        )
    if kind == "mistral":
        return transformers.MistralConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, hidden_act="silu",
            max_position_embeddings=64, rope_theta=100.0, sliding_window=5, **ids,
        )
    if kind == "gemma3_text":
        # EmbeddingGemma's shape in miniature: bidirectional, sliding and global layers.
        return transformers.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24, intermediate_size=48,
            hidden_activation="gelu_pytorch_tanh", max_position_embeddings=64,
            query_pre_attn_scalar=20, sliding_window=8, use_bidirectional_attention=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            **ids,
        )
    raise ValueError(kind)


def decoder_head(kind):
    """Pooling mode, include_prompt, the modules after the pooling, and the prompts."""
    if kind == "gemma3_text":
        torch.manual_seed(SEED + 3)
        up = st_modules.Dense(32, 64, bias=False, activation_function=torch.nn.Identity())
        down = st_modules.Dense(64, 32, bias=False, activation_function=torch.nn.Identity())
        prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
        return "mean", True, [up, down, st_modules.Normalize()], prompts
    prompts = {"query": QUERY_PROMPT, "document": ""}
    if kind == "llama":
        return "mean", False, [st_modules.Normalize()], prompts
    return "lasttoken", True, [st_modules.Normalize()], prompts


def save_decoder(kind, tokenizer, model):
    mode, include_prompt, extra, prompts = decoder_head(kind)
    raw = os.path.join(OUT, f"_{kind}_raw")
    shutil.rmtree(raw, ignore_errors=True)
    model.save_pretrained(raw, safe_serialization=True)
    tokenizer.save_pretrained(raw)
    transformer = st_modules.Transformer(raw)
    pooling = st_modules.Pooling(
        model.config.hidden_size, pooling_mode=mode, include_prompt=include_prompt
    )
    st = SentenceTransformer(
        modules=[transformer, pooling, *extra], device="cpu", prompts=prompts,
        default_prompt_name=None,
    )
    st.eval()
    shutil.rmtree(raw)
    return st


def decoder_references(st, texts):
    """Hidden states of the real tokens (wherever the padding is) and every pooling mode on
    the batch as sentence-transformers pads it; the whole head with each prompt."""
    out = {}
    features = st.preprocess(texts)
    with torch.no_grad():
        tokens = st[0](dict(features))["token_embeddings"]
    mask = features["attention_mask"]
    for i, row in enumerate(mask):
        out[f"hidden.{i}"] = tokens[i][row.bool()].contiguous()
    for mode in MODES:
        pool = st_modules.Pooling(tokens.shape[-1], pooling_mode=mode)
        f = {"token_embeddings": tokens, "attention_mask": mask}
        out[f"pooled.{mode}"] = pool(f)["sentence_embedding"].contiguous()
    with torch.no_grad():
        for side in ["query", "document"]:
            e = st.encode(texts, prompt_name=side, convert_to_tensor=True, batch_size=len(texts))
            out[f"embeddings.{side}"] = e.contiguous()
    return out


def decoder_grads(st):
    """The reference loss on the prompted queries and the documents (their own prompt)."""
    st.zero_grad()
    q = st(st.preprocess(QUERIES, prompt=st.prompts["query"]))["sentence_embedding"]
    p = st(st.preprocess(PASSAGES, prompt=st.prompts["document"] or None))["sentence_embedding"]
    scores = 20.0 * torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(p, dim=-1).T
    loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(QUERIES)))
    loss.backward()
    grads = {}
    for name, param in st[0].auto_model.named_parameters():
        if param.grad is not None:
            grads[f"grad.{name}"] = param.grad.detach().clone()
    for idx, module in enumerate(st):
        if isinstance(module, st_modules.Dense):
            for name, param in module.named_parameters():
                grads[f"grad.{idx}_Dense.{name}"] = param.grad.detach().clone()
    return float(loss), grads


def build_decoder(kind, texts):
    torch.manual_seed(SEED)
    tokenizer = decoder_tokenizer(kind, texts)
    cfg = tiny_decoder(kind, tokenizer)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModel.from_config(cfg)
    perturb(model, SEED + 1)
    model.eval()
    return tokenizer, model


def main():
    torch.set_default_dtype(torch.float32)
    random.seed(SEED)
    np.random.seed(SEED)
    texts = sample_text()
    families = [
        ("bert", wordpiece),
        ("roberta", byte_level_bpe),
        ("xlm-roberta", unigram),
        ("mpnet", mpnet_wordpiece),
        ("modernbert", modernbert_bpe),
        ("distilbert", distilbert_wordpiece),
    ]
    only = sys.argv[1:]
    for kind, make_tokenizer in families:
        if only and kind not in only:
            continue
        tokenizer, model = build(kind, make_tokenizer, texts)
        st = save_sentence_transformer(kind, tokenizer, model)
        tensors = references(st, TEXTS)
        loss, grads = contrastive_grads(st)
        tensors.update(grads)
        write(kind, st, tensors, loss)
        if kind == "bert":
            torch.manual_seed(SEED + 2)
            dense = st_modules.Dense(32, 16, activation_function=torch.nn.Tanh())
            with torch.no_grad():
                dense.linear.bias.add_(0.1 * torch.randn(16))
            st2 = save_sentence_transformer(
                "bert-dense", tokenizer, model, extra=[dense, st_modules.Normalize()]
            )
            with torch.no_grad():
                emb = st2.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
            loss2, grads2 = contrastive_grads(st2)
            write("bert-dense", st2, {"embeddings": emb.contiguous(), **grads2}, loss2)
    for kind in DECODERS:
        if only and kind not in only:
            continue
        tokenizer, model = build_decoder(kind, texts)
        st = save_decoder(kind, tokenizer, model)
        tensors = decoder_references(st, TEXTS)
        loss, grads = decoder_grads(st)
        tensors.update(grads)
        write(kind, st, tensors, loss)


if __name__ == "__main__":
    main()
