"""``python -m bana_sglang.migrate``: list, trigger, follow and cancel migrations.

Through the router's admin endpoints (``--router URL``, default
``http://127.0.0.1:30000``; ``--api-key`` or ``$BANA_API_KEY``), where workers
are named as in the launcher (``prefill-0``), or straight to one agent
(``--agent tcp://HOST:PORT``, with the cluster secret in
``$BANA_CLUSTER_SECRET_FILE``), where the peer is an agent endpoint.

    python -m bana_sglang.migrate status
    python -m bana_sglang.migrate migrate prefill-0 decode-0 --layers 2:4 --wait
    python -m bana_sglang.migrate kv decode-0 prefill-0 --pages 64 --wait
    python -m bana_sglang.migrate request decode-0 decode-1 --wait
    python -m bana_sglang.migrate reclaim prefill-1
    python -m bana_sglang.migrate recall mig-1a2b3c --wait
    python -m bana_sglang.migrate watch mig-1a2b3c
    python -m bana_sglang.migrate cancel mig-1a2b3c
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx
import msgspec

from bana_sglang import envs
from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.wire import agent as m


class CommandError(RuntimeError):
    pass


def _layers(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use START:STOP, e.g. 2:4 for layers 2 and 3"
        ) from None
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.migrate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--router", default=None, help="the router (default http://127.0.0.1:30000)")
    where.add_argument(
        "--agent",
        default=None,
        metavar="tcp://HOST:PORT",
        help="talk to one agent directly (needs the cluster secret: $BANA_CLUSTER_SECRET_FILE)",
    )
    p.add_argument("--api-key", default=None, help="the router's API key (default: $BANA_API_KEY)")
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds per call (agents answer at batch boundaries; the router waits up to 30 s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="who executes which layers, migrations, guest memory")
    mg = sub.add_parser("migrate", help="move layers of WORKER to PEER")
    mg.add_argument(
        "worker", help="worker name (router) — ignored with --agent, which is the worker"
    )
    mg.add_argument("peer", help="peer name (router) or agent endpoint tcp://HOST:PORT (--agent)")
    mg.add_argument("--layers", type=_layers, required=True, metavar="START:STOP")
    mg.add_argument("--id", default=None, help="migration id (default: generated)")
    mg.add_argument("--wait", action="store_true", help="follow it until it ends")
    mg.add_argument(
        "--stage-only",
        action="store_true",
        help="only copy the weights to PEER (verified); WORKER keeps executing the layers",
    )
    kv = sub.add_parser(
        "kv",
        help="move KV pages of WORKER's running decode requests to PEER, which then "
        "computes the attention over them (KV-block migration)",
    )
    kv.add_argument(
        "worker", help="decode worker name (router) — ignored with --agent, which is the worker"
    )
    kv.add_argument("peer", help="peer name (router) or agent endpoint tcp://HOST:PORT (--agent)")
    kv.add_argument("--pages", type=int, required=True, help="how many KV pages to move (at most)")
    kv.add_argument(
        "--min-pages",
        type=int,
        default=1,
        help="move pages only of requests that have this many "
        "complete pages of their own (default 1)",
    )
    kv.add_argument("--id", default=None, help="migration id (default: generated)")
    kv.add_argument("--wait", action="store_true", help="follow it until the pages are on the peer")
    rq = sub.add_parser(
        "request",
        help="move a running request of decode worker WORKER to another decode "
        "worker; the router relays the rest of its stream",
    )
    rq.add_argument(
        "worker", help="decode worker name (router) — ignored with --agent, which is the worker"
    )
    rq.add_argument(
        "peer",
        nargs="?",
        default="",
        help="target decode worker name (router) or agent endpoint (--agent); default: the router's "
        "load-aware choice",
    )
    rq.add_argument(
        "--rid",
        default="",
        help="the request (default: the migratable one with the most tokens left)",
    )
    rq.add_argument("--id", default=None, help="migration id (default: generated)")
    rq.add_argument("--wait", action="store_true", help="follow it until the request is handed off")
    rcl = sub.add_parser(
        "reclaim",
        help="WORKER hosts KV pages of others and needs its memory: ask their "
        "lenders to recall them",
    )
    rcl.add_argument(
        "worker", help="worker name (router) — ignored with --agent, which is the worker"
    )
    rc = sub.add_parser("recall", help="bring the layers (or KV pages) of a migration home")
    rc.add_argument("id")
    rc.add_argument(
        "--from-checkpoint",
        action="store_true",
        help="reload the weights from the checkpoint on disk instead of reading the peer's copy",
    )
    rc.add_argument("--wait", action="store_true", help="follow it until the layers are home")
    for name in ("watch", "cancel"):
        s = sub.add_parser(name, help=f"{name} a migration")
        s.add_argument("id")
    return p


class Backend:
    """Router or agent: the same four operations, results as plain dicts."""

    def __init__(self, args: argparse.Namespace):
        self.agent = AgentClient(args.agent, timeout_s=args.timeout) if args.agent else None
        self.router = (args.router or "http://127.0.0.1:30000").rstrip("/")
        key = args.api_key or envs.BANA_API_KEY.get() or None
        self.http = httpx.Client(
            base_url=self.router,
            timeout=args.timeout,
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )

    def _agent(self, make, **fields) -> dict:
        try:
            r = self.agent.call(make, **fields)
        except AgentUnavailable as e:
            raise CommandError(str(e)) from None
        if isinstance(r, m.Error):
            raise CommandError(f"{r.reason}: {r.detail}")
        return {"kind": type(r).__name__.lower(), **msgspec.to_builtins(r)}

    def _http(self, method: str, path: str, **kw) -> dict:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise CommandError(f"router {self.router}: {e}") from None
        try:
            data = r.json()
        except ValueError:
            data = {"error": {"message": r.text[:300]}}
        if r.status_code >= 400:
            raise CommandError(f"{r.status_code}: {data.get('error', {}).get('message', data)}")
        return data

    def status(self) -> list[dict]:
        if self.agent:
            return [{"agent": self.agent.endpoint, **self._agent(m.Status)}]
        return self._http("GET", "/bana/admin/agents")["agents"]

    def migrate(
        self, worker: str, peer: str, layers: tuple[int, int], mid: str | None, switch: bool
    ) -> dict:
        mid = mid or f"mig-{os.urandom(6).hex()}"
        if self.agent:
            return self._agent(
                m.MigrateLayers,
                migration=mid,
                start=layers[0],
                stop=layers[1],
                peer=peer,
                switch=switch,
            )
        return self._http(
            "POST",
            "/bana/admin/migrations",
            json={
                "worker": worker,
                "peer": peer,
                "layers": list(layers),
                "id": mid,
                "switch": switch,
            },
        )

    def migrate_kv(
        self, worker: str, peer: str, pages: int, min_pages: int, mid: str | None
    ) -> dict:
        mid = mid or f"kv-{os.urandom(6).hex()}"
        if self.agent:
            return self._agent(
                m.MigrateKV, migration=mid, peer=peer, pages=pages, min_pages=min_pages
            )
        return self._http(
            "POST",
            "/bana/admin/migrations",
            json={
                "worker": worker,
                "peer": peer,
                "kv_pages": pages,
                "min_pages": min_pages,
                "id": mid,
            },
        )

    def migrate_request(self, worker: str, peer: str, rid: str, mid: str | None) -> dict:
        mid = mid or f"req-{os.urandom(6).hex()}"
        if self.agent:
            return self._agent(m.MigrateRequest, migration=mid, peer=peer, rid=rid)
        return self._http(
            "POST",
            "/bana/admin/migrations",
            json={"worker": worker, "peer": peer or None, "request": rid or True, "id": mid},
        )

    def reclaim(self, worker: str) -> dict:
        if self.agent:
            return self._agent(m.Reclaim, reason="asked from the command line")
        return self._http("POST", "/bana/admin/reclaim", json={"worker": worker})

    def recall(self, mid: str, source: str) -> dict:
        if self.agent:
            return self._agent(m.Recall, migration=mid, source=source)
        return self._http("POST", f"/bana/admin/migrations/{mid}/recall", json={"source": source})

    def watch(self, mid: str) -> dict:
        return (
            self._agent(m.Watch, migration=mid)
            if self.agent
            else self._http("GET", f"/bana/admin/migrations/{mid}")
        )

    def cancel(self, mid: str) -> dict:
        return (
            self._agent(m.Cancel, migration=mid)
            if self.agent
            else self._http("DELETE", f"/bana/admin/migrations/{mid}")
        )


def status_table(agents: list[dict]) -> str:
    lines = []
    for a in agents:
        if "error" in a:
            lines.append(f"{a.get('url', a.get('agent'))}: agent unreachable ({a['error']})")
            continue
        place = ", ".join(f"[{p['start']},{p['stop']}) on {p['executor']}" for p in a["placement"])
        if any(p["executor"] != a["worker"] for p in a["placement"]):
            place += " (remote)"
        kv_free = (
            f"; KV free {a['kv_free_tokens']}/{a['kv_total_tokens']} slots"
            if a.get("kv_total_tokens", -1) > 0
            else ""
        )
        lines.append(
            f"{a['worker']} ({a['role']}, {a['num_layers']} layers): layers {place}; "
            f"guest memory {a['guest_bytes'] / 1e6:.1f} MB{kv_free}"
        )
        for x in a["migrations"]:
            what = f"{x['reason']}: {x['detail']}" if x["reason"] else ""
            steps = ""
            if x.get("steps"):
                steps = f"  {x['steps']} steps"
                if x.get("remote_seconds"):
                    steps += f" ({1e3 * x['remote_seconds'] / x['steps']:.1f} ms each)"
            if x.get("released_bytes"):
                steps += f"  released {x['released_bytes'] / 1e6:.1f} MB"
            kv = x.get("kv") or {}
            if kv.get("attend_calls"):
                each = 1e3 * kv["attend_s"] / kv["attend_calls"]
                steps += f"  {kv['attend_calls']:.0f} attention calls ({each:.1f} ms each)"
            if kv:
                steps += (
                    f"  {kv.get('pages', 0):.0f} pages in {kv.get('segments', 0):.0f} requests, "
                    f"{kv.get('remote_segments', 0):.0f} still remote"
                )
            what_moves = {"kv": "KV pages", "request": "request"}.get(
                x.get("kind"), f"layers [{x['start']},{x['stop']})"
            )
            lines.append(
                f"  {x['migration']}  {x['side']:6s} {what_moves} "
                f"{'->' if x['side'] == 'source' else '<-'} {x['peer']}  {x['state']}  "
                f"{x['bytes_done'] / 1e6:.1f}/{x['bytes_total'] / 1e6:.1f} MB  {x['seconds']:.2f}s"
                f"{steps}  {what}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    be = Backend(args)
    show = (lambda d: print(json.dumps(d, indent=2))) if args.json else None
    try:
        if args.cmd == "status":
            agents = be.status()
            print(json.dumps(agents, indent=2) if args.json else status_table(agents))
            return 0
        if args.cmd in ("migrate", "recall", "kv", "request"):
            if args.cmd == "migrate":
                r = be.migrate(args.worker, args.peer, args.layers, args.id, not args.stage_only)
            elif args.cmd == "kv":
                r = be.migrate_kv(args.worker, args.peer, args.pages, args.min_pages, args.id)
            elif args.cmd == "request":
                r = be.migrate_request(args.worker, args.peer, args.rid, args.id)
            else:
                r = be.recall(args.id, "checkpoint" if args.from_checkpoint else "peer")
            mid = r.get("migration")
            (show or (lambda d: print(f"{args.cmd} {mid} accepted")))(r)
            if not args.wait:
                return 0
            while (r := be.watch(mid))["kind"] == "progress":
                if not args.json:
                    print(
                        f"  {r['state']}: {r['bytes_done'] / 1e6:.1f}/{r['bytes_total'] / 1e6:.1f} MB",
                        file=sys.stderr,
                    )
                time.sleep(0.5)
        elif args.cmd == "reclaim":
            r = be.reclaim(args.worker)
        else:
            r = be.watch(args.id) if args.cmd == "watch" else be.cancel(args.id)
        if show:
            show(r)
        elif r["kind"] == "done":
            print(
                f"{r['migration']}: {r['state']} ({r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f}s)"
            )
        elif r["kind"] == "ok":
            print(r.get("note", "ok"))
        elif r["kind"] == "failed":
            print(f"{r['migration']}: failed: {r['reason']}: {r['detail']}")
        else:
            print(json.dumps(r))
        return 1 if r["kind"] == "failed" else 0
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
