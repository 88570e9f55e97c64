"""The ``deepinfer serve`` flags of disaggregated serving, and the failure-detection flags that
``deepinfer node`` shares with them (light: no torch at parser build)."""

from __future__ import annotations

import argparse

from deepinfer.runtime.failure_detector import (
    DEFAULT_MAX_SILENCE_S,
    DEFAULT_MIN_SILENCE_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_SUSPECT_PHI,
    DetectorSettings,
)

LOCAL_HEARTBEAT_INTERVAL_S = 0.2  # engines on one host: cheap beats, quick first estimates

# args attribute -> DetectorSettings field (the serve spellings carry a pd_ prefix)
_DETECTOR_FIELDS = {"heartbeat_interval": "interval_s", "suspect_phi": "suspect_phi", "min_silence": "min_silence_s",
                    "max_silence": "max_silence_s", "probe_timeout": "probe_timeout_s"}


def add_disagg_arguments(parser) -> None:
    g = parser.add_argument_group("disaggregated serving")
    g.add_argument("--disaggregated", action="store_true",
                   help="run prefill and decode engines as separate supervised processes on loopback")
    g.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill engines (default 1)")
    g.add_argument("--decode", type=int, default=1, metavar="M", help="decode engines (default 1)")
    g.add_argument("--encoders", type=int, default=0, metavar="K",
                   help="vision encoder nodes for a model that reads images (default 0); images are encoded there, "
                        "spread by pending image tokens, and their embeddings pushed to the prefill engines")
    g.add_argument("--failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="when an engine dies mid-request: recompute elsewhere (default) or fail it")
    g.add_argument("--pd-transport", choices=["ipc", "tcp"], default="ipc",
                   help="engine sockets: ipc (default) or tcp on 127.0.0.1 (the cross-host code path)")
    g.add_argument("--pd-decode-silence", type=float, default=15.0, metavar="S",
                   help="seconds a decode engine may stay silent after acknowledging a handoff before the "
                        "request is treated as lost there and recomputed/failed by --failure-policy (default 15)")
    add_detector_arguments(parser, prefix="pd-", defaults=DetectorSettings(interval_s=LOCAL_HEARTBEAT_INTERVAL_S))


def add_detector_arguments(parser, *, prefix: str = "", defaults: DetectorSettings | None = None) -> None:
    """Failure-detection flags (runtime/failure_detector.py). ``defaults`` None: the values left
    out come from the cluster config (``deepinfer node``)."""
    def default(field: str, fallback: float) -> str:
        if defaults is None:
            key = "heartbeat_interval_s" if field == "interval_s" else field
            return f"default: the cluster config's [cluster] {key}, else {fallback:g}"
        return f"default {getattr(defaults, field):g}"

    g = parser.add_argument_group(
        "peer failure detection" + (" (--disaggregated: gateway and engines)" if prefix else ""),
        "A silent peer is suspected once phi (how unlikely its silence is, given the heartbeat intervals seen "
        "so far) reaches the threshold, never before --{p}min-silence and always by --{p}max-silence; it is "
        "then probed on its control channel and declared down (its requests recomputed or failed) only if "
        "it does not answer within --{p}probe-timeout. A dead peer is down within max-silence + "
        "probe-timeout; a busy-but-alive one is not.".format(p=prefix))
    g.add_argument(f"--{prefix}heartbeat-interval", type=_seconds(">0"), default=None, metavar="S",
                   help=f"seconds between heartbeats ({default('interval_s', 0.5)})")
    g.add_argument(f"--{prefix}suspect-phi", type=_number(">0"), default=None, metavar="PHI",
                   help="suspicion threshold: phi 8 = a silence expected once in 10^8 intervals "
                        f"({default('suspect_phi', DEFAULT_SUSPECT_PHI)})")
    floor = "" if defaults is not None else "; at least the config's missed_beats x heartbeat_interval_s"
    g.add_argument(f"--{prefix}min-silence", type=_seconds(">0"), default=None, metavar="S",
                   help="silence always tolerated before suspicion, for stalls of a busy host "
                        f"({default('min_silence_s', DEFAULT_MIN_SILENCE_S)}{floor})")
    g.add_argument(f"--{prefix}max-silence", type=_seconds(">0"), default=None, metavar="S",
                   help="silence after which a peer is suspected whatever its history "
                        f"({default('max_silence_s', DEFAULT_MAX_SILENCE_S)})")
    g.add_argument(f"--{prefix}probe-timeout", type=_seconds(">=0"), default=None, metavar="S",
                   help="seconds a suspected peer has to answer a direct probe before it is declared down; "
                        f"0 declares it down on suspicion ({default('probe_timeout_s', DEFAULT_PROBE_TIMEOUT_S)})")


def detector_overrides(args, *, prefix: str = "") -> dict[str, float]:
    """The DetectorSettings fields the user gave on the command line."""
    attr_prefix = prefix.replace("-", "_")
    given = {field: getattr(args, attr_prefix + attr, None) for attr, field in _DETECTOR_FIELDS.items()}
    return {field: value for field, value in given.items() if value is not None}


def serve_detector(args) -> DetectorSettings:
    """``serve --disaggregated``'s detector: the --pd-* flags over the local defaults; ValueError
    (one line naming the flags' meaning) when they contradict each other."""
    base = {"interval_s": LOCAL_HEARTBEAT_INTERVAL_S}
    return DetectorSettings(**{**base, **detector_overrides(args, prefix="pd-")})


def _number(rule: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > 0 if rule == ">0" else value >= 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'> 0' if rule == '>0' else '>= 0'} and finite, got {text}")
        return value
    return parse


def _seconds(rule: str):
    parse_number = _number(rule)

    def parse(text: str) -> float:
        value = parse_number(text)
        if value > 3600:
            raise argparse.ArgumentTypeError(f"must be at most 3600 seconds, got {text}")
        return value
    return parse
