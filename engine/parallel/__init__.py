"""Parallelism of one engine replica: expert parallelism (EP) with its load balancer (EPLB).

    eplb/              pure policy: load window, planner (phy2log), schedule with drift trigger,
                       replica choice (EVEN / LEAST_LOADED), slot sources of a re-placement
    group.py           an EP group over torch.distributed (the step's channel, the background one)
    dispatch.py        the wire layout of one MoE layer's dispatch and combine
    expert_slots.py    one rank's expert weights per layer, the grouped compute, spare buffers
    ep_moe.py          the EP MoE layer (drop-in for the V4 MoE): route, choose, dispatch, compute, combine
    expert_parallel.py one rank's EP state: its layers, window, re-placements, rule decisions
    replacement.py     a re-placement in the background, layers swapped between steps by agreement
    planner_process.py the planner in a child process (off the step loop's GIL)
    ep_runner.py       the runner of an EP rank: every forward a step of the group, idle ranks serve
    settings.py        EpSettings, ExpertParallelSpec (EngineOptions.expert_parallel), build_ep_runner
The processes of an EP group (one rank per process, N of them behind one EngineClient) are
runtime/ep/: they speak the transport's wire, which this layer may not import.
"""
