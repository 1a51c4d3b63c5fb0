"""Config schema of the ``scripted`` backend (group ``backend``, option ``scripted``)."""

from dataclasses import dataclass


@dataclass
class ScriptedBackendConfig:
    name: str = "scripted"
    #: the script file (YAML or JSON): replies by turn and rules on the new messages (docs/backends.md)
    script: str = ""
    #: seconds each call (and each streamed token) waits, to imitate a model's latency
    delay_s: float = 0.0

    def problems(self) -> list[str]:
        """The script is read and checked when the config is validated: a bad one never boots."""
        from swarmkit_plugins.backend_scripted.script import ScriptError, load_script

        out = []
        if self.delay_s < 0:
            out.append(f"backend.delay_s: must be >= 0, got {self.delay_s}")
        try:
            load_script(self.script)
        except ScriptError as exc:
            out.append(f"backend.script: {exc}")
        return out
