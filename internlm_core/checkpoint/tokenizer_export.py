"""The run's tokenizer as Hugging Face tokenizer files: our byte tokenizer as a byte-level BPE `tokenizer.json`,
SentencePiece models and `tokenizer.json` files copied with a matching `tokenizer_config.json`."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError


@dataclass
class TokenizerExport:
    """What `write_tokenizer_files` wrote and the special-token ids for config.json."""

    files: list[Path]
    special_ids: dict
    note: str


def _byte_tokenizer_json(add_bos: bool) -> str:
    """A `tokenizers` tokenizer.json equal to our built-in byte tokenizer: ids 0..255 are UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    from ..data.tokenizers import BYTE_BOS, BYTE_EOS, BYTE_PAD

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte-level BPE
    # GPT-2's bytes_to_unicode: bytes that are printable map to themselves, the rest to 256+n in order
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    if set(chars.values()) != set(alphabet):
        raise CheckpointError("tokenizers' ByteLevel alphabet differs from GPT-2's byte mapping; cannot export "
                              "the byte tokenizer")
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True),
                            AddedToken("<pad>", special=True)])
    ids = {"<s>": tok.token_to_id("<s>"), "</s>": tok.token_to_id("</s>"), "<pad>": tok.token_to_id("<pad>")}
    if ids != {"<s>": BYTE_BOS, "</s>": BYTE_EOS, "<pad>": BYTE_PAD}:
        raise CheckpointError(f"byte tokenizer export: special ids came out as {ids}")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", BYTE_BOS)])
    return tok.to_str()


def _sentencepiece_normalizer(path: Path) -> Optional[tuple[str, bool]]:
    """(normalization rule name, remove_extra_whitespaces) of a SentencePiece model; None without protobuf."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
        proto = pb.ModelProto()
        proto.ParseFromString(path.read_bytes())
    except Exception:  # protobuf missing or an unexpected file: the note just lacks the warning
        return None
    return proto.normalizer_spec.name, bool(proto.normalizer_spec.remove_extra_whitespaces)


def write_tokenizer_files(spec: Optional[str], out_dir: str | os.PathLike, model_max_length: int,
                          add_bos: bool = True) -> TokenizerExport:
    """Write the tokenizer of a run into an HF folder.

    spec "byte": a `tokenizer.json` (byte-level BPE without merges: ids 0..255 are the UTF-8 bytes, <s> 256,
    </s> 257, <pad> 258) loadable with AutoTokenizer. A SentencePiece `.model`: copied as `tokenizer.model` with a
    LlamaTokenizer `tokenizer_config.json`. A `tokenizer.json`: copied with a PreTrainedTokenizerFast config.
    None (unknown): nothing is written and the note says so.
    """
    out = Path(out_dir)
    if spec is None:
        return TokenizerExport([], {}, "no tokenizer recorded in the run's config (key `tokenizer`): "
                                       "no tokenizer files written; pass --tokenizer to add them")
    from ..data.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer(spec)
    except Exception as e:  # DataError for a missing or unreadable file
        raise CheckpointError(f"tokenizer {spec!r}: {e}") from None
    files: list[Path] = []
    common = {"model_max_length": model_max_length, "add_bos_token": add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    if tok.name == "byte":
        (out / "tokenizer.json").write_text(_byte_tokenizer_json(add_bos))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", **common}
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        files.append(out / "tokenizer.json")
        note = "byte tokenizer: tokenizer.json with UTF-8 byte ids 0..255, <s>=256, </s>=257, <pad>=258"
    elif spec.endswith(".json") or (Path(spec).is_dir() and (Path(spec) / "tokenizer.json").is_file()):
        src = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
        shutil.copyfile(src, out / "tokenizer.json")
        t = tok.tok
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **common}
        if tok.bos_id is not None:
            cfg["bos_token"] = t.id_to_token(tok.bos_id)
        if tok.eos_id is not None:
            cfg["eos_token"] = t.id_to_token(tok.eos_id)
        cfg["add_bos_token"] = False  # a tokenizer.json carries its own post-processor
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": None}
        files.append(out / "tokenizer.json")
        note = f"tokenizer.json copied from {src}"
    else:
        src = Path(tok.name)
        shutil.copyfile(src, out / "tokenizer.model")
        sp = tok.sp
        # the model's own normalizer decides whether "▁" is prepended (Llama's yes, InternLM's V7_sft.model no)
        prefix = sp.encode("a", out_type=str)[0].startswith("\u2581")
        cfg = {"tokenizer_class": "LlamaTokenizer", "unk_token": sp.id_to_piece(sp.unk_id()),
               "legacy": False, "add_prefix_space": prefix, "sp_model_kwargs": {}, **common}
        if tok.bos_id is not None:
            cfg["bos_token"] = sp.id_to_piece(tok.bos_id)
        if tok.eos_id is not None:
            cfg["eos_token"] = sp.id_to_piece(tok.eos_id)
        pad = sp.pad_id()
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": pad if pad >= 0 else None}
        files.append(out / "tokenizer.model")
        note = f"SentencePiece model copied from {src} (LlamaTokenizer, add_prefix_space={prefix})"
        norm = _sentencepiece_normalizer(src)
        if norm is not None and (norm[0] != "identity" or norm[1]):
            note += (f"; WARNING: the model normalizes text ({norm[0]}, remove_extra_whitespaces={norm[1]}), which "
                     f"transformers' LlamaTokenizer does not do: ids differ on whitespace runs and some unicode")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    specials = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in cfg}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    files += [out / "tokenizer_config.json", out / "special_tokens_map.json"]
    return TokenizerExport(files, ids, note)
