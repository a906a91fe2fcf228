"""Checkpoint files that must not load, each refused with an error naming the file: paths leading
out of the checkpoint directory (config.json's too), files that are not regular files, damaged
safetensors, config.json that is not JSON or gives an impossible MoE layout, and `.bin` files
holding pickled objects (whose refusal never suggests `weights_only=False`)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_rollout.model import checkpoint as ckpt

CONFIG = dict(vocab_size=32, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=24,
              num_hidden_layers=1, max_position_embeddings=64, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny real Llama checkpoint (config.json + model.safetensors) and its loaded state."""
    path = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).save_pretrained(path)
    return path, ckpt.load_pretrained(path).state_dict()


def _config_only(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _index(dst, file_name, src):
    names = load_file(src / "model.safetensors").keys()
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: file_name for n in names}}))


def test_index_entries_leading_out_of_the_directory_are_refused(good, tmp_path):
    src, _ = good
    shutil.copytree(src, tmp_path / "other")
    ckpt_dir = _config_only(src, tmp_path / "ckpt")
    _index(ckpt_dir, "../other/model.safetensors", src)
    with pytest.raises(ValueError, match=r"weight_map names '\.\./other/model\.safetensors', outside the checkpoint "
                                         r"directory .*ckpt"):
        ckpt.load_pretrained(ckpt_dir)
    _index(ckpt_dir, str(tmp_path / "other" / "model.safetensors"), src)
    with pytest.raises(ValueError, match=r"weight_map names '/.*other/model\.safetensors', outside the checkpoint"):
        ckpt.load_pretrained(ckpt_dir)
    _index(ckpt_dir, "model.safetensors", src)  # a file of its own loads
    shutil.copy(src / "model.safetensors", ckpt_dir / "model.safetensors")
    ckpt.load_pretrained(ckpt_dir)


@pytest.mark.parametrize("indexed", [False, True])
def test_a_symlink_out_of_the_directory_is_refused(good, tmp_path, indexed):
    src, _ = good
    shutil.copytree(src, tmp_path / "other")
    ckpt_dir = _config_only(src, tmp_path / "ckpt")
    (ckpt_dir / "model.safetensors").symlink_to(tmp_path / "other" / "model.safetensors")
    if indexed:
        _index(ckpt_dir, "model.safetensors", src)
    with pytest.raises(ValueError, match=r"ckpt/model\.safetensors is a symlink to .*other/model\.safetensors, "
                                         r"outside the checkpoint directory"):
        ckpt.load_pretrained(ckpt_dir)


