import re

from rest_framework import serializers

from controlplane.capacity.services import DTYPE_BYTES
from controlplane.core.serializers import StrictSerializer
from engine.cache.misses import MISS_CAUSES
from engine.server.contract import ADMISSIONS, EVICTION_POLICIES
from engine.whatif.trace import output_blocks

BLOCK_TOKENS = 512  # Mooncake's block size: rows posted without block_tokens (an older agent)


class SizingQuerySerializer(StrictSerializer):
    """Query parameters of the sizing calculator: ``bytes_per_token`` (one rank's), or the model's
    ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype``; ``tp_size`` (the worker's ranks: L1 and
    L2 are sized per rank) and ``dp_size`` (DP attention ranks: every figure is one DP rank's);
    then the worker's launch flags and the machine (``host_memory_bytes``: the
    host's, shared by the ranks)."""

    bytes_per_token = serializers.IntegerField(min_value=1, required=False)
    num_layers = serializers.IntegerField(min_value=1, required=False)
    num_kv_heads = serializers.IntegerField(min_value=1, required=False)
    head_dim = serializers.IntegerField(min_value=1, required=False)
    dtype = serializers.ChoiceField(choices=sorted(DTYPE_BYTES), default="bfloat16")
    tp_size = serializers.IntegerField(min_value=1, max_value=1024, default=1)
    dp_size = serializers.IntegerField(
        min_value=1,
        max_value=1024,
        default=1,
        help_text="DP attention ranks (--dp-size with --enable-dp-attention; must equal tp_size above 1): "
        "each holds every KV head and a 1/dp share of the worker's L1",
    )
    page_size = serializers.IntegerField(min_value=1, default=1)
    max_total_tokens = serializers.IntegerField(min_value=1, required=False)
    mem_fraction_static = serializers.FloatField(min_value=0.01, max_value=1.0, required=False)
    free_gpu_memory_bytes = serializers.IntegerField(min_value=1, required=False)
    enable_hierarchical_cache = serializers.BooleanField(default=False)
    hicache_ratio = serializers.FloatField(min_value=0, default=2.0)
    hicache_size = serializers.IntegerField(min_value=0, default=0)
    host_memory_bytes = serializers.IntegerField(min_value=0, required=False)
    l3_bytes = serializers.IntegerField(min_value=0, default=0)

    def validate(self, attrs):
        shape = ("num_layers", "num_kv_heads", "head_dim")
        if "bytes_per_token" not in attrs:
            missing = [f for f in shape if f not in attrs]
            if missing:
                raise serializers.ValidationError({f: ["required without bytes_per_token"] for f in missing})
        return attrs


class MissesSerializer(StrictSerializer):
    """A recorded row's miss attribution (the worker's ``miss_tokens_details`` causes, ``unseen``: the token
    ranges ``[start, end)`` of its ``not_seen_here`` tokens)."""

    causes = serializers.DictField(child=serializers.IntegerField(min_value=0))
    unseen = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField(min_value=0), min_length=2, max_length=2),
        default=list,
    )

    def validate_causes(self, value):
        unknown = sorted(set(value) - set(MISS_CAUSES))
        if unknown:
            raise serializers.ValidationError(
                f"unknown cause {unknown[0]!r}: one of {', '.join(MISS_CAUSES)}"
            )
        return value


class MissesQuerySerializer(StrictSerializer):
    """``GET /capacity/misses/``: the ``pool`` (regular, prefill, decode) and, optionally, ``since_ms``
    (ms since the epoch): only traffic that arrived from then on; ``recent`` (0-100, default 0): the newest
    that many attributed requests of each worker and of the pool, each with its own causes."""

    pool = serializers.ChoiceField(choices=["regular", "prefill", "decode"], default="regular")
    since_ms = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False)
    recent = serializers.IntegerField(min_value=0, max_value=100, default=0)


