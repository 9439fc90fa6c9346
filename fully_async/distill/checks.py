"""What is checked of a teacher before Ray starts (preflight), each refusal a ConfigError naming the key:

- `teacher_dir`: distill.teacher.path resolved as model.path is (a directory, a hub id in the cache, a .gguf or
  pkg:// file converted once), or a shipped model group's name (`smollm2`: config/model/smollm2.yaml's path).
- `compare_tokenizers(student, teacher)`: the teacher scores the student's token ids, so both must read ids alike:
  the same vocabulary (every token and its id, added tokens included) and the same special tokens (bos, eos, pad,
  unk and the additional ones, by token and id). The first differences are named.
- `probe_prompt_logprobs(url, model, ...)`: a teacher at distill.teacher.url must return prompt log-probs (vLLM's
  /completions `prompt_logprobs`); one two-token request finds out. The teacher's own servers (path) are of a kind
  that does (distill.teacher.kind, config/sections/distill.py).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fully_async.config import CONFIG_DIR, ConfigError
from fully_async.config.sections import TeacherConfig

KEY = "distill.teacher"
SHOWN = 5
"""Differences named in a tokenizer refusal."""


def packaged_path(value: str) -> str:
    """A shipped model group's model.path (config/model/<value>.yaml), else `value` itself."""
    group = Path(CONFIG_DIR) / "model" / f"{value}.yaml"
    if "/" in value or not group.is_file():
        return value
    import yaml

    return str((yaml.safe_load(group.read_text()) or {}).get("path") or value)


def teacher_dir(t: TeacherConfig, cache_dir: str | None = None) -> Path:
    """The teacher's model directory (module docstring); a ConfigError names distill.teacher.path."""
    from fully_async.models.hub import resolve_pretrained

    try:
        return resolve_pretrained(packaged_path(t.path), cache_dir)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.path", f"{KEY}.path")) from None


def _tokenizer(path: str | Path, key: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: no tokenizer can be loaded from {path} ({type(e).__name__}: {e})") from None


def special_tokens(tok: Any) -> dict[str, tuple[str, int]]:
    """Special tokens by role (bos, eos, pad, unk; `additional:<token>` for the rest) -> (token, id)."""
    out = {}
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tok, role, None)
        if token is not None:
            out[role] = (str(token), int(tok.convert_tokens_to_ids(str(token))))
    for token in getattr(tok, "all_special_tokens", []):
        if (str(token), int(tok.convert_tokens_to_ids(str(token)))) not in out.values():
            out[f"special:{token}"] = (str(token), int(tok.convert_tokens_to_ids(str(token))))
    return out


def compare_tokenizers(student: str | Path, teacher: str | Path, key: str = KEY) -> None:
    """Raise ConfigError naming `key` when the teacher's tokenizer reads ids differently from the student's."""
    s, t = _tokenizer(student, "model.path"), _tokenizer(teacher, key)
    sv, tv = s.get_vocab(), t.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:SHOWN]
        only_t = sorted(set(tv) - set(sv))[:SHOWN]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:SHOWN]
        raise ConfigError(
            f"{key}'s tokenizer ({teacher}) differs from the student's ({student}): vocabulary of {len(tv)} tokens "
            f"against {len(sv)}; only the student's: {only_s}; only the teacher's: {only_t}; other ids: {moved}. "
            "The teacher scores the student's token ids, so both need one tokenizer"
        )
    ss, ts = special_tokens(s), special_tokens(t)
    if ss != ts:
        diff = sorted(k for k in set(ss) | set(ts) if ss.get(k) != ts.get(k))[:SHOWN]
        shown = {k: (ss.get(k), ts.get(k)) for k in diff}
        raise ConfigError(
            f"{key}'s tokenizer ({teacher}) has other special tokens than the student's ({student}): "
            f"(student, teacher) {shown}"
        )


def api_headers(t: TeacherConfig) -> dict[str, str]:
    """The Authorization header for distill.teacher.url from the environment variable api_key_env names."""
    if not t.api_key_env:
        return {}
    value = os.environ.get(t.api_key_env)
    if not value:
        raise ConfigError(f"{KEY}.api_key_env names the environment variable {t.api_key_env!r}, which is not set")
    return {"Authorization": f"Bearer {value}"}


def probe_prompt_logprobs(t: TeacherConfig, timeout_s: float = 30.0) -> None:
    """One request of two tokens to distill.teacher.url; ConfigError unless it answers with their prompt log-probs."""
    from fully_async.distill.scorer import TeacherEndpoint, response_logprobs
    from fully_async.reward.judge import RemoteError

    endpoint = TeacherEndpoint("/completions", t.model)
    ids = [1, 2]
    url = t.url.rstrip("/") + endpoint.path
    request = urllib.request.Request(url, data=json.dumps(endpoint.body(ids)).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **api_headers(t)})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise ConfigError(f"{KEY}.url={t.url}: the teacher answered HTTP {e.code} to a prompt log-prob request "
                          f"({e.read()[:200]!r}); it must return prompt log-probs") from None  # fmt: skip
    except (OSError, ValueError) as e:
        raise ConfigError(f"{KEY}.url={t.url} cannot be reached ({type(e).__name__}: {e})") from None
    try:
        response_logprobs(endpoint.entries(body), ids, 1)
    except (KeyError, IndexError, TypeError, RemoteError) as e:
        raise ConfigError(
            f"{KEY}.url={t.url} cannot return prompt log-probs (its /completions answer holds none: "
            f"{type(e).__name__}: {e}); distillation needs a server that does (vLLM's prompt_logprobs)"
        ) from None


def check_teacher(cfg: Any, student_dir: Path) -> None:
    """Every check of the teacher before Ray starts (a no-op with distill off); distill.teacher.path becomes the
    resolved model directory."""
    t = cfg.distill.teacher
    if not cfg.distill.enable:
        return
    if t.url:
        if not t.tokenizer:
            raise ConfigError(f"{KEY}.tokenizer must name the teacher's tokenizer directory with {KEY}.url (it is "
                              "compared with the student's)")  # fmt: skip
        probe_prompt_logprobs(t)
        compare_tokenizers(student_dir, t.tokenizer)
        return
    resolved = teacher_dir(t, cfg.model.cache_dir)
    compare_tokenizers(student_dir, t.tokenizer or resolved)
    t.path = str(resolved)  # the actors get the directory itself: absolute, a GGUF converted once (here)
