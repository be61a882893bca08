"""The name a scraped engine gets in the timeline: it is printed everywhere (the live view's
panel titles, which rich reads as markup, the plot, the report), so it is made of safe
characters whoever chose it, and a URL's credentials are never part of it."""

from __future__ import annotations

import pytest

from replay.metrics.scrape import MetricsSource, engine_name


@pytest.mark.parametrize("name", ["[/]", "[bold]P", "P\x1b[2J", "$\\frac{$"])
def test_a_name_a_target_gives_its_upstream_is_made_safe_as_a_label_is(name: str):
    """A proxy's /health names its upstreams; one named "[/]" crashed the live view
    (rich's MarkupError, exit 1)."""
    got = engine_name(MetricsSource("http://127.0.0.1:8100/metrics", name), "0", 1)
    assert not set(got) & set("[]$\\{}\x1b"), got
    assert engine_name(MetricsSource("http://127.0.0.1:8100/metrics", "P"), "0", 1) == "P"


def test_a_url_without_a_name_names_its_engine_by_host_and_port_never_its_credentials():
    source = MetricsSource.parse("http://carol:pw9@127.0.0.1:8100/metrics")
    assert engine_name(source, "", 1) == "127.0.0.1:8100"
    assert engine_name(source, "1", 1) == "127.0.0.1:8100:1"
