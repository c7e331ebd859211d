"""``mii-server``: serve a model in the foreground, run one role of a deployment on its own, generate
from, inspect and stop deployments.

mii-server serve [MODEL] [--replica-num N] [--port P] [--rest] [--openai-port 8000] ...   # Ctrl-C tears down
mii-server replica [MODEL] --config FILE --host H --port P --metrics-port M --tensor-parallel T
mii-server load-balancer --config FILE --host H --port P --replicas dns:///NAME:PORT
mii-server gateway --config FILE --host H --load-balancer HOST:PORT [--rest-port P] [--openai-port P]
mii-server generate "DeepSpeed is" --max-new-tokens 32 [--stream]
mii-server status [NAME]
mii-server stop NAME

The flags of serve() kwargs and of the roles' layouts are derived from the config models' fields
(``config_flags``): every flag's default and help is its field's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from .config import ModelConfig
from .config_flags import add_field_flags, deep_merge, given
from .errors import InvalidRequest, MIIServerError
from .serving.control.deployment import DeploymentConfig
from .serving.control.roles import GatewayRole, LoadBalancerRole, ReplicaRole

# namespaces of the derived flags
MODEL, DEPLOYMENT, ROLE = "model", "deployment", "role"
# the serve flags that predate the derived ones keep working beside them
SERVE_ALIASES = {
    "port_number": ["--port"],
    "enable_restful_api": ["--rest"],
    "restful_api_port": ["--rest-port"],
    "restful_api_host": ["--rest-host"],
    "openai_api_port": ["--openai-port"],
    "openai_api_host": ["--openai-host"],
    "enable_metrics": ["--metrics"],  # and so --no-metrics
    "registry_dir": ["--registry"],
}


def _serve(args: argparse.Namespace) -> int:
    from .serving.control import registry
    from .serving.control.api import prepare
    from .serving.control.supervisor import Supervisor
    from .serving.log_format import setup_logging
    from .serving.security import ADMIN_TOKEN_ENV, new_admin_token

    config = prepare(deployment_config(args))
    setup_logging("supervisor")
    print(
        f"serving {config.model.model_name_or_path or 'the built-in demo model'} as {config.deployment_name}: "
        f"gRPC {config.lb_address}"
        + (f", REST {config.rest_url}" if config.rest_url else "")
        + (f", OpenAI API {config.openai_url}" if config.openai_url else "")
        + "; Ctrl-C stops",
        file=sys.stderr,
    )
    os.environ.setdefault(ADMIN_TOKEN_ENV, new_admin_token())  # the deployment's own: see serving.security
    code = Supervisor(config).run()
    if code != 0:
        record = registry.read(config.deployment_name, config.registry_dir)
        registry.remove(config.deployment_name, config.registry_dir)
        print(f"error: {record.error if record else 'start-up failed'}", file=sys.stderr)
    return code


def _run_role(role_name: str, runner: str, args: argparse.Namespace) -> int:
    """Run one role in this process (as a pod runs it): its config from the flags, then its entry."""
    import importlib

    from .launch.process import raise_open_file_limit
    from .serving.log_format import setup_logging

    role = role_config(args)
    setup_logging(role_name)
    raise_open_file_limit()
    module, _, function = runner.rpartition(".")
    return getattr(importlib.import_module(module, __package__), function)(role)


def _replica(args: argparse.Namespace) -> int:
    return _run_role("replica", ".replica.main.run_replica", args)


def _load_balancer(args: argparse.Namespace) -> int:
    return _run_role("load-balancer", ".serving.routing.main.run_load_balancer", args)


def _gateway(args: argparse.Namespace) -> int:
    return _run_role("gateway", ".serving.frontends.gateway.run_gateway", args)


def deployment_config(args: argparse.Namespace) -> DeploymentConfig:
    """The ``DeploymentConfig`` of parsed arguments: ``--config FILE`` (serve() kwargs) with the model
    and deployment flags on top; the positional MODEL, when given, wins over the file's."""
    from .config import merge_mii_config_dicts

    kwargs = _read_config_file(args.config)
    path, flat = merge_mii_config_dicts(str(kwargs.pop("model_name_or_path", "") or ""), kwargs)
    flags = given(args, DEPLOYMENT)
    if "openai_api_port" in flags:  # naming the OpenAI port starts that server (as --openai-port always did)
        flags.setdefault("enable_openai_api", True)
    flat = deep_merge(deep_merge(flat, given(args, MODEL)), flags)
    return DeploymentConfig.from_kwargs(getattr(args, "model", "") or path, **flat)


