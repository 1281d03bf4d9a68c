#!/usr/bin/env python3
"""A tiny ColBERT saved by PyLate and by sentence-transformers 6, with their token
embeddings and their contrastive loss and gradients, for tests/it/colbert.rs (run by a
developer, never by CI).

PyLate pins an older sentence-transformers, so the script runs twice, once per package:

    python3 -m venv ~/.cache/gradcache/pylate-venv   # pylate 1.6 (sentence-transformers 5.3)
    ~/.cache/gradcache/pylate-venv/bin/python scripts/make_colbert_fixtures.py pylate
    ~/.cache/gradcache/peer-venv/bin/python scripts/make_colbert_fixtures.py st6

`pylate` builds `ColBERT` over the BERT family fixture (tests/fixtures/families/bert:
vocabulary 400, hidden 32, 2 layers) with a 8-d Dense projection, query length 12,
document length 20 (PyLate adds its `[Q] ` and `[D] ` prefix tokens to the vocabulary and
pads queries with `[MASK]`, not attended), perturbs the projection, and saves it to
tests/fixtures/colbert/pylate. `st6` loads that directory with sentence-transformers'
`MultiVectorEncoder` and saves it in its own layout to tests/fixtures/colbert/st6.

Each writes `reference.safetensors` / `reference.json` beside its model:

- `query.{i}` / `document.{i}`: `encode` of each text (queries with expansion: 12
  vectors; documents: the kept tokens, punctuation skiplisted, one text truncated);
- `grad.{name}`: the gradient of every parameter (Hugging Face names, `1_Dense.linear.weight`)
  of the package's contrastive loss over four (query, positive, hard negative) triples,
  evaluation mode (no dropout), temperature 1 (PyLate's `Contrastive`, sentence-transformers'
  `MultiVectorMultipleNegativesRankingLoss`); the loss value in reference.json. The script
  checks that every MaxSim maximum of the batch is positive, where PyLate (masked tokens
  score 0) and sentence-transformers (masked tokens leave the max) agree.

A third mode, `distill` (PyLate's venv, after `pylate`), loads the saved PyLate model and
writes `distillation.safetensors` / `distillation.json` beside it: PyLate's
`Distillation` loss (KL divergence to teacher scores given with the data) of the four
queries, each with three passages (its positive, its hard negative, the next query's
positive) and made-up teacher scores; the loss and every parameter's gradient with
`normalize_scores` on (`normalized.grad.{name}`, PyLate's default) and off (`raw.grad.{name}`).
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "colbert"
BERT = ROOT / "tests" / "fixtures" / "families" / "bert"

QUERIES = ["in the beginning god created", "the lord is my shepherd", "who is he", "light"]
POSITIVES = [
    "in the beginning, god created the heaven and the earth.",
    "the lord is my shepherd; i shall not want.",
    "and he said, who is he?",
    "and god said, let there be light: and there was light.",
]
NEGATIVES = [
    "and the earth was without form, and void; and darkness was upon the face of the deep "
    "and the spirit of god moved upon the face of the waters.",
    "he maketh me to lie down in green pastures.",
    "thou shalt not kill.",
    "and the evening and the morning were the first day.",
]


def triples():
    return {"queries": QUERIES, "positives": POSITIVES, "negatives": NEGATIVES}


def hf_name(name):
    for prefix in ("0.auto_model.", "0.model.", "0.auto_model.bert.", "0.model.bert."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("1.linear."):
        return "1_Dense." + name[2:]
    raise SystemExit(f"unexpected parameter {name}")


def write(out, tensors, meta):
    save_file({k: v.detach().contiguous().float() for k, v in tensors.items()},
              str(out / "reference.safetensors"))
    (out / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")


def pylate_fixture():
    from pylate import losses, models
    import pylate

    with tempfile.TemporaryDirectory() as plain:
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BERT / f, Path(plain) / f)
        torch.manual_seed(0)
        model = models.ColBERT(plain, embedding_size=8, query_length=12, document_length=20,
                               device="cpu")
    with torch.no_grad():
        model[1].linear.weight.add_(torch.randn_like(model[1].linear.weight) * 0.3)
    out = OUT / "pylate"
    shutil.rmtree(out, ignore_errors=True)
    model.save(str(out))
    (out / "README.md").unlink(missing_ok=True)
    model.eval()
    tensors = {}
    q = model.encode(QUERIES + POSITIVES, is_query=True, convert_to_tensor=False)
    d = model.encode(QUERIES + POSITIVES + NEGATIVES, is_query=False, convert_to_tensor=False)
    texts = QUERIES + POSITIVES
    for i, e in enumerate(q):
        tensors[f"query.{i}"] = torch.as_tensor(e)
    for i, e in enumerate(d):
        tensors[f"document.{i}"] = torch.as_tensor(e)
    features = [
        model.tokenize(QUERIES, is_query=True),
        model.tokenize(POSITIVES + NEGATIVES, is_query=False),
    ]
    # PyLate stacks the positive and negative columns: one tokenization, split in two.
    docs = features[1]
    n = len(QUERIES)
    features = [features[0]] + [{k: v[:n] for k, v in docs.items()}, {k: v[n:] for k, v in docs.items()}]
    loss_fn = losses.Contrastive(model=model, temperature=1.0)
    model.zero_grad()
    loss = loss_fn(features, None)
    loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            tensors[f"grad.{hf_name(name)}"] = p.grad
    check_positive_maxima(model, features)
    write(out, tensors, {
        **triples(), "query_texts": texts, "document_texts": QUERIES + POSITIVES + NEGATIVES,
        "loss": loss.item(), "pylate": pylate.__version__ if hasattr(pylate, "__version__") else "1.6",
        "torch": torch.__version__,
    })
    print("pylate loss", loss.item())


def check_positive_maxima(model, features):
    with torch.no_grad():
        emb = [torch.nn.functional.normalize(model(dict(f))["token_embeddings"], dim=-1) for f in features]
        q = emb[0]
        for d, f in zip(emb[1:], features[1:]):
            sims = torch.einsum("ash,bth->abst", q, d)
            mask = f["attention_mask"].bool()
            sims = sims.masked_fill(~mask[None, :, None, :], float("-inf"))
            assert sims.max(-1).values.min() > 0, "a MaxSim maximum is negative"


def st6_fixture():
    import sentence_transformers
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import (
        MultiVectorMultipleNegativesRankingLoss,
    )

    model = MultiVectorEncoder(str(OUT / "pylate"), device="cpu")
    out = OUT / "st6"
    shutil.rmtree(out, ignore_errors=True)
    model.save(str(out))
    (out / "README.md").unlink(missing_ok=True)
    model.eval()
    tensors = {}
    texts = QUERIES + POSITIVES
    q = model.encode_query(texts)
    d = model.encode_document(QUERIES + POSITIVES + NEGATIVES)
    for i, e in enumerate(q):
        tensors[f"query.{i}"] = torch.as_tensor(e)
    for i, e in enumerate(d):
        tensors[f"document.{i}"] = torch.as_tensor(e)
    # The trainer puts the prompts (PyLate's prefixes) before the texts.
    prompted = lambda texts, task: [model.prompts[task] + t for t in texts]
    features = [model.preprocess(prompted(QUERIES, "query"), task="query"),
                model.preprocess(prompted(POSITIVES, "document"), task="document"),
                model.preprocess(prompted(NEGATIVES, "document"), task="document")]
    for f, task in zip(features, ["query", "document", "document"]):
        f["task"] = task
    loss_fn = MultiVectorMultipleNegativesRankingLoss(model, scale=1.0)
    model.zero_grad()
    loss = loss_fn(features, None)
    loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            tensors[f"grad.{hf_name(name)}"] = p.grad
    write(out, tensors, {
        **triples(), "query_texts": texts, "document_texts": QUERIES + POSITIVES + NEGATIVES,
        "loss": loss.item(), "sentence_transformers": sentence_transformers.__version__,
        "torch": torch.__version__,
    })
    print("st6 loss", loss.item())


# Teacher scores of each query's (positive, negative, next query's positive): made up,
# in a cross-encoder's range, and not in the student's order everywhere.
TEACHER = [[11.5, 2.25, -3.0], [9.0, 9.5, 1.0], [4.0, -1.5, 0.5], [7.75, 6.0, 7.0]]


def distill_groups():
    """Each query's passages, in the order the loss sees them."""
    n = len(QUERIES)
    return [[POSITIVES[i], NEGATIVES[i], POSITIVES[(i + 1) % n]] for i in range(n)]


