#!/usr/bin/env python3
"""Compares the loss curves and evaluations of two runs' metrics.jsonl files.

    scripts/compare-losses.py runs/one/metrics.jsonl runs/two/metrics.jsonl

Prints the number of steps, the largest relative and absolute loss difference (and the
step where the relative one occurs), and the recall@1 / MRR@10 of every evaluation of both
runs. Used for the 2-rank against 1-rank comparison in docs/distributed.md.
"""
import json
import sys


def read(path):
    steps, evals = [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "step":
                steps.append(rec["loss"])
            elif rec.get("type") == "eval":
                evals.append((rec["step"], rec["metrics"]))
    return steps, evals


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    (a, ea), (b, eb) = read(sys.argv[1]), read(sys.argv[2])
    if len(a) != len(b) or not a:
        sys.exit(f"different or empty curves: {len(a)} and {len(b)} steps")
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    print(f"steps={len(a)} max_rel_diff={rel[worst]:.2e} (step {worst + 1}) "
          f"max_abs_diff={max(abs(x - y) for x, y in zip(a, b)):.2e}")
    for (step, m1), (_, m2) in zip(ea, eb):
        print(f"eval step {step}: recall@1 {m1['recall_at_1']:.4f} vs {m2['recall_at_1']:.4f}, "
              f"mrr@10 {m1['mrr_at_10']:.4f} vs {m2['mrr_at_10']:.4f}")


if __name__ == "__main__":
    main()
