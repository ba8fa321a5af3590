"""A trainer across hosts, the parts that need no network: ``HOST:PORT`` parsing, the
address and interface a host talks from, each rank's torchrun environment, the checks of
``trainer.nnodes``."""

from __future__ import annotations

import pytest

from streamrft.app.launch import Node, rank_env
from streamrft.infra.config import load_config
from streamrft.infra.net import interface_of, local_address_towards, split_host_port
from streamrft.schemas.errors import ConfigError
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("10.0.0.2:29500", ("10.0.0.2", 29500)),
        ("node-a.cluster:1", ("node-a.cluster", 1)),
        ("[::1]:29500", ("::1", 29500)),
        ("[fe80::1]:65535", ("fe80::1", 65535)),
        ("fe80::1", None),  # an IPv6 address needs its brackets
        ("::1", None),
        ("10.0.0.2", None),
        ("10.0.0.2:", None),
        (":29500", None),
        ("10.0.0.2:0", None),
        ("10.0.0.2:65536", None),
        ("h:\\u0663\\u0663", None),  # digits of another script
        (" h:1", None),
        ("[not-v6]:1", None),
    ],
)
def test_host_and_port(text, parts):
    assert split_host_port(text.encode().decode("unicode_escape")) == parts


def test_the_address_and_interface_a_host_talks_from():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.250") is None  # no interface holds it
    assert local_address_towards("no-such-host.invalid") == ""


def _cfg(*overrides):
    return load_config(EXAMPLE, list(overrides))


def test_each_rank_of_each_host_gets_its_global_rank_and_the_rendezvous():
    cfg = _cfg("trainer.nproc=2", "trainer.nnodes=3", "trainer.rdzv=127.0.0.1:29511")
    assert cfg.trainer.world == 6
    node = Node.of(cfg, 2)
    assert (node.rank, node.count, node.addr, node.port) == (2, 3, "127.0.0.1", 29511)
    env = rank_env(1, 2, 55555, None, node)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("5", "1", "6")
    assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("2", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29511")
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # the interface towards the rendezvous
    with pytest.raises(ConfigError, match=r"--node-rank 3: .* numbered 0 to 2"):
        Node.of(cfg, 3)
    one = rank_env(1, 2, 55555)  # one host: a free port on the loopback, no interface set
    assert (one["RANK"], one["WORLD_SIZE"], one["MASTER_PORT"]) == ("1", "2", "55555")


def test_an_interface_named_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    cfg = _cfg("trainer.nnodes=2", "trainer.rdzv=127.0.0.1:29511")
    env = rank_env(0, 1, 1, None, Node.of(cfg, 1))
    assert env["GLOO_SOCKET_IFNAME"] == "eth9" and env["NCCL_SOCKET_IFNAME"] == "lo"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.nnodes=2"], r"trainer.rdzv: ''; with trainer.nnodes 2 give HOST:PORT"),
        (["trainer.nnodes=2", "trainer.rdzv=fe80::1"], r"trainer.rdzv: 'fe80::1'"),
        (
            ["trainer.nnodes=2", "trainer.rdzv=h:1", "trainer.device=cuda:1"],
            r"trainer.device: 'cuda:1' names one device; with 2 trainer ranks",
        ),
        (
            ["trainer.nnodes=2", "trainer.rdzv=h:1", "algorithm.type=ppo"],
            r"critic, which the sharded engine does not support yet.*nnodes 2",
        ),
    ],
)
def test_a_trainer_across_hosts_is_checked(overrides, message):
    from streamrft.consumers.algorithms.presets import resolve_algorithm

    with pytest.raises(ConfigError, match=message):
        resolve_algorithm(_cfg(*overrides))
