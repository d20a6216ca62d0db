"""How a rank ends, written to $OUT_DIR/ending<R>.txt: under warm start it must end as a fresh
`python script.py` does (non-daemon threads, then atexit, then the user's objects let go,
buffered files flushed, stdout flushed)."""

import atexit
import logging
import os
import sys
import threading
import time

rank = os.environ["RANK"]
os.makedirs(os.environ["OUT_DIR"], exist_ok=True)
path = os.path.join(os.environ["OUT_DIR"], f"ending{rank}.txt")


def event(what):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{what}\n".encode())
    os.close(fd)


class Goodbye:
    def __del__(self):
        event("a global's __del__")


def late_thread():
    time.sleep(0.5)
    event("a non-daemon thread")


unclosed = open(os.path.join(os.environ["OUT_DIR"], f"unclosed{rank}.txt"), "w")
unclosed.write("buffered, never closed\n")
goodbye = Goodbye()
logging.basicConfig(filename=os.path.join(os.environ["OUT_DIR"], f"log{rank}.txt"), level=logging.INFO)
logging.info("logged")
atexit.register(event, "atexit")
threading.Thread(target=late_thread).start()
sys.stdout.write("no newline at the end")
