"""Expert placement as data: per MoE layer, which logical expert each physical slot holds.

A layer has P = n_routed_experts + --num-redundant-experts physical slots, split evenly over the EP ranks
(rank r holds slots [r * P/W, (r+1) * P/W)). phys_to_logical[s] is the logical expert of slot s; an expert
with several slots is replicated, and the (token, choice) pairs routed to it are spread over its replicas
round-robin. The router output goes through this map; replication and rebalancing change the map only.

Without expert parallelism (W > 1) each rank holds every expert, TP-sharded: the map is the identity and
every slot is local (experts_tp_sharded).

--shared-expert-ranks N: the last N EP ranks hold the shared expert(s) and no routed slot; the P slots are
split over the other W - N ranks. Each token's shared-expert row is one more dispatched pair, addressed to
the physical id P + j of shared rank j (tokens spread over the N ranks round-robin), and comes back in the
same combine with weight 1.

--expert-placement FILE is JSON: {"default": [P logical ids], "layers": {"<decoder layer>": [P ids]}}
(either key may be absent).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from moeserve.config import ConfigError, ParallelConfig
from moeserve.scoped import Scoped


@dataclass(frozen=True)
class LayerPlacement:
    phys_to_logical: tuple[int, ...]  # (P,) logical expert of each physical slot
    num_ranks: int  # EP ranks the slots are split over
    rank: int  # this rank
    experts_tp_sharded: bool = False  # every rank holds all experts (sliced); all slots are local
    num_shared_ranks: int = 0  # the last ones of the num_ranks hold the shared experts, no routed slot

    @property
    def num_physical(self) -> int:
        return len(self.phys_to_logical)

    @property
    def routed_ranks(self) -> int:
        return self.num_ranks - self.num_shared_ranks

    @property
    def slots_per_rank(self) -> int:
        """Routed slots of each routed-expert rank (a shared-expert rank holds none)."""
        return self.num_physical if self.experts_tp_sharded else self.num_physical // self.routed_ranks

    @property
    def holds_shared(self) -> bool:
        """Whether this rank is one of the --shared-expert-ranks."""
        return self.num_shared_ranks > 0 and self.rank >= self.routed_ranks

    def local_slot_experts(self) -> list[int]:
        """Logical expert of each slot this rank holds."""
        if self.experts_tp_sharded:
            return list(self.phys_to_logical)
        if self.holds_shared:
            return []
        s = self.slots_per_rank
        return list(self.phys_to_logical[self.rank * s:(self.rank + 1) * s])

    def rank_of(self, phys: torch.Tensor) -> torch.Tensor:
        """EP rank holding each physical id (a routed slot, or P + j for shared-expert rank j)."""
        p = self.num_physical
        if not self.num_shared_ranks:
            return phys // self.slots_per_rank
        return torch.where(phys < p, phys.div(self.slots_per_rank, rounding_mode="floor"),
                           self.routed_ranks + phys - p)

    def local_slot(self, phys: torch.Tensor) -> torch.Tensor:
        """Slot of each physical id on the rank holding it (0: a shared-expert rank's one destination)."""
        if not self.num_shared_ranks:
            return phys % self.slots_per_rank
        return torch.where(phys < self.num_physical, phys % self.slots_per_rank, torch.zeros_like(phys))

    def shared_destinations(self, num_tokens: int, device) -> torch.Tensor:
        """[T, 1] physical ids of the shared-expert ranks this rank's tokens go to: round-robin, starting at
        this rank's offset so that every shared rank gets a share of every rank's tokens."""
        j = (torch.arange(num_tokens, device=device) + self.rank) % self.num_shared_ranks
        return (self.num_physical + j)[:, None]

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """replicas [E, max_replicas] physical slots of each expert (padded), num_replicas [E]."""
        num_logical = max(self.phys_to_logical) + 1
        reps: list[list[int]] = [[] for _ in range(num_logical)]
        for slot, e in enumerate(self.phys_to_logical):
            reps[e].append(slot)
        width = max(len(r) for r in reps)
        # Explicit CPU device: models are constructed under torch.device("meta").
        table = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.long, device="cpu")
        return table, torch.tensor([len(r) for r in reps], dtype=torch.long, device="cpu")


