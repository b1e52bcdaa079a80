"""The GDN precision probe's premise on CPU: replaying the ranks in one process gives what the ranks
compute (torch kernels, bf16 inputs), so its numbers on a GPU are pcp=2's (state passing and relay)."""

import torch

from qwen36_pcp.layers.gdn_cp import TorchGDNKernels
from qwen36_pcp.tools import layer_inputs
from tests.gpu import probe_gdn_precision as probe


def test_replayed_ranks_are_as_exact_as_the_unsplit_scan(monkeypatch):
    for key, value in dict(hk=2, hv=4, dk=16, dv=16).items():
        monkeypatch.setitem(layer_inputs.GDN, key, value)
    res = probe.run_case([0, 0, 50, 10], [200, 1, 300, 7], torch.device("cpu"), kernels=TorchGDNKernels)
    assert res["num_corrected_rows"] > 0
    one, pcp = res["one_gpu"], res["pcp2_state_passing"]
    # a wrong or missing payload from the other rank would put the corrected rows off by O(1)
    assert pcp["corrected_rows"]["rel_rms"] < 1.2 * one["corrected_rows"]["rel_rms"] < 1e-2
    assert pcp["final_state"]["rel_rms"] < 1.2 * one["final_state"]["rel_rms"] < 1e-2
    assert res["pcp2_state_passing_vs_one_gpu"]["output"]["rel_rms"] < 5e-3
    # the relay starts every block from its true state: the unsplit scan's numbers (bf16 outputs exact)
    relay = res["pcp2_relay_vs_one_gpu"]
    assert relay["output"]["max_abs"] < 1e-6 and relay["final_state"]["rel_rms"] < 1e-6
