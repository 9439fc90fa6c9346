"""The trained model out of a run, in Hugging Face format: `python -m fully_async.export RUN_DIR [--step N] --out DIR`.

Reads a checkpoint (`RUN_DIR/checkpoints/step_N/`, default the latest) whatever trainer world size wrote it: verl's
per-rank FSDP shards are joined into full tensors in this process (fully_async/training/hf_files.py; no Ray, no
ranks), then written as safetensors with the model's config.json, generation_config.json and tokenizer files, so
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it and `model.path=DIR` serves it. Needs memory for
the full model once (in float32 as FSDP keeps it). The policy only: a critic (`backend/critic/`) is not exported.

A model that ties its word embeddings is written without `lm_head.weight`, as `save_pretrained` writes it
(training/hf_files.without_tied_head). A LoRA run (model.lora.rank > 0) gives both: DIR holds the merged model (base + adapter, Hugging Face names) and
DIR/adapter/ the adapter alone in PEFT format (`peft.PeftModel.from_pretrained(base, DIR/adapter)`), its
adapter_config.json the one the run wrote into the checkpoint's `adapter/`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

STATE_FILE = "fully_async_backend.json"
"""The backend's marker in a checkpoint's `backend/` (step, world size, critic)."""


class ExportError(RuntimeError):
    """The run directory or the step asked for holds no usable checkpoint; the message says what is missing."""


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """`RUN_DIR/checkpoints/step_N` (the one `checkpoints/latest` names when `step` is None), checked complete."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} does not exist")
    if not root.is_dir():
        raise ExportError(f"{run_dir} is not a run directory with checkpoints (no {root.name}/ in it)")
    steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if p.name[5:].isdigit())
    if step is None:
        from fully_async.trainer import latest_checkpoint

        ckpt = latest_checkpoint(root)
        if ckpt is None:
            raise ExportError(f"{root} has no checkpoint (no 'latest'); steps there: {steps or 'none'}")
    else:
        ckpt = root / f"step_{step}"
        if not ckpt.is_dir():
            raise ExportError(f"no checkpoint for step {step} in {root}; steps there: {steps or 'none'}")
    if not (ckpt / "backend" / STATE_FILE).is_file():
        raise ExportError(f"{ckpt} is not a complete checkpoint (no backend/{STATE_FILE})")
    return ckpt


def _model_path(ckpt: Path) -> Path | None:
    """The run's model.path, where the tokenizer (and a vision-language model's processor) files come from: for a run
    of the tiny model (no model.path) its local build, made again from the run's settings when it is not cached (its
    tokenizer and processor do not depend on the init seed). None when the checkpoint does not say."""
    state = ckpt / "state.json"
    if not state.is_file():
        return None
    model = json.loads(state.read_text()).get("config", {}).get("model", {})
    if model.get("path"):
        return Path(model["path"]).expanduser()
    if "tiny" not in model:
        return None
    from fully_async.config import TinyModelConfig
    from fully_async.models import build_tiny_model

    return build_tiny_model(TinyModelConfig(**model["tiny"]), model.get("cache_dir"))


def _default_dtype(config_dirs: list[Path | None]) -> str:
    """The dtype the model's config.json names (float32 when none or another)."""
    from fully_async.training.hf_files import DTYPES

    for d in config_dirs:
        if d is not None and (d / "config.json").is_file():
            cfg = json.loads((d / "config.json").read_text())
            name = cfg.get("dtype") or cfg.get("torch_dtype")
            return name if name in DTYPES else "float32"
    return "float32"


def export_checkpoint(
    ckpt: str | Path, out: str | Path, dtype: str | None = None, progress: Callable[[str], None] | None = print
) -> list[Path]:
    """Write checkpoint `ckpt`'s policy into `out` as a Hugging Face model directory; returns the weight files."""
    from fully_async.training import hf_files, hf_names, lora

    ckpt, out = Path(ckpt), Path(out)
    backend = ckpt / "backend"
    sources = [backend / "huggingface", _model_path(ckpt)]
    dtype = dtype or _default_dtype(sources)
    state = json.loads((backend / STATE_FILE).read_text())
    if progress:
        progress(f"export: {ckpt} (step {state['step']}, {state['world_size']} ranks) -> {out} as {dtype}")
    tensors = hf_files.merged_model(backend, progress)
    named = tensors.items()
    if any(lora.is_adapter(name) for name in tensors):
        named = _export_adapter(ckpt, tensors, out / "adapter", dtype, progress)
    config_dir = next((d for d in sources if d is not None and (d / "config.json").is_file()), None)
    # A model that ties its word embeddings comes out as save_pretrained writes it, without lm_head.weight.
    named = hf_files.without_tied_head(named, config_dir is not None and hf_files.ties_embeddings(config_dir))
    named = hf_names.checkpoint_names(named, hf_names.model_type(sources))
    files = hf_files.write_safetensors(named, out, dtype, progress=progress)
    copied = hf_files.copy_model_files(sources, out)
    if "config.json" not in copied and not (out / "config.json").is_file():
        raise ExportError(f"no config.json for the model: neither {backend / 'huggingface'} nor model.path has one")
    if progress:
        progress(f"export: wrote {len(tensors)} tensors in {len(files)} files, and {', '.join(copied)}")
    return [out / f for f in files]


def _export_adapter(ckpt: Path, tensors: dict, out: Path, dtype: str, progress: Callable[[str], None] | None):
    """A LoRA checkpoint's adapter into `out` (PEFT format); returns the merged model's (name, tensor) pairs."""
    from fully_async.training import lora

    config_file = ckpt / "adapter" / lora.ADAPTER_CONFIG
    if not config_file.is_file():
        raise ExportError(f"{ckpt} holds a LoRA policy but no adapter/{lora.ADAPTER_CONFIG} (rank, alpha, modules)")
    config = json.loads(config_file.read_text())
    lora.write_adapter(lora.adapter_tensors(tensors.items()), config, out, dtype)
    if progress:
        progress(f"export: LoRA run: the adapter (rank {config['r']}) -> {out}, the merged model -> {out.parent}")
    return lora.merged_tensors(tensors.items(), lora.scaling(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fully_async.export", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run directory (hydra.run.dir of the run)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weight dtype (default: the model config's)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        ckpt = find_checkpoint(args.run_dir, args.step)
    except ExportError as e:
        print(f"fully_async.export: {e}", file=sys.stderr)
        return 2
    export_checkpoint(ckpt, args.out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
