"""Elastic EP (engine/elastic.py has the lifecycle), a survivor's side of step 4: it keeps its engine core and
re-places its MoE slots for the new EP group. can_keep() says whether it can, roll_back() readies a kept core
when the rank leaves its epoch, vote_maps() agrees on the new expert maps (keep_map()) across the new epoch's
ranks, and keep_core() re-places the slots (copies where the rank holds the expert, checkpoint reads else)."""
from __future__ import annotations

import dataclasses

from moeserve.config import ConfigError, EngineConfig, ParallelConfig

def _moe_blocks(model) -> list:
    from moeserve.layers.moe.layer import MoE

    return [m for m in model.modules() if isinstance(m, MoE)] if model is not None else []


def expert_roots(runner) -> list:
    """The modules that hold MoE blocks under their checkpoint names: the model, and the MTP layer's module."""
    return [runner.model] + ([runner.proposer.mtp] if runner.proposer is not None else [])


def _core_blocks(runner) -> list:
    return [b for root in expert_roots(runner) for b in _moe_blocks(root)]


def can_keep(core) -> bool:
    """Whether a survivor can re-place its MoE slots for a new EP group instead of rebuilding: routed experts
    whose every per-slot tensor is stacked [slots, ...], re-sliced here (the MTP layer's too): float
    FusedExperts, A8W8's Int8FusedExperts (int8 weights, per-channel scales; a slot read from the checkpoint
    is quantized by its load_expert, as at start-up) and FP8's Fp8FusedExperts (e4m3 weights, block scales);
    no PD transfer. Otherwise it rebuilds."""
    from moeserve.layers.fp8 import Fp8FusedExperts
    from moeserve.layers.moe.experts import FusedExperts
    from moeserve.layers.quant import Int8FusedExperts

    if core.kv_transfer is not None:
        return False
    kinds = (FusedExperts, Int8FusedExperts, Fp8FusedExperts)
    return all(type(b.experts) in kinds and not b.shared_remote and not b.placement.experts_tp_sharded
               for b in _core_blocks(core.runner))


def roll_back(core) -> None:
    """The interrupted step leaves no trace, and the survivor's requests stay scheduled (the front end re-queues
    only those no survivor kept: RankReport.kept). A step of a core that can be kept fails inside its forward
    (the MoE collectives; the sampler and the scheduler's update come after it, and online EPLB's collectives
    run after the step's report), so the scheduler never saw the step end: each request's computed tokens,
    block table and outputs are those of its last finished step, and the next step schedules the interrupted
    tokens again. Their KV was written past every request's computed tokens, where the re-run writes again;
    nothing of it was registered in the prefix cache (a block is registered only in update_from_output, once
    the step that wrote it finished), so no half-written block is ever shared. EPLB moves in flight on the
    old groups are dropped: a layer whose move did not finish keeps its old weights and map together
    (_Move.finish switches a layer only once all its transfers arrived). With MTP the step may also fail in
    the MTP pass, after sampling: greedy requests re-run it to the same tokens; a seeded one's generator has
    drawn that step's noise already (seeded MTP is not exact across a resume either: docs/serving.md)."""
    core._pending = []  # rejections queued for the lost step's report: their requests are re-queued instead
    if core.runner.eplb is not None:
        core.runner.eplb.pending = []
    runner = core.runner
    if runner.decode_graphs is not None:  # traced over the old groups: the next epoch compiles its own
        runner.graph_steps_carried = runner.decode_graphs.steps  # (elastic_graphs.py), counting on from here
    runner.decode_graphs = None
    if runner.proposer is not None:
        runner.proposer.graphs = None


def maps_digest(blocks) -> int:
    """A fingerprint of the expert maps a rank serves (every rank of an epoch holds the same ones)."""
    import hashlib

    maps = [(b.layer_idx, b.expert_map.placement.num_ranks, b.expert_map.placement.phys_to_logical)
            for b in sorted(blocks, key=lambda b: b.layer_idx)]
    return int.from_bytes(hashlib.blake2b(repr(maps).encode(), digest_size=7).digest(), "little")


