"""What a process of a replica job (``meshtune launch --max-restarts``) reads of its launcher: the launcher's
store (``$MESHTUNE_JOB_STORE``), through which the mesh's processes agree across replica jobs, and how many
times this process was restarted (``$MESHTUNE_RESTART``)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from .._validation import require

__all__ = ["JOB_STORE_ENV", "RESTART_ENV", "job_store"]

JOB_STORE_ENV, RESTART_ENV = "MESHTUNE_JOB_STORE", "MESHTUNE_RESTART"


def job_store(timeout_s: float) -> dist.TCPStore | None:
    """A client of the launcher's store ``$MESHTUNE_JOB_STORE`` (replica jobs), or None without one."""
    address = os.environ.get(JOB_STORE_ENV)
    if not address:
        return None
    host, _, port = address.rpartition(":")
    require(bool(host) and port.isdigit(), JOB_STORE_ENV, address, "be host:port of the launcher's TCPStore")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
