"""tools/convert2hf.py and HF import as a user meets them: sharded (FSDP, 2 processes) load and save, CLI export.

A Llama folder written by transformers is loaded into an FSDP-sharded model on 2 gloo ranks (loss equal to
HF's), saved from there as a sharded DCP checkpoint, and exported with the CLI: the exported folder gives the
logits of the original Hugging Face model.
"""

import json
import os

import pytest
import torch

from tests.helpers.launch import run_script, run_train

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

DRIVER = r'''
import json, sys
import torch
import torch.distributed as dist
from internlm_core.checkpoint import CheckpointManager
from internlm_core.checkpoint.hf import load_hf_llama
from internlm_core.checkpoint.hf import config_from_hf
from internlm_core.config import dump_yaml, load_config
from internlm_core.distributed import ParallelDims, destroy_distributed, init_distributed
from internlm_core.loss import FlashGPTLMLoss
from internlm_core.model import build_model, model_spec
from internlm_core.parallel import parallel_options, parallelize_model

hf_dir, ckpt_dir, out = sys.argv[1:4]
layout = sys.argv[4:]
launch = init_distributed(None)
keys = config_from_hf(hf_dir)
cfg = load_config("configs/tiny.py", ["model_type=LLAMA", "data.seq_len=64", "model.dtype=torch.float32",
                                      "tokenizer=byte", "data.micro_num=2", *layout, "ckpt.enable_save_ckpt=True",
                                      f"ckpt.save_ckpt_folder={ckpt_dir}",
                                      *[f"model.{k}={v}" for k, v in keys.items()]], world_size=launch.world_size)
dims = ParallelDims.from_config(cfg.parallel, launch.world_size)
dims.build_mesh("cpu")
built = parallelize_model(build_model(cfg), model_spec(cfg), parallel_options(cfg), dims)
model, pipeline = built if isinstance(built, tuple) else (built, None)
loaded = load_hf_llama(model, hf_dir)
shard = next(p for n, p in model.named_parameters() if n.endswith("attention.wq.weight"))
torch.manual_seed(4)
ids = torch.randint(0, cfg.model.vocab_size, (2, 64))
loss = None
if pipeline is None:  # (a pipeline stage has no whole forward: its export below is the check)
    with torch.no_grad():
        logits = model(ids)
        if hasattr(logits, "full_tensor"):  # vocab-parallel logits under tensor parallel
            logits = logits.full_tensor()
        loss = FlashGPTLMLoss(use_flash=False)(logits[:, :-1], ids[:, 1:])[0].item()
mgr = CheckpointManager(cfg.ckpt, rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
                        dims=dims, config_text=dump_yaml(cfg))
mgr.register_model(model)
mgr.save(7, "test")
mgr.close()
if launch.rank == 0:
    json.dump({"loss": loss, "loaded": len(loaded), "world": launch.world_size, "global_rows": shard.shape[0],
               "local_rows": shard.to_local().shape[0] if hasattr(shard, "to_local") else shard.shape[0]},
              open(out, "w"))
dist.barrier()
destroy_distributed()
'''


def write_hf_llama(path):
    conf = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    rms_norm_eps=1e-5, rope_theta=50000.0)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(conf).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("layout", [["parallel.zero1=-1"], ["parallel.tensor=2"], ["parallel.pipeline=2"]],
                         ids=["fsdp2", "tensor2", "pipeline2"])
