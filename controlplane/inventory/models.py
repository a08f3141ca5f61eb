"""Fleet inventory tables. Worker admin keys and API keys are Fernet-encrypted at rest
(controlplane.core.crypto), write-only in the API and masked in audit records."""

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from controlplane.core.crypto import decrypt_text, encrypt_text
from controlplane.core.models import TimeStamped
from engine.fleet.identity import grpc_url
from engine.server.contract import CAPABILITIES, ENGINE_KINDS, missing_capability


class Host(TimeStamped):
    name = models.CharField(max_length=100, unique=True)
    address = models.CharField(max_length=200, blank=True)
    agent_version = models.CharField(max_length=50, blank=True)
    cpu_count = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Logical CPUs (os.cpu_count()) the agent reported; empty for hosts added by hand",
    )
    memory_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Physical memory in bytes the agent reported; empty for hosts added by hand",
    )
    last_seen = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Gpu(models.Model):
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    model = models.CharField(max_length=100)
    memory_mib = models.PositiveIntegerField(help_text="Device memory in MiB")

    class Meta:
        ordering = ["host__name", "index"]
        constraints = [models.UniqueConstraint(fields=["host", "index"], name="gpu_unique_index_per_host")]

    def __str__(self) -> str:
        return f"{self.host.name}/gpu{self.index}"


class StorageBackend(models.TextChoices):
    AIBRIX = "aibrix"
    FILE = "file"
    LMCACHE = "lmcache", "LMCache"
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    DYNAMIC = "dynamic"


class StorageProfile(TimeStamped):
    """An L3 store a worker can attach: e.g. a file path or a Mooncake cluster (`extra_config` as the engine
    takes it in `hicache_storage_backend_extra_config_json`)."""

    name = models.CharField(max_length=100, unique=True)
    backend = models.CharField(max_length=20, choices=StorageBackend.choices)
    extra_config = models.JSONField(default=dict, blank=True)
    description = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class RouterMode(models.TextChoices):
    REGULAR = "regular"
    PD = "pd"


class RouterPolicy(models.TextChoices):
    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    POWER_OF_TWO = "power_of_two"


class RouterKind(models.TextChoices):
    """Which router answers at a Router's URL (engine/fleet/identity.py); "" until it has been probed."""

    SMG = "smg", "smg"
    SGLANG_ROUTER = "sglang-router", "sglang-router"
    UNKNOWN = "", "not identified"


class Router(TimeStamped):
    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(unique=True)
    kind = models.CharField(
        max_length=20,
        choices=RouterKind.choices,
        blank=True,
        default=RouterKind.UNKNOWN,
        help_text="Probed from the router's GET /get_loads (smg, or sglang-router); empty until it answered",
    )
    version = models.CharField(
        max_length=40,
        blank=True,
        help_text="The router's release as it reports it (smg: e.g. 1.13.0); empty when it does not "
        "(sglang-router) or before it was probed",
    )
    identified_at = models.DateTimeField(
        null=True, blank=True, help_text="When kind and version were last probed from the router"
    )
    mode = models.CharField(max_length=10, choices=RouterMode.choices, default=RouterMode.REGULAR)
    policy = models.CharField(max_length=20, choices=RouterPolicy.choices, default=RouterPolicy.CACHE_AWARE)
    metrics_url = models.URLField(
        blank=True,
        help_text="The router's Prometheus endpoint (--prometheus-host/--prometheus-port, path /metrics); "
        "its circuit-breaker state is read from there",
    )
    circuit_breaker = models.BooleanField(
        default=True,
        help_text="Whether the router runs its circuit breaker: false for one started with "
        "--disable-circuit-breaker, as every router KVFleet starts is (its metrics still report each "
        "breaker closed, so only this record can say it is off)",
    )
    slo_ttft_p90_s = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001)],
        help_text="PD: TTFT p90 SLO in seconds, the client's (measured on the decode workers): the P:D "
        "planner sizes the prefill pool for it; a rebalance's soak watches it unless the POST "
        "sets slo",
    )
    slo_itl_p90_s = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0001)],
        help_text="PD: inter-token latency p90 SLO in seconds: the P:D planner sizes the decode pool for "
        "it; a rebalance's soak watches it unless the POST sets slo",
    )
    worker_budget = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(2)],
        help_text="PD: a cap on the workers the P:D planner splits into prefill and decode (it plans for "
        "the smaller of this and the router's prefill + decode workers; empty: all of them)",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class WorkerRole(models.TextChoices):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    ENCODER = "encoder"  # EPD: a vision encoder (--encoder-only); prefill workers call it, never switched


