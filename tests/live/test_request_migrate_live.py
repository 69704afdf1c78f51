"""Live request migration on real SGLang workers: the launcher starts a 1P2D
cluster with the global store; a streamed request running on one decode
worker is stopped at a batch boundary, its KV published to the global store,
and the router continues it on the other decode worker (the prefill worker
loads the published pages), relaying the rest into the same client stream.

Checks: greedy float32 tokens (``/generate``) and text (chat, moved twice)
equal a plain run's, in one stream with one id and whole usage; the
continuation's prefill loaded the handed-off pages from the store; both decode
workers' pools are whole afterwards; bad commands are refused with the reason;
requests whose sampling a continuation would not reproduce (seeded sampling,
a grammar, penalties) are never offered for a move and keep a plain run's
tokens beside a greedy one that moves; and when no decode worker can take the request, the client gets the tokens
produced so far (a prefix of the plain run's) and an error event, never wrong
tokens or a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from support.cluster import launched_cluster
from support.migrate import (
    KEY,
    agents,
    cli,
    counter,
    generate,
    generate_many,
    pid_of,
    prompts_of,
    wait_state,
)

pytestmark = pytest.mark.slow

H = {"Authorization": f"Bearer {KEY}"}
# tokens, all of them (ignore_eos: the tiny model can end an answer after a few hundred): a
# request runs for seconds, about 2.4 s alone at this model's speed here
NEW = 480
# the first test moves one request through the CLI, whose start-up (seconds on a loaded
# machine) a 480-token request can outrun (the clean-clone CI saw them end "while its pages
# were copied" and before the command came): its requests run longer. 1000 tokens were
# outrun once too (a stop-25 clean-clone run: the picked request "ended while its pages
# were copied"), so 2000 (the tiny model's context is 4096)
NEW_CLI = 2000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with launched_cluster(
        # the last test needs the killed decode worker to stay dead
        ["--num-prefill", "1", "--num-decode", "2", "--api-key", KEY, "--no-restart"],
        tmp_path_factory.mktemp("request-migrate-logs"),
    ) as c:
        yield c


class Stream:
    """A streamed request read on a thread: every event, and when it came."""

    def __init__(self, url: str, path: str, body: dict):
        self.events: list[dict | str] = []
        self.times: list[float] = []
        self.status = 0
        self._t = threading.Thread(target=self._read, args=(url + path, body), daemon=True)
        self._t.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json=dict(body, stream=True), headers=H, timeout=300) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.times.append(time.monotonic())
                    data = line[5:].strip()
                    self.events.append(data if data == "[DONE]" else json.loads(data))

    def join(self) -> list:
        self._t.join(300)
        assert not self._t.is_alive(), "the stream hung"
        return self.events


def gen_body(ids: list[int], new: int = NEW) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
    }


def movable(
    c, worker: str | None = None, n: int = 1, timeout: float = 120
) -> tuple[str, list[dict]]:
    """Until a decode worker lists ``n`` movable requests: (worker, them)."""
    deadline = time.monotonic() + timeout
    while True:
        for name, st in agents(c).items():
            if st["role"] == "decode" and (worker in (None, name)) and len(st["movable"]) >= n:
                return name, st["movable"]
        assert time.monotonic() < deadline, agents(c)
        time.sleep(0.1)


def other(name: str) -> str:
    return "decode-1" if name == "decode-0" else "decode-0"


def move(c, worker: str, mid: str, peer: str | None = None, timeout: float = 120) -> dict:
    """A request migration through the admin API (quicker than the CLI's start-up,
    which a request can outrun on a loaded machine), followed to its end."""
    r = httpx.post(
        c.url + "/bana/admin/migrations",
        headers=H,
        timeout=30,
        json={"worker": worker, "peer": peer, "request": True, "id": mid},
    )
    assert r.status_code == 202, r.text
    return wait_state(c, worker, mid, ("handed_off", "failed", "cancelled"), timeout)


def router_counter(c, name: str) -> float:
    text = httpx.get(c.url + "/metrics", headers=H, timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


def test_streamed_requests_move_mid_answer_and_read_as_one_answer(cluster, single_server):
    prompts = prompts_of(31, 3, base=60, step=30)
    want = generate_many(single_server, prompts, NEW_CLI, ignore_eos=True)
    urls = {w: st["url"] for w, st in agents(cluster).items()}
    loaded = counter(urls["prefill-0"], "bana_store_loaded_pages_total")
    streams = [Stream(cluster.url, "/generate", gen_body(ids, NEW_CLI)) for ids in prompts]
    src, reqs = movable(cluster, n=1)
    # one through the CLI (the request with the most tokens left, the router picks the target) ...
    out = cli(cluster, "request", src, "--id", "req-cli", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "req-cli: handed_off" in out.stdout
    # ... one through the admin endpoint: a named request to a named peer
    src2, reqs2 = movable(cluster, n=1)
    r = httpx.post(
        cluster.url + "/bana/admin/migrations",
        headers=H,
        timeout=30,
        json={"worker": src2, "peer": other(src2), "request": reqs2[0]["rid"], "id": "req-admin"},
    )
    assert r.status_code == 202, r.text
    done = wait_state(cluster, src2, "req-admin", ("handed_off", "failed"))
    got = [s.join() for s in streams]
    for events, ids, w in zip(got, prompts, want, strict=True):
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["output_ids"] == w  # the same tokens as a plain run, moved or not
        assert last["meta_info"]["prompt_tokens"] == len(ids) and last["meta_info"][
            "completion_tokens"
        ] == len(w)
        assert len({e["meta_info"]["id"] for e in events[:-1]}) == 1  # one response
        texts = [e["text"] for e in events[:-1]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative across the move
    assert done["state"] == "handed_off", done
    assert done["kind"] == "request" and done["bytes_total"] > 0
    assert router_counter(cluster, 'bana_router_request_migrations_total{result="continued"}') == 2
    # the continuations' prefill loaded the handed-off pages from the global store
    assert counter(urls["prefill-0"], "bana_store_loaded_pages_total") - loaded >= 2 * (60 // 16)


def test_a_chat_stream_moves_twice_and_reads_as_one_answer(cluster):
    body = {
        "messages": [{"role": "user", "content": "tell me about the sea and the ships " * 4}],
        "max_tokens": NEW,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    plain = httpx.post(
        cluster.url + "/v1/chat/completions", headers=H, timeout=300, json=body
    ).json()
    s = Stream(cluster.url, "/v1/chat/completions", body)
    src, _ = movable(cluster)
    assert move(cluster, src, "chat-1", peer=other(src))["state"] == "handed_off"
    # the continuation is migratable too: move it back
    src2, _ = movable(cluster, worker=other(src))
    assert move(cluster, src2, "chat-2", peer=src)["state"] == "handed_off"
    events = s.join()
    assert s.status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert len({c["id"] for c in chunks}) == 1 and all(
        c["object"] == "chat.completion.chunk" for c in chunks
    )
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == plain["choices"][0]["finish_reason"] and "abort" not in finishes
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        plain["usage"]["prompt_tokens"],
        plain["usage"]["completion_tokens"],
    )


def test_after_the_moves_both_decode_pools_are_whole(cluster):
    deadline = time.monotonic() + 60
    while True:
        a = agents(cluster)
        d = [a[w] for w in ("decode-0", "decode-1")]
        if all(
            x["running_requests"] == 0
            and x["kv_free_tokens"] + x["kv_evictable_tokens"] == x["kv_total_tokens"]
            for x in d
        ):
            break
        assert time.monotonic() < deadline, d
        time.sleep(0.2)


def test_bad_request_migrations_are_refused_with_the_reason(cluster):
    def post(**body) -> httpx.Response:
        return httpx.post(cluster.url + "/bana/admin/migrations", headers=H, timeout=30, json=body)

    r = post(worker="prefill-0", request=True)
    assert r.status_code == 400 and "prefill worker" in r.text
    r = post(worker="decode-0", request=5)
    assert r.status_code == 400 and "'request' must be" in r.text
    r = post(worker="decode-0", peer="decode-0", request=True)
    assert r.status_code == 400 and "must differ" in r.text
    r = post(worker="decode-0", peer="decode-7", request=True)
    assert r.status_code == 404 and "decode-7" in r.text
    # nothing running: accepted, then failed at the boundary with the reason
    out = cli(cluster, "request", "decode-0", "--rid", "bana-m-nope", "--id", "req-none", "--wait")
    assert out.returncode == 1 and "not running here" in out.stdout, out.stdout + out.stderr
    # a non-streamed request is not migratable: it is never cut short
    ids = prompts_of(41, 1, base=40)[0]
    with httpx.Client(timeout=300) as client:
        t = threading.Thread(
            target=lambda: client.post(cluster.url + "/generate", headers=H, json=gen_body(ids))
        )
        t.start()
        deadline = time.monotonic() + 120
        while not any(agents(cluster)[w]["running_requests"] for w in ("decode-0", "decode-1")):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        busy = next(w for w in ("decode-0", "decode-1") if agents(cluster)[w]["running_requests"])
        out = cli(cluster, "request", busy, "--id", "req-plain", "--wait")
        t.join(300)
    assert out.returncode == 1 and "can move" in out.stdout, out.stdout + out.stderr


#: sampling a continuation would not reproduce: never marked movable, each with the reason
#: the router counts (``bana_router_unmigratable_total{reason}``)
KEPT = {
    "sampling_seed": {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234},
    "regex": {"temperature": 0, "regex": "[a-d ]{300}"},
    "frequency_penalty": {"temperature": 0, "frequency_penalty": 0.7},
}


def test_sampled_and_constrained_requests_stay_put_and_keep_their_answers(cluster, single_server):
    ids = prompts_of(57, 1, base=50)[0]
    # the grammar ends the constrained answer (ignore_eos would fight it)
    bodies = {
        why: {
            "input_ids": ids,
            "sampling_params": dict(sp, max_new_tokens=300, ignore_eos="regex" not in sp),
        }
        for why, sp in KEPT.items()
    }
    # long enough to be still decoding after the listings below and the pre-copy (a
    # 480-token answer once ended while its pages were copied, failing the move)
    bodies["greedy"] = gen_body(ids, new=1200)

    def plain(body: dict) -> list[int]:
        r = httpx.post(single_server + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    want = {k: plain(b) for k, b in bodies.items()}
    assert want["sampling_seed"] != want["greedy"][:300]  # it really sampled
    before = {
        why: router_counter(cluster, f'bana_router_unmigratable_total{{reason="{why}"}}')
        for why in KEPT
    }
    streams = {k: Stream(cluster.url, "/generate", b) for k, b in bodies.items()}
    src, _ = movable(cluster, n=1)
    # of the four running requests, only the greedy one is ever offered for a move. A
    # listing reads each scheduler's running batch from the agent's thread, and SGLang
    # replaces that batch object between steps, so one listing can catch it empty.
    counts = []
    for _ in range(10):
        counts.append(sum(len(st["movable"]) for st in agents(cluster).values()))
        time.sleep(0.05)
    assert max(counts) == 1, counts
    done = move(cluster, src, "req-mixed")
    got = {k: s.join() for k, s in streams.items()}
    assert done["state"] == "handed_off", done
    for k, events in got.items():
        assert events[-1] == "[DONE]", (k, events[-3:])
        assert len({e["meta_info"]["id"] for e in events[:-1]}) == 1, k  # one response
        if k == "sampling_seed":
            # SGLang uses the seed only with --enable-deterministic-inference, so a sampled
            # answer has no plain run to equal: it ran whole where it started
            assert len(events[-2]["output_ids"]) == 300
            continue
        assert events[-2]["output_ids"] == want[k], k  # moved or kept: a plain run's tokens
    for why in KEPT:
        n = router_counter(cluster, f'bana_router_unmigratable_total{{reason="{why}"}}')
        assert n - before[why] == 1, why


def kill_worker(url: str) -> int:
    """SIGKILL a whole SGLang worker (its HTTP server and every child) by its URL's port."""
    port = url.rstrip("/").rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if (
            "sglang.launch_server" in cmd
            and "--port" in cmd
            and cmd[cmd.index("--port") + 1] == port
        ):
            tree = [proc, *proc.children(recursive=True)]
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            return len(tree)
    raise AssertionError(f"no SGLang worker serves {url}")


