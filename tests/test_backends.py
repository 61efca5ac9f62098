"""One backend per mesh, chosen by the controller from the GPU counts its agents report, and the
environment a rank starts with. The GPU paths themselves run in tests/test_gpu.py (``./dev gpu``)."""

from __future__ import annotations

import os

import pytest

import meshbook
from meshbook.mesh.protocol.backends import NCCL, Backend, HostGpus, choose


def hosts(*counts: tuple[int, int]) -> list[HostGpus]:
    return [HostGpus(f"h{i + 1}", gpus, ranks) for i, (gpus, ranks) in enumerate(counts)]


def test_auto_is_nccl_only_with_a_gpu_per_rank_on_every_host() -> None:
    assert choose("auto", hosts((8, 8), (8, 8))) == Backend(NCCL, "cuda")
    assert choose("auto", hosts((8, 4))) == Backend(NCCL, "cuda")  # spare GPUs are fine
    assert choose("auto", hosts((0, 4), (0, 4))) == Backend("gloo", "cpu")  # no GPU anywhere: no note


def test_auto_with_too_few_gpus_runs_gloo_and_says_why() -> None:
    chosen = choose("auto", hosts((1, 4)))  # the README's -n 4 on a one-GPU workstation
    assert (chosen.torch, chosen.device_type) == ("gloo", "cpu")
    assert "host h1 has 1 GPU(s) for 4 rank(s)" in chosen.note and "NCCL needs one GPU per rank" in chosen.note
    assert "\n" not in chosen.note
    chosen = choose("auto", hosts((8, 8), (2, 8)))
    assert chosen.torch == "gloo" and "host h2 has 2 GPU(s) for 8 rank(s)" in chosen.note
    assert "h1" not in chosen.note


def test_a_host_without_gpus_beside_nccl_hosts_is_refused() -> None:
    with pytest.raises(meshbook.MeshError) as info:
        choose("auto", hosts((8, 8), (0, 8)))
    text = str(info.value)
    assert "host h2 has 0 GPU(s) for 8 rank(s)" in text and "CUDA_VISIBLE_DEVICES" in text
    assert "--backend gloo" in text


def test_explicit_nccl_without_a_gpu_per_rank_is_a_clear_error() -> None:
    assert choose("nccl", hosts((4, 4))) == Backend(NCCL, "cuda")
    with pytest.raises(meshbook.MeshError) as info:
        choose("nccl", hosts((4, 4), (3, 4)))
    text = str(info.value)
    assert "host h2 has 3 GPU(s) for 4 rank(s)" in text
    assert "--backend gloo" in text and "at most 3 rank(s)" in text


def test_explicit_backends_pass_through() -> None:
    assert choose("gloo", hosts((8, 8))) == Backend("gloo", "cpu")  # asked: gloo even on GPUs
    assert choose("cpu:gloo", hosts((0, 2))) == Backend("cpu:gloo", "cpu")
    assert choose("cuda:nccl,cpu:gloo", hosts((2, 2))) == Backend(NCCL, "cuda")
    with pytest.raises(meshbook.MeshError, match="use 'auto', 'gloo', 'nccl'"):
        choose("nvlink", hosts((2, 2)))


def test_nccl_on_this_cpu_machine_refuses_to_start_and_leaves_nothing() -> None:
    # The agent counts this host's GPUs in a subprocess and reports them; here there are none.
    with pytest.raises(meshbook.MeshError) as info:
        meshbook.start(2, backend="nccl")
    assert str(info.value).startswith("--backend nccl needs a GPU per rank, and this host has none. Start with "
                                      "--backend gloo"), str(info.value)
    with meshbook.start(2) as mesh:  # auto: gloo, and no note (there is no GPU to explain)
        assert mesh.controller.chosen == Backend("gloo", "cpu") and mesh.controller.notes == []


def test_ranks_start_with_the_environment_as_it_is_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set after the agent was prewarmed (as after %load_ext): the ranks still see it, as a
    subprocess started now would; a site's NCCL_SOCKET_IFNAME is kept, not overwritten."""
    meshbook.prewarm()
    monkeypatch.setenv("MESHBOOK_TEST_SETTING", "from the notebook")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=ib0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # read by the agent at its start: a new agent
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with meshbook.start(2) as mesh:
        seen = mesh.run("import os\n[os.environ.get(k) for k in ('MESHBOOK_TEST_SETTING', "
                        "'NCCL_SOCKET_IFNAME', 'CUDA_VISIBLE_DEVICES', 'OMP_NUM_THREADS')]").result()
        assert seen.unique() == ["from the notebook", "=ib0", "", "1"]
        assert mesh.run("torch.get_num_threads()").result().unique() == 1
        assert "as torchrun sets it" in mesh.status()[0].threads
    monkeypatch.delenv("MESHBOOK_TEST_SETTING")
    with meshbook.start(2) as mesh:
        assert mesh.run("import os\nos.environ.get('MESHBOOK_TEST_SETTING')").result().unique() is None


def test_a_users_omp_num_threads_wins_and_one_rank_keeps_torchs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with meshbook.start(2) as mesh:
        assert mesh.run("torch.get_num_threads()").result().unique() == 2
        assert mesh.status()[0].threads == "OMP_NUM_THREADS=2 per rank (yours)"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with meshbook.start(1) as mesh:  # torchrun sets it only for several processes per node
        assert mesh.run("import os\nos.environ.get('OMP_NUM_THREADS')").result()[0] is None
        assert mesh.status()[0].threads == ""


def test_env_names_variables_and_bad_ones_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshbook.mesh.controller.api.mesh import parse_env

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert parse_env(["NCCL_DEBUG", "FOO=bar=baz"]) == {"NCCL_DEBUG": "INFO", "FOO": "bar=baz"}
    assert parse_env({"NCCL_DEBUG": None, "X": "1"}) == {"NCCL_DEBUG": "INFO", "X": "1"}
    with pytest.raises(meshbook.MeshError, match="NOT_SET_HERE is not set in this notebook"):
        meshbook.start(2, env=["NOT_SET_HERE"])
    with pytest.raises(meshbook.MeshError, match="is not a variable name"):
        parse_env(["=oops"])
    assert os.environ.get("NOT_SET_HERE") is None


def test_a_kept_meshs_backend_string_gives_its_device() -> None:
    assert [Backend.of(s).device_type for s in ("gloo", "nccl", "cuda:nccl,cpu:gloo", "cuda:gloo")] == [
        "cpu", "cuda", "cuda", "cuda"]  # an explicit cuda:gloo mesh came back as cpu after attach
