"""What the agent reports about its host: name, address, CPUs, memory and GPUs.

GPUs come from ``torch.cuda`` when a CUDA build of torch sees devices, else from ``nvidia-smi``; a CPU-only
host reports none.
"""

from __future__ import annotations

import os
import shutil
import subprocess

AGENT_VERSION = "kvfleet-agent 0.1.0"


def gpus() -> list[dict]:
    """``[{index, model, memory_mib}]`` of this host's NVIDIA GPUs; ``[]`` when there are none."""
    try:
        import torch

        if torch.cuda.is_available():
            return [
                {
                    "index": i,
                    "model": torch.cuda.get_device_name(i),
                    "memory_mib": torch.cuda.get_device_properties(i).total_memory // 2**20,
                }
                for i in range(torch.cuda.device_count())
            ]
    except ImportError:
        pass
    return _nvidia_smi_gpus()


def _nvidia_smi_gpus() -> list[dict]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        index, name, memory = (part.strip() for part in line.split(","))
        found.append({"index": int(index), "model": name, "memory_mib": int(float(memory))})
    return found


def memory_bytes() -> int:
    """Physical memory of this host in bytes (page size x physical pages, i.e. ``MemTotal`` of
    ``/proc/meminfo`` on Linux)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_facts(name: str, address: str) -> dict:
    """The ``host`` object of the control plane's agent register call: name, address, agent version,
    ``cpu_count`` (logical CPUs, ``os.cpu_count()``), ``memory_bytes`` and ``gpus``."""
    return {
        "name": name,
        "address": address,
        "agent_version": AGENT_VERSION,
        "cpu_count": os.cpu_count() or 1,
        "memory_bytes": memory_bytes(),
        "gpus": gpus(),
    }
