"""Build an engine's ``SpecDecoding`` at start-up: the drafter's context ring, the measured SPS
table, the length policy.

    drafter   the family's ``DraftModel`` over the loaded target (``ModelFamily.build_drafter``)
    SPS       calibrate_sps over the engine's own runner and drafter (sps_calibration.py), at the
              request counts 1, 4, 16, .. max_num_seqs, before any request is taken
    policy    --spec-schedule: "confidence" (the length schedule over SPS with a floor on the accepted
              length), "throughput" (without the floor, drafter gated) or "fixed"

The calibration's context length is capped by the model length (a tiny engine has no room for
256 positions), and never below one block.
"""

from __future__ import annotations

import logging
import time

from deepinfer.engine.spec.decoding import SpecConfig, SpecDecoding
from deepinfer.engine.spec.draft_model import DraftModel
from deepinfer.engine.spec.proposer import DraftProposer
from deepinfer.engine.spec.sps_calibration import calibrate_sps
from deepinfer.engine.spec.sps_table import SpsTable

log = logging.getLogger(__name__)

CALIBRATION_CONTEXT = 256  # positions before the timed verify tokens


def build_spec_decoding(runner, drafter: DraftModel, *, num_draft_tokens: int, schedule: str, max_num_seqs: int,
                        max_model_len: int, block_size: int, max_num_batched_tokens: int,
                        sps: SpsTable | None = None) -> SpecDecoding:
    """``runner``: the plain ModelRunner (calibration runs scratch forwards through it);
    ``sps``: a table measured before (tests, benches), else calibrated here."""
    graphed = getattr(runner, "graphs", None) is not None
    # verify steps padded to token buckets where the target's forwards replay CUDA graphs
    config = SpecConfig(num_draft_tokens=num_draft_tokens, schedule=schedule, pad_to_buckets=graphed)
    # the drafter's pass is CUDA-graphed when the target's forwards are
    proposer = DraftProposer(drafter, num_slots=max_num_seqs, cuda_graphs=graphed)
    if sps is None:
        t0 = time.perf_counter()
        context = max(min(CALIBRATION_CONTEXT, max_model_len - num_draft_tokens - 2), 1)
        sps = calibrate_sps(runner, drafter, max_num_seqs=max_num_seqs, num_blocks=runner.blocks.num_blocks,
                            block_size=block_size, max_depth=num_draft_tokens, context=context,
                            graphed_pass=proposer.graphs)  # fmt: skip
        log.info("DSpark: SPS table over %s requests calibrated in %.1f s", list(sps.grid), time.perf_counter() - t0)
    proposer.draft_threads = dict(sps.draft_threads or {})
    return SpecDecoding(proposer, sps, config, max_verify_tokens=max_num_batched_tokens)