class CrossoverQuerySerializer(StrictSerializer):
    """``GET /capacity/crossover/``: the ``pool`` (regular, prefill, decode; left out: every worker) and,
    optionally, ``window_s``: measure over the last that many seconds (else since each worker started)."""

    pool = serializers.ChoiceField(choices=["regular", "prefill", "decode"], required=False)
    window_s = serializers.IntegerField(min_value=10, max_value=7 * 86400, required=False)


class CrossoverApplySerializer(StrictSerializer):
    """``POST /capacity/crossover/apply/``: the ``worker`` (name) whose recommendation to apply and,
    optionally, the ``window_s`` it is measured over (as the GET's) and the operator's ``reason`` (kept in
    the operation and the audit log before the crossover behind the change)."""

    worker = serializers.CharField(max_length=200)
    window_s = serializers.IntegerField(min_value=10, max_value=7 * 86400, required=False)
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)


class CrossoverProbeSerializer(StrictSerializer):
    """``POST /capacity/crossover/probe/``: the ``worker`` (name) to probe, optionally its ``sizes`` (1 to 8
    token counts; left out: the worker's defaults) and the operator's ``reason`` (kept in the audit log)."""

    worker = serializers.CharField(max_length=200)
    sizes = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=1 << 20),
        min_length=1,
        max_length=8,
        required=False,
    )
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)


