"""Build a running engine from launch arguments: model runner, L1 pool, radix/HiCache, scheduler, metrics.

L1 sizing (SGLang semantics): :func:`engine.sizing.tiers.l1_pool_tokens` (``--max-total-tokens``;
else on cuda ``--mem-fraction-static``, default 0.88, of the free GPU memory after loading weights; on cpu
``CPU_DEFAULT_MAX_TOTAL_TOKENS``). ``--dtype auto``: ``engine/model/compute_mode.py`` (on cpu a Q4_1 GGUF
computes in bfloat16 on its int4 blocks, other models in float32; bfloat16 on cuda). Chunked prefill defaults
to 2048 tokens on cpu and 8192 on cuda; -1 turns it off. The context length is
``--context-length`` or the model's ``max_position_embeddings``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from engine.cache.config import HiCacheConfig, parse_extra_config, split_extra_config
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.cache.kv_dtypes import resolve_kv_cache_dtype
from engine.cache.tenant_caps import TenantCap, TenantCaps
from engine.disaggregation import PrefillTransfer, TransferBackendError, create_kv_manager
from engine.disaggregation.staging import mla_staging_refused
from engine.distributed import TPConfigError, TPGroup, TPShard, check_tp_size, init_tp_group, single_rank
from engine.grammar.backend import GrammarBackend
from engine.model.config import ModelConfig
from engine.model.deepseek import mla_unsupported
from engine.model.linear import QuantizationError
from engine.model.loader import load_config
from engine.model.loader.fingerprint import kv_producer, weights_digest
from engine.model.runner import ModelRunner
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.tp_sync import TPSync
from engine.server.args import ArgumentError, ServerArgs
from engine.server.dp import DPDispatcher, SharedRunner
from engine.server.encoder_client import EncoderClient
from engine.server.engine import Engine
from engine.server.images import Embedder, EmbeddingCache, ImageInputs, local_embedder
from engine.server.metrics import EngineMetrics
from engine.server.recording import TraceRecorder
from engine.server.tenants import TenantConfigError, Tenants
from engine.server.tp_ranks import cpu_threads, init_method, start_ranks
from engine.sizing.kv import shape_for
from engine.sizing.tiers import dp_rank_pool_tokens, l1_pool_tokens

logger = logging.getLogger(__name__)

MLA_LCM_NOOP = (
    "tp_lcm_size %d: no-op for %s (MLA): every rank holds the same latent and its L3 keys name no rank, "
    "so every tp size shares its pages already"
)

MLA_PD_WHOLE = (
    "PD of %s (MLA): its %d-value latent is one KV head every rank holds whole, so slicing KV heads between "
    "tp sizes is a no-op: each decode rank receives whole pages once, from one prefill rank"
)

# HiCacheConfig field -> the flag that sets it; any other field comes from the extra config.
_FLAGS = {
    "ratio": "--hicache-ratio",
    "size": "--hicache-size",
    "write_policy": "--hicache-write-policy",
    "io_backend": "--hicache-io-backend",
    "mem_layout": "--hicache-mem-layout",
    "storage_backend": "--hicache-storage-backend",
    "prefetch_policy": "--hicache-storage-prefetch-policy",
    "eviction_policy": "--radix-eviction-policy",
}


def hicache_config(args: ServerArgs) -> HiCacheConfig:
    """The cache's config from the ``--hicache-*`` flags; ``ArgumentError`` names the flag of a bad value
    (``--hicache-write-policy: 'x' is not one of ...``, ``--hicache-storage-backend-extra-config:
    prefetch_threshold: must be >= 0, got -1``)."""
    try:
        config = HiCacheConfig(
            ratio=args.hicache_ratio,
            size=args.hicache_size,
            write_policy=args.hicache_write_policy,
            io_backend=args.hicache_io_backend,
            mem_layout=args.hicache_mem_layout,
            storage_backend=args.hicache_storage_backend,
            prefetch_policy=args.hicache_storage_prefetch_policy,
            eviction_policy=args.radix_eviction_policy,
        )
        config, _ = split_extra_config(config, parse_extra_config(args.hicache_storage_backend_extra_config))
    except ValueError as exc:
        field, _, problem = str(exc).partition(": ")
        flag = _FLAGS.get(field)
        message = f"{flag}: {problem}" if flag else f"--hicache-storage-backend-extra-config: {exc}"
        raise ArgumentError(message) from None
    return config


def _pool_tokens(args: ServerArgs, bytes_per_token: int) -> int:
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" and args.max_total_tokens is None else None
    return l1_pool_tokens(
        args.page_size,
        bytes_per_token,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        free_gpu_bytes=free,
    )


def pd_transfer(args: ServerArgs, pool: DeviceKVPool, group: TPGroup | None = None):
    """The PD transfer of this worker's role (None when not in PD mode); on P it starts the bootstrap
    server, and ``args.disaggregation_bootstrap_port`` becomes the bound port. ``ArgumentError`` names the
    flag when the backend is unusable or the port is taken.

    With a tensor-parallel ``group`` every rank calls this at the same point: rank 0 builds its manager
    first and broadcasts the bound bootstrap port, then each other rank builds its own (a prefill rank
    registers at rank 0's bootstrap server). Each rank moves the KV heads of its own pool."""
    if args.disaggregation_mode == "null":
        return None
    group = group or single_rank()
    if group.is_leader:
        try:
            mgr = _kv_manager(args, pool, group, args.disaggregation_bootstrap_port)
        except Exception as exc:
            group.broadcast_object(f"{type(exc).__name__}: {exc}")  # the other ranks stop waiting for it
            raise
        group.broadcast_object(mgr.bootstrap_port if args.disaggregation_mode == "prefill" else 0)
        return mgr
    port = group.broadcast_object(None)
    if isinstance(port, str):
        raise ArgumentError(
            f"tensor-parallel rank 0 failed to build its {args.disaggregation_mode} transport: {port}"
        )
    assert isinstance(port, int), f"rank 0 broadcasts its bootstrap port or an error, not {port!r}"
    return _kv_manager(args, pool, group, port)


def _kv_manager(args: ServerArgs, pool: DeviceKVPool, group: TPGroup, bootstrap_port: int):
    cfg = load_config(args.model_path)
    model_kv_heads = cfg.kv_cache_heads if group.size > 1 else None
    try:
        mgr = create_kv_manager(
            args.disaggregation_transfer_backend,
            args.disaggregation_mode,
            pool,
            host=args.host,
            bootstrap_port=bootstrap_port,
            prefill_http_port=args.port,
            ib_device=args.disaggregation_ib_device,
            tp_rank=group.rank,
            tp_size=group.size,
            model_kv_heads=model_kv_heads,
        )
    except TransferBackendError as exc:
        raise ArgumentError(str(exc)) from None  # names the flag
    except OSError as exc:
        raise ArgumentError(f"--disaggregation-bootstrap-port: {exc}") from None
    except ValueError as exc:  # SGLANG_DISAGG_STAGING_POOL_SIZE_MB
        raise ArgumentError(str(exc)) from None
    if args.disaggregation_mode == "prefill" and group.is_leader:
        assert isinstance(mgr, PrefillTransfer), "the prefill mode builds a PrefillTransfer"
        args.disaggregation_bootstrap_port = mgr.bootstrap_port
    logger.info(
        "PD %s worker%s, transfer backend %s%s",
        args.disaggregation_mode,
        f" (tp rank {group.rank} of {group.size})" if group.size > 1 else "",
        args.disaggregation_transfer_backend,
        f", bootstrap port {mgr.bootstrap_port}" if isinstance(mgr, PrefillTransfer) else "",
    )
    if cfg.mla and group.is_leader:
        logger.info(MLA_PD_WHOLE, cfg.architecture, 2 * cfg.kv_cache_head_dim)
    return mgr


@dataclass
class _Rank:
    """What every rank of a worker builds: the model shard, its pools and cache, the scheduler's config."""

    runner: ModelRunner
    pool: DeviceKVPool
    cache: HiRadixCache
    sched_cfg: SchedulerConfig
    bytes_per_token: int
    context: int
    name: str


def _check_tp_lcm(args: ServerArgs, cfg: ModelConfig) -> None:
    """``tp_lcm_size`` (extra config): must be a positive multiple of ``--tp-size`` (upstream's check),
    before any rank starts. The cache checks that the model's KV heads split into its shards
    (``engine/cache/storage/shards.py``); for an MLA model it is a no-op, which the log says."""
    extra = parse_extra_config(args.hicache_storage_backend_extra_config) or {}
    lcm = extra.get("tp_lcm_size")
    if lcm is None:
        return
    if isinstance(lcm, bool) or not isinstance(lcm, int) or lcm < 1 or lcm % args.tp_size:
        raise ArgumentError(
            f"--hicache-storage-backend-extra-config: tp_lcm_size {lcm!r} must be a multiple of "
            f"--tp-size {args.tp_size}"
        )
    if cfg.mla:
        logger.info(MLA_LCM_NOOP, lcm, cfg.architecture)
        return
    logger.info("tp_lcm_size %d: L3 pages are stored in KV-head shards shared across tp sizes", lcm)


def _check_tp(args: ServerArgs) -> None:
    """Refuse a tp size the model's heads or this host's GPUs do not take (before any rank starts), and
    flags an MLA model cannot run with yet."""
    cfg = load_config(args.model_path)
    _check_tp_lcm(args, cfg)
    why = mla_unsupported(cfg, args.attention_backend)
    if cfg.mla and args.disaggregation_mode != "null":
        why = why or mla_staging_refused(cfg.architecture)
    if why:
        raise ArgumentError(why)
    if args.tp_size == 1:
        return
    try:
        check_tp_size(cfg, args.tp_size)
    except TPConfigError as exc:
        raise ArgumentError(str(exc)) from None
    if args.device == "cuda" and args.base_gpu_id + args.tp_size > torch.cuda.device_count():
        raise ArgumentError(
            f"--tp-size {args.tp_size} from --base-gpu-id {args.base_gpu_id} needs GPUs "
            f"{args.base_gpu_id}..{args.base_gpu_id + args.tp_size - 1}; {torch.cuda.device_count()} visible"
        )


def _join_group(args: ServerArgs, rank: int, method: str | None) -> TPGroup:
    """This rank's device (cuda: ``--base-gpu-id`` + rank), torch threads, and its place in the group."""
    if args.device == "cuda":
        torch.cuda.set_device(args.base_gpu_id + rank)
    if args.tp_size == 1:
        return single_rank()
    if args.device == "cpu":
        torch.set_num_threads(cpu_threads(args.tp_size))
    assert method is not None
    return init_tp_group(rank, args.tp_size, method, args.device)


def _build_rank(
    args: ServerArgs,
    group: TPGroup,
    runner: ModelRunner | None,
    pool_tokens: int | None = None,
    dp_size: int = 1,
) -> _Rank:
    """The model (unless ``runner``), L1 pool, cache and scheduler config of one rank. ``pool_tokens``: the
    L1 size to use (a DP rank after the first: the first one's); else the sized pool split over ``dp_size``
    DP ranks (they share one device's memory), cut to whole pages (at least one)."""
    if runner is None:
        try:
            runner = ModelRunner(
                args.model_path,
                dtype=args.dtype,
                device=args.device,
                attention_backend=args.attention_backend,
                quantization=args.torchao_config or None,
                fused_decode=not args.disable_fused_decode,
                cpu_quant_kernels=not args.disable_cpu_quant_kernels,
                language_only=args.language_only,
                tp=group,
            )
        except QuantizationError as exc:  # e.g. an int4 group size the model's in_features do not take
            raise ArgumentError(str(exc)) from None  # names --torchao-config
    if group.size > 1 and runner.vlm is not None:
        raise ArgumentError(f"--tp-size {group.size}: image models run at --tp-size 1 in this release")
    spec = runner.kv_pool_spec()
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, str(spec.dtype).removeprefix("torch."))
    bytes_per_token = shape_for(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype).bytes_per_token
    if pool_tokens is None:
        pool_tokens = dp_rank_pool_tokens(_pool_tokens(args, bytes_per_token), dp_size, args.page_size)
    pool = DeviceKVPool(pool_tokens, args.page_size, **vars(spec), kv_cache_dtype=args.kv_cache_dtype)
    cfg = runner.config
    context = args.context_length or cfg.max_position_embeddings
    name = args.served_model_name or str(runner.model_path)
    config = hicache_config(args)  # its ArgumentError names the flag; not re-wrapped below
    producer = ""
    if args.enable_hierarchical_cache:  # the L3 namespace names the weights, quantization and dtype
        producer = kv_producer(weights_digest(runner.model_path), runner.quantization, str(runner.dtype))
        if runner.vlm is not None:  # image KV depends on the vision tower and the processor settings too
            producer += f";vision={runner.vlm.digest()}"
    shard = TPShard(cfg, group.rank, group.size)
    tenants = load_tenants(args)
    caps = TenantCaps({s: TenantCap(*pair) for s, pair in tenants.caps().items()} if tenants else {})
    try:
        cache = HiRadixCache(
            pool,
            config,
            model_name=name,
            enable_hierarchical=args.enable_hierarchical_cache,
            kv_producer=producer,
            tp_rank=group.rank,
            tp_size=group.size,
            # MLA: every rank holds the same latent: L3 keys name no rank, rank 0 alone backs pages up
            replicated_kv=cfg.mla,
            kv_shard=(0, 1) if cfg.mla else (shard.kv_shard, shard.num_kv_shards),
            kv_writer=group.rank == 0 if cfg.mla else shard.kv_writer,
            tenant_caps=caps,
        )
    except ValueError as exc:  # bad layout / io backend / storage backend settings
        raise ArgumentError(f"--hicache-*: {exc}") from None
    if args.enable_hierarchical_cache:  # layout / io corrections (kernel -> direct, mooncake + layer_first)
        args.hicache_mem_layout = cache.config.mem_layout  # show in the args too, as upstream's server_args
        args.hicache_io_backend = cache.config.io_backend
    chunk = args.chunked_prefill_size
    if chunk is None:
        chunk = 2048 if args.device == "cpu" else 8192
    sched_cfg = SchedulerConfig(
        context_length=context,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=max(chunk, 0),
        max_running_requests=args.max_running_requests or 256,
        max_queued_requests=args.max_queued_requests,
        eos_token_ids=tuple(sorted(runner.tokenizer.eos_token_ids)),
    )
    return _Rank(runner, pool, cache, sched_cfg, bytes_per_token, context, name)


