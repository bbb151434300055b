"""`python -m kvyard.stack.supervise --run-dir DIR`: keeps `kvyard up`'s processes running.

Without it a crashed EPP is a total outage (Envoy fails closed) until someone
runs `up` again. It polls every process in the state file and starts a dead one
again with the same command, ports, log and environment (`Proc.env_files`: secrets
are re-read from their 0600 files, never kept in the state file), after a
per-process backoff that doubles from 0.5 s to 30 s and resets once a process
has stayed up for a minute, so a crash loop costs little. Each death (with its
exit status) and restart goes to stderr, which `up` points at
`logs/supervisor.log`; the new pid and the restart count go into the state file,
rewritten atomically.

`kvyard up` makes this process the parent of everything it starts (it forks,
starts the stack, then execs this module), so exit statuses are real; a process
it did not start itself is watched by pid and command line, its status unknown.
It exits when `kvyard down` signals it (down stops it first, so nothing is
restarted behind down's back) or when the state file no longer names it.

With scale to zero it is also the Deployment controller: when `autoscale.json`
(written by `kvyard.stack.autoscale`, the local KEDA) asks for another number of
workers, `kvyard.stack.resize` starts or stops them. The autoscaler sends SIGUSR1
when it changes its mind, which ends the poll's wait at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.stack import procs, resize
from kvyard.stack.state import StackState
from kvyard.stack.procs import Proc

POLL_S = 0.2
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # up this long: the next crash is restarted after the base delay again
LOG_NAME = "supervisor.log"
log = logging.getLogger("kvyard.supervisor")


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "kvyard.stack.supervise", "--run-dir", str(run_dir)]


@dataclass(slots=True)
class Backoff:
    """One process's restart schedule."""

    started: float  # time.monotonic() when the running incarnation started
    delay_s: float = BACKOFF_BASE_S
    due: float | None = None  # when to start it again; None while it runs

    def crashed(self, now: float) -> float:
        if now - self.started >= STABLE_S:
            self.delay_s = BACKOFF_BASE_S
        wait = self.delay_s
        self.due = now + wait
        self.delay_s = min(BACKOFF_MAX_S, self.delay_s * 2)
        return wait


def describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass(slots=True)
class Draining:
    """A worker scaled away: out of the endpoints file, waiting for the EPP to drop it
    (until `deadline`), then signalled and draining (until the next `deadline`)."""

    proc: Proc
    deadline: float
    address: str
    epp_metrics_url: str
    signalled: bool = False


def _epp_lists(d: Draining) -> bool:
    """The EPP still has the endpoint (or cannot say): not safe to stop it yet."""
    import json

    try:
        code, body = procs.http_get(d.epp_metrics_url + "/debug/endpoints", 0.5)
        doc = json.loads(body) if code == 200 else None
    except (OSError, ValueError):
        return True
    rows = doc.get("endpoints", []) if isinstance(doc, dict) else doc or []
    return any(isinstance(r, dict) and r.get("address") == d.address for r in rows)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # procs.spawn gives each child its own session: pid = group
    except (ProcessLookupError, PermissionError):
        pass


def exit_status(proc: Proc) -> str | None:
    """None while `proc` runs; how it ended otherwise."""
    try:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:  # not our child (or already reaped): pid and command line
        return None if procs.is_ours(proc) else "exit status unknown (not started by this supervisor)"
    return None if pid == 0 else describe(status)


