"""A strided gradient updates the parameter as its contiguous copy does (optim/optimizer.contiguous_grads).

torch's fused AdamW (2.13, CPU) reads a non-contiguous gradient as if it were laid out contiguously: the update of
each element uses another element's gradient, silently. The split-backward pipeline schedules' weight passes leave
transposed gradients wherever FSDP does not replace them (pipeline parallel without data or context parallel): a
zero-bubble run then drifted from 1F1B from its second step (loss off by 4e-3 at step 2)."""

import pytest
import torch

from internlm_core.config.schema import AdamConfig
from internlm_core.optim.optimizer import build_optimizer


def _pair(impl: str):
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 4, bias=False) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, AdamConfig(lr=1e-2), impl) for m in models]
    g = torch.randn(3, 4).t()  # [4, 3] as a transposed view, as a weight pass leaves it
    assert not g.is_contiguous()
    models[0].weight.grad, models[1].weight.grad = g.contiguous(), g.clone().t().contiguous().t()
    for o in opts:
        o.step()
    return models


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_transposed_gradient_updates_as_its_contiguous_copy(impl):
    contiguous, strided = _pair(impl)
    assert torch.equal(contiguous.weight, strided.weight)


def test_torch_fused_adamw_alone_misreads_it():
    """What the hook guards against (if torch fixes it, this test says so and the hook can go)."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(4, 3)), None
    q = torch.nn.Parameter(p.detach().clone())
    g = torch.randn(3, 4).t()
    p.grad, q.grad = g.contiguous(), g
    for x in (p, q):
        torch.optim.AdamW([x], lr=1e-2, fused=True).step()
    assert not torch.equal(p, q), "torch's fused AdamW now reads strided gradients right: contiguous_grads can go"
