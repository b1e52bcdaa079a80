# SPDX-License-Identifier: Apache-2.0
"""Images and videos for the vision-language checks: deterministic pixels from a seed, and prompts of
token ids with the vision placeholders where they go.

A prompt in an engine spec (``e2e``) is then a dict, which JSON carries: ``{"ids": [...], "images":
[[width, height, seed], ...], "videos": [[frames, width, height, seed], ...]}``. The ids hold one
``<|vision_start|><|image_pad|><|vision_end|>`` (or ``<|video_pad|>``) per item, in order; vLLM's
processor widens each to the item's tokens: an image of W x H pixels (multiples of 32) to
(W / 32) x (H / 32) tokens, a video to that per pair of frames, each pair with its timestamp.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SIDE = 32  # pixels per merged vision token along each axis (patch 16 x spatial merge 2)


def image(width: int, height: int, seed: int):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def video(frames: int, width: int, height: int, seed: int):
    """Frames as vLLM takes them from a caller: the array and its metadata (2 frames per second,
    every frame kept)."""
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    metadata = {"fps": 2.0, "duration": frames / 2.0, "total_num_frames": frames,
                "frames_indices": list(range(frames)), "video_backend": "opencv", "do_sample_frames": False}
    return pixels, metadata


def write_video(path: Path, frames: int, width: int, height: int, seed: int) -> Path:
    """An MP4 file of ``video(...)``'s frames at 2 frames per second (OpenCV's encoder)."""
    import cv2

    pixels, _ = video(frames, width, height, seed)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (width, height))
    for frame in pixels:
        writer.write(frame[:, :, ::-1].copy())  # OpenCV takes BGR
    writer.release()
    if not path.exists() or path.stat().st_size == 0:
        raise RuntimeError(f"OpenCV wrote no video to {path}")
    return path


def multi_modal_data(prompt: dict) -> dict:
    data = {}
    if prompt.get("images"):
        data["image"] = [image(*i) for i in prompt["images"]]
    if prompt.get("videos"):
        data["video"] = [video(*v) for v in prompt["videos"]]
    return data


def image_tokens(width: int, height: int) -> int:
    return (width // SIDE) * (height // SIDE)


def video_tokens(frames: int, width: int, height: int) -> int:
    return frames // 2 * image_tokens(width, height)


def vision_prompt(ckpt: str, segments, seed: int) -> dict:
    """A prompt from ``segments``: an int is that many random text tokens, ``("image", w, h)`` and
    ``("video", frames, w, h)`` an item (its pixels seeded from ``seed`` and its place)."""
    config = json.loads((Path(ckpt) / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    start, end = config["vision_start_token_id"], config["vision_end_token_id"]
    rng = random.Random(seed)
    prompt = {"ids": [], "images": [], "videos": []}
    for i, seg in enumerate(segments):
        if isinstance(seg, int):
            prompt["ids"] += [rng.randrange(10, vocab - 300) for _ in range(seg)]
        elif seg[0] == "image":
            prompt["ids"] += [start, config["image_token_id"], end]
            prompt["images"].append([seg[1], seg[2], seed * 100 + i])
        else:
            prompt["ids"] += [start, config["video_token_id"], end]
            prompt["videos"].append([seg[1], seg[2], seg[3], seed * 100 + i])
    return prompt
