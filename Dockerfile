# syntax=docker/dockerfile:1
# kvredis on vLLM's official OpenAI server image: the image of the prefill, decode and proxy services of
# docker-compose.yml. kvredis is added to the image's Python without touching what vLLM runs on.
ARG VLLM_VERSION=v0.34.0
FROM vllm/vllm-openai:${VLLM_VERSION}

COPY pyproject.toml README.md /opt/kvredis/
COPY kvredis /opt/kvredis/kvredis

# kvredis itself goes in with --no-deps: its torch, numpy requirements and the proxy's aiohttp and the
# metrics' prometheus-client are the image's own, and letting pip resolve them could replace the image's
# CUDA build of torch (or vLLM's pins). What the image lacks is installed next, constrained to every
# version the image already has, and the build fails if torch or vLLM changed anyway.
RUN set -eu; \
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1; \
    python3 -m pip list --format=freeze > /tmp/image-packages.txt; \
    grep -iE '^(torch|vllm)==' /tmp/image-packages.txt > /tmp/torch-vllm-before.txt; \
    python3 -m pip install --no-deps /opt/kvredis; \
    python3 -m pip install --constraint /tmp/image-packages.txt "redis[hiredis]>=5.0" "msgpack>=1.0" "xxhash>=3.0"; \
    python3 -m pip list --format=freeze | grep -iE '^(torch|vllm)==' | diff /tmp/torch-vllm-before.txt -; \
    python3 -c "import kvredis, kvredis.v0.buffer, kvredis.stack.proxy; print('kvredis', kvredis.__version__)"; \
    rm -rf /tmp/image-packages.txt /tmp/torch-vllm-before.txt /opt/kvredis/build

# The image's ENTRYPOINT is `vllm serve`; docker-compose.yml gives each service its whole command.
ENTRYPOINT []
CMD ["kvredis", "--help"]
EXPOSE 8000 9000
