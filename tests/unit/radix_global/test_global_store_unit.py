"""Fast unit tests of the global store's wiring (no processes): the linker's
configuration, the model identity in page keys, the worker flags the launcher
adds, the counters table, and the decode worker's hook on arriving KV."""

from __future__ import annotations

import json
import os
import shutil
import threading
from types import SimpleNamespace

import pytest

from bana_sglang import launch
from bana_sglang.radix_global import config as flags
from bana_sglang.radix_global import hooks, summary
from bana_sglang.radix_global.keys import KVLayout, model_identity, namespaced
from bana_sglang.radix_global.publisher import name_native_thread


def test_linker_flags_are_what_sglang_parses():
    args = flags.linker_args("tcp://127.0.0.1:5", "127.0.0.1:6", owner="prefill-0")
    assert args[:3] == [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
    ]
    cfg = json.loads(args[args.index("--unified-cache-external-linker-config") + 1])
    assert cfg["linker"] == flags.LINKER_NAME and cfg["linker_module_path"] == flags.LINKER_MODULE
    assert flags.LinkerConfig.from_extra(cfg["linker_extra_config"], "x") == flags.LinkerConfig(
        "tcp://127.0.0.1:5", "127.0.0.1:6", "prefill-0"
    )


def test_linker_config_errors_name_the_problem(monkeypatch):
    monkeypatch.delenv("BANA_INDEX_ENDPOINT", raising=False)
    monkeypatch.delenv("BANA_STORE_MASTER", raising=False)
    with pytest.raises(ValueError, match="index"):
        flags.LinkerConfig.from_extra({"master": "h:1"}, "w")
    with pytest.raises(ValueError, match="unknown linker_extra_config keys \\['indx'\\]"):
        flags.LinkerConfig.from_extra({"indx": "tcp://h:1", "master": "h:1"}, "w")
    monkeypatch.setenv("BANA_INDEX_ENDPOINT", "tcp://h:2")
    assert flags.LinkerConfig.from_extra({"master": "h:1"}, "w").index == "tcp://h:2"


