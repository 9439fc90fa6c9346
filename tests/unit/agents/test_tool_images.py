"""A multi-turn tool that returns an image (docs/vlm.md, agents/tool_images.py): the engine is sent one image token
per image with every image so far, the Trajectory keeps each expanded to its patch tokens (mask 0, no version) with
the images in order, and the training batch lays the tool's image out at those positions. The real engine and
trainer on such a response: tests/integration/test_vlm_engine_trainer.py."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from fully_async.agents.base import Sample
from fully_async.agents.tool import ToolAgentLoop
from fully_async.agents.toolkit import ToolResult, function_tool
from fully_async.config import MultiTurnConfig, TinyModelConfig
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.protocol import NO_VERSION, PromptRef
from tests import fakes


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from fully_async.models import build_tiny_model

    return build_tiny_model(TinyModelConfig(arch="qwen2_vl"), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tok(vlm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm)


@pytest.fixture(scope="module")
def vision(vlm):
    from fully_async.multimodal.processor import VisionProcessor

    return VisionProcessor(vlm)


def png(color, size=(56, 56)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


PROMPT_IMAGE = png((0, 0, 255))
PICTURES = {"red": png((255, 0, 0)), "wide": png((0, 255, 0), (84, 56))}
"""What the camera tool shows: 56x56 is 4 image tokens (a 2x2 grid after the merge), 84x56 is 6 (2 high, 3 wide)."""


async def camera(picture: str) -> ToolResult:
    """Show a picture."""
    return ToolResult(f"picture {picture}", images=[PICTURES[picture]])


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def episode(tok, turns, images=(PROMPT_IMAGE,), response_length=400):
    tools = {"camera": function_tool(camera)}
    loop = ToolAgentLoop(tok, Sampling(), response_length, multi_turn=MultiTurnConfig(), tools=tools)
    content = "<image>" * len(images) + "what is shown?"
    row = PromptRow("t", [{"role": "user", "content": content}], "x", images=list(images))
    client = fakes.ScriptedClient(tok, turns, end=tok.convert_tokens_to_ids("<|im_end|>"))
    return asyncio.run(loop.run(client, Sample(PromptRef(0, 0), 0, row))), client


def runs(ids, token):
    """Lengths of the runs of `token` in ids, in order."""
    out, n = [], 0
    for t in [*ids, None]:
        if t == token:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def test_a_tools_images_reach_the_engine_short_and_the_trajectory_expanded_in_order(tok, vision):
    pad = vision.image_token_id
    traj, client = episode(tok, [call("camera", picture="red") + call("camera", picture="wide"), "done"])
    # The engine: one image token per image, every image so far with every call, in order.
    assert [runs(p, pad) for p in client.prompts] == [[1], [1, 1, 1]]
    assert client.images == [[PROMPT_IMAGE], [PROMPT_IMAGE, PICTURES["red"], PICTURES["wide"]]]
    assert all(vision.image_token_id in s.stop_token_ids for s in client.samplings)  # a VLM's turn stops before one
    # The trajectory: the same images in the same order, each image token expanded as the engine expands it.
    assert traj.images == client.images[-1]
    assert runs(traj.prompt_ids.tolist(), pad) == [4] and runs(traj.response_ids.tolist(), pad) == [4, 6]
    last = list(tok.encode("done", add_special_tokens=False)) + [tok.convert_tokens_to_ids("<|im_end|>")]
    engine_view = client.prompts[-1] + last
    assert traj.prompt_ids.tolist() + traj.response_ids.tolist() == vision.expand(engine_view, traj.images)
    # Only the model's tokens are trained on: every image token of the tool turn has mask 0 and no version.
    resp, mask, versions = traj.response_ids.tolist(), traj.loss_mask.tolist(), traj.token_versions.tolist()
    first = list(tok.encode(call("camera", picture="red") + call("camera", picture="wide"), add_special_tokens=False))
    assert sum(mask) == len(first) + 1 + len(last)  # the first turn's calls and its end token, then the answer
    assert resp[: len(first)] == first and resp[-len(last) :] == last
    assert all(m == 0 and v == NO_VERSION for t, m, v in zip(resp, mask, versions) if t == pad)
    assert len(resp) == len(mask) == len(versions) == len(traj.behaviour_logprobs)


def test_the_batch_lays_a_tools_image_out_at_its_positions(tok, vision):
    from fully_async.protocol import TrajectoryGroup
    from fully_async.training.batch import assemble

    pad = vision.image_token_id
    traj, _ = episode(tok, [call("camera", picture="wide"), "done"])
    traj.reward = 1.0
    batch = assemble([TrajectoryGroup(traj.prompt, [traj])], 0, vision)
    inputs = batch.multi_modal_inputs[0]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]  # the prompt's image, then the tool's
    ids = batch.prompts[0].tolist() + batch.responses[0].tolist()
    positions = batch.mrope_position_ids[0]  # (4, P + R): text, then mrope's temporal / height / width
    where = [i for i, t in enumerate(ids) if t == pad]
    assert len(where) == 4 + 6
    tool_image = where[4:]
    assert len({int(positions[1, i]) for i in tool_image}) == 1  # one frame
    assert len({int(positions[2, i]) for i in tool_image}) == 2  # 2 rows ...
    assert len({int(positions[3, i]) for i in tool_image}) == 3  # ... of 3 columns: the wide picture's grid
    # The text after the image continues past the image's positions, as the engine's model lays it out.
    after = tool_image[-1] + 1
    assert int(positions[1, after]) == max(int(positions[r, i]) for r in (1, 2, 3) for i in tool_image) + 1
    response_mask = batch.response_mask[0].tolist()
    P = batch.prompts.shape[1]
    assert all(response_mask[i - P] == 0 for i in tool_image)


def test_images_from_a_tool_need_a_vision_model_and_readable_pictures(tmp_path):
    from transformers import AutoTokenizer

    from fully_async.agents.toolkit import ToolCall, run_call
    from fully_async.models.tiny import build_tokenizer
    from fully_async.multimodal.processor import VisionError

    async def broken() -> ToolResult:
        """Show a broken picture."""
        return ToolResult("here", images=[b"not an image"])

    res = asyncio.run(run_call({"broken": function_tool(broken)}, ToolCall("broken"), "e", 5.0))
    assert res.error == "tool_error" and "unreadable image" in res.text and not res.images
    build_tokenizer(tmp_path)
    with pytest.raises(VisionError, match="tool 'camera' returned images but the model .* is not a vision-language"):
        episode(AutoTokenizer.from_pretrained(tmp_path), [call("camera", picture="red"), "done"], images=())
