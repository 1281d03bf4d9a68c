#!/usr/bin/env python3
"""PEFT LoRA adapters on two of the tiny family fixtures, with PEFT's adapter gradients,
for tests/it/lora_peft.rs (run by a developer, never by CI).

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_lora_fixtures.py
    # needs torch, transformers, sentence-transformers and peft; writes tests/fixtures/lora/

For `bert` (an encoder) and `qwen3` (a decoder) of tests/fixtures/families/, the script
loads the sentence-transformers model, wraps its transformer with
`peft.get_peft_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=0, target_modules=every
attention and feed-forward projection))`, moves every adapter off its initialisation
(seeded noise: B is not zero, so A gets a gradient too) and saves the adapter with
`save_pretrained` (PEFT's own layout: adapter_config.json, adapter_model.safetensors).
Then `reference.safetensors` holds

- `grad.<module>.lora_{A,B}.weight`: the gradient of every adapter (names as the base
  model's modules, PEFT's `base_model.model.` and `.default` taken off) of the fixture
  loss of make_family_fixtures.py (cosine x 20, cross-entropy over the in-batch passages;
  the decoder with its query and document prompts), evaluation mode;
- `embeddings`: the adapted model's `encode` of the fixture texts;

and `reference.json` the loss and the versions used.
"""

import json
import os
import sys

import peft
import safetensors.torch
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_family_fixtures import PASSAGES, QUERIES, TEXTS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = os.path.join(ROOT, "tests", "fixtures", "families")
OUT = os.path.join(ROOT, "tests", "fixtures", "lora")
TARGETS = {
    "bert": ["query", "key", "value", "dense"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
SEED = 4321


def ours(name):
    """PEFT's parameter name as the base model's module path."""
    return name.removeprefix("base_model.model.").replace(".default", "")


def main():
    torch.set_default_dtype(torch.float32)
    for family, targets in TARGETS.items():
        torch.manual_seed(SEED)
        st = SentenceTransformer(os.path.join(FAMILIES, family), device="cpu")
        st.eval()
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, bias="none"
        )
        model = peft.get_peft_model(st[0].auto_model, config)
        st[0].auto_model = model
        g = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if "lora_" in name:
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
        out = os.path.join(OUT, family)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(os.path.join(out, "adapter"))
        os.remove(os.path.join(out, "adapter", "README.md"))
        # The base as a path from the repository's root, not this machine's.
        config_path = os.path.join(out, "adapter", "adapter_config.json")
        with open(config_path) as f:
            saved = json.load(f)
        saved["base_model_name_or_path"] = f"tests/fixtures/families/{family}"
        with open(config_path, "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)

        st.zero_grad()
        prompts = st.prompts or {}
        if family == "qwen3":
            q = st(st.preprocess(QUERIES, prompt=prompts["query"]))["sentence_embedding"]
            p = st(st.preprocess(PASSAGES, prompt=prompts.get("document") or None))[
                "sentence_embedding"
            ]
        else:
            q = st(st.tokenize(QUERIES))["sentence_embedding"]
            p = st(st.tokenize(PASSAGES))["sentence_embedding"]
        n = torch.nn.functional.normalize
        scores = 20.0 * n(q, dim=-1) @ n(p, dim=-1).T
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(QUERIES)))
        loss.backward()
        tensors = {
            f"grad.{ours(name)}": param.grad.detach().clone()
            for name, param in model.named_parameters()
            # BertModel's pooler (`pooler.dense`, which "dense" targets too) is not part
            # of the sentence embedding: its adapter gets no gradient.
            if "lora_" in name and param.grad is not None
        }
        with torch.no_grad():
            tensors["embeddings"] = st.encode(TEXTS, convert_to_tensor=True).cpu()
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            os.path.join(out, "reference.safetensors"),
        )
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(
                {
                    "loss": float(loss),
                    "loss_fn": "cross_entropy(20 * cos(q, p), arange)",
                    "texts": TEXTS,
                    "versions": {
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "sentence_transformers": sentence_transformers.__version__,
                        "peft": peft.__version__,
                    },
                },
                f,
                indent=1,
            )
        print(family, float(loss), len(tensors) - 1, "adapter gradients")


if __name__ == "__main__":
    main()