def completion_text(url: str, ids: list[int], n: int) -> str:
    body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, headers=H, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def chat_body(topic: str) -> dict:
    return {
        "messages": [{"role": "user", "content": f"tell me about {topic} " * 4}],
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
    }


def chat_text(events: list) -> str:
    return "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in events
        if isinstance(c, dict) and c.get("choices")
    )


def test_streams_of_a_decode_worker_that_dies_go_on_elsewhere(cluster, single_server):
    """SIGKILL of a whole decode worker while streams run on both: the router resumes
    each of its streams on the other decode worker from the prompt and the tokens it
    already relayed, so every client reads one unbroken answer with a plain run's
    tokens (``/generate``) or text (``/v1/completions``, and chat, whose ids the workers
    stream to the router in ``bana_ids`` events). Then the next test, with that worker
    still dead."""
    gens = prompts_of(61, 4, base=40, step=20)
    want = generate_many(single_server, gens, NEW, ignore_eos=True)
    comps = prompts_of(71, 2, base=50, step=20)
    want_text = [completion_text(single_server, ids, NEW) for ids in comps]
    chats = [chat_body(t) for t in ("the sea", "the hills")]
    want_chat = []
    for body in chats:
        r = httpx.post(single_server + "/v1/chat/completions", json=body, headers=H, timeout=300)
        assert r.status_code == 200, r.text
        want_chat.append(r.json()["choices"][0]["message"]["content"])
    # the chat streams first, one on each decode worker (the load-aware policy spreads them):
    # one of them is decoding on the worker about to die
    victim = "decode-1"
    chat_streams = [Stream(cluster.url, "/v1/chat/completions", body) for body in chats]
    movable(cluster, worker=victim, n=1)
    streams = [Stream(cluster.url, "/generate", gen_body(ids)) for ids in gens]
    streams += [
        Stream(
            cluster.url,
            "/v1/completions",
            {"prompt": ids, "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
        )
        for ids in comps
    ]
    movable(cluster, worker=victim, n=1)  # it is decoding some of them
    url = agents(cluster)[victim]["url"]
    assert kill_worker(url) >= 2
    got = [s.join() for s in streams]
    for events, w in zip(got[: len(gens)], want, strict=True):
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-3:]
        assert events[-2]["output_ids"] == w  # the plain run's tokens, resumed or not
        assert "prompt_token_ids" not in events[-2]
    for events, w in zip(got[len(gens) :], want_text, strict=True):
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        text = "".join(c["text"] for e in events[:-1] for c in e.get("choices", []))
        assert text == w
        assert not any("token_ids" in c for e in events[:-1] for c in e.get("choices", []))
    for s, w in zip(chat_streams, want_chat, strict=True):
        events = s.join()
        assert s.status == 200 and events[-1] == "[DONE]", events[-3:]
        assert not any("error" in e for e in events[:-1]), events[-3:]
        assert chat_text(events) == w
        assert len({e["id"] for e in events[:-1]}) == 1
    assert router_counter(cluster, 'bana_router_stream_resumes_total{result="resumed"}') >= 1
    assert router_counter(cluster, "bana_router_stream_errors_total") == 0


