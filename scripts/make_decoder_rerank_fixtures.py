#!/usr/bin/env python3
"""Tiny decoder rerankers saved by sentence-transformers' `CrossEncoder`, their scores and
one cached step's gradients, for tests/it/rerank_decoder.rs (run by a developer, never by
CI; the venv of scripts/peer-bench has what it needs):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_decoder_rerank_fixtures.py
                                        # writes tests/fixtures/rerank/decoders/

Three layouts over the tiny decoders of tests/fixtures/families (their weights, a longer
position table, the tokenizer with "yes" and "no" added as whole words):

- `qwen3-causal`: Qwen3-Reranker's layout. A `Qwen3ForCausalLM` (word embeddings tied to
  the LM head) that sentence-transformers loads as a `Transformer` (text generation) and a
  `LogitScore` of the "yes" and "no" tokens: the score is logit[yes] - logit[no] at the
  last position, the sigmoid its probability.
- `qwen2-causal`: the same on Qwen2 with its own (untied) `lm_head`.
- `qwen3-seq-cls`: the converted layout (`Qwen3ForSequenceClassification`, a `score`
  projection without bias on the last real token), as text-embeddings-inference serves
  Qwen3-Reranker.

Each tokenizer carries a chat template that renders a pair (the `query` and `document`
roles sentence-transformers gives its halves; a `system` message is the instruction) as
Qwen3-Reranker's prompt does, shortened for the tiny models. `reference.json` keeps, for
the pairs of make_rerank_fixtures.py (four past the 160-token limit: truncated, the
template's tail written back), the token ids, raw scores and activated scores, with and
without an instruction. `reference.safetensors` keeps the parameter gradients of one step
of `CachedMultipleNegativesRankingLoss(num_negatives=2, mini_batch_size=3)` on
`qwen3-causal`, in float64, the in-batch negatives fixed as in make_rerank_fixtures.py.
"""

import json
import os
import shutil
import sys
import tempfile

import safetensors.torch
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers.cross_encoder import CrossEncoder, losses
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "rerank", "decoders")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_rerank_fixtures import DOCUMENTS, QUERIES, pairs  # noqa: E402

MAX_LEN = 160
INSTRUCTION = "Given a question, find the verse"

TEMPLATE = (
    '{%- set instruction = messages | selectattr("role", "eq", "system") '
    '| map(attribute="content") | first | default("Judge the verse") -%}\n'
    '{%- set query = messages | selectattr("role", "eq", "query") '
    '| map(attribute="content") | first -%}\n'
    '{%- set document = messages | selectattr("role", "eq", "document") '
    '| map(attribute="content") | first -%}\n'
    "<|im_start|>system\nAnswer yes or no.<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: {{ instruction }}\n<Query>: {{ query }}\n"
    "<Document>: {{ document }}<|im_end|>\n<|im_start|>assistant\n"
    '{{ "<think>\\n\\n</think>\\n\\n" }}'
)

LAYOUTS = {
    "qwen3-causal": ("qwen3", transformers.Qwen3ForCausalLM, 300),
    "qwen2-causal": ("qwen2", transformers.Qwen2ForCausalLM, 301),
    "qwen3-seq-cls": ("qwen3", transformers.Qwen3ForSequenceClassification, 302),
}


def build(name):
    family, cls, seed = LAYOUTS[name]
    src = os.path.join(ROOT, "tests", "fixtures", "families", family)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens([tokenizers.AddedToken(w, single_word=True) for w in ["yes", "no"]])
    tok.chat_template = TEMPLATE
    tok.model_max_length = MAX_LEN
    config = transformers.AutoConfig.from_pretrained(src)
    config.max_position_embeddings = 2 * MAX_LEN
    config.architectures = [cls.__name__]
    if "seq-cls" in name:
        config.num_labels = 1
    model = cls.from_pretrained(src, config=config)
    model.resize_token_embeddings(len(tok))
    model.config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("model."):
                p.add_(0.02 * torch.randn_like(p))
            elif "norm" not in n:
                p.copy_(0.3 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        ce = CrossEncoder(tmp)
        out = os.path.join(OUT, name)
        shutil.rmtree(out, ignore_errors=True)
        ce.save(out)
    os.remove(os.path.join(out, "README.md"))
    return CrossEncoder(out)


def token_ids(ce, batch, prompt=None):
    features = ce[0].preprocess(batch, prompt=prompt)
    ids, mask = features["input_ids"], features["attention_mask"]
    return [[int(t) for t, m in zip(row, ms) if m] for row, ms in zip(ids.tolist(), mask.tolist())]


def main():
    torch.set_default_dtype(torch.float32)
    meta = {"pairs": pairs(), "instruction": INSTRUCTION, "models": {}, "losses": {}}
    models = {}
    for name in LAYOUTS:
        ce = build(name)
        ce.model.eval()
        entry = {}
        for key, prompt in [("plain", None), ("instructed", INSTRUCTION)]:
            logits = ce.predict(pairs(), activation_fn=torch.nn.Identity(), prompt=prompt,
                                convert_to_numpy=True)
            scores = ce.predict(pairs(), prompt=prompt, convert_to_numpy=True)
            entry[key] = {
                "ids": token_ids(ce, pairs(), prompt),
                "logits": logits.reshape(-1).tolist(),
                "scores": scores.reshape(-1).tolist(),
            }
        meta["models"][name] = entry
        models[name] = ce
        print(name, entry["plain"]["logits"][:3], [len(i) for i in entry["plain"]["ids"]])

    tensors = {}
    ce = models["qwen3-causal"]
    ce.model.eval()
    ce.model.double()
    q, pos, hard = QUERIES, DOCUMENTS[:4], [DOCUMENTS[(i + 2) % 6] for i in range(4)]
    candidates = pos + hard
    pick = [[1, 6], [7, 0], [3, 4], [2, 5]]
    columns = [[candidates[pick[r][c]] for r in range(4)] for c in range(2)]
    cmnrl = losses.CachedMultipleNegativesRankingLoss(ce, num_negatives=2, mini_batch_size=3)
    cmnrl.get_in_batch_negatives = lambda anchors, cands: iter(columns)
    groups = [[pos[r], columns[0][r], columns[1][r], hard[r]] for r in range(4)]
    ce.model.zero_grad()
    value = cmnrl([list(q), list(pos), list(hard)], None)
    value.backward()
    for name, p in ce.model.named_parameters():
        if p.grad is not None:
            tensors[f"cmnrl.grad.{name}"] = p.grad.detach().float().clone()
    meta["losses"]["cmnrl"] = {"loss": float(value), "queries": q, "groups": groups,
                               "scale": 10.0}
    print(f"cmnrl: loss {float(value):.6f}, {len(tensors)} gradients")

    meta["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
    }
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                os.path.join(OUT, "reference.safetensors"))
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
