"""Command line: `pdserve serve | generate | bench | diagnose | poc | profile | calc | convert | router`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import typing
from typing import Any

from pdserve.api.log_hygiene import install_log_hygiene
from pdserve.config import EngineConfig, shown_default

# pdserve.server.tool_parser_registry's names (not imported: `pdserve router` loads no server code); a test
# keeps the two equal
TOOL_CALL_PARSERS = ["auto", "hermes", "json", "llama3_json", "mistral", "pythonic", "qwen3_coder"]

def add_engine_args(parser: argparse.ArgumentParser, repeat_model: bool = False) -> None:
    """One flag per EngineConfig field, so every engine option is on every command line; its help is the field's.
    `repeat_model` (serve): `--model` may be given more than once, each `NAME=PATH` or a path."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        shown = shown_default(f)
        text = f.metadata["help"] + (f" (default: {shown})" if shown != "–" else "")
        text = text.replace("%", "%%")  # argparse %-formats help strings
        if f.name == "model" and repeat_model:
            parser.add_argument(flag, action="append", default=None, help=text + "; repeat it to serve several "
                                "models, each `NAME=PATH` or a path (the first is the default model)")
        elif hints[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            conv: Any = int if "int" in str(hints[f.name]) and "str" not in str(hints[f.name]) else str  # sizes
            if "float" in str(hints[f.name]):
                conv = float
            parser.add_argument(flag, type=conv, default=default, help=text)
    parser.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                        help="same as --no-enable-chunked-prefill")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _print_roofline(meter: Any) -> None:
    """Live roofline of the run: per step kind, achieved FLOP/s and B/s against this machine's peaks, and where
    those peaks came from (when and how they were measured, cached or not)."""
    dev = meter.device
    if dev is not None:
        print(f"# roofline peaks: {meter.peak_flops / 1e9:.1f} GFLOP/s, {dev.mem_bandwidth / 1e9:.1f} GB/s "
              f"({dev.name})", file=sys.stderr)
        print(f"# roofline peaks from: {dev.describe_source()}", file=sys.stderr)
    for kind, row in meter.summary().items():
        util = (f" MFU {row['mfu']:.1%}, MBU {row['mbu']:.1%}, nearer the {row['nearer_roof']} roof"
                if "mfu" in row else "")
        print(f"# roofline {kind}: {row['steps']} steps, {row['seconds']:.2f}s, "
              f"{row['flops_per_s'] / 1e9:.2f} GFLOP/s, {row['bytes_per_s'] / 1e9:.2f} GB/s,{util}", file=sys.stderr)
    print(json.dumps({"roofline": meter.summary()}), file=sys.stderr)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams
    from pdserve.server.chat_template import render_chat

    cfg = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(cfg))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed_sample,
                            max_tokens=args.max_tokens, stop=args.stop or [], ignore_eos=args.ignore_eos)
    prompts = [render_chat(llm.get_tokenizer(), [{"role": "user", "content": p}]) if args.chat else p
               for p in args.prompt]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    for out in outs:
        m = out.metrics
        comp = out.outputs[0]
        print(comp.text)
        timing = {k: (round(v * 1000, 2) if isinstance(v, float) else v) for k, v in m.as_dict().items()}
        print(json.dumps({"request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids),
                          "output_tokens": len(comp.token_ids), "cached_tokens": out.num_cached_tokens,
                          "finish_reason": comp.finish_reason, "times_ms": timing}, ensure_ascii=False),
              file=sys.stderr)
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"# {len(outs)} requests, {total} output tokens in {wall:.2f}s ({total / wall:.1f} tok/s)", file=sys.stderr)
    _print_roofline(llm.engine.roofline)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from pdserve.config import parse_dtype
    from pdserve.model.convert import convert_gguf_to_hf
    from pdserve.model.loader import resolve_model_path

    src = resolve_model_path(args.gguf)
    convert_gguf_to_hf(src, args.out_dir, dtype=parse_dtype(args.dtype))
    print(f"wrote {args.out_dir} from {src}")
    return 0


def _serve_models(args: argparse.Namespace) -> tuple[list[Any], dict[str, str]]:
    """The models `serve` starts with (ModelSpecs, first = default) and their aliases."""
    from pdserve.server.model_spec import ModelSpec, check_names, load_models_config, parse_model_arg

    specs: list[ModelSpec] = []
    aliases: dict[str, str] = {}
    if args.models_config:
        mc = load_models_config(args.models_config)
        specs, aliases = mc.models, mc.aliases
    given = args.model or []
    if len(given) == 1 and not specs and "=" not in given[0]:  # one model, named as before
        specs = [ModelSpec(args.served_model_name or given[0], given[0])]
    else:
        specs += [parse_model_arg(m) for m in given]
    if not specs:
        specs = [ModelSpec(args.served_model_name or "smollm2-135m")]
    check_names(specs, aliases)
    return specs, aliases


