"""Target: the GPU (or host) a plan is made for, and how to name or detect one.

``resolve_target`` takes a preset name (case-insensitive, aliases allowed,
plugins may add presets) or ``auto``; ``detect_target`` reads the first
CUDA/ROCm device through torch. Unknown names raise ``UnknownTargetError``
with the closest names.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any

from kvgen import target_presets
from kvgen.errors import UnknownTargetError


@dataclass(frozen=True)
class Target:
    """One device, as far as KV-cache planning and kernel selection are concerned.

    ``memory_bytes`` is the device memory (bytes); ``memory_bandwidth`` and
    ``host_link_bandwidth`` (per direction, to host memory) are bytes/s;
    ``shared_mem_per_sm`` and ``l2_bytes`` are bytes. ``arch`` is the
    compile target: ``sm_XY`` for NVIDIA, ``gfxNNN`` for AMD, ``cpu``.
    ``notes`` says which values were measured, estimated or assumed.
    ``host_link_measured`` is the date of the ``kvgen probe`` measurement
    ``host_link_bandwidth`` comes from (its host-to-device figure); empty
    when the figure is a preset's or an assumption.
    """

    name: str
    memory_bytes: int
    memory_bandwidth: float
    sm_count: int
    shared_mem_per_sm: int
    l2_bytes: int
    arch: str
    fp8: bool
    host_link_bandwidth: float
    vendor: str
    notes: str = ""
    host_link_measured: str = ""

    def host_link_text(self) -> str:
        """The host-link figure and where it comes from, for plan reasons."""
        gbs = f"host link {self.host_link_bandwidth / 1e9:.1f} GB/s"
        if self.host_link_measured:
            return f"{gbs} (measured by kvgen probe on {self.host_link_measured})"
        return f"{gbs} (preset, not measured: run kvgen probe)"

    @property
    def arch_number(self) -> int:
        """The CUDA compute capability as an int (``sm_90`` -> 90, ``sm_120`` -> 120); 0 when not CUDA."""
        m = re.fullmatch(r"sm_(\d+)[a-z]?", self.arch)
        return int(m.group(1)) if m else 0

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-able dict; ``Target(**t.to_json())`` round-trips."""
        return dataclasses.asdict(self)


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _presets() -> dict[str, Target]:
    cols = target_presets.COLUMNS
    return {row[0]: Target(**dict(zip(cols, row))) for row in target_presets.PRESETS}


def _plugin_targets() -> list[Target]:
    # Imported here: loading plugins is only worth it when a name is not a built-in.
    from kvgen.registry import default_registry

    objs = default_registry().targets.values()
    return [o[0] if isinstance(o, tuple) else o for o in objs]


def list_targets() -> list[Target]:
    """Built-in presets, then plugin-registered targets whose names are not taken."""
    targets = list(_presets().values())
    taken = {_norm(t.name) for t in targets}
    return targets + [t for t in _plugin_targets() if _norm(t.name) not in taken]


def resolve_target(name: str) -> Target:
    """The Target called ``name`` (``auto``: :func:`detect_target`).

    Raises UnknownTargetError naming the 3 closest targets when nothing matches.
    """
    key = _norm(name)
    if key == "auto":
        return detect_target()
    key = target_presets.ALIASES.get(key, key)
    presets = _presets()
    if key in presets:
        return presets[key]
    for t in _plugin_targets():
        if _norm(t.name) == key:
            return t
    names = {_norm(t.name): t.name for t in list_targets()}
    names.update(target_presets.ALIASES)
    close: list[str] = []
    for hit in difflib.get_close_matches(key, list(names), n=len(names), cutoff=0.0):
        if names[hit] not in close:
            close.append(names[hit])
    raise UnknownTargetError(
        f"unknown target {name!r}; closest: {', '.join(close[:3])} (`kvgen targets` lists all, `auto` detects the GPU)")


# Device name -> preset, first match wins, so the more specific patterns come
# first: "GH200" contains "H200", "GB200" contains "B200", "H100 PCIe" and
# "H100 NVL" contain "H100". None: a part with no preset of its own (H100 NVL
# has 94 GB at 3.9 TB/s; GB200 has NVLink-C2C), described from its properties.
_NAME_RULES: tuple[tuple[str, str | None], ...] = (
    (r"GH200", "gh200"),
    (r"GB200", None),
    (r"H200", "h200"),
    (r"H100.*NVL", None),
    (r"H100.*PCIe", "h100-pcie"),
    (r"H100", "h100"),
    (r"A100.*40\s*GB", "a100-40gb"),
    (r"A100", "a100"),
    (r"L40S", "l40s"),
    (r"RTX\s*4090", "rtx4090"),
    (r"RTX\s*5090", "rtx5090"),
    (r"B200", "b200"),
    (r"MI300X", "mi300x"),
)


