"""Elastic EP --elastic-ep-host-copy: each rank keeps a copy of its routed experts in host shared memory, so
the survivors of a loss take a lost expert that no survivor holds from there instead of the checkpoint.

Lifecycle: a rank that builds its engine core (at start-up, or a replacement) writes one file in the front
end's folder (/dev/shm where there is one) before it reports ready: each distinct expert it holds, every
per-slot tensor of it as it serves (quantized ones with their scales: nothing is quantized again). The file
outlives the rank (the point: a lost rank's file is what its survivors read); a survivor re-placing its
slots (elastic_placement.keep_core) and a replacement building its core (elastic_replace.build_core) look
there for each expert no survivor holds, and only an expert in no file is read from the checkpoint. Files
are never rewritten: every expert a rank ever took over came from a file or the checkpoint already. The
front end removes the folder at start and at shutdown.
"""
from __future__ import annotations

import glob
import os
import tempfile

import torch


def folder(front_end_port: int) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"moeserve-elastic-{front_end_port}-experts")


def _key(root: int, module: str, expert: int, param: str) -> str:
    return f"{root}/{module}/{expert}/{param}"


def write(worker, roots: list, slot_params) -> int:
    """This rank's distinct experts (each tensor's row of the expert's first slot) to its own file; written
    under another name, then renamed, so a reader never sees half a file. Returns the bytes written."""
    from safetensors.torch import save_file

    from moeserve.layers.moe.experts import FusedExperts

    tensors: dict[str, torch.Tensor] = {}
    for k, root in enumerate(roots):
        for name, m in root.named_modules():
            if not isinstance(m, FusedExperts):
                continue
            first: dict[int, int] = {}
            for s, e in enumerate(m.slot_experts):
                first.setdefault(e, s)
            for pname, prm in slot_params(m):
                for e, s in first.items():
                    tensors[_key(k, name, e, pname)] = prm.data[s].clone()  # a row of its own (safetensors)
    where = folder(worker.front_end_port)
    path = os.path.join(where, f"{os.getpid()}.safetensors")
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        os.makedirs(where, exist_ok=True)
        save_file(tensors, path + ".part")
        os.replace(path + ".part", path)
    except OSError as e:  # a full /dev/shm (a container's is 64 MiB by default): say what it takes
        try:
            os.unlink(path + ".part")
        except OSError:
            pass
        raise RuntimeError(f"--elastic-ep-host-copy: cannot write this rank's {size / 2**20:.1f} MiB of experts to "
                           f"{path}: {e}; the copy needs that much free in {os.path.dirname(where)} per rank: "
                           "make room there or drop the flag") from e
    return size


class HostCopy:
    """The files in the folder (the lost ranks' too), indexed once."""

    def __init__(self, front_end_port: int) -> None:
        from safetensors import safe_open

        self.files: list[tuple[str, set[str]]] = []
        for path in sorted(glob.glob(os.path.join(folder(front_end_port), "*.safetensors"))):
            try:
                with safe_open(path, framework="pt") as f:
                    self.files.append((path, set(f.keys())))
            except Exception:  # noqa: BLE001 - unreadable: its experts come from the checkpoint
                continue
        self.experts = {k.rsplit("/", 1)[0] for _, keys in self.files for k in keys}  # "root/module/expert"

    def has(self, root: int, module: str, expert: int) -> bool:
        """Whether a file holds `expert` of that experts module (a rank writes every tensor of an expert it
        holds): a replacement rank then leaves it unread at its build (elastic_replace.py)."""
        return _key(root, module, expert, "")[:-1] in self.experts

    def fill(self, root: int, module: str, expert: int, tensors: list[tuple[str, torch.Tensor]],
             slots: list[int]) -> bool:
        """Write `expert`'s rows into `slots` of each (param name, new [slots, ...] tensor); False when no file
        holds all its tensors (then nothing is written)."""
        from safetensors import safe_open

        keys = [_key(root, module, expert, p) for p, _ in tensors]
        for path, have in self.files:
            if all(k in have for k in keys):
                with safe_open(path, framework="pt") as f:
                    for k, (_, t) in zip(keys, tensors):
                        row = f.get_tensor(k)
                        for j in slots:
                            t[j] = row
                return True
        return False