def _cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.api.http_protocol import HeadLimits
    from pdserve.profiler.traces import ProfilerLimits
    from pdserve.server.allocator import tune_allocator
    from pdserve.server.app import ServerConfig, create_registry_app, new_registry, run_server

    tune_allocator()  # before the first load: freed models go back to the OS (allocator.py)
    specs, aliases = _serve_models(args)
    base = dataclasses.replace(engine_config_from_args(args), model=None)
    if args.lora_modules:
        base = dataclasses.replace(base, enable_lora=True)
    server_cfg = ServerConfig(served_model_name=specs[0].name, api_key=args.api_key, api_key_file=args.api_key_file,
                              allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                              allowed_headers=args.allowed_headers,
                              max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
                              body_read_timeout=args.body_read_timeout, max_n=args.max_n,
                              head_limits=HeadLimits(args.header_read_timeout, args.max_header_bytes),
                              max_sequences_per_request=args.max_sequences_per_request,
                              max_prompt_chars=args.max_prompt_chars,
                              max_prompt_logprob_entries=args.max_prompt_logprob_entries,
                              prefix_cache_isolation=args.prefix_cache_isolation,
                              tool_call_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser,
                              default_chat_template_kwargs=args.default_chat_template_kwargs,
                              explain_itl_threshold=args.explain_itl_threshold,
                              debug_requests_history=args.debug_requests_history,
                              profiler_dir=args.profiler_dir, profiler_limits=ProfilerLimits(
                                  args.profiler_max_duration, args.profiler_max_traces,
                                  args.profiler_max_trace_bytes), otlp_traces_endpoint=args.otlp_traces_endpoint,
                              admin_api_key=args.admin_api_key, audit_log=args.audit_log,
                              tenant_label_limit=args.tenant_label_limit, metrics_public=args.metrics_public,
                              responses_store_max_entries=args.responses_store_max_entries,
                              responses_store_max_bytes=args.responses_store_max_bytes,
                              responses_store_ttl=args.responses_store_ttl)
    server_cfg.key_ring()  # a bad --api-key-file fails before any model loads
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    registry = new_registry(base, server_cfg)
    for spec in specs:  # each on its own engine thread; peaks resolved there (`auto` may measure)
        served, old = registry.begin_load(spec)
        registry.finish_load(served, old, "load", None)
        if served.state != "loaded":
            raise ValueError(f"model {spec.name!r} failed to load: {served.error}")
    for alias, target in aliases.items():
        registry.set_alias(alias, target, None, None)
    _load_lora_modules(registry, args.lora_modules or [])
    app = create_registry_app(registry, server_cfg)
    # SIGTERM/SIGINT: /health turns 503 "draining", open requests finish for up to the grace period, then the
    # streams still open end with an error event and the app's shutdown aborts what is left and frees its blocks.
    run_server(app, args.host, args.port, args.log_level, args.shutdown_grace, server_cfg.head_limits,
               args.ssl_keyfile, args.ssl_certfile)
    return 0


def _add_serve_bounds(srv: Any) -> None:
    """`serve` options that bound what one client may hold: request heads, prompt logprobs."""
    srv.add_argument("--header-read-timeout", type=float, default=10.0,
                     help="seconds a client has to send a request's line and headers, from connecting or from "
                     "the previous response (408 and closed after: slow-header clients cannot hold connections)")
    srv.add_argument("--max-header-bytes", type=int, default=32 * 1024,
                     help="largest request line + headers in bytes; over it, or over 100 header fields: 431")
    srv.add_argument("--max-prompt-logprob-entries", type=int, default=2**17,
                     help="largest prompt tokens x (prompt_logprobs + 1) of one request, its sequences together "
                     "(400 above): bounds the reply's size and what building it allocates")


def _add_tool_parsers(sub: Any) -> None:
    """The measuring and deployment commands (imported here: `pdserve serve` does not need them)."""
    from pdserve.bench import add_bench_parser
    from pdserve.bench.diagnose import add_diagnose_parser
    from pdserve.deploy.ray.app import add_ray_serve_parser
    from pdserve.poc import add_poc_parser
    from pdserve.profiler.cli import add_profile_parser
    from pdserve.roofline import add_calc_parser
    from pdserve.router.app import add_router_parser

    add_bench_parser(sub)
    add_diagnose_parser(sub)
    add_calc_parser(sub)
    add_poc_parser(sub)
    add_router_parser(sub)
    add_ray_serve_parser(sub, serve_option_names)
    add_profile_parser(sub, add_engine_args, engine_config_from_args)


