"""Weight files (swarmkit.weights): what the training group and the vLLM backend write and read."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from swarmkit.weights import load_weights, save_weights, weights_from_bytes, weights_to_bytes  # noqa: E402


def _tied() -> dict[str, object]:
    emb = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    return {"embed.weight": emb, "lm_head.weight": emb, "t.weight": emb.t()}  # shared storage, one not contiguous


def test_save_and_load_a_file_with_tied_tensors(tmp_path):
    path = tmp_path / "w.safetensors"
    save_weights(_tied(), path)
    got = load_weights(path)
    assert sorted(got) == ["embed.weight", "lm_head.weight", "t.weight"]
    assert torch.equal(got["lm_head.weight"], got["embed.weight"]) and torch.equal(got["t.weight"], _tied()["t.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # nothing left beside it


def test_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "w.safetensors"
    save_weights({"a": torch.ones(2)}, path)

    def half_then_fail(tensors, filename):
        with open(filename, "wb") as f:
            f.write(b"\x08\x00")
        raise OSError("no space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError, match="no space"):
        save_weights({"a": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert torch.equal(load_weights(path)["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_a_folder_and_bytes(tmp_path):
    save_weights({"a": torch.ones(2)}, tmp_path / "model-1.safetensors")
    save_weights({"b": torch.zeros(1)}, tmp_path / "model-2.safetensors")
    assert sorted(load_weights(tmp_path)) == ["a", "b"]
    assert torch.equal(weights_from_bytes(weights_to_bytes(_tied()))["lm_head.weight"], _tied()["embed.weight"])
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_weights(tmp_path / "empty")


def test_the_vllm_backend_writes_and_reads_its_weights_through_swarmkit_weights(tmp_path):
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend  # imports no vllm

    backend = VLLMBackend.__new__(VLLMBackend)
    backend._shm_dir, backend._base_named, backend._weights_folder, backend.model_dir = None, {}, None, tmp_path
    try:
        folder = backend._write_shm(list(_tied().items()))
        backend._write_shm([("x", torch.ones(1))])  # a new push replaces the files of the last one
        assert [p.name for p in sorted(backend._shm_dir.iterdir())] == ["model.safetensors"]
        backend._weights_folder = folder
        assert sorted(backend._base_state()) == ["x"]
    finally:
        shutil.rmtree(backend._shm_dir, ignore_errors=True)
    backend._weights_folder = None
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        backend._base_state()  # model_dir without weights


def test_the_vllm_backend_merges_an_adapter_into_base_weights_on_their_own_device(tmp_path):
    """Weights pushed from a GPU trainer stay on the GPU: merging a peft adapter into them (enable_lora
    off) adds the CPU-loaded delta on the base's device and keeps its dtype (``meta`` stands in for cuda)."""
    from safetensors.torch import save_file

    from swarmkit_plugins.backend_vllm.engine import VLLMBackend  # imports no vllm

    (tmp_path / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}')
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2)},
              str(tmp_path / "adapter_model.safetensors"))
    backend = VLLMBackend.__new__(VLLMBackend)
    base = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
            "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    backend._base_named, backend._weights_folder = {k: v.to("meta") for k, v in base.items()}, None
    merged = dict(backend._merge_adapter(tmp_path))
    q = merged["model.layers.0.self_attn.q_proj.weight"]
    assert q.device.type == "meta" and q.dtype == torch.bfloat16
    backend._base_named = base  # on CPU the values: scale (4 / 2) * B @ A = 2 * 2
    assert torch.equal(dict(backend._merge_adapter(tmp_path))["model.layers.0.self_attn.q_proj.weight"],
                       torch.full((4, 4), 4.0, dtype=torch.bfloat16))
