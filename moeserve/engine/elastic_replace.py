"""Elastic EP (engine/elastic.py has the lifecycle), step 4 and 6 for a rank that builds its engine core afresh
in an epoch where another rank kept its own (a replacement, --elastic-ep-replace; or a survivor that could not
keep its core): its routed experts come from where they already are, not the checkpoint.

Before its build the rank takes part in the survivors' all-gather of holdings (elastic_transfer.gather_held;
it holds nothing) and derives the same routes they do for the new map: an expert a peer holds arrives from it
after the build (one SlotTransfer per layer, posted in the survivors' order: elastic_placement.keep_core), one
no peer holds comes from the host copy where a file has it (--elastic-ep-host-copy), and only the rest is
read from the checkpoint. The build itself (EngineCore, in the survivors' expert map) reads no tensor of the
first two kinds (loader.experts_supplied); their slots are written once the build is done, quantized ones
with their scales as served, and the oneDNN packs are remade. The build runs no collective, so the survivors
wait for its transfers in theirs (bounded by --distributed-timeout).
"""
from __future__ import annotations


def build_core(worker, config, info, maps: dict[int, list[int]] | None, peers: bool):
    """The rank's new EngineCore for `maps` (or the default layout), its expert slots filled from peers (with
    `peers`: a rank of the epoch kept its core, so every rank runs the matching collectives), the host copy and
    the checkpoint. Returns (core, slots received from peers, slots from the host copy, checkpoint expert
    tensors read)."""
    from moeserve.distributed.parallel_state import get_world_group
    from moeserve.engine.elastic_host_copy import HostCopy
    from moeserve.engine.elastic_placement import _core_blocks, expert_roots, slot_params
    from moeserve.engine.elastic_transfer import SlotTransfer, gather_held, peer_routes
    from moeserve.engine.engine_core import EngineCore
    from moeserve.layers.moe.placement import build_plan, given_maps
    from moeserve.models.loader import experts_supplied

    arch, world = worker.arch, get_world_group()
    with given_maps(maps):
        plan = build_plan(config.parallel, arch, info.rank, mtp=config.speculative is not None)
    host = HostCopy(worker.front_end_port) if worker.base_config.parallel.elastic_ep_host_copy else None
    peers = peers and world.world_size > 1
    held = gather_held(world, {i: [] for i in plan.layers}) if peers else None  # the survivors' keep_core's
    routes: dict[int, list[list[int]]] = {}
    from_host: dict[int, dict[int, list[int]]] = {}  # layer -> expert -> its new local slots
    supplied: dict[int, set[int]] = {}
    for i, p in plan.layers.items():
        n = p.slots_per_rank
        wants = [list(p.phys_to_logical[r * n:(r + 1) * n]) for r in range(world.world_size)]
        mine = [-2] * n
        if held is not None:
            routes[i] = peer_routes(held[i], wants)
            mine = routes[i][world.rank]
        root = int(i >= arch.num_hidden_layers)  # the MTP layer's block lives in the second root
        for j, (e, src) in enumerate(zip(wants[world.rank], mine)):
            if src >= 0:
                supplied.setdefault(i, set()).add(e)
            elif host is not None and host.has(root, f"model.layers.{i}.mlp.experts", e):
                from_host.setdefault(i, {}).setdefault(e, []).append(j)
                supplied.setdefault(i, set()).add(e)
    with given_maps(maps), experts_supplied(supplied):
        core = EngineCore(config, arch)
    names = {m: (k, n) for k, root in enumerate(expert_roots(core.runner)) for n, m in root.named_modules()}
    moves, hosted = [], 0
    for block in _core_blocks(core.runner):  # the survivors' order: each posts its transfers layer by layer
        ex, i = block.experts, block.layer_idx
        tensors = [prm.data for _, prm in slot_params(ex)]
        if i in routes and any(src >= 0 for row in routes[i] for src in row):
            n = len(ex.slot_experts)
            wants = [list(block.placement.phys_to_logical[r * n:(r + 1) * n]) for r in range(world.world_size)]
            move = SlotTransfer(world, routes[i], wants, {})  # it sends nothing: it holds nothing yet
            move.start([(t, t) for t in tensors])
            moves.append(move)
        k, name = names[ex]
        for e, js in from_host.get(i, {}).items():
            if not host.fill(k, name, e, [(pn, prm.data) for pn, prm in slot_params(ex)], js):
                raise RuntimeError(f"--elastic-ep-host-copy: expert {e} of {name} left the host copy while this "
                                   "rank built its engine core")
            hosted += len(js)
    got = sum(m.finish() for m in moves)
    if moves or hosted:
        for block in _core_blocks(core.runner):
            block.experts.process_weights_after_loading()  # the packs were made of the unset slots
    return core, got, hosted, core.runner.checkpoint.num_expert_tensors
