"""The adapter transport: with LoRA on (model.lora.rank > 0), each version moves only the adapter, megabytes instead
of the model, and is served beside the unchanged base model under a versioned name.

Per version N (engines/adapters.py holds the engines' side):
1. export (the trainer's thread): the backend writes a PEFT adapter into ROOT/vN (`export_adapter`, which returns
   fa_digest over the tensors it wrote); the file is read back and must digest the same;
2. distribute: servers on other nodes get a node-local copy (the disk transport's copy machinery, disk.py);
3. load: every serving server loads the directory as `policy-vN` (the control plane's pool-wide fan-out: a server
   that stops answering is set aside, any other failure fails the sync naming the server);
4. verify: every server's worker reports the digest of the adapter it holds under that name (fa_lora.py), which must
   equal the trainer's, taken in vLLM's layout (lora_B scaled by alpha / r, as vLLM folds it);
5. activate: new requests name `policy-vN`; only now do the pool's version and the rollouter's ledger move;
6. unload: names older than the newest max_staleness + 2 that no request uses any more (their directories go too).

No pause, decided because nothing needs it: loading a name leaves requests on the other names alone, so the engines
keep generating through the whole sync, and a pause would only cost every request in flight an abort and a
continuation per sync. A request in flight finishes on the adapter it named, and the client labels its tokens with
that adapter's version (not the servers' version spans, which would call old-adapter tokens new and hide their
staleness). Staleness is what it is with a pause and partial rollout (a sample's oldest token decides it, and that
token is the same either way); with partial_rollout=false a request in flight is not restarted under the new version
but is still one version throughout, which is what that setting guarantees. A continuation after an abort for another
reason names the newest adapter, so each segment keeps its own version. So the transport's plan says `pause=False`
and ParamSync skips its pause and resume.

`lora_serving` decides, once, at start, whether a run syncs adapters or falls back to merged full weights through
async_training.weight_transport (the backend's export_weights / weight_sender give base + adapter merged).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fully_async.handles import resolve
from fully_async.weights.base import Phase, SyncPlan, WeightTransport
from fully_async.weights.disk import DiskTransport, prune
from fully_async.weights.port import EnginePort
from fully_async.weights.verify import SyncVerifier

ADAPTER_FILE = "adapter_model.safetensors"

PREFIX = "policy-v"


def adapter_name(version: int) -> str | None:
    """The adapter name of policy version `version`; None for version 0 (the base model)."""
    return f"{PREFIX}{version}" if version > 0 else None


@dataclass(frozen=True)
class LoraServing:
    """How servers are started to serve versioned adapters (`adapter_sync_plan` decides; engines/adapters.py)."""

    max_loras: int
    """Adapters in one batch at once, and the names kept loaded: async_training.max_staleness + 2."""
    max_rank: int
    """--max-lora-rank: the smallest rank the engine allows that is >= model.lora.rank."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """model.lora.target_modules (SGLang's --lora-target-modules)."""

    @property
    def max_cpu_loras(self) -> int:
        """Adapters the engine keeps in its CPU cache: two above `max_loras`, so that a name kept past `max_loras`
        because a request still uses it does not evict one that is kept anyway."""
        return self.max_loras + 2


def adapter_sync_plan(cfg: Any, device: str) -> tuple[LoraServing | None, str]:
    """(how the servers serve adapters, or None when versions go as merged full weights; why, "" when LoRA is off
    or adapters serve). `device`: the engines' (cuda | cpu). model.lora.sync=adapter where adapters cannot serve:
    ConfigError with the reason."""
    from fully_async.config import ConfigError
    from fully_async.config.sections.model import VLLM_LORA_RANKS

    lora = cfg.model.lora
    if not lora.enabled:
        return None, ""
    kind = cfg.engine.kind
    why = ""
    if lora.sync == "merged":
        why = "model.lora.sync=merged"
    elif lora.rank > VLLM_LORA_RANKS[-1]:
        why = f"model.lora.rank={lora.rank} is above the largest rank an engine serves ({VLLM_LORA_RANKS[-1]})"
    elif kind == "sim":
        why = "engine=sim emulates full-weight syncs only"
    elif kind == "sglang" and device != "cuda":
        why = "SGLang's CPU engine crashes with LoRA at start-up"
    if why and lora.sync == "adapter":
        raise ConfigError(f"model.lora.sync=adapter cannot work here: {why}; use model.lora.sync=auto or merged")
    if why:
        return None, why
    rank = next(r for r in VLLM_LORA_RANKS if r >= lora.rank)
    keep = cfg.async_training.max_staleness + 2
    return LoraServing(max_loras=keep, max_rank=rank, target_modules=tuple(lora.target_modules)), ""


def engine_digest(adapter_dir: Path, dtype: str) -> tuple[str, str]:
    """(fa_digest of the adapter file's tensors as written; the digest an engine reports for it once loaded: the
    tensors in the engine's `dtype`, lora_B scaled as vLLM folds it; fa_lora.py)."""
    import torch
    from safetensors.torch import load_file

    from fully_async.vllm_ext.fa_digest import digest
    from fully_async.vllm_ext.fa_lora import folded, scaling

    tensors = load_file(str(adapter_dir / ADAPTER_FILE))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    as_served = ((k, v.to(getattr(torch, dtype))) for k, v in tensors.items())
    return digest(tensors.items()), digest(folded(as_served, scaling(config)))


class LoraTransport(WeightTransport):
    """Versions as PEFT adapters loaded under versioned names (see the module docstring)."""

    name = "adapter"

    def __init__(
        self, rollouter: Any, backend: Any, root: str | Path, dtype: str, device: str = "cpu", verify: bool = True
    ) -> None:
        """`verify`: async_training.verify_sync (the verify phase; off: adapters are loaded and activated unproven)."""
        from fully_async.device import resolve_dtype

        self.engines, self.backend = EnginePort(rollouter), backend
        self.dtype = resolve_dtype(dtype, device)
        self.disk = DiskTransport(rollouter, backend, root, self.dtype)
        """Its node-local copies (distribute) and its root's clean-up serve the adapters as they serve weights."""
        self.root = self.disk.root
        self.expected: dict[int, str] = {}
        """version -> the digest every server must report for its adapter."""
        self.verifier = SyncVerifier(rollouter, verify)
        """The verify phase (weights/verify.py): every server's digest of the adapter against `expected`."""
        self.bytes: dict[int, int] = {}
        """version -> bytes of its adapter directory (what one sync moves per node)."""

    def prepare(self, rollouter: Any) -> None:
        """Nothing to set up: the servers were started to serve adapters (engines/adapters.py)."""

    def plan(self, version: int, background: bool) -> SyncPlan:
        """The export reads the backend; the rest reads only ROOT/vN and needs no pause (new names load beside the
        served ones). The same plan in both modes."""
        name = adapter_name(version)
        out = self.root / f"v{version}"
        if name is None:
            raise ValueError("version 0 is the base model: there is no adapter to sync")

        def load() -> None:
            resolve(self.engines.load_adapter(name, str(out), self.disk.node_dirs or None))

        def verify() -> dict[str, str]:
            if not self.verifier.active():  # engines that report no digest (said once)
                return {}
            return self.verifier(self.expected[version], "fa_adapter_digest", f"adapter {name}", {"name": name})

        engines: tuple[Phase, ...] = (
            ("distribute", lambda: self.disk.distribute(version)),
            ("load", load),
            ("verify", verify),
            ("activate", lambda: resolve(self.engines.activate_adapter(name, version))),
            ("unload", self.unload),
        )
        return SyncPlan(reads=(("export", lambda: self.export(version)),), engines=engines, pause=False)

    def export(self, version: int) -> Path:
        """Write version `version`'s adapter into ROOT/v<version> and check the file against the trainer's digest.
        Also what a resumed run's engines start from (the base model, then this adapter)."""
        out = self.root / f"v{version}"
        if out.exists():  # a retried sync: the new bytes win
            shutil.rmtree(out)
        reported = self.backend.export_adapter(out, dtype="float32")
        written, served = engine_digest(out, self.dtype)
        if written != reported:
            raise RuntimeError(f"the adapter in {out} digests {written}, the trainer exported {reported}")
        self.expected[version] = served
        self.bytes[version] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        return out

    def unload(self) -> dict[str, list[str]]:
        """Unload old names (engines/adapters.py's rule) and remove the directories of names no longer loaded."""
        result = resolve(self.engines.unload_adapters())
        kept = {f"v{name.rsplit('-v', 1)[1]}" for name in result["loaded"]}
        prune(self.root, keep=kept)
        return result

    def close(self, remove: bool = True) -> None:
        self.disk.close(remove)