class WorkerState(models.TextChoices):
    UNKNOWN = "unknown"
    ONLINE = "online"
    OFFLINE = "offline"


# What the control plane asks a worker's agent (desired_role and its generation) and what the agent last
# acknowledged: written only by queryset updates (controlplane.inventory.services).
ROLE_REQUEST_FIELDS = ("desired_role", "role_request_seq", "role_seen_seq", "role_applied_seq")
# What the reconciler keeps a worker at (its assigned role, whether it left its router on purpose): also
# written only by queryset updates, never by a full save of a possibly stale row.
# The command line its agent is asked to restart it with (a restart-with-flags operation) and what the agent
# last acknowledged: queryset updates only, as the role request.
FLAGS_REQUEST_FIELDS = (
    "desired_flags",
    "flags_request_seq",
    "flags_applied_seq",
    "flags_failed_seq",
    "flags_failure",
)
HICACHE_READ_FIELDS = ("hicache_config", "hicache_unreported", "hicache_config_read_at")
SERVICE_ONLY_FIELDS = (
    *ROLE_REQUEST_FIELDS,
    *FLAGS_REQUEST_FIELDS,
    *HICACHE_READ_FIELDS,
    "assigned_role",
    "drained",
)


def devices_problem(devices, tp_size: int | None) -> str | None:
    """Why ``devices`` is not a valid device list for a worker of ``tp_size`` ranks (None: it is): a list of
    distinct integers >= 0, empty (not reported) or exactly one per rank."""
    if not isinstance(devices, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices
    ):
        return "must be a list of device indexes (integers >= 0)"
    if len(set(devices)) != len(devices):
        return f"device index repeated: {devices}"
    if devices and tp_size is not None and len(devices) != tp_size:
        return f"{len(devices)} device(s) for tp_size {tp_size}: one per rank"
    return None


