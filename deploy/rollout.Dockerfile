# Rollout replicas and the evaluator on a GPU node: vLLM (CUDA build) + the agent runtime.
# Sandboxed tool calls need bubblewrap and util-linux, and the container must be allowed to create
# namespaces (run it privileged or with a seccomp/apparmor profile that permits unshare).
FROM vllm/vllm-openai:latest
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap util-linux && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spopp ./spopp
COPY runtime ./runtime
COPY services ./services
COPY tools ./tools
# vllm comes with the base image; install the rest without replacing its torch.
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir 'transformers>=4.51' tokenizers safetensors \
    'math-verify==0.9.0' pyarrow fastapi 'uvicorn[standard]' prometheus-client click httpx pydantic pyyaml tensorboard
EXPOSE 8200
ENTRYPOINT ["spopp"]
CMD ["rollout", "serve"]