def detect_target() -> Target:
    """The Target of CUDA/ROCm device 0, for ``--target auto``.

    A device whose name matches a preset gets that preset's datasheet
    bandwidth and link speed, with memory, SM count, L2 and shared memory
    taken from the device itself (the driver's memory total, a MIG slice's
    SMs). Any other device is described from its properties, bandwidth
    estimated; ``notes`` says what was estimated. Where ``kvgen probe``
    stored a measurement of this device (by name), its host-to-device
    bandwidth replaces the datasheet's host link. Raises
    UnknownTargetError when torch sees no GPU.
    """
    import torch  # deferred: importing torch costs seconds the other commands do not need

    if not torch.cuda.is_available():
        raise UnknownTargetError("--target auto found no CUDA GPU; pass a target name such as h100 (kvgen targets lists them)")
    props = torch.cuda.get_device_properties(0)
    dev_name = str(props.name)
    measured = {
        "memory_bytes": int(props.total_memory),
        "sm_count": int(props.multi_processor_count),
    }
    # Older torch lacks these attributes; the preset's datasheet value stands in.
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    smem = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
    if l2:
        measured["l2_bytes"] = l2
    if smem:
        measured["shared_mem_per_sm"] = smem
    preset = next((p for pat, p in _NAME_RULES if re.search(pat, dev_name, re.IGNORECASE)), None)
    if preset is not None:
        target = dataclasses.replace(
            _presets()[preset], **measured,
            notes=f"detected {dev_name!r}; memory, SMs, L2 and shared memory read from the device, "
                  f"bandwidth and host link from the {preset} datasheet")
    else:
        target = _from_properties(props, dev_name, measured, hip=bool(getattr(torch.version, "hip", None)))
    return _with_probe(target, dev_name)


def _with_probe(target: Target, dev_name: str) -> Target:
    """``target`` with the host link ``kvgen probe`` measured on ``dev_name``, when one is stored."""
    from kvgen.probe import load_probe

    probe = load_probe(dev_name)
    if probe is None:
        return target
    return dataclasses.replace(
        target, host_link_bandwidth=float(probe["host_to_device_bandwidth"]), host_link_measured=probe["date"],
        notes=f"{target.notes}; host link measured by kvgen probe on {probe['date']} (replaces the figure above)")


def _from_properties(props: Any, dev_name: str, measured: dict[str, int], hip: bool) -> Target:
    """A Target for a device with no preset, bandwidth estimated from its memory clock when torch reports it."""
    notes = [f"detected {dev_name!r} (no preset); memory, SMs, L2, shared memory read from the device"]
    clock_khz = int(getattr(props, "memory_clock_rate", 0) or 0)
    bus_bits = int(getattr(props, "memory_bus_width", 0) or 0)
    if clock_khz and bus_bits:
        # Double data rate: two transfers per clock over the whole bus.
        bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8
        notes.append("bandwidth estimated as 2 x memory clock x bus width")
    else:
        bandwidth = 1e12
        notes.append("bandwidth unknown, assumed 1 TB/s")
    if hip:
        arch = str(getattr(props, "gcnArchName", "") or "gfx").split(":")[0]
        vendor, fp8 = "amd", arch in ("gfx942", "gfx950")
    else:
        arch = f"sm_{props.major}{props.minor}"
        vendor, fp8 = "nvidia", props.major * 10 + props.minor >= 89  # FP8 tensor cores from Ada (8.9) on
    # PCIe Gen5 arrived with Hopper-era servers; older parts are assumed Gen4.
    link = 64e9 if (hip or props.major >= 9) else 32e9
    notes.append(f"host link assumed PCIe Gen{5 if link == 64e9 else 4} x16")
    return Target(
        name=_norm(dev_name).replace("nvidia-", "", 1) or "gpu",
        memory_bandwidth=bandwidth,
        shared_mem_per_sm=measured.get("shared_mem_per_sm", 0),
        l2_bytes=measured.get("l2_bytes", 0),
        memory_bytes=measured["memory_bytes"],
        sm_count=measured["sm_count"],
        arch=arch, fp8=fp8, host_link_bandwidth=link, vendor=vendor,
        notes="; ".join(notes),
    )
