"""The dashboard against a real server that is training (tiny model, one task client process).

Auth is checked over HTTP (every dashboard route but the login form refuses a request
without the admin token or a session; the cookie is HttpOnly and SameSite=Strict); the
pages are checked in a real browser: Debian's ``chromium`` driven by Playwright
(``executable_path``: no browser download). Without chromium or playwright the browser
test skips, unless ``SWARMKIT_REQUIRE_BROWSER=1`` (CI sets it) makes that a failure.
Screenshots go to the test's temp folder, and to ``$SWARMKIT_SCREENSHOTS`` when set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cycle_e2e import TOKEN, _env, _free_port, _stop  # noqa: E402

from swarmkit.client import SwarmClient  # noqa: E402

CHROMIUM = os.environ.get("SWARMKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ROUTES = ["/metrics", "/api/v1/dashboard/overview", "/api/v1/dashboard/episodes", "/api/v1/dashboard/episodes/ep-x",
          "/dashboard/static/app.js", "/dashboard/static/app.css"]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """A server training the tiny model on token_rule, fed by one task client process."""
    run_dir = tmp_path_factory.mktemp("dashboard-run")
    port = _free_port()
    server = subprocess.Popen(  # its console output (a pipe: never wrapped) goes to server.out
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}",
         f"hydra.run.dir={run_dir}/hydra"],
        env=_env(), stdout=open(run_dir / "server.out", "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    ctl = SwarmClient(url, token=TOKEN, retry_for=60)
    ctl.wait_for_state("OFFLINE", timeout=60)
    ctl.configure(["model=tiny", "task=token_rule", "batching=c2", "batching.batch_size=2",
                   "batching.rollouts_per_task=2", "optim.lr=1e-3",
                   # train until stopped: the browser test watches the step move, which a finished
                   # run (the default 20 steps, reached within a minute on a fast machine) never does
                   "trainer.total_steps=0"])
    ctl.start()
    ctl.wait_for_state("ROLLING", timeout=120)
    client = subprocess.Popen(
        [sys.executable, "-m", "swarmkit.apps.task_client", "--url", url, "--task", "token_rule",
         "--train-size", "8", "--rollouts-per-task", "2", "--max-tokens", "6", "--concurrency", "2",
         "--eval-every", "2", "--eval-size", "2", "--client-id", "dash-client"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=open(run_dir / "client.err", "ab"))
    try:
        deadline = time.monotonic() + 120
        while ctl.status()["global_step"] < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert ctl.status()["global_step"] >= 2
        yield url, ctl, run_dir
    finally:
        _stop([client, server])
        ctl.close()


def test_every_dashboard_route_needs_the_token_or_a_session(training):
    url, _, _ = training
    with httpx.Client(base_url=url) as http:
        form = http.get("/dashboard")
        assert form.status_code == 200 and 'action="/dashboard/login"' in form.text and TOKEN not in form.text
        assert "script" not in form.headers["content-security-policy"]
        for path in ROUTES:
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer wrong-token"}).status_code == 401, path
        assert http.get(ROUTES[0], headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        bad = http.post("/dashboard/login", data={"token": "wrong"})
        assert bad.status_code == 401 and "not this server's admin token" in bad.text and "set-cookie" not in bad.headers
        ok = http.post("/dashboard/login", data={"token": TOKEN}, follow_redirects=False)
        assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
        page = http.get("/dashboard")  # the cookie jar sends the session now
        assert page.status_code == 200 and "/dashboard/static/app.js" in page.text and TOKEN not in page.text
        assert "'self'" in page.headers["content-security-policy"]
        for path in ROUTES[:3] + ROUTES[4:]:
            assert http.get(path).status_code == 200, path
        assert TOKEN not in http.get("/dashboard/static/app.js").text
        assert http.get("/dashboard/static/../../server/app.py").status_code == 404
        http.post("/dashboard/logout", follow_redirects=False)
        assert http.get(ROUTES[0]).status_code == 401


def test_server_prints_one_line_per_step(training):
    """mode=server writes a line per step (trigger, reward, loss, samples, merge ratio, tokens, times),
    whole lines even into a pipe."""
    url, ctl, run_dir = training
    text = (run_dir / "server.out").read_text()
    assert f"dashboard: {url}/dashboard" in text
    lines = [line for line in text.splitlines() if "trigger c2 " in line]
    assert len(lines) >= 2, text[-3000:]
    for key in ("step ", "reward ", "loss ", "samples ", "merge ", "tokens ", "sync "):
        assert key in lines[-1], lines[-1]
    assert len(lines[-1]) > 80  # not wrapped at 80 columns


def test_prometheus_metrics_follow_training(training):
    from prometheus_client.parser import text_string_to_metric_families

    url, _, _ = training
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    state = {dict(k[1])["state"]: v for k, v in samples.items() if k[0] == "swarmkit_state"}
    assert sum(state.values()) == 1 and set(state) == {"OFFLINE", "BOOTING", "ROLLING", "ROLLING_POST",
                                                       "WEIGHT_SYNCING"}
    assert samples[("swarmkit_global_step", ())] >= 2 and samples[("swarmkit_policy_version", ())] >= 2
    assert samples[("swarmkit_episodes_total", (("outcome", "finished"),))] >= 4
    assert samples[("swarmkit_tokens_generated_total", ())] > 0 and samples[("swarmkit_tokens_trained_total", ())] > 0
    assert samples[("swarmkit_step_phase_duration_seconds_count", (("phase", "train"),))] >= 2
    assert ("swarmkit_pool_fill_target", (("unit", "tasks"),)) in samples
    chat = [v for (name, labels), v in samples.items() if name == "swarmkit_http_request_duration_seconds_count"
            and dict(labels)["route"] == "/v1/chat/completions" and dict(labels)["status"] == "2xx"]
    assert chat and chat[0] >= 4


def test_dashboard_data_follows_training(training):
    url, ctl, _ = training
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=auth) as http:
        o = http.get("/api/v1/dashboard/overview").json()
        assert o["status"]["global_step"] >= 2 and o["metrics"]["total"] >= 2
        assert {s["state"] for s in o["states"]} >= {"ROLLING", "ROLLING_POST", "WEIGHT_SYNCING"}
        assert any(c["client_id"] == "dash-client" for c in o["clients"])
        assert all(r["needed"] == 2 and r["episodes"] >= 1 for r in o["pool_tasks"])
        later = http.get("/api/v1/dashboard/overview", params={"after": o["metrics"]["total"]}).json()
        assert len(later["metrics"]["rows"]) == later["metrics"]["total"] - o["metrics"]["total"]
        rows = http.get("/api/v1/dashboard/episodes", params={"status": "finished", "kind": "train"}).json()["episodes"]
        assert rows and all(r["status"] == "finished" and not r["eval"] for r in rows)
        low = http.get("/api/v1/dashboard/episodes", params={"max_reward": 0.1}).json()["episodes"]
        assert all(r["reward"] is not None and r["reward"] <= 0.1 for r in low)
        assert http.get("/api/v1/dashboard/episodes", params={"min_reward": "nan"}).status_code == 422
        ep = http.get(f"/api/v1/dashboard/episodes/{rows[0]['episode_id']}").json()
        assert ep["episode"]["episode_id"] == rows[0]["episode_id"] and ep["timelines"] and ep["samples"]
        raw = http.get(f"/api/v1/episodes/{rows[0]['episode_id']}/timelines").json()["timelines"]
        for view, tl in zip(ep["timelines"], raw, strict=True):
            tokens = [t for b in view["blocks"] for t in b["tokens"]]
            assert [t[1] for t in tokens] == [i for b in tl["blocks"] for i in b["token_ids"]]
            assert [t[3] for t in tokens] == [m for b in tl["blocks"] for m in b["loss_mask"]]
            assert "".join(t[0] for t in tokens if t[3]) == "".join(b["text"] for b in tl["blocks"] if b["author"] == "llm")


def _browser():
    need = os.environ.get("SWARMKIT_REQUIRE_BROWSER") == "1"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if need:
            raise
        pytest.skip("playwright is not installed (pip install playwright)")
    if CHROMIUM is None:
        if need:
            raise AssertionError("no chromium: apt-get install chromium, or set SWARMKIT_CHROMIUM")
        pytest.skip("no chromium (apt-get install chromium)")
    return sync_playwright


def _step(page) -> int:
    return int(page.text_content("#headline").split("step ")[1].split()[0])


def _shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    out = os.environ.get("SWARMKIT_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)
    return path


def test_dashboard_in_a_real_browser(training, tmp_path):
    sync_playwright = _browser()
    url, ctl, _ = training
    episode = httpx.get(f"{url}/api/v1/dashboard/episodes", params={"status": "finished", "kind": "train"},
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()["episodes"][0]
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"{url}/dashboard")
        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_selector("#state.s-ROLLING, #state.s-ROLLING_POST, #state.s-WEIGHT_SYNCING")
        assert page.evaluate("document.cookie") == ""  # HttpOnly: no script sees the session
        page.wait_for_selector("#charts .chart svg path")
        step0 = _step(page)
        deadline = time.monotonic() + 60  # (polled from here: the page's CSP forbids evaluating strings)
        while _step(page) <= step0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _step(page) > step0, "the page did not follow training"
        paths = page.locator("#charts .chart").first.locator("svg path").count()
        assert paths >= 1, "the reward chart drew no line"
        assert page.locator("#clients td", has_text="dash-client").count() == 1
        _shot(page, tmp_path, "dashboard.png")

        page.goto(f"{url}/dashboard#/episode/{episode['episode_id']}")
        page.wait_for_selector(".timeline .tok")
        trained = page.locator(".timeline .tok.trained").count()
        assert trained == episode["tokens"] > 0, "trained tokens shown differ from the episode's"
        tip = page.locator(".timeline .tok.trained").first.get_attribute("title")
        assert "logprob" in tip and "policy v" in tip and "id " in tip
        page.click("text=Training samples")
        page.wait_for_selector(".timeline h3:has-text('sample 1')")
        _shot(page, tmp_path, "trajectory.png")

        page.goto(f"{url}/dashboard#/episodes")
        page.wait_for_selector("#episode-list table")
        boxes = page.locator("#episode-list input[type=checkbox]")
        boxes.nth(0).check()
        boxes.nth(1).check()
        page.click("#compare")
        page.wait_for_selector(".compare .episode:nth-child(2) .tok")
        html = page.content()
        browser.close()
    assert TOKEN not in html
    assert not problems, problems


# --------------------------------------------------------------------------- the pure parts
def test_sessions_expire_are_revoked_and_bounded():
    from swarmkit.server.dashboard.session import Sessions

    s = Sessions(ttl_s=10, max_sessions=2)
    a = s.issue(now=0)
    assert s.valid(a, now=5) and not s.valid(a, now=11) and not s.valid("made-up", now=5) and not s.valid(None)
    b, c = s.issue(now=1), s.issue(now=2)  # a third live session drops the oldest
    assert not s.valid(a, now=3) and s.valid(b, now=3) and s.valid(c, now=3)
    s.revoke(b)
    assert not s.valid(b, now=3) and len(a) >= 43  # 256 random bits


def test_state_spans_and_episode_filters():
    from swarmkit.server.dashboard.data import find_episodes, state_spans
    from swarmkit.swarm.episodes import Episode

    spans = state_spans([(0.0, "OFFLINE"), (2.0, "BOOTING"), (5.0, "ROLLING")], now=9.0)
    assert [(s["state"], s["seconds"]) for s in spans] == [("OFFLINE", 2.0), ("BOOTING", 3.0), ("ROLLING", 4.0)]
    eps = [Episode(id=f"ep-{i}", task_id=f"task-{i % 2}", eval=i == 3, client_id=f"c{i % 2}", created=float(i),
                   deadline=99.0, keys={}, roles=["spy"] if i == 1 else [], reward=[0.0, 1.0, None, 0.5][i],
                   status="finished" if i < 3 else "running") for i in range(4)]
    ids = lambda **kw: [r["episode_id"] for r in find_episodes(eps, 10.0, **kw)]  # noqa: E731
    assert ids() == ["ep-3", "ep-2", "ep-1", "ep-0"]
    assert ids(task="task-1") == ["ep-3", "ep-1"] and ids(client="c0") == ["ep-2", "ep-0"]
    assert ids(role="spy") == ["ep-1"] and ids(kind="eval") == ["ep-3"] and ids(status="running") == ["ep-3"]
    assert ids(min_reward=0.5) == ["ep-3", "ep-1"] and ids(max_reward=0.0) == ["ep-0"] and ids(limit=1) == ["ep-3"]


def test_pool_tasks_count_what_the_trigger_counts():
    from swarmkit.server.dashboard.data import pool_tasks

    rows = pool_tasks([("a", "f", 1.0), ("b", "f", 0.0), ("a", "f", 0.0), ("b", "f", 0.0), ("a", "f", 1.0)], 4)
    assert rows == [{"task_id": "a", "family": "f", "episodes": 3, "needed": 4, "rewards_differ": True},
                    {"task_id": "b", "family": "f", "episodes": 2, "needed": 4, "rewards_differ": False}]
    assert pool_tasks([("t", "g", {"civilian": 1, "spy": 0}), ("t", "g", {"spy": 0, "civilian": 1})], None) == [
        {"task_id": "t", "family": "g", "episodes": 2, "needed": None, "rewards_differ": False}]


def test_metrics_tail_reads_again_when_the_file_grows(tmp_path):
    from swarmkit.server.dashboard.data import MetricsTail

    tail = MetricsTail()
    assert tail.rows(None) == [] and tail.rows(tmp_path) == []
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2')  # the second line is still being written
    assert tail.rows(tmp_path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2}\n')
    assert [r["step"] for r in tail.rows(tmp_path)] == [1, 2]


def test_monitor_serves_the_dashboard_of_a_run_folder(training):
    """``python -m swarmkit monitor RUN_DIR``: the same JSON, read from the run's files."""
    url, ctl, run_dir = training
    live = httpx.get(f"{url}/api/v1/dashboard/overview", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    proc = subprocess.Popen([sys.executable, "-m", "swarmkit", "monitor", str(run_dir), "--port", "0",
                             "--model", "builtin:tiny"], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"dashboard of {run_dir}: http://127.0.0.1:"), first
        assert "SWARMKIT_ADMIN_TOKEN" in proc.stdout.readline()
        base = first.split(": ", 1)[1].strip().removesuffix("/dashboard")
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            deadline = time.monotonic() + 20
            while True:
                try:
                    o = http.get("/api/v1/dashboard/overview").json()
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            assert o["live"] is False and "not live" in o["status"]["source"]
            assert isinstance(o["pool_tasks"], list)
            assert o["status"]["global_step"] >= live["status"]["global_step"] - 1 >= 1
            assert o["metrics"]["total"] >= 2 and {s["state"] for s in o["states"]} >= {"BOOTING", "ROLLING"}
            rows = http.get("/api/v1/dashboard/episodes", params={"status": "trained"}).json()["episodes"]
            assert rows and all(r["status"] == "trained" for r in rows)
            ep = http.get(f"/api/v1/dashboard/episodes/{rows[0]['episode_id']}").json()
            tokens = [t for b in ep["timelines"][0]["blocks"] for t in b["tokens"]]
            assert all(isinstance(t[1], int) for t in tokens) and any(t[3] for t in tokens)
            assert http.get("/api/v1/dashboard/episodes/ep-nope").status_code == 404
            assert httpx.get(f"{base}/api/v1/dashboard/overview").status_code == 401
            assert httpx.get(f"{base}/metrics").status_code == 404  # the live server's only
    finally:
        proc.terminate()
        proc.wait(10)


def test_status_command_prints_and_watches(training):
    url, _, _ = training
    once = subprocess.run([sys.executable, "-m", "swarmkit", "status", "--url", url], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 0 and "step" in once.stdout and "policy v" in once.stdout, once.stderr
    proc = subprocess.Popen([sys.executable, "-m", "swarmkit", "status", "--url", url, "--watch", "--interval", "0.3"],
                            env=_env(), stdout=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.terminate()
    proc.wait(10)
    assert all(" step " in line and "pool " in line for line in lines), lines
    bad = subprocess.run([sys.executable, "-m", "swarmkit", "status", "--url", url],
                         env={k: v for k, v in _env().items() if k != "SWARMKIT_ADMIN_TOKEN"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "admin token" in bad.stderr


def test_token_pieces_join_to_the_decoded_text():
    """Each token's piece of text; together they are the block's text, even where a character spans
    tokens (byte-level pieces of one UTF-8 character) or a merge depends on the tokens before."""
    import random

    from transformers import AutoTokenizer

    from swarmkit.models import tiny_model_dir
    from swarmkit.server.dashboard.data import token_pieces

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for text in ["héllo wörld 日本語 🎉 ok", "<|im_start|>user\n  two  spaces<|im_end|>", "naïve café ☕☕"]:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = token_pieces(decode, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == decode(ids) == text
    rnd = random.Random(0)
    for _ in range(300):
        ids = [rnd.randrange(len(tok)) for _ in range(rnd.randrange(1, 24))]
        assert "".join(token_pieces(decode, ids)) == decode(ids), ids
