"""Start a command as N ranks of one torch.distributed group, and end them together.

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and this process's stdout and
stderr. The launcher is the group's one face to whoever started it (``streamrft run``'s
supervisor, a shell):

- a rank that exits non-zero (or is killed) fails the group: the launcher kills the
  others at once (a group with a dead member cannot go on; its collectives would hang
  or fail) and exits with that rank's status (128 + the signal for a killed rank), so a
  supervisor restarts the group, which resumes from its checkpoint;
- SIGTERM or SIGINT asks for an orderly stop: it is passed to rank 0 as SIGTERM (rank 0
  finishes and tells the others to stop); a second one kills every rank;
- every rank dies with the launcher, even when it is SIGKILLed (a rank asks for it,
  ``PR_SET_PDEATHSIG``, as it starts: :func:`die_with_launcher`);
- it exits 0 when every rank did.

A trainer on several hosts (``trainer.nnodes``) is one launcher per host, each started with
its ``--node-rank``: its ranks take the global ranks ``node_rank * nproc`` onwards and meet
the others at ``trainer.rdzv`` (node 0's first rank listens there). A rank failing on one
host breaks the group's collectives on the others, so every launcher exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import NoReturn, cast

from streamrft.app.placement import visible_gpus
from streamrft.infra.config import Config
from streamrft.infra.net import free_port, interface_of, local_address_towards, split_host_port
from streamrft.schemas.errors import ConfigError

log = logging.getLogger(__name__)
FOLLOWERS_GRACE_S = 60.0
"""How long the other ranks may take to exit after rank 0 exited 0."""
LAUNCHER_PID = "STREAMRFT_LAUNCHER_PID"
"""Environment variable: the pid of the launcher of this rank."""
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """In a rank, first thing: be SIGKILLed when the launcher dies (Linux), or exit now if
    it is gone already. (Not a ``preexec_fn``: that is unsafe in a launcher with threads.)"""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):
        os._exit(1)


@dataclass(frozen=True)
class Node:
    """This host's place among the trainer's hosts (``trainer.nnodes``)."""

    rank: int = 0
    count: int = 1
    addr: str = "127.0.0.1"
    """Where the group's first rank listens (``MASTER_ADDR``)."""
    port: int = 0
    """Its port (``MASTER_PORT``; 0: a free one, one host only)."""

    @classmethod
    def of(cls, cfg: Config, node_rank: int) -> Node:
        """Node ``node_rank`` of the trainer ``cfg`` describes (checked against it)."""
        t = cfg.trainer
        if not 0 <= node_rank < t.nnodes:
            raise ConfigError(
                f"--node-rank {node_rank}: the trainer spans trainer.nnodes = {t.nnodes} "
                f"host(s), numbered 0 to {t.nnodes - 1}"
            )
        if t.nnodes == 1:
            return cls()
        host, port = split_host_port(t.rdzv) or ("", 0)  # checked by the config
        return cls(node_rank, t.nnodes, host, port)

    @functools.cached_property
    def environment(self) -> dict[str, str]:
        """What the ranks of a host among several are shown besides torchrun's variables:
        gloo's and NCCL's interface, the one holding the address this host reaches the
        rendezvous from (unless the environment names one). Found once per launcher."""
        if self.count == 1:
            return {}
        own = local_address_towards(self.addr)
        ifname = interface_of(own) if own else None
        if ifname is None:
            log.warning(
                "no interface found for this host's address towards %s (%r): gloo and NCCL "
                "choose their own (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
                self.addr,
                own,
            )
            return {}
        log.info(
            "trainer node %d of %d: ranks talk from %s (%s)", self.rank, self.count, own, ifname
        )
        return {
            name: os.environ.get(name, ifname)
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        }


def rank_env(
    local: int, nproc: int, port: int, gpus: list[int] | None = None, node: Node = Node()
) -> dict[str, str]:
    """Torchrun's environment for the ``local``-th rank of ``nproc`` on this host, node
    ``node`` (rank ``node.rank * nproc + local`` of ``nproc * node.count``); ``gpus``: the
    GPU indexes (of those this process sees) the ranks may see, the local rank r's ``cuda:r``
    being ``gpus[r]``."""
    visible = {"CUDA_VISIBLE_DEVICES": visible_gpus(gpus, "trainer.devices")} if gpus else {}
    return {
        **os.environ,
        **visible,
        **node.environment,
        "RANK": str(node.rank * nproc + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nproc * node.count),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node.rank),
        "MASTER_ADDR": node.addr,
        "MASTER_PORT": str(node.port or port),
        LAUNCHER_PID: str(os.getpid()),
    }


def _status(code: int) -> int:
    """A child's return code as an exit status (a signal: 128 + its number)."""
    return code if code >= 0 else 128 - code