def vote_maps(worker, parallel: ParallelConfig) -> tuple[dict[int, list[int]] | None, bool]:
    """Every rank of the new epoch says which rank it was in the epoch its expert maps come from (-1: it holds
    no engine core: a replacement, or a survivor that could not keep its own) and a fingerprint of those maps.
    When the ranks that kept their cores did so under the same maps, the new map of each MoE layer keeps
    their slots where they are and gives the rest to the others (keep_map), and the ranks that build afresh
    receive it (one more all-gather); else None: every rank uses the default layout. Also whether a rank kept
    its core: then every rank takes part in the peer fill (keep_core's peers; one building afresh receives in
    elastic_replace.build_core)."""
    import torch

    from moeserve.distributed.parallel_state import get_world_group

    world = get_world_group()
    core = worker.core
    blocks = _core_blocks(core.runner) if core is not None else []
    digest = maps_digest(blocks) if blocks else 0
    if getattr(worker.before_step, "vote_other_maps", False):  # testing only: as if its maps differed
        digest += 1
    row = torch.tensor([[worker.info.rank if core is not None else -1, digest]], dtype=torch.long)
    votes = world.all_gather(row).tolist()  # [W, 2], the same on every rank: every decision below is too
    worker.epoch_builds = any(v[0] < 0 for v in votes)  # a rank builds afresh (elastic_graphs.between_steps)
    olds = [v[0] for v in votes]
    keepers = [v for v in votes if v[0] >= 0]
    peers = bool(keepers)
    if not keepers or len({v[1] for v in keepers}) != 1 or len({v[0] for v in keepers}) != len(keepers):
        return None, peers
    arch = worker.arch
    experts = arch.n_routed_experts or 0
    physical = experts + parallel.num_redundant_experts
    maps = {b.layer_idx: keep_map(list(b.expert_map.placement.phys_to_logical), b.expert_map.placement.num_ranks,
                                  olds, experts, physical // parallel.world_size) for b in blocks}
    if len(keepers) < len(votes):  # the ranks that build take the first keeper's maps
        mtp = worker.base_config.speculative is not None  # the MTP layer's MoE block is one more layer
        layers = [i for i in range(arch.num_hidden_layers + int(mtp)) if arch.is_moe_layer(i)]
        flat = [e for i in layers for e in maps[i]] if maps else [0] * (len(layers) * physical)
        got = world.all_gather(torch.tensor([flat], dtype=torch.long))[olds.index(keepers[0][0])].tolist()
        maps = {i: got[k * physical:(k + 1) * physical] for k, i in enumerate(layers)}
    return maps, peers


def keep_map(old: list[int], old_ranks: int, survivors: list[int], num_experts: int, slots: int) -> list[int]:
    """One MoE layer's map for the survivors (survivors[i]: the old EP rank of new rank i; `slots` per rank):
    each survivor keeps the experts it holds in its first slots (-1: a rank holding none, a replacement), the
    experts nobody holds any more go to the ranks with the most free slots (ties: the lowest), and slots
    still free take a second copy of an expert the rank holds (a local copy, nothing to read; online EPLB
    re-places by load later), on a rank holding none the experts with the fewest copies."""
    per = len(old) // old_ranks
    held = [list(dict.fromkeys(old[o * per:(o + 1) * per]))[:slots] if o >= 0 else [] for o in survivors]
    lost = sum(not any(e in h for h in held) for e in range(num_experts))
    for e in range(num_experts):  # room for the lost experts: drop replicas held on several ranks (fullest first)
        while lost > sum(slots - len(h) for h in held) and sum(e in h for h in held) > 1:
            max((h for h in held if e in h), key=len).remove(e)
    have = {e for h in held for e in h}
    for e in range(num_experts):
        if e not in have:
            i = max(range(len(held)), key=lambda i: (slots - len(held[i]), -i))
            if len(held[i]) >= slots:
                raise ConfigError(f"{num_experts} experts do not fit {len(held)} x {slots} expert slots")
            held[i].append(e)
    for h in held:
        if not h:
            copies = {e: sum(g.count(e) for g in held) for e in range(num_experts)}
            h += sorted(range(num_experts), key=lambda e: (copies[e], e))[:slots]
        for k in range(slots - len(h)):
            h.append(h[k % len(h)])
    return [e for h in held for e in h]


def keep_core(worker, config: EngineConfig, info, maps: dict[int, list[int]] | None,
              peers: bool = False, ready: bool = True) -> tuple[int, int, int, int]:
    """Serve on with the survivor's engine core under the new process groups: its non-expert weights, KV cache
    pool, prefix cache and scheduler stay; each MoE layer's slots are re-placed for the new EP group (`maps`,
    or the default layout): a slot whose expert this rank holds is copied from it; with `peers` (every rank
    of the epoch runs this, or elastic_replace.build_core where it builds afresh) one a peer holds arrives from
    it (elastic_transfer.py);
    with --elastic-ep-host-copy one no survivor holds comes from a file a rank wrote (elastic_host_copy.py);
    the others are read from the checkpoint, only those experts. Returns (slots copied, slots received, slots
    from the host copy, checkpoint tensors read)."""
    from moeserve.distributed.comm import GroupCoordinator
    from moeserve.distributed.parallel_state import get_ep_group, get_ep_hierarchy, get_tp_group, get_world_group
    from moeserve.engine.elastic_host_copy import HostCopy
    from moeserve.engine.elastic_transfer import DISK, LOCAL, SlotTransfer, gather_held, peer_routes
    from moeserve.layers.moe.dispatch import make_codec, make_dispatcher
    from moeserve.layers.moe.placement import ExpertMap, build_plan, validate_map
    from moeserve.models.loader import load_expert_slots

    core, worker.core = worker.core, None  # lost if the re-placement fails: the next epoch builds afresh
    runner = core.runner
    plan = build_plan(config.parallel, worker.arch, info.rank, mtp=config.speculative is not None)
    if maps is not None:
        for i, phys in maps.items():
            validate_map(phys, worker.arch.n_routed_experts, info.world_size, f"elastic EP layer {i}")
        plan = dataclasses.replace(plan, layers={i: dataclasses.replace(p, phys_to_logical=tuple(maps[i]))
                                                 for i, p in plan.layers.items()})
    names = {m: (k, n) for k, root in enumerate(expert_roots(runner)) for n, m in root.named_modules()}
    blocks = _core_blocks(runner)
    wanted: list[dict[str, dict[int, list[int]]]] = [{} for _ in expert_roots(runner)]  # per root
    host = HostCopy(worker.front_end_port) if worker.base_config.parallel.elastic_ep_host_copy else None
    hosted = 0
    kept = 0
    ep, mb1, codec = get_ep_group(), get_ep_group(micro_batch=1), make_codec(plan.comm_dtype)
    world = get_world_group()  # = the EP group (TP 1); a layer's rank r holds phys_to_logical's r-th share
    held = (gather_held(world, {b.layer_idx: list(b.experts.slot_experts) for b in blocks})
            if peers and world.world_size > 1 else None)  # a rank building afresh takes part: elastic_replace.py
    moves = []
    for block in blocks:
        p, ex = plan.layers[block.layer_idx], block.experts
        new = p.local_slot_experts()
        have: dict[int, int] = {}
        for s, e in enumerate(ex.slot_experts):
            have.setdefault(e, s)
        n = len(new)
        wants = [list(p.phys_to_logical[r * n:(r + 1) * n]) for r in range(world.world_size)]
        routes = peer_routes(held[block.layer_idx], wants) if held is not None else None
        mine = routes[world.rank] if routes else [LOCAL if e in have else DISK for e in new]
        pairs = [(pn, prm, prm.data, prm.data.new_empty((n,) + tuple(prm.shape[1:]))) for pn, prm in slot_params(ex)]
        disk: dict[int, list[int]] = {}  # expert -> new slots that no survivor can fill
        for j, e in enumerate(new):
            if mine[j] == LOCAL:
                for *_, old, fresh in pairs:
                    fresh[j] = old[have[e]]
                kept += 1
            elif mine[j] == DISK:
                disk.setdefault(e, []).append(j)
        k, name = names[ex]
        for e, js in disk.items():  # --elastic-ep-host-copy: a lost rank's file has it, else the checkpoint
            if host is not None and host.fill(k, name, e, [(pn, fresh) for pn, *_, fresh in pairs], js):
                hosted += len(js)
            else:
                wanted[k].setdefault(name, {})[e] = js
        if routes and any(src >= 0 for row in routes for src in row):  # every rank sees the same routes
            move = SlotTransfer(world, routes, wants, have)
            move.start([(old, fresh) for *_, old, fresh in pairs])  # rows copied out: the old may go
            moves.append(move)
        for _, prm, _, fresh in pairs:
            prm.data = fresh  # the Parameters stay (the module's), their storage is the new slots'
        ex.packed = None  # the old slots' oneDNN packs: freed now, remade below (process_weights_after_loading)
        ex.num_local_experts, ex.slot_experts = n, list(new)
        block.placement, block.expert_map = p, ExpertMap(p)
        block.dispatcher = make_dispatcher(plan.comm, ep, p, codec, plan.node_size, get_ep_hierarchy(),
                                           plan.pipeline_chunks)
        block.dispatchers = [block.dispatcher] + (
            [make_dispatcher(plan.comm, mb1, p, codec, plan.node_size, get_ep_hierarchy(micro_batch=1),
                             plan.pipeline_chunks)] if mb1 is not ep else [])
    got = sum(m.finish() for m in moves)
    read = sum(load_expert_slots(root, config.model.model, w) for root, w in zip(expert_roots(runner), wanted))
    for block in blocks:
        block.experts.process_weights_after_loading()  # oneDNN packs / zentorch of the new slots
    for m in [m for root in expert_roots(runner) for m in root.modules()]:  # MLA, MoE hold the TP group (TP 1 here)
        if isinstance(getattr(m, "tp", None), GroupCoordinator):
            m.tp = get_tp_group()
    runner.config = core.config = config
    runner.moe_plan = plan
    p = config.parallel
    if p.enable_eplb and blocks:  # a new balancer over the new groups; the load counts go on
        from moeserve.layers.moe.eplb_online import OnlineEPLB

        recorder = runner.eplb.recorder if runner.eplb is not None else runner.load_recorder
        runner.eplb = OnlineEPLB(blocks, worker.arch.n_routed_experts, p.eplb_step_interval, recorder)
        runner.load_recorder = runner.eplb.recorder
    elif runner.eplb is not None:  # one survivor: nothing to balance
        runner.eplb = None
        if not p.expert_load_stats:
            runner.load_recorder = None
    worker.start(config, info, core, ready=ready)
    return kept, got, hosted, read


def slot_params(experts) -> list:
    """The experts module's per-slot tensors ([slots, ...]: w13, w2, and a quantized module's scales),
    re-placed slot by slot."""
    n = len(experts.slot_experts)
    return [(name, prm) for name, prm in experts.named_parameters(recurse=False) if prm.dim() and prm.shape[0] == n]
