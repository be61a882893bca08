"""`kvdrain top`'s options: --connect given an HTTP URL points at --metrics; a metrics URL
that never answers is a usage error."""

from __future__ import annotations

from click.testing import CliRunner

from cli import cli


def test_top_connect_given_an_http_url_says_what_it_takes_and_suggests_metrics():
    result = CliRunner().invoke(cli, ["top", "--connect", "http://127.0.0.1:8100/metrics"])
    assert result.exit_code == 2
    assert (
        "tcp://HOST:PORT" in result.output
        and "--metrics http://127.0.0.1:8100/metrics" in result.output
    )
    assert "Protocol not supported" not in result.output
    bare = CliRunner().invoke(cli, ["top", "--connect", "http://127.0.0.1:8100"])
    assert "--metrics http://127.0.0.1:8100/metrics" in bare.output  # advice that works as given


def test_top_metrics_at_a_url_that_never_answers_is_a_usage_error_naming_it():
    result = CliRunner().invoke(
        cli,
        ["top", "--metrics", "http://127.0.0.1:9/metrics", "--seconds", "0.3", "--interval", "0.1"],
    )
    assert result.exit_code == 2, result.output  # as replay's pre-flight and top --connect
    assert "http://127.0.0.1:9/metrics: no KV reading in" in result.output
