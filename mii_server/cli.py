"""``mii-server``: serve a model in the foreground, generate from, inspect and stop deployments.

mii-server serve [MODEL] [--replica-num N] [--port P] [--rest] [--openai-port 8000] ...   # Ctrl-C tears down
mii-server generate "DeepSpeed is" --max-new-tokens 32 [--stream]
mii-server status [NAME]
mii-server stop NAME
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .errors import MIIServerError


def _serve(args: argparse.Namespace) -> int:
    from .serving.control import registry
    from .serving.control.api import prepare
    from .serving.control.deployment import DeploymentConfig
    from .serving.control.supervisor import Supervisor
    from .serving.log_format import setup_logging

    kwargs: dict[str, Any] = {
        "replica_num": args.replica_num,
        "tensor_parallel": args.tensor_parallel,
        "port_number": args.port,
        "host": args.host,
        "enable_restful_api": args.rest,
        "restful_api_port": args.rest_port,
        "restful_api_host": args.rest_host,
        "enable_openai_api": args.openai_port is not None,
        "openai_api_host": args.openai_host,
        "dtype": args.dtype,
        "device": args.device,
    }
    if args.deployment_name:
        kwargs["deployment_name"] = args.deployment_name
    if args.max_length is not None:
        kwargs["max_length"] = args.max_length
    if args.device_map is not None:
        kwargs["device_map"] = json.loads(args.device_map)
    if args.registry:
        kwargs["registry_dir"] = args.registry
    if args.openai_port is not None:
        kwargs["openai_api_port"] = args.openai_port
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name
    if args.api_key_file:
        kwargs["api_key_file"] = args.api_key_file
    if args.metrics_port is not None:
        kwargs["metrics_port"] = args.metrics_port
    if args.no_metrics:
        kwargs["enable_metrics"] = False
    config = prepare(DeploymentConfig.from_kwargs(args.model, **kwargs))
    setup_logging("supervisor")
    print(
        f"serving {config.model.model_name_or_path or 'the built-in demo model'} as {config.deployment_name}: "
        f"gRPC {config.lb_address}"
        + (f", REST {config.rest_url}" if config.rest_url else "")
        + (f", OpenAI API {config.openai_url}" if config.openai_url else "")
        + "; Ctrl-C stops",
        file=sys.stderr,
    )
    code = Supervisor(config).run()
    if code != 0:
        record = registry.read(config.deployment_name, config.registry_dir)
        registry.remove(config.deployment_name, config.registry_dir)
        print(f"error: {record.error if record else 'start-up failed'}", file=sys.stderr)
    return code


def _generate(args: argparse.Namespace) -> int:
    from .serving.control.api import client

    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.greedy:
        kwargs["do_sample"] = False
    for name in ("temperature", "top_p", "top_k", "seed", "max_length"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.stop:
        kwargs["stop"] = args.stop
    c = client(args.deployment)
    try:
        if args.stream:
            for chunk in c.generate_stream(args.prompts, **kwargs):
                if args.json:
                    print(json.dumps(chunk.to_msg_dict()), flush=True)
                elif len(args.prompts) == 1:
                    print(chunk.generated_text, end="", flush=True)
                else:
                    print(f"[{chunk.prompt_index}] {chunk.generated_text!r}", flush=True)
            if not args.json and len(args.prompts) == 1:
                print()
        else:
            for prompt, response in zip(args.prompts, c.generate(args.prompts, **kwargs), strict=True):
                if args.json:
                    print(json.dumps(response.to_msg_dict()))
                else:
                    print(f"{prompt}{response.generated_text}")
    finally:
        c.close()
    return 0


def _status(args: argparse.Namespace) -> int:
    from .serving.control import registry
    from .serving.control.api import client

    if args.name:
        c = client(args.name)
        try:
            for s in c.stats():
                state = "up" if s.healthy else "DOWN"
                print(
                    f"replica {s.replica_index} {s.address} {state} pid={s.pid} routed={s.prompts_routed} "
                    f"received={s.prompts_received} running={s.running} waiting={s.waiting} "
                    f"kv_free={s.free_blocks}/{s.total_blocks} generated_tokens={s.generated_tokens}"
                )
        finally:
            c.close()
        return 0
    records = registry.list_records()
    if not records:
        print(f"no deployments in {registry.registry_dir()}")
    for r in records:
        state = r.state if r.is_alive() else "dead (stale record)"
        rest = f", REST {r.rest_url}" if r.rest_url else ""
        openai = f", OpenAI API {r.openai_url}" if r.openai_url else ""
        print(
            f"{r.name}: {state}, gRPC {r.address}{rest}{openai}, supervisor pid {r.supervisor_pid}, logs {r.log_dir}"
        )
    return 0


def _stop(args: argparse.Namespace) -> int:
    from .serving.control.api import client

    client(args.name).terminate_server()
    print(f"stopped {args.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mii-server",
        description="An MII-style model server: serve, query, inspect and stop deployments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="serve a model in the foreground (Ctrl-C stops it)",
        description="Start a deployment (replicas, load balancer, optional REST gateway) and supervise it "
        "in the foreground until Ctrl-C or `mii-server stop NAME`.",
    )
    p.add_argument(
        "model", nargs="?", default="", help="checkpoint dir or HF hub id; omit for the demo model"
    )
    p.add_argument("--deployment-name", default="", help="registry name (default '<model>-mii-deployment')")
    p.add_argument("--replica-num", type=int, default=1, help="model replicas (default 1)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="ranks per replica (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=50050, help="load balancer port; replicas follow (default 50050)"
    )
    p.add_argument("--rest", action="store_true", help="also start the REST gateway")
    p.add_argument("--rest-port", type=int, default=28080, help="REST gateway port (default 28080)")
    p.add_argument("--rest-host", default="127.0.0.1", help="REST gateway bind address (default 127.0.0.1)")
    p.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="also start the OpenAI-compatible server on this port (/v1/completions, /v1/chat/completions)",
    )
    p.add_argument(
        "--openai-host", default="127.0.0.1", help="OpenAI server bind address (default 127.0.0.1)"
    )
    p.add_argument("--served-model-name", default="", help="model id of the OpenAI API (default: MODEL)")
    p.add_argument(
        "--api-key-file",
        default="",
        help="file of API keys (one per line) the HTTP servers require; or set $MII_SERVER_API_KEY "
        "(never pass a key on the command line)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="replica i serves /metrics on this port + i (default: right after the replicas' gRPC ports)",
    )
    p.add_argument("--no-metrics", action="store_true", help="no /metrics HTTP port on the replicas")
    p.add_argument(
        "--max-length", type=int, default=None, help="default prompt+output token limit per request"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--device-map", default=None, help='GPUs per replica as JSON, e.g. "[[0],[1]]"')
    p.add_argument(
        "--registry", default="", help="registry directory (default $MII_SERVER_REGISTRY or per-user)"
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "generate",
        help="generate text from a running deployment",
        description="Send prompts to a running deployment and print the outputs.",
    )
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument(
        "-d", "--deployment", default="", help="deployment name or host:port (default: the demo's)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--max-length", type=int, default=None, help="prompt+output token limit")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (do_sample=False)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print one JSON object per response or chunk")
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "status",
        help="list deployments, or show one's replicas",
        description="Without NAME: every deployment in the registry. With NAME: per-replica counters.",
    )
    p.add_argument("name", nargs="?", default="", help="deployment name or host:port")
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "stop",
        help="stop a running deployment",
        description="Terminate every process of a deployment and free its ports.",
    )
    p.add_argument("name", help="deployment name or host:port")
    p.set_defaults(func=_stop)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MIIServerError as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
