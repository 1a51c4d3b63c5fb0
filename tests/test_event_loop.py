"""No request stalls the server's event loop: a prompt too long for any context is refused before
it is rendered, and a large one is rendered in a worker thread, while ``/api/v1/health`` keeps
answering (a real uvicorn server on 127.0.0.1, scripted backend)."""

from __future__ import annotations

import gc
import threading
import time

import httpx
import pytest

from swarmkit.client import SwarmClient

TOKEN = "event-loop-admin-token-" + "x" * 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.testing.scripted import ScriptedBackend

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    config = validate_config(compose(["model=tiny", "model.max_context=60000"]), get_registry())
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("loop"))}},
                            config=config, backend_factory=lambda cfg: backend, train=False)
    with SwarmClient(h.url, token=TOKEN) as c:
        c.start()
        c.wait_for_state("ROLLING", timeout=30)
        yield h, c
    h.stop()


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            http.get(f"{url}/api/v1/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)


def _while_polling_health(url: str, call):
    """``call()``'s result and time, with /health's latencies meanwhile. The cyclic collector is off in
    that window: the server runs in this test process, whose heap is large late in a full run, and a
    full collection there (CI: /health 786 ms while a 0.98 s request ran) stops every thread, the event
    loop's included, whatever the request does."""
    stop, lat = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(url, stop, lat))
    gc.collect()
    gc.disable()
    poller.start()
    time.sleep(0.1)
    try:
        t0 = time.perf_counter()
        result = call()
        took = time.perf_counter() - t0
    finally:
        stop.set()
        poller.join()
        gc.enable()
    return result, took, lat


def test_a_prompt_longer_than_any_context_is_refused_before_rendering(server):
    h, client = server
    with client.episode("huge") as ep:
        body = {"messages": [{"role": "user", "content": "word " * 1_300_000}]}  # 6.5 MB, under the body cap
        r, took, lat = _while_polling_health(h.url, lambda: httpx.post(
            f"{ep.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {ep.api_key}"},
            timeout=60))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:200]
        assert took < 5.0
        assert lat and max(lat) < 0.1, f"/health took up to {max(lat):.3f} s"
        ep.report(0.0)


def test_a_large_prompt_is_rendered_off_the_event_loop(server, monkeypatch):
    h, client = server
    threads: list[tuple[int, int]] = []  # (characters rendered, thread) of every render
    renderer = h.swarm.renderer
    render = renderer.render_prompt

    def traced(messages, *args, **kwargs):
        threads.append((sum(len(str(m.get("content") or "")) for m in messages), threading.get_ident()))
        return render(messages, *args, **kwargs)

    monkeypatch.setattr(renderer, "render_prompt", traced)
    with client.episode("large") as ep:
        small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        httpx.post(f"{ep.base_url}/chat/completions", json=small, headers={"Authorization": f"Bearer {ep.api_key}"},
                   timeout=60).raise_for_status()
        body = {"messages": [{"role": "user", "content": "word " * 25_000}], "max_tokens": 2}  # 125 kB, 50k tokens
        r, took, lat = _while_polling_health(h.url, lambda: httpx.post(
            f"{ep.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {ep.api_key}"},
            timeout=120))
        loop_thread = h.thread.ident
        assert [t == loop_thread for n, t in threads] == [True, False], threads  # small on the loop, large off it
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["prompt_tokens"] > 40_000
        print(f"render {took:.2f} s, health max {max(lat) * 1000:.0f} ms over {len(lat)} polls")
        # the render took a while; health answered meanwhile (the GIL is shared, so not instantly)
        assert lat and max(lat) < max(0.25, took / 4), (took, max(lat))
        ep.report(0.0)


@pytest.mark.parametrize("route,body", [
    ("/completions", {"prompt": "word " * 1_300_000, "max_tokens": 2}),  # 6.5 MB of text
    ("tokenize", {"prompt": "word " * 1_300_000}),
    ("tokenize", {"messages": [{"role": "user", "content": "word " * 1_300_000}]}),
    ("/chat/completions", {"messages": [{"role": "user", "content": ""}] * 70_000, "max_tokens": 2}),  # > context
])
def test_what_cannot_fit_the_context_is_refused_at_once_on_every_route(server, route, body):
    """Issue 31: a 6.4 MB prompt froze /health for 16.5 s on /v1/completions and 14.3 s on /tokenize;
    more messages than the context has tokens are refused before rendering too."""
    h, client = server
    with client.episode("huge-" + route.strip("/")) as ep:
        url = f"{h.url}/tokenize" if route == "tokenize" else f"{ep.base_url}{route}"
        r, took, lat = _while_polling_health(h.url, lambda: httpx.post(
            url, json=body, headers={"Authorization": f"Bearer {ep.api_key}"}, timeout=60))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:200]
        assert took < 5.0
        assert lat and max(lat) < 0.1, f"/health took up to {max(lat):.3f} s"
        ep.report(0.0)


@pytest.mark.parametrize("route", ["/chat/completions", "/responses"])
def test_many_empty_messages_are_rendered_off_the_event_loop(server, route):
    """Issue 31: 20,000 empty chat messages (660 kB) froze the loop 27-66 s; 10,000 empty /v1/responses
    input items 17.9 s. Each message now counts as work, so such a request renders in the worker."""
    h, client = server
    n = 3_000
    with client.episode("many-" + route.strip("/")) as ep:
        if route == "/responses":
            body = {"input": [{"role": "user", "content": ""}] * n, "max_output_tokens": 2}
        else:
            body = {"messages": [{"role": "user", "content": ""}] * n, "max_tokens": 2}
        r, took, lat = _while_polling_health(h.url, lambda: httpx.post(
            f"{ep.base_url}{route}", json=body, headers={"Authorization": f"Bearer {ep.api_key}"}, timeout=300))
        assert r.status_code in (200, 400), r.text[:300]
        print(f"{route}: {n} empty messages, {took:.2f} s, health max {max(lat) * 1000:.0f} ms")
        assert lat and max(lat) < max(0.25, took / 4), (took, max(lat))
        ep.report(0.0)
