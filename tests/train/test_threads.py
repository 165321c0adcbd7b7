"""Torch threads per CPU rank (k3train/runtime/process_groups.py: choose_num_threads): OMP_NUM_THREADS and train.num_threads are
respected; otherwise the cores this process may use are shared among the ranks on the same HOST, counted by
hostname over the process group -- also when two torchrun agents (a 2-"node" rehearsal) share one machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dist_helpers import run_distributed
from k3train.runtime.local_workers import free_port
from k3train.runtime.process_groups import child_pythonpath, choose_num_threads, cores_available

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PROBE = str(Path(__file__).with_name("thread_probe.py"))


def shared(n_ranks: int) -> int:
    return max(1, cores_available() // n_ranks)


def test_omp_num_threads_and_config_are_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("K3TRAIN_THREADS_AUTO", raising=False)
    assert choose_num_threads(0, 1) == (3, "OMP_NUM_THREADS=3")
    assert choose_num_threads(5, 1) == (5, "train.num_threads=5")  # the run's config wins over the environment
    monkeypatch.setenv("K3TRAIN_THREADS_AUTO", "1")  # `k3train train` set OMP_NUM_THREADS=1 only to mute torchrun
    assert choose_num_threads(0, 1)[0] == cores_available()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("K3TRAIN_THREADS_AUTO")
    n, why = choose_num_threads(0, 1)
    assert n == cores_available() and "1 rank(s) on host" in why


def _two_ranks_one_host(rank: int, world: int) -> None:
    os.environ.pop("OMP_NUM_THREADS", None)
    n, why = choose_num_threads(0, world)  # collective: the hostname all-gather
    assert n == shared(2) and f"{cores_available()} cores available / 2 rank(s) on host" in why, (n, why)


def test_two_ranks_on_one_host_share_the_cores():
    run_distributed(_two_ranks_one_host, 2)


def test_two_agents_on_one_host_share_the_cores(tmp_path):
    """The 2-node command of docs/running.md rehearsed on one machine: two torchrun agents (LOCAL_WORLD_SIZE 1 each) with
    c10d rendezvous on 127.0.0.1. Each rank gets half the cores, not all of them."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_PORT", "K3TRAIN_THREADS_AUTO")}
    env["PYTHONPATH"] = child_pythonpath(ROOT)
    port = free_port()
    cmd = [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
           "--rdzv_id=k3threads", PROBE]
    agents = [subprocess.Popen([*cmd[:3], f"--node_rank={i}", *cmd[3:]], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [a.communicate(timeout=240) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    got = sorted((json.loads(ln) for out, _ in outs for ln in out.splitlines() if ln.startswith("{")),
                 key=lambda r: r["rank"])
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        assert r["local_world_size"] == 1  # what the old rule divided by
        assert r["threads"] == r["torch_threads"] == shared(2), r
        assert "2 rank(s) on host" in r["reason"], r
