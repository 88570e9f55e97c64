import socket

from deepinfer.transport import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    got = [ports.free_tcp_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    low = ports._ephemeral_low()
    for p in got:
        assert ports._LOWEST <= p < low or low - ports._LOWEST < 1_000
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # nothing else holds it
