"""``python -m kvbridge.router`` / ``kvbridge router`` as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
from router_fakes import FakeInstance, ServerThread, closed_port

from kvbridge.router import RouterConfig


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.router", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_check_prints_the_resolved_config(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"prefill": ["a:1"], "decode": ["b:2"], "port": 9001}))
    r = run_cli("--config", str(f), "--decode", "c:3", "--prefill-timeout", "7", "--check")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["prefill"] == ["http://a:1"] and cfg["decode"] == ["http://c:3"]
    assert cfg["port"] == 9001 and cfg["prefill_timeout_s"] == 7


def test_bad_arguments_exit_2_with_a_message():
    r = run_cli("--prefill", "http://a:1")
    assert r.returncode == 2 and "--decode" in r.stderr
    r = run_cli("--decode", "http://a:1", "--prefill", "http://a:1")
    assert r.returncode == 2 and "both a prefill and a decode" in r.stderr


def test_kvbridge_router_command_is_registered():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="kvbridge.commands") if e.name == "router"]
    assert ep.value == "kvbridge.router.cli:router_command"


def test_served_router_process_answers(tmp_path):
    p, d = FakeInstance("p0"), FakeInstance("d0")
    with ServerThread(p.app) as sp, ServerThread(d.app) as sd:
        port = closed_port()
        log = open(tmp_path / "router.log", "w")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge.router", "--prefill", sp.url,
                                 "--decode", sd.url, "--port", str(port), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            end = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < end, (tmp_path / "router.log").read_text()
                time.sleep(0.1)
            r = httpx.post(url + "/v1/completions", json={"prompt": "cli"}, trust_env=False)
            assert r.json()["choices"][0]["text"] == "cli|p0"
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def test_served_router_keeps_idle_client_connections_longer_than_client_pools(monkeypatch):
    """Client pools (httpx, the OpenAI SDK) drop idle connections after 5 s, uvicorn's own
    default keep-alive: a client request could meet a connection the router is closing."""
    import uvicorn

    from kvbridge.router.app import serve

    seen: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    serve(RouterConfig(prefill=(), decode=("http://127.0.0.1:1",)))
    client_expiry = httpx.Limits().keepalive_expiry
    assert client_expiry is not None and seen["timeout_keep_alive"] > 10 * client_expiry
