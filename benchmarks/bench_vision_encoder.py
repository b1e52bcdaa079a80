# SPDX-License-Identifier: Apache-2.0
"""The vision encoder's share of time to first token for long videos: on every rank, or split.

    python benchmarks/bench_vision_encoder.py --out DIR            # on a GPU: measure, then summarize
    python benchmarks/bench_vision_encoder.py --summarize DIR      # the table and plot again

Measured: vLLM's Qwen3-VL vision tower (``Qwen3_VisionTransformer``) with Qwen3.6-35B-A3B's vision
config (27 blocks, hidden 1152; random bf16 weights, eager, as vLLM runs it by default) on 64-frame
videos of growing frame size and on a batch of 8 images, one GPU: the whole batch (what every rank
encodes with ``vision_encoder="replicated"``), and the largest rank's share of the frames at pcp = 2,
4, 8 (``layers.vision_split``, the default). Predicted: the language model's time to first token for
the same number of prompt tokens at each pcp (``predict_ttft``'s step-time model, calibrated on H200
measurements) and, split, the all-gather of the embeddings over NVLink. The encoder runs before the
split language model, so its time adds to the first token's: share = encoder / (encoder + language
model).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/
from benchmarks.plot import save_figure  # noqa: E402

FRAMES = 64
# (frames, width, height) -> 32 x (W/32) x (H/32) tokens: 6.3k, 12.5k, 28.2k, 61.4k
VIDEOS = ((FRAMES, 448, 448), (FRAMES, 640, 640), (FRAMES, 1280, 704), (FRAMES, 1920, 1024))
IMAGES = (8, 1024, 1024)  # 8 images of 1024 tokens
PCPS = (1, 2, 4, 8)


def vision_tower(ckpt: str):
    """vLLM's vision tower of the checkpoint's config on GPU 0, random weights."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer
    from vllm.utils.network_utils import get_open_port

    cfg = EngineArgs(model=ckpt, load_format="dummy", max_model_len=131072,
                     gdn_prefill_backend="triton").create_engine_config()
    hf = cfg.model_config.hf_config
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(cfg), torch.device("cuda"):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, "nccl")
        initialize_model_parallel(1, 1)
        tower = Qwen3_VisionTransformer(hf.vision_config, norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
                                        prefix="visual")
    for p in tower.parameters():
        p.data.normal_(0, 0.02)
    return tower.eval(), hf.vision_config


def time_encoder(tower, vision, grids: list[list[int]], reps: int = 5) -> float:
    """Median seconds of one encoder call over items of these [t, h, w] patch grids."""
    import torch

    per_patch = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, per_patch, device="cuda", dtype=torch.bfloat16)
    times = []
    with torch.inference_mode():
        for i in range(reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tower(pixels, grid_thw=grids)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure(out: Path) -> dict:
    from benchmarks.bench_ttft import checkpoint

    tower, vision = vision_tower(checkpoint(str(out)))
    patch, merge, tp = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    from qwen36_pcp.layers.vision_split import frame_shares

    batches = {f"video {f}x{w}x{h}": [[f // tp, h // patch, w // patch]] for f, w, h in VIDEOS}
    n, w, h = IMAGES
    batches[f"{n} images {w}x{h}"] = [[1, h // patch, w // patch]] * n
    rows = {}
    for name, grids in batches.items():
        split = {}
        for pcp in PCPS[1:]:  # the rank with the most patches
            share = max((g for _, g in frame_shares(grids, pcp)), key=lambda g: sum(t * a * b for t, a, b in g))
            split[pcp] = time_encoder(tower, vision, share)
        rows[name] = {"tokens": sum(t * a * b for t, a, b in grids) // merge ** 2,
                      "encoder_s": time_encoder(tower, vision, grids), "encoder_split_s": split}
    return rows


def summarize(rows: dict) -> dict:
    """Per item and pcp: the language model's predicted TTFT, the encoder's time and share replicated
    and split (its largest share measured, plus the all-gather predicted)."""
    from benchmarks.predict_ttft import BF16, CONFIGS, HIDDEN, NVLINK_BYTES_PER_S, StepModel

    model = StepModel()
    for r in rows.values():
        split = {int(k): v for k, v in r["encoder_split_s"].items()}
        r["lm_ttft_s"] = {n: model.ttft(CONFIGS[f"pcp{n}"], r["tokens"]) for n in PCPS}
        gather = {n: (n - 1) / n * r["tokens"] * HIDDEN * BF16 / NVLINK_BYTES_PER_S for n in PCPS}
        r["split_s"] = {n: r["encoder_s"] if n == 1 else split[n] + gather[n] for n in PCPS}
        r["share"] = {n: r["encoder_s"] / (r["encoder_s"] + r["lm_ttft_s"][n]) for n in PCPS}
        r["share_split"] = {n: r["split_s"][n] / (r["split_s"][n] + r["lm_ttft_s"][n]) for n in PCPS}
        r["ttft_gain"] = {n: (r["encoder_s"] + r["lm_ttft_s"][n]) / (r["split_s"][n] + r["lm_ttft_s"][n])
                          for n in PCPS}
    return rows


def table(rows: dict) -> str:
    lines = ["per rank, ms: encoder replicated (measured) / encoder split (largest share measured + "
             "all-gather predicted) / language model TTFT (predicted); encoder share of TTFT replicated -> "
             "split; TTFT replicated / split"]
    for name, r in rows.items():
        lines.append(f"{name} ({r['tokens']} tokens)")
        for n in PCPS:
            lines.append(f"  pcp={n}: {r['encoder_s'] * 1e3:7.1f} / {r['split_s'][n] * 1e3:7.1f} / "
                         f"{r['lm_ttft_s'][n] * 1e3:7.1f}   share {r['share'][n]:6.1%} -> {r['share_split'][n]:6.1%}"
                         f"   TTFT x{r['ttft_gain'][n]:.2f}")
    return "\n".join(lines)


def plot(rows: dict, path: Path) -> None:
    def draw(ax):
        for i, (name, r) in enumerate(rows.items()):
            color = f"C{i}"
            ax.plot(PCPS, [100 * r["share"][n] for n in PCPS], marker="o", color=color,
                    label=f"{name} ({r['tokens']} tokens)")
            ax.plot(PCPS, [100 * r["share_split"][n] for n in PCPS], marker="x", ls="--", color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(PCPS, [str(n) for n in PCPS])
        ax.set_xlabel("pcp")
        ax.set_ylabel("encoder share of TTFT, %")
        ax.set_title("Vision encoder share of TTFT: replicated (o) and split (x, dashed)\n"
                     "encoder measured per rank on 1 x H200, language model predicted", fontsize=9)

    save_figure(str(path), draw, fontsize=7)


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/vision_encoder")
    parser.add_argument("--summarize", help="a directory holding a measured vision_encoder.json")
    args = parser.parse_args()
    out = Path(args.summarize or args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "vision_encoder.json"
    if not args.summarize:
        path.write_text(json.dumps(measure(out), indent=1) + "\n")
    rows = summarize(json.loads(path.read_text()))
    text = table(rows)
    (out / "table.txt").write_text(text + "\n")
    plot(rows, out / "vision_encoder.png")
    print(text)


if __name__ == "__main__":
    main()