class Launcher:
    """``nproc`` ranks of ``argv`` on this machine (see the module docstring)."""

    def __init__(
        self,
        argv: list[str],
        nproc: int,
        cwd: str | None = None,
        gpus: list[int] | None = None,
        node: Node = Node(),
    ) -> None:
        port = free_port()
        self.procs = [
            subprocess.Popen(
                argv,
                env=rank_env(rank, nproc, port, gpus, node),
                cwd=cwd,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher alone
            )
            for rank in range(nproc)
        ]
        self.stops = 0
        log.info("trainer ranks started: pids %s", [p.pid for p in self.procs])

    def on_signal(self, signum: int, _frame: object = None) -> None:
        self.stops += 1
        if self.stops == 1:
            log.info("%s: asking rank 0 to stop", signal.Signals(signum).name)
            self._signal(self.procs[:1], signal.SIGTERM)
        else:
            self._signal(self.procs, signal.SIGKILL)

    @staticmethod
    def _signal(procs: list[subprocess.Popen], signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def kill_all(self) -> None:
        self._signal(self.procs, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, poll_s: float = 0.1) -> int:
        """Until every rank exited 0 (0) or one failed (its status; the others killed)."""
        deadline = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    log.warning(
                        "trainer rank %d exited with code %s: stopping the others", rank, code
                    )
                    return _status(code)
                if all(c == 0 for c in codes):
                    return 0
                if codes[0] == 0 and deadline is None:
                    deadline = time.monotonic() + FOLLOWERS_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    log.warning(
                        "trainer ranks still running %.0f s after rank 0 finished",
                        FOLLOWERS_GRACE_S,
                    )
                    return 1
                time.sleep(poll_s)
        finally:
            self.kill_all()


def launch(
    argv: list[str],
    nproc: int,
    handle_signals: bool = True,
    cwd: str | None = None,
    gpus: list[int] | None = None,
    node: Node = Node(),
) -> int:
    """Run ``argv`` as ``nproc`` ranks (in ``cwd``; ``gpus``, ``node``: see :func:`rank_env`)
    until they end; the exit status (module docstring). ``handle_signals``: install the
    SIGTERM/SIGINT handling (main thread only)."""
    launcher = Launcher(argv, nproc, cwd, gpus, node)
    if handle_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, launcher.on_signal)
    return launcher.wait()


def launch_trainer(args: argparse.Namespace, cfg: Config, node: Node) -> int:
    """``streamrft train`` with more than one rank (``trainer.nproc`` on this host, times
    ``trainer.nnodes`` hosts): this host's ranks run the same command (config file, or the
    run's record on ``--bootstrap``; overrides, the resolved run id, the rank counts);
    ``node``: this host's place among the trainer's hosts (:meth:`Node.of`)."""
    t = cfg.trainer
    argv = [sys.executable, "-m", "streamrft.app.cli", "train"]
    argv += [args.config] if args.config else ["--bootstrap", args.bootstrap]
    argv += ["--run-id", str(cfg.run.id), "--nproc", str(t.nproc), "--nnodes", str(t.nnodes)]
    if t.rdzv:
        argv += ["--rdzv", t.rdzv]
    for setting in args.override or []:
        argv += ["-o", setting]
    gpus = [int(d.split(":")[1]) for d in t.devices] or None
    return launch(argv, t.nproc, gpus=gpus, node=node)


def run_trainer_rank(cfg: Config) -> NoReturn:
    """One rank of a ``trainer.nproc`` trainer (the launcher's environment is set): rank 0
    the trainer, the others its engine's followers. A rank that fails raises; the launcher
    then stops the others."""
    die_with_launcher()
    import torch

    from streamrft.consumers.distributed import join_group
    from streamrft.consumers.fsdp_engine import FsdpTrainEngine
    from streamrft.consumers.trainer import Trainer
    from streamrft.producers.evaluation import trainer_evaluator

    ranks = join_group(cfg.trainer.world, cfg.model.device)
    torch.set_num_threads(cfg.trainer.threads)
    if ranks.leader:
        trainer = Trainer(cfg, trainer_evaluator(cfg))
        asyncio.run(trainer.run())
        cast(FsdpTrainEngine, trainer.engine).release()
    else:
        FsdpTrainEngine(cfg).follow()
    _leave_past_last_barrier()


def _leave_past_last_barrier() -> NoReturn:
    """Past the last barrier every rank is done (rank 0's trainer has drained): the process
    ends without tearing the group's connections down, as gloo aborts a process (SIGABRT,
    "terminate called without an active exception") that destroys its group while a peer
    closes its end: seen on a follower across two hosts, and on rank 0 at the end of a run
    beside CPU hogs on one host (the supervisor then restarted a finished trainer)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
