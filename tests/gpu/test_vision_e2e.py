# SPDX-License-Identifier: Apache-2.0
"""Images and video at pcp > 1: the vision-language class against itself at pcp=1.

    python -m pytest -q -s tests/gpu/test_vision_e2e.py     # one GPU is enough

``Qwen3_6ForConditionalGeneration`` on the tiny checkpoint (its vision tower and processor files),
greedy, 32 tokens, top-5 logprobs, prefix caching on, vLLM's 16384-token chunks, prompts split from
512 tokens (``min_split_tokens``), at pcp = 1, 2, 4, 8 with the vision encoder split over the ranks
(the default), at pcp=2 with it on every rank (``vision_encoder="replicated"``), with the MTP head
(K=2) at pcp = 1 and 2, and the dense layout (``tiny-dense``) at pcp = 1 and 2. Three batches:
- ``mixed``: one image in a short prompt (unsplit); a 1024-token image across a block boundary of the
  split (1500 text tokens, the image, 1500 more: at pcp=2 the blocks are about 1000 tokens); eight
  images of different sizes among text (about 3900 tokens); a 64-frame video of 30720 tokens, which
  chunked prefill cuts inside the video (its embeddings come from vLLM's encoder cache for the second
  chunk);
- ``prefix_hits``: the 3000-token image prompt and the eight-image prompt again, each with more text:
  prefix-cache hits over image tokens (the cached token counts are compared too);
- ``long_video``: a 64-frame video of 61440 tokens in one prompt (four chunks).
Judged: every prompt within vLLM's check_logprobs_close rule of pcp=1 (MTP: of pcp=1 with MTP, the
ranks' drafts the same, and pcp=1's where the answers are the same bits), no NaN, the same
prefix-cache hits; the replicated encoder bit for bit with pcp=1; whether the split encoder's
batches are is reported.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.media import image_tokens, video_tokens, vision_prompt

from . import e2e

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

VL_ARCH = "Qwen3_6ForConditionalGeneration"
PCPS = (1, 2, 4, 8)
# engine -> (pcp, qwen36_pcp options, MTP drafts, checkpoint preset); each judged against the pcp=1
# engine of its kind
ENGINES = {f"vision_pcp{n}": (n, {}, 0, "tiny") for n in PCPS} | {
    "vision_pcp2_replicated": (2, {"vision_encoder": "replicated"}, 0, "tiny"),
    "vision_mtp_pcp1": (1, {}, 2, "tiny"), "vision_mtp_pcp2": (2, {}, 2, "tiny"),
    "vision_dense_pcp1": (1, {}, 0, "tiny-dense"), "vision_dense_pcp2": (2, {}, 0, "tiny-dense")}
REFERENCE = {"vision_pcp2": "vision_pcp1", "vision_pcp4": "vision_pcp1", "vision_pcp8": "vision_pcp1",
             "vision_pcp2_replicated": "vision_pcp1", "vision_mtp_pcp2": "vision_mtp_pcp1",
             "vision_dense_pcp2": "vision_dense_pcp1"}
EIGHT_IMAGES = ((256, 320), (512, 256), (384, 384), (256, 256), (640, 480), (320, 320), (448, 256), (512, 512))
BATCHES = ("mixed", "prefix_hits", "long_video")


def prompts(ckpt: str) -> list[list[dict]]:
    eight = [seg for i, (w, h) in enumerate(EIGHT_IMAGES) for seg in (150 + 50 * i, ("image", w, h))] + [100]
    straddle = [1500, ("image", 1024, 1024), 1500]
    mixed = [vision_prompt(ckpt, [40, ("image", 256, 256), 20], seed=1),
             vision_prompt(ckpt, straddle, seed=2),
             vision_prompt(ckpt, eight, seed=3),
             vision_prompt(ckpt, [200, ("video", 64, 1024, 960), 300], seed=4)]
    # whole earlier prompts, then more text: vLLM's hybrid prefix cache keeps the GDN states where a
    # prompt's last full block ends, so a hit needs the earlier prompt whole
    tail = vision_prompt(ckpt, [300], seed=5)["ids"]
    again, more = dict(mixed[1], ids=mixed[1]["ids"] + tail), dict(mixed[2], ids=mixed[2]["ids"] + tail[:40])
    long_video = [vision_prompt(ckpt, [100, ("video", 64, 1920, 1024), 100], seed=6)]
    return [mixed, [again, more], long_video]


def vision_jobs():
    jobs = {}
    for name, (pcp, options, k, preset) in ENGINES.items():
        ckpt = e2e.checkpoint(preset)
        batches = prompts(ckpt)
        llm = e2e.base_llm_kwargs(ckpt, hf_overrides={"architectures": [VL_ARCH]}, enforce_eager=True,
                                  enable_prefix_caching=True, prefill_context_parallel_size=pcp,
                                  limit_mm_per_prompt={"image": 8, "video": 1})
        if pcp > 1:
            llm["additional_config"] = {"qwen36_pcp": {"min_split_tokens": 512, **options}}
        if k:
            llm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        jobs[name] = ({"llm": llm, "engine_core_in_process": True, "batches": batches, "record_drafts": bool(k)}, pcp)
    return jobs


def _serve_images(gpus: str) -> dict:
    """``vllm serve`` at pcp=2 with chat completions carrying an image: a base64 data URL made from a
    local PNG file, and the file itself (``file://`` under ``--allowed-local-media-path``); and a local
    MP4 file as ``video_url``."""
    import base64
    import tempfile
    from pathlib import Path

    from tests.media import image, write_video

    folder = Path(tempfile.mkdtemp())
    png = folder / "scan.png"
    image(1024, 768, seed=7).save(png)
    clip = write_video(folder / "clip.mp4", frames=16, width=256, height=256, seed=8)
    data_url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    ckpt = e2e.checkpoint("tiny")
    args = e2e.pcp_serve_args(ckpt, gpus, 2, 32768, {"architectures": [VL_ARCH]}) + [
        "--allowed-local-media-path", str(folder), "--additional-config",
        json.dumps({"qwen36_pcp": {"min_split_tokens": 512}})]

    def requests(url):
        out = {}
        for name, part in (("data_url", {"type": "image_url", "image_url": {"url": data_url}}),
                           ("file", {"type": "image_url", "image_url": {"url": png.as_uri()}}),
                           ("video", {"type": "video_url", "video_url": {"url": clip.as_uri()}})):
            content = [{"type": "text", "text": "What is on this page? " * 40}, part]
            r = e2e.post(f"{url}/v1/chat/completions", {
                "model": ckpt, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                "temperature": 0, "logprobs": True})
            out[name] = {"usage": r["usage"], "finish_reason": r["choices"][0]["finish_reason"],
                         "tokens": [t["token"] for t in r["choices"][0]["logprobs"]["content"]]}
        return out

    return e2e.serve(args, requests, name="vision_serve_pcp2", gpus=gpus)


def serve_jobs():
    return {"vision_serve_pcp2": (_serve_images, 2)}


@GPU[0]
@GPU[1]
@pytest.mark.engine_jobs(builder=serve_jobs)
def test_serve_chat_completions_with_an_image(engine_pool):
    out = e2e.result(engine_pool, "vision_serve_pcp2")
    e2e.save("vision_serve", out)
    print(f"[vision serve] {out}")
    for name, r in out.items():
        assert r["usage"]["completion_tokens"] == 8 and r["finish_reason"] == "length", (name, r)
    # the image's 768 tokens (1024 x 768 pixels) are in the prompt, which pcp=2 splits; the video's too
    # (however many of its 16 frames vLLM's loader samples: at least the processor's 4)
    text = out["file"]["usage"]["prompt_tokens"] - image_tokens(1024, 768)
    assert text > 0, out
    assert out["video"]["usage"]["prompt_tokens"] - text >= video_tokens(4, 256, 256), out
    assert out["data_url"]["tokens"] == out["file"]["tokens"]  # the same image either way


def test_prompt_sizes():
    """The prompts hold what the docstring says (token counts from the pixel sizes)."""
    assert image_tokens(1024, 1024) == 1024 and video_tokens(64, 1024, 960) == 30720
    assert video_tokens(64, 1920, 1024) == 61440
    assert 3500 < sum(image_tokens(w, h) for w, h in EIGHT_IMAGES) + sum(150 + 50 * i for i in range(8)) < 4500


@GPU[0]
@GPU[1]
@pytest.mark.engine_jobs(builder=vision_jobs)
def test_images_and_video_at_pcp_match_pcp1(engine_pool):
    report, failed = {}, []
    for engine, reference in REFERENCE.items():
        ref, r = e2e.result(engine_pool, reference), e2e.result(engine_pool, engine)
        for i, name in enumerate(BATCHES):
            a, b = e2e.outputs(ref, [i]), e2e.outputs(r, [i])
            c = e2e.compare(a, b)
            cached = ([o["num_cached_tokens"] for o in a], [o["num_cached_tokens"] for o in b])
            report[f"{engine}/{name}"] = {**{k: v for k, v in c.items() if k != "diverged_at"},
                                          "identical": a == b, "cached_tokens": cached[1]}
            if not (c["ok"] and c["nonfinite"] == 0):
                failed.append(f"{engine} {name}: {c}")
            if cached[0] != cached[1]:
                failed.append(f"{engine} {name}: cached tokens {cached[1]} vs {reference}'s {cached[0]}")
            if engine == "vision_pcp2_replicated" and a != b:
                failed.append(f"{engine} {name}: not bit for bit")
        if ENGINES[engine][2]:  # the same drafts wherever the answers are the same bits
            same = all(report[f"{engine}/{name}"]["identical"] for name in BATCHES)
            report[f"{engine}/drafts_identical"] = ref["drafts"] == r["drafts"] and bool(r["drafts"])
            if (same and not report[f"{engine}/drafts_identical"]) or not r["drafts_ranks_agree"]:
                failed.append(f"{engine}: drafts differ from {reference}'s or between ranks")
    e2e.save("vision_e2e", report)
    print("[vision] " + json.dumps(report, indent=1))
    hits = report["vision_pcp2/prefix_hits"]["cached_tokens"]
    if not all(n > 0 for n in hits):
        failed.append(f"no prefix-cache hit over the image prompts: {hits}")
    assert not failed, failed
