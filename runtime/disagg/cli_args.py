"""The ``deepinfer serve`` flags of disaggregated serving (light: no torch at parser build)."""

from __future__ import annotations


def add_disagg_arguments(parser) -> None:
    g = parser.add_argument_group("disaggregated serving")
    g.add_argument("--disaggregated", action="store_true",
                   help="run prefill and decode engines as separate supervised processes on loopback")
    g.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill engines (default 1)")
    g.add_argument("--decode", type=int, default=1, metavar="M", help="decode engines (default 1)")
    g.add_argument("--failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="when an engine dies mid-request: recompute elsewhere (default) or fail it")
    g.add_argument("--pd-transport", choices=["ipc", "tcp"], default="ipc",
                   help="engine sockets: ipc (default) or tcp on 127.0.0.1 (the cross-host code path)")
    g.add_argument("--pd-decode-silence", type=float, default=15.0, metavar="S",
                   help="seconds a decode engine may stay silent after acknowledging a handoff before the "
                        "request is treated as lost there and recomputed/failed by --failure-policy (default 15)")
