"""Vision-language weight sync benchmark (issue 37): bytes and seconds of one sync's export with the vision tower
frozen (model.freeze_vision_tower=true, the default) and training (false), next to the text-only model of the same
language size, side by side in one run.

For each of the three models a real verl backend (one CPU rank, training/verl_backend.py) is built, takes one update
step on image (or text) prompts, then exports what a weight sync sends (`export_weights(sync=True)`: the disk
transport's payload; the collective transport sends the same tensors) `--rounds` times. Bytes: the safetensors
written per version, and the tensors of the tower among them (from the names). Seconds: the median export.

    .venv/bin/python scripts/bench/vlm_sync.py                       # the tiny models, 3 rounds
    .venv/bin/python scripts/bench/vlm_sync.py --hidden-size 256 --layers 4

Prints a markdown table. Importing this module starts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CASES = (
    ("vlm, tower frozen", "qwen2_vl", True),
    ("vlm, tower trained", "qwen2_vl", False),
    ("text only", "qwen2", True),
)


def _groups(model: Path, vision: bool):
    """Two groups of two one-token trajectories on colors prompts (with images) or their text (without)."""
    import numpy as np
    from transformers import AutoTokenizer

    from fully_async.data import synthetic_rows
    from fully_async.multimodal.processor import VisionProcessor
    from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup

    tok = AutoTokenizer.from_pretrained(model)
    groups = []
    for i, row in enumerate(synthetic_rows(2, 0, task="colors")):
        text = row.messages[-1]["content"]
        if vision:
            proc = VisionProcessor(model)
            ids = proc.expand(tok.encode(proc.prompt_text(text)), row.images)
        else:
            ids = tok.encode(text.replace("<image>", ""))
        ref = PromptRef(0, i)
        trajs = [
            Trajectory(
                prompt=ref,
                sample_index=s,
                prompt_ids=np.asarray(ids, dtype=np.int64),
                response_ids=np.asarray([65 + s], dtype=np.int64),
                behaviour_logprobs=np.asarray([-1.0], np.float32),
                token_versions=np.zeros(1, dtype=np.int64),
                reward=float(s),
                images=list(row.images) if vision else [],
            )  # fmt: skip
            for s in range(2)
        ]
        groups.append(TrajectoryGroup(ref, trajs))
    return groups


def one_case(arch: str, freeze: bool, args, tmp: Path) -> dict[str, float]:
    from safetensors import safe_open

    from fully_async.config import AlgorithmConfig, TinyModelConfig, TrainerConfig
    from fully_async.models import build_tiny_model
    from fully_async.training import build_backend
    from fully_async.training.vision_tower import is_tower

    tiny = TinyModelConfig(arch=arch, hidden_size=args.hidden_size, num_layers=args.layers)
    model = build_tiny_model(tiny, tmp / "models")
    backend = build_backend(TrainerConfig(max_token_len_per_gpu=512), AlgorithmConfig(), model, device="cpu",
                            freeze_vision_tower=freeze)  # fmt: skip
    try:
        backend.update(_groups(model, arch == "qwen2_vl"))
        seconds, out = [], None
        for r in range(args.rounds):
            out = tmp / f"{arch}-{freeze}-v{r}"
            t0 = time.perf_counter()
            files = backend.export_weights(out, sync=True)
            seconds.append(time.perf_counter() - t0)
        total = sum(f.stat().st_size for f in files)
        tower = tensors = 0
        for f in files:
            with safe_open(str(f), "pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensors += 1
                    if is_tower(name):
                        tower += _nbytes(st, name)
        return {"bytes": total, "tower_bytes": tower, "tensors": tensors, "export_s": statistics.median(seconds)}
    finally:
        backend.shutdown()


def _nbytes(st, name: str) -> int:
    t = st.get_tensor(name)
    return t.numel() * t.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import ray

    ray.init(num_cpus=8, include_dashboard=False, configure_logging=False, _node_ip_address="127.0.0.1")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fa-vlm-sync-") as d:
        for label, arch, freeze in CASES:
            rows[label] = one_case(arch, freeze, args, Path(d))
    ray.shutdown()
    base = rows["vlm, tower trained"]
    print(f"\nhidden_size={args.hidden_size} layers={args.layers}, median of {args.rounds} exports per model\n")
    print("| model | bytes per sync | tower bytes sent | tensors | export s | bytes vs tower trained |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['bytes']:,} | {r['tower_bytes']:,} | {r['tensors']} | {r['export_s']:.3f} | "
              f"{r['bytes'] / base['bytes']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