def test_a_config_json_linked_out_of_the_directory_is_refused(good, tmp_path):
    """The index's entries were checked, config.json was read wherever it pointed."""
    src, _ = good
    shutil.copytree(src, tmp_path / "ckpt")
    (tmp_path / "secret.json").write_text((src / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").unlink()
    (tmp_path / "ckpt" / "config.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(ValueError, match=r"ckpt/config\.json is a symlink to .*/secret\.json, outside the checkpoint "
                                         r"directory"):
        ckpt.load_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
@pytest.mark.parametrize("indexed", [False, True])
def test_a_fifo_in_place_of_a_file_is_refused(good, tmp_path, name, indexed):
    """A FIFO as model.safetensors blocked the loader forever (waiting for a writer)."""
    src, _ = good
    shutil.copytree(src, tmp_path / "ckpt")
    if indexed:
        _index(tmp_path / "ckpt", "model.safetensors", src)
    (tmp_path / "ckpt" / name).unlink()
    os.mkfifo(tmp_path / "ckpt" / name)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'ckpt' / name} is not a regular file \(a directory, FIFO, "
                                         r"socket or device\); a checkpoint is read from regular files only"):
        ckpt.load_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize("step", [0, -1])
def test_an_impossible_decoder_sparse_step_is_refused(step):
    """decoder_sparse_step 0 raised ZeroDivisionError."""
    config = transformers.Qwen3MoeConfig(**CONFIG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                         decoder_sparse_step=step)
    with pytest.raises(ValueError, match=rf"Qwen3MoeForCausalLM: decoder_sparse_step must be an integer >= 1 "
                                         rf".*got {step}; fix config.json"):
        ckpt.config_from_hf(config)


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_loads(good, tmp_path):
    src, state = good
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    shutil.copy(src / "model.safetensors", repo / "blobs" / "0123abcd")
    snapshot = _config_only(src, repo / "snapshots" / "main")
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    loaded = ckpt.load_pretrained(snapshot).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("damage", [
    lambda data: b"",
    lambda data: data[: len(data) // 2],
    lambda data: data[:6],
    lambda data: b"\x00" * 64,
    lambda data: b"not a safetensors file at all",
], ids=["empty", "truncated", "cut-header", "zeros", "text"])
@pytest.mark.parametrize("indexed", [False, True])
def test_damaged_safetensors_name_the_file(good, tmp_path, damage, indexed):
    src, _ = good
    bad = _config_only(src, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(damage((src / "model.safetensors").read_bytes()))
    if indexed:
        _index(bad, "model.safetensors", src)
    with pytest.raises(ValueError, match=rf"{bad / 'model.safetensors'}: not a readable safetensors file \(.*\); "
                                         r"it is empty, truncated or corrupt"):
        ckpt.load_pretrained(bad)


@pytest.mark.parametrize("text, message", [
    ('{"model_type": "llama",', r"not valid JSON \(Expecting property name enclosed in double quotes at line 1, "
                                r"column 24\)"),
    ("", r"not valid JSON \(Expecting value at line 1, column 1\)"),
    ("[1, 2]", "expected a JSON object, got list"),
])
def test_config_json_that_is_not_a_json_object_names_the_file(good, tmp_path, text, message):
    src, _ = good
    shutil.copytree(src, tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'c' / 'config.json'}: {message}"):
        ckpt.load_pretrained(tmp_path / "c")


def test_missing_config_and_damaged_index_name_the_file(good, tmp_path):
    src, _ = good
    shutil.copytree(src, tmp_path / "c")
    (tmp_path / "c" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'c' / 'config.json'} does not exist"):
        ckpt.load_pretrained(tmp_path / "c")
    shutil.copy(src / "config.json", tmp_path / "c" / "config.json")
    index = tmp_path / "c" / "model.safetensors.index.json"
    index.write_text("{oops")
    with pytest.raises(ValueError, match=rf"{index}: not valid JSON"):
        ckpt.load_pretrained(tmp_path / "c")
    index.write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(ValueError, match=rf"{index}: expected a 'weight_map' object"):
        ckpt.load_pretrained(tmp_path / "c")


class _Opaque:
    """A pickled Python object that no library registers with torch.serialization."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def test_bin_with_pickled_objects_is_refused_without_suggesting_weights_only_false(good, tmp_path):
    src, _ = good
    bad = _config_only(src, tmp_path / "bad")
    state = dict(load_file(src / "model.safetensors"))
    # An object of a class nobody allow-lists (megatron-core, once imported, registers
    # argparse.Namespace as a safe global for torch.load, so the suite's order decided this test).
    torch.save({**state, "args": _Opaque(lr=1.0)}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError) as info:
        ckpt.load_pretrained(bad)
    assert str(info.value).startswith(f"{bad / 'pytorch_model.bin'}: refused: it holds pickled Python objects")
    shown = [info.value] + [e for e in (info.value.__cause__, info.value.__context__) if e is not None
                            and not info.value.__suppress_context__]
    assert all("weights_only=False" not in str(e) and "weights_only" not in str(e) for e in shown)
    assert info.value.__suppress_context__ and info.value.__cause__ is None


def test_damaged_bin_names_the_file(good, tmp_path):
    src, _ = good
    bad = _config_only(src, tmp_path / "bad")
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x02garbage")
    with pytest.raises(ValueError, match=rf"{bad / 'pytorch_model.bin'}: not a readable PyTorch checkpoint"):
        ckpt.load_pretrained(bad)
    torch.save([1, 2], bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match=rf"{bad / 'pytorch_model.bin'}: expected a dict of tensor name -> tensor"):
        ckpt.load_pretrained(bad)
