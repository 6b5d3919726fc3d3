"""A serving process's start, frozen out of the cyclic collector's passes (procgc.settle)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import gc, weakref
from orchestrator.gateway import server   # (a gateway's modules: thousands of long-lived objects)
from orchestrator.procgc import settle

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a   # garbage in a cycle, made before the start ended
gone = weakref.ref(a)
del a, b
before = len(gc.get_objects())
settle()
print(before, len(gc.get_objects()), gc.get_freeze_count(), gone() is None)
"""


def test_settle_collects_then_freezes_what_the_start_built():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    before, after, frozen, collected = out.split()
    assert collected == "True"   # the start's garbage was collected, not frozen for ever
    assert int(before) > 20000 and int(frozen) > 20000   # what a full collection walked each time ...
    assert int(after) < 1000   # ... is out of its way: it walks what was made since