class ExpertMap:
    """The router-side view of a LayerPlacement: logical ids -> physical slots, replicas spread."""

    def __init__(self, placement: LayerPlacement) -> None:
        self.placement = placement
        self.replicas, self.num_replicas = placement.tables()  # [E, R_max], [E]
        self.trivial = list(placement.phys_to_logical) == list(range(len(self.num_replicas)))

    def to_physical(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, k] logical -> [T, k] physical slots; pair i goes to replica i mod #replicas."""
        if self.trivial:
            return expert_ids
        if self.replicas.device != expert_ids.device:
            self.replicas, self.num_replicas = self.replicas.to(expert_ids.device), self.num_replicas.to(expert_ids.device)
        t, k = expert_ids.shape
        pair = torch.arange(t * k, device=expert_ids.device).view(t, k)
        choice = pair % self.num_replicas[expert_ids]  # [T, k]
        return self.replicas[expert_ids, choice]


@dataclass(frozen=True)
class MoePlan:
    """How every MoE layer of one model is laid out and talks: comm kind plus per-layer placement."""

    comm: str  # "local", "alltoall" or "allgather"
    layers: dict[int, LayerPlacement]
    comm_dtype: str = "bfloat16"  # dispatch payload: "bfloat16" (activation dtype) or "int8" (+ scales)
    node_size: int | None = None  # EP ranks per node (real or --ranks-per-node): link classes of the bytes
    pipeline_chunks: int = 1  # --moe-pipeline-chunks

    def layer(self, idx: int) -> LayerPlacement:
        return self.layers[idx]


def default_map(num_experts: int, redundant: int, num_ranks: int, shared_ranks: int = 0) -> list[int]:
    """Experts in contiguous blocks per rank. When experts and replicas each divide over the ranks, rank r's
    replicas copy the next rank's experts; otherwise (e.g. 8 experts + 1 replica over 3 ranks) the replicas
    copy experts 0, 1, ... after the last expert. num_ranks: the ranks holding routed experts (those besides
    the shared_ranks)."""
    total = num_experts + redundant
    if total % num_ranks:
        which = f"{num_ranks} EP ranks" if not shared_ranks else (
            f"the {num_ranks} EP ranks besides --shared-expert-ranks {shared_ranks}")
        raise ConfigError(
            f"{num_experts} routed experts + {redundant} redundant do not spread evenly over {which}: choose "
            f"--num-redundant-experts so that the sum divides by {num_ranks} (e.g. "
            f"--num-redundant-experts {redundant + (-total) % num_ranks}), or give --expert-placement")
    if num_experts % num_ranks or redundant % num_ranks:
        return list(range(num_experts)) + [j % num_experts for j in range(redundant)]
    per, extra = num_experts // num_ranks, redundant // num_ranks
    slots: list[int] = []
    for r in range(num_ranks):
        slots += list(range(r * per, (r + 1) * per))
        nxt = (r + 1) % num_ranks
        slots += [nxt * per + j % per for j in range(extra)]
    return slots


def validate_map(phys: list[int], num_experts: int, num_ranks: int, where: str) -> None:
    bad = [e for e in phys if not (isinstance(e, int) and not isinstance(e, bool) and 0 <= e < num_experts)]
    if bad:
        raise ConfigError(f"{where}: expert id {bad[0]!r} is not in 0..{num_experts - 1}")
    missing = sorted(set(range(num_experts)) - set(phys))
    if missing:
        raise ConfigError(f"{where}: expert(s) {missing[:8]} have no physical slot; every expert needs a replica")
    if len(phys) % num_ranks:
        raise ConfigError(f"{where}: {len(phys)} expert slots are not divisible over {num_ranks} EP ranks; "
                          f"use a multiple of {num_ranks} slots")


