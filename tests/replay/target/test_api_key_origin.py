"""--api-key goes to the target's origin only: a URL the target names (a proxy's /health
upstreams) is scraped without it, and one on another host than the target's is not
fetched at all: the replay refuses it, naming the --metrics flag that gives it."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from tests.http_utils import serving_in_thread
from tests.replay.target.test_hostile_server import LeakyPD, invoke_replay

pytestmark = pytest.mark.timeout(90)
KEY = "sekrit"


class Recording:
    """A server that records the Authorization header of every request, by path."""

    def __init__(self, app: web.Application) -> None:
        self.seen: list[tuple[str, str | None]] = []

        @web.middleware
        async def record(request: web.Request, handler):
            self.seen.append((request.path, request.headers.get("Authorization")))
            return await handler(request)

        app.middlewares.append(record)
        self.app = app

    def keyed(self) -> list[str]:
        return [path for path, auth in self.seen if auth is not None]


def proxy_naming(upstream: str) -> web.Application:
    """A P/D front (LeakyPD's completions) whose /health names `upstream` as its engine P."""
    app = LeakyPD(0.0, 0.05).app()

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "upstreams": {"P": {"url": upstream}}})

    app.router.add_get("/health", health)
    return app


def test_the_api_key_goes_to_the_target_and_never_to_the_upstream_it_names(tmp_path: Path):
    upstream = Recording(LeakyPD(0.0, 0.05).app())
    with serving_in_thread(upstream.app) as upstream_url:
        target = Recording(proxy_naming(upstream_url))
        with serving_in_thread(target.app) as url:
            result = invoke_replay(url, tmp_path, "--api-key", KEY, "--tail", "0.3")
    assert result.exit_code in (0, 1, 3), result.output
    assert any(path == "/metrics" for path, _ in upstream.seen)  # it was scraped
    assert upstream.keyed() == [], upstream.seen[:5]
    assert {"/v1/models", "/v1/completions"} <= {
        path for path, auth in target.seen if auth == f"Bearer {KEY}"
    }


def test_an_upstream_on_another_host_is_refused_naming_the_flag_that_gives_it(tmp_path: Path):
    elsewhere = "http://192.0.2.7:8100"  # TEST-NET-1: never fetched
    target = Recording(proxy_naming(elsewhere))
    with serving_in_thread(target.app) as url:
        result = invoke_replay(url, tmp_path, "--api-key", KEY)
    assert result.exit_code == 2, result.output
    assert f"--metrics P={elsewhere}/metrics" in result.output
    assert "another host than the target's" in result.output
    assert "/v1/completions" not in [path for path, _ in target.seen]


def test_a_metrics_url_given_at_another_origin_is_scraped_without_the_key(tmp_path: Path):
    upstream = Recording(LeakyPD(0.0, 0.05).app())
    with serving_in_thread(upstream.app) as upstream_url:
        target = Recording(LeakyPD(0.0, 0.05).app())
        with serving_in_thread(target.app) as url:
            result = invoke_replay(
                url, tmp_path, "--api-key", KEY, "--metrics", f"P={upstream_url}/metrics"
            )
    assert result.exit_code in (0, 1, 3), result.output
    assert upstream.seen and upstream.keyed() == []
    assert "/v1/completions" in target.keyed()


@pytest.mark.parametrize(
    "url,target,followed",
    [
        ("http://127.0.0.1:8100/metrics", "http://127.0.0.1:8000", True),
        ("http://localhost:8100/metrics", "http://127.0.0.1:8000", True),
        ("http://[::1]:8100/metrics", "http://localhost:8000", True),
        ("http://10.0.0.5:8100/metrics", "http://10.0.0.5:8000", True),
        ("http://127.0.0.1:8100/metrics", "http://10.0.0.5:8000", False),  # its loopback
        ("http://10.0.0.6:8100/metrics", "http://10.0.0.5:8000", False),
        ("http://169.254.169.254/metrics", "http://127.0.0.1:8000", False),
    ],
)
def test_a_url_a_target_names_is_followed_only_on_its_own_host(
    url: str, target: str, followed: bool
):
    from replay.target.server_facts import is_followable

    assert is_followable(url, target) is followed
