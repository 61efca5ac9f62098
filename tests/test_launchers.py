"""The launcher contract: a site's own launcher, registered by its package, works like the built-in ones.

The plug-in here is what a site would write (a Kubernetes launcher has the same shape): a
``meshbook.Launcher`` subclass that starts ``python -m meshbook.mesh.agent listen`` its own way
(here: a plain subprocess on this machine) and dials it. It is registered the way a package
registers one, through an entry point of the group ``meshbook.launchers`` in its installed
metadata, and then ``start(launcher=NAME)``, ``%mesh start``'s options, and the contract's
defaults (no relaunch, no keep) all follow from the registry, with no change to meshbook.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

import pytest

import meshbook
from meshbook.mesh import add_start_arguments, launcher_from_args, launchers
from meshbook.mesh.controller.launch import GROUP, get_launcher

PLUGIN = '''
"""A site's launcher: agents as plain subprocesses of the notebook, listening on loopback."""

import json
import sys
import time

from meshbook import AgentHandle, HostPlan, LaunchContext, Launcher
from meshbook.mesh.controller.launch.ssh import ListeningAgent, plan_hosts


class Subprocesses(Launcher):
    name = "subprocesses"

    def __init__(self, hosts=2):
        super().__init__()
        self.hosts = hosts

    def default_ranks(self):
        return self.hosts

    def plan(self, world_size):
        return plan_hosts(world_size, self.hosts, None, "subprocesses launcher")

    def launch(self, plans, ctx, timeout):
        boot = ctx.network.bootstrap(controller_hint="127.0.0.1").to_dict()
        agents = []
        for plan in plans:
            agent = ListeningAgent(f"proc{plan.host}", [sys.executable, "-m", "meshbook.mesh.agent", "listen"])
            agents.append(agent)
            agent.send(json.dumps(boot) + "\\n")
            info = agent.wait_listening(time.monotonic() + timeout, sys.executable)
            ctx.network.dial(plan.host, agent.name, plan.ranks, info, info["addr"], info["port"])
        return agents

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--subprocesses", type=int, help="agents as subprocesses, this many")

    @classmethod
    def from_args(cls, args):
        return cls(args.subprocesses) if args.subprocesses else None
'''


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the plug-in as a package would: a module and its entry point in the metadata."""
    (tmp_path / "site_launchers.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "site_launchers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: site-launchers\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nsubprocesses = site_launchers:Subprocesses\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("site_launchers", None)


def test_the_built_in_launchers_are_in_the_registry() -> None:
    assert {"local", "ssh", "join", "slurm"} <= set(launchers())
    with pytest.raises(meshbook.MeshError, match="needs its settings"):
        get_launcher("ssh")
    with pytest.raises(meshbook.MeshError, match="unknown launcher 'k8s'.*meshbook.launchers"):
        meshbook.start(2, launcher="k8s")


def test_a_launcher_a_package_registers_runs_a_mesh(registered: None) -> None:
    assert "subprocesses" in launchers()
    mesh = meshbook.start(launcher="subprocesses", timeout=120)  # two hosts of one rank: its default
    try:
        assert dict(mesh.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()").result()) == \
            {0: 3.0, 1: 3.0}
        assert [h.name for h in mesh.hosts()] == ["proc0", "proc1"]
        assert not mesh.controller.agents.same_host, "shared memory only where the launcher says so"
        mesh.push(x=list(range(5)))  # frames over the links
        assert set(mesh.run("sum(x)").result().values()) == {10}
    finally:
        mesh.stop()


def test_the_contracts_defaults_say_what_a_launcher_cannot_do(registered: None) -> None:
    with pytest.raises(meshbook.MeshError, match="subprocesses launcher cannot keep a mesh"):
        meshbook.start(2, launcher="subprocesses", keep="1h")
    mesh = meshbook.start(launcher="subprocesses", timeout=120)
    try:
        mesh.controller.agents[1].proc.kill()  # host 1's agent is gone, and its rank with it
        deadline = time.monotonic() + 30
        while mesh.status()[1].state != "dead":
            assert time.monotonic() < deadline, "the lost agent's rank never showed as dead"
            time.sleep(0.1)
        with pytest.raises(meshbook.MeshError, match="subprocesses launcher cannot start a host's agent again"):
            mesh.restart([1])
        with pytest.raises(meshbook.MeshError, match="subprocesses launcher cannot move a host"):
            mesh.restart([1], on="elsewhere")
        assert mesh.run("rank", ranks=[0]).result()[0] == 0, "the other host's rank lives on"
    finally:
        mesh.stop()


def test_mesh_start_gets_its_options_from_the_launchers(registered: None) -> None:
    parser = argparse.ArgumentParser()
    add_start_arguments(parser)
    chosen = launcher_from_args(parser.parse_args(["--subprocesses", "3"]))
    assert type(chosen).name == "subprocesses" and chosen.default_ranks() == 3
    assert type(launcher_from_args(parser.parse_args([]))).name == "local"
    with pytest.raises(meshbook.MeshError, match="pick one"):
        launcher_from_args(parser.parse_args(["--subprocesses", "2", "--hosts", "a,b"]))
    with pytest.raises(meshbook.MeshError, match="--per-host goes with a launcher for other hosts"):
        launcher_from_args(parser.parse_args(["--per-host", "2"]))


@pytest.mark.parametrize("flags, main", [
    (["--tunnel"], "--hosts"), (["--join-address", "10.0.0.1"], "--join"),
    (["--sbatch=--qos=high"], "--slurm"), (["--on-time-limit", "save()"], "--slurm")])
def test_an_option_without_its_launcher_says_which_it_goes_with(flags: list[str], main: str) -> None:
    parser = argparse.ArgumentParser()
    add_start_arguments(parser)
    with pytest.raises(meshbook.MeshError, match=f"--{flags[0].lstrip('-').split('=')[0]} goes with {main}"):
        launcher_from_args(parser.parse_args(flags))
