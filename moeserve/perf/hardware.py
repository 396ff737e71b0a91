"""Hardware database: devices, systems (device + wiring) and efficiency factors, all as data.

The built-in table is data/hardware.yaml; users add or override entries with a YAML/JSON file of the
same shape (`--hardware-file`). Units: TFLOPS, GiB, TB/s, GB/s unidirectional per card.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from moeserve.perf.hardware_file import EFF_FIELDS, EFF_OPTIONAL, merge, number, read

GIB = 2 ** 30
_EFF_KEYS = EFF_FIELDS + EFF_OPTIONAL  # the Efficiency fields, also what a --hardware-file may set
PROFILES = ("end_to_end", "kernel")
# End-to-end terms a serving step pays beyond its kernels at their large-shape efficiencies; each has an
# operator-level source (data/hardware.yaml, docs/planner.md "Calibration"). The kernel profile has none.
TERMS = ("small_m_gemm",        # expert/dense GEMMs at small M stream weights at gemm_memory, not memory
         "mla_tile",            # decode attention computes at least mla_min_rows query rows per tile
         "collective_floor",    # dispatch/combine latency floor by EP size (measured tables), hop latency
         "load_noise",          # busiest expert rank's sampling noise x residual imbalance
         "framework",           # per-step framework time (step_overhead_ms)
         "overlap_bound")       # two-batch overlap saves no more than its measured gain (tbo_max_gain)
# Range of every physical figure (TFLOPS, GiB, TB/s, GB/s, in the unit of its field), of the positive
# --scale-*-gbps overrides and of the other positive float flags (cli_args). "> 0 and finite" is not
# enough: 1e-320 GB/s makes a transfer time overflow to inf (then 0 tok/s and a division by zero), 1e300
# GiB overflows to inf bytes. Inside this range every time and rate the planner derives stays a finite,
# non-zero float; no real device comes near either end (a measured CPU, cpucheck.py: ~0.01 TFLOPS).
FIGURE_MIN, FIGURE_MAX = 1e-6, 1e9


@dataclass(frozen=True)
class Efficiency:
    gemm: float              # achieved / peak tensor FLOPs in GEMMs
    attention: float         # achieved / peak for attention kernels (FLOPs and KV bytes)
    memory: float            # achieved / peak HBM bandwidth for weight streaming
    link: float              # achieved / nominal link bandwidth
    link_latency_us: float   # fixed cost per collective / dispatch / combine
    step_overhead_ms: float  # per engine step (scheduling, launch, sampling)
    memory_utilization: float  # usable fraction of HBM
    # End-to-end serving / kernel-level achieved rate, applied to every on-device compute operator
    # (GEMM, attention, memory-bound kernels; not to collectives, whose constants are already measured
    # operation times, nor to the per-step overhead). 1.0 = the kernel-level profile.
    serving: float = 1.0
    # Measured speed-up of the attention block from prefetching its weights during communication
    # (Instance.weight_prefetch); an upper bound on what step.py lets the technique hide.
    prefetch_attention_gain: float = 0.10
    # Operator-level terms (docs/planner.md "Calibration"); None falls back to the older single factor
    # named in brackets, so a file written for the older model keeps its meaning.
    gemm_memory: float | None = None       # weight streaming of small-M GEMMs, of HBM peak [memory]
    attention_memory: float | None = None  # MLA decode KV streaming, of HBM peak [attention]
    link_out: float | None = None          # scale-out achieved / nominal [link]
    out_latency_us: float | None = None    # per scale-out hop [link_latency_us]
    mla_min_rows: float = 1.0              # query rows (heads x q_len) a decode-attention tile computes
    mla_tflops: float | None = None        # measured decode-MLA kernel rate, TFLOPS [peak x attention]
    mla_fp8_gain: float | None = None      # FP8 decode MLA's measured speed-up over BF16 (None: none measured)
    tbo_max_gain: float = 0.35             # two-batch overlap's largest measured speed-up (hw.md +25-35%)
    # Two-batch overlap's measured gain by tokens per card per step on this device family, as (tokens,
    # gain) points, linear between them and held flat outside (data/hardware.yaml `tbo_gain`); the step
    # under overlap is never faster than serial / (1 + gain) (term overlap_bound). Empty: tbo_max_gain alone.
    tbo_gain: tuple[tuple[float, float], ...] = ()
    # End-to-end terms in force (TERMS); the kernel profile turns all off to show the gap term by term.
    terms: tuple[str, ...] = TERMS
    # (factor, low, high): the documented range of a factor whose point value is above (data/hardware.yaml
    # `ranges`); at(end) moves every ranged factor to that end, which bounds every prediction (`band`).
    ranges: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self):
        for k in ("gemm", "attention", "memory", "link", "memory_utilization", "serving"):
            v = getattr(self, k)
            if not FIGURE_MIN <= v <= 1.0:  # a fraction of peak: 0 divides by zero, > 1 beats the hardware
                raise ValueError(f"{k} is a fraction of peak, in [{FIGURE_MIN:g}, 1]; got {v:g}")
        for k in ("gemm_memory", "attention_memory", "link_out"):
            v = getattr(self, k)
            if v is not None and not FIGURE_MIN <= v <= 1.0:
                raise ValueError(f"{k} is a fraction of peak, in [{FIGURE_MIN:g}, 1]; got {v:g}")
        if self.out_latency_us is not None and not 0.0 <= self.out_latency_us <= FIGURE_MAX:
            raise ValueError(f"out_latency_us must be in [0, {FIGURE_MAX:g}], got {self.out_latency_us:g}")
        if self.mla_tflops is not None and not FIGURE_MIN <= self.mla_tflops <= FIGURE_MAX:
            raise ValueError(f"mla_tflops must be in [{FIGURE_MIN:g}, {FIGURE_MAX:g}], got {self.mla_tflops:g}")
        if self.mla_fp8_gain is not None and not 0.0 <= self.mla_fp8_gain <= 10.0:
            raise ValueError(f"mla_fp8_gain must be in [0, 10], got {self.mla_fp8_gain:g}")
        if not 0.0 <= self.tbo_max_gain <= 10.0:
            raise ValueError(f"tbo_max_gain must be in [0, 10], got {self.tbo_max_gain:g}")
        pts = [t for t, _ in self.tbo_gain]
        if pts != sorted(set(pts)) or any(not 1.0 <= t <= FIGURE_MAX or not -0.99 <= g <= 10.0
                                          for t, g in self.tbo_gain):
            raise ValueError("tbo_gain maps tokens per card (>= 1, each once) to a gain in [-0.99, 10], "
                             f"got {dict(self.tbo_gain)!r}")
        if not 1.0 <= self.mla_min_rows <= 4096:
            raise ValueError(f"mla_min_rows must be in [1, 4096], got {self.mla_min_rows:g}")
        bad = set(self.terms) - set(TERMS)
        if bad:
            raise ValueError(f"unknown term {sorted(bad)[0]!r}; known: {', '.join(TERMS)}")
        for k in ("link_latency_us", "step_overhead_ms"):
            if not 0.0 <= getattr(self, k) <= FIGURE_MAX:
                raise ValueError(f"{k} must be in [0, {FIGURE_MAX:g}], got {getattr(self, k):g}")
        if not 0.0 <= self.prefetch_attention_gain < 1.0:
            raise ValueError(f"prefetch_attention_gain must be in [0, 1), "
                             f"got {self.prefetch_attention_gain:g}")
        for k, lo, hi in self.ranges:  # a point outside its own range would fall outside its band
            if not lo <= getattr(self, k) <= hi:
                raise ValueError(f"{k} {getattr(self, k):g} lies outside its range [{lo:g}, {hi:g}]; "
                                 f"set the factor inside its range or change the range")

    def has(self, term: str) -> bool:
        return term in self.terms

    def tbo_bound(self, tokens: float) -> float:
        """The largest two-batch-overlap gain measured on this family at `tokens` per card per step (negative
        where it was measured to lose), never above tbo_max_gain."""
        pts = self.tbo_gain
        if not pts:
            return self.tbo_max_gain
        if tokens <= pts[0][0]:
            g = pts[0][1]
        elif tokens >= pts[-1][0]:
            g = pts[-1][1]
        else:
            (t0, g0), (t1, g1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= tokens <= b[0])
            g = g0 + (g1 - g0) * (tokens - t0) / (t1 - t0)
        return min(g, self.tbo_max_gain)

    @property
    def gemm_mem(self) -> float:
        return self.memory if self.gemm_memory is None else self.gemm_memory

    @property
    def attn_mem(self) -> float:
        return self.attention if self.attention_memory is None else self.attention_memory

    @property
    def link_up(self) -> float:
        return self.link

    @property
    def link_scale_out(self) -> float:
        return self.link if self.link_out is None else self.link_out

    @property
    def latency_out_us(self) -> float:
        return self.link_latency_us if self.out_latency_us is None else self.out_latency_us

    def at(self, end: str) -> "Efficiency":
        """Every ranged factor at its 'low' or 'high' end (no ranges left: a point set of factors)."""
        if end not in ("low", "high"):
            raise ValueError(f"end must be 'low' or 'high', got {end!r}")
        vals = {k: (lo if end == "low" else hi) for k, lo, hi in self.ranges}
        return replace(self, **vals, ranges=())


@dataclass(frozen=True)
class CollectiveTable:
    """Measured expert-parallel dispatch / combine times (data/hardware.yaml `collectives`), with the shape
    and the links they were measured on, so comm.py can take the payload out and keep the latency floor."""
    name: str
    tokens: float                 # tokens per rank in the measurement
    hidden: float
    topk: float
    dispatch_bytes: float         # bytes per element of a dispatched copy, scales included
    combine_bytes: float
    up_gbps: float                # the measuring system's achieved links
    out_gbps: float
    domain: int
    points: tuple[tuple[int, float, float], ...]   # (EP, dispatch us, combine us), EP ascending
    # DeepEP normal (prefill) kernels across nodes: (EP, dispatch GB/s, combine GB/s) as DeepEP counts them
    # (tokens x distinct destination nodes x bytes / time), measured behind a NIC of normal_nic_gbps.
    normal_rdma: tuple[tuple[int, float, float], ...] = ()
    normal_nic_gbps: float = 50.0
    normal_sm_share: float = 0.0   # share of the SMs the normal kernels occupy while they run

    def __post_init__(self):
        if not self.points or any(p[0] < 2 or p[1] <= 0 or p[2] <= 0 for p in self.points):
            raise ValueError(f"collectives {self.name!r}: points must be EP >= 2 -> [dispatch_us, combine_us] > 0")
        for k in ("tokens", "hidden", "topk", "dispatch_bytes", "combine_bytes", "up_gbps", "out_gbps"):
            if not FIGURE_MIN <= getattr(self, k) <= FIGURE_MAX:
                raise ValueError(f"collectives {self.name!r}: {k} must be in [{FIGURE_MIN:g}, {FIGURE_MAX:g}]")
        if self.domain < 1:
            raise ValueError(f"collectives {self.name!r}: domain must be >= 1")
        if any(p[0] < 2 or not FIGURE_MIN <= min(p[1:]) <= max(p[1:]) <= FIGURE_MAX for p in self.normal_rdma):
            raise ValueError(f"collectives {self.name!r}: normal_rdma must be EP >= 2 -> [dispatch, combine] GB/s "
                             f"in [{FIGURE_MIN:g}, {FIGURE_MAX:g}]")
        if not 0.0 <= self.normal_sm_share < 1.0:
            raise ValueError(f"collectives {self.name!r}: normal_sm_share must be in [0, 1)")
        if not FIGURE_MIN <= self.normal_nic_gbps <= FIGURE_MAX:
            raise ValueError(f"collectives {self.name!r}: normal_nic_gbps must be in [{FIGURE_MIN:g}, {FIGURE_MAX:g}]")


_POSITIVE = ("bf16_tflops", "int8_tops", "hbm_gib", "hbm_tbps", "scale_up_gbps", "scale_out_gbps")


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    bf16_tflops: float
    int8_tops: float
    fp8_tflops: float | None
    hbm_gib: float
    hbm_tbps: float
    scale_up_gbps: float
    scale_out_gbps: float
    scale_up_domain: int
    eff: Efficiency
    collective: CollectiveTable | None = None   # measured dispatch/combine floors of this fabric
    fp4_tflops: float | None = None             # dense FP4 (NVFP4 / MXFP4) tensor rate; None: no FP4 path

    def __post_init__(self):
        # Physical figures: a zero divides by zero in the roofline, a negative one gives negative times.
        # A denormal or astronomic one overflows a time or a byte count (FIGURE_MIN).
        for k in _POSITIVE:
            if not FIGURE_MIN <= getattr(self, k) <= FIGURE_MAX:
                raise ValueError(f"hardware {self.key!r}: {k} must be in [{FIGURE_MIN:g}, {FIGURE_MAX:g}], "
                                 f"got {getattr(self, k):g}")
        for k in ("fp8_tflops", "fp4_tflops"):
            v = getattr(self, k)
            if v is not None and not FIGURE_MIN <= v <= FIGURE_MAX:
                raise ValueError(f"hardware {self.key!r}: {k} must be in [{FIGURE_MIN:g}, {FIGURE_MAX:g}] "
                                 f"(or null: no {k[:3].upper()} path), got {v:g}")
        if self.scale_up_domain < 1:
            raise ValueError(f"hardware {self.key!r}: scale_up_domain must be >= 1 card, got {self.scale_up_domain}")

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s for GEMM inputs of this dtype ('bf16', 'int8', 'fp8', 'fp4'); a dtype the device has no
        tensor path for is refused naming the flag that chose it."""
        if dtype == "bf16":
            return self.bf16_tflops * 1e12
        if dtype == "int8":
            return self.int8_tops * 1e12
        if dtype == "fp8":
            if not self.fp8_tflops:
                raise ValueError(f"{self.name} has no FP8 tensor path; use --quantization a8w8 or bf16")
            return self.fp8_tflops * 1e12
        if dtype == "fp4":
            if not self.fp4_tflops:
                raise ValueError(f"{self.name} has no FP4 tensor path (NVFP4 / MXFP4 need Blackwell or CDNA 4); "
                                 f"use --quantization {'fp8' if self.fp8_tflops else 'a8w8'} or bf16")
            return self.fp4_tflops * 1e12
        raise ValueError(f"unknown compute dtype {dtype!r}")

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    @property
    def hbm_bw(self) -> float:  # bytes/s
        return self.hbm_tbps * 1e12

    def with_overrides(self, **kw) -> "Hardware":
        """Change wiring/peaks (e.g. --scale-up-gbps) while keeping the rest."""
        kw = {k: v for k, v in kw.items() if v is not None}
        eff_kw = {k: kw.pop(k) for k in list(kw) if k in _EFF_KEYS}
        hw = replace(self, **kw)
        if not eff_kw:
            return hw
        ranges = tuple(r for r in hw.eff.ranges if r[0] not in eff_kw)  # an overridden factor is pinned
        return replace(hw, eff=replace(hw.eff, **eff_kw, ranges=ranges))

    def at(self, end: str) -> "Hardware":
        """This hardware with its efficiency factors at the low or high end of their documented ranges."""
        return replace(self, eff=self.eff.at(end))