def load_tenants(args: ServerArgs) -> Tenants | None:
    """The ``--tenant-keys-file`` tenants (None without one); ``ArgumentError`` naming the flag."""
    try:
        return Tenants.load(args.tenant_keys_file) if args.tenant_keys_file else None
    except TenantConfigError as exc:
        raise ArgumentError(f"--tenant-keys-file {exc}") from None


def build_follower(args: ServerArgs, rank: int, method: str) -> Scheduler:
    """Tensor-parallel rank ``rank`` > 0: its shard, pools and cache, and a scheduler that follows rank 0
    (``Scheduler.run`` it)."""
    group = _join_group(args, rank, method)
    r = _build_rank(args, group, None)
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    tok = r.runner.tokenizer
    grammar = None
    if args.grammar_backend == "xgrammar":  # the follower's own matchers end a request where rank 0's do
        grammar = GrammarBackend(tok.backend, r.runner.config.vocab_size, tok.eos_token_ids)
    return Scheduler(
        r.runner,
        r.cache,
        r.pool,
        r.sched_cfg,
        tok.decode,
        pd_mode=args.disaggregation_mode,
        pd_transfer=pd_transfer(args, r.pool, group),
        pd_decode_offload=args.disaggregation_decode_enable_offload_kvcache,
        tp=TPSync(
            group, grammar, lambda role: pd_transfer(replace(args, disaggregation_mode=role), r.pool, group)
        ),
    )


