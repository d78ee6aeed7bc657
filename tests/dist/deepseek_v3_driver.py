"""Two-rank driver (gloo, fp32): DEEPSEEK_V3 (latent attention with low-rank and full-rank queries, a dense first
block, group-limited sigmoid MoE with summed shared experts and the aux-loss-free bias) trains as one process over
10 AdamW steps under each of its layouts, every rank checking its per-step losses against the one-process model it
trains beside them on the same global batch:

    tp2      the family's tensor-parallel plan (heads split, latents replicated, the rotary key's gradient summed),
             with sequence parallel; a full-rank-query model's logits and gradients checked once too
    ep2      experts sharded over the 2 ranks (the family's MeshDim), each rank its half of the batch, gradients
             averaged over the ranks as FSDP does, the expert bias moved from both ranks' loads
    pp2      the family's pipeline split (embedding, dense block and first MoE block on rank 0; the rest on rank 1),
             the hidden states and their gradient sent between the stages
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from internlm_core.config import load_config
from internlm_core.model import MeshDimContext, TensorParallelOptions, build_model, get_model_spec
from internlm_core.model.moe import update_expert_bias

STEPS, V = 10, 128
SHAPE = ["model_type=DEEPSEEK_V3", "data.seq_len=32", "model.dtype=torch.float32", "model.num_layers=4",
         "model.hidden_size=64", "model.num_attention_heads=4", "model.q_lora_rank=24", "model.kv_lora_rank=16",
         "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=12", f"model.vocab_size={V}",
         "model.intermediate_size=64", "model.moe_intermediate_size=32", "model.num_experts=4",
         "model.num_shared_experts=1", "model.first_k_dense_replace=1", "model.moe_type=Dropless", "moe.top_k=2",
         "moe.score_func=sigmoid", "moe.num_expert_groups=2", "moe.top_k_groups=1", "moe.routed_scaling_factor=2.5",
         "moe.expert_bias_update_rate=0.01", "loss.moe_loss_coeff=0.0"]
SPEC = get_model_spec("DEEPSEEK_V3")


def models(extra=()):
    cfg = load_config("configs/tiny.py", [*SHAPE, *extra])
    torch.manual_seed(0)
    ref = build_model(cfg, attn_backend="sdpa")
    with torch.no_grad():  # larger weights: routing and every term matter
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref, copy.deepcopy(ref)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (4, 33), generator=g) for _ in range(STEPS)]


def loss_of(logits, ids):
    return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))


def close(a, b, what):
    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{what}: {a} vs {b}"


def reference_step(ref, opt, ids):
    opt.zero_grad()
    loss = loss_of(ref(ids[:, :-1]), ids)
    loss.backward()
    opt.step()
    update_expert_bias(ref, None)
    return loss.item()


def tensor_parallel(mesh):
    ref, model = models()
    SPEC.plan.apply_tensor_parallel(model, mesh, TensorParallelOptions(sequence_parallel=True, parallel_output=False))
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=2e-3), torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step, ids in enumerate(batches()):
        opt.zero_grad()
        loss = loss_of(model(ids[:, :-1]), ids)
        loss.backward()
        opt.step()
        update_expert_bias(model, None)  # every tensor rank routes the same tokens: the same loads
        close(loss.item(), reference_step(ref, ref_opt, ids), f"tp2 step {step}")


def full_rank_query_gradients(mesh):
    ref, model = models(["model.q_lora_rank=None"])
    SPEC.plan.apply_tensor_parallel(model, mesh, TensorParallelOptions(parallel_output=False))
    ids = batches()[0]
    loss_of(model(ids[:, :-1]), ids).backward()
    loss_of(ref(ids[:, :-1]), ids).backward()
    grads = dict(ref.named_parameters())
    assert "layers.0.attention.wq.weight" in grads
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        err = ((g - grads[name].grad).abs().max() / grads[name].grad.abs().max()).item()
        assert err <= 1e-5, f"tp2 full-rank q: gradient of {name} differs ({err:.2e})"


def expert_parallel(mesh, rank):
    ref, model = models()
    experts = {id(p) for m in SPEC.plan.mesh_dims[0].apply(model, MeshDimContext(mesh, 2, rank, model.args))
               for p in m.parameters()}
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=2e-3), torch.optim.AdamW(model.parameters(), lr=2e-3)
    group = mesh.get_group()
    for step, ids in enumerate(batches()):
        opt.zero_grad()
        loss = loss_of(model(ids[2 * rank:2 * rank + 2, :-1]), ids[2 * rank:2 * rank + 2])
        loss.backward()
        for p in model.parameters():  # FSDP's average over the data ranks; the experts' already summed both
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if id(p) not in experts:
                dist.all_reduce(grad, group=group)
            grad.div_(2)
        opt.step()
        update_expert_bias(model, group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        close(total.item() / 2, reference_step(ref, ref_opt, ids), f"ep2 step {step}")


def pipeline_parallel(rank):
    ref, model = models()
    model, _ = SPEC.plan.split_stages(model, [rank], 2)
    assert (model.tok_embeddings is None) == (rank == 1) and len(model.layers) == 2
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=2e-3), torch.optim.AdamW(model.parameters(), lr=2e-3)
    positions = torch.arange(32).expand(4, 32)
    for step, ids in enumerate(batches()):
        opt.zero_grad()
        hidden = torch.empty(4, 32, 64)
        if rank == 0:
            out = model(ids[:, :-1], positions)
            dist.send(out.detach(), 1)
            dist.recv(hidden, 1)
            out.backward(hidden)
            loss = torch.empty(())
            dist.recv(loss, 1)
        else:
            dist.recv(hidden, 0)
            hidden.requires_grad_(True)
            loss = loss_of(model(hidden, positions), ids)
            loss.backward()
            dist.send(hidden.grad, 0)
            dist.send(loss.detach(), 0)
        opt.step()
        update_expert_bias(model, None)  # each stage its own layers' loads
        close(loss.item(), reference_step(ref, ref_opt, ids), f"pp2 step {step}")


def main() -> None:
    dist.init_process_group("gloo")
    mesh, rank = init_device_mesh("cpu", (2,)), dist.get_rank()
    tensor_parallel(mesh)
    full_rank_query_gradients(mesh)
    expert_parallel(mesh, rank)
    pipeline_parallel(rank)
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
