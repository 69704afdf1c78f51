"""``python -m bana_sglang.balancer``: the live balancer's process.

Its flags (:func:`build_parser`), the :class:`~.controller.Controller` built
from them, and a small HTTP server for ``/metrics``, ``/decisions`` and
``/health`` on ``--host``/``--port``; SIGTERM or Ctrl-C recalls the
migrations it started and stops.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bana_sglang import _cli, envs
from bana_sglang.balancer import controller
from bana_sglang.balancer.actions import BalancerConfig, MigrationCostModel
from bana_sglang.balancer.controller import Controller, model_shape
from bana_sglang.balancer.policy import BALANCERS


def serve(ctl: Controller, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                body, ctype = ctl.metrics_text().encode(), "text/plain; version=0.0.4"
            elif self.path == "/decisions":
                body, ctype = ctl.decisions_json(), "application/json"
            elif self.path == "/health":
                body, ctype = b'{"status": "ok"}', "application/json"
            else:
                self.send_error(404, "try /metrics, /decisions or /health")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="bana-balancer-http", daemon=True).start()
    return server


def build_parser() -> argparse.ArgumentParser:
    d = BalancerConfig()
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.balancer",
        description=controller.__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--router", default="http://127.0.0.1:30000", help="the router's URL")
    p.add_argument("--api-key", default=None, help="the router's API key (default: $BANA_API_KEY)")
    p.add_argument(
        "--model-path",
        required=True,
        help="the served checkpoint (its config.json sizes the model)",
    )
    p.add_argument("--balancer", default="bana", choices=sorted(BALANCERS), help="the policy")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between policy evaluations")
    p.add_argument(
        "--recall-after-s",
        type=float,
        default=30.0,
        help="recall the layer migrations it started after the cluster stayed calm this long",
    )
    p.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=150.0,
        help="migration bandwidth for the cost model, MB/s (bench/bench_migrate.py measures it)",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=2000.0,
        help="one prefill worker's uncached prompt tokens per second (sizes the queue term)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--imbalance-threshold", type=float, default=d.imbalance_threshold)
    p.add_argument("--consecutive", type=int, default=d.consecutive)
    p.add_argument("--cooldown-s", type=float, default=d.cooldown_s)
    p.add_argument("--min-interval-s", type=float, default=d.min_interval_s)
    p.add_argument("--min-peak", type=float, default=d.min_peak)
    p.add_argument("--budget-s", type=float, default=d.budget_s)
    p.add_argument(
        "--max-actions",
        type=int,
        default=d.max_actions,
        help="actions per plan; 0: one per 8 workers, at least one",
    )
    p.add_argument(
        "--sustained-backlog-s",
        type=float,
        default=d.sustained_backlog_s,
        help="a prefill backlog this long (queued tokens / --prefill-tokens-per-s) acts without the streak",
    )
    p.add_argument(
        "--tpot-slo-s",
        type=float,
        default=0.0,
        help="TPOT SLO in seconds: a decode worker takes guest layers only while its step "
        "(running requests / generated tokens per second) stays within --tpot-headroom "
        "of it; 0: no guard",
    )
    p.add_argument(
        "--tpot-headroom",
        type=float,
        default=d.tpot_headroom,
        help="share of --tpot-slo-s a decode worker's step may reach with guest layers",
    )
    p.add_argument(
        "--recall-kv-usage",
        type=float,
        default=d.recall_kv_usage,
        help="recall the layers a decode worker hosts at once when its used KV plus the KV of "
        "the requests waiting for its memory (SGLang's /v1/loads) passes this share of its "
        "pool; 0: only when calm",
    )
    p.add_argument("--host", default="127.0.0.1", help="where /metrics and /decisions are served")
    p.add_argument("--port", type=int, default=0, help="0: an ephemeral port (logged)")
    p.add_argument("--log-level", default="INFO")
    return p


def controller_from_args(args: argparse.Namespace) -> Controller:
    cfg = BalancerConfig(
        imbalance_threshold=args.imbalance_threshold,
        release_threshold=min(BalancerConfig().release_threshold, args.imbalance_threshold),
        consecutive=args.consecutive,
        cooldown_s=args.cooldown_s,
        min_interval_s=args.min_interval_s,
        min_peak=args.min_peak,
        budget_s=args.budget_s,
        max_actions=args.max_actions,
        sustained_backlog_s=args.sustained_backlog_s,
        tpot_slo_s=args.tpot_slo_s,
        tpot_headroom=args.tpot_headroom,
        recall_kv_usage=args.recall_kv_usage,
    )
    return Controller(
        router=args.router,
        balancer_name=args.balancer,
        shape=model_shape(args.model_path, args.page_size, args.prefill_tokens_per_s),
        cost=MigrationCostModel(args.bandwidth_mbps * 1e6),
        config=cfg,
        interval_s=args.interval,
        recall_after_s=args.recall_after_s,
        api_key=args.api_key or envs.BANA_API_KEY.get() or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, ctl = _cli.parse(
        build_parser(), list(argv) if argv is not None else None, controller_from_args
    )
    _cli.exit_on_sigterm()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    server = serve(ctl, args.host, args.port)
    host, port = server.server_address[:2]
    print(
        f"bana-balancer ready on http://{host}:{port} (policy {args.balancer}; /metrics, /decisions)",
        flush=True,
    )
    stop = threading.Event()
    try:
        ctl.run(stop)
    except (KeyboardInterrupt, SystemExit):
        stop.set()
        if ctl.active:
            ctl.recall_all("controller stopping")
    finally:
        server.shutdown()
    return 0
