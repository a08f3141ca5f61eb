"""factory_boy factories for the control-plane models (minimal; relations are explicit)."""

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from controlplane.configs.models import ConfigProfile, ConfigRevision
from controlplane.inventory.models import EngineWorker, Gpu, Host, Router, StorageProfile

AGENT_HOST = "agent-host"  # the host the agent persona's token (conftest ``personas``) is bound to


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", "pw-for-tests-1")

    @factory.post_generation
    def role(self, create, extracted, **kwargs):
        if extracted:
            self.groups.add(Group.objects.get_or_create(name=extracted)[0])
        self.save()


class HostFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Host

    name = factory.Sequence(lambda n: f"host-{n}")
    address = "10.0.0.1"


class GpuFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Gpu

    host = factory.SubFactory(HostFactory)
    index = factory.Sequence(lambda n: n)
    model = "H200"
    memory_mib = 143771


class RouterFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Router

    name = factory.Sequence(lambda n: f"router-{n}")
    url = factory.Sequence(lambda n: f"http://router-{n}.local:30000")


class StorageProfileFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = StorageProfile

    name = factory.Sequence(lambda n: f"l3-{n}")
    backend = "file"
    extra_config = factory.LazyFunction(lambda: {"file_path": "/var/kvfleet/l3"})


class EngineWorkerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EngineWorker
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"worker-{n}")
    url = factory.Sequence(lambda n: f"http://worker-{n}.local:30000")
    role = "mixed"
    model_name = "SmolLM2"
    admin_key_encrypted = ""

    @factory.post_generation
    def admin_key(self, create, extracted, **kwargs):
        if extracted:
            self.admin_key = extracted
            self.save(update_fields=["admin_key_encrypted"])


class ConfigProfileFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ConfigProfile

    name = factory.Sequence(lambda n: f"profile-{n}")


class ConfigRevisionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ConfigRevision

    profile = factory.SubFactory(ConfigProfileFactory)
    number = 1
    content = factory.LazyFunction(lambda: {"hicache_write_policy": "write_back", "prefetch_threshold": 128})
    content_sha256 = "0" * 64


def crossover_change(worker, *, created_at: float, finished_at: float, before: dict, after: dict):
    """A succeeded ``apply_config`` operation of ``worker``'s crossover profile (``crossover-<name>``,
    as ``POST /capacity/crossover/apply/`` creates it), created at ``created_at`` and its one target
    succeeded at ``finished_at`` (epoch s), having read ``before`` and ``after`` (HiCache config fields).
    Returns the Operation."""
    from datetime import UTC, datetime

    from controlplane.configs.models import ConfigProfile
    from controlplane.operations.models import Operation, OperationTarget

    profile, _ = ConfigProfile.objects.get_or_create(name=f"crossover-{worker.name}")
    number = profile.revisions.count() + 1
    revision = ConfigRevisionFactory(profile=profile, number=number, content=dict(after))
    ConfigProfile.objects.filter(pk=profile.pk).update(head_number=number)
    op = Operation.objects.create(
        kind="apply_config", revision=revision, state="succeeded", idle_timeout_s=60.0
    )
    Operation.objects.filter(pk=op.pk).update(  # auto_now_add: set after the insert
        created_at=datetime.fromtimestamp(created_at, UTC),
        finished_at=datetime.fromtimestamp(finished_at, UTC),
    )
    OperationTarget.objects.create(
        operation=op,
        worker=worker,
        state="succeeded",
        before=before,
        after=after,
        finished_at=datetime.fromtimestamp(finished_at, UTC),
    )
    op.refresh_from_db()
    return op


TTFT_BOUNDS = ("0.05", "0.1", "0.25", "0.5", "1.0", "+Inf")


def ttft_histogram(counts: dict[str, int]) -> str:
    """``/metrics`` lines of SGLang's TTFT histogram holding ``counts`` ({upper bound: observations in that
    bucket alone}, bounds from ``TTFT_BOUNDS``): its cumulative ``_bucket`` counters and ``_count``."""
    lines, total = [], 0
    for bound in TTFT_BOUNDS:
        total += counts.get(bound, 0)
        lines.append(f'sglang:time_to_first_token_seconds_bucket{{le="{bound}"}} {total}\n')
    return "".join(lines) + f"sglang:time_to_first_token_seconds_count {total}\n"
