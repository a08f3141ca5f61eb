"""Launch arguments of ``python -m engine.launch_server``, with SGLang's flag names and defaults.

Follows ``sglang.srt.server_args.ServerArgs``: every flag keeps its upstream spelling and its ``dest`` is the
upstream attribute name, so ``/server_info`` reports the same keys as an SGLang worker. Only the flags this
engine implements exist; any other flag is a start-up error that names it and the closest real flags, or
says that the upstream flag is not supported by KVFleet (:mod:`engine.server.upstream_flags`). KVFleet adds
``--device cpu|cuda`` (upstream also has ``--device``; here it picks the torch device the model and the L1
pool live on). This module imports no torch, so flags are checked before the model stack loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine import unknown_flags
from engine.cache.config import (
    EVICTION_POLICIES,
    IO_BACKENDS,
    MEM_LAYOUTS,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    parse_extra_config,
)
from engine.cache.kv_dtypes import KV_CACHE_DTYPES
from engine.cache.storage.extra_keys import check_extra_keys
from engine.cache.storage.registry import UNAVAILABLE, registered_backends
from engine.grammar.tool_parsers import TOOL_CALL_PARSERS
from engine.model.config import QUANTIZATIONS
from engine.server import upstream_flags
from engine.sizing.tiers import CPU_DEFAULT_MAX_TOTAL_TOKENS
from kernels import unavailable_reason

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")  # registered in engine/model/attention
GRAMMAR_BACKENDS = ("xgrammar", "none")  # engine/grammar/backend.py

# Default L1 size on CPU when neither --max-total-tokens nor a GPU memory budget applies (tokens).


class ArgumentError(ValueError):
    """A launch argument is unknown or has a bad value; the message names the flag."""


SECRET_ARGS = ("api_key", "admin_api_key")
"""Args never echoed: ``to_dict`` masks them and ``repr`` leaves them out."""
SECRET_ENV = {"api_key": "KVFLEET_API_KEY", "admin_api_key": "KVFLEET_ADMIN_API_KEY"}
"""Where a secret comes from when its flag is not given (kept off the command line, so out of ``ps``): the
``--<name>-file`` flag, else this environment variable. The upstream flags still work."""


@dataclass
class ServerArgs:
    """Parsed launch arguments; attribute names are SGLang's ``ServerArgs`` field names."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    torchao_config: str = ""
    served_model_name: str | None = None
    context_length: int | None = None
    random_seed: int | None = None
    log_level: str = "info"
    page_size: int = 1
    attention_backend: str = "torch"
    disable_fused_decode: bool = False
    disable_cpu_quant_kernels: bool = False
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    watchdog_timeout: float = 300.0
    api_key: str | None = dataclasses.field(default=None, repr=False)
    admin_api_key: str | None = dataclasses.field(default=None, repr=False)
    tenant_keys_file: str | None = None
    enable_metrics: bool = False
    enable_cache_report: bool = False
    record_trace: bool = False
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "layer_first"
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: str | None = None
    radix_eviction_policy: str = "lru"
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_ib_device: str | None = None
    disaggregation_decode_enable_offload_kvcache: bool = False
    num_reserved_decode_tokens: int = 512
    enable_pd_role_switch: bool = False
    base_gpu_id: int = 0
    limit_mm_data_per_request: str | None = None
    max_image_pixels: int = 4096 * 4096
    allowed_local_media_path: str | None = None
    mm_embedding_cache_size: int = 256
    encoder_only: bool = False
    grpc_mode: bool = False
    disable_kv_events: bool = False
    smg_http_sidecar_port: int | None = None
    language_only: bool = False
    encoder_urls: list[str] = dataclasses.field(default_factory=list)
    encoder_transfer_backend: str = "zmq_to_scheduler"
    enable_mm_global_cache: bool = False
    grammar_backend: str = "xgrammar"
    tool_call_parser: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    ep_size: int = 1
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0

    @property
    def max_images_per_request(self) -> int:
        """``--limit-mm-data-per-request``'s ``image`` entry (default 8)."""
        return int(json.loads(self.limit_mm_data_per_request or "{}").get("image", 8))

    def to_dict(self) -> dict:
        """Every launch arg by its SGLang dest name (for ``/server_info``); keys read ``"***"`` when set."""
        out = dataclasses.asdict(self)
        for name in SECRET_ARGS:
            out[name] = "***" if out[name] else None
        return out

    @property
    def model_name(self) -> str:
        """Name served to clients: ``--served-model-name`` or the model path."""
        return self.served_model_name or self.model_path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse calls this for unknown flags and bad values
        raise ArgumentError(message)