def serve_option_names() -> set[str]:
    """The option names (argparse dests) of `pdserve serve`."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest for a in sub.choices["serve"]._actions if a.dest != "help"}


def _add_access_args(srv: argparse.ArgumentParser) -> None:
    """`serve`'s keys and the audit log."""
    srv.add_argument("--api-key", action="append", default=None, help="require 'Authorization: Bearer KEY' on "
                     "/v1, /tokenize, /detokenize, /debug, the API docs, /metrics and /version (/health stays open); "
                     "repeat for several keys, each named key-<8 hex of its SHA-256>")
    srv.add_argument("--api-key-file", default=None, help="named keys with optional limits, one `NAME:KEY [rpm=N] "
                     "[tpm=N] [concurrent=N]` a line, or JSON (README: keys and quotas); the name is the tenant")
    srv.add_argument("--metrics-public", action="store_true", help="serve /metrics and /version without the API "
                     "key (a Prometheus that cannot send it); they show tenant names, load and versions")
    srv.add_argument("--admin-api-key", default=None, help="enable the admin API (/admin: load, unload, sleep, "
                     "wake, aliases, audit) behind 'Authorization: Bearer KEY' (off when unset: /admin is 404)")
    srv.add_argument("--audit-log", default=None, help="append-only JSONL of model lifecycle changes (default: "
                     "<cache dir>/audit.jsonl with --admin-api-key, else kept in memory; `off`: no file)")


def _list_arg(text: str) -> list[str]:
    """A list option: a JSON list (vLLM's form, '["*"]') or comma-separated words."""
    if text.lstrip().startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [w.strip() for w in text.split(",") if w.strip()]


def _add_web_args(srv: argparse.ArgumentParser) -> None:
    """CORS and TLS, with vLLM's flag names."""
    srv.add_argument("--allowed-origins", type=_list_arg, default=None, help="CORS: origins browsers may call "
                     "from ('[\"*\"]' or a,b; default: no CORS headers)")
    srv.add_argument("--allowed-methods", type=_list_arg, default=["*"], help="CORS: allowed methods")
    srv.add_argument("--allowed-headers", type=_list_arg, default=["*"], help="CORS: allowed request headers")
    srv.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    srv.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")


def _add_responses_args(srv: argparse.ArgumentParser) -> None:
    """The bounds of the stored responses of POST /v1/responses (server/response_store.py)."""
    srv.add_argument("--responses-store-max-entries", type=int, default=1024,
                     help="POST /v1/responses: responses kept for previous_response_id and GET /v1/responses/{id} "
                     "(the oldest dropped first; 0: none kept)")
    srv.add_argument("--responses-store-max-bytes", type=int, default=64 * 2**20,
                     help="the stored responses' JSON, in all (the oldest dropped first)")
    srv.add_argument("--responses-store-ttl", type=float, default=3600.0,
                     help="seconds a stored response is kept")


