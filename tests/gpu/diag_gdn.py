"""Diagnostic: run the unsplit GDN reference twice on one GPU, report NaNs per stage."""
import torch

from qwen36_pcp.layers.gdn_cp import VllmGDNKernels as K
from qwen36_pcp.tools.layer_inputs import gdn_inputs

dev = torch.device("cuda", 0)
num_computed, num_new = [0, 0, 1500, 40], [8192, 1, 3000, 7]
inp, w = gdn_inputs(num_computed, num_new, dev)
cu_cpu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32)
cu = cu_cpu.to(dev)
has = torch.tensor([c > 0 for c in num_computed], device=dev)
nan = lambda x: int(torch.isnan(x.float()).sum())  # noqa: E731
for it in range(3):
    init_conv = torch.where(has[:, None, None], inp["conv_state"][inp["state_idx"]], 0).to(torch.bfloat16)
    scratch = init_conv.transpose(1, 2).contiguous().transpose(1, 2)
    y0 = K.conv(inp["mixed_qkv"], w.conv_weight, w.conv_bias, init_conv.clone(), cu, cu_cpu)  # DS-strided scratch
    print(it, "nan y (DS scratch)", nan(y0), flush=True)
    y = K.conv(inp["mixed_qkv"], w.conv_weight, w.conv_bias, scratch, cu, cu_cpu)  # SD-strided scratch
    print(it, "nan y (SD scratch)", nan(y), flush=True)
    q, k, v, g, beta = K.prep(y, inp["a"], inp["b"], w)
    init = torch.where(has[:, None, None, None], inp["ssm_state"][inp["state_idx"]], 0.0)
    o, fin = K.chunk(q, k, v, g, beta, init, cu, cu_cpu)
    print(it, "nan y", nan(y), "q", nan(q), "k", nan(k), "v", nan(v), "g", nan(g), "beta", nan(beta),
          "o", nan(o), "final", nan(fin), "absmax o", o.float().abs().max().item(), flush=True)
    V = v.shape[-1]; Kd = k.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], Kd)], -1)
    init_aug = torch.zeros(init.shape[0], init.shape[1], V + Kd, Kd, device=dev)
    init_aug[:, :, :V] = init
    init_aug[:, :, V:] = torch.eye(Kd, device=dev)
    o2, fin2 = K.chunk(q, k, v_aug, g, beta, init_aug, cu, cu_cpu)
    print(it, "aug nan o", nan(o2), "final", nan(fin2), "diff plain-vs-aug o", (o2[..., :V].float() - o.float()).abs().max().item(),
          "final", (fin2[:, :, :V] - fin).abs().max().item(), flush=True)
