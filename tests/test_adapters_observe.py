"""Adapters in the status, the `status` command, Prometheus and the dashboard (live and of a run folder).

One real server process (the tiny model, ``model.adapters=[obs_e,obs_o]``) that has trained one step of
each adapter, with one ``obs_e`` episode waiting in the pool and one ``obs_o`` episode open.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cycle_e2e import TOKEN, _free_port, _stop, start_server  # noqa: E402

from swarmkit.client import SwarmClient  # noqa: E402

ADAPTERS = ["obs_e", "obs_o"]


def _chat(http: httpx.Client, url: str, key: str) -> None:
    r = http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 1.0})
    r.raise_for_status()


@pytest.fixture(scope="module")
def adapters_server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("adapters-observe")
    port = _free_port()
    server = start_server(run_dir, port)
    url = f"http://127.0.0.1:{port}"
    ctl = SwarmClient(url, token=TOKEN, retry_for=60)
    open_ep = None
    try:
        ctl.configure(["model=tiny", "model.lora_rank=4", f"model.adapters=[{','.join(ADAPTERS)}]",
                       "batching=c2", "batching.batch_size=1", "batching.rollouts_per_task=2",
                       "trainer.total_steps=0", "trainer.checkpoint_every=0"])
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=120)
        with httpx.Client(timeout=60) as http:
            for adapter in ADAPTERS:  # one group of two (rewards 0 and 1) per adapter: one step each
                for reward in (0.0, 1.0):
                    with ctl.episode(f"t-{adapter}", adapter=adapter) as ep:
                        _chat(http, url, ep.api_key)
                        ep.report(reward)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                steps = {n: a["step"] for n, a in ctl.status()["pool"]["adapters"].items()}
                if all(s == 1 for s in steps.values()):
                    break
                time.sleep(0.3)
            assert steps == {"obs_e": 1, "obs_o": 1}, steps
            with ctl.episode("t-wait", adapter="obs_e") as ep:  # half a group: it waits in the pool
                _chat(http, url, ep.api_key)
                ep.report(0.5)
            open_ep = ctl.register("t-open", adapter="obs_o")  # open: running
            _chat(http, url, open_ep.api_key)
        yield url, ctl, run_dir
    finally:
        if open_ep is not None:
            open_ep.abort()
        _stop([server])
        ctl.close()


def test_status_and_status_command_show_each_adapter(adapters_server):
    from swarmkit.apps.monitor import status_line, status_text

    _, ctl, _ = adapters_server
    st = ctl.status()
    a = st["pool"]["adapters"]
    assert {n: (v["step"], v["policy_version"], v["waiting"], v["running"]) for n, v in a.items()} == {
        "obs_e": (1, 1, 1, 0), "obs_o": (1, 1, 0, 1)}
    assert a["obs_e"]["reward_mean"] == pytest.approx(0.5) and a["obs_o"]["reward_mean"] == pytest.approx(0.5)
    assert "adapters obs_e s1 w1, obs_o s1 w0" in status_line(st)
    text = status_text(st)
    assert "adapter obs_e: step 1  policy v1  waiting 1  running 0  last reward 0.500" in text
    assert "adapter obs_o: step 1  policy v1  waiting 0  running 1" in text


def test_prometheus_labels_each_adapters_series(adapters_server):
    from prometheus_client.parser import text_string_to_metric_families

    url, _, _ = adapters_server
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    samples = {(s.name, s.labels.get("adapter")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name.startswith("swarmkit_adapter_")}
    assert samples == {
        ("swarmkit_adapter_steps_total", "obs_e"): 1.0, ("swarmkit_adapter_steps_total", "obs_o"): 1.0,
        ("swarmkit_adapter_policy_version", "obs_e"): 1.0, ("swarmkit_adapter_policy_version", "obs_o"): 1.0,
        ("swarmkit_adapter_waiting_episodes", "obs_e"): 1.0, ("swarmkit_adapter_waiting_episodes", "obs_o"): 0.0,
        ("swarmkit_adapter_running_episodes", "obs_e"): 0.0, ("swarmkit_adapter_running_episodes", "obs_o"): 1.0,
        ("swarmkit_adapter_reward_mean", "obs_e"): 0.5, ("swarmkit_adapter_reward_mean", "obs_o"): 0.5}


def test_dashboard_lists_and_filters_episodes_by_adapter(adapters_server):
    url, _, _ = adapters_server
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        every = http.get("/api/v1/dashboard/episodes").json()
        assert every["adapters"] == ADAPTERS
        assert {r["adapter"] for r in every["episodes"]} == set(ADAPTERS)
        for name, count in (("obs_e", 3), ("obs_o", 3)):  # two trained + one waiting / one running
            rows = http.get("/api/v1/dashboard/episodes", params={"adapter": name}).json()["episodes"]
            assert len(rows) == count and {r["adapter"] for r in rows} == {name}, rows
        assert http.get("/api/v1/dashboard/episodes", params={"adapter": "nope"}).json()["episodes"] == []
        o = http.get("/api/v1/dashboard/overview").json()
        assert set(o["status"]["pool"]["adapters"]) == set(ADAPTERS)
        steps = [r for r in o["metrics"]["rows"] if r.get("kind") == "train"]
        assert sorted(k for r in steps for k in r if k.endswith("/step")) == ["adapter/obs_e/step", "adapter/obs_o/step"]
        assert any(r["adapter"] == "obs_o" for r in o["running"])


def test_run_folder_dashboard_knows_the_adapters(adapters_server):
    from swarmkit.server.dashboard.data import find_episodes
    from swarmkit.server.dashboard.source import RunDirSource

    _, _, run_dir = adapters_server
    src = RunDirSource(run_dir, TOKEN)
    eps = src.all_episodes()
    assert {e.adapter for e in eps} == set(ADAPTERS)
    assert {r["episode_id"] for r in find_episodes(eps, time.time(), adapter="obs_o")} == {
        e.id for e in eps if e.adapter == "obs_o"}
    adapters = src.status()["pool"]["adapters"]
    assert {n: (a["step"], a["reward_mean"]) for n, a in adapters.items()} == {"obs_e": (1, 0.5), "obs_o": (1, 0.5)}


def test_dashboard_adapter_filter_in_a_real_browser(adapters_server):
    from test_dashboard import CHROMIUM, _browser

    sync_playwright = _browser()
    url, _, _ = adapters_server
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"{url}/dashboard")
        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_selector("#adapters td")
        assert page.locator("#adapters td", has_text="obs_o").count() == 1
        assert page.locator("#charts h3", has_text="Reward per adapter").count() == 1
        page.select_option("#chart-adapter", "obs_e")  # the charts keep obs_e's step only
        page.goto(f"{url}/dashboard#/episodes")
        page.wait_for_selector("#adapter-label:not([hidden])")
        page.select_option("#adapter-filter", "obs_o")
        page.click("#filters button[type=submit]")
        deadline = time.monotonic() + 30  # polled from here (the page's CSP forbids evaluating strings)
        while page.locator("#episode-list tbody tr").count() != 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        cells = page.locator("#episode-list tbody td:nth-child(5)").all_text_contents()
        browser.close()
    assert cells == ["obs_o"] * 3, cells
    assert not problems, problems
