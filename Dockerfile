# One image for every Podium role: `podium scheduler`, `podium node`, and controller scripts.
#
#   docker build -t podium .                                        # python:3.11-slim, deps from PyPI
#   docker build --build-arg PYTHON_IMAGE=python:3.12-slim -t podium .
#
# Torch comes from PyPI (the CUDA build on x86_64). For a smaller CPU-only image add
#   --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# Offline builds (no index at all): put every wheel, podium's dependencies and setuptools +
# wheel included, under wheelhouse/ in the build context and pass
#   --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/src/wheelhouse
# (tests/cluster/test_compose.py builds it that way, on a locally imported Debian base).
#
# Works with the classic builder (DOCKER_BUILDKIT=0) as well as BuildKit.

# Any image with python3 >= 3.10 and its venv module.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: podium's wheel, installed with its dependencies into a virtualenv
FROM ${PYTHON_IMAGE} AS build
# pip reads these from the environment; ARGs are environment variables while RUN runs.
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS=
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY . /src
# A virtualenv, not the system interpreter: Debian's python3 refuses pip installs (PEP 668),
# and one path (/opt/podium) works on every base image.
RUN python3 -m venv /opt/podium \
 && /opt/podium/bin/pip wheel --no-deps --wheel-dir /wheels /src \
 && /opt/podium/bin/pip install /wheels/podium-*.whl \
 && /opt/podium/bin/podium --help >/dev/null

# ---- runtime: the virtualenv only (no sources, no wheels, no build tools)
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="podium" \
      org.opencontainers.image.description="Podium scheduler, node agent and controller runtime"
COPY --from=build /opt/podium /opt/podium
# The examples, for the Kubernetes example Job (deploy/kubernetes/job) and quick tries.
COPY --from=build /src/examples /opt/podium/examples
# A fixed uid so volumes keep working across rebuilds; state and logs live on volumes.
RUN useradd --uid 10001 --create-home --home-dir /home/podium --shell /usr/sbin/nologin podium \
 && mkdir -p /var/lib/podium /var/log/podium \
 && chown podium:podium /var/lib/podium /var/log/podium
ENV PATH=/opt/podium/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/podium
USER podium
WORKDIR /home/podium
# 50051: scheduler gRPC (SDK), 8265: scheduler HTTP (/healthz, /v1/placement, /metrics).
EXPOSE 50051 8265
ENTRYPOINT ["podium"]
CMD ["--help"]
