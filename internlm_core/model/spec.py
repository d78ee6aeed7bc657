"""ModelSpec: everything the rest of the framework may know about a model family, and the registry by name.

A family (a folder under `internlm_core/model/`) registers one spec per `model_type`. Nothing outside
`internlm_core/model/` names a family, a module attribute or a parameter path: the trainer, the parallel
code, the checkpoint code and the estimator go through these fields.

The contract a family's module fulfils (what the trainer and the pipeline call):

    model(input_ids [B, T], position_ids [B, T], cu_seqlens) -> logits [B, T, V]
    chunk(x, position_ids=..., document_ids=...)            # a pipeline stage; x: ids or hidden states
    model.init_weights(buffer_device=None)                  # the initial values (also after a meta build)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from .counts import ModelCounts


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel layout as a family's rules see it (plain values from the config's `parallel` section).

    dims: the sizes of the mesh dimensions the family adds (`ParallelPlan.mesh_dims`), by their config key."""

    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    dims: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInputs:
    """Everything a family may read to build, check and count its model: plain values, not the whole config.

    model: the `model` section (config.schema.ModelConfig; read by attribute, since this package sits below
        `config`); seq_len: tokens of one sequence (data.seq_len); parallel: the layout its rules check.
    moe, moe_loss_coeff: the MoE families' routing section and loss weight (dense families ignore them);
        expert_gemm: their expert kernel, as the run chose it.
    `Config.model_inputs()` makes one."""

    model_type: str
    model: Any
    seq_len: int
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    moe: Any = None               # the `moe` section (config.schema.MoEConfig): routing of MoE families
    moe_loss_coeff: float = 0.0   # loss.moe_loss_coeff: weight of the MoE load-balancing loss
    expert_gemm: str = "loop"     # the MoE layers' expert GEMM numerics.select_kernels chose (loop, grouped)


@dataclass(frozen=True)
class TensorParallelOptions:
    """How the tensor-parallel plan is applied (from `parallel` and `model`)."""

    sequence_parallel: bool = False
    parallel_output: bool = True
    local_logits: bool = False  # a pipeline stage hands on its vocabulary shard as a plain tensor
    compile: bool = False
    # (block, block plan) -> the plan with other styles for some linears (model.fp8: torchao's float8 styles)
    linear_styles: Optional[Callable[[Any, dict], dict]] = None


@dataclass(frozen=True)
class StageShapes:
    """What fixes the shapes pipeline stages exchange: one micro-batch's rows and tokens, the tensor-parallel
    split, and the dtypes of hidden states and logits."""

    rows: int
    seq_len: int
    tp: int = 1
    sequence_parallel: bool = False
    parallel_output: bool = True
    hidden_dtype: torch.dtype = torch.float32
    logits_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class MeshDim:
    """A parallel dimension a family adds to the generic ones (data, tensor, pipeline), e.g. expert parallel.

    It is carved out of the sharded data-parallel ranks: with `parallel.<key>` = E, each group of E consecutive
    data-parallel shard ranks becomes one group of this dimension (mesh dims `dp_shard_rest`, `name`). Every
    generic group keeps its meaning: the E ranks read different batches, losses and metrics are averaged over
    all data-parallel ranks, and the parameters `apply` leaves alone are sharded by FSDP over all of them.

    name: the mesh dimension's name ("ep"); key: its size's config key (`parallel.<key>`, default 1: off);
    apply(model, ctx): shard the family's modules over this dimension (`MeshDimContext`) and return the modules
        it sharded; FSDP then shards each of those over the remaining data-parallel ranks only, and averages
        their gradients over every data-parallel rank (their forward already combined the E ranks' tokens);
    resolve(requested, dp_shard, inputs) -> size: the size of `parallel.<key>` = requested given the sharded
        data-parallel size (default: requested, or all of dp_shard for requested <= 0);
    description: one line for logs and errors.
    """

    name: str
    key: str
    apply: Callable[[nn.Module, "MeshDimContext"], list[nn.Module]]
    resolve: Optional[Callable[[int, int, "ModelInputs"], int]] = None
    description: str = ""

    def size(self, requested: int, dp_shard: int, inputs: "ModelInputs") -> int:
        if self.resolve is not None:
            return int(self.resolve(requested, dp_shard, inputs))
        return dp_shard if requested <= 0 else requested


@dataclass(frozen=True)
class MeshDimContext:
    """What `MeshDim.apply` gets: the dimension's own mesh (a 1-D DeviceMesh of its E ranks), its size and this
    rank's index in it, and the model's args."""

    mesh: Any
    size: int
    rank: int
    args: Any


