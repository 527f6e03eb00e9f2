"""Launching multi-process tests under torchrun: gloo over the loopback only, a free port,
bounded in time, and the whole process group killed if it overruns."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux's /proc; none found elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """Kill `pid`'s process group and every descendant: torchrun starts its workers in sessions
    of their own, which the group's kill does not reach, and a surviving worker holds the output
    pipe open, so waiting for the output would never end."""
    descendants = _descendants(pid)
    for target in [pid, *descendants]:
        try:
            os.killpg(target, signal.SIGKILL) if target == pid else os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torchrun(n_procs: int, *target: str, timeout_s: int, extra_env: dict | None = None) -> str:
    """Run `target` (a script and its arguments, or `-m module ...`) on n_procs ranks; fail
    the test with the output's tail if it fails or overruns. Returns the output."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "TORCHELASTIC_ERROR_FILE": "", **(extra_env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n_procs}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *map(str, target)]
    what = f"torchrun {' '.join(map(str, target))} on {n_procs} processes"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s} s:\n{output[-4000:]}")
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    lines = [line for line in output.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert proc.returncode == 0, f"{what} failed:\n" + "\n".join(lines[-60:])
    return output
