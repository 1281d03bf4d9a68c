#!/usr/bin/env python3
"""A tiny Jina v3 with task adapters in its release's layout, and the embeddings and
gradients its arithmetic gives (run by a developer, never by CI):

    ~/.cache/gradcache/peer-venv/bin/python scripts/make_task_adapter_fixture.py
                                        # writes tests/fixtures/jina-tasks/

transformers 5.2x's `jina_embeddings_v3` carries no task adapters, and the release's own
code (`XLMRobertaLoRA`, remote code) cannot be fetched here, so the fixture writes what
the release ships and computes what its code does, from transformers' layers:

- the model is tests/fixtures/families/jina_embeddings_v3 (its weights, tokenizer and
  pooling) with random adapters for three tasks on every linear projection and embedding
  table (`lora_adaptations`, `lora_rank` 2, `lora_alpha` 3: scale 1.5);
- `config.json` is the release's: `model_type` `xlm-roberta`, `position_embedding_type`
  `rotary`, `rotary_emb_base`, `architectures` `XLMRobertaLoRA`, `task_instructions`;
- `model.safetensors` is the release's: the base under `roberta.`, every adapted weight
  under `<m>.parametrizations.weight.original`, its adapters stacked over the tasks under
  `<m>.parametrizations.weight.0.lora_A` / `lora_B` (linear: A [tasks, r, in],
  B [tasks, out, r], W' = W + s B[t] A[t]; embedding: A [tasks, rows, r],
  B [tasks, r, dim], E' = E + s A[t] B[t]), as `LoRAParametrization` stores them;
- the references: each task's text embeddings (its instruction put before the text, the
  task's updated weights, mean pooling), the base model's (no task), and one contrastive
  loss with the queries under `retrieval.query` and the passages under
  `retrieval.passage`, with the gradient of every parameter (the base's under the
  checkpoint's names, each adapter's per task as `<m>.lora_A.task<t>`).
"""

import json
import os
import shutil
import sys

import safetensors.torch
import torch
import transformers
from sentence_transformers import SentenceTransformer
from torch.func import functional_call
from transformers.core_model_loading import revert_weight_conversion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_family_fixtures as base  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "fixtures", "families", "jina_embeddings_v3")
OUT = os.path.join(ROOT, "tests", "fixtures", "jina-tasks")
TASKS = ["retrieval.query", "retrieval.passage", "text-matching"]
INSTRUCTIONS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "text-matching": "",
}
RANK, ALPHA = 2, 3.0
SCALE = ALPHA / RANK
QUERY_TASK, PASSAGE_TASK = 0, 1


def adapted_modules(layers):
    """(checkpoint module, loaded modules its rows split into, kind)."""
    out = [
        ("embeddings.word_embeddings", ["embeddings.word_embeddings"], "embedding"),
        ("embeddings.token_type_embeddings", ["embeddings.token_type_embeddings"], "embedding"),
        ("pooler.dense", ["pooler.dense"], "linear"),
    ]
    for i in range(layers):
        out += [
            (f"encoder.layers.{i}.mixer.Wqkv",
             [f"layers.{i}.self_attn.{p}_proj" for p in "qkv"], "linear"),
            (f"encoder.layers.{i}.mixer.out_proj", [f"layers.{i}.self_attn.o_proj"], "linear"),
            (f"encoder.layers.{i}.mlp.fc1", [f"layers.{i}.mlp.fc1"], "linear"),
            (f"encoder.layers.{i}.mlp.fc2", [f"layers.{i}.mlp.fc2"], "linear"),
        ]
    return out