class EngineWorker(TimeStamped):
    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(unique=True)
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.SET_NULL, related_name="workers")
    router = models.ForeignKey(
        Router, null=True, blank=True, on_delete=models.SET_NULL, related_name="workers"
    )
    role = models.CharField(
        max_length=10,
        choices=WorkerRole.choices,
        default=WorkerRole.MIXED,
        help_text="The role it runs as last seen (its /server_info disaggregation_mode, reported by its "
        "agent or read back by a rebalance); mixed = not PD",
    )
    role_changed_at = models.DateTimeField(
        null=True, blank=True, help_text="When the control plane last saw the worker's role change"
    )
    assigned_role = models.CharField(
        max_length=10,
        choices=WorkerRole.choices,
        blank=True,
        help_text="PD role the reconciler keeps it in (set by a rebalance step); empty: none",
    )
    drained = models.BooleanField(
        default=False,
        help_text="Out of its router on purpose (drain): not re-added by the reconciler",
    )
    desired_role = models.CharField(
        max_length=10,
        choices=WorkerRole.choices,
        blank=True,
        help_text="A role its agent is asked to restart it in (POST .../role/, or a rebalance step of "
        "method restart); cleared once it reports that role",
    )
    role_request_seq = models.PositiveIntegerField(
        default=0,
        help_text="Generation of desired_role: bumped each time it is set or withdrawn (heartbeat answers "
        "carry it; a fulfilled request clears desired_role without a bump)",
    )
    role_seen_seq = models.PositiveIntegerField(
        default=0,
        help_text="The newest role_request_seq its agent has acted on or decided against, as it last "
        "reported (heartbeat role_acks.seen)",
    )
    role_applied_seq = models.PositiveIntegerField(
        default=0,
        help_text="The newest role request its agent carried out (restarted it in that role, or found it "
        "running it), as it last reported (heartbeat role_acks.applied)",
    )
    engine = models.CharField(
        max_length=10,
        choices=[(k, k) for k in ENGINE_KINDS],
        default="kvfleet",
        help_text="The engine it runs: kvfleet (KVFleet's engine) or sglang (upstream SGLang), as its agent "
        "reports it",
    )
    engine_version = models.CharField(
        max_length=50, blank=True, help_text="Its /server_info version as its agent last read it"
    )
    capabilities = models.JSONField(
        default=list,
        blank=True,
        help_text="What it was found able to do, probed by its agent (names of "
        "engine.server.contract.CAPABILITIES); the console offers only these operations",
    )
    command_line = models.JSONField(
        default=list,
        blank=True,
        help_text="The launch flags it runs with, one argv item each (--flag=value), as its agent last "
        "reported them once it answered /health; no interpreter, no secrets (keys go through the "
        "environment); empty: no agent reported one",
    )
    launch_flags = models.JSONField(
        default=dict,
        blank=True,
        help_text="Its engine's launch flags as its agent's parser for it knows them: SGLang name -> "
        "[option, takes a value]; what a restart with flags may set or remove",
    )
    desired_flags = models.JSONField(
        null=True,
        blank=True,
        help_text="The command line its agent was last asked to restart it with (a restart_with_flags "
        "operation); kept after it is carried out, the generation says which request is current",
    )
    flags_request_seq = models.PositiveIntegerField(
        default=0, help_text="Generation of desired_flags: bumped each time it is set"
    )
    flags_applied_seq = models.PositiveIntegerField(
        default=0,
        help_text="The newest flags request its agent carried out (the worker answered /health with those "
        "flags), as it last reported (heartbeat flag_acks.applied)",
    )
    flags_failed_seq = models.PositiveIntegerField(
        default=0,
        help_text="The newest flags request that failed (refused by the engine's parser, or the process "
        "exited before answering /health), as its agent last reported (heartbeat flag_acks.failed)",
    )
    flags_failure = models.TextField(blank=True, help_text="Why flags_failed_seq failed, as its agent said")
    model_name = models.CharField(max_length=200, blank=True)
    tp_size = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        help_text="Tensor-parallel ranks (--tp-size): the worker spans this many devices, and the P:D "
        "planner and rebalances count it as that many",
    )
    devices = models.JSONField(
        default=list,
        blank=True,
        help_text="Device (GPU) indexes on its host its ranks hold, rank 0 first, as its agent reports them "
        "(--base-gpu-id .. + tp_size - 1); empty: not reported (a CPU worker, or one added by hand)",
    )
    dp_size = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    page_size = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    hicache_config = models.JSONField(
        default=dict,
        blank=True,
        help_text="The HiCache runtime config last read from the worker, under GET /hicache/config's names: "
        "from its /server_info by its agent (at register and every heartbeat) or by the control plane, or "
        "read back by an operation; {} before the first read, or without --enable-hierarchical-cache",
    )
    hicache_unreported = models.JSONField(
        default=dict,
        blank=True,
        help_text="Settings of GET /hicache/config's names the worker does not report, each with why (an "
        "upstream SGLang worker reports only its launch args and its extra config's keys)",
    )
    hicache_config_read_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When hicache_config was read as it is now (a read that finds it unchanged does not move "
        "it); null: never read from the worker",
    )
    storage_backend = models.CharField(
        max_length=20, blank=True, help_text="Attached L3 backend name, if any"
    )
    storage_profile = models.ForeignKey(
        StorageProfile, null=True, blank=True, on_delete=models.PROTECT, related_name="workers"
    )
    config_revision = models.ForeignKey(
        "configs.ConfigRevision", null=True, blank=True, on_delete=models.PROTECT, related_name="workers"
    )
    state = models.CharField(max_length=10, choices=WorkerState.choices, default=WorkerState.UNKNOWN)
    last_seen = models.DateTimeField(null=True, blank=True)
    admin_key_encrypted = models.TextField(blank=True)
    api_key_encrypted = models.TextField(
        blank=True,
        help_text="The worker's --api-key, encrypted: bearer of its /generate, /pd_role_switch",
    )

    audit_masked_fields = ("admin_key_encrypted", "api_key_encrypted")
    # its engine's whole flag table (hundreds of flags on upstream SGLang): a register's record keeps its size
    audit_counted_fields = ("launch_flags",)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """``devices``: distinct non-negative integers, one per rank (``tp_size`` of them) when given;
        ValidationError naming ``devices`` otherwise."""
        super().clean()
        problem = devices_problem(self.devices, self.tp_size)
        if problem:
            raise ValidationError({"devices": problem})

    def save(self, *args, **kwargs):
        """A full save of an existing row leaves SERVICE_ONLY_FIELDS (role requests, assigned role, drained,
        the HiCache config read from the worker) alone: only the services' queryset updates write them, so a
        stale instance saved by another path never moves a request, its agent's acknowledgement or a read
        back."""
        if not self._state.adding and kwargs.get("update_fields") is None:
            kwargs["update_fields"] = [
                f.name
                for f in self._meta.concrete_fields
                if not f.primary_key and f.name not in SERVICE_ONLY_FIELDS
            ]
        super().save(*args, **kwargs)

    def can(self, capability: str) -> bool:
        """Whether its agent found it able to do ``capability`` (a key of ``CAPABILITIES``). A worker no
        agent probed (added by hand, or registered before probing existed) is taken to be KVFleet's engine
        and able to do what KVFleet's engine does."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}")
        if not self.capabilities and self.engine == "kvfleet" and not self.engine_version:
            return capability != "recorded_trace"
        return capability in self.capabilities

    def cannot_because(self, capability: str) -> str:
        """'' when it can, else why not and what to do instead (``missing_capability``)."""
        if self.can(capability):
            return ""
        return missing_capability(capability, self.engine, self.engine_version or "?")

    @property
    def router_url(self) -> str:
        """The URL its router lists it by (no trailing slash): ``grpc://host:port`` for a worker whose command
        line says ``--grpc-mode`` (the router speaks gRPC to it on ``--port``; ``url`` is its HTTP sidecar's,
        ``engine.fleet.identity.grpc_url``), else ``url``. Drain, undrain, operations and the reconciler
        find it in the router by this. A gRPC worker added by hand (no command line) is taken to be HTTP."""
        return grpc_url(self.url, self.command_line or []) or self.url.rstrip("/")

    @property
    def admin_key(self) -> str:
        return decrypt_text(self.admin_key_encrypted)

    @admin_key.setter
    def admin_key(self, value: str) -> None:
        self.admin_key_encrypted = encrypt_text(value)

    @property
    def api_key(self) -> str:
        """The worker's ``--api-key`` ('' when it has none): upstream guards its inference routes and
        ``POST /pd_role_switch`` with it."""
        return decrypt_text(self.api_key_encrypted)

    @api_key.setter
    def api_key(self, value: str) -> None:
        self.api_key_encrypted = encrypt_text(value)


class FleetAlert(models.Model):
    """Drift the reconciler found and cannot repair (a router listing a URL no worker of its has, a worker
    that does not answer, a worker in the wrong role with no agent to restart it). Open while the drift is
    seen; closed (``resolved_at``) by the first pass that no longer sees it. One open alert per (router,
    worker, kind)."""

    router = models.ForeignKey(Router, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    worker = models.ForeignKey(
        EngineWorker, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts"
    )
    kind = models.CharField(
        max_length=40, help_text="unknown_worker | worker_unreachable | cannot_restart | ..."
    )
    subject = models.CharField(
        max_length=300, blank=True, help_text="What it is about (a URL for unknown_worker)"
    )
    message = models.TextField()
    opened_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now=True)
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["router", "worker", "kind", "subject"],
                condition=models.Q(resolved_at__isnull=True),
                name="one_open_alert_per_drift",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"
