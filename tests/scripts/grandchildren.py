"""A worker that leaves two processes behind, picked with MODE (ok, fail, sleep).

One ignores SIGTERM and SIGINT; the other calls setsid, leaving the worker's session. Each
writes its pid to $OUT_DIR/grandchild_<rank>_<kind>; the worker then writes the job's marker
to $OUT_DIR/marker<rank>. torch is not imported: the test is about processes, not collectives.
"""
import os
import subprocess
import sys
import time

STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid())); os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""
SETSID = """
import os, sys, time
os.setsid()
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid())); os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""

mode = os.environ.get("MODE", "ok")
rank = int(os.environ["RANK"])
out = os.environ["OUT_DIR"]
os.makedirs(out, exist_ok=True)
paths = []
for kind, code in (("stubborn", STUBBORN), ("setsid", SETSID)):
    path = f"{out}/grandchild_{rank}_{kind}"
    subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    paths.append(path)
while not all(map(os.path.exists, paths)):
    time.sleep(0.02)
with open(f"{out}/marker{rank}.tmp", "w") as f:
    f.write(os.environ.get("DDPRUN_JOB", ""))
os.replace(f"{out}/marker{rank}.tmp", f"{out}/marker{rank}")

if mode == "sleep" or (mode == "fail" and rank == 0):
    time.sleep(300)
elif mode == "fail":
    while not os.path.exists(f"{out}/marker0"):  # rank 0 has left its own behind too
        time.sleep(0.02)
    sys.exit(1)
