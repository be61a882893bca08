"""`kvdrain proxy`: a P/D proxy in front of vLLM servers. Runs in: proxy process.

Light to import (cli.py declares the verb with its Limits group): the proxy itself,
aiohttp and all, is imported when it runs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import click

from replay.commands.options import OptionGroup
from replay.verify.verdict import EXIT_INTERRUPTED, EXIT_USAGE
from replay.vllm.proxy_options import (
    MAX_BODY_BYTES,
    MAX_IN_FLIGHT,
    MIB,
    ProxyError,
    ProxyOptions,
    UpstreamTimeouts,
)


def _proxy_limits(
    connect_timeout: float,
    first_byte_timeout: float,
    idle_timeout: float,
    total_timeout: float,
    max_in_flight: int,
    max_body_mib: float,
) -> dict:
    """ProxyOptions' bounds from the Limits group's flags."""
    timeouts = UpstreamTimeouts(
        connect_s=connect_timeout,
        first_byte_s=first_byte_timeout,
        idle_s=idle_timeout,
        total_s=total_timeout,
    )
    body = int(max_body_mib * MIB)
    return {"timeouts": timeouts, "max_in_flight": max_in_flight, "max_body_bytes": body}


def _limit(flag: str, default: float, help: str, metavar: str = "S") -> Callable:
    kind = click.IntRange(min=1) if metavar == "N" else click.FloatRange(min=0, min_open=True)
    return click.option(
        flag, type=kind, default=default, show_default=True, metavar=metavar, help=help
    )


_TIMEOUTS = UpstreamTimeouts()
PROXY_LIMITS = OptionGroup(
    "Limits",
    "limits",
    (
        _limit("--connect-timeout", _TIMEOUTS.connect_s, "Connecting to a server."),
        _limit(
            "--first-byte-timeout",
            _TIMEOUTS.first_byte_s,
            "From sending to a server's first byte (a non-streamed answer's: its end).",
        ),
        _limit("--idle-timeout", _TIMEOUTS.idle_s, "Between two reads of an answer."),
        _limit("--total-timeout", _TIMEOUTS.total_s, "One whole exchange with a server."),
        _limit("--max-in-flight", MAX_IN_FLIGHT, "Requests at one server; beyond: 503.", "N"),
        _limit("--max-body-mib", MAX_BODY_BYTES / MIB, "A request body; beyond: 413.", "MIB"),
    ),
    build=_proxy_limits,
)


def proxy_main(
    prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], limits: dict, **options
) -> int:
    """`kvdrain proxy`: the exit status (130 on SIGINT, 143 on SIGTERM, 2 if it cannot
    listen); options: replay/vllm/proxy_options.py ProxyOptions' other fields."""
    from replay.openai.bearer import CredentialError
    from replay.vllm.proxy import check_listen

    try:
        proxy = ProxyOptions(prefill=prefill_urls, decode=decode_urls, **options, **limits)
        check_listen(proxy)
    except (ProxyError, CredentialError) as e:
        raise click.UsageError(str(e)) from None
    return serve_proxy(proxy)


def serve_proxy(options: ProxyOptions) -> int:
    """Serve until SIGINT or SIGTERM: 130 or 143; 2 if it cannot listen."""
    from replay.vllm.proxy import check_listen, run_proxy

    def say(line: str) -> None:
        print(line, flush=True)

    for warning in check_listen(options):
        print(warning, file=sys.stderr, flush=True)
    try:
        return asyncio.run(run_proxy(options, say))
    except OSError as e:
        print(
            f"kvdrain proxy: cannot listen on {options.host}:{options.port}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
