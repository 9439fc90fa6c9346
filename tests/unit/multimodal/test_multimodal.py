"""The multimodal layers without an engine (docs/vlm.md): images as PNG bytes, verl's `images` rows, task=colors, the
tiny Qwen2-VL and its processor, the Trajectory encoding, the training batch's pixel inputs and mrope positions, the
vLLM request and command. The real engine and trainer: tests/integration/test_vlm_engine_trainer.py."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.data import DataError, load_rows, synthetic_rows
from fully_async.multimodal.colors import COLORS, SIZE
from fully_async.multimodal.images import ImageError, data_url, open_png, to_png
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup, decode_groups, encode_groups


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from fully_async.models import build_tiny_model

    return build_tiny_model(TinyModelConfig(arch="qwen2_vl"), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def vision(vlm):
    from fully_async.multimodal.processor import VisionProcessor

    return VisionProcessor(vlm)


def _png(color=(10, 200, 30), size=(SIZE, SIZE)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_to_png_reads_what_verl_rows_hold_and_names_what_it_cannot(tmp_path):
    from PIL import Image

    png = _png()
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(jpeg, format="JPEG")
    (tmp_path / "a.png").write_bytes(png)
    assert to_png({"bytes": png, "path": None}) == png
    assert to_png({"bytes": None, "path": "a.png"}, tmp_path) == png
    assert to_png(data_url(png)) == png
    assert open_png(to_png(jpeg.getvalue())).size == (8, 8)  # any image format becomes PNG
    with pytest.raises(ImageError, match="does not exist"):
        to_png("missing.png", tmp_path)
    with pytest.raises(ImageError, match="needs 'bytes' or 'path'"):
        to_png({"url": "x"})
    with pytest.raises(ImageError, match="not a readable image"):
        to_png(b"not an image")


def test_colors_rows_carry_one_image_whose_color_is_the_answer():
    rows = synthetic_rows(40, 0, task="colors")
    assert {r.ground_truth for r in rows} == set(COLORS)
    for r in rows:
        assert len(r.images) == 1 and r.messages[0]["content"].count("<image>") == 1
        pixels = np.asarray(open_png(r.images[0]), dtype=float)
        assert pixels.shape == (SIZE, SIZE, 3)
        mean = pixels.reshape(-1, 3).mean(0)
        nearest = min(COLORS, key=lambda k: float(((mean - np.array(COLORS[k])) ** 2).sum()))
        assert nearest == r.ground_truth
    again = synthetic_rows(40, 0, task="colors")
    assert [r.images for r in again] == [r.images for r in rows]  # seeded: the same pictures
    assert synthetic_rows(4, 0, task="copy")[0].images == []


def test_verl_multimodal_rows_from_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    png = _png()
    (tmp_path / "img.png").write_bytes(png)
    row = {
        "data_source": "geo3k",
        "prompt": [{"role": "user", "content": "<image>What is x?"}],
        "images": [{"bytes": png, "path": None}],
        "reward_model": {"ground_truth": "3"},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text(json.dumps({**row, "images": ["img.png"]}) + "\n")
    for name in ("d.parquet", "d.jsonl"):
        (got,) = load_rows([str(tmp_path / name)])
        assert got.images == [png] and got.ground_truth == "3"
    (tmp_path / "bad.jsonl").write_text(json.dumps({**row, "images": []}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:line 1: 1 '<image>' marker\(s\) in the prompt for 0 image"):
        load_rows([str(tmp_path / "bad.jsonl")])


def test_tiny_vlm_and_its_processor(vlm, vision):
    from transformers import AutoTokenizer

    from fully_async.models.tiny_vlm import IMAGE_PAD_ID, VISION_START_ID

    config = json.loads((vlm / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl" and config["image_token_id"] == IMAGE_PAD_ID
    tok = AutoTokenizer.from_pretrained(vlm)
    assert len(tok) == config["text_config"]["vocab_size"]
    text = vision.prompt_text("<image>color?")
    ids = tok(text)["input_ids"]
    assert ids[:3] == [VISION_START_ID, IMAGE_PAD_ID, VISION_START_ID + 1]
    big = _png(size=(112, 84))
    expanded = vision.expand(ids, [big])
    # 112x84 -> a 6x8 patch grid of 14 px, 2x2 merged: 12 image tokens.
    assert expanded.count(IMAGE_PAD_ID) == 12 and len(expanded) == len(ids) + 11
    inputs = vision.pixel_inputs([big])
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8]] and inputs["pixel_values"].shape == (48, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match="1 image marker"):
        vision.expand(ids, [big, big])
    pos = vision.position_ids(expanded, inputs["image_grid_thw"])
    assert pos.shape == (4, len(expanded)) and pos[0].tolist() == list(range(len(expanded)))
    # mrope: the 12 image tokens share one temporal position and span 3 rows x 4 columns.
    img = [i for i, t in enumerate(expanded) if t == IMAGE_PAD_ID]
    assert len(set(pos[1, img].tolist())) == 1 and len(set(pos[2, img].tolist())) == 3
    assert len(set(pos[3, img].tolist())) == 4


def test_a_sampled_vision_token_ends_the_response(vision):
    tokens, logprobs, versions = [65, 66, vision.image_token_id, 67], [-1.0, -2.0, -3.0, -4.0], [0, 0, 1, 1]
    assert vision.cut_response(tokens, logprobs, versions, "length") == ([65, 66], [-1.0, -2.0], [0, 0], "stop")
    assert vision.cut_response([65], [-1.0], [0], "length") == ([65], [-1.0], [0], "length")


def _traj(index, sample, prompt, response, images):
    n = len(response)
    return Trajectory(PromptRef(0, index), sample, np.array(prompt), np.array(response), -np.ones(n), np.zeros(n),
                      images=images)  # fmt: skip


def test_trajectories_keep_their_images_through_the_encoding_and_text_ones_encode_as_before():
    png = _png()
    group = TrajectoryGroup(PromptRef(0, 1), [_traj(1, s, [1, 2], [3, 4], [png]) for s in range(2)])
    (back,) = decode_groups(encode_groups([group]))
    assert [t.images for t in back.trajectories] == [[png], [png]]
    text = TrajectoryGroup(PromptRef(0, 2), [_traj(2, 0, [1, 2], [3], [])])
    assert b'"images"' not in encode_groups([text])


def test_batch_with_images_has_pixel_inputs_per_row_and_mrope_positions(vlm, vision):
    from fully_async.training import batch as B

    png = _png()
    prompt = vision.expand([vision.vision_start_id, vision.image_token_id, vision.vision_end_id, 65], [png])
    groups = [
        TrajectoryGroup(PromptRef(0, 0), [_traj(0, s, prompt, [66] * (s + 1), [png]) for s in range(2)]),
        TrajectoryGroup(PromptRef(0, 1), [_traj(1, 0, [65, 66, 67, 68, 69, 70, 71, 72], [66], [])]),
    ]
    batch = B.assemble(groups, 0, vision)
    mm = batch.multi_modal_inputs
    assert mm[0] is mm[1]  # one tensor for the group's shared image
    assert mm[0]["image_grid_thw"].tolist() == [[1, 4, 4]] and mm[2] is None
    pos = batch.position_ids
    assert pos.shape == (3, 4, batch.attention_mask.shape[1])
    width = batch.prompts.shape[1]
    start = width - len(prompt)
    want = vision.position_ids(prompt + [66], mm[0]["image_grid_thw"])
    assert torch.equal(pos[0, :, start : width + 1], want)
    text = (batch.attention_mask[2].cumsum(-1) - 1).clamp(min=0)
    assert all(torch.equal(pos[2, k], text) for k in range(4))
    picked = batch.select(np.array([1, -1]))  # a padding row: no image, text positions
    assert picked.multi_modal_inputs[1] is None and picked.position_ids.shape == (2, 4, pos.shape[2])
    td = B.to_engine_td(picked, 1.0)
    assert td["position_ids"].unbind()[0].shape[0] == 4
    assert B.assemble(groups[1:], 0, vision).multi_modal_inputs is None  # text: the batch as before
    with pytest.raises(ValueError, match="needs the model's vision processor"):
        B.assemble(groups, 0, None)


def test_vllm_request_and_command_of_a_vision_model(vlm, tmp_path, python):
    from fully_async.engines import EngineError, build_engine
    from fully_async.engines.vllm import VISION_SHIM_DIR

    servers = build_engine(EngineConfig(python=python), vlm, tmp_path / "run")
    png = _png()
    assert servers.kind.image_fields([png]) == {"content_parts": [{"type": "image_url", "url": data_url(png)}]}
    cmd = servers.kind.command(0, 8000)
    assert json.loads(cmd[cmd.index("--limit-mm-per-prompt") + 1]) == {"image": 4, "video": 0}
    assert str(VISION_SHIM_DIR) in servers.kind.environment(0)["PYTHONPATH"].split(":")
    sglang = build_engine(EngineConfig(kind="sglang", python=python), vlm, tmp_path / "run2")
    with pytest.raises(EngineError, match="engine.kind=sglang cannot take images"):
        sglang.kind.image_fields([png])