def build_plan(parallel: ParallelConfig, arch, rank: int, mtp: bool = False) -> MoePlan:
    """The MoePlan of `arch` for global rank `rank` (validates the whole map on every rank).

    mtp: also lay out the MTP layer (decoder index num_hidden_layers), whose MoE block is one more layer."""
    world, shared = parallel.world_size, parallel.shared_expert_ranks
    if shared and not arch.n_shared_experts:
        raise ConfigError(f"--shared-expert-ranks {shared}: this model has no shared experts "
                          "(n_shared_experts is 0); remove the flag")
    routed_world = world - shared
    moe_layers = [i for i in range(arch.num_hidden_layers + int(mtp)) if arch.is_moe_layer(i)]
    e, r = arch.n_routed_experts or 0, parallel.num_redundant_experts
    if not moe_layers:
        return MoePlan("local", {})
    tp_sharded = world > 1 and not parallel.enable_expert_parallel
    if tp_sharded:
        if arch.moe_intermediate_size % world:
            raise ConfigError(f"moe_intermediate_size {arch.moe_intermediate_size} does not split over {world} "
                              "ranks; use --enable-expert-parallel or another --data/--tensor-parallel-size")
        ident = tuple(range(e))
        return MoePlan("allgather", {i: LayerPlacement(ident, world, rank, True) for i in moe_layers},
                       parallel.moe_comm_dtype, parallel.moe_node_ranks, parallel.moe_pipeline_chunks)
    file_maps = _read_placement_file(parallel.expert_placement) if parallel.expert_placement else {}
    given = _GIVEN.get() or {}
    layers = {}
    for i in moe_layers:
        phys = given.get(i, file_maps.get(i, file_maps.get("default")))
        where = (f"--expert-placement {parallel.expert_placement} layer {i}" if i not in given
                 else f"the placement of the elastic EP ranks layer {i}")
        if phys is None:
            phys, where = default_map(e, r, routed_world, shared), "default placement"
        elif r and len(phys) != e + r:
            raise ConfigError(f"{where}: {len(phys)} slots, but {e} experts + --num-redundant-experts {r} "
                              f"= {e + r}; make them agree")
        validate_map(phys, e, routed_world, where)
        layers[i] = LayerPlacement(tuple(phys), world, rank, num_shared_ranks=shared)
    return MoePlan("local" if world == 1 else parallel.resolved_moe_comm, layers, parallel.moe_comm_dtype,
                   parallel.moe_node_ranks, parallel.moe_pipeline_chunks)


def _read_placement_file(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--expert-placement {path}: cannot read a JSON placement ({err})") from err
    if not isinstance(data, dict) or not set(data) <= {"default", "layers"}:
        raise ConfigError(f"--expert-placement {path}: expected {{\"default\": [...], \"layers\": "
                          "{\"<layer>\": [...]}}")
    where = f"--expert-placement {path}"
    maps: dict = {}
    if "default" in data:
        maps["default"] = _slot_list(data["default"], f"{where}: \"default\"")
    layers = data.get("layers") or {}
    if not isinstance(layers, dict):
        raise ConfigError(f"{where}: \"layers\" must be an object {{\"<decoder layer>\": [...]}}, "
                          f"got {type(layers).__name__}")
    for key, phys in layers.items():
        try:
            idx = int(key)
        except ValueError:
            raise ConfigError(f"{where}: layer key {key!r} is not a decoder layer number") from None
        maps[idx] = _slot_list(phys, f"{where}: layer {key}")
    return maps


def _slot_list(value, where: str) -> list[int]:
    """A JSON list of logical expert ids (the ids themselves are checked by validate_map)."""
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list of logical expert ids (one per physical slot), "
                          f"got {json.dumps(value)[:40]}")
    return value


_CURRENT: Scoped[MoePlan] = Scoped("moe_plan")
_GIVEN: Scoped[dict[int, list[int]]] = Scoped("moe_given_maps")


def given_maps(maps: dict[int, list[int]] | None):
    """build_plan() inside lays out these MoE layers ({decoder layer: P logical ids}) as given (elastic EP: a
    rank that builds its engine core in an epoch whose other ranks kept theirs takes their map)."""
    return _GIVEN.use(maps)


def moe_plan_context(plan: MoePlan):
    """MoE layers constructed inside read their placement and comm kind from `plan`."""
    return _CURRENT.use(plan)


def current_comm_dtype() -> str:
    plan = _CURRENT.get()
    return "bfloat16" if plan is None else plan.comm_dtype


def current_node_size() -> int | None:
    plan = _CURRENT.get()
    return None if plan is None else plan.node_size


def current_pipeline_chunks() -> int:
    plan = _CURRENT.get()
    return 1 if plan is None else plan.pipeline_chunks


def current_layer_placement(layer_idx: int, num_experts: int) -> tuple[str, LayerPlacement]:
    plan = _CURRENT.get()
    if plan is None or layer_idx not in plan.layers:
        return "local", LayerPlacement(tuple(range(num_experts)), 1, 0)
    return plan.comm, plan.layer(layer_idx)
