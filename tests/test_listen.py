"""The mesh's servers listen on one address, never on every interface (``hf_meshtune.comm.listen``).

Each test reads the kernel's own table of listening sockets (``ss``, over netlink) with the process
holding each, so what is checked is what the kernel sees, for every process of
a launched mesh: the launcher (lighthouse, job store), rank 0's rendezvous store, each fast
replica's store, torchft's manager and checkpoint servers and gloo's pairs.
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from hf_meshtune.comm.listen import bound_store, listen_address
from hf_meshtune.dp.diloco import AdvertisedHTTPTransport
from tests.distributed import mesh_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WILDCARDS = {"0.0.0.0", "::"}


def listening(pids: set[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes ``pids`` hold, as the kernel
    reports them over netlink (``ss``; /proc/net/tcp misses sockets on some kernels here)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        address = address.strip("[]").split("%")[0]
        address = "::" if address == "*" else address  # ss prints a dual-stack wildcard as *
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in pids:
                found.add((int(pid), address, int(port)))
    return found


def _process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def test_a_bound_store_listens_on_its_address_only():
    store = bound_store("127.0.0.1")
    sockets = {(a, p) for _, a, p in listening({os.getpid()})}
    assert ("127.0.0.1", store.port) in sockets
    assert not any(p == store.port and a in WILDCARDS for a, p in sockets)
    # a plain torch TCPStore server, for contrast, listens on every interface: the reason for bound_store
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert any(p == plain.port and a in WILDCARDS for _, a, p in listening({os.getpid()}))


def test_a_store_on_an_address_this_machine_lacks_names_the_rule():
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1:0 \(.*\): MESHTUNE_HOST .* must be addresses"):
        bound_store("192.0.2.1")  # TEST-NET-1: never an address of this machine


def test_the_checkpoint_server_listens_on_the_named_address(monkeypatch):
    from datetime import timedelta

    monkeypatch.setenv("MESHTUNE_HOST", "127.0.0.1")
    transport = AdvertisedHTTPTransport("127.0.0.1", timeout=timedelta(seconds=5), num_chunks=0)
    try:
        port = transport._server.socket.getsockname()[1]
        assert transport.address() == f"http://127.0.0.1:{port}/checkpoint/"
        assert ("127.0.0.1", port) in {(a, p) for _, a, p in listening({os.getpid()})}
    finally:
        transport.shutdown()


def test_listen_address_resolves_names_and_keeps_addresses():
    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("[::1]") == "::1"
    assert ipaddress.ip_address(listen_address("localhost")).is_loopback


FLAGS = ["--max_steps", "16", "--per_device_train_batch_size", "2", "--dp_sync_every", "4", "--report_to", "none"]
FLAGS += ["--save_strategy", "no"]


def _scan_launch(mesh: str, out_dir: str, *flags: str, launcher: tuple[str, ...] = ()) -> set[tuple[int, str, int]]:
    """Run a launched mesh; every listening socket its processes held, sampled every 0.2 s."""
    command = [*mesh_launch(mesh, *launcher), os.path.join(ROOT, "tests", "scripts", "mesh_sft.py")]
    command += ["--output_dir", out_dir, *FLAGS, *flags]
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    seen: set[tuple[int, str, int]] = set()
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= listening(_process_tree(proc.pid))
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    output = proc.communicate()[0]
    assert proc.returncode == 0, output[-4000:]
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "flags", "launcher", "min_sockets"),
    [
        # one world with the anchor: rendezvous, replica stores, managers, checkpoint servers, gloo, lighthouse
        ("3x2", ("--preset", "paper", "--anchor_every", "2"), (), 12),
        # one job per replica: also the launcher's job store and one rendezvous store per replica
        ("2x2", (), ("--max-restarts", "1"), 10),
    ],
)
def test_no_process_of_a_launched_mesh_listens_on_every_interface(tmp_path, mesh, flags, launcher, min_sockets):
    seen = _scan_launch(mesh, str(tmp_path / "run"), *flags, launcher=launcher)
    assert len(seen) >= min_sockets, seen  # the mesh's servers were seen at all
    assert not [s for s in seen if s[1] in WILDCARDS], sorted(seen)
    assert {address for _, address, _ in seen} == {listen_address()} | {"127.0.0.1"}, sorted(seen)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
