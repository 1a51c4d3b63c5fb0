"""The backend conformance suite (swarmkit.testing), run for every backend available here."""

from __future__ import annotations

import importlib.util

import pytest

from swarmkit.testing import CONFORMANCE_CHECKS, BackendConformance, build_test_model

#: where the hf engine runs in these tests (SWARMKIT_TEST_DEVICE=cuda runs the suite on a GPU, float32)
TEST_DEVICE = __import__("os").environ.get("SWARMKIT_TEST_DEVICE", "cpu")

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _hf_backend():
    from swarmkit_plugins.backend_hf.engine import HFBackend

    return HFBackend, {"name": "hf", "device": TEST_DEVICE, "dtype": "float32", "batch_wait_s": 0.01,
                       "max_batch_size": 32}


BACKENDS = {"hf": _hf_backend}
if importlib.util.find_spec("vllm") is not None:  # the vllm plugin adds itself here when present
    try:
        from swarmkit_plugins.backend_vllm.engine import conformance_backend as _vllm_conformance

        # on a GPU the float32 engine (vLLM's CUDA LoRA kernels take no float32: adapters are merged)
        BACKENDS["vllm"] = lambda: _vllm_conformance(TEST_DEVICE, lora=TEST_DEVICE == "cpu")
    except ImportError:  # pragma: no cover - plugin not written yet
        pass


#: (backend, architecture): hf also runs the suite on a Llama model (SmolLM2's architecture: its mask handling
#: differs from Qwen2's, and the engine's slot attention must serve both)
CASES = [(name, "qwen2") for name in sorted(BACKENDS)] + [("hf", "llama")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] if c[1] == "qwen2" else f"{c[0]}-{c[1]}")
def conformance(request, tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    name, arch = request.param
    folder = build_test_model(tmp_path_factory.mktemp(f"conformance-model-{arch}"), arch=arch)
    backend_cls, config = BACKENDS[name]()
    with BackendConformance.started(backend_cls, config=config,
                                    model={"path": str(folder), "max_context": 1024},
                                    reference_dir=folder, tol=1e-3) as suite:
        yield suite


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS)
def test_backend_conformance(conformance, check):
    conformance.run(check)