def _storage_backend(name: str) -> str:
    """An upstream backend KVFleet lacks (``hf3fs``, ...) is refused saying why; other names go on to the
    choices check."""
    if name in UNAVAILABLE:
        raise argparse.ArgumentTypeError(f"{name}: {UNAVAILABLE[name]}")
    return name


def _positive_int(flag: str):
    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be > 0, got {value}")
        return value

    return conv


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mem-fraction-static must be a number, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"--mem-fraction-static must be in (0, 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every implemented SGLang flag (``allow_abbrev`` off, as upstream)."""
    p = _Parser(prog="python -m engine.launch_server", allow_abbrev=False)
    a = p.add_argument
    a("--model-path", "--model", dest="model_path", required=True, help="HF folder, .gguf file or 'smollm2'")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--device", choices=("cpu", "cuda"), default="cpu")
    a(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto: on cpu a Q4_1 GGUF computes on its blocks as stored (bfloat16 + int4wo-32), other models "
        "in float32; bfloat16 on cuda",
    )
    a(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="how L1/L2/L3 and the PD transfer store K/V: auto (the --dtype), bfloat16, fp8_e4m3/fp8_e5m2 "
        "(1 byte, no scale) or int8 (1 byte + a bfloat16 scale per token and KV head); read dequantized",
    )
    a(
        "--torchao-config",
        choices=("", *QUANTIZATIONS),
        default="",
        help="int8wo: int8 weight-only linear layers; int4wo-<group>: int4 groupwise (cpu, --dtype bfloat16; "
        "the group must divide the model's in_features); no torchao needed; on the cpu each call takes "
        "KVFleet's or torch's kernels by its rows (--disable-cpu-quant-kernels)",
    )
    a("--served-model-name", default=None)
    a("--context-length", type=_positive_int("--context-length"), default=None)
    a("--random-seed", type=int, default=None)
    a("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    a("--page-size", type=_positive_int("--page-size"), default=1)
    a(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="torch",
        help="torch (reference) or triton (Triton kernels: --device cuda, or TRITON_INTERPRET=1 on cpu)",
    )
    a(
        "--disable-fused-decode",
        action="store_true",
        help="decode on the Python path: by default a decode-only batch (torch backend, cpu, float32 or "
        "bfloat16) runs every layer in one C++ call, float32 between the matmuls (built once per venv, "
        "skipped with a warning where it cannot be built)",
    )
    a(
        "--disable-cpu-quant-kernels",
        action="store_true",
        help="--torchao-config int8wo/int4wo layers on torch's weight-only kernels only: by default decode "
        "batches take KVFleet's AVX512-VNNI integer kernels and prefill chunks a dense bfloat16 matmul "
        "(AVX512-BF16; a bfloat16 copy of the weights, 2 bytes each) where the CPU has them",
    )
    a("--mem-fraction-static", type=_fraction, default=None, help="share of free GPU memory for KV (cuda)")
    a(
        "--max-total-tokens",
        type=_positive_int("--max-total-tokens"),
        default=None,
        help=f"L1 KV pool size in tokens (cpu default {CPU_DEFAULT_MAX_TOTAL_TOKENS})",
    )
    a("--max-running-requests", type=_positive_int("--max-running-requests"), default=None)
    a(
        "--max-queued-requests",
        type=_positive_int("--max-queued-requests"),
        default=None,
        help="refuse a request with 503 while this many wait (default unbounded; ignored on PD workers)",
    )
    a("--max-prefill-tokens", type=_positive_int("--max-prefill-tokens"), default=16384)
    a("--chunked-prefill-size", type=int, default=None, help="tokens per prefill chunk; -1 disables chunking")
    a("--watchdog-timeout", type=float, default=300.0, help="seconds a forward may take before unhealthy")
    a("--api-key", default=None, help="prefer --api-key-file or $KVFLEET_API_KEY (kept out of ps)")
    a("--api-key-file", default=None, help="read the API key from this file")
    a("--admin-api-key", default=None, help="prefer --admin-api-key-file or $KVFLEET_ADMIN_API_KEY")
    a("--admin-api-key-file", default=None, help="read the admin API key from this file")
    a(
        "--tenant-keys-file",
        default=None,
        help="KVFleet: JSON of tenants and their API keys; each tenant's requests get a cache salt of their "
        "own (tenants share no cached KV), an optional cap on requests in flight (docs/operations.md)",
    )
    a("--enable-metrics", action="store_true")
    a("--enable-cache-report", action="store_true")
    a("--record-trace", action="store_true", help="KVFleet: keep a Mooncake-format trace at /recorded_trace")
    a("--enable-hierarchical-cache", action="store_true")
    a("--hicache-ratio", type=float, default=2.0)
    a("--hicache-size", type=int, default=0, help="host pool size in GB; overrides --hicache-ratio when > 0")
    a("--hicache-write-policy", choices=WRITE_POLICIES, default="write_through")
    a(
        "--hicache-io-backend",
        choices=IO_BACKENDS,
        default="kernel",
        help="kernel: Triton copies (cuda, or cpu with TRITON_INTERPRET=1); elsewhere corrected to direct",
    )
    a("--hicache-mem-layout", choices=MEM_LAYOUTS, default="layer_first")
    a(
        "--hicache-storage-backend",
        type=_storage_backend,
        choices=registered_backends(),
        default=None,
        help="L3: file (page files in file_path), mooncake (a Mooncake store), nixl (the file backend's "
        "page files through NIXL's POSIX plugin; directory: file_path or "
        "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR), aibrix (AIBrix KVCache's store), lmcache (an "
        "lmcache_server named by lmcache_url), dynamic (a class named in the extra config)",
    )
    a("--hicache-storage-prefetch-policy", choices=PREFETCH_POLICIES, default="best_effort")
    a("--hicache-storage-backend-extra-config", default=None, help="JSON object or @file (.json/.toml/.yaml)")
    a("--radix-eviction-policy", choices=EVICTION_POLICIES, default="lru")
    a("--base-gpu-id", type=int, default=0, help="the GPU of rank 0 (cuda); rank r uses base + r")
    a(
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        dest="tp_size",
        type=_positive_int("--tp-size"),
        default=1,
        help="tensor parallelism: one scheduler process per rank, the model's heads split over them",
    )
    a(
        "--dp-size",
        "--dp",
        "--data-parallel-size",
        dest="dp_size",
        type=_positive_int("--dp-size"),
        default=1,
        help="attention data parallelism (with --enable-dp-attention): DP ranks in this worker, each with "
        "its own scheduler, radix tree, L1 and L2; must divide --tp-size",
    )
    a(
        "--enable-dp-attention",
        action="store_true",
        help="run --dp-size attention data-parallel ranks in this worker (requests go to the rank holding "
        "their longest cached prefix)",
    )
    a(
        "--ep-size",
        "--ep",
        "--expert-parallel-size",
        dest="ep_size",
        type=_positive_int("--ep-size"),
        default=1,
        help="expert parallelism: only 1 (MoE experts are split by --tp-size instead)",
    )
    a(
        "--dist-init-addr",
        default=None,
        help="host:port where the ranks meet (torch.distributed); default a free port on 127.0.0.1",
    )
    a("--nnodes", type=int, default=1, help="1 only: every rank of a KVFleet worker runs on this host")
    a("--node-rank", type=int, default=0, help="0 only (see --nnodes)")
    a("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null")
    a(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="prefill: the bootstrap server's port (0: a free one, reported by /server_info)",
    )
    a("--disaggregation-transfer-backend", choices=("mooncake", "fake", "nixl"), default="mooncake")
    a("--disaggregation-ib-device", default=None, help="RDMA device(s); unused on TCP (logged)")
    a(
        "--disaggregation-decode-enable-offload-kvcache",
        action="store_true",
        help="decode: cache each finished PD request (prompt + answer) so HiCache backs it up to L3",
    )
    a(
        "--num-reserved-decode-tokens",
        type=int,
        default=512,
        help="upstream's decode headroom; D here reserves prompt + max_new_tokens, so no request runs out",
    )
    a("--enable-pd-role-switch", action="store_true", help="POST /pd_role_switch flips an idle P/D worker")
    a(
        "--grammar-backend",
        choices=GRAMMAR_BACKENDS,
        default="xgrammar",
        help="constrained decoding (json_schema, regex, ebnf, structural_tag, response_format, tool_choice); "
        "none: such requests are a 400",
    )
    a(
        "--tool-call-parser",
        type=_tool_call_parser,
        default=None,
        help=f"how tool calls are found in the model's text: {', '.join(TOOL_CALL_PARSERS)} "
        "(default: the one the model's chat template implies)",
    )
    _vlm_flags(a)
    return p


def _tool_call_parser(name: str) -> str:
    if name in TOOL_CALL_PARSERS:
        return name
    close = difflib.get_close_matches(name, list(TOOL_CALL_PARSERS), n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise argparse.ArgumentTypeError(f"unknown parser {name!r} (one of {', '.join(TOOL_CALL_PARSERS)}){hint}")


ENCODER_TRANSFER_BACKENDS = ("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake")


def _vlm_flags(a) -> None:
    """Vision-language inputs and EPD (encoder / language-only workers), SGLang's names."""
    a(
        "--limit-mm-data-per-request",
        default=None,
        help='JSON, e.g. {"image": 4}: images per request (default 8)',
    )
    a("--max-image-pixels", type=_positive_int("--max-image-pixels"), default=4096 * 4096)
    a("--allowed-local-media-path", default=None, help="KVFleet: image_url may name a local file under DIR")
    a(
        "--mm-embedding-cache-size",
        type=int,
        default=256,
        help="KVFleet: image embeddings kept by content hash",
    )
    a("--encoder-only", action="store_true", help="EPD: run the vision tower + projector only, serve /encode")
    a(
        "--grpc-mode",
        "--smg-grpc-mode",
        dest="grpc_mode",
        action="store_true",
        help="serve smg's gRPC SglangScheduler service on --port instead of HTTP (docs/architecture.md)",
    )
    a(
        "--smg-http-sidecar-port",
        type=int,
        default=None,
        help="with --grpc-mode: the port of the HTTP routes (health, metrics, admin; default --port + 1)",
    )
    a(
        "--disable-kv-events",
        action="store_true",
        help="KVFleet: with --grpc-mode, publish no KV events (SubscribeKvEvents answers UNIMPLEMENTED, so "
        "smg routes by its approximate tree)",
    )
    a("--language-only", action="store_true", help="EPD: no vision tower; embeddings from --encoder-urls")
    a("--encoder-urls", nargs="+", default=[], help="EPD: encoder workers a language-only worker calls")
    a("--encoder-transfer-backend", choices=ENCODER_TRANSFER_BACKENDS, default="zmq_to_scheduler")
    a("--enable-mm-global-cache", action="store_true", help="EPD encoder: image embeddings cache in Mooncake")


def parse_args(argv: list[str] | None) -> ServerArgs:
    """Parse and validate ``argv``; raises ``ArgumentError`` naming the flag on any problem."""
    values = vars(unknown_flags.parse_args(build_parser(), argv, upstream_flags.explain))
    for name, env_var in SECRET_ENV.items():
        path = values.pop(f"{name}_file")
        if values[name] is None and path:
            try:
                values[name] = Path(path).read_text().strip() or None
            except OSError as exc:
                flag = "--" + name.replace("_", "-") + "-file"
                raise ArgumentError(f"{flag} {path}: {exc.strerror}") from None
        if values[name] is None:
            values[name] = os.environ.get(env_var) or None
    args = ServerArgs(**values)
    _validate(args)
    return args


def _validate(args: ServerArgs) -> None:
    if args.hicache_ratio <= 1.0 and args.hicache_size <= 0:  # the cache's config refuses it, hicache or not
        raise ArgumentError(
            f"--hicache-ratio must be > 1 (host pool larger than L1), got {args.hicache_ratio}"
        )
    if args.hicache_size < 0:
        raise ArgumentError(f"--hicache-size must be >= 0, got {args.hicache_size}")
    if args.chunked_prefill_size is not None and (
        args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1
    ):
        raise ArgumentError(f"--chunked-prefill-size must be > 0 or -1, got {args.chunked_prefill_size}")
    if (
        args.chunked_prefill_size
        and args.chunked_prefill_size > 0
        and args.chunked_prefill_size % args.page_size
    ):
        raise ArgumentError(
            f"--chunked-prefill-size {args.chunked_prefill_size} must be a multiple of "
            f"--page-size {args.page_size}"
        )
    if args.attention_backend == "triton" and (reason := unavailable_reason(args.device)):
        raise ArgumentError(f"--attention-backend triton: {reason}")
    if args.torchao_config.startswith("int4wo") and (
        args.device != "cpu" or args.dtype not in ("bfloat16", "auto")
    ):
        raise ArgumentError(
            f"--torchao-config {args.torchao_config} needs --device cpu and --dtype bfloat16 or auto (the "
            f"int4 CPU kernel; its float32 path is 50-100x slower), got --device {args.device} "
            f"--dtype {args.dtype}"
        )
    if not 0 < args.port < 65536:
        raise ArgumentError(f"--port must be in 1..65535, got {args.port}")
    if args.watchdog_timeout <= 0:
        raise ArgumentError(f"--watchdog-timeout must be > 0, got {args.watchdog_timeout}")
    _validate_pd(args)
    _validate_vlm(args)
    _validate_grpc(args)
    _validate_tp(args)
    if args.hicache_storage_backend and not args.enable_hierarchical_cache:
        raise ArgumentError("--hicache-storage-backend needs --enable-hierarchical-cache")
    if args.hicache_storage_backend_extra_config is not None:
        try:  # the backend's keys too, before the model loads (engine/cache/storage/extra_keys.py)
            extra = parse_extra_config(args.hicache_storage_backend_extra_config)
            check_extra_keys(args.hicache_storage_backend, extra)
        except (ValueError, OSError) as exc:
            raise ArgumentError(f"--hicache-storage-backend-extra-config: {exc}") from None
    if args.max_total_tokens is not None and args.max_total_tokens % args.page_size:
        raise ArgumentError(
            f"--max-total-tokens {args.max_total_tokens} must be a multiple of --page-size {args.page_size}"
        )


def _validate_tp(args: ServerArgs) -> None:
    if args.nnodes != 1:
        raise ArgumentError(
            f"--nnodes {args.nnodes}: not supported by KVFleet: every rank of a worker runs on one host "
            "(--tp-size ranks as local processes); use --nnodes 1"
        )
    if args.node_rank != 0:
        raise ArgumentError(
            f"--node-rank {args.node_rank}: not supported by KVFleet (one node: --node-rank 0)"
        )
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ArgumentError(f"--dist-init-addr must be host:port, got {args.dist_init_addr!r}")
    if args.ep_size > 1:
        raise ArgumentError(
            f"--ep-size {args.ep_size}: expert parallelism is not built in KVFleet; MoE experts are split "
            "by --tp-size (every rank computes its share of each expert's intermediate columns): use "
            "--ep-size 1"
        )
    if args.tp_size > 1 and (args.encoder_only or args.language_only):
        flag = "--encoder-only" if args.encoder_only else "--language-only"
        raise ArgumentError(f"--tp-size {args.tp_size} with {flag}: EPD workers run with --tp-size 1")
    _validate_dp(args)


def _validate_dp(args: ServerArgs) -> None:
    """``--dp-size`` / ``--enable-dp-attention`` (docs/architecture.md, DP attention): N > 1 needs the flag
    (plain data parallelism is several workers behind the router), must divide ``--tp-size`` (upstream's
    rule) and, in this release, equal it (one attention rank per DP rank); aggregated text workers only."""
    dp, tp = args.dp_size, args.tp_size
    if args.enable_dp_attention and dp == 1:
        fix = f"add --dp-size {tp}" if tp > 1 else "use --tp-size N --dp-size N (N >= 2)"
        raise ArgumentError(
            f"--enable-dp-attention needs --dp-size > 1 (the number of attention DP ranks); {fix}, or leave "
            "out --enable-dp-attention"
        )
    if dp == 1:
        return
    if not args.enable_dp_attention:
        with_tp = f" --tp-size {dp}" if tp != dp else ""
        raise ArgumentError(
            f"--dp-size {dp} without --enable-dp-attention: plain data parallelism is not built into a "
            "worker (run several workers behind the router, cache-aware routing); did you mean "
            f"--tp-size {dp} (tensor parallelism over {dp} GPUs) or --enable-dp-attention{with_tp} "
            f"({dp} attention DP ranks in this worker)?"
        )
    if tp % dp:
        raise ArgumentError(
            f"--dp-size {dp} must divide --tp-size {tp} (attention tp size = tp / dp); use --tp-size {dp} "
            "(one attention rank per DP rank)"
        )
    if tp != dp:
        raise ArgumentError(
            f"--dp-size {dp} with --tp-size {tp}: attention tensor parallelism inside a DP rank "
            f"(tp / dp = {tp // dp}) is not built; use --tp-size {dp} --dp-size {dp} (one attention rank "
            "per DP rank)"
        )
    for flag, on in (
        ("--disaggregation-mode", args.disaggregation_mode != "null"),
        ("--grpc-mode", args.grpc_mode),
        ("--encoder-only", args.encoder_only),
        ("--language-only", args.language_only),
        ("--enable-pd-role-switch", args.enable_pd_role_switch),
    ):
        if on:
            raise ArgumentError(
                f"--enable-dp-attention with {flag}: DP attention runs on aggregated HTTP workers only"
            )


def _validate_pd(args: ServerArgs) -> None:
    if not 0 <= args.disaggregation_bootstrap_port < 65536:
        raise ArgumentError(
            f"--disaggregation-bootstrap-port must be in 0..65535, got {args.disaggregation_bootstrap_port}"
        )
    if args.num_reserved_decode_tokens < 0:
        n = args.num_reserved_decode_tokens
        raise ArgumentError(f"--num-reserved-decode-tokens must be >= 0, got {n}")
    if args.base_gpu_id < 0:
        raise ArgumentError(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")
    if args.disaggregation_decode_enable_offload_kvcache and (
        args.disaggregation_mode != "decode" or not args.hicache_storage_backend
    ):
        raise ArgumentError(
            "--disaggregation-decode-enable-offload-kvcache needs --disaggregation-mode decode and "
            "--hicache-storage-backend"
        )
    if args.enable_pd_role_switch and args.disaggregation_mode == "null":
        raise ArgumentError("--enable-pd-role-switch needs --disaggregation-mode prefill or decode")


def _validate_grpc(args: ServerArgs) -> None:
    """``--grpc-mode`` serves a regular worker only, and no tenants (``ArgumentError`` naming the flag)."""
    if args.grpc_mode and (args.encoder_only or args.disaggregation_mode != "null" or args.tp_size > 1):
        raise ArgumentError(
            "--grpc-mode: only a regular worker serves gRPC (no --encoder-only, --disaggregation-mode, "
            "--tp-size > 1)"
        )
    if args.smg_http_sidecar_port is not None:
        if not args.grpc_mode:
            raise ArgumentError("--smg-http-sidecar-port: only a --grpc-mode worker has an HTTP sidecar")
        if not 0 < args.smg_http_sidecar_port < 65536 or args.smg_http_sidecar_port == args.port:
            raise ArgumentError(
                f"--smg-http-sidecar-port must be in 1..65535 and differ from --port, got "
                f"{args.smg_http_sidecar_port}"
            )
    if args.disable_kv_events and not args.grpc_mode:
        raise ArgumentError("--disable-kv-events: only a --grpc-mode worker publishes KV events")
    if args.grpc_mode and args.tenant_keys_file:
        raise ArgumentError(
            "--grpc-mode and --tenant-keys-file exclude each other: the gRPC service has no tenant gate "
            "(smg sends no API key and no cache_salt over gRPC); serve tenants over HTTP"
        )


def _validate_vlm(args: ServerArgs) -> None:
    try:
        limit = json.loads(args.limit_mm_data_per_request or "{}")
        if not isinstance(limit, dict) or set(limit) - {"image"} or int(limit.get("image", 8)) < 0:
            raise ValueError('expected {"image": <count>}')
    except (ValueError, TypeError) as exc:
        raise ArgumentError(f"--limit-mm-data-per-request: {exc} (images only)") from None
    if args.allowed_local_media_path is not None and not Path(args.allowed_local_media_path).is_dir():
        raise ArgumentError(f"--allowed-local-media-path {args.allowed_local_media_path}: not a directory")
    if args.mm_embedding_cache_size < 0:
        raise ArgumentError(f"--mm-embedding-cache-size must be >= 0, got {args.mm_embedding_cache_size}")
    if args.encoder_only and args.language_only:
        raise ArgumentError("--encoder-only and --language-only exclude each other")
    if args.encoder_only and args.disaggregation_mode != "null":
        raise ArgumentError("--encoder-only: an encoder is not a PD worker (drop --disaggregation-mode)")
    if args.language_only and not args.encoder_urls and args.disaggregation_mode != "decode":
        raise ArgumentError("--language-only needs --encoder-urls (the encoders it fetches embeddings from)")
    if args.encoder_urls and not args.language_only:
        raise ArgumentError("--encoder-urls needs --language-only")
    for url in args.encoder_urls:
        if not url.startswith(("http://", "https://")):
            raise ArgumentError(f"--encoder-urls {url}: expected http://host:port")
    if args.encoder_transfer_backend == "zmq_to_tokenizer":
        raise ArgumentError(
            "--encoder-transfer-backend zmq_to_tokenizer: not supported by KVFleet; a worker is one process "
            "(tokenizer and scheduler share it), so zmq_to_scheduler already delivers embeddings where "
            "zmq_to_tokenizer would; use zmq_to_scheduler or mooncake"
        )
    if args.encoder_transfer_backend == "mooncake" and not (args.encoder_only or args.language_only):
        raise ArgumentError(
            "--encoder-transfer-backend mooncake: only an --encoder-only or --language-only worker moves "
            "image embeddings (this worker runs its own vision tower)"
        )
    if args.enable_mm_global_cache and not args.encoder_only:
        raise ArgumentError(
            "--enable-mm-global-cache: only an --encoder-only worker looks images up in the Mooncake-backed "
            "embedding cache (other workers keep a local one: --mm-embedding-cache-size)"
        )