def test_with_no_decode_worker_to_take_it_the_client_gets_a_prefix_and_an_error(
    cluster, single_server
):
    """Last: decode-1 is dead (killed here if the test before did not). The request is stopped on the survivor,
    the continuation has nowhere to go: the stream ends with an error event
    after tokens that are a prefix of the plain run's, and the survivor serves on."""
    ids = prompts_of(51, 1, base=50)[0]
    want = generate(single_server, ids, NEW, ignore_eos=True)
    victim = "decode-1"
    if httpx.get(cluster.url + "/health", headers=H, timeout=30).json()["healthy_decode"] == 2:
        os.kill(pid_of(cluster, victim), signal.SIGKILL)  # unless the test before killed it
    deadline = time.monotonic() + 60
    while (
        httpx.get(cluster.url + "/health", headers=H, timeout=30).json()["healthy_decode"] != 1
    ):  # the router noticed
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for attempt in range(
        3
    ):  # a loaded machine can let the request end before the boundary: try again
        s = Stream(cluster.url, "/generate", gen_body(ids))
        src, _ = movable(cluster, worker="decode-0")
        st = move(cluster, src, f"req-orphan-{attempt}")
        if st["state"] == "handed_off":
            break
        s.join()
    else:
        pytest.fail(f"the request was never stopped for the hand-off: {st}")
    events = s.join()
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert "could not continue" in events[-2]["error"]["message"]
    seen = [e for e in events if isinstance(e, dict) and "output_ids" in e]
    assert seen and seen[-1]["output_ids"] == want[: len(seen[-1]["output_ids"])]
    assert router_counter(cluster, 'bana_router_request_migrations_total{result="failed"}') >= 1
    # the survivor serves on (and a plain request is not routed to the dead worker for long)
    assert generate(cluster.url, ids, 8, KEY, ignore_eos=True) == want[:8]
