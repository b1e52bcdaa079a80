# SPDX-License-Identifier: Apache-2.0
"""The vision-language class on the CPU: vLLM's processor takes images and videos for the checkpoints
the maker writes (its processor files, both layouts), with the placeholder counts the GPU checks
build their prompts from; the text-only class refuses them. (The model built with
its PCP layers and every tensor loaded: ``test_vllm_integration``; each rank's rows of a split step's
embeddings and M-RoPE positions: ``test_runner``.)"""

from __future__ import annotations

import pytest

from tests.media import image_tokens, video_tokens

VL_ARCH = "Qwen3_6ForConditionalGeneration"
IMAGE, VIDEO = (288, 256), (4, 256, 320)  # multiples of 32 pixels, above the processor's smallest size


def _processed(ckpt: str) -> dict:
    from harness.dist import error_of
    from tests.fake_cuda import engine_config, use_fake_cuda

    use_fake_cuda()
    import qwen36_pcp

    qwen36_pcp.register()
    from vllm.inputs.preprocess import InputPreprocessor

    from tests.media import multi_modal_data, vision_prompt

    prompt = vision_prompt(ckpt, [5, ("image", *IMAGE), 7, ("video", *VIDEO), 3, ("image", *IMAGE), 2], seed=1)
    request = {"prompt_token_ids": prompt["ids"], "multi_modal_data": multi_modal_data(prompt)}
    out = {}
    for arch, pcp in ((VL_ARCH, 2), (VL_ARCH, 1), ("Qwen3_6ForCausalLM", 2)):
        cfg = engine_config(ckpt, hf_overrides={"architectures": [arch]}, prefill_context_parallel_size=pcp)
        error = error_of(lambda: out.__setitem__((arch, pcp), InputPreprocessor(cfg).preprocess(request)))
        if error:
            out[(arch, pcp)] = error
            continue
        processed = out[(arch, pcp)]
        out[(arch, pcp)] = {
            "num_tokens": len(processed["prompt_token_ids"]),
            "placeholders": {m: [(r.offset, r.length, r.get_num_embeds()) for r in ranges]
                             for m, ranges in processed["mm_placeholders"].items()},
        }
    return {f"{a}@{p}": v for (a, p), v in out.items()}


@pytest.fixture(scope="module", params=["tiny", "tiny-dense"])
def processed(request, tmp_path_factory, fake_cuda_ranks):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / request.param, preset=request.param, seed=0)
    return fake_cuda_ranks.isolated(_processed, str(ckpt))


def test_images_and_video_become_their_placeholder_tokens(processed):
    out = processed[f"{VL_ARCH}@2"]
    assert isinstance(out, dict), out
    images, videos = out["placeholders"]["image"], out["placeholders"]["video"]
    assert [n for _, _, n in images] == [image_tokens(*IMAGE)] * 2
    assert [n for _, _, n in videos] == [video_tokens(*VIDEO)]
    # the video's placeholder also holds its frames' timestamps and markers (not embedded)
    assert videos[0][1] > video_tokens(*VIDEO)
    assert out == processed[f"{VL_ARCH}@1"]  # the same prompt at pcp=1


def test_text_only_class_refuses_images(processed):
    """Refused in vLLM's front end before any engine work (vLLM 0.20.2's renderer fails on a text-only
    model's ``multi_modal_data`` with an AttributeError of its own, for any text-only model)."""
    assert isinstance(processed["Qwen3_6ForCausalLM@2"], str), processed["Qwen3_6ForCausalLM@2"]
