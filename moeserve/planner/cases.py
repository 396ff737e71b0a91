"""Published results to check the planner against: the built-in data/published.yaml, or a user's own file
(`moeserve plan validate --cases FILE`: their cluster's measured figures, other published deployments).

Shape (YAML or JSON), checked when read so that a bad entry is an error naming the file, the case and the
field, never a traceback halfway through a validation run:

    tolerance: 0.15                 # optional, the +-share a row may miss by (default 0.15)
    cases:                          # counted in all_within
      - id: my-decode               # unique
        what: free text             # optional
        model: deepseek-v3          # optional: preset, config.json or checkpoint folder
        hardware: hgx-h800          # device or system (--hardware-file adds more)
        kind: decode                # decode: tpot_ms + workload; prefill: requests + input_len
        tpot_ms: 50
        workload: {input_len: 2048, output_len: 2048}
        instance: {cards: 32, quantization: fp8, ...}   # moeserve.perf.deploy.Instance fields
        published: {metric: tok_s_card, value: 1850}    # decode: tok_s_card; prefill: ttft_ms or tok_s_card
    unlisted: [...]                 # optional, same shape: reported, not counted
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from importlib import resources
from pathlib import Path

import yaml

from moeserve.files import read_text
from moeserve.planner.cli_args import MAX_INT
from moeserve.perf.deploy import MAX_CARDS, Instance, PlanError, Workload
from moeserve.perf.hardware import FIGURE_MAX, FIGURE_MIN

CASE_FIELDS = {"id", "what", "model", "hardware", "kind", "tpot_ms", "batch_per_device", "workload", "requests",
               "tokens_per_device", "input_len", "instance", "published", "handoff"}
KIND_FIELDS = {"decode": ("tpot_ms", "workload"), "prefill": ("requests", "input_len")}
# What a published deployment may state instead (issue 41): its batch per device, its prompt tokens per device.
ALTERNATIVE = {"tpot_ms": "batch_per_device", "requests": "tokens_per_device"}
KIND_ONLY = {kind: set(f) | {ALTERNATIVE[x] for x in f if x in ALTERNATIVE} for kind, f in KIND_FIELDS.items()}
METRICS = {"decode": ("tok_s_card",), "prefill": ("ttft_ms", "tok_s_card")}
_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}
# The flags Instance's and the model's errors name, as the field of a case to change.
_FLAG_FIELDS = {"--cards": "instance.cards", "--tp": "instance.tp", "--shared-expert-ranks":
                "instance.shared_expert_ranks", "--redundant-experts": "instance.redundant_experts",
                "--mtp-drafts": "instance.mtp_drafts", "--mtp-acceptance": "instance.mtp_acceptance",
                "--imbalance": "instance.imbalance", "--model": "model"}


def as_fields(msg: str) -> str:
    """A planner error about a case, naming the case's fields instead of flags the user never typed."""
    return re.sub(r"--[a-z-]+", lambda m: _FLAG_FIELDS.get(m[0], m[0]), msg)


def builtin() -> dict:
    text = resources.files("moeserve.planner").joinpath("data/published.yaml").read_text()
    return check(yaml.safe_load(text), "data/published.yaml")


def read(path: str | Path) -> dict:
    """A user's cases file, checked."""
    label = f"--cases {path}"
    text = read_text(path, label, "YAML or JSON")
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{label}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                         f"{str(err).splitlines()[0]}") from None
    except RecursionError:  # thousands of nested [ or {: both parsers recurse
        raise ValueError(f"{label}: nested too deeply to be a cases file") from None
    return check(data, label)