def role_config(args: argparse.Namespace) -> ReplicaRole | LoadBalancerRole | GatewayRole:
    """The role config of a role subcommand's parsed arguments: the deployment config, then the layout flags."""
    return args.role.standalone(deployment_config(args), **given(args, ROLE))


def _read_config_file(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise InvalidRequest(f"--config {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise InvalidRequest(f"--config {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"--config {path} must hold a JSON object of serve() kwargs, not {type(data).__name__}")
    return data


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


def _add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default="", help="checkpoint dir or HF hub id; omit for the demo model"
    )


def _add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default="",
        metavar="FILE",
        help="JSON object of serve() kwargs (DeploymentConfig and ModelConfig fields, or MII's nested "
        "model_config); flags override it",
    )


def _add_role_command(
    sub: argparse._SubParsersAction,
    name: str,
    role: type[ReplicaRole | LoadBalancerRole | GatewayRole],
    func: Callable[[argparse.Namespace], int],
    **text: str,
) -> None:
    """``mii-server NAME``: one role on its own; its layout flags from ``role``'s FLAG fields, plus the
    model's flags (and the MODEL argument) for a replica."""
    p = sub.add_parser(name, **text)
    if role is ReplicaRole:
        _add_model_argument(p)
    _add_config_flag(p)
    add_field_flags(p.add_argument_group("layout"), role, ROLE, fields=role.flag_fields())
    if role is ReplicaRole:
        add_field_flags(p.add_argument_group("model (serve() kwargs)"), ModelConfig, MODEL, skip={"model_name_or_path"})
    p.set_defaults(func=func, role=role)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mii-server",
        description="An MII-style model server: serve, query, inspect and stop deployments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="serve a model in the foreground (Ctrl-C stops it)",
        description="Start a deployment (replicas, load balancer, optional REST gateway and OpenAI server) and "
        "supervise it in the foreground until Ctrl-C or `mii-server stop NAME`. Every serve() kwarg is a flag.",
    )
    _add_model_argument(p)
    _add_config_flag(p)
    add_field_flags(
        p.add_argument_group("deployment (serve() kwargs)"), DeploymentConfig, DEPLOYMENT, skip={"model"}, aliases=SERVE_ALIASES
    )
    add_field_flags(p.add_argument_group("model (serve() kwargs)"), ModelConfig, MODEL, skip={"model_name_or_path"})
    p.set_defaults(func=_serve)

    _add_role_command(
        sub,
        "replica",
        ReplicaRole,
        _replica,
        help="run one model replica on its own (as a Kubernetes pod runs it)",
        description="One replica: its gRPC server (health 'mii_server.wire.Generation' SERVING once the model "
        "has loaded, '' while the process serves) and Prometheus /metrics and /health on --metrics-port. "
        "Rank 0 starts the other --tensor-parallel ranks itself. SIGTERM drains and exits 0.",
    )
    _add_role_command(
        sub,
        "load-balancer",
        LoadBalancerRole,
        _load_balancer,
        help="run the load balancer on its own, over replicas by address or by DNS name",
        description="The gRPC load balancer (no torch, no GPU): per-prompt round robin over the replicas whose "
        "health is SERVING, retrying a prompt a replica refused before its first token. dns:///NAME:PORT is "
        "re-resolved while running (resolve_interval_s), so replicas that come and go are followed.",
    )
    _add_role_command(
        sub,
        "gateway",
        GatewayRole,
        _gateway,
        help="run the REST gateway and/or the OpenAI server in front of a load balancer",
        description="HTTP front ends (no torch) calling the load balancer at --load-balancer: --rest-port "
        "starts the REST gateway, --openai-port the OpenAI-compatible server (give one or both). API keys "
        "come from $MII_SERVER_API_KEY or the config's api_key_file, never from a flag.",
    )

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
