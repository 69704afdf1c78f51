"""GPU plans, made on this CPU machine with a stated GPU inventory: each worker its GPU
(or a share of one), bf16 and SGLang's own attention backend for float32 checkpoints
(the user's flags win), Mooncake's transport from the hardware, and no silent fall
back to the CPU layer on a GPU box whose GPUs torch cannot use."""

from __future__ import annotations

import pytest
from support.cluster import free_port, free_port_block

from bana_sglang import compat
from bana_sglang.launch import LaunchConfig, gpus, plan_cluster
from bana_sglang.launch import spec as cluster_spec
from bana_sglang.launch.plan import plan_spec


@pytest.fixture
def gpu_box(monkeypatch):
    """This process plans as on a CUDA machine with the inventory the test sets."""
    monkeypatch.setenv("BANA_DEVICE", "cuda")
    for var in ("MOONCAKE_PROTOCOL", "BANA_STORE_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    box = {"inventory": gpus.GpuInventory(1)}
    monkeypatch.setattr(gpus, "detect", lambda timeout_s=10.0: box["inventory"])
    return box


def flag(argv, name):
    argv = list(argv)
    return argv[argv.index(name) + 1] if name in argv else None


def cfg(**kw) -> LaunchConfig:
    return LaunchConfig(port=free_port(), worker_base_port=free_port_block(40), **kw)


def test_one_gpu_1p1d_shares_it_in_bf16_over_tcp(gpu_box):
    plan = plan_cluster(cfg())
    assert [flag(w.argv, "--base-gpu-id") for w in plan.workers] == ["0", "0"]
    assert [flag(w.argv, "--mem-fraction-static") for w in plan.workers] == ["0.425", "0.425"]
    for w in plan.workers:
        assert flag(w.argv, "--dtype") == "bfloat16"  # the tiny checkpoint is float32
        assert "--attention-backend" not in w.argv  # SGLang's default GPU backend
        assert "--device" not in w.argv and "--sleep-on-idle" not in w.argv  # no CPU layer
    assert plan.env["MOONCAKE_PROTOCOL"] == "tcp" and plan.env["BANA_STORE_PROTOCOL"] == "tcp"
    assert "SGLANG_USE_CPU_ENGINE" not in plan.env
    assert flag(plan.router.argv, "--kv-dtype") == "bfloat16"  # the store's keys match


def test_eight_gpus_4p4d_one_gpu_each_over_rdma(gpu_box):
    gpu_box["inventory"] = gpus.GpuInventory(8, rdma=True)
    plan = plan_cluster(cfg(num_prefill=4, num_decode=4))
    assert sorted(int(flag(w.argv, "--base-gpu-id")) for w in plan.workers) == list(range(8))
    assert all(flag(w.argv, "--mem-fraction-static") is None for w in plan.workers)
    assert plan.env["MOONCAKE_PROTOCOL"] == "rdma"


def test_more_workers_than_gpus_split_the_memory_of_the_ones_they_share(gpu_box):
    plan = plan_cluster(cfg(num_prefill=3, num_decode=2, gpus=2))  # --gpus overrides nvidia-smi
    placed = [
        (flag(w.argv, "--base-gpu-id"), flag(w.argv, "--mem-fraction-static")) for w in plan.workers
    ]
    assert placed == [
        ("0", "0.283"),
        ("1", "0.425"),
        ("0", "0.283"),
        ("1", "0.425"),
        ("0", "0.283"),
    ]
    assert gpus.place(2, 4) == [(0, None), (1, None)]


def test_the_users_flags_win(gpu_box, monkeypatch):
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    plan = plan_cluster(
        cfg(
            sglang_args=("--dtype", "float32", "--attention-backend", "triton"),
            prefill_args=("--base-gpu-id", "3", "--mem-fraction-static", "0.5"),
        )
    )
    pre, dec = plan.workers
    assert (
        flag(pre.argv, "--dtype") == "float32" and flag(pre.argv, "--attention-backend") == "triton"
    )
    assert pre.argv.count("--base-gpu-id") == 1 and flag(pre.argv, "--base-gpu-id") == "3"
    assert flag(pre.argv, "--mem-fraction-static") == "0.5"
    assert flag(dec.argv, "--base-gpu-id") == "0"
    assert plan.env["MOONCAKE_PROTOCOL"] == "rdma"  # an operator's transport stays
    assert flag(plan.router.argv, "--kv-dtype") == "float32"


def test_a_cuda_box_without_a_visible_gpu_is_refused(gpu_box):
    gpu_box["inventory"] = gpus.GpuInventory(0)
    with pytest.raises(ValueError, match="no GPU is visible"):
        plan_cluster(cfg())


def test_a_spec_with_cuda_devices_gives_each_worker_its_gpu_and_no_cpu_flags():
    spec = cluster_spec.load("docs/specs/multi-gpu.yaml")
    plan = plan_spec(spec, None, dry_run=True)
    gpu_workers = [w for w in plan.workers if flag(w.argv, "--device") == "cuda"]
    assert len(gpu_workers) == 8
    assert sorted({flag(w.argv, "--base-gpu-id") for w in gpu_workers}) == ["0", "2", "4", "6"]
    for w in gpu_workers:
        assert "--sleep-on-idle" not in w.argv and "bana_cpu" not in w.argv


def test_a_gpu_box_torch_cannot_use_is_not_run_on_the_cpu_layer_silently(monkeypatch):
    monkeypatch.delenv("BANA_DEVICE", raising=False)
    monkeypatch.setattr(compat, "cuda_available", lambda: False)
    monkeypatch.setattr(compat, "visible_gpus", lambda: (2, "535.104.05"))
    with pytest.raises(compat.GpuUnusable, match="driver 535.104.05.*BANA_DEVICE=cpu"):
        compat.cpu_mode()
    monkeypatch.setenv("BANA_DEVICE", "cpu")  # on purpose
    assert compat.cpu_mode() is True
    monkeypatch.delenv("BANA_DEVICE")
    monkeypatch.setattr(compat, "visible_gpus", lambda: (0, None))
    assert compat.cpu_mode() is True  # no GPU at all: the CPU layer
