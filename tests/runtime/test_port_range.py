"""`cpn agent --port-range LO-HI`: the range is checked and handed on through CPN_AGENT_PORT_RANGE;
free_port picks from it (skipping ports in use) or from anywhere without it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from cpn.cli.agent import agent_cmd
from cpn.runtime.launcher import ENV_PORT_RANGE, PortRange, agent_port_range, free_port


@pytest.fixture
def two_ports() -> Iterator[tuple[PortRange, socket.socket]]:
    """A range of two ports, the first held by a listener."""
    for low in range(43100, 43900, 2):
        held = socket.socket()
        try:
            held.bind(("", low))
            with socket.socket() as probe:
                probe.bind(("", low + 1))
        except OSError:
            held.close()
            continue
        held.listen()
        yield PortRange(low, low + 1), held
        held.close()
        return
    pytest.skip("no two free adjacent ports here")


def test_parse_names_the_fix() -> None:
    assert PortRange.parse(" 29400-29499 ") == PortRange(29400, 29499)
    assert str(PortRange(29400, 29499)) == "29400-29499"
    for bad in ("29400", "a-b", "29500-29400", "80-90", "60000-70000"):
        with pytest.raises(ValueError, match="LO-HI"):
            PortRange.parse(bad)


def test_free_port_comes_from_the_range_and_skips_ports_in_use(two_ports: tuple[PortRange, socket.socket]) -> None:
    port_range, held = two_ports
    assert {free_port(port_range) for _ in range(10)} == {port_range.high}
    with socket.socket() as other:
        other.bind(("", port_range.high))
        with pytest.raises(OSError, match=f"no free TCP port in --port-range {port_range}"):
            free_port(port_range)
    assert free_port() not in (0, held.getsockname()[1])  # no range: any free port, as before


def test_agent_port_range_reads_the_agents_setting() -> None:
    assert agent_port_range({}) is None
    assert agent_port_range({ENV_PORT_RANGE: "30000-30099"}) == PortRange(30000, 30099)


def test_the_agent_option_checks_the_range_and_hands_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PORT_RANGE, "")  # restored after the test: the option sets it in this process
    bad = CliRunner().invoke(agent_cmd, ["--cluster", "c", "--local", "--port-range", "9-5"])
    assert bad.exit_code == 2 and "--port-range" in bad.output and "LO-HI" in bad.output
    # valid: set for the work loop and drivers (the command then stops at the missing server)
    CliRunner().invoke(agent_cmd, ["--cluster", "c", "--port-range", "30000-30099"])
    assert agent_port_range() == PortRange(30000, 30099)
