"""What the trainer's top-k / nucleus truncation (verl patch 0007) adds to a log-prob pass, side by side in one run.

    .venv/bin/python scripts/bench/truncated_logprobs.py            # the tiny model's vocabulary and a 152 K one

For each shape (tokens, vocabulary) the same logits go through verl's log-probs (forward and backward), plain and
after verl.utils.torch_functional.truncate_to_sampling_support at top_p 0.8, top_k 20 and both; the passes are
interleaved over --repeats rounds so a drift of the machine's load hits every variant alike. Prints the median
seconds of each and its ratio to the plain pass, in Markdown. The model's own forward (which the ratio leaves out)
makes the share of a whole update smaller still.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _pass(logits: torch.Tensor, labels: torch.Tensor, top_k: int, top_p: float) -> float:
    from verl.utils.torch_functional import logprobs_from_logits, truncate_to_sampling_support

    x = logits.detach().requires_grad_(True)
    start = time.perf_counter()
    lp = logprobs_from_logits(truncate_to_sampling_support(x, top_k, top_p, keep=labels), labels)
    lp.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    variants = {"plain": (-1, 1.0), "top_p 0.8": (-1, 0.8), "top_k 20": (20, 1.0), "top_k 20 + top_p 0.8": (20, 0.8)}
    print("| tokens x vocabulary | variant | median s | ratio to plain |\n|---|---|---|---|")
    for tokens, vocab in [(2048, 259), (256, 151_936)]:
        logits = torch.randn(tokens, vocab) * 3
        labels = torch.randint(0, vocab, (tokens,))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (k, p) in variants.items():
                times[name].append(_pass(logits, labels, k, p))
        plain = statistics.median(times["plain"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {tokens} x {vocab} | {name} | {med:.4f} | {med / plain:.2f} |")


if __name__ == "__main__":
    main()