def distill_fixture():
    from pylate import losses, models

    out = OUT / "pylate"
    model = models.ColBERT(str(out), device="cpu")
    model.eval()
    documents = [d for group in distill_groups() for d in group]
    features = [
        model.tokenize(QUERIES, is_query=True),
        model.tokenize(documents, is_query=False),
    ]
    labels = torch.tensor(TEACHER, dtype=torch.float32)
    tensors, meta = {}, {"queries": QUERIES, "groups": distill_groups(), "teacher": TEACHER}
    for key, normalize in (("normalized", True), ("raw", False)):
        loss_fn = losses.Distillation(model=model, normalize_scores=normalize)
        model.zero_grad()
        loss = loss_fn(features, labels)
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                tensors[f"{key}.grad.{hf_name(name)}"] = p.grad.clone()
        meta[f"{key}_loss"] = loss.item()
        print("pylate distillation", key, loss.item())
    # Every maximum of a query against its own passages is positive (PyLate and
    # sentence-transformers agree there).
    with torch.no_grad():
        q = torch.nn.functional.normalize(model(dict(features[0]))["token_embeddings"], dim=-1)
        d = torch.nn.functional.normalize(model(dict(features[1]))["token_embeddings"], dim=-1)
        mask = features[1]["attention_mask"].bool()
        for i in range(len(QUERIES)):
            for j in range(3):
                k = i * 3 + j
                sims = (q[i] @ d[k].T).masked_fill(~mask[k][None, :], float("-inf"))
                assert sims.max(-1).values.min() > 0, "a MaxSim maximum is negative"
    save_file({k: v.detach().contiguous().float() for k, v in tensors.items()},
              str(out / "distillation.safetensors"))
    (out / "distillation.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    {"pylate": pylate_fixture, "st6": st6_fixture, "distill": distill_fixture}[sys.argv[1]]()
