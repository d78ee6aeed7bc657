"""Two-rank driver (gloo): QWEN3 and QWEN3_MoE (q/k norms, head_dim apart from width / heads, a sliding window)
under their family's tensor-parallel plan, with and without sequence parallel, against the unsharded model: the
logits and every parameter's gradient, the q/k norms' included (each rank normalizes its own heads; their weights'
gradient is the sum over all heads)."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from internlm_core.config import load_config
from internlm_core.model import TensorParallelOptions, build_model, get_model_spec


def check(model_type: str, sequence_parallel: bool, mesh) -> None:
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", "data.seq_len=32", "model.dtype=torch.float32",
                                          "model.hidden_size=64", "model.num_attention_heads=4",
                                          "model.num_kv_attention_heads=2", "model.head_dim=32",
                                          "model.sliding_window=8",
                                          *(["model.num_experts=4", "model.moe_type=Dropless"] if "MoE" in model_type
                                            else [])])
    torch.manual_seed(0)
    ref = build_model(cfg, attn_backend="sdpa")
    with torch.no_grad():  # norms away from 1: their gradients differ from rank to rank
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = copy.deepcopy(ref)
    get_model_spec(model_type).plan.apply_tensor_parallel(
        model, mesh, TensorParallelOptions(sequence_parallel=sequence_parallel, parallel_output=False))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 32))
    weight = torch.randn(2, 32, cfg.model.vocab_size)
    out, expected = model(ids), ref(ids)
    where = f"{model_type} sp={sequence_parallel}"
    assert torch.allclose(out, expected, atol=1e-5), f"{where}: logits differ"
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    grads = dict(ref.named_parameters())
    assert any("q_norm" in n for n in grads)
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        r = grads[name].grad
        err = ((g - r).abs().max() / r.abs().max()).item()  # fp32 sums in another order: relative to the largest
        assert err <= 1e-5, f"{where}: gradient of {name} differs ({err:.2e})"


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    for model_type in ("QWEN3", "QWEN3_MoE"):
        for sp in (False, True):
            check(model_type, sp, mesh)
    print(f"rank {dist.get_rank()}: ok")


if __name__ == "__main__":
    main()
