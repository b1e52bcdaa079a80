# SPDX-License-Identifier: Apache-2.0
"""The GPU diagnostic that lines up two compiled engines' caches (``tests.gpu.compiled_graphs``), on made-up caches."""

from __future__ import annotations

from tests.gpu import compiled_graphs

GRAPH = "class GraphModule(torch.nn.Module):\n    def forward(self, x):\n        # File: /a/layer.py:3\n{}\n"
KERNEL = "@triton.jit\ndef {}(in_ptr0, out_ptr0):\n    {}\n"


def cache(root, graph_body: str, kernels: dict[str, str]) -> None:
    piece = root / "torch_compile_cache" / "abc" / "rank_0_0" / "backbone"
    piece.mkdir(parents=True)
    (piece / "computation_graph.py").write_text(GRAPH.format(graph_body))
    for i, (name, body) in enumerate(kernels.items()):
        path = piece.parent / "inductor_cache" / f"k{i}" / f"c{i}.py"
        path.parent.mkdir(parents=True)
        path.write_text(KERNEL.format(name, body))


def test_graphs_and_kernels_lined_up(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cache(a, "        y = torch.mm(x, w)", {"triton_poi_fused_add_0": "pass", "triton_red_fused_sum_1": "x = 1"})
    cache(b, "        y = torch.ops.vllm.qwen36_pcp_full_rows_linear(x, w, None)",
          {"triton_poi_fused_add_0": "pass", "triton_red_fused_sum_1": "x = 2", "triton_poi_fused_mul_2": "pass"})
    report = compiled_graphs.compare(a, b)
    assert report["pieces"] == {"a": ["backbone"], "b": ["backbone"]}
    diff = report["backbone"]["graph_diff"]
    assert "-        y = torch.mm(x, w)" in diff and any("qwen36_pcp_full_rows_linear" in d for d in diff)
    assert not any("# File" in d for d in diff)
    assert report["kernels"] == {"count": [2, 3], "only_a": [], "only_b": ["triton_poi_fused_mul_2"],
                                 "source_differs": ["triton_red_fused_sum_1"]}


def test_same_caches_agree(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        cache(root, "        y = x + 1", {"triton_poi_fused_add_0": "pass"})
    report = compiled_graphs.compare(a, b)
    assert report["backbone"]["graph_diff_lines"] == 0
    assert report["kernels"] == {"count": [1, 1], "only_a": [], "only_b": [], "source_differs": []}
