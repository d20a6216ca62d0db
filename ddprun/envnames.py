"""Environment variables through which the launcher talks to the processes it starts.

Both sides import this module: the launcher's rooms never import from `ddprun.worker`, and
the worker side never imports the launcher's.
"""

# The launcher's pid: a worker that finds another parent was orphaned before it could arm
# its parent-death signal.
LAUNCHER_PID_ENV = "DDPRUN_LAUNCHER_PID"
# Where each rank writes its pid, so the launcher can tell which rank a dead pid was.
PID_FILE_ENV = "DDPRUN_PID_FILE"
# Where rank 0 of the bundled trainer appends progress records for the launcher's bar.
PROGRESS_FILE_ENV = "DDPRUN_PROGRESS_FILE"
# torch elastic's own variable: where a failing rank records its exception.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# A token unique to one launcher's job, in every process it starts: after a kill -9 of the
# launcher, its watchdog finds what the job left running by this variable (ddprun.reaper).
JOB_MARKER_ENV = "DDPRUN_JOB"
# Where each rank's stack dumps go (its file in the attempt folder, 0600), and the real-time
# signal (SIGRTMIN + this offset) that asks a rank for one (ddprun.stacks, worker/stackdump.py).
STACKS_FILE_ENV = "DDPRUN_STACKS_FILE"
STACKS_SIGNAL_OFFSET = 7
# ddprun.launch(fn): the file, in the job's private folder, holding fn and its arguments (worker/call.py).
CALL_FILE_ENV = "DDPRUN_CALL_FILE"
# Warm start (ddprun/warmstart.py): the node's fork server's socket, for each rank's small client.
WARM_SOCKET_ENV = "DDPRUN_WARM_SOCKET"
# Beside a rank's pid file under warm start: the pid of its client, the process torch started.
CLIENT_PID_SUFFIX = ".client"