def test_model_identity_follows_the_weights(tmp_path, tiny_model):
    a = tmp_path / "a"
    shutil.copytree(tiny_model, a)
    b = tmp_path / "b" / a.name
    shutil.copytree(tiny_model, b)
    assert model_identity(str(a)) == model_identity(str(b))  # same name, same bytes
    weights = next(b.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    assert model_identity(str(a)) != model_identity(str(b))  # same name, other weights
    # and so the namespaced page keys differ: KV of the other weights is never served
    la = KVLayout(model_identity(str(a)), "float32", 16, 2, 16, 4)
    lb = KVLayout(model_identity(str(b)), "float32", 16, 2, 16, 4)
    assert namespaced("ab" * 32, la) != namespaced("ab" * 32, lb)


def test_launcher_worker_flags_with_and_without_the_store():
    linker = flags.linker_args("tcp://h:1", "h:2")
    pre = launch.store_args("prefill", linker, 16, ())
    assert pre[-3:] == ["--page-size", "16", "--enable-metrics"]
    dec = launch.store_args("decode", linker, 16, ("--page-size", "32"))
    assert "--page-size" not in dec  # the user's wins
    assert "--disaggregation-decode-enable-radix-cache" in dec
    assert launch.store_args("prefill", None, 16, ()) == []
    with pytest.raises(ValueError, match="store-bytes"):
        launch.LaunchConfig(store_bytes=1000)
    with pytest.raises(ValueError, match="Mooncake master"):
        launch.LaunchConfig(mooncake_master=False)


def test_summary_parses_prometheus_text_and_formats_a_table():
    text = "\n".join(
        [
            "# HELP bana_store_loaded_bytes_total Bytes loaded",
            "bana_store_loaded_bytes_total 2000000.0",
            'bana_store_load_seconds_total{pid="1"} 1.5',
            'bana_store_load_seconds_total{pid="2"} 0.5',
            "bana_store_load_wait_seconds_total 0.5",
            "bana_store_global_hit_tokens_total 288",
            "bana_store_loaded_bytes_created 1.7e9",
            "sglang:num_running_reqs 3",
        ]
    )
    m = summary.parse(text)
    assert m == {
        "loaded_bytes": 2e6,
        "load_seconds": 2.0,
        "load_wait_seconds": 0.5,
        "global_hit_tokens": 288,
    }
    table = summary.table([("prefill-0", m), ("decode-0", None)])
    assert "75%" in table  # 1 - 0.5 / 2.0 hidden
    assert "decode-0     (no answer)" in table


class _NativeStore:
    """Mooncake's store binding as ``get_bytes`` sees it: a failed read of an existing
    key (a replica on a stopped storage process) answers empty bytes."""

    def __init__(self, exists: int, data: bytes):
        self.exists, self.data = exists, data

    def is_exist(self, key):
        return self.exists

    def get(self, key):
        return self.data


def test_an_existing_key_that_cannot_be_read_is_an_error_not_an_absent_key():
    """The index's store-reset check reads a sentinel key: a read that fails while the
    storage process is stopped must not look like a store that lost its contents (the
    index would forget every page)."""
    from bana_sglang.radix_global.errors import StoreError
    from bana_sglang.radix_global.mooncake_kv import MooncakeKV, StoreConfig

    kv = MooncakeKV(StoreConfig(master_addr="127.0.0.1:9"))
    kv._ready = True  # as after a successful setup
    kv._store = _NativeStore(1, b"")
    with pytest.raises(StoreError, match="could not be read"):
        kv.get_bytes("bana/epoch/x")
    kv._store = _NativeStore(0, b"")
    assert kv.get_bytes("bana/epoch/x") is None
    kv._store = _NativeStore(1, b"bana-epoch")
    assert kv.get_bytes("bana/epoch/x") == b"bana-epoch"


@pytest.mark.parametrize(
    "nbytes, taken",
    [
        (0, 0),
        (9, 9),  # small sizes are their own class
        (15, 15),
        (17, 18),  # then classes an eighth of a power of two apart
        (1000, 1024),
        (16384, 16384),  # a class already: nothing added
        (16385, 18432),
        (16576, 18432),  # bana-tiny-v1's page: 16 KiB payload + 192-byte header
        (18432, 18432),
        (18433, 20480),
        (32767, 32768),
        ((1 << 20) + 192, 1179648),  # a 1 MiB payload with its header: 1 MiB + 1/8
    ],
)
def test_a_page_takes_its_allocators_size_class(nbytes, taken):
    from bana_sglang.radix_global.mooncake_kv import allocation_size

    assert allocation_size(nbytes) == taken
    assert allocation_size(taken) == taken  # a class rounds to itself
    if nbytes >= 16:
        assert taken - nbytes < taken / 8  # never more than an eighth over


class BanaGlobalLinker:  # recognised by its class name, as the hooks recognise ours
    arrivals = False


def _batch(linker):
    return SimpleNamespace(tree_cache=SimpleNamespace(linker=SimpleNamespace(cache_linker=linker)))


def test_a_decode_worker_knows_when_a_prompts_kv_arrives():
    """While a decode batch takes in requests whose KV came from their prefill
    workers (``process_prebuilt`` puts them into the tree), our linker is told so
    (it holds those offers back); before and after, and when the call raises, not."""
    linker, seen = BanaGlobalLinker(), []

    def prebuilt(batch, future_map):
        seen.append(linker.arrivals)
        return future_map

    assert hooks.prebuilt_hook(prebuilt, _batch(linker), "fm") == "fm"
    assert seen == [True] and linker.arrivals is False

    def failing(batch, future_map):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hooks.prebuilt_hook(failing, _batch(linker), None)
    assert linker.arrivals is False

    other = SimpleNamespace(arrivals=False)  # another linker (or none): untouched
    assert hooks.prebuilt_hook(lambda b, f: other.arrivals, _batch(other), None) is False
    assert hooks.prebuilt_hook(lambda b, f: "ok", SimpleNamespace(), None) == "ok"


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux names threads in /proc")
def test_the_store_threads_carry_their_names_in_the_os():
    """``top -H`` and per-thread CPU accounting tell the publish and load threads
    from the scheduler's (each names itself when it starts; 15 bytes at most)."""
    got = []

    def run():
        name_native_thread("bana-publish-and-more")
        tid = threading.get_native_id()
        got.append(open(f"/proc/self/task/{tid}/comm").read().strip())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == ["bana-publish-an"]