@dataclass(frozen=True)
class ParallelPlan:
    """How the generic parallel code (internlm_core/parallel) cuts and shards a family's module.

    blocks: the repeated units, in order: activation checkpointing, compile and FSDP wrap each of them.
    roots: the non-block modules that hold parameters (embedding, final norm, output); FSDP shards them with
        the root of each pipeline chunk.
    apply_tensor_parallel(model, tp_mesh, options): shard the module in place with DTensor plans.
    split_stages(model, stage_ids, num_stages): prune the module to the virtual pipeline stages
        `stage_ids` (keeping parameter names) and return (model, one runnable chunk per stage).
    stage_io(args, stage, num_stages, shapes) -> (input, output) of one micro-batch of a stage as meta tensors
        (a simulated job's pipeline cannot learn them from its fake neighbours).
    mesh_dims: parallel dimensions of the family's own (MeshDim), applied after tensor parallel, before
        activation checkpointing and FSDP.
    """

    blocks: Callable[[nn.Module], list[nn.Module]]
    apply_tensor_parallel: Optional[Callable[[nn.Module, Any, TensorParallelOptions], None]] = None
    split_stages: Optional[Callable[[nn.Module, list[int], int], tuple[nn.Module, list[nn.Module]]]] = None
    stage_io: Optional[Callable[[Any, int, int, StageShapes], tuple[torch.Tensor, torch.Tensor]]] = None
    mesh_dims: tuple[MeshDim, ...] = ()


@dataclass(frozen=True)
class AdapterContext:
    """What a state-dict adapter needs besides the tensors.

    args: the model's ModelArgs (heads, kv heads, head_dim, tied embeddings, ...).
    tp: tensor-parallel shards of the foreign side (InternLM folders keep one state dict per tensor rank, Meta's
        Llama folders one per model-parallel rank).
    options: the foreign format's own switches (InternLM's model_config.pt: embed_split_hidden, qk_interleaved).
    """

    args: Any
    tp: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StateDictAdapter:
    """Converts a family's state dict to and from a foreign format (Hugging Face, InternLM checkpoints).

    to_foreign(state_dict, ctx) / from_foreign(foreign, ctx) map a whole state dict, or any part of it made of
    whole layers (the generic code converts one layer at a time), names and tensors where a format packs them.
    For format "internlm" the foreign side is {tensor rank: state dict} with the pipeline stages merged (global
    layer numbers), for "llama" (Meta's) {model-parallel rank: state dict}; a foreign name's first number is its
    layer, ours (the generic code hands from_foreign one layer's entries, and those outside the layers together).
    A tied output is produced from, and restored to, the embedding.
    foreign_config(inputs: ModelInputs, dtype_name, special_ids) -> the foreign config (HF config.json, InternLM's
    model_config.pt) of our model (`Config.model_inputs()`); config_from_foreign(foreign_config) -> our `model` keys (CheckpointError
    for what the family cannot represent). architectures: the HF classes this adapter reads and writes;
    hf_model_types: config.json's `model_type` of each (the same order), which names the class of a folder whose
    config.json lacks `architectures`.
    A format of one file per model-parallel rank (Meta's "llama") names its folder's layout: config_file (the
    foreign config in the folder, e.g. params.json) and shard_files(folder) -> the rank files in rank order
    (CheckpointError when there are none); checkpoint/pth_shards.py reads such folders for any family.
    """

    format: str
    to_foreign: Callable[[dict, Any], dict]
    from_foreign: Callable[[dict, Any], dict]
    foreign_config: Optional[Callable[..., dict]] = None
    config_from_foreign: Optional[Callable[[dict], dict]] = None
    architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    description: str = ""
    config_file: str = ""
    shard_files: Optional[Callable[[Any], list]] = None


def _no_op(*args: Any) -> None:
    return None


@dataclass(frozen=True)
class TrainingHooks:
    """What a family does in the step loop besides forward and backward (the loop calls these; dense families
    need none). MoE: the auxiliary losses' gradient scale, the expert-bias update, the load-balance metrics.

    before_backward(model, scale): the factor of this micro-batch's loss gradient (loss scale / micro-batches)
        just before its backward (losses a family adds inside the model scale theirs the same way);
    after_step(model, dp_group): after each optimizer step that was taken, outside autograd; dp_group: the
        data-parallel process group (None for one process), for what must agree across the data-parallel ranks;
    step_metrics(model, dp_group, pp_group) -> {name: value}: the family's metrics of the step just taken
        (metrics.jsonl, TensorBoard, console), e.g. "moe/layer0/max_load" (names without a leading "/"); called on
        every rank (dp_group as for after_step: a family may sum over it; pp_group: the pipeline stages, None
        without pipeline parallel: each stage holds other layers, a family merges their metrics over it).
    """

    before_backward: Callable[[nn.Module, float], None] = _no_op
    after_step: Callable[[nn.Module, Any], None] = _no_op
    step_metrics: Callable[[nn.Module, Any, Any], dict] = lambda model, dp_group, pp_group: {}