def check(data, src: str) -> dict:
    """The table with defaults filled in (tolerance, what, model, unlisted), or ValueError naming the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{src}: expected a mapping with cases (and optional tolerance, unlisted)")
    unknown = set(data) - {"tolerance", "cases", "unlisted", "per_layer"}
    if unknown:
        raise ValueError(f"{src}: unknown top-level field {sorted(unknown)[0]!r}; known: tolerance, cases, "
                         "unlisted, per_layer")
    tol = data.get("tolerance", 0.15)
    if not _number(tol) or not 0 < tol < 10:
        raise ValueError(f"{src}: tolerance is a share (0.15 = +-15%), got {_got(tol)}")
    if not isinstance(data.get("cases"), list) or not data["cases"]:
        raise ValueError(f"{src}: cases must be a non-empty list of cases")
    if not isinstance(data.get("unlisted", []), list):
        raise ValueError(f"{src}: unlisted must be a list of cases")
    ids: set = set()
    out = {"tolerance": float(tol)}
    for part in ("cases", "unlisted"):
        out[part] = [_case(c, f"{src}: {part}[{i}]", ids) for i, c in enumerate(data.get(part) or [])]
    out["per_layer"] = [_layer_check(c, f"{src}: per_layer[{i}]", out) for i, c in enumerate(data.get("per_layer") or [])]
    return out


LAYER_FIELDS = {"id", "case", "batch", "context", "mtp_drafts", "published_us"}


def _layer_check(c, where: str, table: dict) -> dict:
    """A published per-layer decode time: a decode case's hardware and layout at a given batch and KV length."""
    if not isinstance(c, dict) or set(c) != LAYER_FIELDS:
        raise ValueError(f"{where}: a per-layer check has exactly {', '.join(sorted(LAYER_FIELDS))}")
    named = {x["id"]: x for x in table["cases"] + table["unlisted"]}
    if named.get(c["case"], {}).get("kind") != "decode":
        raise ValueError(f"{where}: case {c['case']!r} is not a decode case of this file")
    for k in ("batch", "context", "mtp_drafts"):
        if not isinstance(c[k], int) or isinstance(c[k], bool) or not (0 if k == "mtp_drafts" else 1) <= c[k] <= MAX_INT:
            raise ValueError(f"{where}: {k} must be an integer, got {_got(c[k])}")
    _figure(c["published_us"], where, "published_us")
    return dict(c)


def _number(v) -> bool:
    # An int is finite whatever its size (math.isfinite(10**400) raised OverflowError).
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))


def _got(v) -> str:
    """v for an error line: 10**400 written out is 400 digits."""
    r = repr(v)
    return r if len(r) <= 30 else r[:20] + "..."


def _figure(v, where: str, what: str) -> None:
    """A time or rate: in the range --tpot-ms and hardware figures take (1e-320 made the error +inf%, which
    --json printed as Infinity, not JSON; 10**400 overflowed a float)."""
    if not _number(v) or not FIGURE_MIN <= v <= FIGURE_MAX:
        raise ValueError(f"{where}: {what} must be a number in [{FIGURE_MIN:g}, {FIGURE_MAX:g}], got {_got(v)}")


def _handoff(h, kind: str, where: str) -> dict:
    """A prefill case's PD hand-off: the decode instance that pulls the KV and runs the first step, and the
    deployment's cards (which decide whether the pull crosses scale-out)."""
    if kind != "prefill":
        raise ValueError(f"{where}: handoff is for prefill cases")
    if not isinstance(h, dict) or set(h) != {"instance", "deployment_cards"}:
        raise ValueError(f"{where}: handoff is {{instance, deployment_cards}}, got {h!r}")
    d = h["deployment_cards"]
    if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= MAX_CARDS:
        raise ValueError(f"{where}: handoff.deployment_cards must be an integer in [1, {MAX_CARDS}], got {_got(d)}")
    inst = _fields(Instance, h["instance"], f"{where}: handoff.instance")
    Instance(**inst)
    return {"instance": inst, "deployment_cards": d}


