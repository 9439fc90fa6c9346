"""One training rank: verl's `TrainingWorker` plus what our driver needs from every rank.

On CPU the process group is created here, over gloo, before `TrainingWorker.__init__`: verl would otherwise ask for
"cpu:gloo,cpu:<nccl backend>" (see patches/). Weight export drains the engine's per-tensor iterator, which all-gathers
each parameter, so it must run on every rank at once (ONE_TO_ALL); rank 0 alone writes the files.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import TrainingWorker

from fully_async.training import hf_files, hf_names, lora, vision_tower


def _init_gloo(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend="gloo",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        timeout=timedelta(seconds=timeout_s),
    )


def _value_models_with_eager_attention() -> None:
    """verl's `load_valuehead_model` (which its FSDP engine imports at each model build) asks transformers for
    flash_attention_2 whatever the config says; on CPU there is none. In this process, load the value model (a token
    classifier with one output, as verl's first choice) with eager attention instead, like the policy on CPU. The new
    score head is drawn from a fixed seed, so every rank, world size and run starts from the same critic."""
    import verl.utils.model as verl_model
    from transformers import AutoModelForTokenClassification

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForTokenClassification.from_pretrained(
                pretrained_model_name_or_path=local_path,
                torch_dtype=torch_dtype,
                config=model_config,
                attn_implementation="eager",
                trust_remote_code=trust_remote_code,
            )

    verl_model.load_valuehead_model = load_valuehead_model


def _lora_dropout(p: float) -> None:
    """verl builds its PEFT LoraConfig without a dropout; in this process, build it with `p`."""
    import verl.workers.engine.fsdp.transformer_impl as impl
    from peft import LoraConfig

    impl.LoraConfig = partial(LoraConfig, lora_dropout=p)


def _trainable_optimizer(engine, module):
    """verl's optimizer over the parameters that train (with LoRA, the adapter's only; with a frozen vision tower,
    all but the tower's), not every parameter: the frozen ones then appear in neither the optimizer's groups nor its
    state, so checkpoints carry only the moments of what trains."""
    from verl.workers.config.optimizer import build_optimizer

    return build_optimizer([p for p in module.parameters() if p.requires_grad], engine.optimizer_config)


def _freezing_tower(build):
    """verl's module build followed by `vision_tower.freeze`: before LoRA, FSDP and the optimizer see the module."""

    def build_module():
        module = build()
        vision_tower.freeze(module)
        return module

    return build_module


class FullyAsyncTrainingWorker(TrainingWorker):
    """`TrainingWorker` that can run on CPU (gloo), export weights as safetensors and, with LoRA, its adapter."""

    def __init__(
        self,
        config,
        cpu: bool = False,
        cpu_threads: int = 0,
        dist_timeout_s: float = 600.0,
        cpu_set: list[int] | None = None,
        lora_dropout: float = 0.0,
        freeze_vision_tower: bool = False,
    ):
        """`freeze_vision_tower`: a vision-language model's tower gets no gradient, no optimizer state, and is left out
        of every weight sync (training/vision_tower.py); nothing changes for a text model."""
        if lora_dropout:
            _lora_dropout(lora_dropout)
        if cpu:
            if cpu_set and hasattr(os, "sched_setaffinity"):
                # Cores of their own: OpenMP threads sharing a core with the engine's spin at every barrier.
                os.sched_setaffinity(0, cpu_set)
            # Ray starts actors with OMP_NUM_THREADS=1; by default CPU ranks on one host share its cores instead.
            local = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(cpu_threads or max(1, cores // max(1, local)))
            _init_gloo(dist_timeout_s)
            if config.model_type == "value_model":
                _value_models_with_eager_attention()
        super().__init__(config)
        self.tower_frozen = freeze_vision_tower
        if freeze_vision_tower:
            self.engine._build_module = _freezing_tower(self.engine._build_module)
        if (config.model_config.lora_rank > 0 or freeze_vision_tower) and config.optimizer_config is not None:
            self.engine._build_optimizer = partial(_trainable_optimizer, self.engine)

    def where(self) -> dict:
        """Node id, pid and visible devices of this rank (for the job's placement record)."""
        import ray

        return {"rank": int(os.environ.get("RANK", "0")), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip

    # ---- the policy's tensors out: full weights (merged with the adapter under LoRA) and the adapter alone ------
    def _peft_model(self):
        """The PEFT model the engine wrapped (LoRA on), else None."""
        module = self.engine.module
        module = getattr(module, "_fsdp_wrapped_module", module)
        return module if hasattr(module, "peft_config") else None

    def _full_tensors(self, keep=None):
        """(module name, full tensor) of the module's state dict, gathered one tensor at a time (a collective: every
        rank drains it in the same order); `keep(name)` picks the names (all when None)."""
        from torch.distributed.tensor import DTensor

        for name, value in self.engine.module.state_dict().items():
            if keep is None or keep(name):
                yield name, value.full_tensor() if isinstance(value, DTensor) else value.detach()

    def _policy_tensors(self, sync: bool = False):
        """(Hugging Face name, full tensor) of the policy as an engine serves it: with LoRA the merged model
        (fully_async/training/lora.py; verl's own iterator would give the base without the adapter here), else
        verl's per-tensor iterator; a model that ties its word embeddings without `lm_head.weight`
        (hf_files.without_tied_head: every sync, export and resume takes its tensors from here). `sync`: what a
        weight sync sends, the frozen vision tower left out."""
        peft = self._peft_model()
        if peft is None:
            tensors = self.engine.get_per_tensor_param()[0]
        else:
            config = lora.adapter_config(peft.peft_config["default"])
            tensors = lora.merged_tensors(self._full_tensors(), lora.scaling(config))
        tensors = hf_files.without_tied_head(tensors, hf_files.ties_embeddings(self.config.model_config.hf_config))
        return vision_tower.without_tower(tensors) if sync and self.tower_frozen else tensors

    def _sync_tensors(self):
        return self._policy_tensors(sync=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_adapter(self, out_dir: str, dtype: str = "float32", base_model: str | None = None) -> str | None:
        """Write the LoRA adapter as a PEFT adapter directory; returns fa_digest's digest of the tensors written on
        rank 0, None on the other ranks."""
        peft = self._peft_model()
        if peft is None:
            raise RuntimeError("export_adapter: this policy has no LoRA adapter (model.lora.rank=0)")
        tensors = lora.adapter_tensors(self._full_tensors(lora.is_adapter))
        if not self._rank0():
            for _ in tensors:
                pass
            return None
        config = lora.adapter_config(peft.peft_config["default"], base_model)
        return lora.write_adapter(tensors, config, out_dir, dtype)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_weights(
        self,
        out_dir: str,
        dtype: str = "float32",
        bucket_bytes: int = 512 << 20,
        sync: bool = False,
        checkpoint_of: str | None = None,
    ) -> list[str] | None:
        """Write the full (unsharded) weights, merged with the LoRA adapter when there is one, as Hugging Face
        safetensors shards of about `bucket_bytes` each, with a `model.safetensors.index.json`. Floating tensors are
        cast to `dtype`. `sync`: a weight sync's export (a frozen vision tower left out). `checkpoint_of`: a model
        type whose checkpoint names the files get (training/hf_names.py; the HF export), else the module's names.
        Returns the file names on rank 0, None on the other ranks."""
        params = hf_names.checkpoint_names(self._policy_tensors(sync), checkpoint_of)
        if not self._rank0():  # every rank drains the generator: each step is a collective
            for _ in params:
                pass
            return None
        return hf_files.write_safetensors(params, out_dir, dtype, bucket_bytes)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stage_export(self, out_dir: str, dtype: str = "float32", bucket_bytes: int = 512 << 20) -> bool | None:
        """A weight sync's `export_weights` in two halves: copy the weights a sync sends into host memory now (every
        rank gathers; rank 0 keeps the copy) and write them from that copy in a thread of this process, while the
        next update already changes the parameters. `out_dir` appears complete or not at all (hf_files.write_staged). True on rank 0,
        None on the other ranks."""
        params = [(name, t.detach().to("cpu", copy=True)) for name, t in self._sync_tensors()]
        if not self._rank0():
            return None
        writer = threading.Thread(target=hf_files.write_staged, args=(params, out_dir, dtype, bucket_bytes),
                                  name="fa-staged-export", daemon=True)  # fmt: skip
        writer.start()
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint_resharded(self, local_path: str) -> None:
        """Load a checkpoint written at another world size: every rank reads all the old ranks' shards, joins them to
        full tensors (fully_async/training/hf_files.py) and keeps its own new shard of the model and the optimizer
        moments (torch.distributed.checkpoint's full-state-dict setters); LR schedule from rank 0's file, RNG from this
        rank's (rank 0's for a rank the old run did not have)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        engine = self.engine
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(engine.module, hf_files.merged_model(local_path), options=full)
        if engine.optimizer is not None:
            raw = hf_files.merged_optimizer(local_path)
            # torch keys the saved state by parameter index, in the order of the parameters it was built over (all of
            # module.parameters(); with LoRA or a frozen tower those that train, _trainable_optimizer); the setter wants
            # names.
            every = self._peft_model() is None and not self.tower_frozen
            names = [name for name, p in engine.module.named_parameters() if every or p.requires_grad]
            osd = {
                "state": {names[i]: entry for i, entry in raw["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in raw["param_groups"]],
            }
            set_optimizer_state_dict(engine.module, engine.optimizer, osd, options=full)
        extra = hf_files.extra_state(local_path, dist.get_rank() if dist.is_initialized() else 0)
        if extra.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if "rng" in extra:
            engine.checkpoint_manager.load_rng_state(extra["rng"])
        if dist.is_initialized():
            dist.barrier()

    # ---- the collective weight transport's sending side (fully_async/weights/collective.py) -------------------
    # Every rank drains the per-tensor iterator (each step all-gathers one parameter); rank 0 alone is in the
    # weight group and broadcasts. Methods that touch only the group are no-ops on the other ranks.
    def _sender(self):
        from fully_async.weights.collective_sender import CollectiveSender

        if getattr(self, "_weight_sender", None) is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._weight_sender = CollectiveSender(self._policy_tensors, device, tower_frozen=self.tower_frozen)
        return self._weight_sender

    @staticmethod
    def _rank0() -> bool:
        return dist.get_rank() == 0 if dist.is_initialized() else True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_plan(self) -> list | None:
        """Names and shapes in send order on rank 0 (a full pass of the iterator on every rank), None elsewhere."""
        plan = self._sender().plan()
        return plan if self._rank0() else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_listen(self, loopback: bool, timeout_s: float) -> tuple[str, int] | None:
        return self._sender().listen(loopback, timeout_s) if self._rank0() else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_form(self, group: str, world: int, backend: str, timeout_s: float) -> None:
        if self._rank0():
            self._sender().form(group, world, backend, timeout_s)

    def _packing(self, method: str, buckets_json: str, dtype: str, *args: str) -> dict | None:
        """The sender's `method` (send | stage) on rank 0; the other ranks take part in the gathers its iterator
        needs."""
        if not self._rank0():
            for _ in self._sync_tensors():
                pass
            return None
        return getattr(self._sender(), method)(json.loads(buckets_json), dtype, *args)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_send(self, buckets_json: str, dtype: str) -> dict | None:
        return self._packing("send", buckets_json, dtype)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_stage(self, buckets_json: str, dtype: str, staging: str = "device") -> dict | None:
        """Background syncs: rank 0 copies the weights into its staging buffers and starts their broadcast."""
        return self._packing("stage", buckets_json, dtype, staging)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_send_staged(self) -> None:
        """Rank 0 broadcasts its staged copy again, into the group re-formed since (a server restarted)."""
        if self._rank0():
            self._sender().send_staged()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_close(self) -> None:
        if getattr(self, "_weight_sender", None) is not None:
            self._weight_sender.close()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_info(self) -> dict:
        """Rank, world size, process-group backend, FSDP2 units and LR-schedule position, for checks and messages."""
        from torch.distributed.fsdp import FSDPModule

        module = getattr(self.engine, "module", None)
        return {
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in module.modules()) if module is not None else 0,
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "backend": str(dist.get_backend()),
            "pid": os.getpid(),
            "lr_scheduler_steps": getattr(getattr(self.engine, "lr_scheduler", None), "last_epoch", None),
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        }
