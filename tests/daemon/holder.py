"""A client process for the daemon tests: acquires a model, maps it and obeys stdin.

``python -m tests.daemon.holder SOCKET NAME`` prints one JSON line after mapping, then for each
stdin line answers one JSON line: ``read`` (the float32 values of tensor ``w``), ``write V``
(fill ``w`` with V in the private mapping, then read), ``maps`` (the inode and shared resident kB
of the model's mapping, a trims memfd or a disk-tier blob, from /proc/self/smaps), ``exit``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.daemon.rawclient import RawClient


def _model_mappings() -> dict[str, object]:
    """Inodes of the trims memfds and disk-tier blobs this process maps, and their shared
    resident kB (smaps)."""
    inodes: set[str] = set()
    shared_kb = 0
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                current = "memfd:trims" in line or "/disk/blobs/" in line
                if current:
                    inodes.add(fields[4])
            elif current and fields[0] in ("Shared_Clean:", "Shared_Dirty:"):
                shared_kb += int(fields[1])
    return {"inodes": sorted(inodes), "shared_kb": shared_kb}


def main() -> int:
    socket_path, name = sys.argv[1], sys.argv[2]
    client = RawClient(socket_path)
    result, mapping = client.acquire_map(name)
    entry = next(t for t in result["manifest"]["tensors"] if t["name"] == "w")
    w = np.frombuffer(mapping, np.float32, entry["nbytes"] // 4, entry["offset"])

    def say(**fields: object) -> None:
        print(json.dumps(fields), flush=True)

    say(lease=result["lease"], values=w.tolist())
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "exit":
            break
        if command[0] == "write":
            w[:] = float(command[1])
        if command[0] == "maps":
            say(**_model_mappings())
            continue
        say(values=w.tolist())
    del w
    mapping.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
