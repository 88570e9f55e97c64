"""DSpark speculative decoding in an engine: the part ``EngineHooks.spec`` gives the core.

One step, and who does what (ARCHITECTURE.md, "The step timeline"; "DSpark"):

    loop thread   plan_lengths   before schedule(): the requests holding fresh drafts (proposed
                                 for their current position, nothing in flight) -> confidences
                                 [R, D] -> the length policy picks each one's verify length L
                                 across the batch (SPS(B) for R requests from the SpsTable) ->
                                 req.spec_token_ids = its first L drafts; the scheduler lays
                                 out [root, d_1 .. d_L] with 1 + L sample rows
    device thread (forward, sampling: verification is the sampler's, engine/sample/)
                  propose        the drafter reads the step's target features, keeps the
                                 accepted positions' rows in its context ring and drafts D
                                 tokens after each request's last accepted token
    loop thread   commit         counts drafted / verified / accepted per request and in total;
                                 keeps the new drafts for the next plan_lengths

Verification is exact: a draft is accepted when it equals the token the target's sampler draws
at its position (greedy: the argmax; sampled: the counter-based draw of (seed, position), see
engine/sample/sampler.py), and the first mismatch or the token after the last draft is the
target's own. For a deterministic proposal this is standard speculative rejection sampling
(accept d with probability min(1, p(d) / 1) = p(d), else draw from p without d, renormalised),
realised with the same noise as a non-speculative run: outputs with speculation on equal those
with it off, token for token, for every seed, whatever the batch. Rejected positions are rolled
back by the scheduler (num_computed_tokens, blocks past the need); every cache row, the SWA
rings, Engram's history ring and the drafter's context ring are position-addressed, and the
grammar advances only over committed tokens.

The drafter gate (schedule "throughput"): drafting costs a drafter pass every step and, below,
the step overlap. When the step being planned is not worth drafting after, its drafter pass is
skipped (the context ring is still written: a later proposal reads those positions). The test
is the schedule's own objective in steady state, over every decoding request of the step, with
its last known confidences (a request never drafted yet: the running mean of all proposals):

    draft after this step   iff   max_L E(L) x SPS_with_drafter(R + sum L)  >  R x SPS_target(R)

A skipped step has no fresh drafts to learn from, so after ``interval`` skipped steps in a row
one step drafts anyway (a probe); the interval doubles while probes find drafting not worth it
(1, 2, 4 .. MAX_PROBE_INTERVAL) and is reset to 1 when the test passes. A probe's drafts are
verified only if the test, run again on the confidences they bring, passes: with the gate closed
no step verifies (on the CPU the probes' drafts, verified at 43 % acceptance at 60 sequences,
cost more target time than they saved). "confidence" and "fixed" always draft and verify.

Verify buckets (a runner that replays CUDA graphs): a graph replays only a forward of the token
count it was captured with, and the schedule's total (requests + chosen drafts) changes nearly
every step. So there the total moves to a bucket (``cuda_graphs.shape_bucket``: four per octave): the one
above, filled with the next candidates in the schedule's own order (highest survival first,
``fill_budget``), or the one below, the lowest-survival chosen drafts dropped, whichever has the
better E x SPS(B) while keeping the policy's accepted-length floor. When every draft is already
in and the bucket below breaks the floor, the step stays as it is. ``fixed`` is never padded.

Async scheduling: a step whose requests will draft cannot have its successor scheduled before
its own sampling (the successor's tokens are the drafts, its positions depend on how many were
accepted), so the pipelined loop runs such steps one at a time (``must_commit_first``); steps
without sample rows (middle prefill chunks) and steps the gate keeps from drafting still overlap.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from deepinfer.engine.core.cuda_graphs import shape_bucket, shape_bucket_below
from deepinfer.engine.core.request import RequestStatus
from deepinfer.engine.spec.length_policy import SCHEDULES, make_length_policy
from deepinfer.engine.spec.length_schedule import fill_budget, schedule_lengths
from deepinfer.engine.spec.proposer import DraftProposer, StepDrafts
from deepinfer.engine.spec.sps_table import SpsTable


@dataclass(frozen=True, slots=True)
class SpecConfig:
    num_draft_tokens: int = 5  # D: drafts a request may verify per step (<= the drafter's block)
    schedule: str = "confidence"  # "confidence" | "throughput" | "fixed" (every request verifies D)
    budget_delay: int = 0  # confidence / throughput: size the budget from confidences this many steps old
    gate_drafter: bool = True  # throughput schedule: skip the drafter when drafting does not pay
    # confidence / throughput: move each step's verify tokens to a ``shape_bucket`` size with the next
    # candidates (the module docstring; the engine sets it when its runner replays CUDA graphs)
    pad_to_buckets: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown spec schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.budget_delay < 0:
            raise ValueError(f"budget_delay must be >= 0 steps, got {self.budget_delay}")


@dataclass(slots=True)
class SpecStats:
    """Lifetime counters (EngineStats.spec, /metrics)."""

    num_steps: int = 0  # steps that verified at least one draft
    num_proposals: int = 0  # drafter proposals (one per request and step)
    num_drafted: int = 0  # drafts proposed (D per proposal)
    num_verified: int = 0  # drafts sent to the target
    num_accepted: int = 0  # drafts the target accepted
    num_request_steps: int = 0  # a request's decode step (root + 0..D drafts), drafts or not
    draft_seconds: float = 0.0  # device time of the drafter
    num_drafter_skips: int = 0  # steps after which the drafter gate skipped the drafter's pass

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


MAX_PROBE_INTERVAL = 16  # longest run of skipped drafter passes before a probe
PRIOR_WEIGHT = 0.05  # weight of one proposal in the running mean confidence (prior for new requests)


@dataclass(slots=True)
class _Fresh:
    anchor: int
    tokens: list[int]
    confidence: np.ndarray  # [D]


class SpecDecoding:
    def __init__(self, proposer: DraftProposer, sps: SpsTable, config: SpecConfig = SpecConfig(), *,
                 max_verify_tokens: int | None = None) -> None:
        if config.num_draft_tokens > proposer.model.block_size:
            raise ValueError(f"num_draft_tokens {config.num_draft_tokens} exceeds the drafter's block of "
                             f"{proposer.model.block_size}")
        self.proposer = proposer
        self.sps = sps
        self.config = config
        self.policy = make_length_policy(config.schedule, sps.profile(1), num_drafts=config.num_draft_tokens,
                                         delay=config.budget_delay, max_verify_tokens=max_verify_tokens)
        self.max_verify_tokens = max_verify_tokens
        self.pad_to_buckets = config.pad_to_buckets and config.schedule != "fixed"
        self.stats = SpecStats()
        self._gated = config.gate_drafter and config.schedule == "throughput"
        self._prior: np.ndarray | None = None  # running mean confidence [D] over all proposals
        self._probe_interval, self._num_skipped = 1, 0  # the drafter gate's probe backoff
        # the gate's test memoised: its inputs (the confidences, the requests, their caps) change
        # only when a commit brings proposals or the decoding set or a cap changes
        self._epoch = 0  # commits that brought proposals
        self._gate_memo: tuple | None = None  # (key, drafting pays)
        self.num_gate_tests = 0  # tests actually computed (the rest were memoised)
        self._fresh: dict[str, _Fresh] = {}
        self._counts: dict[str, list[int]] = {}  # request id -> [drafted, verified, accepted]

    @property
    def num_draft_tokens(self) -> int:
        return self.config.num_draft_tokens

    # ---- loop thread: before schedule() ------------------------------------------------------
    def plan_lengths(self, requests, running) -> bool:
        """Set ``spec_token_ids`` of the running requests with fresh drafts to the policy's lengths;
        returns whether the drafter runs after this step (the gate of the module docstring)."""
        fresh = self._fresh
        for rid in [rid for rid in fresh if rid not in requests]:
            del fresh[rid]
        for rid in [rid for rid in self._counts if rid not in requests]:
            del self._counts[rid]  # finished (reported) or aborted
        d = self.config.num_draft_tokens
        decoding, confs, caps, num_fresh = [], [], [], 0
        for req in running:
            if req.status != RequestStatus.RUNNING or req.num_output_tokens == 0:
                continue  # prefilling: not a decode step (the SPS table's R counts decodes)
            f = fresh.get(req.request_id)
            is_fresh = f is not None and not (
                req.num_output_placeholders or req.is_awaiting_verification
                or req.num_computed_tokens != f.anchor + 1 or req.num_tokens != f.anchor + 2)
            if not is_fresh:
                req.spec_token_ids = []  # stale (preempted, rolled over, skipped) or a step in flight
            decoding.append((req, f if is_fresh else None))
            confs.append(f.confidence if f is not None else self._prior)
            caps.append(_length_cap(req, len(f.tokens) if is_fresh else 0))
            num_fresh += is_fresh
        if not decoding:
            return True
        drafter_runs, verify = self._gate(decoding, confs)
        if not num_fresh or not verify:
            return drafter_runs
        conf = np.stack([c if c is not None else np.zeros(d) for c in confs])
        self.policy.sps = self.sps.profile(len(decoding), drafter=drafter_runs)
        caps = np.asarray(caps, dtype=np.int64)
        schedule = self.policy(conf, max_lengths=caps)
        lengths = schedule.lengths
        if self.pad_to_buckets:
            lengths = self._padded(conf, caps, lengths, self.policy.sps)
        for (req, f), length in zip(decoding, lengths.tolist()):
            if f is not None:
                req.spec_token_ids = f.tokens[:length]
        return drafter_runs

    def _padded(self, conf: np.ndarray, caps: np.ndarray, lengths: np.ndarray, sps) -> np.ndarray:
        """``lengths [R]`` moved to a verify bucket: the bucket at or above R + sum(lengths) (the
        next candidates of highest survival added) or the one below (the lowest-survival chosen
        ones dropped), whichever the schedule's own objective E x SPS(B) prefers among those
        keeping the policy's accepted-length floor (never past a cap or the verify budget)."""
        num_requests = len(lengths)
        tokens = num_requests + int(lengths.sum())
        up = shape_bucket(tokens)
        if up == tokens:
            return lengths
        if self.max_verify_tokens is not None:
            up = min(up, self.max_verify_tokens)
        down = shape_bucket_below(tokens)
        floor = getattr(self.policy, "min_share", 0.0)
        best, best_f = lengths, -1.0
        everything = None
        for target in (up, down):
            if target < num_requests or (target == up and target <= tokens):
                continue
            got = fill_budget(conf, sps, target - num_requests, max_lengths=caps)
            if floor > 0.0:
                if everything is None:
                    everything = fill_budget(conf, sps, int(caps.sum()), max_lengths=caps).expected_tokens
                if got.expected_tokens < floor * everything - 1e-9:
                    continue
            if got.expected_tokens_per_s > best_f:
                best, best_f = got.lengths, got.expected_tokens_per_s
        return best

    def _gate(self, decoding, confs) -> tuple[bool, bool]:
        """The drafter gate: (draft after this step, verify this step's fresh drafts). Drafting
        runs when it pays in steady state, or as a probe; drafts are verified only while it pays
        (a probe's drafts refresh the confidences the test reads, they are not verified)."""
        if not self._gated:
            return True, True
        if any(c is None for c in confs):
            return True, True  # a request with no confidences yet and no prior: learn first
        if self._drafting_pays(decoding, confs):
            self._probe_interval, self._num_skipped = 1, 0
            return True, True
        if self._num_skipped >= self._probe_interval:  # a probe: fresh confidences for the test
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            self._num_skipped = 0
            return True, False
        self._num_skipped += 1
        return False, False

    def _drafting_pays(self, decoding, confs) -> bool:
        """The gate's test: the best ``E x SPS(B)`` with the drafter's time, over the decoding
        requests' last confidences, beats a plain step's ``R x SPS(R)``; recomputed only when an
        input changed (exactly: the same inputs give the same answer)."""
        num = len(decoding)
        caps = np.asarray([_length_cap(req, self.config.num_draft_tokens) for req, _ in decoding], dtype=np.int64)
        key = (self._epoch, tuple(req.request_id for req, _ in decoding), caps.tobytes())
        if self._gate_memo is not None and self._gate_memo[0] == key:
            return self._gate_memo[1]
        self.num_gate_tests += 1
        with_drafts = schedule_lengths(np.stack(confs), self.sps.profile(num), max_lengths=caps)
        pays = bool(with_drafts.expected_tokens_per_s > num * self.sps.profile(num, drafter=False)(num))
        self._gate_memo = (key, pays)
        return pays

    # ---- loop thread: can the next step be scheduled before this one is sampled? -------------
    @staticmethod
    def must_commit_first(plan) -> bool:
        """True when ``plan`` samples anything: its requests draft after sampling, and the next
        step needs those drafts (ARCHITECTURE.md, "The step timeline")."""
        return plan.sched.num_logits > 0 and plan.drafter_runs

    # ---- device thread: after sampling -------------------------------------------------------
    def propose(self, plan, accepted: dict[str, list[int]]) -> StepDrafts:
        t0 = time.perf_counter()
        drafts = self.proposer.propose(plan.sched.scheduled, accepted, draft=plan.drafter_runs)
        drafts.seconds = time.perf_counter() - t0
        return drafts

    # ---- loop thread: at commit --------------------------------------------------------------
    def commit(self, plan, accepted: dict[str, list[int]], drafts: StepDrafts | None, requests) -> None:
        """Count the step's verification and keep its proposals (``requests``: the live map)."""
        st = self.stats
        verified_step = False
        for s in plan.sched.scheduled:
            if not s.num_sample_rows or s.step.num_tokens != s.num_sample_rows:
                continue  # a prefill chunk: nothing to verify
            toks = accepted.get(s.request_id)
            if toks is None:
                continue
            st.num_request_steps += 1
            if not s.num_draft_tokens:
                continue
            num_accepted = len(toks) - 1
            verified_step = True
            st.num_verified += s.num_draft_tokens
            st.num_accepted += num_accepted
            counts = self._counts.setdefault(s.request_id, [0, 0, 0])
            counts[1] += s.num_draft_tokens
            counts[2] += num_accepted
        st.num_steps += verified_step
        if drafts is None:
            return
        st.draft_seconds += drafts.seconds
        if not plan.drafter_runs:
            st.num_drafter_skips += 1
        d = self.config.num_draft_tokens
        fresh = self._fresh
        if len(drafts):
            self._epoch += 1  # new proposals: fresh confidences and the prior change, the gate looks again
            mean = drafts.confidence[:, :d].mean(axis=0)
            w = min(1.0, PRIOR_WEIGHT * len(drafts))
            self._prior = mean if self._prior is None else (1 - w) * self._prior + w * mean
        for i, rid in enumerate(drafts.request_ids):
            req = requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                fresh.pop(rid, None)
                continue
            tokens = drafts.tokens[i][:d]
            fresh[rid] = _Fresh(drafts.anchors[i], tokens, drafts.confidence[i, :d])
            self._counts.setdefault(rid, [0, 0, 0])[0] += len(tokens)
            st.num_proposals += 1
            st.num_drafted += len(tokens)

    def request_counts(self, request_id: str) -> tuple[int, int, int]:
        """(drafted, verified, accepted) drafts of one request so far."""
        return tuple(self._counts.get(request_id, (0, 0, 0)))


def _length_cap(req, num_drafts: int) -> int:
    """Drafts worth verifying: a request can commit at most its remaining tokens (max_tokens,
    the model length), and a step commits accepted drafts + 1."""
    cap = num_drafts
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is not None:
        cap = min(cap, max_tokens - req.num_output_tokens - 1)
    cap = min(cap, req.max_model_len - req.num_tokens - 1)
    return max(cap, 0)
