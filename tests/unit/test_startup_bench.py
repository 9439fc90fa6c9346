"""scripts/bench/startup.py's reading of a vLLM server's launch from its log (the phases the issue-39 tables show), on
a log written here in the engine pool's and vLLM's formats."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "startup.py"


def _bench():
    spec = importlib.util.spec_from_file_location("startup_bench", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOG = """
=== 2026-11-27 17:10:56 launching: python -m vllm.entrypoints.openai.api_server --model M
/x/api_server.py:24: DeprecationWarning: deprecated
(APIServer pid=1) INFO 11-27 17:11:05 [api_utils.py:347] version 0.32.0
(APIServer pid=1) INFO 11-27 17:11:06 [model.py:733] Resolved architecture: Qwen2ForCausalLM
(EngineCore pid=2) INFO 11-27 17:11:15 [core.py:133] Initializing a V1 LLM engine (v0.32.0)
(VllmWorker-0 pid=3) INFO 11-27 17:11:25 [worker_base.py:317] Injected the extension
(Worker pid=3) INFO 11-27 17:11:25 [cpu_model_runner.py:68] Starting to load model M...
(EngineCore pid=2) INFO 11-27 17:11:27 [core.py:402] init engine (profile, create kv cache, warmup model) took 0.68 s
(APIServer pid=1) INFO 11-27 17:11:28 [entry.py:140] Starting vLLM server on http://127.0.0.1:5
(APIServer pid=1) INFO 11-27 17:11:29 [entry.py:140] Starting vLLM server on http://127.0.0.1:5

=== 2026-11-27 17:20:00 launching: python -m vllm.entrypoints.openai.api_server --model M
(APIServer pid=9) INFO 11-27 17:20:01 [api_utils.py:347] version 0.32.0
"""


def test_the_first_launchs_phases_from_the_command_and_from_the_launch(tmp_path):
    log = tmp_path / "vllm-0.log"
    log.write_text(LOG)
    command = datetime.datetime(2026, 11, 27, 17, 10, 44).timestamp()
    phases = _bench().engine_phases(log, command)
    # the restart at 17:20 is not the start-up's: only the first launch's lines count
    assert phases == {"launch_at": 12.0, "api_import": 9.0, "engine_core": 19.0, "worker": 29.0, "model_kv": 31.0,
                      "http_up": 32.0}  # fmt: skip


def test_a_run_without_an_engine_log_has_no_phases(tmp_path):
    assert _bench().engine_phases(tmp_path / "missing.log", 0.0) == {}
