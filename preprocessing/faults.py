"""How an I/O fault during a run reaches the user: one line naming the stage, the path and, for a full disk, the
bytes; never a runner's traceback.

A fault the user fixes rather than the code (a full disk, a file that vanished, a permission refused:
:func:`common.atomic.explain_fault`) is raised where it happens, inside :func:`stage`, as an
:class:`~common.atomic.IOFault` whose message starts with the stage's name. Beam then wraps it: a worker process's
error reaches the driver only as text (``RuntimeError: Traceback ... common.atomic.OutOfSpace: [Errno 28] spill:
... [while running 'ReadAndClean']``, some 180 lines), an in-process one as a RuntimeError chained to it.
:func:`fault_of` finds the fault in either, and ``pipeline.run`` prints it alone, after removing what the run
wrote.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from apache_beam.io.filesystems import FileSystems

from common.atomic import FULL, GONE, REFUSED, IOFault, OutOfSpace, explain_fault

# The stages a fault is named by: the driver's set-up before the pipeline, then the pipeline's steps (ReadAndClean
# reads and spills, TokenizeBucket and the shard plan tokenize, WriteShard writes, Finalize publishes).
STAGES = ("start", "read", "spill", "tokenize", "write", "finalize")
# A fault in the text of a runner's exception: the exception's name, its errno and its staged message, less
# the step annotations Beam appends ("[while running 'ReadAndClean']", once per layer it crossed).
FAULT_TEXT = re.compile(
    rf"\b(?:IOFault|OutOfSpace): \[Errno (\d+)\] ((?:{'|'.join(STAGES)}): .*?)(?: \[while running '[^']*'\])*$",
    re.MULTILINE,
)
# A write that fails on a full disk is at least one block short, even a progress marker's one byte.
BLOCK = 4096


@contextmanager
def stage(name: str, path: str, needed: int | None = None) -> Iterator[None]:
    """Within the block, an I/O fault raises one :class:`IOFault` (:class:`OutOfSpace` for a full disk) whose
    message is ``NAME: ...``: the path (the one the failing call named, else ``path``) and, for a full disk, the
    ``needed`` bytes of the write and those free. The innermost stage names a fault; other errors pass unchanged.
    """
    try:
        yield
    except Exception as err:
        if getattr(err, "stage", None):
            raise
        fault = explain_fault(err, path, FileSystems.split(path)[0], needed)
        if fault is None:
            raise
        staged = type(fault)(fault.errno, f"{name}: {fault.strerror}")
        staged.stage = name  # type: ignore[attr-defined]
        raise staged from err


def fault_of(err: BaseException) -> IOFault | None:
    """The staged fault behind a runner's exception, or None (a bug, whose traceback should show)."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        if isinstance(current, IOFault) and getattr(current, "stage", None):
            return current
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exc in chain:  # a worker process's exception: text only
        found = FAULT_TEXT.findall(str(exc))
        if found:
            number, message = found[-1]
            fault = (OutOfSpace if int(number) in FULL else IOFault)(int(number), message)
            fault.stage = message.split(":", 1)[0]  # type: ignore[attr-defined]
            return fault
    return None


def what_to_do(fault: IOFault, output: str, needed: int | None, free: int | None) -> str:
    """The sentence after a fault's line: its likely cause and the fix; for a full disk under ``output``, the whole
    run's room (``needed``: preflight's estimate; ``free``: what is free once the run's files are removed)."""
    text = str(fault.strerror)
    if fault.errno in FULL and f"into {output}/" not in text and f"into {output}:" not in text:  # a local temp copy
        return "Free room there (TMPDIR names another directory), and run again"
    if fault.errno in FULL:
        room = [f"the whole run needs about {needed:,} bytes there"] if needed is not None else []
        room += [f"{free:,} are free now"] if free is not None else []
        return "Free room there or choose another output=, and run again" + (f": {', '.join(room)}" if room else "")
    if getattr(fault, "stage", None) == "read":
        fix = "An input the run listed at its start is gone: restore it" if fault.errno in GONE else "Make it readable"
        return f"{fix}, and run again"
    if fault.errno in GONE:
        return (
            "The run wrote it and something removed it meanwhile (another run with this output=, or a clean-up "
            "of the disk): run again"
        )
    if fault.errno in REFUSED:
        return (
            "The output stopped accepting writes (a filesystem remounted read-only, permissions changed): make it "
            "writable or choose another output=, and run again"
        )
    return "Run again"
