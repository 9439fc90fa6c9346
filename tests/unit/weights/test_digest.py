"""The sync checksum (vllm_ext/fa_digest.py): same set -> same digest in any order; a tensor missing, from
another version, reshaped or in another dtype -> another digest."""

import torch

from fully_async.vllm_ext.fa_digest import SAMPLES, Digest, digest


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 48, generator=g), "b.bias": torch.randn(7, generator=g)}


def test_the_same_tensors_in_any_order_give_one_digest():
    w = _weights()
    assert digest(w.items()) == digest(reversed(list(w.items())))
    assert digest(w.items()) == Digest().update((k, v.clone()) for k, v in w.items()).hexdigest()


def test_a_missing_changed_reshaped_or_recast_tensor_changes_the_digest():
    w = _weights()
    base = digest(w.items())
    assert digest(list(w.items())[:1]) != base
    assert digest(_weights(seed=1).items()) != base
    assert digest({**w, "a.weight": w["a.weight"].reshape(48, 64)}.items()) != base
    assert digest({**w, "a.weight": w["a.weight"].to(torch.bfloat16)}.items()) != base
    same_bytes = w["a.weight"].view(torch.int32)  # equal bytes, another dtype
    assert digest({**w, "a.weight": same_bytes}.items()) != base
    assert digest({"renamed": w["a.weight"], "b.bias": w["b.bias"]}.items()) != base


def test_a_large_tensor_is_sampled_and_samples_zero_hashes_every_element():
    big = torch.zeros(SAMPLES * 10)
    changed = big.clone()
    changed[0] = 1.0  # the first element is always a sample
    assert digest([("x", big)]) != digest([("x", changed)])
    between = big.clone()
    between[5] = 1.0  # between two samples: only the full hash sees it
    assert digest([("x", big)]) == digest([("x", between)])
    assert digest([("x", big)], samples=0) != digest([("x", between)], samples=0)


def test_a_directory_of_safetensors_digests_as_its_tensors_loaded_in_memory(tmp_path):
    """The disk transport's trainer side (a memory-mapped, sampled read) equals what an engine computes over the
    tensors its loader reads, whatever the dtypes, across files; another directory's differs."""
    from safetensors.torch import load_file, save_file

    from fully_async.vllm_ext.fa_digest import directory_digest

    w = _weights()
    save_file({"a.weight": w["a.weight"], "e": torch.zeros(0), "i": torch.arange(5)}, str(tmp_path / "m-1.safetensors"))
    save_file(
        {"b.bias": w["b.bias"].to(torch.bfloat16), "big": torch.randn(SAMPLES * 3)}, str(tmp_path / "m-2.safetensors")
    )
    (tmp_path / "config.json").write_text("{}")  # not a tensor file: ignored
    loaded = {**load_file(str(tmp_path / "m-1.safetensors")), **load_file(str(tmp_path / "m-2.safetensors"))}
    assert directory_digest(str(tmp_path)) == (digest(loaded.items()), 5)
    other = tmp_path / "other"
    other.mkdir()
    save_file({**w, "b.bias": w["b.bias"] + 1}, str(other / "model.safetensors"))
    assert directory_digest(str(other))[0] != digest(loaded.items())


def test_the_export_records_the_digest_of_what_it_wrote_and_the_disk_side_takes_it_from_the_index(tmp_path):
    """training/hf_files.write_safetensors (the verl backend's export) records the digest of the tensors as written
    (cast, across shards), which equals a read of the files; the disk transport's side takes it from the index
    without reading, and falls back to reading the files when no index records one."""
    import json

    from fully_async.training.hf_files import DIGEST_KEY, INDEX, write_safetensors
    from fully_async.vllm_ext.fa_digest import directory_digest
    from fully_async.weights.disk import files_digest

    w = {**_weights(), "c.weight": torch.randn(300, 20)}
    files = write_safetensors(w.items(), tmp_path, "bfloat16", bucket_bytes=4096)
    assert len(files) > 1
    index = json.loads((tmp_path / INDEX).read_text())
    recorded = index["metadata"][DIGEST_KEY]
    assert recorded == directory_digest(str(tmp_path))[0] == digest((k, v.bfloat16()) for k, v in w.items())
    assert files_digest(tmp_path) == recorded
    index["metadata"][DIGEST_KEY] = "0" * 32  # what the index says is what the disk side compares (nothing read)
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert files_digest(tmp_path) == "0" * 32
    (tmp_path / INDEX).unlink()
    assert files_digest(tmp_path) == recorded


def test_a_tensor_past_two_to_the_24_elements_digests_and_its_last_element_is_sampled():
    """Issue 48: SmolLM2's embedding (49,152 x 576 = 28,311,552 elements) failed the sync's digest with an IndexError:
    the sample positions were computed in float32, where n - 1 rounds up to n past 2**24. The positions are exact
    integers: the first and the last element are always among the samples, whatever the size."""
    n = 49_152 * 576
    big = torch.zeros(n, dtype=torch.uint8)
    base = digest([("model.embed_tokens.weight", big)])
    last = big.clone()
    last[-1] = 1
    assert digest([("model.embed_tokens.weight", last)]) != base
