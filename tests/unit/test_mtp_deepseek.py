"""model.mtp on DEEPSEEK_V3 in Hugging Face folders (DeepSeek's layout: depth k is decoder layer num_hidden_layers +
k - 1, with enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and head). transformers'
DeepseekV3ForCausalLM builds no MTP layers (it ignores them), so the depth's logits are checked against a reference
assembled from transformers' own pieces: its DeepseekV3DecoderLayer (latent attention, routed MoE) loaded with the
folder's layer tensors, its RMSNorm, the main model's last hidden state before its final norm, its embedding and
lm_head, in DeepSeek's MTP formula lm_head(norm(layer(eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]))))."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf  # noqa: E402
from internlm_core.errors import CheckpointError  # noqa: E402
from internlm_core.model import build_model  # noqa: E402
from internlm_core.model.mtp import mtp_module, pop_mtp_logits  # noqa: E402
from tests.unit.test_deepseek_v3 import V3, hf_model, ours_for  # noqa: E402


def _reference_depth(hf, folder, ids):
    """DeepSeek's depth-1 logits at positions 0..T-2 from transformers' pieces and the folder's layer-3 tensors."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    c, layer_no = hf.config, V3["num_hidden_layers"]
    tensors = load_file(folder / "model.safetensors")
    own = {k[len(f"model.layers.{layer_no}."):]: v for k, v in tensors.items() if k.startswith(f"model.layers.{layer_no}.")}
    layer = DeepseekV3DecoderLayer(c, layer_no).eval()
    block = {k: v for k, v in own.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_"))}
    n = c.n_routed_experts  # transformers 5 keeps the experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    block["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([block.pop(f"mlp.experts.{j}.gate_proj.weight"),
                                                                block.pop(f"mlp.experts.{j}.up_proj.weight")])
                                                     for j in range(n)])
    block["mlp.experts.down_proj"] = torch.stack([block.pop(f"mlp.experts.{j}.down_proj.weight") for j in range(n)])
    layer.load_state_dict(block)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(c.hidden_size, c.rms_norm_eps)
        norms[name].weight.data.copy_(own[f"{name}.weight"])
    seen = {}
    hook = hf.model.norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    with torch.no_grad():
        hf(ids)
        hook.remove()
        h, emb = seen["h"][:, :-1], hf.model.embed_tokens(ids[:, 1:])
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](h)], -1) @ own["eh_proj.weight"].T
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        out = layer(x, attention_mask=None, position_ids=positions,
                    position_embeddings=hf.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(norms["shared_head.norm"](out))


def test_depth_exports_imports_and_matches_a_transformers_reference(tmp_path):
    hf_model(V3).save_pretrained(tmp_path / "hf")
    cfg, model = ours_for(tmp_path / "hf", ["model.mtp=1"])
    from internlm_core.model import count_parameters, get_model_spec, model_args
    assert count_parameters(model) == get_model_spec("DEEPSEEK_V3").num_parameters(model_args(cfg))  # depth counted
    # the main model's weights from a folder without MTP layers (its depth kept on purpose); the depth's stay random
    load_hf(model, tmp_path / "hf", strict=False, keep=("model.mtp",))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("mtp."):
                p.add_(torch.randn_like(p) * (0.1 if "norm" in n else 0.05))
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert conf["num_nextn_predict_layers"] == 1
    assert {"model.layers.3.enorm.weight", "model.layers.3.hnorm.weight", "model.layers.3.eh_proj.weight",
            "model.layers.3.shared_head.norm.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.3.mlp.experts.7.down_proj.weight"} <= set(saved)
    assert torch.equal(saved["model.layers.3.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(saved["model.layers.3.shared_head.head.weight"], saved["lm_head.weight"])
    # the exported folder: transformers reads the main model (and ignores the MTP layer); ours reads it all back
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert config_from_hf(tmp_path / "out")["mtp"] == 1
    cfg_back, back = ours_for(tmp_path / "out")
    load_hf(back, tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    # the depth's logits against DeepSeek's formula on transformers' decoder layer (one document per row)
    torch.manual_seed(1)
    ids = torch.randint(0, V3["vocab_size"], (2, 24))
    mtp_ids = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=ids.dtype)], 1).unsqueeze(-1)
    with torch.no_grad():
        back.eval()(ids, mtp_ids=mtp_ids)
    (ours,) = pop_mtp_logits(mtp_module(back))
    reference = _reference_depth(hf, tmp_path / "out", ids)
    assert (ours[:, :-1] - reference).abs().max().item() <= 1e-4
    # a copy of the embedding that is not the embedding is refused (ours share one tensor)
    saved["model.layers.3.embed_tokens.weight"] = saved["model.layers.3.embed_tokens.weight"] + 1
    save_file(saved, tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.3.embed_tokens.weight differs from model.embed_tokens"):
        load_hf(build_model(cfg_back), tmp_path / "out")