def _template_kwargs_arg(text: str) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object of template variables, none of those the renderer sets."""
    from pdserve.errors import RequestRejected
    from pdserve.server.chat_template import check_template_kwargs

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    try:
        check_template_kwargs(value)
    except RequestRejected as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def _add_chat_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--default-chat-template-kwargs", type=_template_kwargs_arg, default=None,
                     help='template variables every chat request gets, under its own chat_template_kwargs (e.g. '
                     '\'{"enable_thinking": false}\' for Qwen3); a request\'s value for the same name wins')


def _add_api_args(srv: argparse.ArgumentParser) -> None:
    """What the API serves besides the models: stored responses, LoRA adapters."""
    _add_responses_args(srv)
    srv.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories: adapter_config.json + adapter_model.safetensors) served "
                     "on the default model, each as model NAME (implies --enable-lora; more at run time with the "
                     "admin API's POST /v1/load_lora_adapter)")


def _load_lora_modules(registry: Any, modules: list[str]) -> None:
    """`serve --lora-modules`: each NAME=PATH onto the default model before the server starts (ValueError)."""
    import asyncio

    from pdserve.api.errors import APIError
    from pdserve.server.lora_admin import load_adapter
    from pdserve.server.model_spec import name_error

    for module in modules:
        name, sep, path = module.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {module!r}")
        if (error := name_error(name, "LoRA adapter name")) is not None:
            raise ValueError(f"--lora-modules {module!r}: {error}")
        try:
            asyncio.run(load_adapter(registry, name, path, None, None))
        except APIError as e:
            raise ValueError(f"--lora-modules {module!r}: {e.message}") from e


def _add_introspection_args(srv: argparse.ArgumentParser) -> None:
    """Explanations, profiles and traces of served requests."""
    srv.add_argument("--explain-itl-threshold", default="2x",
                     help="a stall explained in GET /debug/requests/{id} and the request log: an inter-token gap "
                     "above Nx the request's median ITL, or above a time (50ms, 0.05)")
    srv.add_argument("--debug-requests-history", type=int, default=1000,
                     help="finished requests whose explanations GET /debug/requests/{id} keeps (0: none)")
    srv.add_argument("--profiler-dir", default=None,
                     help="where /start_profile writes traces (default: a new temporary directory)")
    srv.add_argument("--profiler-max-duration", type=float, default=300.0,
                     help="seconds a profile may run; then it stops by itself (/stop_profile returns its report)")
    srv.add_argument("--profiler-max-traces", type=int, default=10,
                     help="trace files kept in the profiler directory; older ones are deleted")
    srv.add_argument("--profiler-max-trace-bytes", type=int, default=512 * 2**20,
                     help="total bytes of the kept trace files; older ones are deleted (a larger new one is not kept)")
    srv.add_argument("--otlp-traces-endpoint", default=None,
                     help="OpenTelemetry collector URL (OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces): one trace "
                     "per request; needs pip install pdserve[otel]")


CORE_COMMANDS = ("generate", "serve", "convert")  # built in this module; the others come from _add_tool_parsers


def build_parser(tools: bool = True) -> argparse.ArgumentParser:
    """The whole command line; with tools=False only CORE_COMMANDS (what `pdserve serve` parses: the tool commands'
    modules cost ~0.3 s of imports at every server start)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    gen = sub.add_parser("generate", help="run prompts offline and print text and phase timings")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(srv, repeat_model=True)
    srv.add_argument("--role", dest="kv_role", choices=["both", "prefill", "decode"], default="both",
                     help="same as --kv-role: PD disaggregation role (see `pdserve router`)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="model id in the API (default: the model name)")
    srv.add_argument("--models-config", default=None, help="YAML or JSON file of models to serve: `models: [{name, "
                     "path, version, options: {engine options}}]` and `aliases: {alias: name}` (with --model: "
                     "those are added after these)")
    _add_access_args(srv)
    _add_web_args(srv)
    srv.add_argument("--tenant-label-limit", type=int, default=16, help="distinct tenants (X-Tenant header, else "
                     "the body's user) labelled in the per-tenant metrics; later ones are counted as `other`")
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="answer 429 when this many requests wait for their first step beyond the free seats "
                          "of the running batch (--max-num-seqs)")
    srv.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="reject larger request bodies (413)")
    srv.add_argument("--body-read-timeout", type=float, default=30.0,
                     help="seconds a client has to send its whole request body (408 after)")
    srv.add_argument("--max-n", type=int, default=128, help="largest n (and best_of) of one request (400 above)")
    srv.add_argument("--max-sequences-per-request", type=int, default=None,
                     help="largest prompts x n of one request (400 above; default: --max-waiting-requests)")
    srv.add_argument("--max-prompt-chars", type=int, default=None,
                     help="longest text prompt or conversation in characters, checked before tokenizing (400 "
                     "above; default: 16 x max model length)")
    srv.add_argument("--prefix-cache-isolation", choices=["none", "tenant"], default="none",
                     help="tenant: prefix-cache blocks are shared only within a tenant (X-Tenant header, else "
                     "the body's user), combined with the body's cache_salt")
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="hermes",
                     help="how chat output becomes tool calls: hermes (<tool_call>{json}</tool_call> blocks), json "
                     "(the whole output is a call object or a list of them), llama3_json, mistral, pythonic, "
                     "qwen3_coder, or auto (read off the chat template; README, tool calling)")
    srv.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                     help="reasoning models: the reply's <think> ... </think> text goes to the message's "
                     "reasoning_content (streamed: delta.reasoning_content), the rest to content; qwen3: only an "
                     "explicit <think> block, deepseek_r1: everything before </think> (its template opens <think>)")
    _add_api_args(srv)
    _add_chat_args(srv)
    srv.add_argument("--shutdown-grace", type=float, default=30.0,
                     help="seconds open requests may run after SIGTERM (while /health answers 503 draining) "
                     "before the rest end with an error")
    _add_introspection_args(srv)
    srv.add_argument("--log-level", default="info")
    _add_serve_bounds(srv)
    srv.set_defaults(func=_cmd_serve)

    if tools:
        _add_tool_parsers(sub)

    conv = sub.add_parser("convert", help="write a GGUF model as a Hugging Face safetensors directory")
    conv.add_argument("gguf", help="a .gguf file or smollm2-135m")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="bfloat16")
    conv.set_defaults(func=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call drowns bench output
    install_log_hygiene()  # no client-made line break splits a line (uvicorn's loggers get it once it set them up)
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(tools=command not in CORE_COMMANDS).parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
