"""A controller and an agent of different installs refuse each other, saying what to install.

Rank operations travel by qualified name and bodies as pickles: without this check, a host with
another meshbook (or torch, or Python) fails somewhere deep. Here an agent really runs from
another install (a copy of meshbook with another version), and a kept mesh's file says it was
started by another install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

import meshbook
from meshbook.mesh.controller.launch.kept import new_mesh_file
from meshbook.mesh.controller.launch.network import Network
from meshbook.mesh.controller.launch.record import MeshRecord
from meshbook.mesh.controller.launch.ssh import ListeningAgent
from meshbook.mesh.protocol import net
from meshbook.mesh.protocol.versions import PROTOCOL_VERSION, mismatch, versions

ROOT = Path(__file__).resolve().parent.parent


def test_versions_name_what_both_sides_run() -> None:
    ours = versions()
    assert ours["protocol"] == str(PROTOCOL_VERSION) and ours["meshbook"] == meshbook.__version__
    assert ours["torch"].startswith("2.") and ours["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert mismatch(ours, dict(ours), "here", "there") == ""
    other = dict(ours, meshbook="0.0.9", torch="2.12.0")
    text = mismatch(ours, other, "this kernel", "the host agent on gpu1")
    assert "this kernel and the host agent on gpu1 run different versions" in text
    assert f"meshbook {ours['meshbook']} here, 0.0.9 there" in text
    assert f"install the same on both (meshbook=={ours['meshbook']}, torch=={ours['torch']})" in text
    assert "(protocol 2 here, 1 (meshbook before versions were sent) there)" in mismatch(ours, None, "a", "b")


def test_a_build_label_is_not_a_version() -> None:
    """A notebook on torch ``2.13.0+cpu`` drives ranks on ``2.13.0+cu130``, and an install whose
    metadata says ``2.13.0`` while ``torch.__version__`` says ``2.13.0+cu130`` matches itself
    whether torch is imported yet or not (a GPU image refused its own agent before)."""
    said = "from meshbook.mesh.protocol.versions import versions; print(versions()['torch'])"
    imported, unimported = (subprocess.run([sys.executable, "-c", first + said], capture_output=True, text=True,
                                           check=True, cwd=ROOT).stdout.strip()
                            for first in ("import torch; ", ""))
    import torch

    assert imported == unimported == torch.__version__.partition("+")[0]


@pytest.fixture
def other_install(tmp_path: Path) -> Path:
    """A copy of meshbook that says it is 0.0.9 (as an older install on another host would)."""
    shutil.copytree(ROOT / "meshbook", tmp_path / "meshbook", ignore=shutil.ignore_patterns("__pycache__"))
    init = tmp_path / "meshbook" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{meshbook.__version__}"', '__version__ = "0.0.9"'))
    return tmp_path


def test_an_agent_of_another_install_refuses_the_controller(other_install: Path) -> None:
    ctx = zmq.Context()
    network = Network(ctx, os.urandom(32))
    # From its own directory: ``python -m`` puts the working directory first on the path.
    agent = ListeningAgent("old-host", ["sh", "-c", f"cd {other_install} && exec {sys.executable} -m "
                                                    f"meshbook.mesh.agent listen"])
    try:
        agent.send(json.dumps(network.bootstrap(controller_hint="127.0.0.1").to_dict()) + "\n")
        with pytest.raises(meshbook.MeshError) as info:
            agent.wait_listening(time.monotonic() + 60, sys.executable)
        text = str(info.value)
        assert "the host agent on" in text and "and the controller that started it run different" in text
        assert f"meshbook 0.0.9 here, {meshbook.__version__} there" in text
        assert f"install the same on both (meshbook=={meshbook.__version__})" in text, "the notebook's, to match"
    finally:
        agent.terminate(2.0)
        network.close()
        ctx.destroy(linger=0)


def test_the_controller_refuses_an_agent_that_says_other_versions() -> None:
    ctx = zmq.Context()
    network = Network(ctx, os.urandom(32))
    try:
        listening = {"addr": "127.0.0.1", "port": 9, "pid": 1, "versions": dict(versions(), meshbook="0.0.9")}
        with pytest.raises(meshbook.MeshError, match=r"this kernel and the host agent on gpu7 run different "
                                                     r"versions \(meshbook .* here, 0.0.9 there\)"):
            network.dial(0, "gpu7", [0], listening, "127.0.0.1", 9)
        with pytest.raises(meshbook.MeshError, match=r"1 \(meshbook before versions were sent\)"):  # too old to say
            network.dial(0, "gpu7", [0], {"addr": "127.0.0.1"}, "127.0.0.1", 9)
        assert network.links == {}
    finally:
        network.close()
        ctx.destroy(linger=0)


def test_a_kept_mesh_of_another_install_is_listed_as_unusable_and_not_attached() -> None:
    mesh_id, path = new_mesh_file()
    record = MeshRecord(mesh_id, "old", "local", [], os.urandom(32).hex(), net.Keys.new().to_json(),
                        net.Keys.new().to_json(), [["world", 2]], "gloo", 60.0, 0, 1, time.time(), 3600.0,
                        versions=dict(versions(), torch="2.4.0"))
    record.save()
    try:
        listed = {r.id: r for r in meshbook.list_meshes()}
        assert "run different versions (torch" in listed[mesh_id].problem
        assert listed[mesh_id].row()["attached"].startswith("unusable: this kernel and kept mesh")
        with pytest.raises(meshbook.MeshError, match=rf"kept mesh {mesh_id}: this kernel and kept mesh {mesh_id} "
                                                     rf"run different versions \(torch .* here, 2.4.0 there\)"):
            meshbook.attach(mesh_id)
    finally:
        os.unlink(path)