class TraceRowSerializer(StrictSerializer):
    """One Mooncake trace row; ``hash_ids`` must have one id per block of the input (the batch's
    ``block_tokens``, given in the serializer's context); ``output_hash_ids`` (optional, a KVFleet
    recording's) one per block of the cached sequence from the first holding a generated token
    (``engine.whatif.trace.output_blocks``)."""

    timestamp = serializers.IntegerField(min_value=0)
    input_length = serializers.IntegerField(min_value=0)
    output_length = serializers.IntegerField(min_value=0)
    hash_ids = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=2**63 - 1))
    output_hash_ids = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=2**63 - 1), required=False, default=list
    )
    misses = MissesSerializer(required=False)

    def validate(self, attrs):
        misses = attrs.get("misses")
        if misses is not None:
            matchable = max(attrs["input_length"] - 1, 0)
            for start, end in misses["unseen"]:
                if not 0 <= start < end <= matchable:
                    raise serializers.ValidationError(
                        {
                            "misses": {
                                "unseen": [
                                    f"[{start}, {end}) is not a range of the {matchable} matchable tokens"
                                ]
                            }
                        }
                    )
            unseen = sum(end - start for start, end in misses["unseen"])
            if unseen > misses["causes"].get("not_seen_here", 0):
                raise serializers.ValidationError(
                    {"misses": {"unseen": [f"{unseen} tokens: more than causes.not_seen_here"]}}
                )
            if sum(misses["causes"].values()) > attrs["input_length"]:
                raise serializers.ValidationError({"misses": {"causes": ["more tokens than the input"]}})
        block_tokens = self.context.get("block_tokens", BLOCK_TOKENS)
        extra = output_blocks(attrs["input_length"], attrs["output_length"], block_tokens)
        if attrs["output_hash_ids"] and len(attrs["output_hash_ids"]) != extra:
            raise serializers.ValidationError(
                {"output_hash_ids": [f"{len(attrs['output_hash_ids'])} ids: want {extra}"]}
            )
        blocks = -(-attrs["input_length"] // block_tokens)
        if len(attrs["hash_ids"]) != blocks:
            raise serializers.ValidationError(
                {
                    "hash_ids": [
                        f"{len(attrs['hash_ids'])} ids for {attrs['input_length']} tokens: want {blocks}"
                    ]
                }
            )
        return attrs


class TraceIngestSerializer(StrictSerializer):
    worker_url = serializers.URLField()
    block_tokens = serializers.IntegerField(min_value=1, max_value=4096, default=BLOCK_TOKENS)
    requests = serializers.ListField(child=serializers.DictField(), allow_empty=False, max_length=10_000)

    def validate(self, attrs):
        rows = TraceRowSerializer(
            data=attrs["requests"], many=True, context={"block_tokens": attrs["block_tokens"]}
        )
        if not rows.is_valid():
            raise serializers.ValidationError({"requests": rows.errors})
        attrs["requests"] = rows.validated_data
        return attrs


_CAPACITIES = re.compile(r"^\s*(inf|\d+(\.\d+)?(e\d+)?)(\s*,\s*(inf|\d+(\.\d+)?(e\d+)?))*\s*$", re.IGNORECASE)
MAX_POINTS = 16
MAX_UPLOAD_CHARS = 32 * 1024 * 1024


class WhatIfSerializer(StrictSerializer):
    """A what-if run: ``trace`` is ``shared:<file>`` or ``pool:<pool>``, or ``trace_text`` an uploaded
    Mooncake JSONL; capacities are comma lists of tokens (``inf`` = unbounded, 0 = tier absent), or instead
    of ``l2_tokens`` a ``hicache_ratio``: L2 = that x each L1 point, as the engine sizes its host pool.
    ``page_size`` left out: the fleet's (``selectors.pool_page_size``, the trace's pool for ``pool:``);
    ``kv_bytes_per_token`` left out: what the pool's workers report at ``/get_model_info``. ``eviction``
    and the ``l2_admission`` / ``l3_admission`` filters are the engine's (``--radix-eviction-policy``, the
    extra-config keys). ``prefetch_threshold`` (tokens) left out: the one the trace's pool's first worker
    reported at ``GET /hicache/config``, else the engine's 256. ``optimum`` (default true): also replay each
    point with Belady's MIN (the offline optimum; about twice the replay time) so each point carries
    ``optimum`` and ``lost``."""

    trace = serializers.CharField(required=False)
    trace_text = serializers.CharField(required=False, max_length=MAX_UPLOAD_CHARS, trim_whitespace=False)
    l1_tokens = serializers.CharField(default="1000000")
    l2_tokens = serializers.CharField(required=False)
    hicache_ratio = serializers.FloatField(min_value=0, required=False)
    l3_tokens = serializers.CharField(default="0")
    page_size = serializers.IntegerField(min_value=1, max_value=4096, required=False)
    eviction = serializers.ChoiceField(choices=EVICTION_POLICIES, default="lru")
    l2_admission = serializers.ChoiceField(choices=ADMISSIONS, default="none")
    l3_admission = serializers.ChoiceField(choices=ADMISSIONS, default="none")
    write_policy = serializers.ChoiceField(
        choices=["write_through", "write_through_selective", "write_back"], default="write_through"
    )
    kv_bytes_per_token = serializers.IntegerField(min_value=1, required=False)
    prefetch_threshold = serializers.IntegerField(min_value=0, max_value=1 << 30, required=False)
    optimum = serializers.BooleanField(default=True)

    def validate(self, attrs):
        if ("trace" in attrs) == ("trace_text" in attrs):
            raise serializers.ValidationError({"trace": ["give exactly one of trace and trace_text"]})
        if "trace" in attrs and not attrs["trace"].startswith(("shared:", "pool:")):
            raise serializers.ValidationError({"trace": ["shared:<file> or pool:<pool>"]})
        if "hicache_ratio" in attrs and "l2_tokens" in attrs:
            raise serializers.ValidationError({"hicache_ratio": ["give it or l2_tokens, not both"]})
        if "hicache_ratio" not in attrs:
            attrs.setdefault("l2_tokens", "0")
        points = 1
        for field in ("l1_tokens", "l2_tokens", "l3_tokens"):
            if field not in attrs:  # L2 follows L1 by hicache_ratio: one L2 per L1 point
                continue
            if not _CAPACITIES.match(attrs[field]):
                raise serializers.ValidationError({field: ["a comma list of token counts or inf"]})
            points *= len(attrs[field].split(","))
        if points > MAX_POINTS:
            raise serializers.ValidationError(
                {"l1_tokens": [f"{points} capacity points: at most {MAX_POINTS}"]}
            )
        return attrs