@dataclass(frozen=True)
class ModelSpec:
    """One model family as the framework sees it.

    name: the canonical `model_type`; aliases: other spellings users' configs carry (InternEvo's, ...).
    build_args(inputs: ModelInputs, attn_backend) -> the module's args; module(args) -> the model.
    fill_defaults(model_section): family defaults for unset keys; validate(inputs: ModelInputs): family rules
        (ConfigError naming the key).
    num_parameters(args), flops_per_token(args, seq_len): analytic counts for logs, MFU and estimates.
    sizes: named shapes ("7B": {model keys}) of the family's published models (`tools/estimate.py --size`).
    adapters: state-dict adapters by format: "hf" (the family's own Hugging Face class), "hf_llama" (the
        LlamaForCausalLM form), "internlm" (InternLM's / InternEvo's training checkpoints), "llama" (Meta's
        original Llama checkpoints).
    hooks: what the step loop calls besides forward and backward (TrainingHooks).
    counts: ModelCounts (model/counts.py): the parameters, FLOPs and activation bytes the estimator sums,
        term by term with the mesh dimensions dividing each.
    parameter_shapes(args): {name: meta tensor} of the full model's state dict (foreign checkpoints).
    """

    name: str
    module: Callable[[Any], nn.Module]
    build_args: Callable[[ModelInputs, str], Any]
    plan: ParallelPlan
    aliases: tuple[str, ...] = ()
    description: str = ""
    fill_defaults: Callable[[Any], None] = lambda model_cfg: None
    validate: Callable[[ModelInputs], None] = lambda inputs: None
    num_parameters: Optional[Callable[[Any], int]] = None
    flops_per_token: Optional[Callable[[Any, int], int]] = None
    sizes: dict[str, dict] = field(default_factory=dict)
    adapters: dict[str, StateDictAdapter] = field(default_factory=dict)
    hooks: TrainingHooks = field(default_factory=TrainingHooks)
    counts: Optional[ModelCounts] = None

    def parameter_shapes(self, args: Any) -> dict[str, torch.Tensor]:
        """Our parameter names -> meta tensors (global shapes, dtypes) of the full model built from `args`, in
        its state_dict order (layer by layer): the module built on the meta device, no memory used."""
        with torch.device("meta"):
            model = self.module(args)
        return {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}


_SPECS: dict[str, ModelSpec] = {}
_ALIASES: dict[str, str] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Make `spec` buildable by its name and aliases (case-insensitive); returns it."""
    for key in (spec.name, *spec.aliases):
        key = key.upper()
        owner = _ALIASES.get(key)
        if owner is not None and owner != spec.name.upper():
            raise ValueError(f"model_type {key!r} is already registered by {owner}")
    _SPECS[spec.name.upper()] = spec
    for key in (spec.name, *spec.aliases):
        _ALIASES[key.upper()] = spec.name.upper()
    return spec


def unregister_model(name: str) -> None:
    """Remove a family (tests register toy families and remove them again)."""
    spec = _SPECS.pop(name.upper(), None)
    if spec is not None:
        for key in (spec.name, *spec.aliases):
            _ALIASES.pop(key.upper(), None)


def model_types() -> list[str]:
    """Canonical names of the registered families, in registration order."""
    return [s.name for s in _SPECS.values()]


def canonical_model_type(model_type: str) -> str:
    """The canonical name of `model_type` or one of its aliases; ConfigError naming the known ones."""
    key = str(model_type).upper()
    if key in _ALIASES:
        return _SPECS[_ALIASES[key]].name
    import difflib
    known = model_types()
    aliases = sorted(a for a in _ALIASES if a not in _SPECS)
    match = difflib.get_close_matches(key, known + aliases, n=1, cutoff=0.5)
    raise ConfigError(f"model_type: expected one of {', '.join(known)}"
                      + (f" (or the aliases {', '.join(aliases)})" if aliases else "")
                      + f", got {model_type!r}" + (f"; did you mean {match[0]!r}?" if match else ""))


def get_model_spec(model_type: str) -> ModelSpec:
    """The spec of `model_type` (a name or an alias)."""
    return _SPECS[canonical_model_type(model_type).upper()]