@dataclass(slots=True)
class Supervisor:
    run_dir: Path
    schedules: dict[str, Backoff] = field(default_factory=dict)
    stopping: bool = False
    draining: dict[int, "Draining"] = field(default_factory=dict)  # by pid

    def tick(self, state: StackState, now: float) -> bool:
        """Notice deaths, restart what is due; True when `state` changed."""
        changed = False
        for i, p in enumerate(state.procs):
            sched = self.schedules.setdefault(p.name, Backoff(started=now))
            if sched.due is None:
                status = exit_status(p)
                if status is None:
                    continue
                wait = sched.crashed(now)
                p.last_exit = status
                changed = True
                log.warning("%s (pid %d) died: %s; restarting it in %.1fs", p.name, p.pid,
                            status, wait)
            if now < sched.due:
                continue
            try:
                new = procs.spawn(p.name, p.cmd, Path(p.log), ports=p.ports,
                                  env_files=p.env_files)
            except OSError as e:  # e.g. a binary or a secret file gone: try again later
                wait = sched.crashed(now)
                log.error("could not restart %s: %s; trying again in %.1fs", p.name, e, wait)
                continue
            new.restarts, new.last_exit = p.restarts + 1, p.last_exit
            state.procs[i] = new
            sched.due, sched.started = None, now
            changed = True
            log.info("restarted %s: pid %d (restart %d, same command and ports %s)", p.name,
                     new.pid, new.restarts, p.ports)
        return changed

    def scale(self, state: StackState) -> bool:
        """Apply the autoscaler's wish for the scaled pool; True when `state` changed
        (resize saves it itself, before stopping anything)."""
        if not state.scaling:
            return False
        from kvyard.stack import autoscale

        want = autoscale.desired(self.run_dir).get(state.scaling.get("role", "both"))
        if want is None:
            return resize.ensure_spare(state)
        try:
            gone = resize.resize(state, want)
        except OSError as e:  # a worker that cannot start: the next tick tries again
            log.error("could not scale to %d workers: %s", want, e)
            return False
        if gone is None:
            return resize.ensure_spare(state)
        for p in gone:  # stopped by `reap_drained` once the EPP has let go of them
            self.draining[p.pid] = Draining(p, time.monotonic() + resize.LEAVE_S,
                                            resize.address(p), state.epp_metrics_url)
        for name in list(self.schedules):  # forget the schedules of stopped workers
            if not any(p.name == name for p in state.procs):
                del self.schedules[name]
        resize.ensure_spare(state)  # the next wake-up's interpreter, while this one starts
        return True

    def reap_drained(self, now: float) -> None:
        """Workers scaled away: SIGTERM once the EPP no longer lists them (a request routed
        in the meantime is still served), SIGKILL past their drain, forgotten once gone."""
        for pid, d in list(self.draining.items()):
            if not procs.alive(pid):
                del self.draining[pid]
                log.info("scaled down: %s (pid %d) exited", d.proc.name, pid)
            elif not d.signalled and (now > d.deadline or not _epp_lists(d)):
                _signal_group(pid, signal.SIGTERM)
                d.signalled, d.deadline = True, now + resize.DRAIN_S
            elif d.signalled and now > d.deadline and procs.is_ours(d.proc):
                log.warning("%s (pid %d) outlived its drain; SIGKILL", d.proc.name, pid)
                _signal_group(pid, signal.SIGKILL)

    def ours(self, state: StackState | None) -> bool:
        return state is not None and state.supervisor is not None \
            and state.supervisor.pid == os.getpid()

    def run(self, ready_fd: int | None = None) -> int:
        """Supervise until signalled; `ready_fd` gets "ok" (then closed) once the signal
        handlers are in and the state names this process (`kvyard up` waits for it)."""
        def stop(signum, _frame) -> None:  # finish the tick (a restart is recorded), then exit
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        # SIGUSR1 (the autoscaler): its byte on this pipe ends the wait below.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        state = StackState.load(self.run_dir)
        if not self.ours(state):
            log.error("the state file in %s does not name this supervisor (pid %d); exiting",
                      self.run_dir, os.getpid())
            return 1
        log.info("supervising %s (pid %d)", ", ".join(p.name for p in state.procs), os.getpid())
        if ready_fd is not None:
            os.write(ready_fd, b"ok")
            os.close(ready_fd)
        while not self.stopping:
            state = StackState.load(self.run_dir)
            if not self.ours(state):
                log.info("the stack in %s is gone or supervised by another; exiting",
                         self.run_dir)
                return 0
            if self.tick(state, time.monotonic()):
                state.save()
            self.scale(state)
            self.reap_drained(time.monotonic())
            if select.select([wake_r], [], [], POLL_S)[0]:  # a poll period, or a wake-up
                os.read(wake_r, 512)
        if self.draining:  # `down` no longer sees these in the state file: finish them
            procs.stop([pid for pid, d in self.draining.items() if procs.is_ours(d.proc)])
        log.info("stopping (signalled); the stack's processes are left to `kvyard down`")
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--ready-fd", type=int, default=None, help="write 'ok' here once running")
    a = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    return Supervisor(Path(a.run_dir).resolve()).run(a.ready_fd)


if __name__ == "__main__":
    raise SystemExit(main())
