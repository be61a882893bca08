"""Who may reach `serve --http`: beyond loopback only with --api-key, or knowingly with
--insecure (warned about); refused before any engine starts, as the zmq address is."""

from __future__ import annotations

import pytest

from replay.openai.bearer import CredentialError
from replay.serve.fronts import HttpServe
from replay.serve.http_front import HttpFrontOptions


def _serve_without_engines(monkeypatch, *args: str):
    """`kvdrain serve ARGS`, failing the test if it gets as far as starting engines."""
    from click.testing import CliRunner

    import replay.commands.serve
    from cli import cli

    def no_engines(*a, **k):
        raise AssertionError("the engines were started before the check")

    monkeypatch.setattr(replay.commands.serve, "start_topology", no_engines)
    return CliRunner().invoke(
        cli, ["serve", "--runner", "mock", "--no-live", *args], catch_exceptions=False
    )


@pytest.mark.parametrize("http", ["0.0.0.0:0", "[::]:0", "10.1.2.3:0", "example.com:0"])
def test_http_beyond_loopback_without_an_api_key_is_refused_before_any_engine_starts(
    monkeypatch, http: str
):
    result = _serve_without_engines(monkeypatch, "--http", http)
    assert result.exit_code == 2, result.output
    assert "listens beyond this machine with no credential: give --api-key KEY" in result.output


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "::1", "localhost"])
def test_http_on_loopback_needs_no_credential(host: str):
    assert HttpServe(HttpFrontOptions(host, 0), "m").warnings == []


def test_http_beyond_loopback_with_an_api_key_or_insecure():
    assert HttpServe(HttpFrontOptions("0.0.0.0", 0, api_key="k"), "m").warnings == []
    warnings = HttpServe(HttpFrontOptions("0.0.0.0", 0), "m", insecure=True).warnings
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: --insecure: HTTP on 0.0.0.0")
    with pytest.raises(CredentialError, match="--http 0.0.0.0: listens beyond this machine"):
        HttpServe(HttpFrontOptions("0.0.0.0", 0), "m")