def _gain_points(table, what: str) -> tuple[tuple[float, float], ...]:
    """`tbo_gain: {tokens per card: gain}` as sorted points (Efficiency checks the ranges)."""
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{what}: tbo_gain must map tokens per card to a gain, got {table!r}")
    def tokens(t):  # a JSON file's keys are strings
        try:
            return float(t) if isinstance(t, str) else number({"tokens": t}, "tokens", f"{what} tbo_gain")
        except ValueError:
            raise ValueError(f"{what}: tbo_gain keys are tokens per card, got {t!r}") from None
    return tuple(sorted((tokens(t), number(table, t, f"{what} tbo_gain")) for t in table))


class HardwareDB:
    """`profile`: 'end_to_end' (default, data/hardware.yaml efficiency.default_profile) prices a serving
    step; 'kernel' uses the kernel-level factors alone (what kernel microbenchmarks reach)."""

    def __init__(self, extra_file: str | Path | None = None, profile: str | None = None):
        self.raw = read(None)
        self.source = f"--hardware-file {extra_file}: " if extra_file else ""
        extra = read(Path(extra_file)) if extra_file else {}
        if extra_file:
            self.raw = merge(self.raw, extra)
        self.profile = profile or self.raw["efficiency"].get("default_profile", "kernel")
        profiles = self.raw["efficiency"].get("profiles") or {}
        if self.profile not in profiles:
            raise ValueError(f"{self.source}unknown efficiency profile {self.profile!r}; "
                             f"known: {', '.join(sorted(profiles))}")
        # A shared range the file gives for a factor the profile sets itself would be silently ignored
        # (_eff): every built-in profile sets serving, so efficiency.ranges.serving never applied.
        for k in ((extra.get("efficiency") or {}).get("ranges") or {}):
            if k in (profiles[self.profile] or {}):
                raise ValueError(f"{self.source}efficiency.ranges.{k} does not apply to profile {self.profile}, "
                                 f"which sets {k} itself; give it as efficiency.profiles.{self.profile}.ranges.{k}")
        if extra_file:  # every entry now, so a bad one is reported with its file, not at first use
            default = self.raw["efficiency"].get("default_profile")
            for name in (extra.get("efficiency") or {}).get("profiles") or {}:
                # --efficiency-profile offers the built-in names only: any other profile is reachable just
                # through default_profile, so one that is not would be silently ignored (a typo).
                if name not in PROFILES and name != default:
                    raise ValueError(f"{self.source}efficiency.profiles.{name} is never used: profiles are "
                                     f"{', '.join(PROFILES)}, or a new one named by efficiency.default_profile")
            for name in self.names():
                self.get(name)
            systems = self.raw["systems"]
            for name in self.raw["efficiency"].get("devices") or {}:
                if name not in self.raw["devices"]:  # factors are looked up by device: they would be ignored
                    if name in systems:
                        what = f"is a system; set its device's (efficiency.devices.{systems[name].get('device')})"
                    else:
                        what = f"is not a device; known: {', '.join(sorted(self.raw['devices']))}"
                    raise ValueError(f"{self.source}efficiency.devices.{name} {what}")

    def names(self) -> list[str]:
        return sorted(self.raw["devices"]) + sorted(self.raw["systems"])

    def _eff(self, device_key: str) -> Efficiency:
        profile = dict(self.raw["efficiency"]["profiles"][self.profile] or {})
        # A factor the profile (or the device, below) sets is described by the profile's range, if any,
        # not by the shared one.
        ranges = {k: v for k, v in (self.raw["efficiency"].get("ranges") or {}).items() if k not in profile}
        own = profile.pop("ranges", None) or {}
        ranges.update(own)
        device = (self.raw["efficiency"].get("devices") or {}).get(device_key) or {}
        shared = {**self.raw["efficiency"]["default"], **profile}
        eff = {**shared, **device}
        what = f"efficiency of {device_key!r} (profile {self.profile})"
        vals = {k: number(eff, k, what) for k in EFF_FIELDS}
        vals.update({k: number(eff, k, what) for k in EFF_OPTIONAL if eff.get(k) is not None})
        if eff.get("tbo_gain") is not None:
            vals["tbo_gain"] = _gain_points(eff["tbo_gain"], what)
        if "terms" in eff:
            terms = eff["terms"]
            if not isinstance(terms, list) or not all(isinstance(t, str) for t in terms):
                raise ValueError(f"{what}: terms must be a list of names, got {terms!r}")
            vals["terms"] = tuple(terms)
        # A factor set for this device alone is pinned: the shared range does not describe it (one set at
        # the shared value, e.g. a --hardware-file restating it, changes nothing and keeps the range).
        vals["ranges"] = tuple((k, float(lo), float(hi)) for k, (lo, hi) in sorted(ranges.items())
                               if k not in device or device[k] == shared.get(k))
        for k, lo, hi in vals["ranges"]:  # name the two entries to change (Efficiency knows neither)
            if not lo <= vals[k] <= hi:
                p = f"efficiency.profiles.{self.profile}"
                raise ValueError(f"{what}: {k} {vals[k]:g} ({p if k in profile else 'efficiency.default'}.{k}) "
                                 f"lies outside its range [{lo:g}, {hi:g}] "
                                 f"({p + '.ranges' if k in own else 'efficiency.ranges'}.{k}); "
                                 "set the factor inside its range or change the range")
        try:
            return Efficiency(**vals)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None

    def _collective(self, name, what: str) -> CollectiveTable | None:
        if name is None:
            return None
        table = (self.raw.get("collectives") or {}).get(name) if isinstance(name, str) else None
        if table is None:
            raise ValueError(f"{what}: collectives {name!r} is not in the collectives section; known: "
                             f"{', '.join(sorted(self.raw.get('collectives') or {}))}")
        where = f"collectives {name!r}"
        pts = table.get("points")
        if not isinstance(pts, dict) or not all(isinstance(v, list) and len(v) == 2 for v in pts.values()):
            raise ValueError(f"{where}: points must map EP -> [dispatch_us, combine_us]")
        points = tuple(sorted((int(ep), float(d), float(c)) for ep, (d, c) in pts.items()))
        normal = table.get("normal_rdma") or {}
        bad = ValueError(f"{where}: normal_rdma must map EP -> [dispatch_gbps, combine_gbps]")
        if not isinstance(normal, dict) or not all(isinstance(v, list) and len(v) == 2 for v in normal.values()):
            raise bad
        try:
            rows = tuple(sorted((int(ep), float(d), float(c)) for ep, (d, c) in normal.items()))
        except (TypeError, ValueError):
            raise bad from None
        extra = {"normal_rdma": rows}
        for k in ("normal_nic_gbps", "normal_sm_share"):
            if table.get(k) is not None:
                extra[k] = number(table, k, where)
        return CollectiveTable(name=name, points=points, domain=number(table, "domain", where, int), **extra,
                               **{k: number(table, k, where) for k in ("tokens", "hidden", "topk", "dispatch_bytes",
                                                                      "combine_bytes", "up_gbps", "out_gbps")})

    def get(self, name: str) -> Hardware:
        key = name.lower()
        systems, devices = self.raw["systems"], self.raw["devices"]
        sys_entry = {}
        if key in systems:
            sys_entry = dict(systems[key])
            dev_key = sys_entry.pop("device", None)
        elif key in devices:
            dev_key = key
        else:
            raise ValueError(f"unknown hardware {name!r}; known: {', '.join(self.names())}")
        if not isinstance(dev_key, str) or dev_key not in devices:
            raise ValueError(f"{self.source}system {name!r} names unknown device {dev_key!r}")
        dev = {**devices[dev_key], **sys_entry}
        what = f"{'system' if sys_entry else 'device'} {key!r}"
        try:
            coll = self._collective(dev.pop("collectives", None), what)
            return Hardware(key=key, name=str(dev.get("name", key)),
                            **{k: number(dev, k, what) for k in _POSITIVE},
                            fp8_tflops=number(dev, "fp8_tflops", what) if dev.get("fp8_tflops") is not None else None,
                            fp4_tflops=number(dev, "fp4_tflops", what) if dev.get("fp4_tflops") is not None else None,
                            scale_up_domain=number({"scale_up_domain": 8, **dev}, "scale_up_domain", what, int),
                            eff=self._eff(dev_key), collective=coll)
        except ValueError as err:
            raise ValueError(f"{self.source}{err}") from None


def load_hardware(name: str, extra_file: str | Path | None = None, profile: str | None = None) -> Hardware:
    return HardwareDB(extra_file, profile).get(name)


def cpu_hardware(prof: dict, overhead_ms: float) -> Hardware:
    """This CPU as a one-card device from measured rates (planner/cpucheck.py profile(): GFLOPS at decode
    shapes, weight-streaming GB/s); the engine's step-time prior uses it with nominal rates."""
    eff = Efficiency(gemm=1.0, attention=1.0, memory=1.0, link=1.0, link_latency_us=0.0,
                     step_overhead_ms=overhead_ms, memory_utilization=0.9,
                     serving=1.0)  # measured rates and per-op cost stand in for the serving derating
    rate = prof["gemm_decode_gflops"] / 1e3  # TFLOPS at decode shapes, not the 1024^3 peak
    return Hardware(key="this-cpu", name="this CPU (measured)", bf16_tflops=rate, int8_tops=rate,
                    fp8_tflops=None, hbm_gib=16, hbm_tbps=prof["gemm_stream_gbs"] / 1e3, scale_up_gbps=1.0,
                    scale_out_gbps=1.0, scale_up_domain=1, eff=eff)