def main():
    torch.set_default_dtype(torch.float32)
    st = SentenceTransformer(SOURCE, device="cpu")
    st.eval()
    model = st[0].auto_model
    model.config._attn_implementation = "eager"
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    checkpoint = safetensors.torch.load_file(os.path.join(SOURCE, "model.safetensors"))
    modules = adapted_modules(model.config.num_hidden_layers)
    g = torch.Generator().manual_seed(base.SEED + 7)
    adapters = {}
    for ck, _, kind in modules:
        out_dim, in_dim = checkpoint[f"{ck}.weight"].shape
        if kind == "linear":
            a = torch.randn(len(TASKS), RANK, in_dim, generator=g) / in_dim ** 0.5
            b = 0.2 * torch.randn(len(TASKS), out_dim, RANK, generator=g)
        else:  # rows = out_dim, dim = in_dim
            a = 0.2 * torch.randn(len(TASKS), out_dim, RANK, generator=g)
            b = torch.randn(len(TASKS), RANK, in_dim, generator=g) / RANK ** 0.5
        adapters[ck] = (a.requires_grad_(), b.requires_grad_())

    def weights(task, leaves):
        """The loaded model's parameters with task `task`'s updates (None: the base)."""
        w = dict(leaves)
        if task is None:
            return w
        for ck, loaded, kind in modules:
            a, b = adapters[ck]
            delta = SCALE * (b[task] @ a[task] if kind == "linear" else a[task] @ b[task])
            rows = delta.shape[0] // len(loaded)
            for k, name in enumerate(loaded):
                w[f"{name}.weight"] = leaves[f"{name}.weight"] + delta[k * rows:(k + 1) * rows]
        return w

    def embed(texts, task, leaves):
        prompt = "" if task is None else INSTRUCTIONS[TASKS[task]]
        features = st.tokenize([prompt + t for t in texts])
        out = functional_call(model, weights(task, leaves),
                              kwargs={"input_ids": features["input_ids"],
                                      "attention_mask": features["attention_mask"]})
        tokens = out.last_hidden_state
        mask = features["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        return (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    tensors = {}
    with torch.no_grad():
        tensors["embeddings.none"] = embed(base.TEXTS, None, params).contiguous()
        for t, name in enumerate(TASKS):
            tensors[f"embeddings.{name}"] = embed(base.TEXTS, t, params).contiguous()
    # The base embeddings are the family fixture's: the references agree.
    check = st.encode(base.TEXTS, convert_to_tensor=True)
    assert torch.allclose(check, tensors["embeddings.none"], atol=1e-6)

    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    q = embed(base.QUERIES, QUERY_TASK, leaves)
    p = embed(base.PASSAGES, PASSAGE_TASK, leaves)
    scores = 20.0 * torch.nn.functional.normalize(q, dim=-1) @ \
        torch.nn.functional.normalize(p, dim=-1).T
    loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(base.QUERIES)))
    loss.backward()
    grads = {n: v.grad.detach().clone() for n, v in leaves.items() if v.grad is not None}
    saved = revert_weight_conversion(model, grads)
    for name, grad in saved.items():
        tensors[f"grad.{name}"] = grad.contiguous()
    for ck, _, _ in modules:
        a, b = adapters[ck]
        if a.grad is None:  # the pooler's: mean pooling does not read it
            continue
        for t in (QUERY_TASK, PASSAGE_TASK):
            tensors[f"grad.{ck}.lora_A.task{t}"] = a.grad[t].contiguous()
            tensors[f"grad.{ck}.lora_B.task{t}"] = b.grad[t].contiguous()

    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(SOURCE, OUT, ignore=shutil.ignore_patterns("reference.*", "model.safetensors"))
    release = {}
    for name, t in checkpoint.items():
        module = name.removesuffix(".weight")
        if module in adapters and name.endswith(".weight"):
            a, b = adapters[module]
            release[f"roberta.{module}.parametrizations.weight.original"] = t
            release[f"roberta.{module}.parametrizations.weight.0.lora_A"] = a.detach().clone()
            release[f"roberta.{module}.parametrizations.weight.0.lora_B"] = b.detach().clone()
        else:
            release[f"roberta.{name}"] = t
    safetensors.torch.save_file(release, os.path.join(OUT, "model.safetensors"),
                                metadata={"format": "pt"})
    cfg = model.config
    config = {
        "architectures": ["XLMRobertaLoRA"],
        "model_type": "xlm-roberta",
        "attention_probs_dropout_prob": 0.1,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "hidden_act": cfg.hidden_act,
        "hidden_dropout_prob": 0.1,
        "hidden_size": cfg.hidden_size,
        "initializer_range": cfg.initializer_range,
        "intermediate_size": cfg.intermediate_size,
        "layer_norm_eps": cfg.layer_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "type_vocab_size": cfg.type_vocab_size,
        "vocab_size": cfg.vocab_size,
        "position_embedding_type": "rotary",
        "rotary_emb_base": cfg.rope_parameters["rope_theta"],
        "load_trained_adapters": True,
        "lora_adaptations": TASKS,
        "lora_alpha": ALPHA,
        "lora_dropout_p": 0.0,
        "lora_main_params_trainable": False,
        "lora_rank": RANK,
        "task_instructions": INSTRUCTIONS,
        "use_flash_attn": False,
    }
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    safetensors.torch.save_file(tensors, os.path.join(OUT, "reference.safetensors"))
    meta = {
        "texts": base.TEXTS,
        "queries": base.QUERIES,
        "passages": base.PASSAGES,
        "max_len": base.MAX_LEN,
        "tasks": TASKS,
        "query_task": TASKS[QUERY_TASK],
        "passage_task": TASKS[PASSAGE_TASK],
        "loss": float(loss),
        "loss_fn": "cross_entropy(20 * cos(q, p), arange), queries and passages each "
                   "under its task's instruction and adapters",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {OUT}: loss {float(loss):.6f}, {len(tensors)} reference tensors")


if __name__ == "__main__":
    main()