def build_engine(args: ServerArgs, runner: ModelRunner | None = None) -> Engine:
    """Load the model (unless ``runner`` is given), build cache and scheduler, start the scheduler thread.
    With ``--tp-size`` > 1 this process is rank 0 and starts the other ranks (``tp_ranks.py``) first."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available")
    if args.device == "cuda" and args.base_gpu_id >= torch.cuda.device_count():
        raise ArgumentError(f"--base-gpu-id {args.base_gpu_id}: {torch.cuda.device_count()} GPUs visible")
    dp = args.dp_size if args.enable_dp_attention else 1
    # DP attention: each DP rank is one attention rank (tp / dp == 1), all in this process on one device
    rank_args = replace(args, tp_size=args.tp_size // dp) if dp > 1 else args
    _check_tp(rank_args)
    ranks = None
    method = None
    if rank_args.tp_size > 1:
        if runner is not None:
            raise ArgumentError(f"--tp-size {args.tp_size}: each rank loads its own shard (no runner given)")
        method = init_method(args.dist_init_addr)
        ranks = start_ranks(args, method, build_follower)
    group = _join_group(rank_args, 0, method)
    r = _build_rank(rank_args, group, runner, dp_size=dp)
    runner, pool, cache, name = r.runner, r.pool, r.cache, r.name
    dp_ranks = [_build_rank(rank_args, group, runner, pool_tokens=pool.size) for _ in range(1, dp)]
    args.hicache_mem_layout, args.hicache_io_backend = (
        rank_args.hicache_mem_layout,
        rank_args.hicache_io_backend,
    )
    cfg = runner.config
    tokenizer = runner.tokenizer
    transfer = pd_transfer(args, pool, group)
    lock = threading.Lock()  # DP attention: the ranks' forward passes take turns on the device
    scheduler = Scheduler(
        SharedRunner(runner, lock) if dp > 1 else runner,
        cache,
        pool,
        r.sched_cfg,
        tokenizer.decode,
        pd_mode=args.disaggregation_mode,
        pd_transfer=transfer,
        pd_decode_offload=args.disaggregation_decode_enable_offload_kvcache,
        tp=TPSync(group) if group.size > 1 else None,
    )
    schedulers = [scheduler] + [
        Scheduler(SharedRunner(runner, lock), d.cache, d.pool, d.sched_cfg, tokenizer.decode)
        for d in dp_ranks
    ]
    tenants = load_tenants(args)
    labels = [t.label for t in tenants.tenants] if tenants else []
    metrics = None
    if args.enable_metrics:
        metrics = EngineMetrics(
            args.model_name,
            lambda: scheduler.state,
            labels,
            dp_states=[partial(getattr, s, "state") for s in schedulers],
        )
    for s in schedulers:
        s.metrics = metrics
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    grammar = None
    if args.grammar_backend == "xgrammar":  # compiles on its own threads; the model's logits width
        grammar = GrammarBackend(tokenizer.backend, cfg.vocab_size, tokenizer.eos_token_ids)
    engine = Engine(
        args,
        tokenizer,
        scheduler,
        context_length=r.context,
        vocab_size=tokenizer.vocab_size,
        metrics=metrics,
        recorder=TraceRecorder() if args.record_trace else None,
        tenants=tenants,
        grammar=grammar,
        model_info={
            "architecture": cfg.architecture,
            "kv_bytes_per_token": pool.bytes_per_token,
            "kv_cache_dtype": pool.kv_cache_dtype,
            # one rank's KV shape: a reader computes bytes per token at another --kv-cache-dtype from it
            "kv_shape": {
                "num_layers": pool.num_layers,
                "num_kv_heads": pool.num_kv_heads,
                "head_dim": pool.head_dim,
                # MLA: the one head's K and V rows are the two halves of this latent
                **({"latent_dim": 2 * cfg.kv_cache_head_dim} if cfg.mla else {}),
            },
            "vocab_size": tokenizer.vocab_size,
        },
        tp_ranks=ranks,
        dp=DPDispatcher(schedulers),
    )
    engine.images = image_inputs(args, runner)
    if ranks is not None:
        ranks.on_death = engine.mark_unhealthy
    for s in schedulers:
        s.start()
    logger.info(
        "engine ready: %s, tp %d, dp %d, L1 %d tokens per rank (page %d), hierarchical=%s",
        name,
        args.tp_size,
        dp,
        pool.size,
        args.page_size,
        args.enable_hierarchical_cache,
    )
    return engine


def image_inputs(args: ServerArgs, runner: ModelRunner) -> ImageInputs | None:
    """The worker's image side: None for a text model; embeddings from the local vision tower (cached by
    image hash), from ``--encoder-urls`` on a language-only worker, or none on a PD decode worker."""
    if runner.vlm is None:
        return None
    embedder: Embedder | None = None
    if args.disaggregation_mode != "decode":
        if args.language_only:
            host = args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1"
            try:
                embedder = EncoderClient(
                    args.encoder_urls,
                    runner.vlm,
                    host,
                    backend=args.encoder_transfer_backend,
                    max_images=args.max_images_per_request,
                )
            except TransferBackendError as exc:
                raise ArgumentError(str(exc)) from None  # names --encoder-transfer-backend
        else:
            assert runner.vision is not None
            embedder = local_embedder(
                runner.vision.encode_images, EmbeddingCache(args.mm_embedding_cache_size)
            )
    local = Path(args.allowed_local_media_path).resolve() if args.allowed_local_media_path else None
    return ImageInputs(runner.vlm, embedder, args.max_images_per_request, args.max_image_pixels, local)
