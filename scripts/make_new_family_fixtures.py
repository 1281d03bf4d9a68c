#!/usr/bin/env python3
"""Tiny random models of the encoder families issue 70 asks for (NomicBERT, GTE, Jina v3,
EuroBERT, DeBERTa-v2/v3), with transformers' and sentence-transformers' outputs, written
the way scripts/make_family_fixtures.py writes the supported families (same texts, same
references, same loss; run by a developer, never by CI):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_new_family_fixtures.py [KIND...]
                                        # writes tests/fixtures/families/<kind>/

transformers 5.2x carries each natively. Each config exercises what its family adds:

- `nomic_bert`: post-norm layers with rotary attention (no biases), a SwiGLU feed-forward
  (`gate_proj`, `up_proj`, `down_proj`), token types; `search_query: ` /
  `search_document: ` prompts in `config_sentence_transformers.json`, as nomic-embed-text.
- `gte`: the same layer with biases and a GeGLU feed-forward (`down_proj` with bias).
- `jina_embeddings_v3`: XLM-R with rotary attention: biased projections, a plain GELU
  feed-forward (`fc1`, `fc2`), XLM-R's tokenizer.
- `eurobert`: a Llama-style encoder: RMSNorm, grouped KV heads, rotary, SwiGLU,
  bidirectional attention, a final norm; byte-level BPE with BOS and EOS.
- `deberta-v2`: DeBERTa-v3's disentangled attention (content-to-position and
  position-to-content over log-bucketed relative positions, shared keys, the relative
  embeddings layer-normed), no absolute positions, a sentencepiece-style tokenizer with
  `[CLS]`/`[SEP]`.

Each is saved with mean pooling; the references add `embeddings.query` /
`embeddings.document` (`encode` with each prompt) where the family has prompts.
"""

import os
import sys

import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_modules
from transformers.core_model_loading import revert_weight_conversion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_family_fixtures as base  # noqa: E402

MAX_LEN = base.MAX_LEN
PROMPTS = {"nomic_bert": {"query": "search_query: ", "document": "search_document: "}}


def deberta_unigram(texts):
    """DeBERTa-v3's tokenizer in miniature: a unigram model with `[CLS] $A [SEP]`."""
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    tok = tokenizers.SentencePieceUnigramTokenizer()
    tok.train_from_iterator(texts, vocab_size=400, special_tokens=specials, unk_token="[UNK]")
    ids = {t: tok.token_to_id(t) for t in specials}
    tok._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer, pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", unk_token="[UNK]", mask_token="[MASK]", model_max_length=MAX_LEN,
    )


def eurobert_bpe(texts):
    """EuroBERT's tokenizer in miniature: byte-level BPE, BOS and EOS around each text,
    padded on the right."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|mask|>", "<|pad|>"]
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=500, min_frequency=2, special_tokens=specials)
    ids = {t: tok.token_to_id(t) for t in specials}
    tok._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|end_of_text|>",
        pair="<|begin_of_text|> $A <|end_of_text|> $B <|end_of_text|>",
        special_tokens=[(t, ids[t]) for t in specials[:2]],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer, bos_token=specials[0], eos_token=specials[1],
        mask_token=specials[2], pad_token=specials[3], model_max_length=MAX_LEN,
        padding_side="right",
    )


def tiny(kind, tokenizer):
    vocab = len(tokenizer)
    rope = {"rope_type": "default", "rope_theta": 100.0}
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  pad_token_id=tokenizer.pad_token_id)
    if kind == "nomic_bert":
        return transformers.NomicBertConfig(
            intermediate_size=48, hidden_act="silu", max_position_embeddings=64,
            type_vocab_size=2, rope_parameters=rope, **common)
    if kind == "gte":
        return transformers.GteConfig(
            intermediate_size=48, hidden_act="gelu", max_position_embeddings=64,
            type_vocab_size=2, layer_norm_eps=1e-12, rope_parameters=rope, **common)
    if kind == "jina_embeddings_v3":
        return transformers.JinaEmbeddingsV3Config(
            intermediate_size=64, hidden_act="gelu", max_position_embeddings=64,
            type_vocab_size=1, layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2,
            rope_parameters=rope, **common)
    if kind == "eurobert":
        return transformers.EuroBertConfig(
            intermediate_size=48, num_key_value_heads=2, hidden_act="silu",
            max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=rope,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            mask_token_id=tokenizer.mask_token_id, **common)
    if kind == "deberta-v2":
        return transformers.DebertaV2Config(
            intermediate_size=64, hidden_act="gelu", max_position_embeddings=MAX_LEN,
            type_vocab_size=0, layer_norm_eps=1e-7, relative_attention=True,
            max_relative_positions=-1, position_buckets=8, norm_rel_ebd="layer_norm",
            share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False,
            **common)
    raise ValueError(kind)


TOKENIZERS = {
    "nomic_bert": base.wordpiece,
    "gte": base.wordpiece,
    "jina_embeddings_v3": base.unigram,
    "eurobert": eurobert_bpe,
    "deberta-v2": deberta_unigram,
}


# Families whose checkpoints transformers 5 renames on load and back on save: their
# reference gradients are named as the checkpoint names their weights.
CHECKPOINT_NAMED_GRADIENTS = {"nomic_bert", "gte", "jina_embeddings_v3"}


def save(kind, tokenizer, model):
    raw = os.path.join(base.OUT, f"_{kind}_raw")
    model.save_pretrained(raw, safe_serialization=True)
    tokenizer.save_pretrained(raw)
    transformer = st_modules.Transformer(raw, max_seq_length=MAX_LEN)
    pooling = st_modules.Pooling(model.config.hidden_size, pooling_mode="mean")
    prompts = PROMPTS.get(kind)
    st = SentenceTransformer(modules=[transformer, pooling], device="cpu", prompts=prompts,
                             default_prompt_name=None)
    st.eval()
    import shutil
    shutil.rmtree(raw)
    return st


def main():
    torch.set_default_dtype(torch.float32)
    texts = base.sample_text()
    only = sys.argv[1:]
    for kind, make_tokenizer in TOKENIZERS.items():
        if only and kind not in only:
            continue
        torch.manual_seed(base.SEED)
        tokenizer = make_tokenizer(texts)
        cfg = tiny(kind, tokenizer)
        cfg._attn_implementation = "eager"
        model = transformers.AutoModel.from_config(cfg)
        base.perturb(model, base.SEED + 1)
        model.eval()
        st = save(kind, tokenizer, model)
        tensors = base.references(st, base.TEXTS)
        if kind in PROMPTS:
            with torch.no_grad():
                for side in ["query", "document"]:
                    e = st.encode(base.TEXTS, prompt_name=side, convert_to_tensor=True,
                                  batch_size=len(base.TEXTS))
                    tensors[f"embeddings.{side}"] = e.contiguous()
        loss, grads = base.contrastive_grads(st)
        if kind in CHECKPOINT_NAMED_GRADIENTS:
            # The gradients under the names the saved checkpoint has (transformers 5 saves
            # these families in their published layout: fused `Wqkv`, `fc11`, `emb_ln`, ...),
            # the chunked weights' gradients concatenated as their weights are.
            bare = {k.removeprefix("grad."): v for k, v in grads.items()}
            saved = revert_weight_conversion(st[0].auto_model, bare)
            grads = {f"grad.{k}": v.contiguous() for k, v in saved.items()}
        tensors.update(grads)
        base.write(kind, st, tensors, loss)


if __name__ == "__main__":
    main()
