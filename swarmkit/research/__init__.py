"""Automated research (A3R): goal -> stages of blueprints -> parallel runs -> analysis -> report.

- :mod:`.blueprint`: the experiment blueprint schema and its validation.
- :mod:`.planner`: the offline leader (threshold, grid, successive halving, ablation).
- :mod:`.leader`: the LLM leader over an OpenAI-compatible chat endpoint.
- :mod:`.executor`: a stage as a Hydra multirun through the subprocess launcher.
- :mod:`.analysis`: each run's metric and curve, mean ± 95% CI over seeds.
- :mod:`.report`: report.md with tables, plots and the trace of decisions.
- :mod:`.campaign`: the resumable state machine; :mod:`.cli`: ``python -m swarmkit research``;
  :mod:`.studies`: ready-made studies (``study=min_batch``).

See docs/research.md.
"""