def test_sharded_import_then_checkpoint_exports_to_the_same_model(tmp_path, layout):
    hf_dir, ckpt, out = tmp_path / "hf_in", tmp_path / "ckpt", tmp_path / "hf_out"
    hf = write_hf_llama(hf_dir)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    p = run_train([str(hf_dir), str(ckpt), str(tmp_path / "result.json"), *layout], nproc=2, script=str(driver))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["world"] == 2 and res["global_rows"] == 64
    if layout != ["parallel.pipeline=2"]:  # a pipeline rank holds whole tensors of half the layers
        assert res["local_rows"] * 2 == 64  # really sharded
    torch.manual_seed(4)
    ids = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        hf_loss = hf(ids, labels=ids).loss.item()
        hf_logits = hf(ids).logits
    if res["loss"] is not None:
        assert abs(res["loss"] - hf_loss) <= 1e-5, (res["loss"], hf_loss)
    assert len(list((ckpt / "7").glob("*.distcp"))) == 2  # one file per rank

    p = run_script("tools/convert2hf.py", [str(ckpt), str(out), "--max-shard-size", "100KB"], timeout=300,
                   extra_env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"newest complete checkpoint under {ckpt}: step 7" in p.stdout
    assert "key prefix 'model.'" in p.stdout and "byte tokenizer: tokenizer.json" in p.stdout
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (back(ids).logits - hf_logits).abs().max().item()
    assert diff <= 1e-4, diff
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hi")["input_ids"] == [256, ord("h"), ord("i")]


def test_train_then_export_equals_the_checkpointed_model(tmp_path):
    """train.py saves a checkpoint; the export's HF logits equal our model loaded by CheckpointManager."""
    from internlm_core.checkpoint import CheckpointManager
    from internlm_core.config import load_config
    from internlm_core.model import build_model
    from tests.helpers.launch import run_train

    ckpts, out = tmp_path / "ckpts", tmp_path / "hf"
    sets = ["data.total_steps=3", "data.valid_every=0", "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=3",
            f"ckpt.save_ckpt_folder={ckpts}", "tokenizer=byte", "model.vocab_size=320"]
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", *sets])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = run_script("tools/convert2hf.py", [str(ckpts / "3"), str(out)], timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"checkpoint of step 3: {ckpts / '3'}" in p.stdout and "INTERNLM -> LlamaForCausalLM" in p.stdout
    conf = json.loads((out / "config.json").read_text())
    assert conf["attention_bias"] is True and conf["torch_dtype"] == "float32"  # InternLM v1, fp32 run

    cfg = load_config("configs/tiny.py", sets)
    ours = build_model(cfg)
    mgr = CheckpointManager(cfg.ckpt)
    mgr.register_model(ours)
    mgr.load(str(ckpts / "3"), ("model",))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.manual_seed(5)
    ids = torch.randint(0, 320, (2, 128))
    ours.eval()
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    assert ours.layers["0"].attention.wo.bias.abs().max() > 0  # trained: the biases moved away from zero

    (ckpts / "3" / "COMPLETE").unlink()  # as if killed while writing
    p = run_script("tools/convert2hf.py", [str(ckpts / "3"), str(tmp_path / "x")], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == (f"error: checkpoint {ckpts / '3'} has no COMPLETE marker: it was interrupted while "
                                f"being written (or not written by train.py); convert an older one, or pass "
                                f"--allow-incomplete")


def test_convert_errors_are_one_line(tmp_path):
    p = run_script("tools/convert2hf.py", [str(tmp_path / "nope"), str(tmp_path / "out")], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == f"error: {tmp_path / 'nope'}: checkpoint folder not found"
    (tmp_path / "empty").mkdir()
    p = run_script("tools/convert2hf.py", [str(tmp_path / "empty"), str(tmp_path / "out")], timeout=120)
    assert p.returncode == 2
    assert "no complete checkpoint in it" in p.stderr and "Traceback" not in p.stderr


def test_train_py_imports_hf_llama_under_fsdp(tmp_path):
    """load_ckpt_info ckpt_type="hf_llama" through train.py on 2 FSDP ranks; with lr 0 the checkpoint it saves
    exports back to the very tensors of the Hugging Face folder."""
    from safetensors.torch import load_file

    from internlm_core.checkpoint.hf import config_from_hf
    from internlm_core.checkpoint.safetensors_io import read_hf_tensors
    from tests.helpers.launch import read_metrics, run_train

    hf_dir, ckpts, out = tmp_path / "hf_in", tmp_path / "ckpts", tmp_path / "hf_out"
    write_hf_llama(hf_dir)
    keys = config_from_hf(hf_dir)
    info = {"path": str(hf_dir), "content": ["model"], "ckpt_type": "hf_llama"}
    sets = ["model_type=LLAMA", *[f"model.{k}={v}" for k, v in keys.items()], "data.seq_len=64", "data.total_steps=1",
            "data.valid_every=0", "adam.lr=0.0", "lr_scheduler.eta_min=0.0", "parallel.zero1=-1",
            f"ckpt.load_ckpt_info={info!r}", "ckpt.auto_resume=False", "ckpt.enable_save_ckpt=True",
            f"ckpt.save_ckpt_folder={ckpts}",
            "ckpt.checkpoint_every=1"]
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", *sets], nproc=2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    first = read_metrics(tmp_path / "run")[0]["loss"]
    assert 4.0 < first < 7.5  # a random 300-token model: about ln(300) = 5.7
    p = run_script("tools/convert2hf.py", [str(ckpts), str(out), "--tokenizer", "none"], timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    original = read_hf_tensors(hf_dir)
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def test_export_from_s3(tmp_path, monkeypatch):
    """train.py saves to s3:// (moto on loopback); convert2hf reads the newest checkpoint from there."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from internlm_core.checkpoint import CheckpointManager
    from internlm_core.config import load_config
    from internlm_core.model import build_model
    from tests.helpers.launch import run_train

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        aws = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
        for k, v in aws.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3").create_bucket(Bucket="ckpts")
        sets = ["data.total_steps=2", "data.valid_every=0", "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=2",
                "ckpt.save_ckpt_folder=s3://ckpts/runs/tiny", f"ckpt.async_upload_tmp_folder={tmp_path / 'stage'}",
                "model_type=LLAMA", "model.num_kv_attention_heads=2", "tokenizer=byte", "model.vocab_size=300"]
        p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", *sets],
                      extra_env=aws)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        out = tmp_path / "hf"
        p = run_script("tools/convert2hf.py", ["s3://ckpts/runs/tiny", str(out)],
                           extra_env=aws, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "checkpoint of step 2: s3://ckpts/runs/tiny/2 (downloaded to " in p.stdout

        cfg = load_config("configs/tiny.py", sets)
        ours = build_model(cfg)
        mgr = CheckpointManager(cfg.ckpt)
        mgr.register_model(ours)
        mgr.load("s3://ckpts/runs/tiny", ("model",))
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(6))
        ours.eval()
        with torch.no_grad():
            assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    finally:
        server.stop()