def _case(c, where: str, ids: set) -> dict:
    if not isinstance(c, dict):
        raise ValueError(f"{where}: a case is a mapping of fields, got {type(c).__name__}")
    if not isinstance(c.get("id"), str) or not c["id"]:
        raise ValueError(f"{where}: needs an id (a string)")
    if not c["id"].isprintable():  # every error names it: a newline in it split the one error line
        raise ValueError(f"{where}: id must be one line of printable text, got {c['id']!r}")
    where = f"{where} ({c['id']})"
    if c["id"] in ids:
        raise ValueError(f"{where}: id used twice")
    ids.add(c["id"])
    unknown = set(c) - CASE_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(CASE_FIELDS))}")
    kind = c.get("kind")
    if kind not in KIND_FIELDS:
        raise ValueError(f"{where}: kind must be decode or prefill, got {kind!r}")
    for k in ("hardware", "instance", "published") + KIND_FIELDS[kind]:
        alt = ALTERNATIVE.get(k)
        if k in c and alt in c:
            raise ValueError(f"{where}: give {k} or {alt}, not both")
        if k not in c and alt not in c:
            raise ValueError(f"{where}: a {kind} case needs {k}" + (f" (or {alt})" if alt else ""))
    extra = set().union(*(v for k, v in KIND_ONLY.items() if k != kind))
    if extra & set(c):
        raise ValueError(f"{where}: {sorted(extra & set(c))[0]} is for the other kind of case, not {kind}")
    for k in ("hardware", "what", "model"):
        if k in c and not isinstance(c[k], str):
            raise ValueError(f"{where}: {k} must be a string, got {c[k]!r}")
    out = {"what": c["id"], "model": "deepseek-v3", **c}
    if not isinstance(c["instance"], dict) or "cards" not in c["instance"]:
        raise ValueError(f"{where}: instance needs cards (and any other Instance field)")
    try:
        out["instance"] = _fields(Instance, c["instance"], f"{where}: instance")
        for k in ("batch_per_device", "tokens_per_device"):
            if k in c and (not isinstance(c[k], int) or isinstance(c[k], bool) or not 1 <= c[k] <= MAX_INT):
                raise ValueError(f"{where}: {k} must be an integer in [1, {MAX_INT:.0e}], got {_got(c[k])}")
        if kind == "decode":
            if "tpot_ms" in c:
                _figure(c["tpot_ms"], where, "tpot_ms")
            out["workload"] = wl = _fields(Workload, c["workload"], f"{where}: workload")
            # Workload checks nothing itself (the CLI's flags do): a length of -5 priced a nonsense row.
            for k in ("input_len", "output_len"):
                if wl.get(k, 1) < 1:
                    raise ValueError(f"{where}: workload.{k} must be an integer >= 1, got {wl[k]!r}")
            if not 0 <= wl.get("prefix_hit", 0) < 1:
                raise ValueError(f"{where}: workload.prefix_hit is the share of prompt tokens found cached, "
                                 f"in [0, 1), got {wl['prefix_hit']!r}")
        else:
            for k in [x for x in ("requests", "input_len") if x in c]:
                if not isinstance(c[k], int) or isinstance(c[k], bool) or not 1 <= c[k] <= MAX_INT:
                    raise ValueError(f"{where}: {k} must be an integer in [1, {MAX_INT:.0e}], got {_got(c[k])}")
        inst = Instance(**out["instance"])  # its own checks (divisibility, choices, ranges)
        if "tokens_per_device" in c:  # priced as the prompts it makes (the rows and the hand-off use requests)
            from moeserve.planner.analysis import requests_for_tokens
            out["requests"] = requests_for_tokens(inst, c["tokens_per_device"], c["input_len"], "tokens_per_device")
        if "handoff" in c:
            out["handoff"] = _handoff(c["handoff"], kind, where)
    except PlanError as err:
        raise ValueError(f"{where}: {as_fields(str(err))}") from None
    pub = c["published"]
    if not isinstance(pub, dict) or set(pub) - {"metric", "value", "note"}:
        raise ValueError(f"{where}: published is {{metric, value}} (and an optional note), got {pub!r}")
    if pub.get("metric") not in METRICS[kind]:
        raise ValueError(f"{where}: published.metric of a {kind} case is one of {', '.join(METRICS[kind])}, "
                         f"got {pub.get('metric')!r}")
    _figure(pub.get("value"), where, "published.value")
    return out


def _fields(cls, given, where: str) -> dict:
    """`given` as keyword arguments of dataclass `cls`, each of its field's type (ints, numbers, booleans,
    strings as YAML gives them: "32" or 32.0 cards is an error, not a silent conversion)."""
    if not isinstance(given, dict):
        raise ValueError(f"{where} must be a mapping of fields, got {type(given).__name__}")
    types = {f.name: str(f.type) for f in fields(cls)}
    for k, v in given.items():
        if k not in types:
            raise ValueError(f"{where}: unknown field {k!r}; known: {', '.join(types)}")
        kind = types[k].replace(" | None", "")  # an optional field (max_num_seqs) takes its type or null
        if v is None and kind != types[k]:
            continue
        want = _TYPES.get(kind)
        ok = want is None or isinstance(v, want) and not (want is not bool and isinstance(v, bool))
        if want is not None and not ok or (kind == "float" and not _number(v)):
            raise ValueError(f"{where}.{k} must be a{'n' if kind == 'int' else ''} {kind}, got {v!r}")
        # The limits the CLI flags enforce (--cards, integer flags, --imbalance): 10**30 cards or 10**400
        # anything overflowed a float or priced a nonsense row.
        high = {"cards": MAX_CARDS, "imbalance": FIGURE_MAX}.get(k, MAX_INT if kind == "int" else None)
        if high is not None and v > high:
            raise ValueError(f"{where}.{k} must be <= {high:g}, got {_got(v)}")
    return dict(given)
